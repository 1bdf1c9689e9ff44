"""Nearest row by dot product, fused: for each source row, the largest dot product with any
destination row and that row's index, without forming the [Ns, Nd] score matrix.

Token merging (adapters/vggt.py) asks this of every global block: each source token's most
cosine-similar destination among ~10^5 (150K destinations against 265K sources at 400 VGGT
frames). Formed as a matmul followed by a max, the scores make a round trip through memory (half
a gigabyte per 2K sources) and the max is a second pass over them; here each program folds its
destination tiles into a running (max, argmax) state in registers — the same tile loop as the
attention forward, with the (max, first index) monoid in place of (m, S, W).

Operands are bf16 or fp16 (the caller's similarity dtype), products accumulate in float32, ties go
to the lowest destination index.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import WIDEN_HALF
from .launch import INTERPRET, cdiv, launch, on_device


@triton.jit
def _nearest_kernel(
    Src, Dst, Val, Idx, n_src, n_dst, C,
    stride_s, stride_d,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < n_src
    s_ptr = Src + rows[:, None].to(tl.int64) * stride_s + ks[None, :]
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK_M], tl.int32)
    for n0 in range(0, n_dst, BLOCK_N):
        col = n0 + cols
        col_ok = col < n_dst
        d_ptr = Dst + col[None, :].to(tl.int64) * stride_d + ks[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, C, BLOCK_K):
            if EVEN_K:
                a = tl.load(s_ptr + k0, mask=row_ok[:, None], other=0.0)
                b = tl.load(d_ptr + k0, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + ks) < C
                a = tl.load(s_ptr + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(d_ptr + k0, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if WIDEN_HALF:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        nan = ((acc != acc) & col_ok[None, :]).to(tl.int32)
        acc = tl.where(col_ok[None, :] & (nan == 0), acc, float("-inf"))
        tile_max = tl.max(acc, axis=1)
        tile_arg = tl.argmax(acc, axis=1, tie_break_left=True).to(tl.int32) + n0
        # strictly greater: an earlier tile keeps a tie, so the first maximal index wins overall
        better = tile_max > best
        best = tl.where(better, tile_max, best)
        arg = tl.where(better, tile_arg, arg)
        # a NaN score wins, as in torch.max (the first one: a row that has one keeps it)
        first_nan = (tl.max(nan, axis=1) > 0) & (best == best)
        best = tl.where(first_nan, float("nan"), best)
        arg = tl.where(first_nan, tl.argmax(nan, axis=1, tie_break_left=True).to(tl.int32) + n0, arg)
    tl.store(Val + rows, best, mask=row_ok)
    tl.store(Idx + rows, arg.to(tl.int64), mask=row_ok)


def supported(src: torch.Tensor, dst: torch.Tensor) -> Optional[str]:
    """None when the fused kernel serves (src, dst), else why not."""
    if not (src.is_cuda or INTERPRET):
        return "the fused kernel runs on CUDA tensors (or under TRITON_INTERPRET=1)"
    if src.dtype not in (torch.bfloat16, torch.float16) or dst.dtype != src.dtype:
        return f"the fused kernel takes bf16/fp16 rows of one dtype, got {src.dtype} and {dst.dtype}"
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1]:
        return f"expected src [Ns, C] and dst [Nd, C], got {tuple(src.shape)} and {tuple(dst.shape)}"
    if src.device != dst.device:
        return "src and dst are on different devices"
    return None


@on_device
def nearest(src: torch.Tensor, dst: torch.Tensor, config: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """src [Ns, C], dst [Nd, C] (bf16/fp16, the same dtype; rows as the caller wants them compared,
    e.g. unit-normalized for cosine similarity) → (best dot product [Ns] float32, index into dst [Ns]
    int64). Nd ≥ 1. ``config``: (block_m, block_n, block_k, warps, stages), for tuning."""
    why = supported(src, dst)
    if why is not None:
        raise ValueError(f"nearest: {why}; use a torch matmul and max instead")
    if dst.shape[0] == 0:
        raise ValueError("nearest: there are no destination rows")
    src = src if src.stride(1) == 1 else src.contiguous()
    dst = dst if dst.stride(1) == 1 else dst.contiguous()
    ns, C = src.shape
    val = torch.empty(ns, device=src.device, dtype=torch.float32)
    idx = torch.empty(ns, device=src.device, dtype=torch.int64)
    if ns == 0:
        return val, idx
    # 128×256 tiles: the fastest of the candidates swept at VGGT-merging sizes (benchmarks/frames.py profiles)
    bm, bn, bk, warps, stages = config or ((16, 16, 16, 1, 1) if INTERPRET else (128, 256, 64, 8, 3))
    launch(_nearest_kernel, (cdiv(ns, bm),), src, dst, val, idx, ns, dst.shape[0], C, src.stride(0), dst.stride(0),
           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=C % bk == 0, num_warps=warps, num_stages=stages)
    return val, idx
