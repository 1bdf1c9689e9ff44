"""Input checks of the public functions: each raises TypeError / ValueError with what is wrong and
how to fix it, and returns the input in the form the kernels take (bool masks as additive tensors,
biases as 4-D broadcast views). ``fn`` is the public function's name, for the messages."""
from __future__ import annotations

import math
from numbers import Real

import torch

from .dispatch import autocast_dtype
from .kernels.limits import WINDOW_BLOCKS

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def autocast(*ts):
    """SDPA's autocast rule: inside CUDA/CPU autocast, floating inputs other than float64 run in the
    autocast dtype (autocast leaves float64 tensors as they are)."""
    if not isinstance(ts[0], torch.Tensor) or not all(t is None or isinstance(t, torch.Tensor) for t in ts):
        return ts  # the input checks that follow explain what is wrong
    dt = autocast_dtype(ts[0].device.type)
    if dt is None:
        return ts
    # only floating tensors: a bool keep-mask stays one, other dtypes meet the checks below
    return tuple(t if t is None or not t.is_floating_point() or t.dtype == torch.float64 else t.to(dt) for t in ts)


def check_dense(t: torch.Tensor, name: str, fn: str) -> None:
    """A strided tensor: a sparse layout or a nested tensor has no strides for the kernels to read."""
    if t.is_nested or t.layout is not torch.strided:
        kind = "a nested tensor" if t.is_nested else f"a {t.layout} tensor"
        how = f"{name}.to_padded_tensor(0.0) (with a mask for the padding)" if t.is_nested else f"{name}.to_dense()"
        raise TypeError(f"{fn}: {name} is {kind}; attention takes dense (strided) tensors: pass {how}")


def check_qkv(q, k, v, fn: str):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        check_dense(t, name, fn)
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D [batch, heads, tokens, head_dim], got shape {tuple(t.shape)}; "
                             "reshape e.g. x.view(B, N, H, D).transpose(1, 2)")
    check_same_kind(q, k, v, fn)
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"{fn}: batch and head dims differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
                         "repeat k/v heads to match q (grouped-query attention is not supported)")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{fn}: k has {k.shape[2]} tokens but v has {v.shape[2]}; they must match")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"{fn}: head dims differ (q {q.shape[3]}, k {k.shape[3]}, v {v.shape[3]}); they must be equal")
    check_head_dim(q.shape[3], fn)


