"""ELSA's half-precision forward on Hopper (sm_90), written in Gluon: TMA loads, asynchronous wgmma.

The scan is attention.py's (the monoid (m, S, W) folded key tile by key tile, log2 units, P
rounded to the value dtype for the product while S sums it unrounded), and the statistics it
writes are the portable forward's, so the portable backward runs from them unchanged. What differs
is how the tiles move:

  * Q, K and V arrive by TMA (4-D tensor descriptors over [B, H, N, D], so any strides with a unit
    last dimension and 16-byte aligned others are read in place; rows past N are zero-filled).
  * K and V have rings of their own, each STAGES tiles deep: a K slot is free as soon as its QKᵀ
    has retired, a V slot once its P·V has, so K runs one product ahead of V.
  * The next tile's QKᵀ is issued (asynchronously) before the current tile's softmax, and P·V is
    left in flight across it: the tensor cores work while the softmax runs
    (FlashAttention-3's intra-warpgroup overlap).
  * One program owns BLOCK_M = 64·warpgroups query rows of one (batch, head); every warpgroup runs
    the same code on its 64 rows, and the scheduler interleaves one's softmax with another's
    products.

Tiles with no visible key are never loaded (causal: the triangle's dead tiles; keys past Nk); the
mask is applied only where a tile straddles the diagonal or the end of the keys.
"""
from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common import LOG2E
from .launch import CHECKED, cdiv

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
# Gluon is experimental: its API is the one of the Triton versions this file was checked against.
# ELSA_HOPPER=0 (or ENABLED = False) keeps every call on the portable kernels.
ENABLED = os.environ.get("ELSA_HOPPER", "1").strip() != "0" and CHECKED


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty,
            b, h, q0, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The producer warp: both warpgroups' Q tiles, then K and V tiles into their rings. A slot is
    refilled once both warpgroups have released it (k_empty / v_empty count two arrivals)."""
    WG_M: gl.constexpr = BLOCK_M // 2
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, q0, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [b, h, q0 + WG_M, 0], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        slot = j % STAGES
        free = ((j // STAGES) & 1) ^ 1  # parity of the release of this slot's previous tile
        mbarrier.wait(k_empty.index(slot), free, pred=j >= STAGES)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, h, j * BLOCK_N, 0], k_ready.index(slot), k_ring.index(slot))
        mbarrier.wait(v_empty.index(slot), free, pred=j >= STAGES)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, h, j * BLOCK_N, 0], v_ready.index(slot), v_ring.index(slot))


@gluon.jit
def _step(j, p16, acc, m_i, s_i, q, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, offs_m, offs_n, masked,
          Nq, Nk, qk_scale2, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
          FIRST: gl.constexpr):
    """Fold key tile j into the state: QKᵀ_j is issued, then P·V_(j−1) (p16: tile j−1's
    probabilities; acc already rescaled to tile j−1's max), and tile j's softmax runs while P·V_(j−1)
    is in flight. Returns tile j's probabilities and the state, acc rescaled to tile j's max.
    Nothing is in flight across calls: ptxas serialises every wgmma of a loop whose in-flight
    accumulators cross its back edge."""
    dtype: gl.constexpr = q.dtype
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = acc.type.layout
    P_L: gl.constexpr = p16.type.layout
    WG_M: gl.constexpr = p16.shape[0]
    slot = j % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q, k_ring.index(slot).reshape([BLOCK_N, D]).permute((1, 0)),
                          gl.zeros([WG_M, BLOCK_N], gl.float32, S_L), use_acc=False, is_async=True)
    if not FIRST:
        prev = (j + STAGES - 1) % STAGES
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        pv = warpgroup_mma(p16, v_ring.index(prev).reshape([BLOCK_N, D]), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])  # QKᵀ_j; P·V_(j−1) stays in flight
    else:
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
    mbarrier.arrive(k_empty.index(slot))  # QKᵀ_j has read its K slot
    if masked:
        n0 = j * BLOCK_N
        visible = gl.expand_dims(n0 + offs_n < Nk, 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(n0 + offs_n, 0) <= gl.expand_dims(offs_m + (Nk - Nq), 1))
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale2)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: p = 0, α = 0
    p = gl.exp2(s * qk_scale2 - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    s_i = s_i * alpha + gl.sum(p, axis=1)
    if not FIRST:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[pv])
        mbarrier.arrive(v_empty.index(prev))  # P·V_(j−1) has read its V slot
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L), assert_trivial=True), 1)
    p16 = gl.convert_layout(p.to(dtype), P_L, assert_trivial=True)
    return p16, acc, m_new, s_i


@gluon.jit
def _consumer(wg: gl.constexpr, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, Out, Stats,
              so_b, so_h, so_m, b, h, bh, q0, Nq, Nk, n_tiles, qk_scale2,
              D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr):
    """One warpgroup's 64 query rows [q0 + wg·64, +64): the scan over n_tiles key tiles, then the
    rows' output and statistics. Every warpgroup visits all n_tiles (a tile past a row's diagonal
    scores −inf there) so that each releases every slot."""
    WG_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_smem.dtype
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    r0 = q0 + wg * WG_M
    # tiles from here on need the mask: the partial last tile, or the first that reaches past the
    # diagonal of this warpgroup's first row
    mask_from = Nk // BLOCK_N
    if CAUSAL:
        mask_from = gl.minimum(mask_from, gl.maximum(r0 + 1 + Nk - Nq, 0) // BLOCK_N)

    q = q_smem.index(wg).reshape([WG_M, D])
    m_i = gl.full([WG_M], float("-inf"), gl.float32, ROW_S)
    s_i = gl.zeros([WG_M], gl.float32, ROW_S)
    acc = gl.zeros([WG_M, D], gl.float32, O_L)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    offs_m = r0 + gl.arange(0, WG_M, layout=ROW_S)

    mbarrier.wait(q_bar, 0)
    if n_tiles > 0:
        p16 = gl.zeros([WG_M, BLOCK_N], dtype, P_L)
        p16, acc, m_i, s_i = _step(0, p16, acc, m_i, s_i, q, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                                   offs_m, offs_n, 0 >= mask_from, Nq, Nk, qk_scale2, D, BLOCK_N, STAGES, CAUSAL, True)
        for j in range(1, n_tiles):
            p16, acc, m_i, s_i = _step(j, p16, acc, m_i, s_i, q, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                                       offs_m, offs_n, j >= mask_from, Nq, Nk, qk_scale2, D, BLOCK_N, STAGES, CAUSAL,
                                       False)
        last = (n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
        acc = warpgroup_mma(p16, v_ring.index(last).reshape([BLOCK_N, D]), acc)

    nonempty = s_i > 0
    inv = gl.convert_layout(1.0 / gl.where(nonempty, s_i, 1.0), ROW_O)
    out = (acc * gl.expand_dims(inv, 1)).to(Out.dtype.element_ty)
    rows_o = r0 + gl.arange(0, WG_M, layout=ROW_O)
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
    o_ptrs = (Out + b.to(gl.int64) * so_b + h.to(gl.int64) * so_h + gl.expand_dims(rows_o.to(gl.int64) * so_m, 1)
              + gl.expand_dims(cols_o, 0))
    gl.store(o_ptrs, out, mask=gl.expand_dims(rows_o < Nq, 1))
    row_ok = offs_m < Nq
    st = Stats + bh.to(gl.int64) * 2 * Nq + offs_m
    gl.store(st, gl.where(nonempty, m_i, float("inf")), mask=row_ok)
    gl.store(st + Nq, gl.where(nonempty, s_i, 1.0), mask=row_ok)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, Out, Stats, so_b, so_h, so_m, H, Nq, Nk, qk_scale2,
                D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """One program: query rows [pid_m·BLOCK_M, +BLOCK_M) of batch·head program_id(1), as two
    warpgroups of BLOCK_M / 2 rows and a producer warp (num_warps = 4: the first warpgroup).

    Out [B, H, Nq, D] (any strides, last one 1), Stats [B, H, 2, Nq] float32: (m in log2 units,
    S); (+inf, 1) for a row that sees no key."""
    dtype: gl.constexpr = q_desc.dtype
    qk_scale2 = qk_scale2.to(gl.float32)
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    q0 = pid_m * BLOCK_M
    k_end = Nk
    if CAUSAL:  # the last key any row of this block sees, + 1 (bottom-right aligned)
        k_end = gl.minimum(Nk, q0 + BLOCK_M + Nk - Nq)
    n_tiles = gl.cdiv(gl.maximum(k_end, 0), BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (0, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, Out, Stats, so_b, so_h, so_m,
                     b, h, bh, q0, Nq, Nk, n_tiles, qk_scale2, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
        (_consumer, (1, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, Out, Stats, so_b, so_h, so_m,
                     b, h, bh, q0, Nq, Nk, n_tiles, qk_scale2, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty,
                   b, h, q0, n_tiles, BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    block = [1, 1, rows, t.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float16 if t.dtype == torch.float16 else gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias, precision: str) -> bool:
    """Whether this forward takes the call: sm_90, half precision, no bias, D ∈ HEAD_DIMS, q/k/v
    with a unit last stride and 16-byte aligned bases and strides (what TMA reads)."""
    if not ENABLED or bias is not None or precision != "native" or q.dtype not in DTYPES or q.shape[-1] not in HEAD_DIMS:
        return False
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    for t in (q, k, v):
        if t.dtype != q.dtype or t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * 2 % 16 for s in t.stride()[:-1]):
            return False
    return True


def config(d: int, nq: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, STAGES, consumer registers)."""
    if d <= 64:
        return 128, 128, 3, 232
    return 128, 128, 2, 232


def forward(q, k, v, out, stats, scale: float, causal: bool) -> None:
    """Fill out [B,H,Nq,D] and stats [B,H,2,Nq] (attention.forward's contract) for inputs that
    ``serves`` accepts."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    bm, bn, stages, regs = config(D, Nq)
    qd, kd, vd = _descriptor(q, bm // 2), _descriptor(k, bn), _descriptor(v, bn)
    _fwd_kernel[(cdiv(Nq, bm), B * H)](
        qd, kd, vd, out, stats, out.stride(0), out.stride(1), out.stride(2), H, Nq, Nk, scale * LOG2E,
        D=D, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, CAUSAL=causal, CONSUMER_REGS=regs, num_warps=4)
