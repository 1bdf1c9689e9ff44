"""ELSA's half-precision forward on Hopper (sm_90), written in Gluon: TMA, warp specialisation, wgmma.

The scan is attention.py's (the monoid (m, S, W) folded key tile by key tile, log2 units, P
rounded to the value dtype for the product while S sums it unrounded), and the statistics it
writes are the portable forward's, so the portable backward runs from them unchanged. What differs
is how the work is laid out:

  * Persistent programs, one per SM, take work items (BLOCK_M query rows of one batch·head) in
    turn; causal calls take one program per item instead, so that the hardware balances the
    triangle's unequal items.
  * A producer warp loads Q, K and V by TMA (4-D tensor descriptors over [B, H, N, D]: any strides
    with a unit last dimension and 16-byte aligned others are read in place; rows past N are
    zero-filled) into a ring of STAGES slots, running ahead across items. K and V have barriers of
    their own: a K slot is released as soon as its QKᵀ has retired.
  * BLOCK_M / 64 consumer warpgroups of 64 rows each: per key tile a warpgroup issues QKᵀ_j and
    P·V_(j−1) asynchronously and runs tile j's softmax while P·V_(j−1) is in flight
    (FlashAttention-3's intra-warpgroup overlap); the scheduler interleaves one warpgroup's
    softmax with another's products.

Tiles with no visible key are never loaded (causal: the triangle's dead tiles; keys past Nk); the
mask is applied only where a tile straddles the diagonal or the end of the keys.
"""
from __future__ import annotations

import functools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common import LOG2E
from .launch import CHECKED, cdiv, launch, sm_count

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
# Gluon is experimental: its API is the one of the Triton versions this file was checked against.
# ELSA_HOPPER=0 (or ENABLED = False) keeps every call on the portable kernels; EVERYWHERE = True
# sends every call the kernel supports here, whatever the measured policy of ``serves`` says.
ENABLED = os.environ.get("ELSA_HOPPER", "1").strip() != "0" and CHECKED
EVERYWHERE = False


@gluon.jit
def _item(w, n_m, H, Nq, Nk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Work item w → (b, h, bh, q0, n_tiles): query rows [q0, q0 + BLOCK_M) of batch·head bh, and
    the key tiles they see. Query blocks of one head are consecutive (they share K/V in L2); with
    CAUSAL the longest rows go first, so the triangle's short items fill the tail."""
    pid_m = w % n_m
    bh = w // n_m
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    q0 = pid_m * BLOCK_M
    k_end = Nk
    if CAUSAL:  # the last key any row of this block sees, + 1 (bottom-right aligned)
        k_end = gl.minimum(Nk, q0 + BLOCK_M + Nk - Nq)
    n_tiles = gl.cdiv(gl.maximum(k_end, 0), BLOCK_N)
    return bh // H, bh % H, bh, q0, n_tiles


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
            H, Nq, Nk, n_m, n_items, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            CAUSAL: gl.constexpr):
    """The producer warp. Per item: every warpgroup's Q tile into Q buffer it % 2 (once the
    warpgroups have released that buffer's previous item), then the item's K and V tiles into their
    rings, whose positions run on across items. Every ring slot and Q buffer is released by all
    warpgroups (the empty barriers count one arrival per warpgroup)."""
    WG_M: gl.constexpr = q_desc.block_type.shape[2]
    NUM_WG: gl.constexpr = BLOCK_M // WG_M
    it = 0
    g = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, bh, q0, n_tiles = _item(w, n_m, H, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
        qb = it % 2
        mbarrier.wait(q_empty.index(qb), ((it // 2) & 1) ^ 1, pred=it >= 2)
        mbarrier.expect(q_ready.index(qb), NUM_WG * q_desc.block_type.nbytes)
        for i in gl.static_range(NUM_WG):
            tma.async_copy_global_to_shared(q_desc, [b, h, q0 + i * WG_M, 0], q_ready.index(qb),
                                            q_smem.index(NUM_WG * qb + i))
        for j in range(n_tiles):
            slot = g % STAGES
            free = ((g // STAGES) & 1) ^ 1  # parity of the release of this slot's previous tile
            mbarrier.wait(k_empty.index(slot), free, pred=g >= STAGES)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, h, j * BLOCK_N, 0], k_ready.index(slot), k_ring.index(slot))
            mbarrier.wait(v_empty.index(slot), free, pred=g >= STAGES)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [b, h, j * BLOCK_N, 0], v_ready.index(slot), v_ring.index(slot))
            g += 1
        it += 1


@gluon.jit
def _step(j, g, p16, acc, m_i, s_i, q, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, offs_m, offs_n, masked,
          Nq, Nk, qk_scale2, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
          FIRST: gl.constexpr):
    """Fold key tile j (ring position g) into the state: QKᵀ_j is issued, then P·V_(j−1) (p16: tile
    j−1's probabilities; acc already rescaled to tile j−1's max), and tile j's softmax runs while
    P·V_(j−1) is in flight. Returns tile j's probabilities and the state, acc rescaled to tile j's
    max. Nothing is in flight across calls: ptxas serialises every wgmma of a loop whose in-flight
    accumulators cross its back edge."""
    dtype: gl.constexpr = q.dtype
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = acc.type.layout
    P_L: gl.constexpr = p16.type.layout
    WG_M: gl.constexpr = p16.shape[0]
    slot = g % STAGES
    mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
    if not FIRST:
        prev = (g + STAGES - 1) % STAGES
        mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
    s_tok = warpgroup_mma(q, k_ring.index(slot).reshape([BLOCK_N, D]).permute((1, 0)),
                          gl.zeros([WG_M, BLOCK_N], gl.float32, S_L), use_acc=False, is_async=True)
    if not FIRST:
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
    p = gl.exp2(gl.fma(s, qk_scale2, -gl.expand_dims(m_use, 1)))
    alpha = gl.exp2(m_i - m_use)
    s_i = s_i * alpha + gl.sum(p, axis=1)
    if not FIRST:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[pv])
        mbarrier.arrive(v_empty.index(prev))  # P·V_(j−1) has read its V slot
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L), assert_trivial=True), 1)
    p16 = gl.convert_layout(p.to(dtype), P_L, assert_trivial=True)
    return p16, acc, m_new, s_i


