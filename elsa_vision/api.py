"""Public API of elsa_vision: attention(_packed), window_attention(_packed), shifted_window_attention, patch /
unpatch / patched."""
from __future__ import annotations

import contextlib
import sys
from typing import Optional, Sequence

import torch

from .checks import (autocast, bias4, check_block, check_dense, check_flag, check_head_dim, check_qkv, check_same_kind,
                     check_scale, pair, window_bias, window_mask)
from .dispatch import HALF, Problem, autocast_dtype, clear_memo, dispatch_token, select
from .kernels.limits import MAX_GRID_YZ, WINDOW_BLOCKS as _BLOCKS
from .kernels.reference import Geometry, qkv_views

PRECISIONS = ("auto", "ieee", "tf32x3", "fp16x3", "tf32")
WINDOW_BLOCKS = ("auto", *_BLOCKS)


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
        backend: ``"triton"``, ``"reference"``, ``"eca"`` (causal, Nq = Nk, no bias; the CPU) or
            ``"auto"`` (first that fits; see dispatch.BACKENDS).
        partitions: force the number of key partitions of phase 1 (testing / structure proofs).
        return_lse: also return the rows' natural-log log-sum-exp [B, H, Nq] (float32, +inf for
            rows that see no key, NaN for rows whose output is NaN); it carries no gradient.

    Returns:
        [B, H, Nq, D] in the inputs' dtype (and the lse with ``return_lse``).

    Under ``torch.autocast`` the inputs are cast to the autocast dtype, as SDPA does. A call with
    more than 65535 batch·heads (CUDA's limit on the grid axis the kernels put them on) and a batch
    of more than one element runs in chunks of the batch, concatenated.
    """
    key, kept = _kept_call("attention", (q, k, v, bias), (scale, causal, precision, backend, partitions, return_lse))
    if kept is not None:
        run, sc, prec = kept
        return _with_lse(run(q, k, v, bias, sc, causal, prec, partitions, return_lse), return_lse)
    given = (q, k, v)
    q, k, v, bias_cast = autocast(q, k, v, bias)
    return _attention(q, k, v, None, bias_cast, bias, scale, causal, precision, backend, partitions, return_lse,
                      "attention", key if _uncast(given, (q, k, v)) else None)


def attention_packed(
    qkv: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = False,
    precision: str = "auto",
    backend: str = "auto",
    return_lse: bool = False,
):
    """:func:`attention` on the packed projection: qkv [B, N, 3, H, D] → [B, H, N, D].

    qkv is a ViT's ``qkv(x).reshape(B, N, 3, H, D)``; q, k, v are ``qkv[:, :, i].transpose(1, 2)``
    and every other argument is as in :func:`attention` (which alone takes ``partitions``), with the
    same results. The difference is the backward: on the Triton backend the kernels write the
    gradient of qkv as one tensor, where q, k, v passed as views would get three gradients that
    autograd (or a compiled graph) then stacks, a copy the size of qkv.
    """
    fn = "attention_packed"
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"{fn}: qkv must be a torch.Tensor, got {type(qkv).__name__}")
    check_dense(qkv, "qkv", fn)
    key, kept = _kept_call(fn, (qkv, bias), (scale, causal, precision, backend, return_lse))
    if kept is not None:  # (q, k, v None: each backend takes the views it needs)
        run, sc, prec = kept
        return _with_lse(run(None, None, None, bias, sc, causal, prec, None, return_lse, qkv=qkv), return_lse)
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"{fn}: qkv must be [B, N, 3, H, D], got shape {tuple(qkv.shape)}; "
                         "reshape the projection output with .reshape(B, N, 3, H, D)")
    qkv0 = qkv
    qkv, bias_cast = autocast(qkv, bias)
    return _attention(*qkv_views(qkv), qkv, bias_cast, bias, scale, causal, precision, backend, None, return_lse, fn,
                      key if qkv is qkv0 else None)


def _with_lse(result, return_lse: bool):
    """An entry point's (out, lse) as the public functions return it."""
    out, lse = result
    return (out, lse.detach()) if return_lse else out


def _attention(q, k, v, qkv, bias, bias_in, scale, causal, precision, backend, partitions, return_lse, fn: str,
               key=None):
    """The attention entry points after autocast: the checks, dispatch, the call. ``qkv``: the
    packed tensor q, k, v are views of, or None. ``bias_in``: the bias as the caller passed it;
    ``key``: the call's :func:`_call_key`, to keep what the checks decide (None when autocast cast q)."""
    check_qkv(q, k, v, fn)
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    scale = check_scale(scale, D, fn)
    bias = bias4(bias, B, H, Nq, Nk, q, fn)
    causal = check_flag(causal, "causal", fn)
    check_flag(return_lse, "return_lse", fn)
    if partitions is not None and (not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1):
        raise ValueError(f"{fn}: partitions must be a positive int or None, got {partitions!r}")
    prec = resolve_precision(precision, q.dtype)
    p = Problem(op="attention", device=q.device.type, dtype=q.dtype, head_dim=D, causal=causal,
                has_bias=bias is not None, precision=prec, positive_scale=scale > 0, same_lengths=Nq == Nk,
                keys=Nk if causal and q.device.type == "cpu" else 0)  # (what ECA's auto rule weighs)
    run = select(p, backend).run["attention"]  # before the shortcut below: an unfit call raises either way
    if Nk == 0 or Nq == 0 or B * H == 0:  # no key: every row is fully masked and returns 0 (no row: empty)
        out = _nothing_to_attend(q.shape, q, k, v)
        return (out, torch.full((B, H, Nq), float("inf"), device=q.device)) if return_lse else out
    if B * H > MAX_GRID_YZ and B > 1:  # (thousands of VGGT frames × heads; views: autograd stacks qkv's gradient)
        return _in_batch_chunks(run, q, k, v, bias, scale, causal, prec, partitions, return_lse)
    if bias is bias_in:  # no bool → additive or broadcast view to redo
        _keep(key, (run, scale, prec))
    return _with_lse(run(q, k, v, bias, scale, causal, prec, partitions, return_lse, qkv=qkv), return_lse)


def _in_batch_chunks(run, q, k, v, bias, scale, causal, prec, partitions, return_lse):
    """``run`` on chunks of the batch of at most MAX_GRID_YZ batch·heads each, concatenated: the
    kernels put batch·heads on a grid axis that CUDA caps at 65535 programs (batch elements are
    independent, so each chunk's rows are what one call would give). bias is 4-D (bias4)."""
    B, H = q.shape[:2]
    step = max(1, MAX_GRID_YZ // H)
    outs, lses = [], []
    for b0 in range(0, B, step):
        rows = slice(b0, b0 + step)
        out, lse = run(q[rows], k[rows], v[rows], bias[rows] if bias is not None and bias.shape[0] == B else bias,
                       scale, causal, prec, partitions, return_lse)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs)
    return (out, torch.cat(lses).detach()) if return_lse else out


def _nothing_to_attend(shape, q, k, v) -> torch.Tensor:
    """Zeros of ``shape`` for a call with no key or no query, connected to the inputs by empty sums
    so that autograd gives them zero gradients."""
    return torch.zeros(shape, dtype=q.dtype, device=q.device) + (q[..., :0].sum() + k[..., :0].sum() + v[..., :0].sum())


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
            D 16…128 on the Triton backend (other head dims run on the reference backend under
            ``backend="auto"``). float32, float16 or bfloat16 (float64 on the reference backend).
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
    given = (q, k, v)
    q, k, v = autocast(q, k, v)
    # (the bias stays in its own dtype under autocast: the kernels read it as float32 either way)
    return _window_attention(*_window_rows(q, k, v, "window_attention"), None, bias, mask, scale, block, precision,
                             backend, "window_attention", key if _uncast(given, (q, k, v)) else None)


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
    check_dense(qkv, "qkv", fn)
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"{fn}: qkv must be [B·nW, N, 3, H, D], got shape {tuple(qkv.shape)}; "
                         "reshape the projection output with .reshape(B·nW, N, 3, H, D)")
    qkv0 = qkv
    (qkv,) = autocast(qkv)
    return _window_attention(*_window_rows(*qkv_views(qkv), fn), qkv, bias, mask, scale, block, precision, backend, fn,
                             key if qkv is qkv0 else None)


