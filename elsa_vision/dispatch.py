"""The one dispatch point: every backend declares what it supports and explains what it does not.

A backend is picked for a :class:`Problem` (shapes, dtype, device, options — no tensors). ``"auto"``
takes the first backend in :data:`BACKENDS` order that fits; naming a backend that does not fit, or
no backend fitting, raises :class:`NotSupportedError` listing every backend's reasons.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch

from .kernels import limits

HALF = (torch.float16, torch.bfloat16)
WINDOW_OPS = ("window_attention", "shifted_window_attention")


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast casts to on this device type now, or None outside autocast (CUDA and CPU
    autocast only, the two SDPA follows)."""
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class NotSupportedError(ValueError):
    """No backend can run this problem; the message lists each backend's reasons."""


class Problem(NamedTuple):
    """What a backend needs to know to accept or refuse a call. (A NamedTuple: built on every
    call, in half a frozen dataclass's time, and hashable for :func:`select`'s memo.)"""
    op: str                      # "attention", "window_attention" or "shifted_window_attention"
    device: str                  # torch device type
    dtype: torch.dtype
    head_dim: int
    causal: bool = False
    has_bias: bool = False
    has_mask: bool = False
    window_tokens: int = 0       # N per window (the window ops only)
    precision: str = "auto"
    positive_scale: bool = True
    same_lengths: bool = True    # Nq == Nk (attention)
    keys: int = 0                # Nk (attention): what a backend's ``auto_when`` may weigh


@dataclass
class Backend:
    """Capabilities of one backend, as data (xFormers-style), plus the functions that run it."""
    name: str
    ops: tuple[str, ...]
    devices: "tuple[str, ...] | Callable[[], tuple[str, ...]]"
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, int]
    supports_causal: bool
    supports_bias: bool
    max_window_tokens: int = 0
    needs_positive_scale: bool = False
    op_head_dims: dict = field(default_factory=dict)  # op name → (lo, hi) where it differs from head_dims
    available: Callable[[], Optional[str]] = lambda: None  # None when usable, else why not
    devices_note: str = ""
    run: dict = field(default_factory=dict)  # op name → callable
    requires_causal: bool = False      # refuses non-causal calls
    requires_same_lengths: bool = False  # refuses Nq ≠ Nk
    # whether ``"auto"`` takes it for a problem it supports (a backend that is exact everywhere but
    # faster only somewhere); naming the backend takes it whenever it supports the problem
    auto_when: Callable[["Problem"], bool] = lambda p: True

    def not_supported_reasons(self, p: Problem, anywhere: bool = False) -> list[str]:
        """Why this backend cannot run ``p`` ([] when it can). ``anywhere``: only what no device or
        dtype would change (availability, p.device and p.dtype are not looked at)."""
        reasons = []
        why = None if anywhere else self.available()
        if why:
            return [why]
        if p.op not in self.ops:
            reasons.append(f"does not implement {p.op}")
        if not anywhere:
            devices = self.devices() if callable(self.devices) else self.devices
            if p.device not in devices:
                reasons.append(f"device '{p.device}' not supported (supports {', '.join(devices)}{self.devices_note})")
            if p.dtype not in self.dtypes:
                reasons.append(f"dtype {p.dtype} not supported (supports {', '.join(str(d) for d in self.dtypes)})")
        lo, hi = self.op_head_dims.get(p.op, self.head_dims)
        if not lo <= p.head_dim <= hi:
            reasons.append(f"head dim {p.head_dim} outside [{lo}, {hi}]")
        if p.causal and not self.supports_causal:
            reasons.append("causal masking not supported")
        if self.requires_causal and not p.causal:
            reasons.append("runs causal attention only (causal=True)")
        if self.requires_same_lengths and not p.same_lengths:
            reasons.append("needs as many queries as keys (Nq == Nk)")
        if self.needs_positive_scale and not p.positive_scale:
            reasons.append("scale must be > 0 (the scan folds the scale into its running max)")
        if p.has_bias and not self.supports_bias:
            reasons.append("additive bias not supported")
        if p.op in WINDOW_OPS and p.window_tokens > self.max_window_tokens:
            reasons.append(f"window of {p.window_tokens} tokens exceeds {self.max_window_tokens}")
        return reasons


def _triton_available() -> Optional[str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install triton; Linux only)"
    return None


class BackendFallbackWarning(UserWarning):
    """``backend="auto"`` passed over a backend that serves the call's device but is not usable here
    (e.g. Triton not installed): the call runs on a slower backend. Also: the Triton backend's
    Hopper kernels cannot run on an sm_90 GPU with the installed Triton (a version they were not
    checked against), so its portable kernels serve the call."""


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_devices() -> tuple[str, ...]:
    # The interpreter runs the same kernels with numpy on CPU tensors.
    return ("cuda", "cpu") if _interpret() else ("cuda",)


