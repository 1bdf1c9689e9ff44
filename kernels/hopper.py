"""ELSA's half-precision and float32 (fp16x3) forward and backward on Hopper (sm_90), written in
Gluon: TMA, warp specialisation, wgmma.

The scan is attention.py's (the monoid (m, S, W) folded key tile by key tile, log2 units, P
rounded to the value dtype for the product while S sums it unrounded; fp16x3: see below), and
the statistics it writes are the portable forward's, so either backward runs from either
forward. What differs is how the work is laid out:

  * Persistent programs, one per SM, take work items (BLOCK_M query rows of one batch·head) in
    turn, a last round that would leave programs idle re-cut into shorter items (_item, _tail);
    causal calls take one program per item instead, so that the hardware balances the
    triangle's unequal items.
  * A producer warp loads Q, K and V by TMA (4-D tensor descriptors over [B, H, N, D]: any strides
    with a unit last dimension and 16-byte aligned others are read in place; rows past N are
    zero-filled, or with fp16x3 read from the lo half: keys there are masked and query rows there
    never stored) into a ring of STAGES slots, running ahead across items. K and V have barriers of
    their own: a K slot is released as soon as its QKᵀ has retired.
  * BLOCK_M / 64 consumer warpgroups of 64 rows each: per key tile a warpgroup issues QKᵀ_j and
    P·V_(j−1) asynchronously, then tile j's softmax; the scheduler interleaves one warpgroup's
    softmax with another's products. The softmax does not run under the warpgroup's own P·V_(j−1)
    (FlashAttention-3's intra-warpgroup overlap): ptxas waits for it at the start of the block
    that holds the softmax, unless it has a copy in each arm of the mask branch (``overlaps``:
    at D = 128 over more than SHORT_ROWS keys; benchmarks/window_compile.py --hopper counts both
    from the SASS).
  * Each warpgroup stores its rows of O by TMA, from a staging tile in shared memory (TMA_OUT):
    attention's O is a [B, H, N, D] view of a token-major [B, N, H, D] buffer, whose rows a
    st.global from the wgmma accumulator layout writes 4 bytes per thread at a time, H·D apart.

Tiles with no visible key are never loaded (causal: the triangle's dead tiles; keys past Nk); the
mask is applied only where a tile straddles the diagonal or the end of the keys.

float32 in fp16x3 takes the same forward (PARTS = 2): a plain Triton pass (_split_kernel) writes
q, k and v, scaled by attention._f16_scales_kernel's powers of two, as float16 (hi, lo) parts;
each tile is then two shared-memory buffers, QKᵀ and P·V three products each (common.dot3's
terms), and each tile's P·V is added to the running W outside the tensor cores (see _pv). The
parts are made for chunks of batch·heads at a time (forward, SPLIT_CHUNK_BYTES).

The backward (deterministic: no atomics) is two kernels: dQ with the queries stationary (the
forward's items and producer warp), which also forms the rows' statistics, then dK/dV with the keys
stationary (each warpgroup owns 64 keys, the query tiles stream past); see the section "backward"
below. In fp16x3 (PARTS = 2) a plain Triton pass (_bwd_split_kernel) first writes the float16
parts of q, k, v and dO at the head scales of the portable fp16x3 backward, q's rows once more
rescaled for dK's product, and the rows' statistics; every product is then three.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common import LOG2E, dk_units, ds_units, split_f16
from .launch import CHECKED, Launch, cdiv, hopper_requested, launch, prepared, register_switches, sm_count
from .limits import HOPPER_HEAD_DIMS, HOPPER_SPLIT_HEAD_DIMS

DTYPES = (torch.float16, torch.bfloat16)
# HOPPER_SPLIT_HEAD_DIMS (float32 in fp16x3): its tiles are twice as many float16 buffers, which fit
# the shared memory at D = 64 (a power of two: the kernels read Scales' rows as 2 + D long, 2 + D_PAD)
# Gluon is experimental: its API is the one of the Triton versions this file was checked against.
# ELSA_HOPPER=0 (or ENABLED = False) keeps every call on the portable kernels; EVERYWHERE = True
# sends every call the kernel supports here, whatever the measured policy of ``serves`` says.
ENABLED = hopper_requested() and CHECKED
EVERYWHERE = False
# TMA_OUT = False stores O and the gradients from registers (gl.store), as before the staging tiles
# (an A/B switch: benchmarks/results/<device>/tma_out_ab.csv, tma_grads_ab.csv); float32's fp16x3
# always does (_tma_writable)
TMA_OUT = True
# BACKWARD = False keeps every backward on the portable kernels (serves_backward does not depend
# on which forward ran: the statistics are the same)
BACKWARD = True
# OVERLAP = True gives each key tile's softmax a copy in both arms of the mask branch (_step), so
# that ptxas, which puts the wait for P·V_(j−1) at the start of the block holding the softmax,
# puts it after the exponentials: FlashAttention-3's intra-warpgroup overlap, in the SASS
# (benchmarks/window_compile.py --hopper). None (the default) takes it where it measured faster
# (``overlaps``); True / False force it (an A/B switch for tests and benchmarks).
OVERLAP = None


def overlaps(d: int, nk: int, split: bool) -> bool:
    """Whether the forward at head dim d over nk keys (``split``: fp16x3's float16 parts) runs the
    overlapped softmax: ``OVERLAP`` where set, else at D = 128 in bf16/fp16 over more than
    SHORT_ROWS keys, where it measured 0.6–5% faster on an H200 in two runs, causal and not, 577 to
    16K tokens (benchmarks/results/<device>/attention_hopper_fwd_overlap_ab_1205.csv, where
    "elsa-gluon" is the plain step, and attention_hopper_fwd_1205.csv, "elsa-gluon-overlap" against
    "elsa-gluon-plain"). At 197 keys (two key tiles) it measured 6–8% slower without a mask (causal
    calls that short take the portable forward: ``serves``), and at D = 64 0.5–9% slower at every
    length the Gluon forward serves: its larger code costs more than it gains where the 192-row
    items' three consumer warpgroups already hide one's softmax under the others' products."""
    if OVERLAP is not None:
        return bool(OVERLAP)
    return d == 128 and nk > SHORT_ROWS and not split


# The persistent kernels' item counts are not specialised on: Triton would compile a kernel per
# divisibility class of each (n_items and t0 took a new class at most new VGGT frame counts, seconds
# per Gluon compile), and they only bound the item loop. The sizes stay specialised: leaving H, Nq
# and Nk out too measured 1–3% slower at 16K (H100), and they take at most two classes per shape.
_COUNTS = ["n_m", "n_items", "t0"]


@gluon.constexpr_function
def _acc_layout(n):
    """The register layout of one warpgroup's wgmma accumulator with n columns (64 rows, 4 warps)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _item(w, t0, n_m, H, Nq, Nk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Work item w → (b, h, bh, q0, n_tiles, rows): query rows [q0, q0 + rows) of batch·head bh,
    and the key tiles they see. Query blocks of one head are consecutive (they share K/V in L2);
    with CAUSAL the longest rows go first, so the triangle's short items fill the tail.

    Items from t0 on (the tail; t0 = the number of items: none) are shorter, rows = BLOCK_M − 64:
    they re-cut the rows that items t0, t0 + 1, … of BLOCK_M rows would have covered (the rest of
    head t0 // n_m, then every later head), so that a last round of items that would fill only
    part of the programs spreads over all of them (see _tail). Not with CAUSAL."""
    TAIL_M: gl.constexpr = BLOCK_M - 64 if BLOCK_M > 64 else 64  # (64-row items have no tail: t0 = n_items)
    pid_m = w % n_m
    bh = w // n_m
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    q0 = pid_m * BLOCK_M
    # (branch-free: the tail's head and first row, blended in where w ≥ t0)
    tail = (w >= t0).to(gl.int32)
    u = gl.maximum(w - t0, 0)
    first_q = (t0 % n_m) * BLOCK_M
    c0 = gl.cdiv(Nq - first_q, TAIL_M)
    c = gl.cdiv(Nq, TAIL_M)
    in_first = (u < c0).to(gl.int32)
    u2 = gl.maximum(u - c0, 0)
    bh_t = t0 // n_m + (1 - in_first) * (1 + u2 // c)
    q0_t = in_first * (first_q + u * TAIL_M) + (1 - in_first) * (u2 % c) * TAIL_M
    bh = tail * bh_t + (1 - tail) * bh
    q0 = tail * q0_t + (1 - tail) * q0
    rows = BLOCK_M - 64 * tail
    k_end = Nk
    if CAUSAL:  # the last key any row of this block sees, + 1 (bottom-right aligned)
        k_end = gl.minimum(Nk, q0 + BLOCK_M + Nk - Nq)
    n_tiles = gl.cdiv(gl.maximum(k_end, 0), BLOCK_N)
    return bh // H, bh % H, bh, q0, n_tiles, rows


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty,
            v_ready, v_empty, H, Nq, Nk, n_m, n_items, t0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, CAUSAL: gl.constexpr, WITH_DO: gl.constexpr, PARTS: gl.constexpr):
    """The producer warp of the query-stationary kernels (the forward, the backward's dQ). Per
    item: every warpgroup's Q tile (and with WITH_DO its dO tile, on the same barrier) into buffer
    it % 2 (once the warpgroups have released that buffer's previous item), then the item's K and V
    tiles into their rings, whose positions run on across items. Every ring slot and Q buffer is
    released by all warpgroups (the empty barriers count one arrival per warpgroup).

    PARTS = 2 (fp16x3): q, k, v (and dO) are float16 [B, H, 2N, D] tensors, a row's hi part at row
    r and its lo part at row N + r (see _split_kernel, _bwd_split_kernel); each tile is two tiles,
    hi then lo, in consecutive buffers on one barrier."""
    WG_M: gl.constexpr = q_desc.block_type.shape[2]
    NUM_WG: gl.constexpr = BLOCK_M // WG_M
    NBYTES: gl.constexpr = (2 if WITH_DO else 1) * PARTS * NUM_WG * q_desc.block_type.nbytes
    it = 0
    g = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, bh, q0, n_tiles, rows = _item(w, t0, n_m, H, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
        qb = it % 2
        mbarrier.wait(q_empty.index(qb), ((it // 2) & 1) ^ 1, pred=it >= 2)
        mbarrier.expect(q_ready.index(qb), NBYTES)
        for i in gl.static_range(NUM_WG):
            for part in gl.static_range(PARTS):
                tma.async_copy_global_to_shared(q_desc, [b, h, q0 + i * WG_M + part * Nq, 0], q_ready.index(qb),
                                                q_smem.index(PARTS * (NUM_WG * qb + i) + part))
            if WITH_DO:
                for part in gl.static_range(PARTS):
                    tma.async_copy_global_to_shared(do_desc, [b, h, q0 + i * WG_M + part * Nq, 0], q_ready.index(qb),
                                                    do_smem.index(PARTS * (NUM_WG * qb + i) + part))
        for j in range(n_tiles):
            slot = g % STAGES
            free = ((g // STAGES) & 1) ^ 1  # parity of the release of this slot's previous tile
            mbarrier.wait(k_empty.index(slot), free, pred=g >= STAGES)
            mbarrier.expect(k_ready.index(slot), PARTS * k_desc.block_type.nbytes)
            for part in gl.static_range(PARTS):
                tma.async_copy_global_to_shared(k_desc, [b, h, j * BLOCK_N + part * Nk, 0], k_ready.index(slot),
                                                k_ring.index(PARTS * slot + part))
            mbarrier.wait(v_empty.index(slot), free, pred=g >= STAGES)
            mbarrier.expect(v_ready.index(slot), PARTS * v_desc.block_type.nbytes)
            for part in gl.static_range(PARTS):
                tma.async_copy_global_to_shared(v_desc, [b, h, j * BLOCK_N + part * Nk, 0], v_ready.index(slot),
                                                v_ring.index(PARTS * slot + part))
            g += 1
        it += 1


@gluon.jit
def _scores(q, q_lo, k_ring, i, BLOCK_N: gl.constexpr, D: gl.constexpr, PARTS: gl.constexpr):
    """Q·Kᵀ of the K tile in ring buffers i (hi) and i + 1 (lo, PARTS = 2), issued asynchronously:
    with PARTS = 2 the three products of the float16 split (common.dot3's order: the small cross
    terms first, lo·lo dropped) on one accumulator. → the accumulator's token."""
    WG_M: gl.constexpr = q.shape[0]
    S_L: gl.constexpr = _acc_layout(BLOCK_N)
    k = k_ring.index(i).reshape([BLOCK_N, D]).permute((1, 0))
    if PARTS == 2:
        k_lo = k_ring.index(i + 1).reshape([BLOCK_N, D]).permute((1, 0))
        tok = warpgroup_mma(q, k_lo, gl.zeros([WG_M, BLOCK_N], gl.float32, S_L), use_acc=False, is_async=True)
        tok = warpgroup_mma(q_lo, k, tok, is_async=True)
        return warpgroup_mma(q, k, tok, is_async=True)
    else:
        return warpgroup_mma(q, k, gl.zeros([WG_M, BLOCK_N], gl.float32, S_L), use_acc=False, is_async=True)


@gluon.jit
def _pv(p16, p_lo, v_ring, i, acc, BLOCK_N: gl.constexpr, D: gl.constexpr, PARTS: gl.constexpr):
    """P·V of the V tile in ring buffers i (and i + 1, its lo part, PARTS = 2: then p16 and p_lo are
    P·2^14's float16 parts), issued asynchronously. → the token of acc + P·V, or with PARTS = 2 of
    the tile's P·V alone, which _fold adds to acc: the tensor cores' accumulation into a running
    sum many tiles larger truncates the small cross terms (2⁻¹¹ of the sum) and made the error
    grow with the number of key tiles (30× the portable forward's at 4K keys)."""
    v = v_ring.index(i).reshape([BLOCK_N, D])
    if PARTS == 2:
        O_L: gl.constexpr = acc.type.layout
        zero = gl.zeros([p16.shape[0], D], gl.float32, O_L)
        tok = warpgroup_mma(p16, v_ring.index(i + 1).reshape([BLOCK_N, D]), zero, use_acc=False, is_async=True)
        tok = warpgroup_mma(p_lo, v, tok, is_async=True)
        return warpgroup_mma(p16, v, tok, is_async=True)
    else:
        return warpgroup_mma(p16, v, acc, is_async=True)


@gluon.jit
def _fold(acc, tok, PARTS: gl.constexpr):
    """The running W after _pv's products (token tok) have retired."""
    if PARTS == 2:
        return acc + warpgroup_mma_wait(num_outstanding=0, deps=[tok])
    else:
        return warpgroup_mma_wait(num_outstanding=0, deps=[tok])


@gluon.jit
def _masked(s, j, offs_m, offs_n, Nq, Nk, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Key tile j's logits with −inf where a key is past Nk or (CAUSAL) past a row's diagonal."""
    n0 = j * BLOCK_N
    visible = gl.expand_dims(n0 + offs_n < Nk, 0)
    if CAUSAL:
        visible = visible & (gl.expand_dims(n0 + offs_n, 0) <= gl.expand_dims(offs_m + (Nk - Nq), 1))
    return gl.where(visible, s, float("-inf"))


@gluon.jit
def _softmax(s, m_i, s_i, qk_scale2):
    """One key tile's online softmax, log2 units: (m_new, P, α = 2^(m_i − m_new), s_i·α + ΣP)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale2)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: p = 0, α = 0
    p = gl.exp2(gl.fma(s, qk_scale2, -gl.expand_dims(m_use, 1)))
    alpha = gl.exp2(m_i - m_use)
    return m_new, p, alpha, s_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _step(j, g, p16, p_lo, acc, m_i, s_i, q, q_lo, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, offs_m,
          offs_n, masked, Nq, Nk, qk_scale2, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
          CAUSAL: gl.constexpr, FIRST: gl.constexpr, PARTS: gl.constexpr, OVERLAP: gl.constexpr):
    """Fold key tile j (ring position g) into the state: QKᵀ_j is issued, then P·V_(j−1) (p16, p_lo:
    tile j−1's probabilities; acc already rescaled to tile j−1's max), then tile j's softmax (under
    P·V_(j−1) with OVERLAP only, which puts a copy of it in each arm of the mask branch: see the
    module's docstring). Returns tile j's probabilities and the state, acc rescaled to tile j's
    max. Nothing is in flight across calls: ptxas serialises every wgmma of a loop whose
    in-flight accumulators cross its back edge. PARTS = 2 (fp16x3): the products are split three
    ways (_scores, _pv) and P goes in as P·2^14's float16 (hi, lo) parts; else p_lo is p16."""
    O_L: gl.constexpr = acc.type.layout
    P_L: gl.constexpr = p16.type.layout
    slot = g % STAGES
    mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
    if not FIRST:
        prev = (g + STAGES - 1) % STAGES
        mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
    s_tok = _scores(q, q_lo, k_ring, PARTS * slot, BLOCK_N, D, PARTS)
    if not FIRST:
        pv = _pv(p16, p_lo, v_ring, PARTS * prev, acc, BLOCK_N, D, PARTS)
        # QKᵀ_j's products retired; P·V_(j−1)'s (one per part pairing) stay in flight
        s = warpgroup_mma_wait(num_outstanding=1 if PARTS == 1 else 3, deps=[s_tok])
    else:
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
    mbarrier.arrive(k_empty.index(slot))  # QKᵀ_j has read its K slot
    if OVERLAP:
        # (the wait in _fold then opens the join block: ptxas keeps it there, after both copies)
        if masked:
            m_new, p, alpha, s_i = _softmax(_masked(s, j, offs_m, offs_n, Nq, Nk, BLOCK_N, CAUSAL), m_i, s_i,
                                            qk_scale2)
        else:
            m_new, p, alpha, s_i = _softmax(s, m_i, s_i, qk_scale2)
    else:
        if masked:
            s = _masked(s, j, offs_m, offs_n, Nq, Nk, BLOCK_N, CAUSAL)
        m_new, p, alpha, s_i = _softmax(s, m_i, s_i, qk_scale2)
    if not FIRST:
        acc = _fold(acc, pv, PARTS)
        mbarrier.arrive(v_empty.index(prev))  # P·V_(j−1) has read its V slot
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L), assert_trivial=True), 1)
    if PARTS == 2:  # P·2^14 < 2^15: float16's range, as the portable fp16x3 fold (common.pv)
        p = p * 16384.0
        p_hi = p.to(gl.float16)
        p16 = gl.convert_layout(p_hi, P_L, assert_trivial=True)
        p_lo = gl.convert_layout((p - p_hi.to(gl.float32)).to(gl.float16), P_L, assert_trivial=True)
    else:
        p16 = gl.convert_layout(p.to(p16.dtype), P_L, assert_trivial=True)
        p_lo = p16
    return p16, p_lo, acc, m_new, s_i


@gluon.jit
def _consumer(wg: gl.constexpr, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out,
              o_desc, o_smem, Stats, Scales, so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, t0, qk_scale2,
              D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, PARTS: gl.constexpr, TMA_OUT: gl.constexpr, OVERLAP: gl.constexpr):
    """Warpgroup wg: per item, its 64 query rows [q0 + wg·64, +64) scanned over the item's key
    tiles, then the rows' output and statistics. Every warpgroup visits all of an item's tiles (a
    tile past a row's diagonal scores −inf there), so that each releases every slot; in a tail item
    (see _item) the last warpgroup has no rows and only waits for and releases them."""
    qk_scale2 = qk_scale2.to(gl.float32)
    it = 0
    g = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, bh, q0, n_tiles, rows = _item(w, t0, n_m, H, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
        if wg * 64 >= rows:
            _pass(it, g, n_tiles, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, STAGES)
        else:
            _fold_item(wg, it, g, b, h, bh, q0, n_tiles, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty,
                       v_ready, v_empty, Out, o_desc, o_smem, Stats, Scales, so_b, so_h, so_m, Nq, Nk, qk_scale2, D,
                       BLOCK_M, BLOCK_N, STAGES, CAUSAL, PARTS, TMA_OUT, OVERLAP)
        g += n_tiles
        it += 1
    if TMA_OUT:
        tma.store_wait(0)


@gluon.jit
def _pass(it, g, n_tiles, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, STAGES: gl.constexpr):
    """A warpgroup with no rows in the item: wait for its Q buffer and each of its K/V slots and
    release them (waiting first keeps every release in the phase it belongs to)."""
    qb = it % 2
    mbarrier.wait(q_ready.index(qb), (it // 2) & 1)
    mbarrier.arrive(q_empty.index(qb))
    for j in range(n_tiles):
        slot = (g + j) % STAGES
        phase = ((g + j) // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.arrive(k_empty.index(slot))
        mbarrier.wait(v_ready.index(slot), phase)
        mbarrier.arrive(v_empty.index(slot))


@gluon.jit
def _fold_item(wg: gl.constexpr, it, g, b, h, bh, q0, n_tiles, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
               k_empty, v_ready, v_empty, Out, o_desc, o_smem, Stats, Scales, so_b, so_h, so_m, Nq, Nk, qk_scale2,
               D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, PARTS: gl.constexpr, TMA_OUT: gl.constexpr, OVERLAP: gl.constexpr):
    """Warpgroup wg's 64 rows [q0 + wg·64, +64) of one item (ring position g, Q buffer it % 2):
    the scan over the item's key tiles, then the rows' output and statistics. PARTS = 2 (fp16x3):
    q, k, v arrive scaled by the head's powers of two in Scales [BH, 2 + D] (c_q, c_k, then c_v per
    column; see attention._f16_scales_kernel), undone in the logits' scale and on the output's
    columns, as in the portable forward."""
    WG_M: gl.constexpr = 64
    NUM_WG: gl.constexpr = BLOCK_M // WG_M
    dtype: gl.constexpr = q_smem.dtype
    S_L: gl.constexpr = _acc_layout(BLOCK_N)
    O_L: gl.constexpr = _acc_layout(D)
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
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
    if PARTS == 2:
        cs = Scales + bh.to(gl.int64) * (2 + D)
        qk_scale2 = qk_scale2 / (gl.load(cs) * gl.load(cs + 1))  # powers of two: exact
    qb = it % 2
    mbarrier.wait(q_ready.index(qb), (it // 2) & 1)
    q = q_smem.index(PARTS * (NUM_WG * qb + wg)).reshape([WG_M, D])
    q_lo = q_smem.index(PARTS * (NUM_WG * qb + wg) + PARTS - 1).reshape([WG_M, D])
    if n_tiles > 0:
        p16 = gl.zeros([WG_M, BLOCK_N], dtype, P_L)
        p16, p_lo, acc, m_i, s_i = _step(0, g, p16, p16, acc, m_i, s_i, q, q_lo, k_ring, v_ring, k_ready, k_empty,
                                         v_ready, v_empty, offs_m, offs_n, 0 >= mask_from, Nq, Nk, qk_scale2,
                                         D, BLOCK_N, STAGES, CAUSAL, True, PARTS, OVERLAP)
        for j in range(1, n_tiles):
            p16, p_lo, acc, m_i, s_i = _step(j, g + j, p16, p_lo, acc, m_i, s_i, q, q_lo, k_ring, v_ring, k_ready,
                                             k_empty, v_ready, v_empty, offs_m, offs_n, j >= mask_from, Nq, Nk,
                                             qk_scale2, D, BLOCK_N, STAGES, CAUSAL, False, PARTS, OVERLAP)
        mbarrier.arrive(q_empty.index(qb))  # every QKᵀ of the item has read Q
        last = (g + n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((g + n_tiles - 1) // STAGES) & 1)
        acc = _fold(acc, _pv(p16, p_lo, v_ring, PARTS * last, acc, BLOCK_N, D, PARTS), PARTS)
        mbarrier.arrive(v_empty.index(last))
    else:
        mbarrier.arrive(q_empty.index(qb))

    if PARTS == 2:  # acc in units of 2^14·c_v (per column)
        acc = acc * (1.0 / 16384.0) * gl.expand_dims(1.0 / gl.load(cs + 2 + cols_o), 0)  # (one at a time: normal)
    nonempty = s_i > 0
    inv = gl.convert_layout(1.0 / gl.where(nonempty, s_i, 1.0), ROW_O)
    out = (acc * gl.expand_dims(inv, 1)).to(Out.dtype.element_ty)
    _store_rows(out, Out, o_desc, o_smem, wg, b, h, r0, so_b, so_h, so_m, Nq, cols_o, WG_M, D, ROW_O, TMA_OUT)
    row_ok = offs_m < Nq
    st = Stats + bh.to(gl.int64) * 2 * Nq + offs_m
    gl.store(st, gl.where(nonempty, m_i, float("inf")), mask=row_ok)
    gl.store(st + Nq, gl.where(nonempty, s_i, 1.0), mask=row_ok)


@gluon.jit
def _store_rows(val, Ptr, desc, smem, wg: gl.constexpr, b, h, r0, s_b, s_h, s_m, Nq, cols, ROWS: gl.constexpr,
                D: gl.constexpr, ROW_L: gl.constexpr, TMA: gl.constexpr):
    """val [ROWS, D] (Ptr's dtype) into rows [r0, r0 + ROWS) of head (b, h) of a [B, H, N, D]
    tensor (strides s_b, s_h, s_m, last 1; cols: the column indices in val's layout, ROW_L the row
    one): with ``TMA``, through warpgroup wg's staging tile smem.index(wg) and one TMA store by
    ``desc`` (once the tile's previous store has read it), which clips the rows past Nq; else by
    gl.store, masked to rows < Nq. The forward's O and the backward's dQ."""
    if TMA:
        buf = smem.index(wg)
        tma.store_wait(0)  # (its previous item's store has read the tile)
        buf.reshape([ROWS, D]).store(val)
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, [b, h, r0, 0], buf)
    else:
        rows = r0 + gl.arange(0, ROWS, layout=ROW_L)
        ptrs = (Ptr + b.to(gl.int64) * s_b + h.to(gl.int64) * s_h + gl.expand_dims(rows.to(gl.int64) * s_m, 1)
                + gl.expand_dims(cols, 0))
        gl.store(ptrs, val, mask=gl.expand_dims(rows < Nq, 1))


@gluon.jit
def _query_stationary_buffers(q_desc, k_desc, v_desc, NUM_WG: gl.constexpr, STAGES: gl.constexpr,
                              PARTS: gl.constexpr):
    """Shared memory of the query-stationary kernels (the forward, the backward's dQ): two Q buffers
    of NUM_WG warpgroup tiles, the K and V rings (each tile PARTS buffers: see _loader), and their
    ready / empty barriers (an empty barrier counts one arrival per warpgroup), initialised and
    fenced."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * NUM_WG * PARTS] + q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES * PARTS] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES * PARTS] + v_desc.block_type.shape, v_desc.layout)
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
    return q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty


@gluon.jit(do_not_specialize=_COUNTS)
def _fwd_kernel(q_desc, k_desc, v_desc, Out, o_desc, Stats, Scales, so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, t0,
                qk_scale2, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, PARTS: gl.constexpr, TMA_OUT: gl.constexpr,
                OVERLAP: gl.constexpr):
    """Persistent: program p takes work items p, p + programs, … (see _item), each BLOCK_M query
    rows of one batch·head (BLOCK_M − 64 from item t0 on), with BLOCK_M / 64 consumer warpgroups of
    64 rows and a producer warp (num_warps = 4: the first warpgroup).

    Out [B, H, Nq, D] (any strides, last one 1), Stats [B, H, 2, Nq] float32: (m in log2 units,
    S); (+inf, 1) for a row that sees no key. PARTS = 2: float32 attention in fp16x3, from the
    float16 parts of q, k, v (see _loader) and their scales, Scales [BH, 2 + D]; else Scales is unused."""
    NUM_WG: gl.constexpr = BLOCK_M // 64
    q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = _query_stationary_buffers(
        q_desc, k_desc, v_desc, NUM_WG, STAGES, PARTS)
    if TMA_OUT:  # one output staging tile per warpgroup
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [NUM_WG] + o_desc.block_type.shape, o_desc.layout)
    else:
        o_smem = q_smem

    # one literal partition list per warpgroup count: Gluon 3.6 builds it at compile time and takes
    # neither a comprehension nor the consumers' arguments grouped into tuples
    if NUM_WG == 3:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out, o_desc,
                         o_smem, Stats, Scales, so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, t0, qk_scale2, D, BLOCK_M,
                         BLOCK_N, STAGES, CAUSAL, PARTS, TMA_OUT, OVERLAP)),
            (_consumer, (1, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out, o_desc,
                         o_smem, Stats, Scales, so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, t0, qk_scale2, D, BLOCK_M,
                         BLOCK_N, STAGES, CAUSAL, PARTS, TMA_OUT, OVERLAP)),
            (_consumer, (2, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out, o_desc,
                         o_smem, Stats, Scales, so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, t0, qk_scale2, D, BLOCK_M,
                         BLOCK_N, STAGES, CAUSAL, PARTS, TMA_OUT, OVERLAP)),
            (_loader, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
                       k_empty, v_ready, v_empty, H, Nq, Nk, n_m, n_items, t0, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                       False, PARTS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    elif NUM_WG == 1:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out, o_desc,
                         o_smem, Stats, Scales, so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, t0, qk_scale2, D, BLOCK_M,
                         BLOCK_N, STAGES, CAUSAL, PARTS, TMA_OUT, OVERLAP)),
            (_loader, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
                       k_empty, v_ready, v_empty, H, Nq, Nk, n_m, n_items, t0, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                       False, PARTS)),
        ], [1], [24])
    else:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out, o_desc,
                         o_smem, Stats, Scales, so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, t0, qk_scale2, D, BLOCK_M,
                         BLOCK_N, STAGES, CAUSAL, PARTS, TMA_OUT, OVERLAP)),
            (_consumer, (1, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, Out, o_desc,
                         o_smem, Stats, Scales, so_b, so_h, so_m, H, Nq, Nk, n_m, n_items, t0, qk_scale2, D, BLOCK_M,
                         BLOCK_N, STAGES, CAUSAL, PARTS, TMA_OUT, OVERLAP)),
            (_loader, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
                       k_empty, v_ready, v_empty, H, Nq, Nk, n_m, n_items, t0, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                       False, PARTS)),
        ], [4, 1], [CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------
# backward: dQ query-stationary (_bwd_dq_kernel), then dK/dV key-stationary (_bwd_dkdv_kernel),
# both deterministic (no atomics) and both from the row statistics the forward saved: the dQ
# kernel turns them into lse2 = m + log2(S) and delta = rowsum(dO∘O) for its own rows and stores
# them, padded to its items' multiple of 128 rows (lse2 = +inf, delta = 0 there: P = 0), so that
# the dK/dV kernel's statistics loads are aligned and unmasked (a separate kernel for them cost a
# pass over O and dO and a launch). P = exp2(S·scale·log2e − lse2) is recomputed in both
# kernels, as in the portable backward (seven products per tile pair against five for a kernel
# that accumulates dQ by atomics: the price of determinism without a TMA reduction, which Gluon
# 3.6 does not expose).


@gluon.jit
def _kv_queries(pid_n, Nq, Nk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(first query tile, number of query tiles) that see any key of key block pid_n (bottom-right
    causal: query i sees key j iff j ≤ i + Nk − Nq)."""
    m_lo = 0
    if CAUSAL:
        m_lo = gl.maximum(pid_n * BLOCK_N - (Nk - Nq), 0) // BLOCK_M
    return m_lo, gl.cdiv(Nq, BLOCK_M) - m_lo


@gluon.jit
def _kv_loader(q_desc, q2_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_ring, q2_ring, do_ring, kv_ready, q_ready,
               q_empty, do_ready, do_empty, H, Nq, Nk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr, PARTS: gl.constexpr):
    """The producer warp of _bwd_dkdv_kernel: the program's K and V rows once, then every query
    tile's Q and dO into their rings (separate barriers: Sᵀ can start before dO has landed).
    PARTS = 2 (fp16x3): every tile is its (hi, lo) parts (see _loader), and the Q barrier also
    brings the parts of q's rows rescaled for dK (q2_desc, into q2_ring; see _bwd_split_kernel)."""
    NUM_WG: gl.constexpr = BLOCK_N // 64
    QBYTES: gl.constexpr = (2 if PARTS == 2 else 1) * PARTS * q_desc.block_type.nbytes
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    n0 = pid_n * BLOCK_N
    mbarrier.expect(kv_ready.index(0), 2 * NUM_WG * PARTS * k_desc.block_type.nbytes)
    for i in gl.static_range(NUM_WG):
        for part in gl.static_range(PARTS):
            tma.async_copy_global_to_shared(k_desc, [b, h, n0 + i * 64 + part * Nk, 0], kv_ready.index(0),
                                            k_smem.index(PARTS * i + part))
            tma.async_copy_global_to_shared(v_desc, [b, h, n0 + i * 64 + part * Nk, 0], kv_ready.index(0),
                                            v_smem.index(PARTS * i + part))
    m_lo, n_m = _kv_queries(pid_n, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    for i in range(n_m):
        slot = i % STAGES
        free = ((i // STAGES) & 1) ^ 1  # parity of the release of this slot's previous tile
        q0 = (m_lo + i) * BLOCK_M
        mbarrier.wait(q_empty.index(slot), free, pred=i >= STAGES)
        mbarrier.expect(q_ready.index(slot), QBYTES)
        for part in gl.static_range(PARTS):
            tma.async_copy_global_to_shared(q_desc, [b, h, q0 + part * Nq, 0], q_ready.index(slot),
                                            q_ring.index(PARTS * slot + part))
            if PARTS == 2:
                tma.async_copy_global_to_shared(q2_desc, [b, h, q0 + part * Nq, 0], q_ready.index(slot),
                                                q2_ring.index(PARTS * slot + part))
        mbarrier.wait(do_empty.index(slot), free, pred=i >= STAGES)
        mbarrier.expect(do_ready.index(slot), PARTS * do_desc.block_type.nbytes)
        for part in gl.static_range(PARTS):
            tma.async_copy_global_to_shared(do_desc, [b, h, q0 + part * Nq, 0], do_ready.index(slot),
                                            do_ring.index(PARTS * slot + part))


@gluon.jit
def _split_p(p, A_L: gl.constexpr):
    """fp16x3: a float32 tile (already in float16's range) as float16 (hi, lo) A operands."""
    hi = p.to(gl.float16)
    lo = (p - hi.to(gl.float32)).to(gl.float16)
    return gl.convert_layout(hi, A_L, assert_trivial=True), gl.convert_layout(lo, A_L, assert_trivial=True)


@gluon.jit
def _kv_consumer(wg: gl.constexpr, k_smem, v_smem, q_ring, q2_ring, do_ring, kv_ready, q_ready, q_empty, do_ready,
                 do_empty, Rows, PLANE, Scales, dK, dV, dk_desc, dv_desc, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, H, Nq,
                 Nk, NQP, scale, qk_scale2, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, CAUSAL: gl.constexpr, PREFETCH: gl.constexpr, PARTS: gl.constexpr,
                 TMA_GRADS: gl.constexpr):
    """Warpgroup wg: keys [n0 + 64·wg, +64) against every query tile that sees them, in the
    transposed (key-major) orientation, so that Pᵀ and dSᵀ are born in the A-operand registers of
    the dV and dK products and never go through shared memory:
      Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (shared-memory operands, both in flight at once),
      Pᵀ = exp2(Sᵀ·scale·log2e − lse2) while dPᵀ runs, dSᵀ = Pᵀ∘(dPᵀ − delta),
      dV += Pᵀ·dO, dK += dSᵀ·Q (A from registers). dK is scaled once at the end.

    Rows [·, B·H, NQP] float32, planes PLANE apart: lse2, delta (the dQ kernel's). PARTS = 2
    (fp16x3, _bwd_split_kernel's planes m, delta, r = 1/S, f, u): every product is three
    (common.dot3's), Pᵀ = exp2(Sᵀ·scale·log2e − m)·r goes in as Pᵀ·2^14 and dSᵀ's column i scaled
    by u_i, against q's rows scaled by c_q·w_i (q2_ring; u_i·w_i = 2⁻¹⁶/D), as the portable fp16x3
    backward does (common.dk_units); each tile's products are summed apart and added to dK, dV outside the
    tensor cores (see _pv)."""
    dtype: gl.constexpr = q_ring.dtype
    ST_L: gl.constexpr = _acc_layout(BLOCK_M)
    O_L: gl.constexpr = _acc_layout(D)
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    COL: gl.constexpr = gl.SliceLayout(0, ST_L)
    qk_scale2 = qk_scale2.to(gl.float32)
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    k0 = pid_n * BLOCK_N + wg * 64
    keys = k0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ST_L))
    key_ok = gl.expand_dims(keys < Nk, 1)
    if PARTS == 2:
        cs = Scales + bh.to(gl.int64) * 4  # c_q, c_k, c_v, c_dO (attention._f16_scales_kernel)
        qk_scale2 = qk_scale2 / gl.load(cs) / gl.load(cs + 1)  # powers of two: exact
    mbarrier.wait(kv_ready.index(0), 0)
    k = k_smem.index(PARTS * wg).reshape([64, D])
    k_lo = k_smem.index(PARTS * wg + PARTS - 1).reshape([64, D])
    v = v_smem.index(PARTS * wg).reshape([64, D])
    v_lo = v_smem.index(PARTS * wg + PARTS - 1).reshape([64, D])
    dk = gl.zeros([64, D], gl.float32, O_L)
    dv = gl.zeros([64, D], gl.float32, O_L)
    lse_row = Rows + bh.to(gl.int64) * NQP
    delta_row = lse_row + PLANE
    m_lo, n_m = _kv_queries(pid_n, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    offs_q = gl.arange(0, BLOCK_M, layout=COL)
    if PREFETCH:
        last = (m_lo + n_m - 1) * BLOCK_M
        lse2 = gl.load(lse_row + m_lo * BLOCK_M + offs_q)
        delta = gl.load(delta_row + m_lo * BLOCK_M + offs_q)
    for i in range(n_m):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        q0 = (m_lo + i) * BLOCK_M
        cols = q0 + offs_q
        if PREFETCH:
            nxt = gl.minimum(q0 + BLOCK_M, last)
            lse2_next = gl.load(lse_row + nxt + offs_q)
            delta_next = gl.load(delta_row + nxt + offs_q)
        mbarrier.wait(q_ready.index(slot), phase)
        t_s = _scores(k, k_lo, q_ring, PARTS * slot, BLOCK_M, D, PARTS)
        mbarrier.wait(do_ready.index(slot), phase)
        t_dp = _scores(v, v_lo, do_ring, PARTS * slot, BLOCK_M, D, PARTS)
        if not PREFETCH:
            # both issued before Sᵀ is awaited: delta loaded where it is used (after dPᵀ) left its
            # latency exposed on every tile (the backward measured 2–11% slower)
            lse2 = gl.load(lse_row + cols)  # (padded to NQP ≥ every tile's end: unmasked)
            delta = gl.load(delta_row + cols)
        if PARTS == 2:
            r = gl.load(lse_row + 2 * PLANE + cols)
            u = gl.load(lse_row + 4 * PLANE + cols)
        s_t = warpgroup_mma_wait(num_outstanding=1 if PARTS == 1 else 3, deps=[t_s])
        p_t = gl.exp2(gl.fma(s_t, qk_scale2, -gl.expand_dims(lse2, 0)))
        # the mask only where the tile has keys past Nk (zero-filled rows score 0, not −inf; with
        # PARTS = 2 they are the lo parts) or straddles the causal diagonal; query rows past Nq
        # have lse2 (m) = +inf and P = 0 already
        if (k0 + 64 > Nk) | (CAUSAL & (k0 + 63 > q0 + Nk - Nq)):
            visible = key_ok
            if CAUSAL:
                visible = visible & (gl.expand_dims(keys, 1) <= gl.expand_dims(cols + (Nk - Nq), 0))
            p_t = gl.where(visible, p_t, 0.0)
        if PARTS == 2:  # (p_t is exp2(·): r and 2^14 applied here, r·u below; powers of two exact)
            p16, p_lo = _split_p(p_t * gl.expand_dims(r * 16384.0, 0), A_L)
        else:
            p16 = gl.convert_layout(p_t.to(dtype), A_L, assert_trivial=True)
            p_lo = p16
        # (dV's product issued before dP is awaited measured the same at D = 64 and spilled more at 128)
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=[t_dp])
        if PARTS == 2:
            # dSᵀ's parts formed before dV's products are issued, and each product's tile folded
            # before the next is issued: one tile accumulator alive at a time (ptxas, Triton 3.6:
            # 112 bytes of spills a thread here and in the orders with more in flight alike)
            ds16, ds_lo = _split_p((p_t * gl.expand_dims(r * u, 0)) * (dp_t - gl.expand_dims(delta, 0)), A_L)
            dv = _fold(dv, _pv(p16, p_lo, do_ring, PARTS * slot, dv, BLOCK_M, D, PARTS), PARTS)
            dk = _fold(dk, _pv(ds16, ds_lo, q2_ring, PARTS * slot, dk, BLOCK_M, D, PARTS), PARTS)
        else:
            t_dv = _pv(p16, p_lo, do_ring, PARTS * slot, dv, BLOCK_M, D, PARTS)
            ds16 = gl.convert_layout((p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype), A_L, assert_trivial=True)
            t_dk = _pv(ds16, ds16, q2_ring, PARTS * slot, dk, BLOCK_M, D, PARTS)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[t_dv, t_dk])
        mbarrier.arrive(do_empty.index(slot))
        mbarrier.arrive(q_empty.index(slot))
        if PREFETCH:
            lse2 = lse2_next
            delta = delta_next
    if PARTS == 2:  # one power of two at a time: their product may leave float32's range
        dk = dk * (65536.0 * D) * (1.0 / gl.load(cs)) * (1.0 / gl.load(cs + 3)) * (1.0 / gl.load(cs + 2))
        dv = dv * (1.0 / 16384.0) * (1.0 / gl.load(cs + 3))
    if TMA_GRADS:  # through this warpgroup's own K and V tiles, whose products have all retired
        gl.static_assert(PARTS == 1, "dK/dV by TMA: half precision only (the tiles are q's dtype)")
        kb = k_smem.index(wg)
        vb = v_smem.index(wg)
        kb.reshape([64, D]).store((dk * scale).to(dtype))
        vb.reshape([64, D]).store(dv.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [b, h, k0, 0], kb)
        tma.async_copy_shared_to_global(dv_desc, [b, h, k0, 0], vb)
        tma.store_wait(0)
    else:
        rows = k0 + gl.arange(0, 64, layout=gl.SliceLayout(1, O_L))
        cols_d = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, O_L)), 0)
        ok = gl.expand_dims(rows < Nk, 1)
        r64 = gl.expand_dims(rows.to(gl.int64), 1)
        gl.store(dK + b.to(gl.int64) * sk_b + h.to(gl.int64) * sk_h + r64 * sk_n + cols_d,
                 (dk * scale).to(dK.dtype.element_ty), mask=ok)
        gl.store(dV + b.to(gl.int64) * sv_b + h.to(gl.int64) * sv_h + r64 * sv_n + cols_d,
                 dv.to(dV.dtype.element_ty), mask=ok)


@gluon.jit
def _bwd_dkdv_kernel(q_desc, q2_desc, do_desc, k_desc, v_desc, Rows, Scales, dK, dV, dk_desc, dv_desc, PLANE, sk_b,
                     sk_h, sk_n, sv_b, sv_h, sv_n, H, Nq, Nk, NQP, scale, qk_scale2, D: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, PARTS: gl.constexpr, TMA_GRADS: gl.constexpr):
    """Grid (cdiv(Nk, BLOCK_N), B·H): BLOCK_N = 128 keys per program, two consumer warpgroups of
    64 keys each holding their dK, dV [64, D] float32 accumulators in registers, a producer warp
    streaming the query tiles (BLOCK_M rows of Q and dO) through a STAGES-deep ring.
    dK, dV [B, H, Nk, D] (any strides, last one 1). PARTS = 2: fp16x3 (see _kv_consumer), from
    _bwd_split_kernel's parts, Rows and the head scales Scales [B·H, 4]; else q2_desc and Scales
    are unused."""
    dtype: gl.constexpr = q_desc.dtype
    NUM_WG: gl.constexpr = BLOCK_N // 64
    k_smem = gl.allocate_shared_memory(dtype, [NUM_WG * PARTS] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_WG * PARTS] + v_desc.block_type.shape, v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES * PARTS] + q_desc.block_type.shape, q_desc.layout)
    if PARTS == 2:
        q2_ring = gl.allocate_shared_memory(dtype, [STAGES * PARTS] + q_desc.block_type.shape, q_desc.layout)
    else:
        q2_ring = q_ring
    do_ring = gl.allocate_shared_memory(dtype, [STAGES * PARTS] + do_desc.block_type.shape, do_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NUM_WG)
        mbarrier.init(do_empty.index(i), count=NUM_WG)
    fence_async_shared()
    # the consumers load a query tile's statistics one tile ahead where the registers allow: at D = 64
    # in half precision (with D = 128's accumulators, or fp16x3's extra tiles, the two extra live
    # vectors spill, and the spills cost more than the loads' latency)
    PREFETCH: gl.constexpr = D <= 64 and PARTS == 1
    gl.warp_specialize([
        (_kv_consumer, (0, k_smem, v_smem, q_ring, q2_ring, do_ring, kv_ready, q_ready, q_empty, do_ready, do_empty,
                        Rows, PLANE, Scales, dK, dV, dk_desc, dv_desc, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, H, Nq,
                        Nk, NQP, scale, qk_scale2, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL, PREFETCH, PARTS, TMA_GRADS)),
        (_kv_consumer, (1, k_smem, v_smem, q_ring, q2_ring, do_ring, kv_ready, q_ready, q_empty, do_ready, do_empty,
                        Rows, PLANE, Scales, dK, dV, dk_desc, dv_desc, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, H, Nq,
                        Nk, NQP, scale, qk_scale2, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL, PREFETCH, PARTS, TMA_GRADS)),
        (_kv_loader, (q_desc, q2_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_ring, q2_ring, do_ring, kv_ready,
                      q_ready, q_empty, do_ready, do_empty, H, Nq, Nk, BLOCK_M, BLOCK_N, STAGES, CAUSAL, PARTS)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.constexpr_function
def _rows_layout(d):
    """A blocked register layout of [64, d] rows over one warpgroup, 8 contiguous elements (16
    bytes) per thread."""
    return gl.BlockedLayout([1, 8], [32 * 8 // d, d // 8], [4, 1], [1, 0])


@gluon.jit
def _o_rows(Out, so_b, so_h, so_m, w, wg: gl.constexpr, n_m, n_items, H, Nq, Nk, D: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, layout: gl.constexpr):
    """O's 64 rows of warpgroup wg in work item w ([64, D] in ``layout``; zeros past Nq, and all
    zeros for w ≥ n_items: the item after a program's last)."""
    b, h, bh, q0, n_tiles, rows = _item(gl.minimum(w, n_items - 1), n_items, n_m, H, Nq, Nk, BLOCK_M, BLOCK_N,
                                        CAUSAL)
    rows = q0 + wg * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    ok = (rows < Nq) & (w < n_items)
    ptrs = (Out + b.to(gl.int64) * so_b + h.to(gl.int64) * so_h + gl.expand_dims(rows.to(gl.int64) * so_m, 1)
            + gl.expand_dims(cols, 0))
    return gl.load(ptrs, mask=gl.expand_dims(ok, 1), other=0.0)


@gluon.jit
def _dq_consumer(wg: gl.constexpr, q_smem, do_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready,
                 v_empty, Out, Stats, Rows, PLANE, Scales, dQ, dq_desc, dq_smem, so_b, so_h, so_m, sq_b, sq_h, sq_m, H,
                 Nq, Nk, NQP, n_m, n_items, scale, qk_scale2, D: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PARTS: gl.constexpr,
                 TMA_GRADS: gl.constexpr):
    """Warpgroup wg: per item (as the forward's), its 64 query rows' statistics and dQ over the
    item's key tiles. Statistics: lse2 = m + log2(S) from the forward's, delta = rowsum(dO∘O) from
    dO in shared memory and O's rows (loaded one item ahead), both stored into Rows' first two
    planes for the dK/dV kernel that runs next (rows past Nq: lse2 = +inf, delta = 0, so that P =
    0 there). Then per key tile S = Q·Kᵀ and dP = dO·Vᵀ (shared-memory operands, in flight
    together), P and dS in registers, dQ += dS·K (A from registers); dQ is scaled once at the end.

    PARTS = 2 (fp16x3): the statistics come from _bwd_split_kernel (Rows' planes m, delta, r =
    1/S, f), every product is three, P = exp2(S·scale·log2e − m)·r, and dS's row i enters dS·K
    scaled by f_i (common.ds_units), undone at the end with the head's scales (Scales [B·H, 4]);
    each tile's dS·K is summed apart and added to dQ outside the tensor cores (see _pv)."""
    WG_M: gl.constexpr = 64
    NUM_WG: gl.constexpr = BLOCK_M // WG_M
    dtype: gl.constexpr = q_smem.dtype
    S_L: gl.constexpr = _acc_layout(BLOCK_N)
    O_L: gl.constexpr = _acc_layout(D)
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    qk_scale2 = qk_scale2.to(gl.float32)
    ROWS_L: gl.constexpr = _rows_layout(D)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
    it = 0
    g = 0
    if PARTS == 1:
        o_next = _o_rows(Out, so_b, so_h, so_m, gl.program_id(0), wg, n_m, n_items, H, Nq, Nk, D, BLOCK_M, BLOCK_N,
                         CAUSAL, ROWS_L)
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, bh, q0, n_tiles, rows = _item(w, n_items, n_m, H, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)  # (no tail)
        r0 = q0 + wg * WG_M
        offs_m = r0 + gl.arange(0, WG_M, layout=ROW_S)
        rows_at = Rows + bh.to(gl.int64) * NQP + offs_m  # (NQP: every item's rows)
        sc2 = qk_scale2
        if PARTS == 2:
            cs = Scales + bh.to(gl.int64) * 4  # c_q, c_k, c_v, c_dO
            sc2 = qk_scale2 / gl.load(cs) / gl.load(cs + 1)  # powers of two: exact
            lse2 = gl.load(rows_at)  # m
            delta = gl.load(rows_at + PLANE)
            f = gl.load(rows_at + 3 * PLANE)
            rf = gl.load(rows_at + 2 * PLANE) * f
        else:
            # (a load of O's rows at the item's start left its latency exposed on every item)
            o = o_next
            o_next = _o_rows(Out, so_b, so_h, so_m, w + gl.num_programs(0), wg, n_m, n_items, H, Nq, Nk, D, BLOCK_M,
                             BLOCK_N, CAUSAL, ROWS_L)
            st = Stats + bh.to(gl.int64) * 2 * Nq + offs_m
            m = gl.load(st, mask=offs_m < Nq, other=float("inf"))
            s_sum = gl.load(st + Nq, mask=offs_m < Nq, other=1.0)
            lse2 = gl.where(m == float("inf"), float("inf"), m + gl.log2(s_sum))  # (+inf, 1): a row that sees no key
        dq = gl.zeros([WG_M, D], gl.float32, O_L)
        qb = it % 2
        mbarrier.wait(q_ready.index(qb), (it // 2) & 1)
        q = q_smem.index(PARTS * (NUM_WG * qb + wg)).reshape([WG_M, D])
        q_lo = q_smem.index(PARTS * (NUM_WG * qb + wg) + PARTS - 1).reshape([WG_M, D])
        do = do_smem.index(PARTS * (NUM_WG * qb + wg)).reshape([WG_M, D])
        do_lo = do_smem.index(PARTS * (NUM_WG * qb + wg) + PARTS - 1).reshape([WG_M, D])
        if PARTS == 1:
            delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do.load(ROWS_L).to(gl.float32), axis=1), ROW_S)
            gl.store(rows_at, lse2)
            gl.store(rows_at + PLANE, delta)
        for j in range(n_tiles):
            slot = (g + j) % STAGES
            phase = ((g + j) // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            t_s = _scores(q, q_lo, k_ring, PARTS * slot, BLOCK_N, D, PARTS)
            mbarrier.wait(v_ready.index(slot), phase)
            t_dp = _scores(do, do_lo, v_ring, PARTS * slot, BLOCK_N, D, PARTS)
            s = warpgroup_mma_wait(num_outstanding=1 if PARTS == 1 else 3, deps=[t_s])
            p = gl.exp2(gl.fma(s, sc2, -gl.expand_dims(lse2, 1)))
            n0 = j * BLOCK_N
            if (n0 + BLOCK_N > Nk) | (CAUSAL & (n0 + BLOCK_N - 1 > r0 + Nk - Nq)):  # (as in _kv_consumer)
                visible = gl.expand_dims(n0 + offs_n < Nk, 0)
                if CAUSAL:
                    visible = visible & (gl.expand_dims(n0 + offs_n, 0) <= gl.expand_dims(offs_m + (Nk - Nq), 1))
                p = gl.where(visible, p, 0.0)
            dp = warpgroup_mma_wait(num_outstanding=0, deps=[t_dp])
            mbarrier.arrive(v_empty.index(slot))  # dP has read its V slot
            if PARTS == 2:  # (p is exp2(·): r·f applied here, powers of two aside as the portable kernel's)
                ds16, ds_lo = _split_p((p * gl.expand_dims(rf, 1)) * (dp - gl.expand_dims(delta, 1)), A_L)
                dq = _fold(dq, _pv(ds16, ds_lo, k_ring, PARTS * slot, dq, BLOCK_N, D, PARTS), PARTS)
            else:
                ds16 = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), A_L, assert_trivial=True)
                dq = warpgroup_mma(ds16, k_ring.index(slot).reshape([BLOCK_N, D]), dq)  # synchronous: nothing in
                # flight across the back edge
            mbarrier.arrive(k_empty.index(slot))
        mbarrier.arrive(q_empty.index(qb))
        g += n_tiles
        it += 1
        if PARTS == 2:  # one power of two at a time: their product may leave float32's range
            dq = (dq * gl.expand_dims(gl.convert_layout(1.0 / f, ROW_O, assert_trivial=True), 1)
                  * (1.0 / gl.load(cs + 1)) * (1.0 / gl.load(cs + 3)) * (1.0 / gl.load(cs + 2)))
        if TMA_GRADS:
            gl.static_assert(PARTS == 1, "dQ by TMA: half precision only")
        _store_rows((dq * scale).to(dQ.dtype.element_ty), dQ, dq_desc, dq_smem, wg, b, h, r0, sq_b, sq_h, sq_m, Nq,
                    cols_o, WG_M, D, ROW_O, TMA_GRADS)
    if TMA_GRADS:
        tma.store_wait(0)


@gluon.jit(do_not_specialize=_COUNTS[:2])
def _bwd_dq_kernel(q_desc, do_desc, k_desc, v_desc, Out, Stats, Rows, Scales, dQ, dq_desc, PLANE, so_b, so_h, so_m,
                   sq_b, sq_h, sq_m, H, Nq, Nk, NQP, n_m, n_items, scale, qk_scale2, D: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, PARTS: gl.constexpr, TMA_GRADS: gl.constexpr):
    """Persistent like _fwd_kernel (the same items and producer warp, which also brings each item's
    dO rows): two consumer warpgroups of 64 query rows. O, dQ [B, H, Nq, D] (any strides, last 1),
    Stats [B, H, 2, Nq] (contiguous); writes Rows' planes lse2, delta [B·H, NQP] float32 (PLANE
    apart), NQP = n_m·BLOCK_M. PARTS = 2 (fp16x3): from _bwd_split_kernel's parts, Rows and the
    head scales Scales [B·H, 4] (Out and Stats unused); see _dq_consumer."""
    dtype: gl.constexpr = q_desc.dtype
    NUM_WG: gl.constexpr = BLOCK_M // 64
    q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = _query_stationary_buffers(
        q_desc, k_desc, v_desc, NUM_WG, STAGES, PARTS)
    do_smem = gl.allocate_shared_memory(dtype, [2 * NUM_WG * PARTS] + do_desc.block_type.shape, do_desc.layout)
    if TMA_GRADS:  # one dQ staging tile per warpgroup
        dq_smem = gl.allocate_shared_memory(dq_desc.dtype, [NUM_WG] + dq_desc.block_type.shape, dq_desc.layout)
    else:
        dq_smem = do_smem
    gl.warp_specialize([
        (_dq_consumer, (0, q_smem, do_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                        Out, Stats, Rows, PLANE, Scales, dQ, dq_desc, dq_smem, so_b, so_h, so_m, sq_b, sq_h, sq_m, H,
                        Nq, Nk, NQP, n_m, n_items, scale, qk_scale2, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL, PARTS,
                        TMA_GRADS)),
        (_dq_consumer, (1, q_smem, do_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                        Out, Stats, Rows, PLANE, Scales, dQ, dq_desc, dq_smem, so_b, so_h, so_m, sq_b, sq_h, sq_m, H,
                        Nq, Nk, NQP, n_m, n_items, scale, qk_scale2, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL, PARTS,
                        TMA_GRADS)),
        (_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
                   k_empty, v_ready, v_empty, H, Nq, Nk, n_m, n_items, n_items, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                   True, PARTS)),
    ], [4, 1], [CONSUMER_REGS, 24])


@functools.lru_cache(maxsize=64)
def _layout(block: tuple, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float16 if dtype == torch.float16 else gl.bfloat16)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """The [B, H, N, D] descriptor of t with blocks of ``rows`` rows. Built without the dataclass's
    checks (host time of each launch that takes Triton's own path; a planned one builds them once):
    ``serves`` has checked what they check."""
    block = (1, 1, rows, t.shape[-1])
    d = TensorDescriptor.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = (
        t, list(t.shape), list(t.stride()), list(block), _layout(block, t.dtype), "zero")
    return d


def _blocks(n: int):
    """What makes a tensor's descriptor with blocks of n rows (a Launch's ``leading``)."""
    return functools.partial(_descriptor, rows=n)


def _tma_writable(split: bool, dtype: torch.dtype, *outs: torch.Tensor) -> bool:
    """Whether the kernels store ``outs`` (O, or dQ / dK and dV) by TMA through their staging tiles:
    TMA_OUT, not fp16x3 (``split``: float32 outputs, staged in tiles of the float16 parts' dtype),
    each of ``dtype`` (the tiles') and TMA-writable in place (_tma_readable)."""
    return TMA_OUT and not split and all(t.dtype == dtype and _tma_readable(t) for t in outs)


_SM90: dict = {}


@torch.compiler.assume_constant_result  # (torch.compile reads it once, as a constant of the graph)
def _sm90(index: int) -> bool:
    """Whether CUDA device ``index`` is sm_90 (asked once per device)."""
    hit = _SM90.get(index)
    if hit is None:
        hit = _SM90[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return hit


def _tma_readable(t: torch.Tensor, traced: bool = False) -> bool:
    """What a TMA descriptor reads in place: a unit last stride, 16-byte aligned base and strides,
    and no broadcast (zero-stride) dimension. ``traced`` (torch.compile's tensors, which have no
    address, and whose storage offset it does not trace): the strides only (the host code checks
    the address per call)."""
    strides = t.stride()
    if strides[-1] != 1 or not (traced or t.data_ptr() % 16 == 0):
        return False
    size = t.element_size()
    for s, n in zip(strides[:-1], t.shape):  # (a loop: host time on every call)
        if s * size % 16 or (s == 0 and n > 1):
            return False
    return True


def _half(q: torch.Tensor, precision: str) -> bool:
    return precision == "native" and q.dtype in DTYPES and q.shape[-1] in HOPPER_HEAD_DIMS


def _split(q: torch.Tensor, precision: str) -> bool:
    return precision == "fp16x3" and q.dtype == torch.float32 and q.shape[-1] in HOPPER_SPLIT_HEAD_DIMS


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias, precision: str, traced: bool = False) -> bool:
    """Whether the forward here can take the call: sm_90, no bias, and either half precision at
    D ∈ HOPPER_HEAD_DIMS with q/k/v of one dtype that TMA reads in place, or float32 in ``fp16x3`` at
    D ∈ HOPPER_SPLIT_HEAD_DIMS (any strides: a pass splits q, k, v into float16 parts first). The backward
    takes the same calls (``serves_backward``). ``traced``: see _tma_readable."""
    if not ENABLED or bias is not None or not (_half(q, precision) or _split(q, precision)):
        return False
    if not q.is_cuda or not _sm90(q.device.index or 0):
        return False
    if q.dtype == torch.float32:
        return k.dtype == v.dtype == q.dtype
    return all(t.dtype == q.dtype and _tma_readable(t, traced) for t in (q, k, v))


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias, precision: str, causal: bool,
           traced: bool = False) -> bool:
    """Whether this forward takes the call: ``supports`` it, and it measured faster than the
    portable forward there (benchmarks/results/<device>/attention_hopper_fwd.csv, bf16, CUDA-graph
    replays, with O stored by TMA): at D = 128 every non-causal call and causal ones from 512 keys
    (1–2% ahead at 577 and 1041, 10% behind at 197); at D = 64 from 1280 keys, causal from 4096,
    and non-causal rows of at most SHORT_ROWS queries and keys (ViT's 197 tokens: 64-row items of
    one warpgroup, 2–5% ahead; short_rows_ab.csv) except in a compiled graph (``traced``): there
    such a call would take the host op (kernels/ops.py), whose host time costs more than the traced
    portable kernels lose (compiled ViT-S 224 bf16 0.66× native through the host ops against 0.97×;
    models_vit_bf16_compiled_short*.csv). Eagerly, at any batch·heads: the launches are planned
    once per call signature (Launch, the TMA maps kept per address), up to about 20 µs more host
    time a call than the portable kernels' where it was 60–90 µs (gluon_host.csv). Between, a block of 128
    or 192 rows is mostly padding or the diagonal's masked tile, and the portable kernel's 64-row
    tiles are ahead (at 257 and 401 keys by 9–13%, VGGT's 1041-token frames by 2%; docs/RESULTS.md,
    "Short rows in the portable forward").
    ``fp16x3`` (benchmarks/results/<device>/attention_hopper_fp32.csv): from 768 keys, causal from
    2048; at 577 keys the portable forward is ahead (5%, causal 23%), and so it is below and at
    causal 1041.
    ``EVERYWHERE`` (tests, benchmarks) takes every call it supports. ``traced`` (the call is in a
    graph torch.compile builds): see _tma_readable and above."""
    if not supports(q, k, v, bias, precision, traced):
        return False
    if EVERYWHERE:
        return True
    nk = k.shape[2]
    if q.dtype == torch.float32:
        return nk >= (2048 if causal else 768)
    if q.shape[-1] == 128:
        return not causal or nk >= 512
    if causal:
        return nk >= 4096
    return nk >= 1280 or (max(q.shape[2], nk) <= SHORT_ROWS and not traced)


def config(d: int, nq: int, split: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, STAGES, consumer registers): BLOCK_M / 64 consumer warpgroups. At D = 64
    a third warpgroup (192 rows, 160 registers each) keeps the tensor cores busier while the
    others run their softmax; at D = 128 its accumulators would not fit. Rows of at most
    SHORT_ROWS queries (D <= 64) run as 64-row items of one warpgroup, two programs per SM
    (per_sm_programs): a block of 128 or 192 rows would be mostly padding. At D = 128 the same
    holds for rows of at most SHORT_ROWS_D128 queries, over 64-key tiles (two programs' K and V
    rings of 128-key tiles would not fit an SM's shared memory). ``split`` (fp16x3, D = 64): every
    tile is a hi and a lo buffer, and SPLIT_CONFIG is what fits the shared memory and measured
    fastest."""
    if split:
        return SPLIT_CONFIG
    if d <= 64:
        return (64, 128, 2, 232) if nq <= SHORT_ROWS else (192, 128, 3, 160)
    if nq <= SHORT_ROWS_D128:
        return 64, 64, 2, 232
    return 128, 128, 2, 232


# D <= 64: rows this short run as 64-row items of one consumer warpgroup, two programs per SM (at
# 197 tokens 8–38% faster than two warpgroups and 2–5% than the portable forward; short_rows_ab.csv)
SHORT_ROWS = 256
# D = 128: rows of at most this many queries run as 64-row items of one consumer warpgroup over
# 64-key tiles, two programs per SM (sm_90 SASS, Triton 3.6: 112 KiB of shared memory a program,
# no spill). An A/B switch, 0 (off) until timed: the 128-row blocks lose most at short causal rows
# (197 to 2048 tokens 0.59–0.93× cuDNN, attention_hopper_fwd_1205.csv), where a block is mostly
# padding or the diagonal's masked tile; benchmarks/attention.py --hopper times it
# ("elsa-gluon-64rows").
SHORT_ROWS_D128 = 0


# (192 rows at 160 registers with 64-key tiles in 3 stages: 4% faster at 1041 keys, 10–12% slower from 4K)
SPLIT_CONFIG = (128, 128, 2, 232)


@triton.jit
def _split_program(H, BH):
    """(t, bh, which, b, h, bh and BH as int64) of a split pass's program (t, bh, which)."""
    bh = tl.program_id(1)
    return (tl.program_id(0), bh, tl.program_id(2), (bh // H).to(tl.int64), (bh % H).to(tl.int64), bh.to(tl.int64),
            tl.cast(BH, tl.int64))


@triton.jit
def _split_kernel(Q, K, V, Scales, Parts, sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
                  H, BH, Nq, Nk, D: tl.constexpr, BLOCK: tl.constexpr):
    """fp16x3's operands for the Gluon forward: program (t, bh, which) splits rows [t·BLOCK, +BLOCK)
    of head bh of q, k or v (which = 0, 1, 2), scaled by the head's c_q or c_k or by v's column
    scales c_v (Scales [BH, 2 + D], attention._f16_scales_kernel), into float16 (hi, lo) parts
    (common.split_f16, as the portable forward splits them in its loop). Parts: q's [B·H, 2·Nq, D],
    then k's and v's [B·H, 2·Nk, D], contiguous, one buffer: row r's hi part at row r of its head,
    its lo part at row N + r."""
    t, bh, which, b, h, bh64, BH = _split_program(H, BH)
    if which == 0:
        base, s_n, s_d, n, dst = Q + b * sq_b + h * sq_h, sq_m, sq_d, Nq, Parts + bh64 * 2 * Nq * D
    elif which == 1:
        base, s_n, s_d, n, dst = K + b * sk_b + h * sk_h, sk_n, sk_d, Nk, Parts + (BH * Nq + bh64 * Nk) * 2 * D
    else:
        base, s_n, s_d, n, dst = V + b * sv_b + h * sv_h, sv_n, sv_d, Nk, Parts + (BH * (Nq + Nk) + bh64 * Nk) * 2 * D
    if t * BLOCK < n:
        rows = t * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        ok = rows[:, None] < n
        c = tl.load(Scales + bh64 * (2 + D) + tl.where(which == 2, 2 + offs_d, which))  # (c_q, c_k: one per head)
        x = tl.load(base + rows[:, None].to(tl.int64) * s_n + offs_d[None, :] * s_d, mask=ok, other=0.0)
        hi, lo = split_f16(x * c[None, :])
        at = dst + rows[:, None].to(tl.int64) * D + offs_d[None, :]
        tl.store(at, hi, mask=ok)
        tl.store(at + n * D, lo, mask=ok)


def split(q, k, v, scales) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float16 parts of fp16x3's q, k, v (see _split_kernel) as [B, H, 2N, D] tensors of one new
    buffer, the size of q, k and v in float32 (``forward`` bounds it by SPLIT_CHUNK_BYTES)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    BH = B * H
    buf = torch.empty(2 * BH * (Nq + 2 * Nk) * D, device=q.device, dtype=torch.float16)
    block = 64
    launch(_split_kernel, (cdiv(max(Nq, Nk), block), BH, 3), q, k, v, scales, buf, *q.stride(), *k.stride(),
           *v.stride(), H, BH, Nq, Nk, D=D, BLOCK=block, num_warps=4)
    nq, nk = 2 * BH * Nq * D, 2 * BH * Nk * D
    return (buf[:nq].view(B, H, 2 * Nq, D), buf[nq:nq + nk].view(B, H, 2 * Nk, D),
            buf[nq + nk:].view(B, H, 2 * Nk, D))


def fills(q: torch.Tensor) -> bool:
    """Whether the forward's work items for q [B, H, Nq, D] take every SM at least once (with
    ``EVERYWHERE``: always, so that tests and benchmarks reach the kernel at every shape)."""
    if EVERYWHERE:
        return True
    B, H, Nq, D = q.shape
    return cdiv(Nq, config(D, Nq, q.dtype == torch.float32)[0]) * B * H >= sm_count(q.device.index or 0)


# fp16x3: the split parts of at most this many bytes exist at a time (batch·heads in chunks), or
# one batch·head's where that is more (its keys' parts are needed whole: 0.8 GB at VGGT's 1000
# frames, 1.04M tokens), so that a long call's extra memory stays bounded
SPLIT_CHUNK_BYTES = 1 << 28


# (the switches this module's host code reads per call: kernels/native.py keys its recorded calls on them,
# so that a switch flipped between two calls changes what the second runs, as on the Python path)
register_switches(lambda: (ENABLED, EVERYWHERE, BACKWARD, TMA_OUT, OVERLAP, SHORT_ROWS, SHORT_ROWS_D128,
                            SPLIT_CHUNK_BYTES))


def _chunks(B: int, H: int, per: int):
    """(batch slice, head slice) pairs covering [B, H] in pieces of at most ``per`` batch·heads,
    each piece's [B', H', …] rows of a contiguous [B, H, …] tensor contiguous: whole batch
    elements, or heads of one element. As few pieces as that allows, of balanced sizes (at most
    two sizes: a last piece may be smaller)."""
    if per >= B * H:
        yield slice(None), slice(None)
    elif per >= H:
        nb = _balanced(B, per // H)
        for b0 in range(0, B, nb):
            yield slice(b0, b0 + nb), slice(None)
    else:
        nh = _balanced(H, per)
        for b in range(B):
            for h0 in range(0, H, nh):
                yield slice(b, b + 1), slice(h0, h0 + nh)


def _balanced(n: int, cap: int) -> int:
    """The piece size that covers n in the fewest pieces of at most cap, as equal as they can be."""
    return cdiv(n, cdiv(n, cap))


def forward(q, k, v, out, stats, scale: float, causal: bool, scales=None) -> None:
    """Fill out [B,H,Nq,D] and stats [B,H,2,Nq] (attention.forward's contract; stats contiguous)
    for inputs that ``supports`` accepts; float32 (fp16x3) takes ``scales``, attention._f16_scales's
    [B·H, 2 + D], and runs in chunks of batch·heads whose float16 parts fit SPLIT_CHUNK_BYTES."""
    if q.dtype != torch.float32:
        return _forward(q, k, v, out, stats, scale, causal, None)
    B, H, Nq, D = q.shape
    per = max(1, SPLIT_CHUNK_BYTES // (4 * (Nq + 2 * k.shape[2]) * D))  # (two float16 parts per element)
    rows = scales.view(B, H, -1)
    for bs, hs in _chunks(B, H, per):
        qc, kc, vc = q[bs, hs], k[bs, hs], v[bs, hs]
        sc = rows[bs, hs].reshape(-1, rows.shape[-1])
        _forward(*split(qc, kc, vc, sc), out[bs, hs], stats[bs, hs], scale, causal, sc)


def _forward(q, k, v, out, stats, scale: float, causal: bool, scales) -> None:
    """One launch of the forward kernel; q, k, v are fp16x3's float16 parts (``split``) when
    ``scales`` is given, Nq and Nk then half their rows. Planned once per call signature
    (_forward_launch): a repeat binds the addresses and reuses the descriptors' tensor maps."""
    key = ("hopper-fwd", q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), q.dtype, q.device,
           scale, causal, scales is None, TMA_OUT, OVERLAP, SHORT_ROWS, SHORT_ROWS_D128, out.data_ptr() & 15 == 0)
    prepared(key, _forward_launch, q, k, v, out, scale, causal, scales is not None)(
        q, k, v, out, stats, stats if scales is None else scales)


def _forward_launch(q, k, v, out, scale: float, causal: bool, split: bool) -> Launch:
    """The forward's launch for this call signature, called with (q, k, v, out, stats, scales)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    parts = 2 if split else 1
    if split:
        Nq, Nk = Nq // 2, Nk // 2
    bm, bn, stages, regs = config(D, Nq, split)
    n_m = cdiv(Nq, bm)
    n_items = n_m * B * H
    # causal items differ in length: one program per item lets the hardware balance them (a static
    # round robin over SMs aliases with the items' order); others run one persistent program per SM
    per_sm = per_sm_programs(bm, bn, stages, D, q.element_size(), parts)
    programs = n_items if causal else min(n_items, per_sm * sm_count(q.device.index or 0))
    t0, n_items = (n_items, n_items) if causal or bm == 64 else _tail(n_items, n_m, bm, Nq, B * H, programs)
    tma_out = _tma_writable(split, q.dtype, out)  # (never traced: see attention._hopper_serves)
    d64, dkeys = _blocks(64), _blocks(bn)
    return Launch(_fwd_kernel, (programs,), (*out.stride()[:3], H, Nq, Nk, n_m, n_items, t0, scale * LOG2E),
                  dict(D=D, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, CAUSAL=causal, CONSUMER_REGS=regs, PARTS=parts,
                       TMA_OUT=tma_out, OVERLAP=overlaps(D, Nk, split), num_warps=4,
                       **({"maxnreg": 256 // per_sm} if per_sm > 1 else {})),
                  leading=((0, d64), (1, dkeys), (2, dkeys), 3, (3, d64) if tma_out else (0, d64), 4, 5))


# shared memory an SM gives its resident programs (H100 / H200: 228 KiB, 1 KiB of it reserved per program)
SM_SHARED_BYTES = 233472


def per_sm_programs(bm: int, bn: int, stages: int, d: int, itemsize: int, parts: int) -> int:
    """Resident programs per SM of the forward: two with one consumer warpgroup (64-row items),
    where two programs' shared memory fits (two Q buffers, the K and V rings, the output staging
    tile; launched at maxnreg = 128, Triton 3.6 gives the consumer 232 registers and the producer
    warp's padded warpgroup 24), else one."""
    if bm != 64:
        return 1
    smem = itemsize * d * parts * (2 * 64 + 2 * stages * bn) + itemsize * d * 64 + 1024  # (+ barriers)
    return 2 if 2 * (smem + 1024) <= SM_SHARED_BYTES else 1


def _tail(n_items: int, n_m: int, bm: int, nq: int, bh: int, programs: int) -> tuple[int, int]:
    """(t0, items) for the persistent forward: the items of the last round, if it would leave
    programs idle, re-cut into items of bm − 64 rows (see _item) where those fit in one round of
    every program: the round then takes about (bm − 64) / bm of a full one. (n_items, n_items) if
    not: no tail."""
    full, rest = divmod(n_items, programs)
    if not full or not rest:
        return n_items, n_items
    t0 = full * programs
    tm = bm - 64
    first_bh, first = divmod(t0, n_m)
    n_tail = cdiv(nq - first * bm, tm) + (bh - first_bh - 1) * cdiv(nq, tm)
    return (t0, t0 + n_tail) if n_tail <= programs else (n_items, n_items)


def serves_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias, precision: str, causal: bool) -> bool:
    """Whether the backward below takes the call: ``supports`` it, and it measured faster than the
    portable backward there (benchmarks/results/<device>/attention_hopper.csv, bf16 forward +
    backward, CUDA-graph replays; short_rows_ab.csv for 197–401 keys): every call at D = 128; at
    D = 64 every non-causal one (with dQ, dK, dV stored by TMA: 10% ahead at 321 and 401 keys,
    2–4% at 197; its launches planned as the forward's); causal D = 64 from 1024 keys, below which
    the portable backward's 32-row tiles waste less on the diagonal. float32 in ``fp16x3`` (D = 64): from 512
    keys, and shorter rows where the work items fill the GPU (``fills``). Its forward + backward
    measured faster than with the portable backward from ViT's 197 tokens on, causal or not, with
    3072 batch·heads there (attention_hopper_fp32_fwdbwd.csv); with few batch·heads a short call is
    the host's (ViT-T at 224 px, batch 16: 48 of them), and its extra pass is one more launch.
    ``EVERYWHERE`` takes every call it supports."""
    if not (BACKWARD and (_half(q, precision) or _split(q, precision)) and supports(q, k, v, bias, precision)):
        return False
    if EVERYWHERE or q.shape[-1] == 128:
        return True
    if q.dtype == torch.float32:
        return k.shape[2] >= 512 or fills(q)
    return not causal or k.shape[2] >= 1024


def bwd_config(d: int, split: bool = False) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """((BLOCK_M, BLOCK_N, STAGES, consumer registers) of the dK/dV kernel, the same of the dQ
    kernel). dK/dV: 64-row query tiles (at 128 the Sᵀ and dPᵀ accumulators spill), two warpgroups
    of 64 keys at 240 registers (three at 160 registers spill the statistics loaded one tile ahead;
    two measured faster at every length: benchmarks/results/<device>/waves_ab.csv). dQ: two
    64-row warpgroups, key tiles of 128 at D = 64 and 64 at D = 128 (shared memory:
    double-buffered Q and dO plus the K/V ring). ``split`` (fp16x3, D = 64): every tile is two
    buffers (and the dK/dV kernel's query tiles a third pair, q rescaled for dK), so the dQ
    kernel's key tiles are 64 wide and both rings two deep: 192 and 160 KiB of shared memory (a
    third dK/dV stage fits, 213 KiB, and measured 1–3% slower: fp16x3_bwd_stages_ab.csv)."""
    if split:
        return (64, 128, 2, 240), (128, 64, 2, 240)
    if d <= 64:
        return (64, 128, 3, 240), (128, 128, 2, 240)
    return (64, 128, 2, 240), (128, 64, 2, 240)


def backward(do, q, k, v, out, stats, scale: float, causal: bool, grads: tuple, scales=None):
    """(dq, dk, dv) [B,H,N·,D] in q's dtype for a call ``serves_backward`` accepts, from the
    forward's out and stats [B,H,2,Nq] (contiguous; any forward's: the statistics are the same).
    A half-precision dO that TMA cannot read in place (see _tma_readable), or of another dtype, is
    copied first. ``grads``: the (dq, dk, dv) buffers to write, shaped as q, k, v, with a unit
    stride along D. float32 (fp16x3) takes ``scales``, attention._f16_scales's backward [B·H, 4],
    and runs in chunks of batch·heads whose float16 parts fit SPLIT_CHUNK_BYTES."""
    if q.dtype != torch.float32:
        if do.dtype != q.dtype or not _tma_readable(do):
            do = do.to(q.dtype).contiguous()
        return _backward(do, q, k, v, out, stats, scale, causal, grads)
    B, H, Nq, D = q.shape
    # (three float16 pairs of Nq rows: q, q rescaled for dK, dO; two of Nk rows: k, v)
    per = max(1, SPLIT_CHUNK_BYTES // (4 * (3 * Nq + 2 * k.shape[2]) * D))
    rows = scales.view(B, H, -1)
    for bs, hs in _chunks(B, H, per):
        _backward(do[bs, hs], q[bs, hs], k[bs, hs], v[bs, hs], out[bs, hs], stats[bs, hs], scale, causal,
                  tuple(g[bs, hs] for g in grads), rows[bs, hs].reshape(-1, rows.shape[-1]))
    return grads


def _backward(do, q, k, v, out, stats, scale: float, causal: bool, grads: tuple, scales=None):
    """The two kernels' launches (with ``scales``, fp16x3: after _bwd_split_kernel's pass)."""
    B, H, Nq, D = q.shape
    BH = B * H
    split = scales is not None
    if out.stride(-1) != 1:  # (the dQ kernel reads rows of out with a unit stride)
        out = out.contiguous()
    qm = bwd_config(D, split)[1][0]
    nqp = cdiv(Nq, qm) * qm  # (≥ every dK/dV query tile's end: its statistics loads are unmasked)
    # the rows' statistics, planes of [B·H, nqp]: lse2, delta (written by the dQ kernel); with
    # fp16x3 m, delta, 1/S, f, u (written by the split pass)
    rows = torch.empty((5 if split else 2, BH, nqp), device=q.device, dtype=torch.float32)
    dq, dk, dv = grads
    if split:
        q, q2, do, k, v = _bwd_split(do, q, k, v, out, stats, scales, rows)
    else:
        q2, scales = q, rows
    key = ("hopper-bwd", q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), out.stride(),
           dq.stride(), dk.stride(), dv.stride(), q.dtype, q.device, scale, causal, split, TMA_OUT,
           *[g.data_ptr() & 15 == 0 for g in grads])
    dq_launch, dkdv_launch = prepared(key, _backward_launches, q, k, out, grads, nqp, scale, causal, split)
    # dQ first: it writes the rows' lse2 and delta, which the dK/dV kernel reads
    dq_launch(q, do, k, v, out, stats, rows, scales, dq)
    dkdv_launch(q, q2, do, k, v, rows, scales, dk, dv)
    return dq, dk, dv


def _backward_launches(q, k, out, grads: tuple, nqp: int, scale: float, causal: bool,
                       split: bool) -> tuple[Launch, Launch]:
    """The backward's two launches for this call signature (q, k: fp16x3's parts when ``split``):
    the dQ kernel's, called with (q, do, k, v, out, stats, rows, scales, dq), and the dK/dV
    kernel's, called with (q, q2, do, k, v, rows, scales, dk, dv)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if split:
        Nq, Nk = Nq // 2, Nk // 2
    BH = B * H
    dq, dk, dv = grads
    (km, kn, kst, kregs), (qm, qn, qst, qregs) = bwd_config(D, split)
    n_m = cdiv(Nq, qm)
    n_items = n_m * BH
    parts = 2 if split else 1
    programs = n_items if causal else min(n_items, sm_count(q.device.index or 0))  # (as the forward's)
    d64, dq_keys, dk_rows = _blocks(64), _blocks(qn), _blocks(km)
    tma_dq = _tma_writable(split, q.dtype, dq)
    dq_launch = Launch(_bwd_dq_kernel, (programs,),
                       (BH * nqp, *out.stride()[:3], *dq.stride()[:3], H, Nq, Nk, nqp, n_m, n_items, scale,
                        scale * LOG2E),
                       dict(D=D, BLOCK_M=qm, BLOCK_N=qn, STAGES=qst, CAUSAL=causal, CONSUMER_REGS=qregs, PARTS=parts,
                            TMA_GRADS=tma_dq, num_warps=4),
                       leading=((0, d64), (1, d64), (2, dq_keys), (3, dq_keys), 4, 5, 6, 7, 8,
                                (8, d64) if tma_dq else (0, d64)))
    tma_dkv = _tma_writable(split, q.dtype, dk, dv)
    dkdv_launch = Launch(_bwd_dkdv_kernel, (cdiv(Nk, kn), BH),
                         (BH * nqp, *dk.stride()[:3], *dv.stride()[:3], H, Nq, Nk, nqp, scale, scale * LOG2E),
                         dict(D=D, BLOCK_M=km, BLOCK_N=kn, STAGES=kst, CAUSAL=causal, CONSUMER_REGS=kregs,
                              PARTS=parts, TMA_GRADS=tma_dkv, num_warps=4),
                         leading=((0, dk_rows), (1, dk_rows), (2, dk_rows), (3, d64), (4, d64), 5, 6, 7, 8,
                                  (7, d64) if tma_dkv else (3, d64), (8, d64) if tma_dkv else (3, d64)))
    return dq_launch, dkdv_launch


@triton.jit
def _bwd_split_kernel(Q, K, V, dO, Out, Stats, Scales, Parts, Rows, sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d,
                      sv_b, sv_h, sv_n, sv_d, sd_b, sd_h, sd_m, sd_d, so_b, so_h, so_m, so_d, H, BH, Nq, Nk, NQP,
                      D: tl.constexpr, BLOCK: tl.constexpr):
    """fp16x3's operands and row statistics for the Gluon backward, as the portable fp16x3 backward
    forms them in its loops. Program (t, bh, which), rows [t·BLOCK, +BLOCK) of head bh:
      which = 0: q·c_q's float16 (hi, lo) parts, and the same parts times w_i (common.dk_units:
        q's rows as dK's product takes them);
      which = 1, 2: k·c_k's and v·c_v's parts (c_v one per head: the backward's dP sums over the
        features);
      which = 3: dO·c_dO's parts, and the rows' planes of Rows [5, BH, NQP]: m, delta = rowsum(dO∘O)
        in units of c_dO·c_v, r = 1/S, f (common.ds_units), u (common.dk_units); rows from Nq to
        NQP: (+inf, 0, 0, 1, 0), so that P = 0 there.
    Scales [BH, 4]: c_q, c_k, c_v, c_dO (attention._f16_scales_kernel); Stats [BH, 2, Nq] (m, S).
    Parts, one buffer of [BH, 2·N, D] blocks (a row's hi part at row r, its lo part at N + r): q's,
    q's rescaled, dO's (N = Nq), then k's and v's (N = Nk)."""
    t, bh, which, b, h, bh64, BH = _split_program(H, BH)
    rows = t * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    cs = Scales + bh64 * 4
    st = Stats + bh64 * 2 * Nq
    q_part = bh64 * 2 * Nq * D  # (head bh's block in q's parts; + BH·2·Nq·D: in the next tensor's)
    if which == 0:
        if t * BLOCK < Nq:
            ok = rows[:, None] < Nq
            x = tl.load(Q + b * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_m + offs_d[None, :] * sq_d,
                        mask=ok, other=0.0)
            hi, lo = split_f16(x * tl.load(cs))
            _, w = dk_units(1.0 / tl.load(st + Nq + rows, mask=rows < Nq, other=1.0), D)
            at = Parts + q_part + rows[:, None].to(tl.int64) * D + offs_d[None, :]
            tl.store(at, hi, mask=ok)
            tl.store(at + Nq * D, lo, mask=ok)
            at += BH * 2 * Nq * D
            tl.store(at, hi * w[:, None], mask=ok)
            tl.store(at + Nq * D, lo * w[:, None], mask=ok)
    elif which == 3:
        if t * BLOCK < NQP:
            ok = rows < Nq
            do = tl.load(dO + b * sd_b + h * sd_h + rows[:, None].to(tl.int64) * sd_m + offs_d[None, :] * sd_d,
                         mask=ok[:, None], other=0.0)
            o = tl.load(Out + b * so_b + h * so_h + rows[:, None].to(tl.int64) * so_m + offs_d[None, :] * so_d,
                        mask=ok[:, None], other=0.0)
            hi, lo = split_f16(do * tl.load(cs + 3))
            at = Parts + 2 * BH * 2 * Nq * D + q_part + rows[:, None].to(tl.int64) * D + offs_d[None, :]
            tl.store(at, hi, mask=ok[:, None])
            tl.store(at + Nq * D, lo, mask=ok[:, None])
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1) * tl.load(cs + 3) * tl.load(cs + 2)
            r = 1.0 / tl.load(st + Nq + rows, mask=ok, other=1.0)
            u, _ = dk_units(r, D)
            at_r = Rows + bh64 * NQP + rows
            plane = BH * NQP
            in_rows = rows < NQP
            tl.store(at_r, tl.load(st + rows, mask=ok, other=float("inf")), mask=in_rows)
            tl.store(at_r + plane, tl.where(ok, delta, 0.0), mask=in_rows)
            tl.store(at_r + 2 * plane, tl.where(ok, r, 0.0), mask=in_rows)
            tl.store(at_r + 3 * plane, tl.where(ok, ds_units(r, D), 1.0), mask=in_rows)
            tl.store(at_r + 4 * plane, tl.where(ok, u, 0.0), mask=in_rows)
    elif t * BLOCK < Nk:
        ok = rows[:, None] < Nk
        if which == 1:
            x = tl.load(K + b * sk_b + h * sk_h + rows[:, None].to(tl.int64) * sk_n + offs_d[None, :] * sk_d,
                        mask=ok, other=0.0)
        else:
            x = tl.load(V + b * sv_b + h * sv_h + rows[:, None].to(tl.int64) * sv_n + offs_d[None, :] * sv_d,
                        mask=ok, other=0.0)
        hi, lo = split_f16(x * tl.load(cs + which))
        at = (Parts + BH * 6 * Nq * D + (which - 1) * BH * 2 * Nk * D + bh64 * 2 * Nk * D
              + rows[:, None].to(tl.int64) * D + offs_d[None, :])
        tl.store(at, hi, mask=ok)
        tl.store(at + Nk * D, lo, mask=ok)


def _bwd_split(do, q, k, v, out, stats, scales, rows) -> tuple:
    """_bwd_split_kernel's pass: → the float16 parts (q, q rescaled for dK, dO, k, v) as [B, H, 2N, D]
    tensors of one new buffer, and ``rows`` [5, B·H, NQP] filled."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    BH = B * H
    nqp = rows.shape[-1]
    buf = torch.empty(2 * BH * (3 * Nq + 2 * Nk) * D, device=q.device, dtype=torch.float16)
    block = 64
    launch(_bwd_split_kernel, (cdiv(max(nqp, Nk), block), BH, 4), q, k, v, do, out, stats, scales, buf, rows,
           *q.stride(), *k.stride(), *v.stride(), *do.stride(), *out.stride(), H, BH, Nq, Nk, nqp, D=D, BLOCK=block,
           num_warps=4)
    nq, nk = 2 * BH * Nq * D, 2 * BH * Nk * D
    qs = [buf[i * nq:(i + 1) * nq].view(B, H, 2 * Nq, D) for i in range(3)]
    ks = [buf[3 * nq + i * nk:3 * nq + (i + 1) * nk].view(B, H, 2 * Nk, D) for i in range(2)]
    return (*qs, *ks)