def check_same_kind(q, k, v, fn: str):
    """q, k, v share one floating dtype and one device."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
                        "cast them to one dtype (or run under torch.autocast)")
    if q.dtype not in FLOATS:
        raise TypeError(f"{fn}: dtype {q.dtype} is not supported; use float32, float16 or bfloat16 "
                        "(float64 on the reference backend)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v are on different devices ({q.device}, {k.device}, {v.device}); move them to one")


def check_head_dim(d: int, fn: str):
    # (the largest head dim is each backend's to declare: see dispatch.BACKENDS)
    if d == 0:
        raise ValueError(f"{fn}: head dim is 0; q, k, v need at least one feature per head")


def check_scale(scale, d: int, fn: str) -> float:
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
    if torch.compiler.is_compiling():
        # torch.compile(dynamic=True) traces a module's float attribute (its ``scale``) as a symbol
        # whose value is unknown while tracing: math.isfinite would break the graph, and a
        # torch._check of it breaks it too. Not tested here, as an eager call tests it.
        return value
    if not math.isfinite(value):
        raise ValueError(f"{fn}: scale must be a finite number, got {scale!r}")
    return value


def check_flag(x, name: str, fn: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{fn}: {name} must be True or False, got {x!r}")
    return x


def check_tensor_arg(t, name: str, q, fn: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
    check_dense(t, name, fn)
    if t.device != q.device:
        raise ValueError(f"{fn}: {name} is on {t.device} but q is on {q.device}; move it with {name}.to(q.device)")


def additive(t, name: str, q, fn: str, what: str = "additive"):
    """A float tensor as is; a bool keep-mask (SDPA's convention: True = attend) as 0 / −inf."""
    if t.dtype == torch.bool:
        fdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        return torch.zeros(t.shape, dtype=fdt, device=q.device).masked_fill_(~t, float("-inf"))
    if not t.is_floating_point():
        raise TypeError(f"{fn}: {name} dtype {t.dtype} must be floating point ({what}) or bool (keep-mask, True = attend)")
    return t


def bias4(bias, B, H, Nq, Nk, q, fn: str):
    """Validate an additive bias (or boolean keep-mask) and view it as 4-D with size-1 broadcast dims."""
    if bias is None:
        return None
    check_tensor_arg(bias, "bias", q, fn)
    if bias.dim() > 4:
        raise ValueError(f"{fn}: bias has {bias.dim()} dims; it must broadcast to [B, H, Nq, Nk] = {[B, H, Nq, Nk]}")
    full = (B, H, Nq, Nk)
    shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    for i, (s, f) in enumerate(zip(shape, full)):
        if s not in (1, f):
            raise ValueError(f"{fn}: bias shape {tuple(bias.shape)} does not broadcast to [B, H, Nq, Nk] = {list(full)} "
                             f"(dim {i - 4} is {s}, expected 1 or {f})")
    bias = additive(bias, "bias", q, fn)
    return bias.reshape(shape) if bias.dim() < 4 else bias


def window_bias(bias, H: int, N: int, q, fn: str):
    """Validate a window bias shared by all windows; returns an [H, N, N] view (or None)."""
    if bias is None:
        return None
    check_tensor_arg(bias, "bias", q, fn)
    shape = tuple(bias.shape)
    lead = shape[:-2] if len(shape) >= 2 else ()
    ok = (2 <= len(shape) <= 4 and shape[-2:] == (N, N) and all(s == 1 for s in lead[:-1])
          and (len(lead) == 0 or lead[-1] in (1, H)))  # (len: dynamo traces no truth test of a tuple of SymInts)
    if not ok:
        raise ValueError(f"{fn}: bias must be [H, N, N] = [{H}, {N}, {N}] (or [1, H, N, N], [N, N]) and is "
                         f"shared by every window, got {shape}; a per-window term belongs in mask [nW, N, N]")
    bias = additive(bias, "bias", q, fn)
    # a head-broadcast bias is read with stride 0 (autograd sums its gradient over heads)
    return bias.reshape(shape[-3:] if len(shape) >= 3 else (1, N, N)).expand(H, N, N)


def window_mask(mask, BW: int, N: int, q, fn: str):
    """Validate a per-window mask [nW, N, N]; returns it as an additive float tensor (or None)."""
    if mask is None:
        return None
    check_tensor_arg(mask, "mask", q, fn)
    if mask.dim() != 3 or tuple(mask.shape[1:]) != (N, N) or mask.shape[0] < 1:
        raise ValueError(f"{fn}: mask must be [nW, N, N] with N = {N} (one [N, N] slice per window position), "
                         f"got {tuple(mask.shape)}; for a single mask shared by all windows use mask[None]")
    nW = mask.shape[0]
    if BW % nW:
        raise ValueError(f"{fn}: q has {BW} windows (dim 0 = batch · nW), which is not a multiple of the mask's "
                         f"nW = {nW}; windows must be ordered batch-major (row r uses mask[r % nW])")
    if mask.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{fn}: the mask takes no gradient; pass mask.detach(), or put a learned term in bias")
    return additive(mask, "mask", q, fn, "additive, e.g. 0 / -100 / -inf")


def check_block(block, fn: str) -> int:
    """The window key tile asked for: 0 for ``"auto"``."""
    if block == "auto":
        return 0
    if block not in WINDOW_BLOCKS or isinstance(block, bool):
        raise ValueError(f"{fn}: block must be one of {('auto', *WINDOW_BLOCKS)}, got {block!r}")
    return int(block)


def pair(x, name: str, fn: str) -> tuple[int, int]:
    """An int or a pair of ints as (rows, columns)."""
    def is_int(i):
        return isinstance(i, int) and not isinstance(i, bool)
    if is_int(x):
        return x, x
    if isinstance(x, (tuple, list)) and len(x) == 2 and all(map(is_int, x)):
        return int(x[0]), int(x[1])
    raise TypeError(f"{fn}: {name} must be an int or a pair of ints (rows, columns), got {x!r}")
