"""A pre-norm block's residual stream in one pass per branch: x + y·γ (LayerScale, or none) and the
LayerNorm of the result that the next branch reads, written in the dtype its projection reads.

A pre-norm transformer block (timm's ViT ``Block``, VGGT's ``Block``) in eval mode is
``h = norm1(x); x = x + ls1(attn(h)); h = norm2(x); x = x + ls2(mlp(h))``. Eagerly, each line is
several passes over the [tokens, C] rows: LayerScale's product is a tensor of its own, then the
add; under autocast the LayerNorm writes float32 and the next projection casts it to the autocast
dtype. Here one program reads a block of rows once and writes the new residual x and the
normalized h (see :func:`residual_norm`); in a long VGGT call those passes are a tenth of the
aggregator's time.

Arithmetic. The residual follows PyTorch's type promotion step by step: y·γ rounded to
``promote_types(y, γ)``, then x + that rounded to ``promote_types(x, ·)``, with floating-point
contraction off (no fused multiply-add), so the new x is bitwise what ``x + ls(y)`` gives. The
LayerNorm is PyTorch's (biased variance, rstd = 1/sqrt(var + eps), then weight and bias) in float32,
its sums in another order than PyTorch's: it agrees to float32 rounding before the one rounding to
the output dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import cast
from .launch import INTERPRET, Launch, prepared
from .limits import RESIDUAL_DTYPES, RESIDUAL_MAX_WIDTH

DTYPES = RESIDUAL_DTYPES
MAX_WIDTH = RESIDUAL_MAX_WIDTH
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _round(v, CODE: tl.constexpr):
    """v (float32) rounded to the dtype of ``_ROUND``'s code, back in float32."""
    if CODE == 1:
        v = cast(v, tl.bfloat16).to(tl.float32)
    elif CODE == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit(do_not_specialize=["M"])  # (one compile for every row count: lean mode's chunks vary it)
