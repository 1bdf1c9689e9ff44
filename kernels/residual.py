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

Under autograd (training) a call with a norm is an autograd Function (:class:`_Fused`): the forward
also writes each row's mean and rstd, and the backward is one pass (_norm_bwd_kernel) that forms the
LayerNorm's input gradient, adds the gradient the residual stream brings, and writes it as x's and,
through y·γ, as y's gradient; a call without a norm is PyTorch's own add (one pass either way).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import cast
from .launch import INTERPRET, Launch, launch, on_device, prepared
from .limits import RESIDUAL_DTYPES, RESIDUAL_MAX_WIDTH
from .ops import check_first_order, has_tangent, no_tangents

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
    X, Y, G, W, Bias, Xout, Hout, Mean, Rstd,
    M, C, stride_x, stride_y, stride_xo, stride_h, eps,
    ADD: tl.constexpr, SCALE: tl.constexpr, P_ROUND: tl.constexpr, NORM: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, SAVE: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
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
        rstd = 1.0 / tl.sqrt(var + eps)
        if SAVE:  # (the backward's row statistics)
            tl.store(Mean + rows, mean, mask=rows < M)
            tl.store(Rstd + rows, rstd, mask=rows < M)
        h = xc * rstd[:, None]
        if HAS_W:
            h = h * tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            h = h + tl.load(Bias + cols, mask=in_row, other=0.0).to(tl.float32)[None, :]
        tl.store(Hout + r * stride_h + cols[None, :], cast(h, Hout.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _norm_bwd_kernel(
    R, DH, DR, Mean, Rstd, W, G, DX, DY, PW, PB,
    M, C, stride_r, stride_dh, stride_dr, stride_dx, stride_dy,
    HAS_DR: tl.constexpr, HAS_W: tl.constexpr, DY_MODE: tl.constexpr, SUMS: tl.constexpr,
    BLOCK_C: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr,
):
    """The LayerNorm's backward for rows R (its input) from DH (the gradient of its output) and the
    forward's Mean / Rstd, plus DR (the gradient reaching R from elsewhere: the residual stream):
    DX = DR + LN_bwd(DH), in float32 and stored in DX's dtype. DY_MODE 1: DY = DX in DY's dtype (the
    branch's gradient through x + y), 2: DY = DX·G (through x + y·γ). SUMS: this program's column
    sums of DH·x̂ and DH (the weight's and bias's gradients) into row pid of PW, PB [programs, C],
    summed by the host afterwards in a fixed order (deterministic). A program takes CHUNKS blocks of
    ROWS rows."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    in_row = cols < C
    w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32) if HAS_W else tl.where(in_row, 1.0, 0.0)
    acc_w = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in range(CHUNKS):
        rows = (pid * CHUNKS + i) * ROWS + tl.arange(0, ROWS)
        ok = (rows < M)[:, None] & in_row[None, :]
        r = rows.to(tl.int64)[:, None]
        mean = tl.load(Mean + rows, mask=rows < M, other=0.0)
        rstd = tl.load(Rstd + rows, mask=rows < M, other=0.0)
        xhat = tl.where(ok, (tl.load(R + r * stride_r + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                             - mean[:, None]) * rstd[:, None], 0.0)
        dh = tl.load(DH + r * stride_dh + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        g = dh * w[None, :]
        c1 = tl.sum(g * xhat, axis=1) / C
        c2 = tl.sum(g, axis=1) / C
        dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if HAS_DR:
            dx += tl.load(DR + r * stride_dr + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(DX + r * stride_dx + cols[None, :], cast(dx, DX.dtype.element_ty), mask=ok)
        if DY_MODE == 1:
            tl.store(DY + r * stride_dy + cols[None, :], cast(dx, DY.dtype.element_ty), mask=ok)
        elif DY_MODE == 2:
            gam = tl.load(G + cols, mask=in_row, other=0.0).to(tl.float32)
            tl.store(DY + r * stride_dy + cols[None, :], cast(dx * gam[None, :], DY.dtype.element_ty), mask=ok)
        if SUMS:
            acc_w += tl.sum(dh * xhat, axis=0)
            acc_b += tl.sum(dh, axis=0)
    if SUMS:
        tl.store(PW + pid.to(tl.int64) * C + cols, acc_w, mask=in_row)
        tl.store(PB + pid.to(tl.int64) * C + cols, acc_b, mask=in_row)


def _rows(t: torch.Tensor, C: int) -> torch.Tensor:
    """t [..., C] as rows evenly strided with a unit column stride: an [M, C] view when contiguous
    (t itself when 1-D), else such a view or a copy (which of the two follows from t's shape and
    strides alone)."""
    if t.is_contiguous():  # (as [M, C]: a contiguous tensor's size-1 dimensions may carry any stride)
        return t.view(-1, C) if t.dim() > 1 else t
    t2 = t.reshape(-1, C)
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def _row_stride(rows: torch.Tensor, C: int) -> int:
    """The row stride of :func:`_rows`' result (a 1-D one is a single row of C)."""
    return rows.stride(-2) if rows.dim() > 1 else C


def residual_dtype(x: torch.Tensor, y: torch.Tensor, gamma: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype of ``x + y * gamma`` (``x + y`` without gamma) under PyTorch's promotion."""
    p = y.dtype if gamma is None else torch.promote_types(y.dtype, gamma.dtype)
    return torch.promote_types(x.dtype, p)


def _spec(t: Optional[torch.Tensor]):
    """What of a tensor the plan of a call depends on (get_device: −1 on the CPU, else the index)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


@on_device
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
    if norm is not None:
        w, b = norm._parameters.get("weight"), norm._parameters.get("bias")
    if has_tangent((x, y, gamma, w, b)):
        if norm is None:  # (PyTorch's ops carry the tangent)
            return (x if y is None else x + (y if gamma is None else y * gamma)), None
        no_tangents("residual_norm", (x, y, gamma, w, b))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, y, gamma, w, b)):
        if norm is None:  # the residual alone: PyTorch's own ops (one pass either way, the same bits)
            return (x if y is None else x + (y if gamma is None else y * gamma)), None
        if y is None:
            return x, _Fused.apply(x, None, None, w, b, norm, out_dtype)
        return _Fused.apply(x, y, gamma, w, b, norm, out_dtype)
    return _forward(x, y, gamma, norm, w, b, out_dtype, False)[:2]


def _forward(x, y, gamma, norm, w, b, out_dtype, save: bool):
    """(r, h, mean, rstd): the launch of :func:`residual_norm`; with ``save`` (and a norm) the rows'
    mean and rstd [M] float32, for the backward (else None)."""
    key = ("residual_norm", _spec(x), _spec(y), _spec(gamma), _spec(w), _spec(b),
           None if norm is None else (tuple(norm.normalized_shape), norm.eps), out_dtype, save)
    r_dtype, h_dtype, run = prepared(key, _plan, x, y, gamma, norm, w, b, out_dtype, save)
    r = x if y is None else torch.empty(x.shape, dtype=r_dtype, device=x.device)
    h = None if norm is None else torch.empty(x.shape, dtype=h_dtype, device=x.device)
    C = x.shape[-1] if x.dim() else 1
    mean = rstd = None
    if save and norm is not None:
        mean, rstd = torch.empty((2, max(1, x.numel()) // C), dtype=torch.float32, device=x.device)
    if run is not None:
        x2 = _rows(x, C)
        y2 = _rows(y, C) if y is not None else x2
        run(x2, y2, gamma if gamma is not None else x2, w if w is not None else x2, b if b is not None else x2,
            r if y is not None else x2, h if h is not None else x2, mean if mean is not None else x2,
            rstd if rstd is not None else x2)
    return r, h, mean, rstd


class _Fused(torch.autograd.Function):
    """:func:`residual_norm` with a norm, recorded by autograd: (r, h) for a branch output y, h alone
    without one. The backward is one pass (_norm_bwd_kernel): the LayerNorm's input gradient plus
    the residual stream's, written as x's gradient and, through y·γ, as y's in y's dtype; the norm's
    weight and bias gradients from per-program column sums added in a fixed order; γ's from x's
    gradient and y (PyTorch's ops)."""

    @staticmethod
    def forward(ctx, x, y, gamma, w, b, norm, out_dtype):
        r, h, mean, rstd = _forward(x, y, gamma, norm, w, b, out_dtype, True)
        ctx.save_for_backward(r, y, gamma, w, mean, rstd)
        ctx.dtypes = (x.dtype, None if b is None else b.dtype)
        return h if y is None else (r, h)

    @staticmethod
    def backward(ctx, *grads):
        check_first_order("residual_norm")  # (the kernel's gradients have no graph: no double backward)
        r, y, gamma, w, mean, rstd = ctx.saved_tensors
        dr, dh = (None, grads[0]) if y is None else grads
        if dh is None:
            dh = torch.zeros_like(r)
        need_x, need_y, need_g, need_w, need_b = ctx.needs_input_grad[:5]
        dx, dy, sums = _backward(r, dh, dr, mean, rstd, w, gamma, y if need_y else None, need_w or need_b)
        dgamma = None
        if need_g:  # (x + y·γ)'s γ-gradient, as PyTorch's mul forms it
            p_dtype = torch.promote_types(y.dtype, gamma.dtype)
            dgamma = (dx.to(p_dtype) * y).reshape(-1, y.shape[-1]).sum(0).to(gamma.dtype)
        x_dtype, b_dtype = ctx.dtypes
        dw = sums[0].to(w.dtype) if need_w else None
        db = sums[1].to(b_dtype) if need_b else None
        return (dx.to(x_dtype) if need_x else None, dy, dgamma, dw, db, None, None)


def _backward(r, dh, dr, mean, rstd, w, gamma, y, sums: bool):
    """(dx, dy, sums) of :class:`_Fused` (see _norm_bwd_kernel): dy only for a given y (in y's
    dtype); with ``sums``, the weight's and the bias's gradients [2, C] float32 (the programs'
    column sums added in their order), else None."""
    C = r.shape[-1]
    M = r.numel() // C
    block_c = 1 << (C - 1).bit_length()
    rows = max(1, (65536 if INTERPRET else 2048) // block_c)
    chunks = 1 if INTERPRET else max(1, 32 // rows)
    programs = max(1, -(-M // (rows * chunks)))
    r2, dh2 = _rows(r, C), _rows(dh, C)
    dr2 = _rows(dr, C) if dr is not None else r2
    dx = torch.empty(r.shape, dtype=r.dtype, device=r.device)
    dy = torch.empty(r.shape, dtype=y.dtype, device=r.device) if y is not None else None
    parts = torch.empty((2, programs, C), dtype=torch.float32, device=r.device) if sums else None
    if M:
        launch(_norm_bwd_kernel, (programs,), r2, dh2, dr2, mean, rstd, w if w is not None else r2,
               gamma if gamma is not None else r2, dx, dy if dy is not None else dx, parts[0] if sums else r2,
               parts[1] if sums else r2, M, C, _row_stride(r2, C), _row_stride(dh2, C), _row_stride(dr2, C), C, C,
               HAS_DR=dr is not None, HAS_W=w is not None, DY_MODE=0 if y is None else (2 if gamma is not None else 1),
               SUMS=sums, BLOCK_C=block_c, ROWS=rows, CHUNKS=chunks, num_warps=4 if block_c <= 2048 else 8)
    elif sums:
        parts.zero_()
    return dx, dy, parts.sum(1) if sums else None


def _plan(x, y, gamma, norm, w, b, out_dtype, save=False):
    """The checks of one call signature, and its launch: (r's dtype, h's dtype, a launch.Launch of
    the kernel taking (x, y, gamma, weight, bias, r, h, mean, rstd) as rows, or None when there is
    nothing to do); ``save``: the kernel writes mean and rstd."""
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
    for name, t in (("gamma", gamma), ("the LayerNorm's weight", w), ("the LayerNorm's bias", b)):
        if t is not None and t.dim() == 1 and t.stride(0) != 1:  # (the kernels read [C] vectors densely)
            raise ValueError(f"residual_norm: {name} must be a contiguous [{C}] vector, got stride {t.stride(0)}; "
                             "pass it .contiguous()")
    if not 0 < C <= MAX_WIDTH or (out_dtype is not None and out_dtype not in DTYPES):
        raise ValueError(f"residual_norm: rows of 1 to {MAX_WIDTH} features and output dtypes among {DTYPES}")
    r_dtype = x.dtype if y is None else residual_dtype(x, y, gamma)
    h_dtype = None if norm is None else out_dtype or r_dtype
    M = x.numel() // C
    if M == 0 or (y is None and norm is None):
        return r_dtype, h_dtype, None
    row_stride = [_row_stride(_rows(t, C), C) for t in (x, y if y is not None else x)]
    block_c = 1 << (C - 1).bit_length()
    # (the interpreter pays per program: many rows each there)
    rows = max(1, (65536 if INTERPRET else 4096) // block_c)
    p_round = _ROUND[torch.promote_types(y.dtype, gamma.dtype)] if y is not None and gamma is not None else 0
    eps = float(norm.eps) if norm is not None else 0.0
    run = Launch(_residual_norm_kernel, (-(-M // rows),), (M, C, *row_stride, C, C, eps),
                 dict(ADD=y is not None, SCALE=gamma is not None, P_ROUND=p_round, NORM=norm is not None,
                      HAS_W=w is not None, HAS_B=b is not None, SAVE=save and norm is not None,
                      BLOCK_C=block_c, ROWS=rows,
                      num_warps=4 if block_c <= 2048 else 8, enable_fp_fusion=False))
    return r_dtype, h_dtype, run
