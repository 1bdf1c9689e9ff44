"""Public API of elsa_vision: attention, window_attention(_packed), shifted_window_attention, patch /
unpatch / patched."""
from __future__ import annotations

import contextlib
import math
from numbers import Real
from typing import Optional, Sequence

import torch

from .dispatch import HALF, Problem, dispatch_token, select
from .kernels.reference import Geometry, qkv_views

PRECISIONS = ("auto", "ieee", "tf32x3", "fp16x3", "tf32")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@torch.compiler.assume_constant_result
def _fp32_matmul_precision() -> str:
    # a global setting: constant for a compiled graph (dynamo cannot trace the getter itself)
    return torch.get_float32_matmul_precision()


def resolve_precision(precision: str, dtype: torch.dtype) -> str:
    """The float32 matmul mode a call runs in.

    ``"auto"`` follows PyTorch: ``torch.get_float32_matmul_precision() == "highest"`` → ``"fp16x3"``
    (float32-class accuracy on tensor cores from float16 hi/lo parts, forward and backward),
    otherwise ``"tf32"``. Half-precision inputs always use
    their own tensor-core dot with float32 accumulation (``"native"``), whatever ``precision`` says.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if dtype in HALF:
        return "native"
    if precision == "auto":
        return "fp16x3" if _fp32_matmul_precision() == "highest" else "tf32"
    return precision


def _autocast(*ts):
    """SDPA's autocast rule: inside CUDA/CPU autocast, floating inputs run in the autocast dtype."""
    t0 = ts[0]
    if not all(t is None or isinstance(t, torch.Tensor) for t in ts):
        return ts  # the input checks that follow explain what is wrong
    dev = t0.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        # only floating tensors: a bool keep-mask stays one, other dtypes meet the checks below
        return tuple(t if t is None or not t.is_floating_point() else t.to(dt) for t in ts)
    return ts


def _check_qkv(q, k, v, fn: str):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D [batch, heads, tokens, head_dim], got shape {tuple(t.shape)}; "
                             "reshape e.g. x.view(B, N, H, D).transpose(1, 2)")
    _check_same_kind(q, k, v, fn)
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"{fn}: batch and head dims differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
                         "repeat k/v heads to match q (grouped-query attention is not supported)")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{fn}: k has {k.shape[2]} tokens but v has {v.shape[2]}; they must match")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"{fn}: head dims differ (q {q.shape[3]}, k {k.shape[3]}, v {v.shape[3]}); they must be equal")
    _check_head_dim(q.shape[3], fn)