def _residual_norm_kernel(
    X, Y, G, W, Bias, Xout, Hout,
    M, C, stride_x, stride_y, stride_xo, stride_h, eps,
    ADD: tl.constexpr, SCALE: tl.constexpr, P_ROUND: tl.constexpr, NORM: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    in_row = cols < C
    ok = (rows < M)[:, None] & in_row[None, :]
    r = rows.to(tl.int64)[:, None]
    x = tl.load(X + r * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if ADD:
        p = tl.load(Y + r * stride_y + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if SCALE:
            p = _round(p * tl.load(G + cols, mask=in_row, other=0.0).to(tl.float32)[None, :], P_ROUND)
        x = cast(x + p, Xout.dtype.element_ty)
        tl.store(Xout + r * stride_xo + cols[None, :], x, mask=ok)
        x = x.to(tl.float32)
    if NORM:
        mean = tl.sum(x, axis=1) / C  # (masked columns hold 0)
        xc = tl.where(ok, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / C
        h = xc * (1.0 / tl.sqrt(var + eps))[:, None]
        if HAS_W:
            h = h * tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            h = h + tl.load(Bias + cols, mask=in_row, other=0.0).to(tl.float32)[None, :]
        tl.store(Hout + r * stride_h + cols[None, :], cast(h, Hout.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor, C: int) -> torch.Tensor:
    """t [..., C] as rows evenly strided with a unit column stride: t itself when contiguous, else a
    [M, C] view or copy (which of the two follows from t's shape and strides alone)."""
    if t.is_contiguous():
        return t
    t2 = t.reshape(-1, C)
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def residual_dtype(x: torch.Tensor, y: torch.Tensor, gamma: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype of ``x + y * gamma`` (``x + y`` without gamma) under PyTorch's promotion."""
    p = y.dtype if gamma is None else torch.promote_types(y.dtype, gamma.dtype)
    return torch.promote_types(x.dtype, p)


def _spec(t: Optional[torch.Tensor]):
    """What of a tensor the plan of a call depends on (get_device: −1 on the CPU, else the index)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


def residual_norm(x: torch.Tensor, y: Optional[torch.Tensor] = None, gamma: Optional[torch.Tensor] = None,
                  norm: Optional[torch.nn.LayerNorm] = None, out_dtype: Optional[torch.dtype] = None,
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x [..., C]; y like x (the branch output) or None; gamma [C] (LayerScale) or None; norm an
    ``nn.LayerNorm`` over C or None. Returns (r, h): r = x + y·γ in :func:`residual_dtype` (x itself
    when y is None), bitwise equal to PyTorch's, and h = norm(r) in ``out_dtype`` (default r's dtype)
    or None without a norm. Every tensor on one device, in :data:`DTYPES`; C ≤ :data:`MAX_WIDTH`.

    A call is checked and its launch planned once per signature (shapes, strides, dtypes, devices,
    eps): a block calls this three times per token batch, and host time is what small batches
    spend (see launch.prepared)."""
    w = b = None
    eps = 0.0
    if norm is not None:
        w, b, eps = norm._parameters.get("weight"), norm._parameters.get("bias"), norm.eps
    key = ("residual_norm", _spec(x), _spec(y), _spec(gamma), _spec(w), _spec(b),
           None if norm is None else (tuple(norm.normalized_shape), eps), out_dtype)
    r_dtype, h_dtype, run = prepared(key, _plan, x, y, gamma, norm, w, b, out_dtype)
    r = x if y is None else torch.empty(x.shape, dtype=r_dtype, device=x.device)
    h = None if norm is None else torch.empty(x.shape, dtype=h_dtype, device=x.device)
    if run is not None:
        C = x.shape[-1]
        x2 = _rows(x, C)
        y2 = _rows(y, C) if y is not None else x2
        run(x2, y2, gamma if gamma is not None else x2, w if w is not None else x2, b if b is not None else x2,
            r if y is not None else x2, h if h is not None else x2)
    return r, h


def _plan(x, y, gamma, norm, w, b, out_dtype):
    """The checks of one call signature, and its launch: (r's dtype, h's dtype, a launch.Launch of
    the kernel taking (x, y, gamma, weight, bias, r, h) as rows, or None when there is nothing to do)."""
    C = x.shape[-1] if x.dim() else 0
    if y is not None and y.shape != x.shape:
        raise ValueError(f"residual_norm: y {tuple(y.shape)} must have x's shape {tuple(x.shape)}")
    if gamma is not None and gamma.shape != (C,):
        raise ValueError(f"residual_norm: gamma must be [{C}], got {tuple(gamma.shape)}")
    if norm is not None and tuple(norm.normalized_shape) != (C,):
        raise ValueError(f"residual_norm: the LayerNorm normalizes {tuple(norm.normalized_shape)}, not the "
                         f"last dimension {C} of x")
    for t in (x, y, gamma, w, b):
        if t is not None and (t.dtype not in DTYPES or t.device != x.device):
            raise ValueError(f"residual_norm: every tensor must be on x's device, with dtypes among {DTYPES}")
    if not 0 < C <= MAX_WIDTH or (out_dtype is not None and out_dtype not in DTYPES):
        raise ValueError(f"residual_norm: rows of 1 to {MAX_WIDTH} features and output dtypes among {DTYPES}")
    r_dtype = x.dtype if y is None else residual_dtype(x, y, gamma)
    h_dtype = None if norm is None else out_dtype or r_dtype
    M = x.numel() // C
    if M == 0 or (y is None and norm is None):
        return r_dtype, h_dtype, None
    row_stride = [_rows(t, C).stride(-2) if t.dim() > 1 else C for t in (x, y if y is not None else x)]
    block_c = 1 << (C - 1).bit_length()
    # (the interpreter pays per program: many rows each there)
    rows = max(1, (65536 if INTERPRET else 4096) // block_c)
    p_round = _ROUND[torch.promote_types(y.dtype, gamma.dtype)] if y is not None and gamma is not None else 0
    eps = float(norm.eps) if norm is not None else 0.0
    run = Launch(_residual_norm_kernel, (-(-M // rows),), (M, C, *row_stride, C, C, eps),
                 dict(ADD=y is not None, SCALE=gamma is not None, P_ROUND=p_round, NORM=norm is not None,
                      HAS_W=w is not None, HAS_B=b is not None, BLOCK_C=block_c, ROWS=rows,
                      num_warps=4 if block_c <= 2048 else 8, enable_fp_fusion=False))
    return r_dtype, h_dtype, run