# Entry points take (q, k, v, bias4, scale, causal, precision, partitions) and return (out, lse):
# out [B,H,Nq,D]; lse [B,H,Nq] float32 natural-log log-sum-exp (+inf for rows that see no key), or
# None unless the argument want_lse is true. qkv: the packed [B,N,3,H,D] tensor q, k, v are views
# of (elsa_vision.attention_packed), or None; a backend whose gradients flow through the views by
# autograd takes the views. q, k, v may be None when qkv is given (a repeated packed call skips
# making views that the Triton backend's eager path does not read).

_KERNELS: dict = {}  # the kernel modules, imported at their first call (they import Triton)


def _kernels(name: str):
    """elsa_vision.kernels.<name>, name "attention" or "window" (an import statement per eager call
    would cost host time)."""
    if torch.compiler.is_compiling():  # (the dict's contents would be guarded on: a recompile once filled)
        return _import_kernels(name)
    mod = _KERNELS.get(name)
    if mod is None:
        mod = _KERNELS[name] = _import_kernels(name)
    return mod


def _import_kernels(name: str):
    # Import statements, not importlib.import_module: torch.compile traces the former and breaks the
    # graph at the latter, where a compiled call is the process's first.
    if name == "attention":
        from .kernels import attention as mod
    else:
        from .kernels import window as mod  # (registers the window custom ops)
    return mod


def _views(q, k, v, qkv, geo=None) -> tuple:
    """(q, k, v) for a runner that reads the views: as given, or qkv's views where q is None."""
    if q is not None:
        return q, k, v
    from .kernels import reference
    return reference.qkv_views(qkv, geo)


def _run_triton_attention(q, k, v, bias, scale, causal, precision, partitions, want_lse=False, qkv=None):
    K = _kernels("attention")
    out, lse = K.attention(q, k, v, bias, scale, causal, precision, partitions, qkv)
    if not want_lse:
        return out, None
    # a NaN among a row's logits leaves the kernels' statistics as a row that sees no key (+inf),
    # and every feature of its output NaN (a row that sees no key has zeros): its lse is NaN, as the
    # reference backend's and torch.logsumexp's are. (One feature read: [B, H, Nq] temporaries.)
    lse = K.natural_lse(lse, bias is not None)
    return out, lse.masked_fill_((lse == float("inf")) & out[..., 0].isnan(), float("nan"))


# Backward entry points ("attention_backward") take (q, k, v, out, lse, do, scale, causal, precision)
# and return (dq, dk, dv): the gradient terms of these keys for rows whose output and natural-log
# lse [B,H,Nq] may span more keys (a key shard; elsa_vision.distributed's ring backward). No bias.

def _run_triton_attention_backward(q, k, v, out, lse, do, scale, causal, precision):
    K = _kernels("attention")
    dq, dk, dv, _ = K.backward(do, q, k, v, None, out, K.stats_from_lse(lse), scale, causal, precision, False)
    return dq, dk, dv


def _run_reference_attention_backward(q, k, v, out, lse, do, scale, causal, precision):
    from .kernels import reference
    return reference.attention_backward(q, k, v, out, lse, do, scale, causal)


def _run_eca_attention(q, k, v, bias, scale, causal, precision, partitions, want_lse=False, qkv=None):
    from .kernels import eca
    out, lse = eca.attention(*_views(q, k, v, qkv), scale)
    return out, (lse if want_lse else None)


def _eca_auto(p: "Problem") -> bool:
    from .kernels import eca
    return eca.faster_than_reference(p.keys, p.head_dim)


def _run_reference_attention(q, k, v, bias, scale, causal, precision, partitions, want_lse=False, qkv=None):
    from .kernels import reference
    q, k, v = _views(q, k, v, qkv)
    if not want_lse:
        return reference.attention(q, k, v, bias, scale, causal), None
    return reference.attention(q, k, v, bias, scale, causal, return_lse=True)


# Window entry points take (q, k, v, bias3, mask3, scale, precision, block, qkv=, geo=) and return out
# [BW,H,N,D]: bias3 [H,N,N] or None, mask3 [nW,N,N] additive float or None, block 0 = auto; qkv the
# packed [BW,N,3,H,D] tensor q, k, v are views of, or None (q, k, v may be None when qkv is given).
# shifted_window_attention passes geo (a kernels.reference.Geometry): q, k, v are then image rows
# [T,H,D] (qkv [T,3,H,D]) and so is the output.

def _run_triton_window(q, k, v, bias, mask, scale, precision, block, qkv=None, geo=None):
    return _kernels("window").window_attention(q, k, v, bias, mask, scale, precision, block, qkv=qkv, geo=geo)


