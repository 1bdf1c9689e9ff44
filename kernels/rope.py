"""q/k LayerNorm and 2-D rotary embedding in one pass over a fused qkv projection (VGGT's attention).

VGGT's attention forms q and k as qkv → per-head LayerNorm over the head dim → 2-D RoPE (the first
half of the head dim rotates with the token's y position, the second half with x). In PyTorch that
is a copy of each strided q/k slice, a LayerNorm over rows of 64 (a launch configuration made for
long rows, a large share of a long VGGT call), then a dozen float32 elementwise passes.
Here one launch forms both q and k: a program takes a block of tokens, reads their positions and
gathers their cos/sin rows once, then runs over every head of q and of k — normalizing and rotating
in float32 registers, and writing each once, in the dtype attention will read (the autocast dtype
under autocast).

Layout: a head's D values are held as two [tokens, 2, D/4] tiles, the first and second quarter of
each half (y, x), so that the rotation x·cos + rotate_half(x)·sin pairs elements of the two tiles
at the same index — contiguous loads and stores, no permuted re-read of the row.

Arithmetic: the LayerNorm of PyTorch (biased variance, rstd = 1/sqrt(var + eps), then weight and
bias) and the rotation with the module's own cos/sin tables, all in float32; the sums of the mean
and variance run in another order than PyTorch's, so results agree to float32 rounding, not bitwise.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .common import cast
from .launch import INTERPRET, cdiv, launch, on_device
from .limits import ROPE_MIN_HEAD_DIM
from .ops import forward_ad_on, no_tangents, register

# tokens per program (heads and parts loop inside it: positions and cos/sin rows are read once per token)
BLOCK_T = 32
NUM_WARPS = 2


@triton.jit
def _normed_rotated(X, W, Bias, row, idx, cos_a, sin_a, cos_b, sin_b, ok, eps,
                    D: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                    ROPE: tl.constexpr):
    """One head of one part for a block of tokens: (a, b), the first and second quarters of each
    half [T, 2, D/4], normalized and rotated, in float32."""
    QUART: tl.constexpr = D // 4
    a = tl.load(X + row + idx, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(X + row + idx + QUART, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        mean = tl.sum(tl.sum(a + b, axis=2), axis=1) / D
        a = a - mean[:, None, None]
        b = b - mean[:, None, None]
        var = tl.sum(tl.sum(a * a + b * b, axis=2), axis=1) / D
        rstd = (1.0 / tl.sqrt(var + eps))[:, None, None]
        a = a * rstd
        b = b * rstd
        if HAS_W:
            a = a * tl.load(W + idx).to(tl.float32)
            b = b * tl.load(W + idx + QUART).to(tl.float32)
        if HAS_B:
            a = a + tl.load(Bias + idx).to(tl.float32)
            b = b + tl.load(Bias + idx + QUART).to(tl.float32)
    if ROPE:  # x·cos + rotate_half(x)·sin, rotate_half([a, b]) = [−b, a] within each half
        a, b = a * cos_a - b * sin_a, b * cos_b + a * sin_b
    return a, b


@triton.jit(do_not_specialize=["n_tok"])  # (one compile for every token count: it only masks rows)
def _qk_norm_rope_kernel(
    X, Pos, W0, B0, W1, B1, Cos, Sin, Out0, Out1,
    n_tok, H, eps0, eps1,
    stride_xb, stride_xn, stride_pb, stride_pn, stride_ob, stride_on, stride_oh,
    D: tl.constexpr, PARTS: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    ROPE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    eps0 = tl.cast(eps0, tl.float32)  # inductor passes float64
    eps1 = tl.cast(eps1, tl.float32)
    n_blocks = tl.cdiv(n_tok, BLOCK_T)
    pid = tl.program_id(0)  # (one axis: CUDA caps the others at 65535, below long videos' B or n / BLOCK_T)
    b = pid // n_blocks
    pid_t = pid % n_blocks
    HALF: tl.constexpr = D // 2
    QUART: tl.constexpr = D // 4
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    half = tl.arange(0, 2)
    i = tl.arange(0, QUART)
    t3 = t[:, None, None]
    ok = t3 < n_tok
    idx = half[None, :, None] * HALF + i[None, None, :]  # [1, 2, D/4]: column of each element of a
    cos_a = tl.zeros([BLOCK_T, 2, QUART], dtype=tl.float32)  # (unused without ROPE)
    sin_a = cos_a
    cos_b = cos_a
    sin_b = cos_a
    if ROPE:  # the token's y (first half) and x (second half) rows of the tables, once for all heads
        p = tl.load(Pos + b.to(tl.int64) * stride_pb + t3.to(tl.int64) * stride_pn + half[None, :, None],
                    mask=ok, other=0)
        tab = p * HALF + i[None, None, :]
        cos_a = tl.load(Cos + tab, mask=ok, other=0.0)
        sin_a = tl.load(Sin + tab, mask=ok, other=0.0)
        cos_b = tl.load(Cos + tab + QUART, mask=ok, other=0.0)
        sin_b = tl.load(Sin + tab + QUART, mask=ok, other=0.0)
    x_row = b.to(tl.int64) * stride_xb + t3.to(tl.int64) * stride_xn
    o_row = b.to(tl.int64) * stride_ob + t3.to(tl.int64) * stride_on
    for h in range(H):
        a, c = _normed_rotated(X, W0, B0, x_row + h * D, idx, cos_a, sin_a, cos_b, sin_b, ok, eps0,
                               D, NORM, HAS_W, HAS_B, ROPE)
        o = Out0 + o_row + h * stride_oh + idx
        tl.store(o, cast(a, Out0.dtype.element_ty), mask=ok)
        tl.store(o + QUART, cast(c, Out0.dtype.element_ty), mask=ok)
        if PARTS == 2:  # k: the next H·D columns of x
            a, c = _normed_rotated(X, W1, B1, x_row + (H + h) * D, idx, cos_a, sin_a, cos_b, sin_b, ok, eps1,
                                   D, NORM, HAS_W, HAS_B, ROPE)
            o = Out1 + o_row + h * stride_oh + idx
            tl.store(o, cast(a, Out1.dtype.element_ty), mask=ok)
            tl.store(o + QUART, cast(c, Out1.dtype.element_ty), mask=ok)


@on_device
def qk_norm_rope(x: torch.Tensor, heads: int, outs: Sequence[torch.Tensor],
                 norms: Optional[Sequence[Optional[torch.nn.Module]]] = None, pos: Optional[torch.Tensor] = None,
                 tables: Optional[tuple] = None) -> Sequence[torch.Tensor]:
    """x [B, n, ≥ P·heads·D] (q, or q and k, of a qkv projection: row stride free, part j's head h
    at columns (j·heads + h)·D … + D − 1, unit column stride) → outs (P = 1 or 2 tensors
    [B, n, heads, D] of one dtype and equal strides, a unit last one), part j normalized by
    ``norms[j]`` (nn.LayerNorms over D, all with the same affine parameters present, or None: no
    norm) and, with ``pos`` [B, n, 2] (integer y, x) and ``tables`` (cos, sin) [P', D/2] float32
    (row p: position p, every position of ``pos`` a row), rotated. Returns outs."""
    if forward_ad_on():
        no_tangents("qk_norm_rope", (x, *(p for m in (norms or ()) if m is not None
                                          for p in (getattr(m, "weight", None), getattr(m, "bias", None)))))
    B, n = x.shape[:2]
    outs = tuple(outs)
    parts = len(outs)
    if parts not in (1, 2):
        raise ValueError(f"qk_norm_rope: takes 1 or 2 outputs (q, or q and k), got {parts}")
    out0 = outs[0]
    D = out0.shape[-1]
    if x.stride(-1) != 1 or any(o.stride(-1) != 1 for o in outs):
        raise ValueError("qk_norm_rope: x and the outputs need a unit last stride")
    if any(o.shape != (B, n, heads, D) or o.stride() != out0.stride() or o.dtype != out0.dtype for o in outs) \
            or x.shape[-1] < parts * heads * D:
        raise ValueError(f"qk_norm_rope: outputs {[tuple(o.shape) for o in outs]} (one dtype and strides) do not "
                         f"fit x {tuple(x.shape)} with {heads} heads")
    if D & (D - 1) or D < ROPE_MIN_HEAD_DIM:
        raise ValueError(f"qk_norm_rope: head dim must be a power of two ≥ {ROPE_MIN_HEAD_DIM}, got {D}")
    norms = tuple(norms) if norms is not None else (None,) * parts
    if len(norms) != parts or len({(m is None, getattr(m, "weight", None) is None, getattr(m, "bias", None) is None)
                                   for m in norms}) != 1:
        raise ValueError("qk_norm_rope: give one norm per output, all None or all with the same affine parameters")
    rope = pos is not None
    if rope and (tables is None or tables[0].shape[1] != D // 2 or tables[0].dtype != torch.float32):
        raise ValueError("qk_norm_rope: rope needs float32 (cos, sin) tables of D/2 columns")
    if rope and (tuple(pos.shape) != (B, n, 2) or pos.dtype.is_floating_point or pos.dtype == torch.bool):
        raise ValueError(f"qk_norm_rope: pos must be an integer [B, n, 2] = [{B}, {n}, 2] tensor of (y, x) "
                         f"positions, got {pos.dtype} {tuple(pos.shape)}; expand a shared one to the batch")
    if n == 0 or B == 0:
        return outs
    if rope:
        pos = pos if pos.stride(-1) == 1 else pos.contiguous()
        cos, sin = (t.contiguous() for t in tables)
    else:
        cos = sin = None
    w = [getattr(m, "weight", None) for m in norms] + [None]
    bias = [getattr(m, "bias", None) for m in norms] + [None]
    if any(t is not None and t.stride(-1) != 1 for t in w + bias):  # (the kernel reads them densely)
        raise ValueError("qk_norm_rope: the norms' weight and bias must be contiguous [D] vectors")
    eps = [float(m.eps) if m is not None else 0.0 for m in norms] + [0.0]
    run = OP if torch.compiler.is_compiling() else _qk_norm_rope
    run(x, heads, out0, outs[1] if parts == 2 else None, norms[0] is not None, w[0], bias[0], w[1], bias[1],
        eps[0], eps[1], pos, cos, sin)
    return outs


def _qk_norm_rope(x: torch.Tensor, heads: int, out0: torch.Tensor, out1: Optional[torch.Tensor], has_norm: bool,
                  w0: Optional[torch.Tensor], b0: Optional[torch.Tensor], w1: Optional[torch.Tensor],
                  b1: Optional[torch.Tensor], eps0: float, eps1: float, pos: Optional[torch.Tensor],
                  cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]) -> None:
    """The launch behind :func:`qk_norm_rope` (arguments checked there; writes ``out0`` and ``out1``)."""
    B, n = x.shape[:2]
    D = out0.shape[-1]
    rope = pos is not None
    block_t = 64 if INTERPRET else BLOCK_T
    launch(_qk_norm_rope_kernel, (cdiv(n, block_t) * B,),
           x, pos if rope else x, w0 if w0 is not None else x, b0 if b0 is not None else x,
           w1 if w1 is not None else x, b1 if b1 is not None else x,
           cos if rope else x, sin if rope else x, out0, out1 if out1 is not None else out0, n, heads, eps0, eps1,
           x.stride(0), x.stride(1), pos.stride(0) if rope else 0, pos.stride(1) if rope else 0,
           out0.stride(0), out0.stride(1), out0.stride(2),
           D=D, PARTS=1 if out1 is None else 2, NORM=has_norm, HAS_W=w0 is not None, HAS_B=b0 is not None,
           ROPE=rope, BLOCK_T=block_t, num_warps=NUM_WARPS)


OP = register("elsa_vision::qk_norm_rope", _qk_norm_rope, mutates=("out0", "out1"))  # torch.compile's path