def _window_rows(q, k, v, fn: str) -> tuple:
    """q, k, v as window rows [BW, H, N, D] after the shape checks of the window functions."""
    check_qkv(q, k, v, fn)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"{fn}: q has {q.shape[2]} tokens per window but k/v have {k.shape[2]}; "
                         "window attention is self-attention inside each window")
    return q, k, v


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
    and True hash alike, but the checks refuse a bool scale. (It runs on every call: loops, not
    generators, and few nested tuples to build and hash.)"""
    if torch.compiler.is_compiling() or not isinstance(tensors[0], torch.Tensor):  # (the checks say what is wrong)
        return None
    types = tuple(map(type, args))
    for ty in types:
        if ty not in _PLAIN_ARGS:
            return None
    key = [op, args, types, torch.is_grad_enabled(), _fp32_matmul_precision(), dispatch_token()]
    for t in tensors:
        if t is None:
            key.append(None)
        elif not isinstance(t, torch.Tensor):
            return None
        else:
            try:
                key.append((t.shape, t.dtype, t.device, t.requires_grad, t.layout))
            except RuntimeError:  # (a nested tensor has no sizes: the checks say what is wrong)
                return None
    key.append(autocast_dtype(tensors[0].device.type))
    return tuple(key)


def _kept_call(op, tensors, args):
    """(the call's key, what the checks decided for it before or None)."""
    key = _call_key(op, tensors, args)
    return key, (_CALLS.get(key) if key is not None else None)


def _uncast(given: tuple, cast: tuple) -> bool:
    """Whether autocast left every input as given: only then may a repeat skip it (a kept call runs
    no autocast, and q alone in the autocast dtype says nothing of k and v)."""
    return all(a is b for a, b in zip(given, cast))


def clear_caches() -> None:
    """Forget everything elsa_vision keeps between calls: the decisions kept for repeated call
    signatures, the dispatch memo and, when the kernels are loaded, their compiled launches,
    planned launches and tile plans. Needed only after changing a tuning switch of
    ``elsa_vision.kernels.tiles`` / ``.window`` (benchmarks/windows.py --tune)."""
    _CALLS.clear()
    clear_memo()
    launch = sys.modules.get(f"{__package__}.kernels.launch")
    if launch is not None:  # (not imported: Triton absent, or no kernel ran yet)
        launch.clear_caches()


def _keep(key, decided) -> None:
    if key is not None and len(_CALLS) < 256:
        _CALLS[key] = decided


def _window_attention(q, k, v, qkv, bias, mask, scale, block, precision, backend, fn: str, key=None,
                      geo: Optional[Geometry] = None) -> torch.Tensor:
    """The window entry points after their own shape checks: the shared checks, dispatch, the call.
    q, k, v (autocast already applied) are window rows [BW, H, N, D], or with ``geo`` image rows
    [T, H, D] whose shifted windows the kernels read in place; ``qkv``: the packed tensor they are
    views of, or None. ``key``: the call's :func:`_call_key`, to keep what the checks decide."""
    check_same_kind(q, k, v, fn)
    BW, H, N, D = (q.shape if geo is None else (geo.windows, q.shape[1], geo.tokens, q.shape[2]))
    check_head_dim(D, fn)
    scale = check_scale(scale, D, fn)
    bias_in, mask_in = bias, mask
    bias = window_bias(bias, H, N, q, fn)
    mask = window_mask(mask, BW, N, q, fn)
    blk = check_block(block, fn)
    prec = resolve_precision(precision, q.dtype)
    op = "window_attention" if geo is None else "shifted_window_attention"
    p = Problem(op=op, device=q.device.type, dtype=q.dtype, head_dim=D, has_bias=bias is not None,
                has_mask=mask is not None, window_tokens=N, precision=prec)
    run = select(p, backend).run[op]  # before the shortcut below: an unfit call raises either way
    if q.numel() == 0:  # no window or no token: nothing to attend
        return _nothing_to_attend(q.shape, q, k, v)
    # keep the decisions when a repeat can pass its tensors straight to ``run``: bias and mask as
    # given (no bool → additive conversion, no broadcast view)
    plain_bias = (bias is bias_in or (bias_in is not None and bias_in.dim() == 3 and bias_in.shape[0] == H
                                      and bias_in.dtype == bias.dtype))
    if plain_bias and mask is mask_in:
        _keep(key, (run, scale, prec, blk) if geo is None else (run, scale, prec, blk, geo))
    return run(q, k, v, bias, mask, scale, prec, blk, qkv=qkv, geo=geo)


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
    image_size=None,
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
            window's: an image that is not is padded at its bottom and right first, and
            ``image_size`` says where its own tokens end (see there).
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
        image_size: None (the whole map is the image), or int or (rows, columns): the image is the
            map's top-left rows × columns tokens, the others pad it (fewer than a window's rows /
            columns), as timm pads a feature map that the window does not tile. The shift rolls
            rows [0, rows) by −shift[0] across the map's whole width and columns [0, columns) by
            −shift[1] across its whole height: each image token lands where timm's
            ``roll(x, −shift)`` then pad puts it, and a pad token moves only among pad positions
            (along its column or row). That is timm's answer exactly when the pad tokens are equal,
            as timm's are (the projection of zeros: its bias); distinct pad tokens are not kept in
            place. The pad tokens are keys and values like the others; their outputs are computed
            and not meant to be read (timm crops them).

    Returns:
        [B, height, width, H, D] in the inputs' dtype, row-major (``out.reshape(B, height, width, H·D)``
        is free: what Swin's output projection reads).
    """
    fn = "shifted_window_attention"
    wh, ww = pair(window_size, "window_size", fn)
    if wh < 1 or ww < 1:
        raise ValueError(f"{fn}: window_size must be at least 1 token a side, got {(wh, ww)}")
    sh, sw = pair(shift_size, "shift_size", fn)
    packed = k is None and v is None
    rows, cols = (None, None) if image_size is None else pair(image_size, "image_size", fn)
    key, kept = _kept_call("shifted", (q, k, v, bias, mask),
                           (scale, block, precision, backend, wh, ww, sh, sw, rows, cols))
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
    check_dense(q, "qkv" if packed else "q", fn)
    if packed:
        if q.dim() != 6 or q.shape[3] != 3:
            raise ValueError(f"{fn}: a packed qkv must be [B, height, width, 3, H, D], got shape {tuple(q.shape)}; "
                             "pass q, k, v as [B, height, width, H, D] each, or reshape the projection output")
        given = (q,)
        cast = autocast(q)
        B, IH, IW, _, H, D = cast[0].shape
        qkv = cast[0].reshape(B * IH * IW, 3, H, D)
        q3, k3, v3 = qkv.unbind(1)
    else:
        if k is None or v is None:
            raise ValueError(f"{fn}: pass both k and v with q, or neither (q then being the packed qkv)")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
            check_dense(t, name, fn)
            if t.dim() != 5:
                raise ValueError(f"{fn}: {name} must be 5-D [B, height, width, H, D], got shape {tuple(t.shape)}")
        if not (q.shape == k.shape == v.shape):
            raise ValueError(f"{fn}: q, k, v must have one shape [B, height, width, H, D], got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        given, qkv = (q, k, v), None
        cast = q, k, v = autocast(q, k, v)
        B, IH, IW, H, D = q.shape
        q3, k3, v3 = (t.reshape(B * IH * IW, H, D) for t in (q, k, v))
    if not _uncast(given, cast):
        key = None  # a repeat would need the cast too
    if min(wh, ww) < 1 or IH % wh or IW % ww:
        raise ValueError(f"{fn}: the {IH}×{IW} token image is not tiled by {wh}×{ww} windows; pad it to a multiple "
                         "of the window at its bottom and right first and pass image_size=(rows, columns) (timm pads "
                         "the rolled image so)")
    if not (0 <= sh < wh and 0 <= sw < ww):
        raise ValueError(f"{fn}: shift_size {(sh, sw)} must lie in [0, window_size) = [0, {(wh, ww)})")
    if image_size is None:
        rows, cols = IH, IW
    elif not (IH - wh < rows <= IH and IW - ww < cols <= IW):
        raise ValueError(f"{fn}: image_size {(rows, cols)} must lie within the {IH}×{IW} map and leave less than a "
                         f"{wh}×{ww} window of padding at its bottom and right (pad the image to the next multiple "
                         "of the window, as timm does)")
    geo = Geometry(B, IH, IW, wh, ww, sh, sw, rows, cols)
    if isinstance(mask, torch.Tensor) and mask.dim() == 3 and mask.shape[0] != geo.nW:
        raise ValueError(f"{fn}: mask has {mask.shape[0]} window slices but a {IH}×{IW} image has {geo.nW} windows "
                         f"of {wh}×{ww}; pass one [N, N] slice per window position")
    out = _window_attention(q3, k3, v3, qkv, bias, mask, scale, block, precision, backend, fn, key, geo)
    return out.reshape(B, IH, IW, H, D)


def patch(model: torch.nn.Module, *, precision: str = "auto", token_merging=None,
          include: Optional[Sequence[str]] = None, exclude: Optional[Sequence[str]] = None, **options):
    """Route every supported module of ``model`` (attention, and the blocks and heads around it)
    through ELSA; returns a PatchReport.

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
    """``with patched(model): ...`` — patch for the duration of the block. On leaving it, the
    modules this call patched are restored; modules patched before it stay patched."""
    from .adapters import registry
    report = patch(model, **kwargs)
    try:
        yield report
    finally:
        registry.unpatch(model, names={n for names in report.patched.values() for n in names})