def _check_same_kind(q, k, v, fn: str):
    """q, k, v share one floating dtype and one device."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
                        "cast them to one dtype (or run under torch.autocast)")
    if q.dtype not in _FLOATS:
        raise TypeError(f"{fn}: dtype {q.dtype} is not supported; use float32, float16 or bfloat16 "
                        "(float64 on the reference backend)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v are on different devices ({q.device}, {k.device}, {v.device}); move them to one")


def _check_head_dim(d: int, fn: str):
    if d > 256:
        raise ValueError(f"{fn}: head dim {d} > 256 is not supported; split the heads")
    if d == 0:
        raise ValueError(f"{fn}: head dim is 0; q, k, v need at least one feature per head")


def _check_scale(scale, d: int, fn: str) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, torch.Tensor):
        raise TypeError(f"{fn}: scale must be a Python number, not a tensor; pass float(scale) (or fold it into q)")
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"{fn}: scale must be a Python number, got {type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"{fn}: scale must be a finite number, got {scale!r}")
    return value


def _check_flag(x, name: str, fn: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{fn}: {name} must be True or False, got {x!r}")
    return x


def _check_tensor_arg(t, name: str, q, fn: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.device != q.device:
        raise ValueError(f"{fn}: {name} is on {t.device} but q is on {q.device}; move it with {name}.to(q.device)")


def _additive(t, name: str, q, fn: str, what: str = "additive"):
    """A float tensor as is; a bool keep-mask (SDPA's convention: True = attend) as 0 / −inf."""
    if t.dtype == torch.bool:
        fdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        return torch.zeros(t.shape, dtype=fdt, device=q.device).masked_fill_(~t, float("-inf"))
    if not t.is_floating_point():
        raise TypeError(f"{fn}: {name} dtype {t.dtype} must be floating point ({what}) or bool (keep-mask, True = attend)")
    return t


def _bias4(bias, B, H, Nq, Nk, q, fn: str):
    """Validate an additive bias (or boolean keep-mask) and view it as 4-D with size-1 broadcast dims."""
    if bias is None:
        return None
    _check_tensor_arg(bias, "bias", q, fn)
    if bias.dim() > 4:
        raise ValueError(f"{fn}: bias has {bias.dim()} dims; it must broadcast to [B, H, Nq, Nk] = {[B, H, Nq, Nk]}")
    full = (B, H, Nq, Nk)
    shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    for i, (s, f) in enumerate(zip(shape, full)):
        if s not in (1, f):
            raise ValueError(f"{fn}: bias shape {tuple(bias.shape)} does not broadcast to [B, H, Nq, Nk] = {list(full)} "
                             f"(dim {i - 4} is {s}, expected 1 or {f})")
    bias = _additive(bias, "bias", q, fn)
    return bias.reshape(shape) if bias.dim() < 4 else bias


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = False,
    precision: str = "auto",
    backend: str = "auto",
    partitions: Optional[int] = None,
    return_lse: bool = False,
):
    """Exact softmax attention, ``softmax(q kᵀ · scale + bias) v``, by the ELSA monoid scan.

    Args:
        q: [B, H, Nq, D]; k, v: [B, H, Nk, D] (Nq may differ from Nk). float32, float16 or bfloat16
            (float64 on the reference backend). Any strides.
        bias: additive, broadcastable to [B, H, Nq, Nk] (e.g. [Nq, Nk], [H, Nq, Nk], [B, 1, Nq, Nk],
            [B, 1, 1, Nk]); read through strides, never expanded. A bool tensor is a keep-mask
            (True = attend), as in SDPA. Gets a gradient when it requires one.
        scale: logit scale, default 1/√D.
        causal: query i sees key j iff j ≤ i + Nk − Nq (aligned bottom-right)::

              Nq = 3, Nk = 5   keys →
                  q0   ■ ■ ■ · ·
                  q1   ■ ■ ■ ■ ·
                  q2   ■ ■ ■ ■ ■

            Rows that see no key (Nq > Nk, or a bias of −inf everywhere) return 0.
        precision: float32 only — ``"ieee"`` (strict FMA), ``"tf32x3"`` (3xTF32, float32-class
            accuracy on tensor cores), ``"fp16x3"`` (the same accuracy from float16 hi/lo parts of
            power-of-two-scaled operands, on float16 MMAs, forward and backward),
            ``"tf32"`` (fast), ``"auto"`` (PyTorch's matmul precision).
        backend: ``"triton"``, ``"reference"`` or ``"auto"`` (first that fits; see dispatch.BACKENDS).
        partitions: force the number of key partitions of phase 1 (testing / structure proofs).
        return_lse: also return the rows' natural-log log-sum-exp [B, H, Nq] (float32, +inf for
            rows that see no key); it carries no gradient.

    Returns:
        [B, H, Nq, D] in the inputs' dtype (and the lse with ``return_lse``).

    Under ``torch.autocast`` the inputs are cast to the autocast dtype, as SDPA does.
    """
    key, kept = _kept_call("attention", (q, k, v, bias), (scale, causal, precision, backend, partitions, return_lse))
    if kept is not None:
        run, sc, prec = kept
        out, lse = run(q, k, v, bias, sc, causal, prec, partitions, return_lse)
        return (out, lse.detach()) if return_lse else out
    q0, bias0 = q, bias
    q, k, v, bias = _autocast(q, k, v, bias)
    _check_qkv(q, k, v, "attention")
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    scale = _check_scale(scale, D, "attention")
    bias = _bias4(bias, B, H, Nq, Nk, q, "attention")
    causal = _check_flag(causal, "causal", "attention")
    if partitions is not None and (not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1):
        raise ValueError(f"attention: partitions must be a positive int or None, got {partitions!r}")
    prec = resolve_precision(precision, q.dtype)
    p = Problem(op="attention", device=q.device.type, dtype=q.dtype, head_dim=D, causal=causal,
                has_bias=bias is not None, precision=prec, positive_scale=scale > 0)
    run = select(p, backend).run["attention"]  # before the shortcut below: an unfit call raises either way
    if Nk == 0 or Nq == 0:
        # no key: every row is fully masked and returns 0 (keeps the graph connected for autograd)
        # (empty sums keep the result connected to the inputs for autograd)
        empty = q[..., :0].sum() + k[..., :0].sum() + v[..., :0].sum()
        out = torch.zeros(B, H, Nq, D, dtype=q.dtype, device=q.device) + empty
        lse = torch.full((B, H, Nq), float("inf"), device=q.device)
        return (out, lse) if return_lse else out
    if q is q0 and bias is bias0:  # no autocast cast, no bool → additive or broadcast view to redo
        _keep(key, (run, scale, prec))
    out, lse = run(q, k, v, bias, scale, causal, prec, partitions, return_lse)
    return (out, lse.detach()) if return_lse else out


