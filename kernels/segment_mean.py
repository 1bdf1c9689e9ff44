"""Segment means of token rows, fused: the merge step of token merging (adapters/vggt/merging.py).

Each merged row is the mean of the rows of its tokens. Done with torch ops, every global block
pays, per tensor (q, k, v), a cast of all N rows to float32, a sort-based scatter-add (the
deterministic one), a division and a cast back: five passes over [N, H·D] and a sort of N keys.
Here one program per (merged row, batch element) reads its tokens' rows once, in the segment order
the plan sorted once, sums them in float32 (float64 for float64 rows), divides by the count and
writes the mean in the rows' dtype.

Exactness: the sum runs in ascending token order, the order of the CPU path's index_add_, and the
quotient is correctly rounded (div_rn, as torch divides), so the CPU interpreter gives bitwise the
CPU path's result in float32 and float64 (its bfloat16 casts truncate, where the GPU's round to
nearest as torch does); the sums are deterministic (no atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, launch, on_device
from .ops import no_tangents


@triton.jit
def _segment_mean_kernel(X, Y, Order, Offsets, N, M, sx_b, sx_n, sx_h, sx_d,
                         D: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, F64: tl.constexpr):
    """Grid (M, B): Y[b, m] = mean of X[b, Order[b, i]] for i in [Offsets[b, m], Offsets[b, m + 1]).
    X [B, N, H, D] (any strides), Y [B, M, H·D] contiguous, C = H·D, Order [B, N] int32, Offsets
    [B, M + 1] int64 (every segment non-empty). Sums in float64 with F64, else float32."""
    ACC: tl.constexpr = tl.float64 if F64 else tl.float32
    m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C
    x_col = (c // D).to(tl.int64) * sx_h + (c % D).to(tl.int64) * sx_d
    seg = Offsets + b * (M + 1) + m
    start = tl.load(seg)
    end = tl.load(seg + 1)
    xb = X + b * sx_b
    order = Order + b * N
    acc = tl.zeros([BLOCK_C], ACC)
    for i in range(start, end):
        tok = tl.load(order + i).to(tl.int64)
        acc += tl.load(xb + tok * sx_n + x_col, mask=c_ok, other=0.0).to(ACC)
    if F64:
        mean = acc / (end - start).to(ACC)  # (float64 division is correctly rounded)
    else:
        mean = tl.div_rn(acc, (end - start).to(ACC))
    tl.store(Y + (b * M + m) * C + c, mean.to(Y.dtype.element_ty), mask=c_ok)


def segments(slot: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [B, N] int32, offsets [B, M + 1] int64) of a plan's ``slot`` [B, N] (each token's merged
    row) and ``counts`` [B, M] (float32, exact integers ≥ 1): the tokens sorted by merged row, stably
    (ascending token index within a row), and where each row's tokens start."""
    B, M = counts.shape
    order = torch.argsort(slot, dim=1, stable=True).to(torch.int32)
    offsets = torch.zeros(B, M + 1, dtype=torch.int64, device=slot.device)
    torch.cumsum(counts.to(torch.int64), dim=1, out=offsets[:, 1:])
    return order, offsets


@on_device
def segment_mean(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [B, N, H, D] (any strides; CUDA, or the CPU under TRITON_INTERPRET=1) → [B, M, H, D]
    contiguous in x's dtype: row m is the mean of x's rows order[b, offsets[b, m] : offsets[b, m + 1]]
    (see :func:`segments`). No gradient: x must not require one (or carry a forward-AD tangent)."""
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError("segment_mean has no backward: call it on a tensor that does not require grad (or under "
                         "torch.no_grad())")
    no_tangents("segment_mean", (x,))
    if not (x.is_cuda or INTERPRET):
        raise ValueError("segment_mean runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1)")
    if x.dim() != 4:
        raise ValueError(f"segment_mean takes x [B, N, H, D], got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"segment_mean takes floating-point x, got {x.dtype}")
    B, N, H, D = x.shape
    if tuple(order.shape) != (B, N) or offsets.dim() != 2 or offsets.shape[0] != B or offsets.shape[1] < 1:
        raise ValueError(f"segment_mean: order {tuple(order.shape)} / offsets {tuple(offsets.shape)} do not fit "
                         f"x {tuple(x.shape)} (order [B, N], offsets [B, M + 1])")
    M = offsets.shape[1] - 1
    order, offsets = order.contiguous(), offsets.contiguous()  # (the kernel reads their rows densely)
    y = torch.empty(B, M, H, D, dtype=x.dtype, device=x.device)
    if M == 0 or B == 0:
        return y
    launch(_segment_mean_kernel, (M, B), x, y, order, offsets, N, M, *x.stride(), D=D, C=H * D,
           BLOCK_C=triton.next_power_of_2(H * D), F64=x.dtype == torch.float64, num_warps=1 if INTERPRET else 4)
    return y
