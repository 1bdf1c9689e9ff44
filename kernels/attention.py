"""ELSA attention in Triton: forward as a two-level monoid scan, backward by recomputation.

Forward (the scan). The state of a query row is the monoid element (m, S, W): running max logit,
normaliser and weighted value sum, merged by

    m = max(ma, mb);  S = Sa·2^(ma−m) + Sb·2^(mb−m);  W = Wa·2^(ma−m) + Wb·2^(mb−m)

with identity (−inf, 0, 0), written here in log2 units. Every exponential is an exp2: without a
bias the state is in log2 units (scale·log2 e applied inside the exponent's FMA); with a bias it is
in natural units and the log2 e factor is applied after s − m is formed (see _scores).

  phase 1  grid (query block, batch·head, key partition): each program folds the key tiles of its
           partition in registers and writes the partition summary (m, S, W), all in float32.
  phase 2  grid (query block, batch·head): merges the partition summaries of each row and writes
           out = W / S and the row's statistics (m, S).

With one partition, phase 2 is phase 1's epilogue (no summaries touch memory). Partitions are a
scheduling choice: when (query blocks × batch·heads) cannot fill the GPU, the keys are split into
balanced partitions so that every SM gets equal work (LeanAttention's stream-K idea).

Backward. A dQ kernel loops over key tiles, forming its rows' delta = rowsum(dO·O) first (float32
with a bias gradient: Σ P·dP, from a kernel of its own, _bwd_delta_kernel); a dK/dV kernel (formed
transposed, key tile as the MMAs' M side) runs next and loops over query tiles; both recompute P
from the saved per-row statistics (m, S) — stored as a [B, H, 2, Nq] float32 tensor, m in the
path's units: without a bias log2 units, with one natural units, so that nothing is rounded at the
logits' magnitude before the large terms cancel.
In float32, P = 2^(q·k·scale·log2 e − m₂) / S (with a bias 2^((q·k·scale + b − m)·log2 e) / S):
folding log S into a single log-sum-exp would round log S at its own magnitude, a relative error
of up to ulp(log S) on every P of the row — several times PyTorch's softmax error once a row has
hundreds of keys or logits of ±100. In half precision P is rounded to 8–11 bits for the dots
anyway, so the cheaper lse form (one FMA) is used. ``natural_lse`` gives the natural-log lse.
dBias has a kernel of its own whose programs own a tile of the bias and loop over the batch/head
dimensions the bias is broadcast along. No atomics: gradients are bitwise reproducible.

Masking. Keys past Nk or past the causal diagonal score −inf; a tile with no visible key merges as
the identity; a row with no visible key (S = 0) returns 0 and saves (m, S) = (+inf, 1), so that
P = 0 in backward and its lse is +inf.
Causal is aligned bottom-right: query i sees key j iff j ≤ i + Nk − Nq.

    Nq = 3, Nk = 5            keys →
                      q0   ■ ■ ■ · ·
                      q1   ■ ■ ■ ■ ·
                      q2   ■ ■ ■ ■ ■
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import (C_LOG2E, FP16X3, IEEE, LN2, LOG2E, PRECISION_CODES, SPLIT3, TF32X3, cast, dk_units, dot, dot3,
                     dot_nt, ds_k, ds_units, finite_abs, fma, load_stats, pv, row_mean, split_f16, split_tf32,
                     store_stats)
from .launch import INTERPRET, Launch, cdiv, host_cache, launch, on_device, pow2, prepared, sm_count, tracing
from .ops import AUTOGRAD, COMPILED, KernelOp, route
from .reference import qkv_views
from .tiles import (PLAIN_KEYS, Config, bwd_config, early_dp_default, fwd_config, kv_config, plan_partitions,
                    tail_width)

try:  # the Gluon forward and backward for Hopper (sm_90); absent where Triton ships no Gluon
    from . import hopper
except ImportError:
    hopper = None

# The dK/dV kernel forms Sᵀ = k·qᵀ. A tensor core sums each element over the head dim in the same
# order either way round; NumPy's matmul (the interpreter's dot) does not, so there Sᵀ is formed as
# (q·kᵀ)ᵀ — the forward's orientation, bitwise its scores — and P stays consistent with the
# forward's (m, S) as it is on the GPU.
_SAME_ORIENTATION = tl.constexpr(INTERPRET)


@triton.jit
def _scores(q, q_lo, k_ptrs, bias_ptrs, offs_m, offs_n, offs_d, Nq, Nk, k_end, sk_n, sb_n, scale, ck,
            D: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr,
            PREC: tl.constexpr):
    """Scores [BM, BN] of a query tile against the key tile at offs_n, −inf where invisible.

    With a bias they are the logits q·k·scale + bias in natural units, one FMA (common.fma: the
    backward's _probs rounds them alike), and the caller forms s − m before multiplying by log2 e;
    without one they are the raw q·k, and the caller applies scale·log2 e inside the exponent's
    FMA. Either way the large terms cancel before anything is rounded at their magnitude: with
    logits of ±100 (Swin v2 at its clamp) a rounded log2-domain logit would carry twice PyTorch's
    error."""
    if MASK:
        k = tl.load(k_ptrs + offs_n[None, :] * sk_n,
                    mask=(offs_n[None, :] < k_end) & (offs_d[:, None] < D), other=0.0)
    else:
        k = tl.load(k_ptrs + offs_n[None, :] * sk_n, mask=offs_d[:, None] < D, other=0.0)
    if PREC == TF32X3 and SPLIT3:
        k_hi, k_lo = split_tf32(k)
        s = dot3(q, q_lo, k_hi, k_lo)
    elif PREC == FP16X3:
        k_hi, k_lo = split_f16(k * ck)
        s = dot3(q, q_lo, k_hi, k_lo)
    else:
        s = dot(q, k, PREC)
    if HAS_BIAS:
        bmask = (offs_m[:, None] < Nq) & (offs_n[None, :] < k_end)
        s = fma(s, scale, tl.load(bias_ptrs + offs_n[None, :] * sb_n, mask=bmask, other=0.0).to(tl.float32))
    if MASK:
        visible = offs_n[None, :] < k_end
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + (Nk - Nq))
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def _fold(p, v, acc, c_acc, s_i, c_s, alpha, cv, PREC: tl.constexpr, KAHAN: tl.constexpr):
    """Fold one tile into the running state: (acc·α + p·v, S·α + Σp). p [BM, BN] float32, v [BN, D_PAD].

    With half-precision v the probabilities are rounded to v's dtype for the dot and S sums them
    unrounded, as FlashAttention and PyTorch's bf16 softmax do (round-to-nearest is unbiased, so the
    output error is that of PyTorch's rounded P). Summing the rounded values instead would make
    the output an exact convex combination, at two more conversions per score (a bf16 → float32
    one and a scalar instead of a packed float32 → bf16 one): a quarter more ALU work in a
    softmax that bounds the half-precision forward. In strict float32 ("ieee") the running sums are
    Kahan-compensated (c_acc, c_s): the FMA dot already adds BN terms in sequence, and without
    compensation the error of the tile-to-tile sum grows with the number of key tiles."""
    if PREC == TF32X3 and SPLIT3:
        p_hi, p_lo = split_tf32(p)
        v_hi, v_lo = split_tf32(v)
        return acc * alpha[:, None] + dot3(p_hi, p_lo, v_hi, v_lo), c_acc, s_i * alpha + tl.sum(p, 1), c_s
    elif PREC == FP16X3:  # acc in units of 2^14·cv (see _fwd_kernel's epilogue)
        p_hi, p_lo = split_f16(p * 16384.0)
        v_hi, v_lo = split_f16(v * cv[None, :])
        return acc * alpha[:, None] + dot3(p_hi, p_lo, v_hi, v_lo), c_acc, s_i * alpha + tl.sum(p, 1), c_s
    elif PREC == IEEE and KAHAN:
        a = acc * alpha[:, None]
        y = dot(p, v, PREC) - c_acc * alpha[:, None]
        t = a + y
        sa = s_i * alpha
        ys = tl.sum(p, 1) - c_s * alpha
        ts = sa + ys
        return t, (t - a) - y, ts, (ts - sa) - ys
    elif v.dtype == tl.float32:
        return acc * alpha[:, None] + dot(p, v, PREC), c_acc, s_i * alpha + tl.sum(p, 1), c_s
    else:
        return acc * alpha[:, None] + dot(cast(p, v.dtype), v, PREC), c_acc, s_i * alpha + tl.sum(p, 1), c_s


@triton.jit
def _softmax_step(s, m_i, qk_scale2, HAS_BIAS: tl.constexpr, MASK: tl.constexpr):
    """(m_new, α, p) of a score tile s [BM, BN] against the running max m_i [BM]."""
    if HAS_BIAS:
        # natural units: s − m is formed before the log2 e factor, so it is exact where it matters
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2((m_i - m_safe) * C_LOG2E)
        p = tl.math.exp2((s - m_safe[:, None]) * C_LOG2E)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale2)
        if MASK:
            # a row with nothing visible yet has m = −inf: the tile must merge as the identity, not NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s * qk_scale2 - m_safe[:, None])  # one FMA per score
    return m_new, alpha, p


@triton.jit
def _scan_tile(q, q_lo, k_ptrs, v_ptrs, bias_ptrs, offs_m, offs_n, offs_d, Nq, Nk, k_end, sk_n, sv_n, sb_n,
               scale, qk_scale2, ck, cv, m_i, s_i, c_s, acc, c_acc, D: tl.constexpr, HAS_BIAS: tl.constexpr,
               CAUSAL: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr, KAHAN: tl.constexpr):
    """Merge the key tile at offs_n into the running monoid state (m_i, s_i, acc) of a query tile
    (c_s, c_acc: compensation terms, used in strict float32 only)."""
    s = _scores(q, q_lo, k_ptrs, bias_ptrs, offs_m, offs_n, offs_d, Nq, Nk, k_end, sk_n, sb_n, scale, ck,
                D, HAS_BIAS, CAUSAL, MASK, PREC)
    m_new, alpha, p = _softmax_step(s, m_i, qk_scale2, HAS_BIAS, MASK)
    if MASK:
        v = tl.load(v_ptrs + offs_n[:, None] * sv_n, mask=(offs_n[:, None] < k_end) & (offs_d[None, :] < D), other=0.0)
    else:
        v = tl.load(v_ptrs + offs_n[:, None] * sv_n, mask=offs_d[None, :] < D, other=0.0)
    acc, c_acc, s_i, c_s = _fold(p, v, acc, c_acc, s_i, c_s, alpha, cv, PREC, KAHAN)
    return m_new, s_i, c_s, acc, c_acc


@triton.jit
def _scan_pipelined(q, q_lo, k_ptrs, v_ptrs, bias_ptrs, offs_m, offs_n0, offs_d, Nq, Nk, k_lo, full_end, k_end,
                    sk_n, sv_n, sb_n, scale, qk_scale2, ck, cv, m_i, s_i, c_s, acc, c_acc, D: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
                    KAHAN: tl.constexpr):
    """The unmasked key tiles [k_lo, full_end) as _scan_tile's loop, software-pipelined: the next
    tile's q·kᵀ is issued before this tile's softmax, so its MMAs run under the exponentials and
    the split (see Config.pipeline for where that pays)."""
    if full_end > k_lo:
        s = _scores(q, q_lo, k_ptrs, bias_ptrs, offs_m, k_lo + offs_n0, offs_d, Nq, Nk, k_end, sk_n, sb_n, scale,
                    ck, D, HAS_BIAS, CAUSAL, False, PREC)
        for start in range(k_lo, full_end - BLOCK_N, BLOCK_N):
            s_next = _scores(q, q_lo, k_ptrs, bias_ptrs, offs_m, start + BLOCK_N + offs_n0, offs_d, Nq, Nk, k_end,
                             sk_n, sb_n, scale, ck, D, HAS_BIAS, CAUSAL, False, PREC)
            m_new, alpha, p = _softmax_step(s, m_i, qk_scale2, HAS_BIAS, False)
            v = tl.load(v_ptrs + (start + offs_n0)[:, None] * sv_n, mask=offs_d[None, :] < D, other=0.0)
            acc, c_acc, s_i, c_s = _fold(p, v, acc, c_acc, s_i, c_s, alpha, cv, PREC, KAHAN)
            m_i = m_new
            s = s_next
        m_new, alpha, p = _softmax_step(s, m_i, qk_scale2, HAS_BIAS, False)
        v = tl.load(v_ptrs + (full_end - BLOCK_N + offs_n0)[:, None] * sv_n, mask=offs_d[None, :] < D, other=0.0)
        acc, c_acc, s_i, c_s = _fold(p, v, acc, c_acc, s_i, c_s, alpha, cv, PREC, KAHAN)
        m_i = m_new
    return m_i, s_i, c_s, acc, c_acc


@triton.jit
def _fwd_kernel(
    Q, K, V, Bias, Out, Stats, Ms, Ss, Ws, Scales,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    so_b, so_h, so_m, so_d, sb_b, sb_h, sb_m, sb_n,
    H, Nq, Nk, part_len, n_part, scale, qk_scale2,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
    KAHAN: tl.constexpr, CHUNK: tl.constexpr, PIPELINE: tl.constexpr, TAIL: tl.constexpr,
):
    """Phase 1 (and, unsplit, its epilogue). TAIL < BLOCK_N (no causal mask; see tiles.tail_width): the
    partial last key tile, at most TAIL keys, is scanned TAIL wide. CHUNK > 0 (float32, unsplit): the
    interior key tiles are folded CHUNK keys at a time into a fresh state, and each chunk's state is
    merged with the monoid operator into the running one, whose W lives in this program's rows of Out
    (float32): the two-level scan inside one program. Rounding then accumulates over CHUNK / BLOCK_N
    tile sums plus Nk / CHUNK merges instead of Nk / BLOCK_N tile sums, at no register cost — Kahan
    compensation, the other way to bound it, doubles the accumulator registers (at 64×64 tiles it
    spilled)."""
    scale, qk_scale2 = tl.cast(scale, tl.float32), tl.cast(qk_scale2, tl.float32)  # inductor passes float64
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    part = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :] * sq_d,
                mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0)
    q_lo = q
    ck = 1.0
    cv = 1.0
    if PREC == TF32X3 and SPLIT3:
        q, q_lo = split_tf32(q)  # once per program: q is reused by every key tile
    elif PREC == FP16X3:
        cs = Scales + bh.to(tl.int64) * (2 + D_PAD)
        cq = tl.load(cs)
        ck = tl.load(cs + 1)
        cv = tl.load(cs + 2 + offs_d)  # per feature column
        q, q_lo = split_f16(q * cq)
        scale = scale / cq / ck  # powers of two: the logits round as unscaled ones would
        qk_scale2 = qk_scale2 / cq / ck
    k_ptrs = K + b * sk_b + h * sk_h + offs_d[:, None] * sk_d
    v_ptrs = V + b * sv_b + h * sv_h + offs_d[None, :] * sv_d
    bias_ptrs = Bias + b * sb_b + h * sb_h + offs_m[:, None] * sb_m

    k_lo = part * part_len
    k_end = tl.minimum(k_lo + part_len, Nk)  # partition end: keys ≥ k_end are not this program's
    k_hi = k_end
    full_end = k_lo + ((k_end - k_lo) // BLOCK_N) * BLOCK_N  # tiles before this need no key mask
    if CAUSAL:
        diag = Nk - Nq
        k_hi = tl.minimum(k_hi, (pid_m + 1) * BLOCK_M + diag)  # last key any row of the block sees, +1
        lowest = pid_m * BLOCK_M + diag + 1  # every row of the block sees keys < lowest
        full_end = tl.minimum(full_end, k_lo + tl.maximum((lowest - k_lo) // BLOCK_N, 0) * BLOCK_N)
    full_end = tl.maximum(full_end, k_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    c_s = tl.zeros([BLOCK_M], tl.float32)
    c_acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    offs_n0 = tl.arange(0, BLOCK_N)
    # unmasked interior tiles, then the masked tail (partial tile, causal diagonal)
    if CHUNK > 0:
        o_ptrs = Out + b * so_b + h * so_h + offs_m[:, None] * so_m + offs_d[None, :] * so_d
        o_mask = (offs_m[:, None] < Nq) & (offs_d[None, :] < D)
        m_t = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s_t = tl.zeros([BLOCK_M], tl.float32)
        for c0 in range(k_lo, full_end, CHUNK):
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            s_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
            for start in range(c0, tl.minimum(c0 + CHUNK, full_end), BLOCK_N):
                m_i, s_i, c_s, acc, c_acc = _scan_tile(
                    q, q_lo, k_ptrs, v_ptrs, bias_ptrs, offs_m, start + offs_n0, offs_d, Nq, Nk, k_end, sk_n,
                    sv_n, sb_n, scale, qk_scale2, ck, cv, m_i, s_i, c_s, acc, c_acc, D, HAS_BIAS, CAUSAL, False,
                    PREC, KAHAN)
            w_t = tl.load(o_ptrs, mask=o_mask & (c0 > k_lo), other=0.0)
            m_t, s_t, w_t = _combine(m_t, s_t, w_t, m_i, s_i, acc, HAS_BIAS)
            tl.store(o_ptrs, w_t, mask=o_mask)
            tl.debug_barrier()  # the next chunk's load may be another thread's store
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    elif PIPELINE:
        m_i, s_i, c_s, acc, c_acc = _scan_pipelined(
            q, q_lo, k_ptrs, v_ptrs, bias_ptrs, offs_m, offs_n0, offs_d, Nq, Nk, k_lo, full_end, k_end, sk_n, sv_n,
            sb_n, scale, qk_scale2, ck, cv, m_i, s_i, c_s, acc, c_acc, D, BLOCK_N, HAS_BIAS, CAUSAL, PREC, KAHAN)
    else:
        for start in range(k_lo, full_end, BLOCK_N):
            m_i, s_i, c_s, acc, c_acc = _scan_tile(
                q, q_lo, k_ptrs, v_ptrs, bias_ptrs, offs_m, start + offs_n0, offs_d, Nq, Nk, k_end, sk_n, sv_n,
                sb_n, scale, qk_scale2, ck, cv, m_i, s_i, c_s, acc, c_acc, D, HAS_BIAS, CAUSAL, False, PREC, KAHAN)
    if TAIL < BLOCK_N:
        # one partial tile at most (partitions are whole tiles, no diagonal): a 197-key row scans
        # 3 × 64 + 16 keys instead of 4 × 64
        if k_hi > full_end:
            m_i, s_i, c_s, acc, c_acc = _scan_tile(
                q, q_lo, k_ptrs, v_ptrs, bias_ptrs, offs_m, full_end + tl.arange(0, TAIL), offs_d, Nq, Nk, k_end,
                sk_n, sv_n, sb_n, scale, qk_scale2, ck, cv, m_i, s_i, c_s, acc, c_acc, D, HAS_BIAS, CAUSAL, True,
                PREC, KAHAN)
    else:
        for start in range(full_end, k_hi, BLOCK_N):
            m_i, s_i, c_s, acc, c_acc = _scan_tile(
                q, q_lo, k_ptrs, v_ptrs, bias_ptrs, offs_m, start + offs_n0, offs_d, Nq, Nk, k_end, sk_n, sv_n,
                sb_n, scale, qk_scale2, ck, cv, m_i, s_i, c_s, acc, c_acc, D, HAS_BIAS, CAUSAL, True, PREC, KAHAN)
    if CHUNK > 0:  # the tail joins the chunks' running state
        w_t = tl.load(o_ptrs, mask=o_mask & (full_end > k_lo), other=0.0)
        m_i, s_i, acc = _combine(m_t, s_t, w_t, m_i, s_i, acc, HAS_BIAS)
    if PREC == IEEE and KAHAN:
        acc -= c_acc
        s_i -= c_s
    if PREC == FP16X3:
        acc = acc * (1.0 / 16384.0) * (1.0 / cv)[None, :]

    row_ok = offs_m < Nq
    if SPLIT:
        # phase-1 summary of this (query block, partition): [BH, n_part, Nq] and [BH, n_part, Nq, D_PAD]
        srow = (bh.to(tl.int64) * n_part + part) * Nq + offs_m
        tl.store(Ms + srow, m_i, mask=row_ok)
        tl.store(Ss + srow, s_i, mask=row_ok)
        tl.store(Ws + srow[:, None] * D_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
    else:
        nonempty = s_i > 0
        out = acc / tl.where(nonempty, s_i, 1.0)[:, None]
        tl.store(Out + b * so_b + h * so_h + offs_m[:, None] * so_m + offs_d[None, :] * so_d,
                 cast(out, Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))
        store_stats(Stats, bh, offs_m, row_ok, Nq, m_i, s_i, nonempty)


@triton.jit
def _f16_scales_kernel(Q, K, V, dO, Scales, Partials, sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h,
                       sv_n, sv_d, sd_b, sd_h, sd_m, sd_d, H, Nq, Nk, CHUNK, n_chunks, D: tl.constexpr,
                       D_PAD: tl.constexpr, BLOCK: tl.constexpr, V_COLS: tl.constexpr, ROW: tl.constexpr,
                       PARTIAL: tl.constexpr):
    """Scales [BH, ROW] float32: per batch·head the powers of two that put the largest |x| of a tensor
    into [2^13, 2^14) for the float16 split (split_f16). Program (bh, t, c) takes rows
    [c·CHUNK, (c + 1)·CHUNK) of tensor t of head bh: q, k, v, then dO (the backward's grid has four).
    With PARTIAL (more than one chunk) it writes their largest |x| per column to Partials
    [BH, T, n_chunks, D_PAD], and _f16_scales_finish_kernel makes the scales from those; else it
    writes the scales (_store_scales). A maximum does not depend on the order it is taken in: the
    scales are the same however the rows are cut."""
    bh = tl.program_id(0)
    which = tl.program_id(1)
    c = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    if which == 0:
        base, s_n, s_d, n = Q + b * sq_b + h * sq_h, sq_m, sq_d, Nq
    elif which == 1:
        base, s_n, s_d, n = K + b * sk_b + h * sk_h, sk_n, sk_d, Nk
    elif which == 2:
        base, s_n, s_d, n = V + b * sv_b + h * sv_h, sv_n, sv_d, Nk
    else:
        base, s_n, s_d, n = dO + b * sd_b + h * sd_h, sd_m, sd_d, Nq
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D_PAD)
    col = tl.zeros([D_PAD], tl.float32)
    lo = c * CHUNK
    for start in range(lo, tl.minimum(lo + CHUNK, n), BLOCK):
        rows = start + offs_r
        x = tl.load(base + rows[:, None].to(tl.int64) * s_n + offs_d[None, :] * s_d,
                    mask=(rows[:, None] < n) & (offs_d[None, :] < D), other=0.0)
        col = tl.maximum(col, tl.max(finite_abs(x.to(tl.float32)), 0))
    if PARTIAL:
        tl.store(Partials + ((bh.to(tl.int64) * tl.num_programs(1) + which) * n_chunks + c) * D_PAD + offs_d, col)
    else:
        _store_scales(col, which, bh, Scales, offs_d, V_COLS, ROW)


@triton.jit
def _f16_scales_finish_kernel(Partials, Scales, n_chunks, D_PAD: tl.constexpr, V_COLS: tl.constexpr,
                              ROW: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (bh, t): the scales of tensor t of head bh from its chunks' column maxima (Partials
    [BH, T, n_chunks, D_PAD], _f16_scales_kernel)."""
    bh = tl.program_id(0)
    which = tl.program_id(1)
    base = Partials + (bh.to(tl.int64) * tl.num_programs(1) + which) * n_chunks * D_PAD
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, D_PAD)
    col = tl.zeros([D_PAD], tl.float32)
    for c0 in range(0, n_chunks, BLOCK_C):
        cs = c0 + offs_c
        x = tl.load(base + cs[:, None] * D_PAD + offs_d[None, :], mask=cs[:, None] < n_chunks, other=0.0)
        col = tl.maximum(col, tl.max(x, 0))
    _store_scales(col, which, bh, Scales, offs_d, V_COLS, ROW)


@triton.jit
def _store_scales(col, which, bh, Scales, offs_d, V_COLS: tl.constexpr, ROW: tl.constexpr):
    """Write tensor ``which``'s scales (see _f16_scales_kernel) from its largest |x| per column
    ``col`` [D_PAD]. Slots 0, 1: c_q, c_k; with V_COLS (the forward) slots 2… hold c_v per feature
    column (ROW = 2 + D_PAD), else slot 2 holds one c_v per head and slot 3 c_dO (ROW = 4: the
    backward's dP = dO·vᵀ sums over the features, so one scale per head). v's per-column scale is
    undone on each output column, so an outlier feature costs the other features nothing; q and k
    meet in one logit and share one scale per head. Their product's inverse must stay a normal
    float32 next to the softmax scale, so c_q and c_k stop at 2^60 (heads whose every |x| < 2⁻⁴⁷
    keep less precision); c_v and c_dO, applied one at a time, stop at 2^113. Powers of two scale
    exactly."""
    per_col = (which == 2) & V_COLS
    top = tl.where(per_col, col, tl.max(col, 0))
    # floor(log2 top) from the exponent bits (top is finite: finite_abs); a zero column takes the lowest scale
    e = tl.maximum(((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, tl.where(which >= 2, -100, -47))
    slot = tl.where(per_col, 2 + offs_d, which)
    tl.store(Scales + bh.to(tl.int64) * ROW + slot, ((140 - e) << 23).to(tl.float32, bitcast=True),
             mask=per_col | (offs_d == 0))


@triton.jit
def _combine(ma, sa, wa, mb, sb, wb, NATURAL: tl.constexpr):
    """The monoid operator on two row states (m [BM], S [BM], W [BM, D_PAD]); m in natural units
    when NATURAL, else log2 units. A pair of empty states (m = −inf) gives the identity, not NaN."""
    m = tl.maximum(ma, mb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    if NATURAL:
        a = tl.math.exp2((ma - m_safe) * C_LOG2E)
        c = tl.math.exp2((mb - m_safe) * C_LOG2E)
    else:
        a = tl.math.exp2(ma - m_safe)
        c = tl.math.exp2(mb - m_safe)
    return m, sa * a + sb * c, wa * a[:, None] + wb * c[:, None]


@triton.jit
def _merge_kernel(
    Ms, Ss, Ws, Out, Stats, so_b, so_h, so_m, so_d, H, Nq, n_part,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, NATURAL: tl.constexpr,
):
    """Phase 2: fold the n_part partition summaries of each row with the monoid operator
    (m in natural units when NATURAL — the bias path — else in log2 units)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < Nq
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    w = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for part in range(0, n_part):
        srow = (bh.to(tl.int64) * n_part + part) * Nq + offs_m
        mp = tl.load(Ms + srow, mask=row_ok, other=float("-inf"))
        sp = tl.load(Ss + srow, mask=row_ok, other=0.0)
        wp = tl.load(Ws + srow[:, None] * D_PAD + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        m, s, w = _combine(m, s, w, mp, sp, wp, NATURAL)
    nonempty = s > 0
    out = w / tl.where(nonempty, s, 1.0)[:, None]
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    tl.store(Out + b * so_b + h * so_h + offs_m[:, None] * so_m + offs_d[None, :] * so_d,
             cast(out, Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))
    store_stats(Stats, bh, offs_m, row_ok, Nq, m, s, nonempty)


@triton.jit
def _probs(qk, bias, scale, qk_scale2, m, r, HAS_BIAS: tl.constexpr, EXACT: tl.constexpr):
    """P (or Pᵀ) from the raw q·k tile, the bias tile and the row statistics of load_stats (log2
    units without a bias, natural units with one), already broadcast along the key axis (m[:, None]
    for a [queries, keys] tile, m[None, :] for a transposed one), with the same rounding structure
    as the forward (see _scores)."""
    if HAS_BIAS:  # natural units on this path: s − m is formed before the log2 e factor
        d = fma(qk, scale, bias) - m
        if not EXACT:  # (r: ln S, subtracted after m; see load_stats)
            d = d - r
        p = tl.math.exp2(d * C_LOG2E)
    else:
        p = tl.math.exp2(qk * qk_scale2 - m)
    if EXACT:
        p = p * r
    return p


@triton.jit
def _head_scales(Scales, bh, PREC: tl.constexpr):
    """(c_q, c_k, c_v, c_dO) of head bh for the float16 split (see _f16_scales_kernel); 1s otherwise."""
    if PREC == FP16X3:
        cs = Scales + bh.to(tl.int64) * 4
        return tl.load(cs), tl.load(cs + 1), tl.load(cs + 2), tl.load(cs + 3)
    else:
        return 1.0, 1.0, 1.0, 1.0


@triton.jit
def _dkdv_step(dk, dv, k, k_lo, v, v_lo, q_base, do_base, bias_base, Stats, Delta, bh, offs_m, offs_n, offs_d,
               Nq, Nk, sq_m, sq_d, sdo_m, sdo_d, sb_m, sb_n, s_scale, s_scale2, cq, cv, cdo, D: tl.constexpr,
               D_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
               EXACT: tl.constexpr, EARLY_DP: tl.constexpr):
    """(dk, dv) [BLOCK_N, D_PAD] plus the shares dSᵀ·q and Pᵀ·dO of the query tile at offs_m (any
    width): the body of _bwd_dkdv_kernel's loop."""
    row_ok = offs_m < Nq
    qT = tl.load(q_base + offs_m[None, :] * sq_m + offs_d[:, None] * sq_d,
                 mask=row_ok[None, :] & (offs_d[:, None] < D), other=0.0)
    do = tl.load(do_base + offs_m[:, None] * sdo_m + offs_d[None, :] * sdo_d,
                 mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    m_r, r_r = load_stats(Stats, bh, offs_m, row_ok, Nq, HAS_BIAS, EXACT)
    delta = tl.load(Delta + bh.to(tl.int64) * Nq + offs_m, mask=row_ok, other=0.0)
    do_lo = do
    if PREC == FP16X3:
        qT, qT_lo = split_f16(qT * cq)
        do, do_lo = split_f16(do * cdo)
        delta = delta * cdo * cv
        if _SAME_ORIENTATION:
            qkT = tl.trans(dot3(tl.trans(qT), tl.trans(qT_lo), tl.trans(k), tl.trans(k_lo)))
        else:
            qkT = dot3(k, k_lo, qT, qT_lo)
    elif _SAME_ORIENTATION:
        qkT = tl.trans(dot(tl.trans(qT), tl.trans(k), PREC))
    else:
        qkT = dot(k, qT, PREC)
    if EARLY_DP:
        dpT = dot_nt(v, v_lo, do, do_lo, PREC)
    btT = 0.0
    if HAS_BIAS:
        btT = tl.load(bias_base + offs_m[None, :] * sb_m + offs_n[:, None] * sb_n,
                      mask=row_ok[None, :] & (offs_n[:, None] < Nk), other=0.0).to(tl.float32)
    visible = offs_n[:, None] < Nk
    if CAUSAL:
        visible = visible & (offs_n[:, None] <= offs_m[None, :] + (Nk - Nq))
    pT = tl.where(visible, _probs(qkT, btT, s_scale, s_scale2, m_r[None, :], r_r[None, :], HAS_BIAS, EXACT), 0.0)
    dv = dv + pv(pT, do, do_lo, PREC)
    if not EARLY_DP:
        dpT = dot_nt(v, v_lo, do, do_lo, PREC)
    dsT = pT * (dpT - delta[None, :])
    if PREC == FP16X3:
        u, w = dk_units(r_r, D_PAD)
        a_hi, a_lo = split_f16(dsT * u[None, :])
        dk = dk + dot3(a_hi, a_lo, tl.trans(qT) * w[:, None], tl.trans(qT_lo) * w[:, None])
    else:
        dk = dk + dot(cast(dsT, qT.dtype), tl.trans(qT), PREC)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, Bias, dOut, Stats, Delta, dK, dV, Scales,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    sdo_b, sdo_h, sdo_m, sdo_d, sb_b, sb_h, sb_m, sb_n, sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n, dk_off, dv_off,
    H, Nq, Nk, qk_scale2, scale,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
    EARLY_DP: tl.constexpr, TAIL: tl.constexpr, ONE_BUFFER: tl.constexpr,
):
    """One key tile per program; loops over the query tiles that can see it (TAIL < BLOCK_M: the
    partial last one TAIL rows wide). Everything is formed transposed — Sᵀ = k·qᵀ [BLOCK_N, BLOCK_M]
    — so that all four products have the key tile as their M dimension (dV += Pᵀ·dO, dPᵀ = v·dOᵀ,
    dK += dSᵀ·q): with BLOCK_N = 64 each is one warpgroup MMA on Hopper, where a [BLOCK_M, BLOCK_N]
    score tile transposed for dV and dK would put BLOCK_N = 32 rows there (mma.sync, or duplicated
    work).

    fp16x3 (PREC 4): k, v, q, dO are split at their heads' scales; Pᵀ goes in as Pᵀ·2^14. dSᵀ's
    column i (query i) is scaled by t_i = 2^min(−floor(log2 r_i), 10) ≈ S_i (see ds_units) and q's
    row i by 1/t_i after the split (exact in float16 down to its subnormals), so the scalings cancel
    in dK; the cap keeps q's rows at least 2^-10 of their scaled range. EARLY_DP: see early_dp_default.
    ONE_BUFFER: dK and dV lie in one tensor, passed as dK (the packed gradient of a qkv projection),
    at element offsets dk_off and dv_off; dV is not written. (Two pointers into one tensor would
    each be taken as written, and torch.compile's functional form of the launch would then copy
    the tensor for each.)"""
    qk_scale2, scale = tl.cast(qk_scale2, tl.float32), tl.cast(scale, tl.float32)  # inductor passes float64
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    kv_mask = (offs_n[:, None] < Nk) & (offs_d[None, :] < D)
    k = tl.load(K + b * sk_b + h * sk_h + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d, mask=kv_mask, other=0.0)
    v = tl.load(V + b * sv_b + h * sv_h + offs_n[:, None] * sv_n + offs_d[None, :] * sv_d, mask=kv_mask, other=0.0)
    cq, ck, cv, cdo = _head_scales(Scales, bh, PREC)
    k_lo = k
    v_lo = v
    s_scale = scale
    s_scale2 = qk_scale2
    if PREC == FP16X3:
        k, k_lo = split_f16(k * ck)
        v, v_lo = split_f16(v * cv)
        s_scale = scale / cq / ck  # powers of two: the logits round as the forward's did
        s_scale2 = qk_scale2 / cq / ck
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    m_lo = 0
    if CAUSAL:
        m_lo = tl.maximum(pid_n * BLOCK_N - (Nk - Nq), 0)  # first query that sees this tile's first key
        m_lo = (m_lo // BLOCK_M) * BLOCK_M
    offs_m0 = tl.arange(0, BLOCK_M)
    q_base = Q + b * sq_b + h * sq_h
    do_base = dOut + b * sdo_b + h * sdo_h
    bias_base = Bias + b * sb_b + h * sb_h
    m_hi = Nq
    if TAIL < BLOCK_M:  # full query tiles, then the partial one TAIL wide
        m_hi = (Nq // BLOCK_M) * BLOCK_M
    for start in range(m_lo, m_hi, BLOCK_M):
        dk, dv = _dkdv_step(
            dk, dv, k, k_lo, v, v_lo, q_base, do_base, bias_base, Stats, Delta, bh, start + offs_m0, offs_n, offs_d,
            Nq, Nk, sq_m, sq_d, sdo_m, sdo_d, sb_m, sb_n, s_scale, s_scale2, cq, cv, cdo, D, D_PAD, HAS_BIAS,
            CAUSAL, PREC, EXACT, EARLY_DP)
    if TAIL < BLOCK_M:
        if m_hi < Nq:  # (m_lo ≤ m_hi: a causal program's first tile is at most the partial one)
            dk, dv = _dkdv_step(
                dk, dv, k, k_lo, v, v_lo, q_base, do_base, bias_base, Stats, Delta, bh, m_hi + tl.arange(0, TAIL),
                offs_n, offs_d, Nq, Nk, sq_m, sq_d, sdo_m, sdo_d, sb_m, sb_n, s_scale, s_scale2, cq, cv, cdo, D, D_PAD,
                HAS_BIAS, CAUSAL, PREC, EXACT, EARLY_DP)
    if PREC == FP16X3:  # one power of two at a time: their product may leave float32's range
        dk = dk * (65536.0 * D_PAD) * (1.0 / cq) * (1.0 / cdo) * (1.0 / cv)
        dv = dv * (1.0 / 16384.0) * (1.0 / cdo)
    dk = dk * scale
    dv_base = dK if ONE_BUFFER else dV
    tl.store(dK + dk_off + b * sdk_b + h * sdk_h + offs_n[:, None] * sdk_n + offs_d[None, :],
             cast(dk, dK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_base + dv_off + b * sdv_b + h * sdv_h + offs_n[:, None] * sdv_n + offs_d[None, :],
             cast(dv, dK.dtype.element_ty), mask=kv_mask)  # (q, k, v, so their gradients, share a dtype)


@triton.jit
def _p_dp_tile(q, q_lo, do, do_lo, k_base, v_base, bias_base, offs_m, offs_n, offs_d, row_ok, m_r, r_r,
               Nq, Nk, sk_n, sk_d, sv_n, sv_d, sb_m, sb_n, scale, qk_scale2, ck, cv,
               D: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
               EXACT: tl.constexpr):
    """(k, k_lo, P, dP) of a query tile (q, dO [BM, D_PAD]) against the key tile at offs_n: k
    [BN, D_PAD], P and dP = dO·vᵀ [BM, BN], P = 0 where a key is invisible. fp16x3: q, dO and the
    returned k come as float16 (hi, lo) pairs of the scaled tensors, dP in units of c_dO·c_v, and
    scale / qk_scale2 include 1/(c_q·c_k); otherwise k_lo is k."""
    kvm = (offs_n[:, None] < Nk) & (offs_d[None, :] < D)
    k = tl.load(k_base + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d, mask=kvm, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * sv_n + offs_d[None, :] * sv_d, mask=kvm, other=0.0)
    if PREC == FP16X3:
        k, k_lo = split_f16(k * ck)
        v, v_lo = split_f16(v * cv)
        qk = dot3(q, q_lo, tl.trans(k), tl.trans(k_lo))
    else:
        k_lo = k
        v_lo = v
        qk = dot(q, tl.trans(k), PREC)
    dp = dot_nt(do, do_lo, v, v_lo, PREC)
    bt = 0.0
    if HAS_BIAS:
        bt = tl.load(bias_base + offs_m[:, None] * sb_m + offs_n[None, :] * sb_n,
                     mask=row_ok[:, None] & (offs_n[None, :] < Nk), other=0.0).to(tl.float32)
    visible = offs_n[None, :] < Nk
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + (Nk - Nq))
    p = tl.where(visible, _probs(qk, bt, scale, qk_scale2, m_r[:, None], r_r[:, None], HAS_BIAS, EXACT), 0.0)
    return k, k_lo, p, dp


@triton.jit
def _query_rows(pid_m, bh, H, Nq, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(b, h, offs_m, offs_d, row_ok, q/dO mask) of query tile pid_m of head bh. (Kept apart from
    _query_tile's loads: inductor's analysis of which tensors a kernel writes follows a stored
    pointer back through helper calls, and takes every pointer passed to a helper whose results
    address a store as written.)"""
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < Nq
    return b, h, offs_m, offs_d, row_ok, row_ok[:, None] & (offs_d[None, :] < D)


@triton.jit
def _query_tile(Q, dOut, Stats, Scales, b, h, bh, offs_m, offs_d, row_ok, qm, Nq, sq_b, sq_h, sq_m, sq_d,
                sdo_b, sdo_h, sdo_m, sdo_d, scale, qk_scale2, HAS_BIAS: tl.constexpr, EXACT: tl.constexpr,
                PREC: tl.constexpr):
    """What a backward program that owns a query tile (see _query_rows) reads once: (q, q_lo, dO,
    dO_lo [BLOCK_M, D_PAD], the rows' statistics of load_stats, the logits' scale and scale·log2 e,
    and the head's c_k, c_v, c_dO). fp16x3: q and dO as float16 (hi, lo) pairs of the scaled
    tensors, the logits' scales with 1/(c_q·c_k) folded in; otherwise the _lo parts are the
    tensors themselves and the c's are 1."""
    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :] * sq_d, mask=qm, other=0.0)
    do = tl.load(dOut + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_m + offs_d[None, :] * sdo_d, mask=qm, other=0.0)
    m_r, r_r = load_stats(Stats, bh, offs_m, row_ok, Nq, HAS_BIAS, EXACT)
    cq, ck, cv, cdo = _head_scales(Scales, bh, PREC)
    q_lo = q
    do_lo = do
    if PREC == FP16X3:
        q, q_lo = split_f16(q * cq)
        do, do_lo = split_f16(do * cdo)
        scale = scale / cq / ck
        qk_scale2 = qk_scale2 / cq / ck
    return q, q_lo, do, do_lo, m_r, r_r, scale, qk_scale2, ck, cv, cdo


@triton.jit
def _bwd_delta_kernel(
    Q, K, V, Bias, dOut, Stats, Delta, Scales,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    sdo_b, sdo_h, sdo_m, sdo_d, sb_b, sb_h, sb_m, sb_n,
    H, Nq, Nk, qk_scale2, scale,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
):
    """delta[bh, i] = Σ_j P_ij·dP_ij from the very P and dP that form dS (float32 with a bias
    gradient, in place of the dQ kernel's rowsum(dO ⊙ O)). That is the same number in exact arithmetic,
    but O carries the forward's rounding, and a bias broadcast along queries sums dS down its
    columns, where that per-row error no longer cancels: such a dbias came out 5× less accurate
    than PyTorch's.

    The same pass sums l_i = Σ_j P_ij and stores delta / l: the backward's logits need not round
    exactly as the forward's did (another product order), so its P rows sum to 1 only within
    that logit error — ~1e-5 with logits of ±100 (cosine attention at τ = 100). With delta
    unnormalised, Σ_j dS_ij = (1 − l)·delta instead of 0, an error at delta's magnitude, not dS's:
    dQ/dK came out 3–8× less accurate than PyTorch's on the H200. Dividing delta by l makes every
    row of dS sum to zero; what remains is a relative error l − 1 on dS. (Renormalising P itself
    was measured worse for dV: P's own error is as small as it gets, its sum is not what dV needs.)"""
    qk_scale2, scale = tl.cast(qk_scale2, tl.float32), tl.cast(scale, tl.float32)  # inductor passes float64
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h, offs_m, offs_d, row_ok, qm = _query_rows(pid_m, bh, H, Nq, D, D_PAD, BLOCK_M)
    q, q_lo, do, do_lo, m_r, r_r, scale, qk_scale2, ck, cv, cdo = _query_tile(
        Q, dOut, Stats, Scales, b, h, bh, offs_m, offs_d, row_ok, qm, Nq, sq_b, sq_h, sq_m, sq_d,
        sdo_b, sdo_h, sdo_m, sdo_d, scale, qk_scale2, HAS_BIAS, EXACT, PREC)
    k_hi = Nk
    if CAUSAL:
        k_hi = tl.minimum(Nk, (pid_m + 1) * BLOCK_M + (Nk - Nq))
    offs_n0 = tl.arange(0, BLOCK_N)
    delta = tl.zeros([BLOCK_M], tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, k_hi, BLOCK_N):
        k, k_lo, p, dp = _p_dp_tile(q, q_lo, do, do_lo, K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h,
                                    Bias + b * sb_b + h * sb_h, offs_m, start + offs_n0, offs_d, row_ok, m_r, r_r,
                                    Nq, Nk, sk_n, sk_d, sv_n, sv_d, sb_m, sb_n, scale, qk_scale2, ck, cv,
                                    D, HAS_BIAS, CAUSAL, PREC, EXACT)
        delta += tl.sum(p * dp, 1)
        l += tl.sum(p, 1)
    if PREC == FP16X3:
        delta = delta * (1.0 / cdo) * (1.0 / cv)
    tl.store(Delta + bh.to(tl.int64) * Nq + offs_m, row_mean(delta, l), mask=row_ok)


@triton.jit
def _dq_step(dq, q, q_lo, do, do_lo, k_base, v_base, bias_base, offs_m, offs_n, offs_d, row_ok, m_r, r_r, delta, f,
             Nq, Nk, sk_n, sk_d, sv_n, sv_d, sb_m, sb_n, scale, qk_scale2, ck, cv, D: tl.constexpr,
             HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr):
    """dq [BM, D_PAD] plus the key tile at offs_n's share dS·k (see _p_dp_tile, ds_k)."""
    k, k_lo, p, dp = _p_dp_tile(q, q_lo, do, do_lo, k_base, v_base, bias_base, offs_m, offs_n, offs_d, row_ok, m_r,
                                r_r, Nq, Nk, sk_n, sk_d, sv_n, sv_d, sb_m, sb_n, scale, qk_scale2, ck, cv,
                                D, HAS_BIAS, CAUSAL, PREC, EXACT)
    return dq + ds_k(p * (dp - delta[:, None]), f, k, k_lo, PREC)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, Bias, dOut, Out, Stats, Delta, dQ, Scales,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    sdo_b, sdo_h, sdo_m, sdo_d, sb_b, sb_h, sb_m, sb_n, so_b, so_h, so_m, so_d, sdq_b, sdq_h, sdq_m,
    H, Nq, Nk, qk_scale2, scale,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr, TAIL: tl.constexpr,
    OWN_DELTA: tl.constexpr,
):
    """One query tile per program; loops over the key tiles it can see (TAIL: as _fwd_kernel's).
    OWN_DELTA: the program forms its rows' delta = rowsum(dO·O) itself (no launch of its own) and
    stores it for the dK/dV kernel that runs next; otherwise it reads Delta (_bwd_delta_kernel's).
    fp16x3: dS row i enters the product scaled by f_i (ds_units), undone on dQ's row i at the end."""
    qk_scale2, scale = tl.cast(qk_scale2, tl.float32), tl.cast(scale, tl.float32)  # inductor passes float64
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h, offs_m, offs_d, row_ok, qm = _query_rows(pid_m, bh, H, Nq, D, D_PAD, BLOCK_M)
    q, q_lo, do, do_lo, m_r, r_r, s_scale, s_scale2, ck, cv, cdo = _query_tile(
        Q, dOut, Stats, Scales, b, h, bh, offs_m, offs_d, row_ok, qm, Nq, sq_b, sq_h, sq_m, sq_d,
        sdo_b, sdo_h, sdo_m, sdo_d, scale, qk_scale2, HAS_BIAS, EXACT, PREC)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    k_hi = Nk
    if CAUSAL:
        k_hi = tl.minimum(Nk, (pid_m + 1) * BLOCK_M + (Nk - Nq))
    offs_n0 = tl.arange(0, BLOCK_N)
    k_base = K + b * sk_b + h * sk_h
    v_base = V + b * sv_b + h * sv_h
    bias_base = Bias + b * sb_b + h * sb_h
    if OWN_DELTA:  # (dO read again as it is: _query_tile's dO is split and scaled under fp16x3)
        o = tl.load(Out + b * so_b + h * so_h + offs_m[:, None] * so_m + offs_d[None, :] * so_d, mask=qm, other=0.0)
        do_in = tl.load(dOut + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_m + offs_d[None, :] * sdo_d, mask=qm,
                        other=0.0)
        delta = tl.sum(o.to(tl.float32) * do_in.to(tl.float32), 1)
        tl.store(Delta + bh.to(tl.int64) * Nq + offs_m, delta, mask=row_ok)
    else:
        delta = tl.load(Delta + bh.to(tl.int64) * Nq + offs_m, mask=row_ok, other=0.0)
    f = 1.0
    if PREC == FP16X3:
        delta = delta * cdo * cv
        f = ds_units(r_r, D_PAD)
    if TAIL < BLOCK_N:  # full tiles, then the partial one TAIL wide (no causal mask: k_hi is Nk)
        k_hi = (Nk // BLOCK_N) * BLOCK_N
    for start in range(0, k_hi, BLOCK_N):
        dq = _dq_step(dq, q, q_lo, do, do_lo, k_base, v_base, bias_base, offs_m, start + offs_n0, offs_d, row_ok,
                      m_r, r_r, delta, f, Nq, Nk, sk_n, sk_d, sv_n, sv_d, sb_m, sb_n, s_scale, s_scale2, ck, cv,
                      D, HAS_BIAS, CAUSAL, PREC, EXACT)
    if TAIL < BLOCK_N:
        if k_hi < Nk:
            dq = _dq_step(dq, q, q_lo, do, do_lo, k_base, v_base, bias_base, offs_m, k_hi + tl.arange(0, TAIL), offs_d,
                          row_ok, m_r, r_r, delta, f, Nq, Nk, sk_n, sk_d, sv_n, sv_d, sb_m, sb_n, s_scale, s_scale2,
                          ck, cv, D, HAS_BIAS, CAUSAL, PREC, EXACT)
    if PREC == FP16X3:  # one power of two at a time: their product may leave float32's range
        dq = dq * (1.0 / f)[:, None] * (1.0 / ck) * (1.0 / cdo) * (1.0 / cv)
    dq = dq * scale
    tl.store(dQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_m + offs_d[None, :], cast(dq, dQ.dtype.element_ty),
             mask=qm)


@triton.jit
def _bwd_dbias_kernel(
    Q, K, V, Bias, dOut, Stats, Delta, dBias, Scales,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    sdo_b, sdo_h, sdo_m, sdo_d, sb_b, sb_h, sb_m, sb_n,
    B, H, Hb, Nq, Nk, scale, qk_scale2,
    BIAS_B1: tl.constexpr, BIAS_H1: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
):
    """dS = P ⊙ (dP − delta) for one [BM, BN] tile of the bias, summed over the batch/head dims the
    bias is broadcast along (BIAS_B1 / BIAS_H1), in a fixed order: deterministic, no atomics.
    dBias is float32 [Bb, Hb, Nq, Nk] with Bb = 1 if BIAS_B1 else B, Hb likewise."""
    scale, qk_scale2 = tl.cast(scale, tl.float32), tl.cast(qk_scale2, tl.float32)  # inductor passes float64
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bhb = tl.program_id(2)
    bb = bhb // Hb
    hb = bhb % Hb
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_b = B if BIAS_B1 else 1
    n_h = H if BIAS_H1 else 1
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for ib in range(0, n_b):
        for ih in range(0, n_h):
            bh = (ib if BIAS_B1 else bb) * H + (ih if BIAS_H1 else hb)
            b, h, offs_m, offs_d, row_ok, qm = _query_rows(pid_m, bh, H, Nq, D, D_PAD, BLOCK_M)
            q, q_lo, do, do_lo, m_r, r_r, s_scale, s_scale2, ck, cv, cdo = _query_tile(
                Q, dOut, Stats, Scales, b, h, bh, offs_m, offs_d, row_ok, qm, Nq, sq_b, sq_h, sq_m, sq_d,
                sdo_b, sdo_h, sdo_m, sdo_d, scale, qk_scale2, True, EXACT, PREC)
            k, k_lo, p, dp = _p_dp_tile(q, q_lo, do, do_lo, K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h,
                                        Bias + b * sb_b + h * sb_h, offs_m, offs_n, offs_d, row_ok, m_r, r_r, Nq, Nk,
                                        sk_n, sk_d, sv_n, sv_d, sb_m, sb_n, s_scale, s_scale2, ck, cv,
                                        D, True, CAUSAL, PREC, EXACT)
            delta = tl.load(Delta + bh.to(tl.int64) * Nq + offs_m, mask=row_ok, other=0.0)
            if PREC == FP16X3:
                acc += p * (dp - (delta * cdo * cv)[:, None]) * (1.0 / cdo) * (1.0 / cv)
            else:
                acc += p * (dp - delta[:, None])
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(dBias + bhb.to(tl.int64) * Nq * Nk + offs_m[:, None] * Nk + offs_n[None, :], acc,
             mask=(offs_m[:, None] < Nq) & (offs_n[None, :] < Nk))


# ---------------------------------------------------------------------------------------------
# host side


def _strides4(t: Optional[torch.Tensor]) -> tuple[int, int, int, int]:
    if t is None:
        return (0, 0, 0, 0)
    # size-1 dims are broadcast: read them with stride 0
    return tuple(0 if t.shape[i] == 1 else t.stride(i) for i in range(4))


def natural_lse(stats: torch.Tensor, has_bias: bool) -> torch.Tensor:
    """Row log-sum-exp [B, H, Nq] in natural-log units from the kernels' statistics [B, H, 2, Nq]
    (m in log2 units without a bias); +inf for a row that sees no key."""
    m, s = stats.unbind(2)
    return (m if has_bias else m * LN2) + torch.log(s)


def stats_from_lse(lse: torch.Tensor) -> torch.Tensor:
    """The kernels' row statistics [B, H, 2, Nq] (m in log2 units, S = 1) of a natural-log
    log-sum-exp [B, H, Nq] without a bias: backward() then forms P = exp(s − lse). A non-finite lse
    (a row that sees no key) becomes (+inf, 1), the kernels' own convention for such rows."""
    m = torch.where(torch.isfinite(lse), lse.float() * LOG2E, float("inf"))
    return torch.stack((m, torch.ones_like(m)), dim=2)


def _out_like(q: torch.Tensor) -> torch.Tensor:
    """[B,H,Nq,D] view of a token-major [B,Nq,H,D] buffer (as SDPA returns): merging the heads back
    into [B,Nq,H·D], what every attention module does next, is then free of copies."""
    B, H, Nq, D = q.shape
    return torch.empty((B, Nq, H, D), device=q.device, dtype=q.dtype).transpose(1, 2)


def new_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous (dq, dk, dv) buffers shaped and typed as q, k, v: what the backward writes when
    it is given none."""
    return tuple(torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))


def launch_plan(q, k, bias, precision: str, partitions: Optional[int] = None,
                config: Optional[Config] = None) -> tuple[Config, int, int]:
    """(tile config, n_part, part_len) of the forward launch for these inputs (see forward)."""
    B, H, Nq, D = q.shape
    return _launch_plan(B * H, Nq, k.shape[2], D, q.dtype, bias is not None, precision, q.device, partitions, config)


@host_cache(maxsize=1024)
def _launch_plan(bh: int, nq: int, nk: int, d: int, dtype: torch.dtype, has_bias: bool, precision: str,
                 device: torch.device, partitions: Optional[int], config: Optional[Config]) -> tuple[Config, int, int]:
    cfg = config or fwd_config(dtype, pow2(d), precision, nk, has_bias, nq)
    # the float32 MMA modes run one program per SM and have no persistent kernel: balance their waves
    waves = dtype == torch.float32 and precision != "ieee"
    n_part, part_len = plan_partitions(bh, nq, nk, cfg.block_m, cfg.block_n, device, partitions, waves)
    if config is None and cfg.chunk and n_part > 1 and part_len > PLAIN_KEYS:
        # a split program folds its partition in one running sum (no chunks): compensate it instead
        cfg = Config(32, 32, 4, 2)
        n_part, part_len = plan_partitions(bh, nq, nk, cfg.block_m, cfg.block_n, device, partitions)
    return cfg, n_part, part_len


def _f16_scales(q, k, v, do=None):
    """The Scales tensor of _f16_scales_kernel: forward (do None) [B·H, 2 + D_PAD], backward [B·H, 4].
    The rows of each tensor are cut into chunks (_scale_chunks) so that the pass has programs enough
    to stream q, k, v (and dO) at the memory's pace; with more than one, a second launch makes the
    scales from the chunks' column maxima (B·H × 4 × chunks × D_PAD floats). A graph torch.compile
    traces with static sizes is chunked as an eager call is (the sizes are plain ints there); with
    symbolic ones (dynamic shapes) it takes one chunk, so that no host arithmetic runs on them and
    one graph serves every size."""
    B, H, Nq, D = q.shape
    d_pad = pow2(D)
    row = 2 + d_pad if do is None else 4
    tensors = 3 if do is None else 4
    scales = torch.empty((B * H, row), device=q.device, dtype=torch.float32)
    dd = q if do is None else do
    block = 16 if INTERPRET else 64
    if all(type(s) is int for s in (B, H, Nq, k.shape[2])):
        n = max(Nq, k.shape[2])
        chunk = cdiv(cdiv(n, _scale_chunks(B * H * tensors, n, block, q.device)), block) * block
        chunks = cdiv(n, chunk)
    else:  # symbolic sizes: one chunk
        chunk, chunks = 1 << 30, 1
    partials = torch.empty((B * H, tensors, chunks, d_pad), device=q.device, dtype=torch.float32) \
        if chunks > 1 else scales
    launch(_f16_scales_kernel, (B * H, tensors, chunks), q, k, v, dd, scales, partials, *q.stride(), *k.stride(),
           *v.stride(), *dd.stride(), H, Nq, k.shape[2], chunk, chunks, D=D, D_PAD=d_pad, BLOCK=block,
           V_COLS=do is None, ROW=row, PARTIAL=chunks > 1, num_warps=4)
    if chunks > 1:
        launch(_f16_scales_finish_kernel, (B * H, tensors), partials, scales, chunks, D_PAD=d_pad, V_COLS=do is None,
               ROW=row, BLOCK_C=16, num_warps=4)
    return scales


def _scale_chunks(programs: int, n: int, block: int, device: torch.device) -> int:
    """Chunks per tensor of _f16_scales: enough for about SCALE_PROGRAMS_PER_SM programs per SM in
    all, at most one per ``block`` rows. One program per batch·head and tensor, each streaming a
    whole head, read ViT-S's q, k, v at 768 px (batch 8) at a fifth of an H200's bandwidth, and
    VGGT's 104K-token global call at a thirteenth (fp16x3_scales_ab.csv: 2.8× and 11× faster in
    chunks). Under the interpreter, one per two blocks: CI's small shapes take the two-pass path."""
    if INTERPRET:
        return cdiv(n, 2 * block)
    return max(1, min(cdiv(n, block), cdiv(SCALE_PROGRAMS_PER_SM * sm_count(device.index or 0), programs)))


# programs per SM the scales pass aims at (_scale_chunks)
SCALE_PROGRAMS_PER_SM = 8


def _hopper_serves(q, k, v, bias, precision: str, causal: bool, backward: bool = False) -> bool:
    """Whether kernels/hopper.py's forward (``backward``: its backward) takes this call (its
    ``serves`` / ``serves_backward``, on an untraced call: torch.compile traces the portable kernels,
    and the calls the Hopper kernels serve reach this host code through the host ops)."""
    if hopper is None or tracing():
        return False
    return (hopper.serves_backward if backward else hopper.serves)(q, k, v, bias, precision, causal)


def forward(q, k, v, bias, scale: float, causal: bool, precision: str, partitions: Optional[int] = None,
            summaries: Optional[dict] = None, config: Optional[Config] = None):
    """Launch phase 1 (and phase 2 when split). Returns (out [B,H,Nq,D], stats [B,H,2,Nq] float32): the
    row statistics (m, S), m in log2 units without a bias, natural units with one (see natural_lse);
    (+inf, 1) for rows that see no key.

    ``summaries``, when a dict, receives the phase-1 summary tensors and the partition plan (used by
    verify.structure to show what phase 2 reads)."""
    if not scale > 0:
        raise ValueError(f"the Triton forward needs scale > 0, got {scale}; use the reference backend")
    B, H, Nq, D = q.shape
    d_pad = pow2(D)
    cfg, n_part, part_len = launch_plan(q, k, bias, precision, partitions, config)
    out = _out_like(q)
    stats = torch.empty((B, H, 2, Nq), device=q.device, dtype=torch.float32)
    split = n_part > 1
    # (a split the planner chose for the portable kernel's waves does not bind the persistent Hopper
    # forward, as long as its own work items fill the GPU)
    if (summaries is None and config is None and _hopper_serves(q, k, v, bias, precision, causal)
            and (not split or (partitions is None and hopper.fills(q)))):
        hopper.forward(q, k, v, out, stats, scale, causal, _f16_scales(q, k, v) if precision == "fp16x3" else None)
        return out, stats
    if split:  # one allocation for the three summaries (ws first: the large one, aligned)
        buf = torch.empty(B * H * n_part * Nq * (d_pad + 2), device=q.device, dtype=torch.float32)
        n_ms = B * H * n_part * Nq
        ws = buf[:n_ms * d_pad].view(B * H, n_part, Nq, d_pad)
        ms = buf[n_ms * d_pad:n_ms * (d_pad + 1)].view(B * H, n_part, Nq)
        ss = buf[n_ms * (d_pad + 1):].view(B * H, n_part, Nq)
    else:
        ms = ss = ws = stats  # unused placeholders
    bias_arg = bias if bias is not None else q
    scales = _f16_scales(q, k, v) if precision == "fp16x3" else stats
    key = ("attention-fwd", q.shape, q.stride(), k.shape, k.stride(), v.stride(),
           None if bias is None else (bias.shape, bias.stride(), bias.dtype), q.dtype, q.device, scale, causal,
           precision, cfg, n_part, part_len)
    fwd = prepared(key, _fwd_launch, q, k, v, bias, out, scale, causal, precision, cfg, n_part, part_len)
    fwd(q, k, v, bias_arg, out, stats, ms, ss, ws, scales)
    if split:
        phase2(ms, ss, ws, out, stats, bias is not None)
    if summaries is not None:
        summaries.update(n_part=n_part, part_len=part_len, block_m=cfg.block_m, block_n=cfg.block_n,
                         phase1_grid=fwd.grid, m=ms if split else None, S=ss if split else None,
                         W=ws if split else None)
    return out, stats


def _fwd_launch(q, k, v, bias, out, scale: float, causal: bool, precision: str, cfg: Config, n_part: int,
                part_len: int) -> Launch:
    """The phase-1 launch of ``forward`` for this call signature; called with (q, k, v, bias or q, out,
    stats, ms, ss, ws, scales)."""
    B, H, Nq, D = q.shape
    split = n_part > 1
    # the chunked scan keeps its running W in Out: float32 outputs of an unsplit launch only
    chunk = 0 if split or q.dtype != torch.float32 or cfg.chunk <= 0 else max(1, cfg.chunk // cfg.block_n) * cfg.block_n
    return Launch(_fwd_kernel, (cdiv(Nq, cfg.block_m), B * H, n_part),
        (*q.stride(), *k.stride(), *v.stride(), *out.stride(), *_strides4(bias),
         H, Nq, k.shape[2], part_len, n_part, scale, scale * LOG2E),
        dict(D=D, D_PAD=pow2(D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
             HAS_BIAS=bias is not None, CAUSAL=causal, SPLIT=split,
             PREC=PRECISION_CODES[precision], KAHAN=cfg.kahan and not chunk, CHUNK=chunk, PIPELINE=cfg.pipeline,
             TAIL=tail_width(k.shape[2], cfg.block_n, causal), num_warps=cfg.num_warps,
             num_stages=cfg.num_stages))


def phase2(ms, ss, ws, out, stats, natural: bool):
    """Merge phase-1 summaries m/S [BH, P, Nq], W [BH, P, Nq, D_PAD] into out [B,H,Nq,D] and the row
    statistics [B,H,2,Nq] (``natural``: m in natural units, the bias path)."""
    # (out's dtype: the compiled kernel stores in it, and a Launch tells kernels apart only by alignment)
    key = ("attention-merge", out.shape, out.stride(), out.dtype, out.device, ws.shape, natural)
    prepared(key, _merge_launch, out, ws, natural)(ms, ss, ws, out, stats)


def _merge_launch(out, ws, natural: bool) -> Launch:
    B, H, Nq, D = out.shape
    d_pad = ws.shape[-1]
    bm2 = 16 if INTERPRET else (64 if d_pad <= 128 else 32)
    return Launch(_merge_kernel, (cdiv(Nq, bm2), B * H), (*out.stride(), H, Nq, ws.shape[1]),
                  dict(D=D, D_PAD=d_pad, BLOCK_M=bm2, NATURAL=natural, num_warps=4))


@on_device
def backward(do, q, k, v, bias, out, stats, scale: float, causal: bool, precision: str, bias_grad: bool,
             config: Optional[Config] = None, kv: Optional[Config] = None, early_dp: Optional[bool] = None,
             dqkv: Optional[torch.Tensor] = None):
    """Returns (dq, dk, dv, dbias); dbias is None unless ``bias_grad``. Shapes as the inputs'.
    ``stats`` [B,H,2,Nq]: the forward's row statistics. ``config`` / ``kv`` / ``early_dp`` replace
    the measured choices of bwd_config / kv_config / early_dp_default (for tuning). ``dqkv``: a
    packed [B,N,3,H,D] gradient to write dq, dk, dv into (then returned as its ``qkv_views``; the
    kernels get the tensor itself and offsets into it, not views of it); new tensors otherwise."""
    if dqkv is not None and dqkv.stride(-1) != 1:
        raise ValueError("attention backward: the packed gradient needs a unit stride along D")
    scales = _f16_scales(q, k, v, do) if precision == "fp16x3" else None
    if (config is None and kv is None and early_dp is None and not bias_grad and stats.is_contiguous()
            and _hopper_serves(q, k, v, bias, precision, causal, backward=True)):
        grads = new_grads(q, k, v) if dqkv is None else qkv_views(dqkv)
        return (*hopper.backward(do, q, k, v, out, stats, scale, causal, grads, scales), None)
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    delta = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
    if scales is None:  # (an unused pointer argument of the kernels)
        scales = delta
    if dqkv is None:
        dq, dk, dv = new_grads(q, k, v)
        dq_arg, dk_arg, dv_arg = dq, dk, dv
    else:  # one tensor: q's part at offset 0, k's and v's one and two [H, D] blocks further (dV unused: q)
        dq, dk, dv = qkv_views(dqkv)
        dq_arg, dk_arg, dv_arg = dqkv, dqkv, q
    bias_arg = bias if bias is not None else q
    own_delta = not (bias_grad and q.dtype == torch.float32)  # else delta from P and dP (see _bwd_delta_kernel)
    # (the gradients are new contiguous tensors, or dqkv's views: their strides follow from the key's)
    key = ("attention-bwd", q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), do.dtype,
           out.stride(), out.dtype, None if bias is None else (bias.shape, bias.stride(), bias.dtype), q.dtype,
           q.device, scale, causal, precision, own_delta, None if dqkv is None else dqkv.stride(), config, kv,
           early_dp)
    delta_launch, dq_launch, kv_launch = prepared(key, _bwd_launches, q, k, v, bias, do, out, dq, dk, dv, dqkv, scale,
                                                  causal, precision, own_delta, config, kv, early_dp)
    if delta_launch is not None:
        delta_launch(q, k, v, bias_arg, do, stats, delta, scales)
    dq_launch(q, k, v, bias_arg, do, out, stats, delta, dq_arg, scales)
    kv_launch(q, k, v, bias_arg, do, stats, delta, dk_arg, dv_arg, scales)
    dbias = None
    if bias_grad:
        cfg, common = _bwd_setup(q, precision, causal, config)
        strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *_strides4(bias))
        b1, h1 = bias.shape[0] == 1, bias.shape[1] == 1
        Bb, Hb = (1 if b1 else B), (1 if h1 else H)
        dfull = torch.empty((Bb, Hb, Nq, Nk), device=q.device, dtype=torch.float32)
        # tensor-core products: at least 64 query rows, a warpgroup's worth. With the 32×32 tf32x3
        # tiles of d ≥ 128, ptxas (sm_90) gave this kernel 32 registers and 14 KB of spills; 64×32
        # has 255 and 320 bytes. (The FMA products of "ieee" go the other way: they keep 32 rows.)
        db_m = cfg.block_m if INTERPRET or precision == "ieee" else max(64, cfg.block_m)
        launch(_bwd_dbias_kernel, (cdiv(Nq, db_m), cdiv(Nk, cfg.block_n), Bb * Hb),
            q, k, v, bias, do, stats, delta, dfull, scales, *strides, B, H, Hb, Nq, Nk, scale, scale * LOG2E,
            BIAS_B1=b1, BIAS_H1=h1,
            **{**common, "BLOCK_M": db_m, "num_stages": 1})  # its batch/head loop needs no prefetch
        # bias broadcast along queries or keys (e.g. a key-padding bias [B,1,1,Nk]): reduce here
        red = tuple(i for i in (2, 3) if bias.shape[i] == 1)
        if red:
            dfull = dfull.sum(dim=red, keepdim=True)
        dbias = dfull.to(bias.dtype)
    return dq, dk, dv, dbias


def _bwd_setup(q, precision: str, causal: bool, config: Optional[Config]) -> tuple[Config, dict]:
    """(the dQ kernel's tile config, the constants every backward kernel takes)."""
    Nq, D = q.shape[2], q.shape[3]
    d_pad = pow2(D)
    cfg = config or bwd_config(q.dtype, d_pad, precision, Nq)
    return cfg, dict(D=D, D_PAD=d_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
                     PREC=PRECISION_CODES[precision], EXACT=q.dtype == torch.float32, num_warps=cfg.num_warps,
                     num_stages=cfg.num_stages)


def _bwd_launches(q, k, v, bias, do, out, dq, dk, dv, dqkv, scale: float, causal: bool, precision: str,
                  own_delta: bool, config: Optional[Config], kv: Optional[Config], early_dp: Optional[bool]) -> tuple:
    """The launches of ``backward`` for this call signature (see launch.Launch): (delta or None, dQ,
    dK/dV), called with (q, k, v, bias or q, dO, stats, delta, scales), (q, k, v, bias or q, dO,
    out, stats, delta, dQ or dqkv, scales) and (q, k, v, bias or q, dO, stats, delta, dK or dqkv,
    dV or q, scales)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    cfg, common = _bwd_setup(q, precision, causal, config)
    offsets = (0, 0) if dqkv is None else (dqkv.stride(2), 2 * dqkv.stride(2))
    g_strides = (*dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3])
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *_strides4(bias))
    has_bias = bias is not None
    delta_launch = None if own_delta else Launch(
        _bwd_delta_kernel, (cdiv(Nq, cfg.block_m), B * H), (*strides, H, Nq, Nk, scale * LOG2E, scale),
        dict(HAS_BIAS=has_bias, **common))
    dq_launch = Launch(_bwd_dq_kernel, (cdiv(Nq, cfg.block_m), B * H),
                       (*strides, *out.stride(), *g_strides[:3], H, Nq, Nk, scale * LOG2E, scale),
                       dict(HAS_BIAS=has_bias, TAIL=tail_width(Nk, cfg.block_n, causal), OWN_DELTA=own_delta,
                            **common))
    d_pad = pow2(D)
    kv = kv or kv_config(q.dtype, d_pad, precision, cfg)
    early_dp = early_dp_default(q.dtype, d_pad, precision) if early_dp is None else early_dp
    kv_launch = Launch(_bwd_dkdv_kernel, (cdiv(Nk, kv.block_n), B * H),
                       (*strides, *g_strides[3:], *offsets, H, Nq, Nk, scale * LOG2E, scale),
                       dict(HAS_BIAS=has_bias, EARLY_DP=early_dp, ONE_BUFFER=dqkv is not None,
                            TAIL=tail_width(Nq, kv.block_m),
                            **{**common, "BLOCK_M": kv.block_m, "BLOCK_N": kv.block_n, "num_warps": kv.num_warps,
                               "num_stages": kv.num_stages}))
    return delta_launch, dq_launch, kv_launch


# ---------------------------------------------------------------------------------------------
# registration: custom ops for torch.compile, an autograd Function for eager calls (kernels/ops.py)


def _op_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor], scale: float,
                causal: bool, precision: str, partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,H,Nq,D], k/v [B,H,Nk,D], bias 4-D broadcastable (size-1 dims) → out [B,H,Nq,D], row
    statistics [B,H,2,Nq] (as in ``forward``). ``partitions`` ≤ 0 lets the planner choose."""
    return forward(q, k, v, bias, scale, causal, precision, partitions if partitions > 0 else None)


def _op_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 bias: Optional[torch.Tensor], out: torch.Tensor, stats: torch.Tensor, scale: float,
                 causal: bool, precision: str, bias_grad: bool) -> list[torch.Tensor]:
    """→ [dq, dk, dv, dbias]; dbias is an empty tensor unless ``bias_grad``."""
    dq, dk, dv, dbias = backward(do, q, k, v, bias, out, stats, scale, causal, precision, bias_grad)
    return [dq, dk, dv, dbias if dbias is not None else q.new_empty(0)]


def _save(inputs, outputs):
    q, k, v, bias, scale, causal, precision, _ = inputs
    return (q, k, v, bias, *outputs), (scale, causal, precision)


OP = KernelOp("attention", "attention", forward=_op_forward, backward=_op_backward, save=_save, host_ops=True)
attention_fwd, attention_bwd = OP.fwd, OP.bwd  # torch.ops.elsa_vision.attention_fwd / _bwd


def _op_forward_packed(qkv: torch.Tensor, bias: Optional[torch.Tensor], scale: float, causal: bool, precision: str,
                       partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B,N,3,H,D] (q, k, v: its ``qkv_views``) → as ``_op_forward``."""
    return _op_forward(*qkv_views(qkv), bias, scale, causal, precision, partitions)


def _op_backward_packed(do: torch.Tensor, qkv: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                        stats: torch.Tensor, scale: float, causal: bool, precision: str,
                        bias_grad: bool) -> list[torch.Tensor]:
    """→ [dqkv [B,N,3,H,D], dbias]: the kernels write dq, dk, dv into their places in one tensor
    (three gradients of views would be stacked by autograd: a copy the size of qkv)."""
    dqkv = torch.empty(qkv.shape, device=qkv.device, dtype=qkv.dtype)
    *_, dbias = backward(do, *qkv_views(qkv), bias, out, stats, scale, causal, precision, bias_grad, dqkv=dqkv)
    return [dqkv, dbias if dbias is not None else qkv.new_empty(0)]


def _save_packed(inputs, outputs):
    qkv, bias, scale, causal, precision, _ = inputs
    return (qkv, bias, *outputs), (scale, causal, precision)


PACKED = KernelOp("attention_packed", "attention_packed", forward=_op_forward_packed, backward=_op_backward_packed,
                  save=_save_packed, bias_input=1, host_ops=True)


def _hopper_in_graph(q, k, v, bias, precision: str, causal: bool) -> bool:
    """Whether a traced call takes the host ops (kernels/ops.py) rather than the traced kernels: the
    Hopper forward would serve it (``hopper.serves``, decided on the traced tensors' sizes, dtypes,
    strides and device). Its kernels are Gluon's, which inductor cannot launch, and the calls it
    serves are long (≥ 768 keys): the host's microseconds a call are small beside them. The host
    code decides again per call on the real tensors (a call it turns down runs the portable
    kernels; an explicit ``partitions`` is applied there as eagerly, so compiled and eager calls
    take the same kernels)."""
    return hopper is not None and hopper.serves(q, k, v, bias, precision, causal, traced=True)


@on_device
def attention(q, k, v, bias, scale: float, causal: bool, precision: str, partitions: Optional[int],
              qkv: Optional[torch.Tensor] = None):
    """(out, stats) with autograd (see :func:`kernels.ops.route`). stats [B,H,2,Nq]: the row
    statistics (m, S) of ``forward`` (``natural_lse`` gives the lse). ``qkv``: the packed
    [B,N,3,H,D] tensor q, k, v are the ``qkv_views`` of, or None; with it, qkv's gradient is
    written by the kernels in one piece, and q, k, v may be None (eager calls read qkv alone)."""
    op, inputs = (OP, (q, k, v)) if qkv is None else (PACKED, (qkv,))
    how = route("attention", (*inputs, bias))
    if how is COMPILED:
        if q is None:
            q, k, v = qkv_views(qkv)
        fwd = op.host_fwd if _hopper_in_graph(q, k, v, bias, precision, causal) else op.fwd
        return fwd(*inputs, bias, scale, causal, precision, partitions or 0)
    if how is AUTOGRAD:
        return op.apply(*inputs, bias, scale, causal, precision, partitions or 0)
    return op.run(*inputs, bias, scale, causal, precision, partitions or 0)