WINDOW_BLOCKS = ("auto", 64, 128, 256)


def _window_bias(bias, H: int, N: int, q, fn: str):
    """Validate a window bias shared by all windows; returns an [H, N, N] view (or None)."""
    if bias is None:
        return None
    _check_tensor_arg(bias, "bias", q, fn)
    shape = tuple(bias.shape)
    lead = shape[:-2] if len(shape) >= 2 else ()
    ok = (2 <= len(shape) <= 4 and shape[-2:] == (N, N) and all(s == 1 for s in lead[:-1])
          and (not lead or lead[-1] in (1, H)))
    if not ok:
        raise ValueError(f"{fn}: bias must be [H, N, N] = [{H}, {N}, {N}] (or [1, H, N, N], [N, N]) and is "
                         f"shared by every window, got {shape}; a per-window term belongs in mask [nW, N, N]")
    bias = _additive(bias, "bias", q, fn)
    # a head-broadcast bias is read with stride 0 (autograd sums its gradient over heads)
    return bias.reshape(shape[-3:] if len(shape) >= 3 else (1, N, N)).expand(H, N, N)


def _window_mask(mask, BW: int, N: int, q, fn: str):
    """Validate a per-window mask [nW, N, N]; returns it as an additive float tensor (or None)."""
    if mask is None:
        return None
    _check_tensor_arg(mask, "mask", q, fn)
    if mask.dim() != 3 or tuple(mask.shape[1:]) != (N, N) or mask.shape[0] < 1:
        raise ValueError(f"{fn}: mask must be [nW, N, N] with N = {N} (one [N, N] slice per window position), "
                         f"got {tuple(mask.shape)}; for a single mask shared by all windows use mask[None]")
    nW = mask.shape[0]
    if BW % nW:
        raise ValueError(f"{fn}: q has {BW} windows (dim 0 = batch · nW), which is not a multiple of the mask's "
                         f"nW = {nW}; windows must be ordered batch-major (row r uses mask[r % nW])")
    if mask.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{fn}: the mask takes no gradient; pass mask.detach(), or put a learned term in bias")
    return _additive(mask, "mask", q, fn, "additive, e.g. 0 / -100 / -inf")


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    block="auto",
    precision: str = "auto",
    backend: str = "auto",
) -> torch.Tensor:
    """Exact attention inside windows (Swin): ``softmax(q kᵀ · scale + bias + mask[window]) v``.

    Args:
        q, k, v: [B·nW, H, N, D] — one row per window, windows ordered batch-major: row r is window
            position r mod nW of image r // nW (what Swin's window partition produces). N ≤ 256 on the
            Triton backend (7×7 = 49, 8×8 = 64, 12×12 = 144, 16×16 = 256, or any other count);
            D 16…128. float32, float16 or bfloat16 (float64 on the reference backend).
        bias: [H, N, N] (or [1, H, N, N]; [N, N] for one bias over all heads), shared by every window
            — Swin's relative-position bias. Additive; a bool tensor is a keep-mask. Gets a gradient
            (summed over all windows) when it requires one.
        mask: [nW, N, N], read by window id (row r uses mask[r mod nW]) — Swin's shifted-window mask.
            Additive (timm's 0 / −100, or −inf), or bool (True = attend). Takes no gradient.
            Rows that see no key (all −inf) return 0.
        scale: logit scale, default 1/√D.
        block: key tile, 64, 128 or 256, or ``"auto"``. A window of N ≤ block tokens is one tile
            (single-pass softmax); a larger one is folded over ⌈N / block⌉ tiles. See
            ``elsa_vision.kernels.window`` for the speed/memory trade-off. Ignored by the reference
            backend.
        precision: float32 only — ``"ieee"``, ``"tf32x3"``, ``"fp16x3"``, ``"tf32"``, ``"auto"`` (as in
            attention(); the window kernels take each window's own power-of-two scales for ``"fp16x3"``).
        backend: ``"triton"``, ``"reference"`` or ``"auto"``.

    Returns:
        [B·nW, H, N, D] in the inputs' dtype. On the Triton backend its memory layout is
        [B·nW, N, H, D], so ``out.transpose(1, 2).reshape(B·nW, N, H·D)`` costs no copy.

    The [B·nW, H, N, N] tensor of bias + mask that timm builds is never materialised, in the forward
    or the backward. Under ``torch.autocast`` q, k, v are cast to the autocast dtype, as SDPA does; the
    bias keeps its own (the kernels read it as float32), and so does its gradient.
    """
    key, kept = _kept_call("window", (q, k, v, bias, mask), (scale, block, precision, backend))
    if kept is not None:
        run, sc, prec, blk = kept
        return run(q, k, v, bias, mask, sc, prec, blk)
    return _window_attention(q, k, v, None, bias, mask, scale, block, precision, backend, "window_attention", key)