@gluon.jit
def _consumer(wg: gl.constexpr, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out,
              Stats, so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, qk_scale2, D: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """Warpgroup wg: per item, its 64 query rows [q0 + wg·64, +64) scanned over the item's key
    tiles, then the rows' output and statistics. Every warpgroup visits all of an item's tiles (a
    tile past a row's diagonal scores −inf there), so that each releases every slot."""
    WG_M: gl.constexpr = 64
    NUM_WG: gl.constexpr = BLOCK_M // WG_M
    dtype: gl.constexpr = q_smem.dtype
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    qk_scale2 = qk_scale2.to(gl.float32)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
    it = 0
    g = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, bh, q0, n_tiles = _item(w, n_m, H, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
        r0 = q0 + wg * WG_M
        # tiles from here on need the mask: the partial last tile, or the first that reaches past
        # the diagonal of this warpgroup's first row
        mask_from = Nk // BLOCK_N
        if CAUSAL:
            mask_from = gl.minimum(mask_from, gl.maximum(r0 + 1 + Nk - Nq, 0) // BLOCK_N)
        offs_m = r0 + gl.arange(0, WG_M, layout=ROW_S)
        m_i = gl.full([WG_M], float("-inf"), gl.float32, ROW_S)
        s_i = gl.zeros([WG_M], gl.float32, ROW_S)
        acc = gl.zeros([WG_M, D], gl.float32, O_L)
        qb = it % 2
        mbarrier.wait(q_ready.index(qb), (it // 2) & 1)
        q = q_smem.index(NUM_WG * qb + wg).reshape([WG_M, D])
        if n_tiles > 0:
            p16 = gl.zeros([WG_M, BLOCK_N], dtype, P_L)
            p16, acc, m_i, s_i = _step(0, g, p16, acc, m_i, s_i, q, k_ring, v_ring, k_ready, k_empty, v_ready,
                                       v_empty, offs_m, offs_n, 0 >= mask_from, Nq, Nk, qk_scale2,
                                       D, BLOCK_N, STAGES, CAUSAL, True)
            for j in range(1, n_tiles):
                p16, acc, m_i, s_i = _step(j, g + j, p16, acc, m_i, s_i, q, k_ring, v_ring, k_ready, k_empty, v_ready,
                                           v_empty, offs_m, offs_n, j >= mask_from, Nq, Nk,
                                           qk_scale2, D, BLOCK_N, STAGES, CAUSAL, False)
            mbarrier.arrive(q_empty.index(qb))  # every QKᵀ of the item has read Q
            last = (g + n_tiles - 1) % STAGES
            mbarrier.wait(v_ready.index(last), ((g + n_tiles - 1) // STAGES) & 1)
            acc = warpgroup_mma(p16, v_ring.index(last).reshape([BLOCK_N, D]), acc)
            mbarrier.arrive(v_empty.index(last))
        else:
            mbarrier.arrive(q_empty.index(qb))
        g += n_tiles
        it += 1

        nonempty = s_i > 0
        inv = gl.convert_layout(1.0 / gl.where(nonempty, s_i, 1.0), ROW_O)
        out = (acc * gl.expand_dims(inv, 1)).to(Out.dtype.element_ty)
        rows_o = r0 + gl.arange(0, WG_M, layout=ROW_O)
        o_ptrs = (Out + b.to(gl.int64) * so_b + h.to(gl.int64) * so_h
                  + gl.expand_dims(rows_o.to(gl.int64) * so_m, 1) + gl.expand_dims(cols_o, 0))
        gl.store(o_ptrs, out, mask=gl.expand_dims(rows_o < Nq, 1))
        row_ok = offs_m < Nq
        st = Stats + bh.to(gl.int64) * 2 * Nq + offs_m
        gl.store(st, gl.where(nonempty, m_i, float("inf")), mask=row_ok)
        gl.store(st + Nq, gl.where(nonempty, s_i, 1.0), mask=row_ok)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, Out, Stats, so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, qk_scale2,
                D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Persistent: program p takes work items p, p + programs, … (see _item), each BLOCK_M query
    rows of one batch·head, with BLOCK_M / 64 consumer warpgroups of 64 rows and a producer warp
    (num_warps = 4: the first warpgroup).

    Out [B, H, Nq, D] (any strides, last one 1), Stats [B, H, 2, Nq] float32: (m in log2 units,
    S); (+inf, 1) for a row that sees no key."""
    dtype: gl.constexpr = q_desc.dtype
    NUM_WG: gl.constexpr = BLOCK_M // 64
    q_smem = gl.allocate_shared_memory(dtype, [2 * NUM_WG] + q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NUM_WG)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)
        mbarrier.init(v_empty.index(i), count=NUM_WG)
    fence_async_shared()

    # one literal partition list per warpgroup count: Gluon 3.6 builds it at compile time and takes
    # neither a comprehension nor the consumers' arguments grouped into tuples
    if NUM_WG == 3:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out, Stats,
                         so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, qk_scale2, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
            (_consumer, (1, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out, Stats,
                         so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, qk_scale2, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
            (_consumer, (2, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out, Stats,
                         so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, qk_scale2, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready,
                       v_empty, H, Nq, Nk, n_m, n_items, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out, Stats,
                         so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, qk_scale2, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
            (_consumer, (1, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out, Stats,
                         so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, qk_scale2, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready,
                       v_empty, H, Nq, Nk, n_m, n_items, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, 24])


@functools.lru_cache(maxsize=64)
def _layout(block: tuple, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float16 if dtype == torch.float16 else gl.bfloat16)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """The [B, H, N, D] descriptor of t with blocks of ``rows`` rows. Built without the dataclass's
    checks (host time on every call): ``serves`` has checked what they check."""
    block = (1, 1, rows, t.shape[-1])
    d = TensorDescriptor.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = (
        t, list(t.shape), list(t.stride()), list(block), _layout(block, t.dtype), "zero")
    return d


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias, precision: str) -> bool:
    """Whether this forward can take the call: sm_90, half precision, no bias, D ∈ HEAD_DIMS, q/k/v
    with a unit last stride and 16-byte aligned bases and strides (what TMA reads)."""
    if not ENABLED or bias is not None or precision != "native" or q.dtype not in DTYPES or q.shape[-1] not in HEAD_DIMS:
        return False
    if not q.is_cuda or _capability(q.device.index or 0) != (9, 0):
        return False
    for t in (q, k, v):
        if t.dtype != q.dtype or t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * 2 % 16 for s in t.stride()[:-1]):
            return False
    return True


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias, precision: str, causal: bool) -> bool:
    """Whether this forward takes the call: ``supports`` it, and it measured faster than the
    portable forward there (benchmarks/results/<device>/attention_hopper.csv, bf16, CUDA-graph
    replays): at D = 128 every non-causal call and causal ones from 2048 keys; at D = 64 from 1024
    keys, causal from 4096. Below, a block of 128 or 192 rows is mostly padding or the diagonal's
    masked tile, and the portable kernel's smaller tiles are ahead. ``EVERYWHERE`` (tests,
    benchmarks) takes every call it supports."""
    if not supports(q, k, v, bias, precision):
        return False
    if EVERYWHERE:
        return True
    nk = k.shape[2]
    if q.shape[-1] == 128:
        return not causal or nk >= 2048
    return nk >= (4096 if causal else 1024)


def config(d: int, nq: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, STAGES, consumer registers): BLOCK_M / 64 consumer warpgroups. At D = 64
    a third warpgroup (192 rows, 160 registers each) keeps the tensor cores busier while the
    others run their softmax; at D = 128 its accumulators would not fit, and for short rows its
    last block is mostly padding."""
    if d <= 64:
        return (192, 128, 3, 160) if nq > 256 else (128, 128, 3, 232)
    return 128, 128, 2, 232


def forward(q, k, v, out, stats, scale: float, causal: bool) -> None:
    """Fill out [B,H,Nq,D] and stats [B,H,2,Nq] (attention.forward's contract) for inputs that
    ``supports`` accepts."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    bm, bn, stages, regs = config(D, Nq)
    qd, kd, vd = _descriptor(q, 64), _descriptor(k, bn), _descriptor(v, bn)
    n_m = cdiv(Nq, bm)
    n_items = n_m * B * H
    # causal items differ in length: one program per item lets the hardware balance them (a static
    # round robin over SMs aliases with the items' order); others run one persistent program per SM
    programs = n_items if causal else min(n_items, sm_count(q.device.index or 0))
    launch(_fwd_kernel, (programs,), qd, kd, vd, out, stats, out.stride(0), out.stride(1), out.stride(2), H, Nq, Nk,
           n_m, n_items, scale * LOG2E, D=D, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, CAUSAL=causal,
           CONSUMER_REGS=regs, num_warps=4)