def _run_reference_window(q, k, v, bias, mask, scale, precision, block, qkv=None, geo=None):
    # autograd carries the gradients of the q, k, v views back to qkv
    from .kernels import reference
    q, k, v = _views(q, k, v, qkv, geo)
    if geo is None:
        return reference.window_attention(q, k, v, bias, mask, scale)
    q, k, v = (reference.to_windows(t, geo).transpose(1, 2) for t in (q, k, v))
    out = reference.window_attention(q, k, v, bias, mask, scale)
    return reference.from_windows(out.transpose(1, 2), geo)


TRITON = Backend(
    name="triton",
    ops=("attention", *WINDOW_OPS),
    devices=_triton_devices,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    head_dims=limits.HEAD_DIMS,
    op_head_dims={op: limits.WINDOW_HEAD_DIMS for op in WINDOW_OPS},
    max_window_tokens=limits.MAX_WINDOW_TOKENS,
    supports_causal=True,
    supports_bias=True,
    needs_positive_scale=True,
    available=_triton_available,
    devices_note="; CPU tensors only under TRITON_INTERPRET=1",
    run={"attention": _run_triton_attention, "attention_backward": _run_triton_attention_backward,
         **{op: _run_triton_window for op in WINDOW_OPS}},
)

REFERENCE = Backend(
    name="reference",
    ops=("attention", *WINDOW_OPS),
    devices=("cuda", "cpu", "mps", "xpu", "meta"),  # (meta: shapes only, e.g. a model built on the meta device)
    dtypes=(torch.float64, torch.float32, torch.float16, torch.bfloat16),
    head_dims=(1, 1 << 16),
    max_window_tokens=1 << 16,
    supports_causal=True,
    supports_bias=True,
    run={"attention": _run_reference_attention, "attention_backward": _run_reference_attention_backward,
         **{op: _run_reference_window for op in WINDOW_OPS}},
)

ECA = Backend(
    name="eca",
    ops=("attention",),
    devices=("cpu",),
    dtypes=(torch.float64, torch.float32, torch.bfloat16),
    head_dims=(1, 1 << 16),
    supports_causal=True,
    supports_bias=False,
    requires_causal=True,
    requires_same_lengths=True,
    auto_when=_eca_auto,
    devices_note=" (an O(L²)-memory CPU backend: S and P are materialised)",
    run={"attention": _run_eca_attention},
)

BACKENDS: list[Backend] = [TRITON, ECA, REFERENCE]


def triton_serves(device_type: str) -> bool:
    """Whether the Triton kernels can run on tensors of this device type here (Triton installed, and
    CUDA, or the CPU under TRITON_INTERPRET=1): for callers that launch a kernel family directly."""
    return TRITON.available() is None and device_type in TRITON.devices()


def fused_kernels(backend: str, device_type: str) -> bool:
    """Whether an adapter may launch its fused kernel families (norms, RoPE, merging) directly for a
    model patched with ``backend``: under "auto" or "triton" where the Triton kernels serve the
    device; a model patched for another backend (e.g. "reference") launches none."""
    return backend in ("auto", "triton") and triton_serves(device_type)


def named_backend_refusal(backend: str, op: str, head_dim: int, causal: bool = False,
                          has_bias: bool = False) -> Optional[str]:
    """Why the named ``backend`` can never run ``op`` calls of this head dim (causal or not, with a
    bias or not), whatever their device and dtype: what patch() can tell a module before any call.
    None for "auto", or where some device and dtype would do."""
    if backend == "auto":
        return None
    check_backend_name(backend)
    b = next(b for b in BACKENDS if b.name == backend)
    p = Problem(op=op, device="", dtype=torch.float32, head_dim=head_dim, causal=causal, has_bias=has_bias)
    reasons = b.not_supported_reasons(p, anywhere=True)
    if not reasons:
        return None
    return f"backend={backend!r} cannot run its calls ({op}: {'; '.join(reasons)}); patch with backend='auto' or another"


def check_backend_name(backend) -> None:
    """ValueError unless ``backend`` is "auto" or the name of one of BACKENDS."""
    names = ["auto", *(b.name for b in BACKENDS)]
    if backend not in names:
        raise ValueError(f"unknown backend {backend!r}; choose one of {names}")


# (problem, backend name, interpreter on, the backends) → the Backend chosen. A call repeats the
# same few problems; deciding again costs microseconds of host time that small kernels notice.
_CHOSEN: dict = {}


def clear_memo() -> None:
    """Forget the backends chosen so far (see :func:`select`)."""
    _CHOSEN.clear()


def dispatch_token() -> tuple:
    """What, besides the problem and the backend name, decides :func:`select`'s answer."""
    return _interpret(), tuple(map(id, BACKENDS))