def window_attention_packed(
    qkv: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    block="auto",
    precision: str = "auto",
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`window_attention` on the packed projection: qkv [B·nW, N, 3, H, D] → [B·nW, H, N, D].

    qkv is Swin's ``qkv(x).reshape(B·nW, N, 3, H, D)``; q, k, v are ``qkv[:, :, i].transpose(1, 2)``
    and every other argument is as in :func:`window_attention`, with the same results. The
    difference is the backward: on the Triton backend the kernels write the gradient of qkv as one
    tensor, where q, k, v passed as views would get three gradients that autograd then stacks (a copy
    the size of qkv: at Swin-T's first stage as long as the attention kernels themselves).
    """
    fn = "window_attention_packed"
    key, kept = _kept_call("window_packed", (qkv, bias, mask), (scale, block, precision, backend))
    if kept is not None:
        run, sc, prec, blk = kept
        return run(None, None, None, bias, mask, sc, prec, blk, qkv=qkv)
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"{fn}: qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"{fn}: qkv must be [B·nW, N, 3, H, D], got shape {tuple(qkv.shape)}; "
                         "reshape the projection output with .reshape(B·nW, N, 3, H, D)")
    qkv0 = qkv
    (qkv,) = _autocast(qkv)
    q, k, v = qkv_views(qkv)
    return _window_attention(q, k, v, qkv, bias, mask, scale, block, precision, backend, fn,
                             key if qkv is qkv0 else None)


# A model repeats a few call signatures (one per ViT size, one per Swin stage): what the checks
# decided for a signature is kept, and a repeat goes straight to the kernels — the checks cost tens
# of microseconds of host time, as much as the kernels of a late Swin stage or a ViT-S block. The key
# holds everything the checks read (shapes, dtypes, devices, who wants a gradient, the arguments
# and their types, and the global settings that "auto" and the dispatch follow), so a call they
# would refuse never matches.
_CALLS: dict = {}
_PLAIN_ARGS = (float, int, str, bool, type(None))


def _call_key(op, tensors, args):
    """The signature of a call (None: not kept — under torch.compile, or arguments other than plain
    numbers / strings, which take the checks every time). ``args`` go in with their types: 1, 1.0
    and True hash alike, but the checks refuse a bool scale."""
    if torch.compiler.is_compiling() or any(type(a) not in _PLAIN_ARGS for a in args):
        return None
    key = [op, *args, *map(type, args), torch.is_grad_enabled(), _fp32_matmul_precision(), dispatch_token()]
    for t in tensors:
        if t is None:
            key.append(None)
        elif not isinstance(t, torch.Tensor):
            return None
        else:
            key.append((t.shape, t.dtype, t.device, t.requires_grad))
    dev = tensors[0].device.type
    key.append(dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev))
    return tuple(key)


def _kept_call(op, tensors, args):
    """(the call's key, what the checks decided for it before or None)."""
    key = _call_key(op, tensors, args)
    return key, (_CALLS.get(key) if key is not None else None)


def _keep(key, decided) -> None:
    if key is not None and len(_CALLS) < 256:
        _CALLS[key] = decided


def _keep_window_call(key, run, heads: int, bias, bias_in, mask, mask_in, scale: float, precision: str, block: int,
                      *extra) -> None:
    """Keep a checked call's decisions when a repeat can pass its tensors straight to ``run``: bias
    and mask as given (no bool → additive conversion, no broadcast view)."""
    plain = (bias is bias_in or (bias_in is not None and bias_in.dim() == 3 and bias_in.shape[0] == heads
                                 and bias_in.dtype == bias.dtype))
    if plain and mask is mask_in:
        _keep(key, (run, scale, precision, block, *extra))


def _window_attention(q, k, v, qkv, bias, mask, scale, block, precision, backend, fn: str, key=None) -> torch.Tensor:
    """Both window entry points: checks, dispatch, the call (``qkv``: the packed tensor q/k/v view).
    ``key``: the call's :func:`_call_key`, to keep what the checks decide."""
    # the bias stays in its own dtype under autocast: the kernels read it as float32 either way
    q0 = q
    q, k, v = _autocast(q, k, v)
    if q is not q0:
        key = None  # a repeat would need the cast too
    bias_in, mask_in = bias, mask
    _check_qkv(q, k, v, fn)
    BW, H, N, D = q.shape
    if k.shape[2] != N:
        raise ValueError(f"{fn}: q has {N} tokens per window but k/v have {k.shape[2]}; "
                         "window attention is self-attention inside each window")
    scale = _check_scale(scale, D, fn)
    bias = _window_bias(bias, H, N, q, fn)
    mask = _window_mask(mask, BW, N, q, fn)
    _check_block(block, fn)
    prec = resolve_precision(precision, q.dtype)
    p = Problem(op="window_attention", device=q.device.type, dtype=q.dtype, head_dim=D, has_bias=bias is not None,
                has_mask=mask is not None, window_tokens=N, precision=prec)
    run = select(p, backend).run["window_attention"]  # before the shortcut below: an unfit call raises either way
    if q.numel() == 0:
        # no window or no token: nothing to attend (empty sums keep the graph connected for autograd)
        empty = q.sum() * 0 + k.sum() * 0 + v.sum() * 0
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device) + empty
    block = 0 if block == "auto" else int(block)
    _keep_window_call(key, run, H, bias, bias_in, mask, mask_in, scale, prec, block)
    if qkv is None:
        return run(q, k, v, bias, mask, scale, prec, block)
    return run(q, k, v, bias, mask, scale, prec, block, qkv=qkv)


def _check_block(block, fn: str) -> None:
    if block not in WINDOW_BLOCKS or isinstance(block, bool):
        raise ValueError(f"{fn}: block must be one of {WINDOW_BLOCKS}, got {block!r}")


def _pair(x, name: str, fn: str) -> tuple[int, int]:
    """An int or a pair of ints as (rows, columns)."""
    def is_int(i):
        return isinstance(i, int) and not isinstance(i, bool)
    if is_int(x):
        return x, x
    if isinstance(x, (tuple, list)) and len(x) == 2 and all(map(is_int, x)):
        return int(x[0]), int(x[1])
    raise TypeError(f"{fn}: {name} must be an int or a pair of ints (rows, columns), got {x!r}")


def shifted_window_attention(
    q: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    *,
    window_size,
    shift_size=0,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    block="auto",
    precision: str = "auto",
    backend: str = "auto",
) -> torch.Tensor:
    """Swin's (shifted-)window attention on tokens laid out as images: the cyclic shift, the window
    partition, :func:`window_attention` and the inverse partition and shift in one call, with no
    copy of the tokens (the kernels read each window's tokens where they lie)::

        out = roll(merge(window_attention(partition(roll(x, −shift)), bias, mask)), +shift)

        image 4×4, window 2×2, shift 1:  the windows are those of the image rolled up-left by one
            a b c d      f g h e      window 0 = [f g; j k]   window 1 = [h e; l i]
            e f g h  →   j k l i      window 2 = [n o; b c]   window 3 = [p m; d a]
            i j k l      n o p m      (row-major over the window grid; mask[w] is window w's)
            m n o p      b c d a

    Args:
        q: [B, height, width, H, D] — or, with k and v left out, the packed projection qkv
            [B, height, width, 3, H, D] (Swin's ``qkv(x).reshape(B, height, width, 3, H, D)``: its
            gradient is then written in one piece). height and width must be multiples of the
            window's (pad the image first: timm pads after the roll, with zeros).
        k, v: [B, height, width, H, D], or None with packed q.
        window_size: int or (rows, columns); N = rows · columns ≤ 256 tokens per window on the Triton
            backend.
        shift_size: int or (rows, columns), each in [0, window): the cyclic shift (0: W-MSA blocks).
        bias: [H, N, N] shared by every window (Swin's relative-position bias), as in
            :func:`window_attention`; gets a gradient summed over all windows.
        mask: [nW, N, N] with nW = (height / rows) · (width / columns), one slice per window position
            in the order above (Swin's shifted-window mask; timm's ``attn_mask`` buffer). Additive or
            bool (True = attend). Takes no gradient.
        scale, block, precision, backend: as in :func:`window_attention`.

    Returns:
        [B, height, width, H, D] in the inputs' dtype, row-major (``out.reshape(B, height, width, H·D)``
        is free: what Swin's output projection reads).
    """
    fn = "shifted_window_attention"
    wh, ww = _pair(window_size, "window_size", fn)
    sh, sw = _pair(shift_size, "shift_size", fn)
    packed = k is None and v is None
    key, kept = _kept_call("shifted", (q, k, v, bias, mask), (scale, block, precision, backend, wh, ww, sh, sw))
    if kept is not None:
        run, sc, prec, blk, geo = kept
        *lead, H, D = q.shape
        T = geo.batch * geo.height * geo.width
        if packed:
            out = run(None, None, None, bias, mask, sc, prec, blk, qkv=q.reshape(T, 3, H, D), geo=geo)
        else:
            out = run(q.reshape(T, H, D), k.reshape(T, H, D), v.reshape(T, H, D), bias, mask, sc, prec, blk, geo=geo)
        return out.view(geo.batch, geo.height, geo.width, H, D)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{fn}: q must be a torch.Tensor, got {type(q).__name__}")
    if packed:
        if q.dim() != 6 or q.shape[3] != 3:
            raise ValueError(f"{fn}: a packed qkv must be [B, height, width, 3, H, D], got shape {tuple(q.shape)}; "
                             "pass q, k, v as [B, height, width, H, D] each, or reshape the projection output")
        q0 = q
        (qkv,) = _autocast(q)
        B, IH, IW, _, H, D = qkv.shape
        qkv = qkv.reshape(B * IH * IW, 3, H, D)
        q3, k3, v3 = qkv.unbind(1)
    else:
        if k is None or v is None:
            raise ValueError(f"{fn}: pass both k and v with q, or neither (q then being the packed qkv)")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 5:
                raise ValueError(f"{fn}: {name} must be 5-D [B, height, width, H, D], got shape {tuple(t.shape)}")
        if not (q.shape == k.shape == v.shape):
            raise ValueError(f"{fn}: q, k, v must have one shape [B, height, width, H, D], got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        q0, qkv = q, None
        q, k, v = _autocast(q, k, v)
        B, IH, IW, H, D = q.shape
        q3, k3, v3 = (t.reshape(B * IH * IW, H, D) for t in (q, k, v))
    if q is not q0 or (packed and qkv.dtype != q0.dtype):
        key = None  # a repeat would need the cast too
    _check_same_kind(q3, k3, v3, fn)
    _check_head_dim(D, fn)
    if min(wh, ww) < 1 or IH % wh or IW % ww:
        raise ValueError(f"{fn}: the {IH}×{IW} token image is not tiled by {wh}×{ww} windows; pad it to a multiple "
                         "of the window first (timm pads the rolled image with zeros)")
    if not (0 <= sh < wh and 0 <= sw < ww):
        raise ValueError(f"{fn}: shift_size {(sh, sw)} must lie in [0, window_size) = [0, {(wh, ww)})")
    geo = Geometry(B, IH, IW, wh, ww, sh, sw)
    N = geo.tokens
    scale = _check_scale(scale, D, fn)
    bias_in, mask_in = bias, mask
    bias = _window_bias(bias, H, N, q3, fn)
    if isinstance(mask, torch.Tensor) and mask.dim() == 3 and mask.shape[0] != geo.nW:
        raise ValueError(f"{fn}: mask has {mask.shape[0]} window slices but a {IH}×{IW} image has {geo.nW} windows "
                         f"of {wh}×{ww}; pass one [N, N] slice per window position")
    mask = _window_mask(mask, geo.windows, N, q3, fn)
    _check_block(block, fn)
    prec = resolve_precision(precision, q3.dtype)
    p = Problem(op=fn, device=q3.device.type, dtype=q3.dtype, head_dim=D, has_bias=bias is not None,
                has_mask=mask is not None, window_tokens=N, precision=prec)
    run = select(p, backend).run[fn]  # before the shortcut below: an unfit call raises either way
    if q3.numel() == 0:
        empty = q3.sum() * 0 + k3.sum() * 0 + v3.sum() * 0
        return torch.zeros((B, IH, IW, H, D), dtype=q3.dtype, device=q3.device) + empty
    block = 0 if block == "auto" else int(block)
    _keep_window_call(key, run, H, bias, bias_in, mask, mask_in, scale, prec, block, geo)
    out = run(q3, k3, v3, bias, mask, scale, prec, block, qkv=qkv, geo=geo)
    return out.reshape(B, IH, IW, H, D)


def patch(model: torch.nn.Module, *, precision: str = "auto", token_merging=None,
          include: Optional[Sequence[str]] = None, exclude: Optional[Sequence[str]] = None, **options):
    """Route every supported attention module of ``model`` through ELSA; returns a PatchReport.

    See :func:`elsa_vision.adapters.registry.patch`."""
    from .adapters import registry
    return registry.patch(model, precision=precision, token_merging=token_merging, include=include,
                          exclude=exclude, **options)


def unpatch(model: torch.nn.Module) -> int:
    """Restore the original forwards; returns how many modules were restored."""
    from .adapters import registry
    return registry.unpatch(model)


@contextlib.contextmanager
def patched(model: torch.nn.Module, **kwargs):
    """``with patched(model): ...`` — patch for the duration of the block."""
    report = patch(model, **kwargs)
    try:
        yield report
    finally:
        unpatch(model)
