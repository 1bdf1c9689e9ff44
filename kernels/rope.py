"""q/k LayerNorm and 2-D rotary embedding in one pass over a fused qkv projection (VGGT's attention).

VGGT's attention forms q and k as qkv → per-head LayerNorm over the head dim → 2-D RoPE (the first
half of the head dim rotates with the token's y position, the second half with x). In PyTorch that
is a copy of each strided q/k slice, a LayerNorm over rows of 64 (a launch configuration made for
long rows, a large share of a long VGGT call), then a dozen float32 elementwise passes.
Here one program normalizes and rotates a block of tokens of one head, in float32 registers, and
writes q or k once, in the dtype attention will read (the autocast dtype under autocast).

Arithmetic: the LayerNorm of PyTorch (biased variance, rstd = 1/sqrt(var + eps), then weight and
bias) and the rotation x·cos + rotate(x)·sin with the module's own cos/sin tables, all in float32;
the sums of the mean and variance run in another order than PyTorch's, so results agree to float32
rounding, not bitwise.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, cdiv, launch
from .ops import register


@triton.jit
def _qk_norm_rope_kernel(
    X, Pos, W, Bias, Cos, Sin, Out,
    n_tok, H, eps,
    stride_xb, stride_xn, stride_pb, stride_pn, stride_ob, stride_on, stride_oh,
    D: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    eps = tl.cast(eps, tl.float32)  # inductor passes float64
    bh = tl.program_id(0)  # (batch·heads on the grid's 1st axis: CUDA caps the 2nd at 65535)
    pid_t = tl.program_id(1)
    b = bh // H
    h = bh % H
    HALF: tl.constexpr = D // 2
    QUART: tl.constexpr = D // 4
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D)
    # rotation partner within each half: r[i] = −x[i + D/4] for i < D/4, x[i − D/4] after
    half = cols // HALF
    i = cols % HALF
    perm = (i + QUART) % HALF + half * HALF
    ok = (t < n_tok)[:, None]
    row = X + b.to(tl.int64) * stride_xb + t[:, None].to(tl.int64) * stride_xn + h * D
    x = tl.load(row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    xr = x
    if ROPE:
        xr = tl.load(row + perm[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM:
        mean = tl.sum(x, axis=1) / D
        xc = x - mean[:, None]
        var = tl.sum(xc * xc, axis=1) / D
        rstd = 1.0 / tl.sqrt(var + eps)
        x = xc * rstd[:, None]
        xr = (xr - mean[:, None]) * rstd[:, None]
        if HAS_W:
            x = x * tl.load(W + cols).to(tl.float32)[None, :]
            xr = xr * tl.load(W + perm).to(tl.float32)[None, :]
        if HAS_B:
            x = x + tl.load(Bias + cols).to(tl.float32)[None, :]
            xr = xr + tl.load(Bias + perm).to(tl.float32)[None, :]
    if ROPE:
        xr = tl.where((i < QUART)[None, :], -xr, xr)
        p = tl.load(Pos + b.to(tl.int64) * stride_pb + t[:, None].to(tl.int64) * stride_pn + half[None, :],
                    mask=ok, other=0)
        tab = p * HALF + i[None, :]
        x = x * tl.load(Cos + tab, mask=ok, other=0.0) + xr * tl.load(Sin + tab, mask=ok, other=0.0)
    out = Out + b.to(tl.int64) * stride_ob + t[:, None].to(tl.int64) * stride_on + h * stride_oh + cols[None, :]
    tl.store(out, x.to(Out.dtype.element_ty), mask=ok)


def qk_norm_rope(x: torch.Tensor, heads: int, out: torch.Tensor, norm: Optional[torch.nn.Module] = None,
                 pos: Optional[torch.Tensor] = None, tables: Optional[tuple] = None) -> torch.Tensor:
    """x [B, n, ≥ heads·D] (the q or k slice of a qkv projection: row stride free, head h at columns
    h·D … h·D + D − 1, unit column stride) → out [B, n, heads, D] (any strides with a unit last one),
    normalized by ``norm`` (an nn.LayerNorm over D, or None) and, with ``pos`` [B, n, 2] (integer y, x)
    and ``tables`` (cos, sin) [P, D/2] float32 (row p: position p), rotated. Returns out."""
    B, n = x.shape[:2]
    D = out.shape[-1]
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("qk_norm_rope: x and out need a unit last stride")
    if out.shape != (B, n, heads, D) or x.shape[-1] < heads * D:
        raise ValueError(f"qk_norm_rope: out {tuple(out.shape)} does not fit x {tuple(x.shape)} with {heads} heads")
    if D & (D - 1) or D < 4:
        raise ValueError(f"qk_norm_rope: head dim must be a power of two ≥ 4, got {D}")
    rope = pos is not None
    if rope and (tables is None or tables[0].shape[1] != D // 2 or tables[0].dtype != torch.float32):
        raise ValueError("qk_norm_rope: rope needs float32 (cos, sin) tables of D/2 columns")
    w = getattr(norm, "weight", None) if norm is not None else None
    bias = getattr(norm, "bias", None) if norm is not None else None
    if n == 0 or B == 0:
        return out
    if rope:
        pos = pos if pos.stride(-1) == 1 else pos.contiguous()
        cos, sin = (t.contiguous() for t in tables)
    else:
        cos = sin = None
    eps = float(norm.eps) if norm is not None else 0.0
    run = OP if torch.compiler.is_compiling() else _qk_norm_rope
    run(x, heads, out, norm is not None, w, bias, eps, pos, cos, sin)
    return out


def _qk_norm_rope(x: torch.Tensor, heads: int, out: torch.Tensor, has_norm: bool, weight: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], eps: float, pos: Optional[torch.Tensor], cos: Optional[torch.Tensor],
                  sin: Optional[torch.Tensor]) -> None:
    """The launch behind :func:`qk_norm_rope` (arguments checked there; writes ``out``)."""
    B, n = x.shape[:2]
    D = out.shape[-1]
    rope = pos is not None
    block_t = 64 if INTERPRET else max(1, 4096 // D)
    launch(_qk_norm_rope_kernel, (B * heads, cdiv(n, block_t)),
           x, pos if rope else x, weight if weight is not None else x, bias if bias is not None else x,
           cos if rope else x, sin if rope else x, out, n, heads, eps,
           x.stride(0), x.stride(1), pos.stride(0) if rope else 0, pos.stride(1) if rope else 0,
           out.stride(0), out.stride(1), out.stride(2),
           D=D, NORM=has_norm, HAS_W=weight is not None, HAS_B=bias is not None, ROPE=rope,
           BLOCK_T=block_t, num_warps=4)


OP = register("elsa_vision::qk_norm_rope", _qk_norm_rope, mutates=("out",))  # torch.compile's path