def select(p: Problem, backend: str = "auto") -> Backend:
    """The backend that runs ``p``: the named one, or the first that fits. Raises NotSupportedError."""
    # (not while torch.compile traces: a graph that read or filled the memo would guard on its
    # contents and be recompiled once an eager call fills it)
    memo = not torch.compiler.is_compiling()
    key = (p, backend, dispatch_token())
    chosen = _CHOSEN.get(key) if memo else None
    if chosen is not None:
        return chosen
    check_backend_name(backend)
    candidates = BACKENDS if backend == "auto" else [b for b in BACKENDS if b.name == backend]
    refusals = []
    unusable = []  # backends that serve this device but are not usable here
    for b in candidates:
        reasons = b.not_supported_reasons(p)
        if not reasons and backend == "auto" and not b.auto_when(p):
            refusals.append(f"  {b.name}: not chosen by auto here (name it to use it)")
            continue
        if not reasons and p.op in b.run:
            for name, why in unusable:
                _warn_fallback(name, why, b.name, p)
            if memo:
                _CHOSEN[key] = b
                if b is TRITON:
                    _say_hopper_off(p)
            return b
        if reasons and reasons == [b.available()] and p.device in (b.devices() if callable(b.devices) else b.devices):
            unusable.append((b.name, reasons[0]))
        refusals.append(f"  {b.name}: " + "; ".join(reasons or [f"no {p.op} entry point"]))
    what = f"{p.op} with dtype={p.dtype}, device={p.device}, head_dim={p.head_dim}, causal={p.causal}, bias={p.has_bias}"
    raise NotSupportedError(f"no backend can run {what}:\n" + "\n".join(refusals))


_WARNED: set = set()


def _warn_fallback(name: str, why: str, chosen: str, p: Problem) -> None:
    """Say once per (backend, reason, device) that ``auto`` fell back past an unusable backend."""
    if (name, why, p.device) in _WARNED:
        return
    _WARNED.add((name, why, p.device))
    warnings.warn(f"elsa_vision: the {name} backend cannot run here ({why}); {p.op} on {p.device} runs on the "
                  f"{chosen} backend instead, which is exact but slower", BackendFallbackWarning, stacklevel=4)


def _cuda_capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


def _say_hopper_off(p: Problem) -> None:
    """Say once per process when an attention call in a dtype, head dim and bias the Hopper kernels
    (kernels/hopper.py) take — half precision at their head dims, or float32 in fp16x3, no bias;
    whatever its length, which their measured policy also weighs — reaches an sm_90 GPU (the current
    device) where they are off because the installed Triton is not a version they were checked
    against (Gluon's API is experimental): the portable kernels run it, exact but slower there. Not
    when ELSA_HOPPER=0 turned them off, which asks for that. (Eager calls: the first selection of a
    problem, before :func:`select`'s memo keeps it; a graph torch.compile traces says nothing.)"""
    if p.op != "attention" or p.device != "cuda" or p.has_bias or ("hopper", "triton") in _WARNED:
        return
    from .kernels import launch
    if launch.CHECKED or not launch.hopper_requested():
        return
    if not ((p.dtype in HALF and p.head_dim in limits.HOPPER_HEAD_DIMS)
            or (p.precision == "fp16x3" and p.head_dim in limits.HOPPER_SPLIT_HEAD_DIMS)):
        return
    if _cuda_capability() != (9, 0):
        return
    _WARNED.add(("hopper", "triton"))
    import triton
    checked = " or ".join(".".join(map(str, v)) for v in launch.CHECKED_TRITON)
    warnings.warn(f"elsa_vision: the Hopper kernels cannot run here (triton {triton.__version__} is not a version "
                  f"they were checked against: {checked}); attention on this sm_90 GPU runs on the portable Triton "
                  f"kernels, which are exact but slower here, and every launch takes Triton's own launcher. "
                  f"Install the torch that brings triton {checked} for them, or set ELSA_HOPPER=0 to keep the "
                  f"portable kernels without this warning", BackendFallbackWarning, stacklevel=4)


def device_problem(device: str, backend: str = "auto") -> Optional[str]:
    """Why a command-line tool cannot run on ``device`` with ``backend`` here (None when it can):
    an unparsable device, CUDA without a GPU, an unknown backend, or one that does not serve the
    device (Triton without CUDA or its CPU interpreter)."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        return f"{device!r} is not a torch device (e.g. cuda, cuda:1, cpu)"
    if kind not in ("cuda", "cpu"):
        return f"device {device!r}: the tools run on cuda or cpu, not {kind}"
    if kind == "cuda" and not torch.cuda.is_available():
        return f"device {device!r}: no CUDA GPU here; use cpu"
    try:
        check_backend_name(backend)
    except ValueError as e:
        return str(e)
    for b in BACKENDS:
        if b.name == backend:
            why = b.available()
            devices = b.devices() if callable(b.devices) else b.devices
            if why or kind not in devices:
                return f"backend {backend!r} cannot run on {kind}: " + (why or f"it runs on {', '.join(devices)}{b.devices_note}")
    return None
