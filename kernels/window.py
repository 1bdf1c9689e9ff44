"""Windowed ELSA attention for Swin: thousands of tiny windows, fused relative-position bias and
shifted-window mask, forward and backward.

Problem. q, k, v are [BW, H, N, D] with BW = batch · nW windows ordered batch-major (row r is window
r mod nW of image r // nW); N ≤ 256 tokens per window (49, 64, 144, 256 in Swin v1/v2). The logits of
row r, head h are

    s = q kᵀ · scale + bias[h] + mask[r mod nW]          bias [H, N, N], mask [nW, N, N]

The bias and the mask are read in place by head and by window id: the [BW, H, N, N] tensor that
timm materialises is never built, in the forward or the backward. They are read as tables whose row
stride is a multiple of 16 so that tile loads vectorise: zero-copy when N % 16 == 0, otherwise a
zero-padded float32 copy of the [H, N, N] / [nW, N, N] inputs (kilobytes, both in one buffer, one
launch of _pad_tables_kernel; small eager half-precision calls read them in place, see PAD_TABLES_FROM).

Forward. Every window is padded to N_pad = next power of two ≥ N (≥ 16) inside the tile: padded keys
score −inf, padded query rows are never stored. ``block`` B ∈ {64, 128, 256} is the key tile:

  N ≤ B   the whole window is one key tile; the softmax is the trivial monoid fold of one tile:
          m = rowmax, S = Σ e^(s−m), W = Σ e^(s−m) v, out = W / S — no running rescale.
  N > B   the ⌈N/B⌉ key tiles of a window are folded with the ELSA monoid operator
          (m, S, W) ⊕ (m', S', W') in registers.

Programs. A program owns one head and a run of consecutive windows (and one query tile of them). It
loops over its windows (software-pipelined), reading each window's mask slice by window id; the
head's bias tile stays in L1 across the run (or in registers, BIAS_IN_REGISTERS). Runs hold at least
G = max(1, B // N_pad) windows and are lengthened by :func:`plan_runs` until the grid is a few
programs per SM: a Swin stage is hundreds of programs, not tens of thousands of nearly empty ones.

The logits are formed in natural units, as PyTorch forms them, and every exponential is
exp2((s − m)·log2 e) (see _exp_rel); the forward saves the row statistics (m, S) [BW, H, 2, N].

Backward. P is recomputed from q, k and the saved (m, S) — in float32 P = e^(s−m) / S, in half
precision as e^(s−m−ln S) (the two subtracted in turn: see common.load_stats) — and
dS = P ⊙ (dP − delta).
  fused   (half precision, N_pad ≤ 64, D ≤ 32 — Swin's 7×7 and 8×8 windows): one kernel; a program
          takes whole windows as one [N_pad, N_pad] tile and writes dq, dk, dv; delta = rowsum(P ⊙ dP)
          is exact inside the tile, so the forward output is not read back.
  tiled   (otherwise): a dq kernel that also writes delta (float32: rowsum(P ⊙ dP) in a first pass
          over the key tiles; half: rowsum(dO ⊙ O)), a dk/dv kernel — which also sums dS into the
          bias gradient when one query tile covers the window — and otherwise a dbias kernel that
          owns one tile of the bias. Triton's 3xTF32 and IEEE-FMA dots keep several copies
          of their operands in registers, so five of them in one kernel spill (ptxas, sm_90).
The bias gradient is summed over the windows of a run in registers; each program writes its partial
sum to a float32 [runs, H, NR, NR] buffer (runs ≈ a few programs per SM per head, independent of BW),
reduced in a fixed order by ``torch.sum``. No atomics: every gradient is bitwise reproducible. The
mask takes no gradient.

Block trade-off (``block``; "auto" = :func:`choose_block`). Tile shapes come from ptxas reports for
sm_90 (registers, spills, shared memory; see :func:`make_plan`):

  B = 64   one 64×64 tile per window for N ≤ 64; larger windows fold 64-wide key tiles (N = 144: 192²
           work instead of 256²). Spill-free in every precision but 3xTF32 (which spills ~100 bytes
           per thread when folding). The "auto" block but for 33-64 tokens (see :func:`choose_block`).
  B = 128  N ≤ 64: as 64, with runs of ≥ 2 windows. 64 < N ≤ 128 in one tile; N > 128 folds two
           128-wide tiles (16-row query strips: a 64×128 float32 score tile spills).
  B = 256  N ≤ 64: as 64, with runs of ≥ 4 windows ("auto" for 33-64 tokens). 64 < N ≤ 256 in
           one tile of 16-row query strips: single pass, no rescale; k and v are re-read (from L2)
           by each strip. Spill-free in half precision; 3xTF32 spills ~1 KB
           per thread. At N = 256 slower than B = 64 despite the single pass (benchmarks/windows.py).
  The block does not change the backward's tiles (only "fused or tiled") nor memory: every block
  allocates the outputs, the row statistics (m, S) [BW, H, 2, N] float32 and, in the backward, the
  dbias partials and (tiled) delta [BW, H, N]; the tiled half-precision backward keeps the forward
  output for delta (float32 recomputes it from P and dP instead). The paper's A100 sweep
  (supplementary §F.1) found B = 64 ~15% slower and ~20% lighter than 128, and 256 no faster;
  benchmarks/windows.py sweeps the blocks on the GPU at hand.

Outputs are allocated in the [BW, N, H, D] memory layout (returned as the [BW, H, N, D] view), which is
what Swin consumes next (``out.transpose(1, 2).reshape(BW, N, H·D)`` is then free); dq, dk, dv likewise.

Image rows (``geo``, a :class:`Geometry`; :func:`elsa_vision.shifted_window_attention`): q, k, v, the
output and the gradients may instead be the [B·height·width, H, D] token rows of a Swin feature map,
before any partition. The kernels find token t of window r where it lies (_tok: Swin's cyclic shift
and window partition as index arithmetic), so the roll, the partition, the merge and the roll back
are never copies; the row statistics, delta and the mask stay in window order.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import tiles
from .common import (C_LOG2E, FP16X3, PRECISION_CODES, cast, dk_units, dot, dot3, dot_nt, ds_k, ds_units, exp_of,
                     finite_abs, fma, load_stats, pow2_of, pv, row_mean, split_f16, store_stats)
from .launch import Launch, cdiv, clear_caches, on_device, pow2, prepared
from .ops import AUTOGRAD, COMPILED, KernelOp, check_first_order, route
from .reference import Geometry, qkv_views
from .tiles import make_plan, plan_runs

# ---------------------------------------------------------------------------------------------
# jit helpers


@triton.jit
def _load_rows(base, tok, offs_r, offs_d, s_r, s_d, N, D: tl.constexpr):
    """[R, D_PAD] tile of the window's tokens offs_r, stored at rows ``tok`` (see _tok) of stride s_r
    (zero past N and past D)."""
    return tl.load(base + tok[:, None] * s_r + offs_d[None, :] * s_d,
                   mask=(offs_r[:, None] < N) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _tok(rr, offs, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO: tl.constexpr):
    """Where token ``offs`` of window ``rr`` is stored. Window rows ([BW, N] tokens, the window
    stride applied by the caller): ``offs`` itself. Image rows (GEO): its index in the [B, IH, IW]
    token grid — window w = rr mod nW of image rr // nW is cell (w // NWX, w mod NWX) of the grid
    of WH×WW windows over the grid whose rows [0, RH) are rolled by −SH across its whole width and
    whose columns [0, RW) by −SW across its whole height (SH < RH, SW < RW; the padding's rows and
    columns after them stay): the top-left RH×RW image as timm's torch.roll, pad and
    window_partition build it, pad tokens moved among pad positions only, so neither the roll, the
    pad nor the partition copies (nor their inverses) are made."""
    if GEO:
        w = rr % nW
        y = (w // G_NWX) * G_WH + offs // G_WW
        x = (w % G_NWX) * G_WW + offs % G_WW
        ys = y + G_SH
        xs = x + G_SW
        ys = tl.where(ys >= G_RH, ys - G_RH, ys)
        xs = tl.where(xs >= G_RW, xs - G_RW, xs)
        y = tl.where(y < G_RH, ys, y)
        x = tl.where(x < G_RW, xs, x)
        return ((rr // nW) * G_IH + y) * G_IW + x
    else:
        return offs


@triton.jit
def _load_table(base, offs_m, offs_n, NR):
    """[BM, BN] float32 tile of an [NR, NR] bias/mask table (row stride NR, a multiple of 16, so the
    loads vectorise). Table entries past N are 0; past NR the tile reads 0."""
    x = tl.load(base + offs_m[:, None] * NR + offs_n[None, :],
                mask=(offs_m[:, None] < NR) & (offs_n[None, :] < NR), other=0.0)
    return x.to(tl.float32)


# fp16x3 scale floors (see _f16_scale): q and k meet in one logit factor 1/(c_q·c_k) next to the
# softmax scale, so each stops at 2^60; v and dO scales are applied one at a time, up to 2^113.
_LOW_QK = tl.constexpr(-47)
_LOW_ONE = tl.constexpr(-100)


@triton.jit
def _f16_scale(top, LOW: tl.constexpr):
    """fp16x3: the power of two that puts ``top`` (a largest |x|, scalar or per column) into
    [2^13, 2^14) for the float16 split (kernels/attention.py split_f16); at most 2^(13 − LOW)."""
    return pow2_of(13 - tl.maximum(exp_of(top), LOW))


@triton.jit
def _parts(x, PER_COL: tl.constexpr, LOW: tl.constexpr, PREC: tl.constexpr):
    """fp16x3: (hi, lo, c) with x·c = hi + lo in float16 parts, c the tile's own scale — each
    column's with PER_COL (c [D_PAD]), else the tile's (c scalar): a window's few dozen rows need no
    prepass over the tensor. Otherwise (x, x, 1)."""
    if PREC == FP16X3:
        a = finite_abs(x)
        if PER_COL:
            c = _f16_scale(tl.max(a, 0), LOW)
            hi, lo = split_f16(x * c[None, :])
        else:
            c = _f16_scale(tl.max(tl.max(a, 1), 0), LOW)
            hi, lo = split_f16(x * c)
        return hi, lo, c
    else:
        return x, x, 1.0


@triton.jit
def _parts_at(x, c, PREC: tl.constexpr):
    """(hi, lo, c) of x split at a given scalar scale c under fp16x3; (x, x, 1) otherwise."""
    if PREC == FP16X3:
        hi, lo = split_f16(x * c)
        return hi, lo, c
    else:
        return x, x, 1.0


@triton.jit
def _window_scale(base, rr, offs_r0, offs_d, s_r, s_d, N, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW,
                  D: tl.constexpr, BLOCK: tl.constexpr, GEO: tl.constexpr):
    """fp16x3: one scalar scale (_f16_scale, v's floor) for all N rows of a window's [N, D] tensor at
    ``base``, read BLOCK rows at a time. The backward needs it for v when a window spans several
    key tiles: delta_i sums P·dP over every key, so in the units of a key tile whose own v is small
    (zero-padded tokens: all zero) dP − delta would leave float16's range when dS is split."""
    tok = _tok(rr, offs_r0, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
    top = tl.max(tl.max(finite_abs(_load_rows(base, tok, offs_r0, offs_d, s_r, s_d, N, D)), 1), 0)
    for start in range(BLOCK, N, BLOCK):
        offs = start + offs_r0
        tok = _tok(rr, offs, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
        top = tl.maximum(top, tl.max(tl.max(finite_abs(_load_rows(base, tok, offs, offs_d, s_r, s_d, N, D)), 1), 0))
    return _f16_scale(top, _LOW_ONE)


@triton.jit
def _logits(q, q_lo, k, k_lo, bias2, bias_base, mask_base, offs_m, offs_n, N, NR, scale,
            HAS_BIAS: tl.constexpr, BIAS_REGS: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr):
    """Logits [BM, BN] = q kᵀ·scale + bias + mask in natural units, as PyTorch forms them (the
    log2 e factor comes after s − m, see _exp_rel); −inf on keys past N. q [BM, D_PAD], k [BN, D_PAD]
    (fp16x3: float16 parts of the scaled tiles, ``scale`` including 1/(c_q·c_k); otherwise the _lo
    arguments are unused). With BIAS_REGS the bias tile is ``bias2`` (held in registers by the
    caller), else it is read from ``bias_base`` (an L1 hit after the first window)."""
    if PREC == FP16X3:
        s = dot3(q, q_lo, tl.trans(k), tl.trans(k_lo))
    else:
        s = dot(q, tl.trans(k), PREC)
    # the first term after the scaling goes in by an explicit FMA (see common.fma): every kernel of
    # the family then rounds the logits alike, whether its bias tile is held or loaded
    if HAS_BIAS:
        if BIAS_REGS:
            s = fma(s, scale, bias2)
        else:
            s = fma(s, scale, _load_table(bias_base, offs_m, offs_n, NR))
        if HAS_MASK:
            s += _load_table(mask_base, offs_m, offs_n, NR)
    elif HAS_MASK:
        s = fma(s, scale, _load_table(mask_base, offs_m, offs_n, NR))
    else:
        s = s * scale
    return tl.where(offs_n[None, :] < N, s, float("-inf"))


@triton.jit
def _kv_logits(q, q_lo, k_base, v_base, bias_h, mask_base, offs_m, offs_n, tok_n, offs_d, sk_n, sk_d, sv_n, sv_d,
               N, NR,
               scale, cv_w, D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr,
               V_COLS: tl.constexpr, V_WIN: tl.constexpr):
    """The k and v tiles at keys offs_n (zero past N) and the logits of q against them (see _logits):
    (k, k_lo, c_k, v, v_lo, c_v, s). fp16x3: k and v as _parts (v's scale per column with V_COLS;
    the window's ``cv_w`` with V_WIN), ``scale`` including 1/c_q; otherwise the tiles themselves and
    scales 1."""
    k, k_lo, ck = _parts(_load_rows(k_base, tok_n, offs_n, offs_d, sk_n, sk_d, N, D), False, _LOW_QK, PREC)
    if V_WIN:
        v, v_lo, cv = _parts_at(_load_rows(v_base, tok_n, offs_n, offs_d, sv_n, sv_d, N, D), cv_w, PREC)
    else:
        v, v_lo, cv = _parts(_load_rows(v_base, tok_n, offs_n, offs_d, sv_n, sv_d, N, D), V_COLS, _LOW_ONE, PREC)
    s = _logits(q, q_lo, k, k_lo, 0.0, bias_h, mask_base, offs_m, offs_n, N, NR, scale / ck, HAS_BIAS, False,
                HAS_MASK, PREC)
    return k, k_lo, ck, v, v_lo, cv, s


@triton.jit
def _exp_rel(s, m):
    """exp(s − m) for logits s [BM, BN] and row maxima m [BM], natural units. s − m is formed first
    (exact for the dominant terms), then scaled by log2 e: in the log2 domain the logit would be
    rounded, three times, at 1.44× its magnitude — with a [H, N, N] bias of a few units that made
    float32 bias gradients 3–4× less accurate than PyTorch's."""
    return tl.math.exp2((s - m[:, None]) * C_LOG2E)


@triton.jit
def _probs2(s, m, r, EXACT: tl.constexpr):
    """P from logits s [BM, BN] and the row statistics of load_stats (natural units): in float32 the
    normaliser 1/S multiplies; in half precision ln S is subtracted after m (see load_stats)."""
    if EXACT:
        return _exp_rel(s, m) * r[:, None]
    return tl.math.exp2(((s - m[:, None]) - r[:, None]) * C_LOG2E)


@triton.jit
def _run(pid, n_tiles, WPP, BW):
    """Split a flat program id into (tile index, first window, end window) of its run."""
    t = pid % n_tiles
    r0 = (pid // n_tiles) * WPP
    return t, r0, tl.minimum(r0 + WPP, BW)


# ---------------------------------------------------------------------------------------------
# forward
#
# Bias and mask arrive as tables with a 16-aligned row stride NR: bias [H or 1, NR, NR] (head stride
# sb_h, 0 for a bias shared by all heads), mask [nW, NR, NR]; window r reads mask slice r mod nW.


@triton.jit
def _win_fwd_kernel(
    Q, K, V, Bias, Mask, Out, Stats,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    so_b, so_h, so_n, so_d, sb_h,
    BW, H, N, NR, nW, WPP, scale, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_REGS: tl.constexpr, HAS_MASK: tl.constexpr,
    PREC: tl.constexpr, GEO: tl.constexpr,
):
    """grid (runs × query tiles, H). Writes out [BW, H, N, D] and the row statistics (m, S)
    [BW, H, 2, N] (m in natural units). GEO: q, k, v and out are image rows (see _tok)."""
    scale = tl.cast(scale, tl.float32)  # inductor passes float64
    h = tl.program_id(1).to(tl.int64)
    pid_m, r0, r1 = _run(tl.program_id(0), tl.cdiv(N, BLOCK_M), WPP, BW)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < N
    bias_h = Bias + h * sb_h
    mask_stride = tl.cast(NR, tl.int64) * NR
    bias2 = 0.0
    if SINGLE and HAS_BIAS and BIAS_REGS:
        bias2 = _load_table(bias_h, offs_m, offs_n0, NR)  # once for the whole run
    for r in range(r0, r1):
        rr = tl.cast(r, tl.int64)
        mask_base = Mask + (rr % nW) * mask_stride
        tok_m = _tok(rr, offs_m, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
        q, q_lo, cq = _parts(_load_rows(Q + rr * sq_b + h * sq_h, tok_m, offs_m, offs_d, sq_n, sq_d, N, D), False,
                             _LOW_QK, PREC)
        k_base = K + rr * sk_b + h * sk_h
        v_base = V + rr * sv_b + h * sv_h
        if SINGLE:
            # the whole window is one key tile: the fold of one tile is a plain softmax
            tok_n = _tok(rr, offs_n0, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
            k, k_lo, ck = _parts(_load_rows(k_base, tok_n, offs_n0, offs_d, sk_n, sk_d, N, D), False, _LOW_QK, PREC)
            v, v_lo, cv = _parts(_load_rows(v_base, tok_n, offs_n0, offs_d, sv_n, sv_d, N, D), True, _LOW_ONE, PREC)
            s = _logits(q, q_lo, k, k_lo, bias2, bias_h, mask_base, offs_m, offs_n0, N, NR, scale / cq / ck,
                        HAS_BIAS, BIAS_REGS, HAS_MASK, PREC)
            m_i = tl.max(s, 1)
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)  # a row with no visible key
            p = _exp_rel(s, m_safe)
            s_i = tl.sum(p, 1)
            acc = pv(p, v, v_lo, PREC)
            if PREC == FP16X3:
                acc = acc * (1.0 / 16384.0) * (1.0 / cv)[None, :]
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            s_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
            for start in range(0, N, BLOCK_N):
                offs_n = start + offs_n0
                tok_n = _tok(rr, offs_n, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
                k, k_lo, ck, v, v_lo, cv, s = _kv_logits(
                    q, q_lo, k_base, v_base, bias_h, mask_base, offs_m, offs_n, tok_n, offs_d,
                    sk_n, sk_d, sv_n, sv_d, N, NR, scale / cq, 1.0, D, HAS_BIAS, HAS_MASK, PREC, True, False)
                # monoid merge of the running state with this tile's (m, S, W)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # identity tile: nothing visible
                alpha = tl.math.exp2((m_i - m_safe) * C_LOG2E)
                p = _exp_rel(s, m_safe)
                s_i = s_i * alpha + tl.sum(p, 1)
                if PREC == FP16X3:  # each key tile has its own v scales
                    acc = acc * alpha[:, None] + pv(p, v, v_lo, PREC) * (1.0 / 16384.0) * (1.0 / cv)[None, :]
                else:
                    acc = acc * alpha[:, None] + pv(p, v, v_lo, PREC)
                m_i = m_new
        nonempty = s_i > 0
        den = tl.where(nonempty, s_i, 1.0)
        out = acc / den[:, None]
        tl.store(Out + rr * so_b + h * so_h + tok_m[:, None] * so_n + offs_d[None, :] * so_d,
                 cast(out, Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))
        store_stats(Stats, rr * H + h, offs_m, row_ok, N, m_i, s_i, nonempty)


# ---------------------------------------------------------------------------------------------
# backward


@triton.jit
def _win_bwd_fused_kernel(
    Q, K, V, Bias, Mask, dOut, Stats, dQ, dK, dV, dBiasPart,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    sdo_b, sdo_h, sdo_n, sdo_d, sg_b, sg_h, sg_n, g_k, g_v, sb_h,
    BW, H, N, NR, nW, WPP, scale, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_REGS: tl.constexpr, HAS_MASK: tl.constexpr, BIAS_GRAD: tl.constexpr,
    PREC: tl.constexpr, EXACT: tl.constexpr, GEO: tl.constexpr, ONE_BUFFER: tl.constexpr,
):
    """N ≤ BLOCK: a program owns whole windows (all queries, all keys: one [BLOCK, BLOCK] tile) of one
    head for a run of windows. Writes dq, dk, dv and its partial bias gradient dBiasPart[run, h]
    (float32 [NR, NR]). dq/dk/dv share the strides sg_* (unit stride along D). ONE_BUFFER: the
    three lie in one tensor (a packed qkv's gradient), passed as dQ, dk and dv at element offsets
    g_k and g_v from it; dK and dV are not written (see attention.py's _bwd_dkdv_kernel)."""
    scale = tl.cast(scale, tl.float32)  # inductor passes float64
    h = tl.program_id(1).to(tl.int64)
    run = tl.program_id(0)
    r0 = run * WPP
    r1 = tl.minimum(r0 + WPP, BW)
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D_PAD)
    tok_ok = offs < N
    io_mask = tok_ok[:, None] & (offs_d[None, :] < D)
    bias_h = Bias + h * sb_h
    mask_stride = tl.cast(NR, tl.int64) * NR
    bias2 = 0.0
    if HAS_BIAS and BIAS_REGS:
        bias2 = _load_table(bias_h, offs, offs, NR)
    if BIAS_GRAD:
        dbias = tl.zeros([BLOCK, BLOCK], tl.float32)
    for r in range(r0, r1):
        rr = tl.cast(r, tl.int64)
        tok = _tok(rr, offs, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
        q = _load_rows(Q + rr * sq_b + h * sq_h, tok, offs, offs_d, sq_n, sq_d, N, D)
        k = _load_rows(K + rr * sk_b + h * sk_h, tok, offs, offs_d, sk_n, sk_d, N, D)
        v = _load_rows(V + rr * sv_b + h * sv_h, tok, offs, offs_d, sv_n, sv_d, N, D)
        do = _load_rows(dOut + rr * sdo_b + h * sdo_h, tok, offs, offs_d, sdo_n, sdo_d, N, D)
        m_r, r_r = load_stats(Stats, rr * H + h, offs, tok_ok, N, True, EXACT)
        s = _logits(q, q, k, k, bias2, bias_h, Mask + (rr % nW) * mask_stride, offs, offs, N, NR, scale,
                    HAS_BIAS, BIAS_REGS, HAS_MASK, PREC)
        # before the exponentials, so that the MMA runs under them (measured faster at every Swin-T
        # stage in bf16)
        dp = dot(do, tl.trans(v), PREC)
        p = _probs2(s, m_r, r_r, EXACT)  # 0 on padded keys, padded rows, fully masked rows
        dv = dot(tl.trans(cast(p, do.dtype)), do, PREC)
        delta = tl.sum(p * dp, 1)  # = rowsum(dO ⊙ O), exact: the tile holds every key of the row
        if EXACT:  # Σ_j dS_ij = 0 (see kernels/attention.py _bwd_delta_kernel)
            delta = row_mean(delta, tl.sum(p, 1))
        ds = p * (dp - delta[:, None])
        dq = dot(cast(ds, k.dtype), k, PREC) * scale
        dk = dot(tl.trans(cast(ds, q.dtype)), q, PREC) * scale
        g_ptrs = rr * sg_b + h * sg_h + tok[:, None] * sg_n + offs_d[None, :]
        tl.store(dQ + g_ptrs, cast(dq, dQ.dtype.element_ty), mask=io_mask)
        # (q, k, v, so their gradients, share a dtype: dQ's)
        tl.store((dQ if ONE_BUFFER else dK) + g_k + g_ptrs, cast(dk, dQ.dtype.element_ty), mask=io_mask)
        tl.store((dQ if ONE_BUFFER else dV) + g_v + g_ptrs, cast(dv, dQ.dtype.element_ty), mask=io_mask)
        if BIAS_GRAD:
            dbias += ds
    if BIAS_GRAD:
        # dS is 0 on padded rows/keys, so the whole [NR, NR] slice is written (vector stores)
        tl.store(dBiasPart + (run.to(tl.int64) * H + h) * mask_stride + offs[:, None] * NR + offs[None, :],
                 dbias, mask=(offs[:, None] < NR) & (offs[None, :] < NR))


@triton.jit
def _win_bwd_dq_kernel(
    Q, K, V, Bias, Mask, dOut, Out, Stats, Delta, dQ,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    sdo_b, sdo_h, sdo_n, sdo_d, so_b, so_h, so_n, so_d, sg_b, sg_h, sg_n, sb_h,
    BW, H, N, NR, nW, WPP, scale, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
    ONE_TILE: tl.constexpr, GEO: tl.constexpr,
):
    """Tiled backward: one query tile of one head for a run of windows, looping over the key tiles.
    Also writes delta [BW, H, N] for the dk/dv and dbias kernels (launched after): in float32
    (EXACT) delta = Σ_j P_ij·dP_ij from the very P and dP that form dS, in a first pass over the
    key tiles — as PyTorch's softmax backward does. rowsum(dO ⊙ O) is the same number in exact
    arithmetic, but O carries the forward's rounding, not this P's, and dS = P ⊙ (dP − delta)
    cancels: with it float32 gradients (dbias most) come out 2–4× less accurate than PyTorch's.
    In half precision, where P is rounded to 8–11 bits for the dots, rowsum(dO ⊙ O) it is.
    Float32 divides it by Σ_j P_ij (see kernels/attention.py _bwd_delta_kernel).
    ONE_TILE (float32, N ≤ BLOCK_N): the row is one key tile, so delta comes free in a single pass."""
    scale = tl.cast(scale, tl.float32)  # inductor passes float64
    h = tl.program_id(1).to(tl.int64)
    pid_m, r0, r1 = _run(tl.program_id(0), tl.cdiv(N, BLOCK_M), WPP, BW)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < N
    bias_h = Bias + h * sb_h
    mask_stride = tl.cast(NR, tl.int64) * NR
    for r in range(r0, r1):
        rr = tl.cast(r, tl.int64)
        mask_base = Mask + (rr % nW) * mask_stride
        tok_m = _tok(rr, offs_m, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
        q, q_lo, cq = _parts(_load_rows(Q + rr * sq_b + h * sq_h, tok_m, offs_m, offs_d, sq_n, sq_d, N, D), False,
                             _LOW_QK, PREC)
        do, do_lo, cdo = _parts(_load_rows(dOut + rr * sdo_b + h * sdo_h, tok_m, offs_m, offs_d, sdo_n, sdo_d, N, D),
                                False, _LOW_ONE, PREC)
        m_r, r_r = load_stats(Stats, rr * H + h, offs_m, row_ok, N, True, EXACT)
        k_base = K + rr * sk_b + h * sk_h
        v_base = V + rr * sv_b + h * sv_h
        f = 1.0
        if PREC == FP16X3:
            f = ds_units(r_r, D_PAD)
        if EXACT and ONE_TILE:
            tok_n = _tok(rr, offs_n0, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
            k, k_lo, ck, v, v_lo, cv, s = _kv_logits(
                q, q_lo, k_base, v_base, bias_h, mask_base, offs_m, offs_n0, tok_n, offs_d,
                sk_n, sk_d, sv_n, sv_d, N, NR, scale / cq, 1.0, D, HAS_BIAS, HAS_MASK, PREC, False, False)
            p = _probs2(s, m_r, r_r, EXACT)
            dp = dot_nt(do, do_lo, v, v_lo, PREC)  # fp16x3: in units of c_dO·c_v
            delta = row_mean(tl.sum(p * dp, 1), tl.sum(p, 1))
            tl.store(Delta + (rr * H + h) * N + offs_m, delta * (1.0 / cdo) * (1.0 / cv), mask=row_ok)
            dq = ds_k(p * (dp - delta[:, None]), f, k, k_lo, PREC) * (1.0 / ck) * (1.0 / cv)
        else:
            cv_w = 1.0
            if PREC == FP16X3:  # one v scale for the window's key tiles (see _window_scale)
                cv_w = _window_scale(v_base, rr, offs_n0, offs_d, sv_n, sv_d, N, nW, G_NWX, G_WH, G_WW, G_IH, G_IW,
                                     G_RH, G_RW, G_SH, G_SW, D, BLOCK_N, GEO)
            if EXACT:
                delta = tl.zeros([BLOCK_M], tl.float32)
                l = tl.zeros([BLOCK_M], tl.float32)
                for start in range(0, N, BLOCK_N):
                    offs_n = start + offs_n0
                    tok_n = _tok(rr, offs_n, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
                    k, k_lo, ck, v, v_lo, cv, s = _kv_logits(
                        q, q_lo, k_base, v_base, bias_h, mask_base, offs_m, offs_n, tok_n,
                        offs_d, sk_n, sk_d, sv_n, sv_d, N, NR, scale / cq, cv_w, D, HAS_BIAS, HAS_MASK, PREC, False,
                        True)
                    p = _probs2(s, m_r, r_r, EXACT)
                    delta += tl.sum(p * dot_nt(do, do_lo, v, v_lo, PREC), 1) * (1.0 / cv)
                    l += tl.sum(p, 1)
                delta = row_mean(delta * (1.0 / cdo), l)
            else:
                o = _load_rows(Out + rr * so_b + h * so_h, tok_m, offs_m, offs_d, so_n, so_d, N, D)
                delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
            tl.store(Delta + (rr * H + h) * N + offs_m, delta, mask=row_ok)
            dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
            for start in range(0, N, BLOCK_N):
                offs_n = start + offs_n0
                tok_n = _tok(rr, offs_n, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
                k, k_lo, ck, v, v_lo, cv, s = _kv_logits(
                    q, q_lo, k_base, v_base, bias_h, mask_base, offs_m, offs_n, tok_n, offs_d,
                    sk_n, sk_d, sv_n, sv_d, N, NR, scale / cq, cv_w, D, HAS_BIAS, HAS_MASK, PREC, False, True)
                p = _probs2(s, m_r, r_r, EXACT)
                dp = dot_nt(do, do_lo, v, v_lo, PREC)
                ds = p * (dp - (delta * cdo * cv)[:, None])
                if PREC == FP16X3:  # each key tile has its own c_k
                    dq += ds_k(ds, f, k, k_lo, PREC) * (1.0 / ck) * (1.0 / cv)
                else:
                    dq += ds_k(ds, f, k, k_lo, PREC)
        if PREC == FP16X3:
            dq = dq * (1.0 / f)[:, None] * (1.0 / cdo)
        dq = dq * scale
        tl.store(dQ + rr * sg_b + h * sg_h + tok_m[:, None] * sg_n + offs_d[None, :], cast(dq, dQ.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _win_bwd_dkdv_kernel(
    Q, K, V, Bias, Mask, dOut, Stats, Delta, dK, dV, dBiasPart,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    sdo_b, sdo_h, sdo_n, sdo_d, sg_b, sg_h, sg_n, g_k, g_v, sb_h,
    BW, H, N, NR, nW, WPP, scale, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
    BIAS_GRAD: tl.constexpr, GEO: tl.constexpr, ONE_BUFFER: tl.constexpr,
):
    """One key tile [BLOCK_N] of one head for a run of windows, looping over the query tiles.
    dk and dv are written at element offsets g_k and g_v from dK and dV (ONE_BUFFER: both from dK,
    one tensor holding them; dV is not written).
    BIAS_GRAD (only when N ≤ BLOCK_M: one query tile holds every row): the program's dS column strip
    [NR, BLOCK_N] is also summed over its run into dBiasPart[run, h] — the bias gradient without a
    kernel of its own that would recompute P and dP."""
    scale = tl.cast(scale, tl.float32)  # inductor passes float64
    h = tl.program_id(1).to(tl.int64)
    n_nt = tl.cdiv(N, BLOCK_N)
    pid_n, r0, r1 = _run(tl.program_id(0), n_nt, WPP, BW)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    bias_h = Bias + h * sb_h
    mask_stride = tl.cast(NR, tl.int64) * NR
    if BIAS_GRAD:
        dbias = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r in range(r0, r1):
        rr = tl.cast(r, tl.int64)
        mask_base = Mask + (rr % nW) * mask_stride
        tok_n = _tok(rr, offs_n, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
        k, k_lo, ck = _parts(_load_rows(K + rr * sk_b + h * sk_h, tok_n, offs_n, offs_d, sk_n, sk_d, N, D), False,
                             _LOW_QK, PREC)
        v_raw = _load_rows(V + rr * sv_b + h * sv_h, tok_n, offs_n, offs_d, sv_n, sv_d, N, D)
        cv_w = 1.0
        if PREC == FP16X3:
            if N > BLOCK_N:  # the window spans several key tiles: one v scale for all (see _window_scale)
                cv_w = _window_scale(V + rr * sv_b + h * sv_h, rr, tl.arange(0, BLOCK_N), offs_d, sv_n, sv_d, N,
                                     nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, D, BLOCK_N, GEO)
            else:
                cv_w = _f16_scale(tl.max(tl.max(finite_abs(v_raw), 1), 0), _LOW_ONE)
        v, v_lo, cv = _parts_at(v_raw, cv_w, PREC)
        q_base = Q + rr * sq_b + h * sq_h
        do_base = dOut + rr * sdo_b + h * sdo_h
        row_stats = (rr * H + h) * N
        dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        for start in range(0, N, BLOCK_M):
            offs_m = start + offs_m0
            row_ok = offs_m < N
            tok_m = _tok(rr, offs_m, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
            q, q_lo, cq = _parts(_load_rows(q_base, tok_m, offs_m, offs_d, sq_n, sq_d, N, D), False, _LOW_QK, PREC)
            do, do_lo, cdo = _parts(_load_rows(do_base, tok_m, offs_m, offs_d, sdo_n, sdo_d, N, D), False, _LOW_ONE,
                                    PREC)
            m_r, r_r = load_stats(Stats, rr * H + h, offs_m, row_ok, N, True, EXACT)
            delta = tl.load(Delta + row_stats + offs_m, mask=row_ok, other=0.0)
            s = _logits(q, q_lo, k, k_lo, 0.0, bias_h, mask_base, offs_m, offs_n, N, NR, scale / cq / ck,
                        HAS_BIAS, False, HAS_MASK, PREC)
            if PREC != FP16X3:
                dp = dot(do, tl.trans(v), PREC)  # before the exponentials, as in the fused kernel
            p = _probs2(s, m_r, r_r, EXACT)
            if PREC == FP16X3:
                # as attention's dK/dV kernel: Pᵀ·2^14; dSᵀ's column i scaled by t_i ≈ S_i and q's row
                # i by 1/t_i after the split; each query tile has its own c_q, c_dO
                p_hi, p_lo = split_f16(p * 16384.0)
                dv += dot3(tl.trans(p_hi), tl.trans(p_lo), do, do_lo) * (1.0 / cdo)
                ds = p * (dot_nt(do, do_lo, v, v_lo, PREC) - (delta * cdo * cv)[:, None])
                u, w = dk_units(r_r, D_PAD)
                a_hi, a_lo = split_f16(ds * u[:, None])
                dk += dot3(tl.trans(a_hi), tl.trans(a_lo), q * w[:, None], q_lo * w[:, None]) * (1.0 / cdo) * (1.0 / cq)
                if BIAS_GRAD:
                    dbias += ds * (1.0 / cdo) * (1.0 / cv)
            else:
                dv += dot(tl.trans(cast(p, do.dtype)), do, PREC)
                ds = p * (dp - delta[:, None])
                dk += dot(tl.trans(cast(ds, q.dtype)), q, PREC)
                if BIAS_GRAD:
                    dbias += ds  # 0 on padded rows and keys
        if PREC == FP16X3:
            dk = dk * (65536.0 * D_PAD) * (1.0 / cv)
            dv = dv * (1.0 / 16384.0)
        dk = dk * scale
        g_base = rr * sg_b + h * sg_h
        kv_mask = (offs_n[:, None] < N) & (offs_d[None, :] < D)
        tl.store(dK + g_k + g_base + tok_n[:, None] * sg_n + offs_d[None, :], cast(dk, dK.dtype.element_ty),
                 mask=kv_mask)
        tl.store((dK if ONE_BUFFER else dV) + g_v + g_base + tok_n[:, None] * sg_n + offs_d[None, :],
                 cast(dv, dK.dtype.element_ty), mask=kv_mask)
    if BIAS_GRAD:
        run = tl.program_id(0) // n_nt
        tl.store(dBiasPart + (run.to(tl.int64) * H + h) * mask_stride + offs_m0[:, None] * NR + offs_n[None, :],
                 dbias, mask=(offs_m0[:, None] < NR) & (offs_n[None, :] < NR))


@triton.jit
def _win_bwd_dbias_kernel(
    Q, K, V, Bias, Mask, dOut, Stats, Delta, dBiasPart,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    sdo_b, sdo_h, sdo_n, sdo_d, sb_h,
    BW, H, N, NR, nW, WPP, scale, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr, GEO: tl.constexpr,
):
    """Tiled backward: a program owns one [BLOCK_M, BLOCK_N] tile of head h's bias and sums dS over a
    run of windows into dBiasPart[run, h] (float32 [NR, NR])."""
    scale = tl.cast(scale, tl.float32)  # inductor passes float64
    h = tl.program_id(1).to(tl.int64)
    n_nt = tl.cdiv(N, BLOCK_N)
    tile, r0, r1 = _run(tl.program_id(0), tl.cdiv(N, BLOCK_M) * n_nt, WPP, BW)
    offs_m = (tile // n_nt) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile % n_nt) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < N
    mask_stride = tl.cast(NR, tl.int64) * NR
    bias2 = _load_table(Bias + h * sb_h, offs_m, offs_n, NR)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r in range(r0, r1):
        rr = tl.cast(r, tl.int64)
        # (dS is not split here: each tile's own scales serve)
        tok_m = _tok(rr, offs_m, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
        tok_n = _tok(rr, offs_n, nW, G_NWX, G_WH, G_WW, G_IH, G_IW, G_RH, G_RW, G_SH, G_SW, GEO)
        q, q_lo, cq = _parts(_load_rows(Q + rr * sq_b + h * sq_h, tok_m, offs_m, offs_d, sq_n, sq_d, N, D), False,
                             _LOW_QK, PREC)
        do, do_lo, cdo = _parts(_load_rows(dOut + rr * sdo_b + h * sdo_h, tok_m, offs_m, offs_d, sdo_n, sdo_d, N, D),
                                False, _LOW_ONE, PREC)
        k, k_lo, ck = _parts(_load_rows(K + rr * sk_b + h * sk_h, tok_n, offs_n, offs_d, sk_n, sk_d, N, D), False,
                             _LOW_QK, PREC)
        v, v_lo, cv = _parts(_load_rows(V + rr * sv_b + h * sv_h, tok_n, offs_n, offs_d, sv_n, sv_d, N, D), False,
                             _LOW_ONE, PREC)
        row_stats = (rr * H + h) * N
        m_r, r_r = load_stats(Stats, rr * H + h, offs_m, row_ok, N, True, EXACT)
        delta = tl.load(Delta + row_stats + offs_m, mask=row_ok, other=0.0)
        s = _logits(q, q_lo, k, k_lo, bias2, Bias, Mask + (rr % nW) * mask_stride, offs_m, offs_n, N, NR,
                    scale / cq / ck, True, True, HAS_MASK, PREC)
        p = _probs2(s, m_r, r_r, EXACT)
        dp = dot_nt(do, do_lo, v, v_lo, PREC)
        if PREC == FP16X3:  # dP back in plain units: this tile's own c_v need not bound delta's range
            acc += p * (dp * (1.0 / cdo) * (1.0 / cv) - delta[:, None])
        else:
            acc += p * (dp - delta[:, None])
    run = tl.program_id(0) // (tl.cdiv(N, BLOCK_M) * n_nt)
    tl.store(dBiasPart + (run.to(tl.int64) * H + h) * mask_stride + offs_m[:, None] * NR + offs_n[None, :], acc,
             mask=(offs_m[:, None] < NR) & (offs_n[None, :] < NR))


# ---------------------------------------------------------------------------------------------
# host side


def _bnhd_empty(bw: int, h: int, n: int, d: int, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """[BW, H, N, D] view of a [BW, N, H, D] buffer: the layout Swin reshapes to (BW, N, H·D) for free."""
    return torch.empty((bw, n, h, d), device=like.device, dtype=dtype or like.dtype).transpose(1, 2)


def _out_empty(like: torch.Tensor, geo: Optional[Geometry]) -> torch.Tensor:
    """A new output (or gradient) for ``like``: window rows [BW, H, N, D] in the [BW, N, H, D] layout,
    or image rows [T, H, D] (row-major: the [B, height, width, H·D] the projection reads next)."""
    if geo is not None:
        return torch.empty(like.shape, device=like.device, dtype=like.dtype)
    return _bnhd_empty(*like.shape, like)


# the kernels' geometry arguments when the rows are window rows (unused there)
_NO_GEO = (1, 1, 1, 1, 1, 1, 1, 0, 0)


def _rows4(t: torch.Tensor, geo: Optional[Geometry]) -> tuple:
    """The (window, head, token, feature) strides the kernels take for ``t``: window rows [BW, H, N, D]
    as they are; image rows [T, H, D] have no window stride (the kernels find each token's row)."""
    if geo is None:
        return t.stride()
    return (0, t.stride(1), t.stride(0), t.stride(2))


def _shape(q: torch.Tensor, geo: Optional[Geometry]) -> tuple[int, int, int, int]:
    """(BW, H, N, D) of a call: q [BW, H, N, D], or image rows q [T, H, D] with ``geo``."""
    if geo is None:
        return tuple(q.shape)
    return geo.windows, q.shape[1], geo.tokens, q.shape[2]


def _table(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(table, lead stride) of x [L, N, N] read unpadded, row stride N (see :func:`_tables`): x as it
    is when its rows are contiguous, else a row-major copy. A lead dim broadcast with stride 0 (one
    bias for all heads) keeps stride 0."""
    n = x.shape[-1]
    if x.stride(-1) == 1 and x.stride(-2) == n and (x.stride(0) % 16 == 0 or n % 16):
        return x, x.stride(0)
    lead0 = x.shape[0] > 1 and x.stride(0) == 0
    return (x[:1] if lead0 else x).contiguous(), (0 if lead0 else n * n)


def _mask_table(mask: torch.Tensor) -> torch.Tensor:
    """The [nW, N, N] mask read unpadded, windows N·N apart. Made on every call, as the padded
    tables are: a copy kept between calls could not see writes that bypass the tensor's version
    counter (``mask.data``, memory shared with NumPy) and would then apply a stale mask."""
    mt = _table(mask)[0]
    n = mask.shape[-1]
    return mt if mt.stride(0) == n * n else mt.contiguous()


@triton.jit
def _pad_tables_kernel(Bias, Mask, Out, sb_l, sb_r, sb_c, sm_l, sm_r, sm_c, LB, N, NR,
                       BR: tl.constexpr, BC: tl.constexpr):
    """grid (LB + LM,): program l writes table l of Out [LB + LM, NR, NR] float32 — Bias[l] for
    l < LB, Mask[l − LB] after — zero past N."""
    l = tl.program_id(0)
    cols = tl.arange(0, BC)
    out = Out + l.to(tl.int64) * NR * NR
    for r0 in range(0, NR, BR):
        rows = r0 + tl.arange(0, BR)
        inside = (rows[:, None] < N) & (cols[None, :] < N)
        if l < LB:
            x = tl.load(Bias + l * sb_l + rows[:, None] * sb_r + cols[None, :] * sb_c, mask=inside, other=0.0)
            x = x.to(tl.float32)
        else:
            x = tl.load(Mask + (l - LB) * sm_l + rows[:, None] * sm_r + cols[None, :] * sm_c, mask=inside, other=0.0)
            x = x.to(tl.float32)
        tl.store(out + rows[:, None] * NR + cols[None, :], x, mask=(rows[:, None] < NR) & (cols[None, :] < NR))


def _pad_launch(lb: int, lm: int, n: int, nr: int, b_strides: tuple, m_strides: tuple) -> Launch:
    bc = pow2(nr)
    return Launch(_pad_tables_kernel, (lb + lm,), (*b_strides, *m_strides, lb, n, nr),
                  dict(BR=min(bc, 4096 // bc), BC=bc, num_warps=4))


def _bias_tables(bias) -> int:
    """How many [NR, NR] tables a bias takes in the padded buffer: none, one for a bias broadcast over
    the heads (lead stride 0), else one per head."""
    return 0 if bias is None else 1 if bias.shape[0] > 1 and bias.stride(0) == 0 else bias.shape[0]


def _padded_tables(bias, mask, n: int, nr: int, like: torch.Tensor):
    """(bias table, its head stride, mask table): bias [H, N, N] and mask [nW, N, N] copied, zero-padded
    to row stride ``nr`` (a multiple of 16: the kernels' tile loads vectorise), as float32 tables
    in one buffer, by one launch."""
    lb = _bias_tables(bias)
    lead0 = lb == 1 and bias.shape[0] > 1  # one bias for all heads
    lm = 0 if mask is None else mask.shape[0]
    buf = torch.empty((lb + lm, nr, nr), device=like.device, dtype=torch.float32)
    b = buf if bias is None else bias
    m = buf if mask is None else mask
    key = ("pad", buf.device, lb, lm, n, nr, b.dtype, m.dtype, b.stride(), m.stride())
    prepared(key, _pad_launch, lb, lm, n, nr, b.stride(), m.stride())(b, m, buf)
    bt = like if bias is None else buf
    return bt, (0 if lead0 else nr * nr), (like if mask is None else buf[lb:])


# Windows × heads of an eager half-precision call from which the bias and mask tables get padded to
# a 16-multiple row stride (vectorised loads, one copy of each table per call). Below it an eager
# call reads them in place, row stride N: such calls are paced by the host, and the copy's launch
# costs more host time than it saves the GPU (Swin-T stages 2-4, bf16, H100: 12-47 µs a call).
# Float32 always pads (its tiled backward reads the tables in many narrow tiles, where in place
# measured much slower), and so do the custom op that compiled graphs run and a call being
# captured into a CUDA graph: there the GPU sets the pace, and in place the unvectorised loads cost
# the window kernels 255 registers, one program fewer per SM (Swin-T stage 3 bf16 forward+backward
# replayed: 165 µs in place, 107 padded; benchmarks/windows.py --tune pad,nopad).
PAD_TABLES_FROM = 8192


def _work(q: torch.Tensor, bw: int, h: int) -> Optional[int]:
    """The ``work`` argument of :func:`_tables` for an eager call: windows × heads of a half-precision
    call that is not being captured; None (pad) otherwise. (The custom op, what a compiled graph
    runs, always pads: see :func:`_op_tables`.)"""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return bw * h


def _tables(bias, mask, n: int, like: torch.Tensor, work: Optional[int] = None):
    """(bias table, its head stride, mask table, NR) for a call of ``work`` windows × heads (None:
    always padded, see :func:`_work`); absent inputs become a placeholder pointer."""
    nr = cdiv(n, 16) * 16 if work is None or work >= PAD_TABLES_FROM else n
    if nr != n and (bias is not None or mask is not None):
        return (*_padded_tables(bias, mask, n, nr, like), nr)
    bt, sb_h = _table(bias) if bias is not None else (like, 0)
    mt = _mask_table(mask) if mask is not None else like
    return bt, sb_h, mt, nr


def clear_plans() -> None:
    """Deprecated: ``elsa_vision.clear_caches()`` forgets every plan of every kernel family."""
    import warnings
    warnings.warn("kernels.window.clear_plans() is deprecated; use elsa_vision.clear_caches()", DeprecationWarning,
                  stacklevel=2)
    clear_caches()


def _fwd_launch(q, k, v, out, has_bias: bool, has_mask: bool, sb_h: int, nr: int, nW: int, scale: float,
                precision: str, block: int, windows_per_program: Optional[int], geo: Optional[Geometry]) -> Launch:
    BW, H, N, D = _shape(q, geo)
    pl = make_plan(N, D, q.dtype, block, precision)
    n_mt = cdiv(N, pl.fwd_m)
    wpp, runs = plan_runs(BW, n_mt * H, pl.min_windows, q.device, tiles.FWD_PROGRAMS_PER_SM, windows_per_program)
    return Launch(_win_fwd_kernel, (runs * n_mt, H),
        (*_rows4(q, geo), *_rows4(k, geo), *_rows4(v, geo), *_rows4(out, geo), sb_h,
         BW, H, N, nr, nW, wpp, scale, *(geo.args if geo is not None else _NO_GEO)),
        dict(D=D, D_PAD=pow2(D), BLOCK_M=pl.fwd_m, BLOCK_N=pl.fwd_n, SINGLE=pl.single, HAS_BIAS=has_bias,
             BIAS_REGS=pl.bias_regs, HAS_MASK=has_mask, PREC=PRECISION_CODES[precision], GEO=geo is not None,
             num_warps=pl.fwd_warps, num_stages=pl.fwd_depth(has_mask)))


def forward(q, k, v, bias, mask, scale: float, precision: str, block: int = 0,
            windows_per_program: Optional[int] = None, tables=None, geo: Optional[Geometry] = None):
    """q/k/v [BW,H,N,D]; bias [H,N,N] or None; mask [nW,N,N] float or None; ``block`` 0 = auto.
    Returns (out [BW,H,N,D] in the [BW,N,H,D] layout, the row statistics (m, S) [BW,H,2,N] float32, m
    in natural units: ``attention.natural_lse(stats, True)`` is the lse).
    ``tables``: :func:`_tables` of (bias, mask), when the caller already has them.
    ``geo``: q/k/v are image rows [T, H, D] (T = batch·height·width tokens, see :class:`Geometry`)
    whose windows the kernels read in place; out is image rows [T, H, D] too; mask [geo.nW, N, N]."""
    BW, H, N, D = _shape(q, geo)
    nW = geo.nW if geo is not None else mask.shape[0] if mask is not None else 1
    out = _out_empty(q, geo)
    stats = torch.empty((BW, H, 2, N), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        stats[:, :, 0], stats[:, :, 1] = float("inf"), 1.0
        return out.zero_(), stats
    bt, sb_h, mt, nr = tables or _tables(bias, mask, N, q, _work(q, BW, H))
    has_bias, has_mask = bias is not None, mask is not None
    key = ("fwd", q.dtype, q.device, q.shape, q.stride(), k.stride(), v.stride(), has_bias, has_mask, sb_h, nr, nW,
           scale, precision, block, windows_per_program, geo)
    prepared(key, _fwd_launch, q, k, v, out, has_bias, has_mask, sb_h, nr, nW, scale, precision, block,
              windows_per_program, geo)(q, k, v, bt, mt, out, stats)
    return out, stats


class _BwdLaunches(NamedTuple):
    """The backward's launches for one signature (see :func:`backward`)."""
    fused: Optional[Launch]   # the single-kernel backward, or:
    dq: Optional[Launch]      # the tiled one: dq (+ delta),
    dkdv: Optional[Launch]    # dk, dv (+ the bias gradient's partial sums when one query tile holds a window)
    dbias: Optional[Launch]   # and the bias gradient's partial sums otherwise (None: not wanted or in dkdv)
    parts: int                # runs of the partial sums [parts, H, NR, NR] (0: no bias gradient)


def _bwd_launches(q, k, v, do, dq, o_arg, has_bias: bool, has_mask: bool, sb_h: int, nr: int, nW: int,
                  scale: float, precision: str, block: int, bias_grad: bool, windows_per_program: Optional[int],
                  geo: Optional[Geometry], offsets: Optional[tuple[int, int]]) -> _BwdLaunches:
    """``offsets``: (g_k, g_v) of a packed gradient (dk and dv written into dq's tensor), or None."""
    BW, H, N, D = _shape(q, geo)
    pl = make_plan(N, D, q.dtype, block, precision)
    qkv_do = (*_rows4(q, geo), *_rows4(k, geo), *_rows4(v, geo), *_rows4(do, geo))
    g3 = _rows4(dq, geo)[:3]  # dq, dk, dv share one layout
    g_kv = offsets or (0, 0)
    rest = (BW, H, N, nr, nW)
    geo_args = geo.args if geo is not None else _NO_GEO
    common = dict(D=D, D_PAD=pow2(D), HAS_MASK=has_mask, PREC=PRECISION_CODES[precision], EXACT=q.dtype == torch.float32,
                  GEO=geo is not None, num_stages=pl.bwd_depth(has_mask))
    if pl.fused_bwd:
        wpp, runs = plan_runs(BW, H, 1, q.device, tiles.BWD_PROGRAMS_PER_SM, windows_per_program)
        fused = Launch(_win_bwd_fused_kernel, (runs, H), (*qkv_do, *g3, *g_kv, sb_h, *rest, wpp, scale, *geo_args),
                       dict(BLOCK=pl.n_pad, HAS_BIAS=has_bias, BIAS_REGS=pl.bias_regs, BIAS_GRAD=bias_grad,
                            ONE_BUFFER=offsets is not None, num_warps=pl.fused_warps, **common))
        return _BwdLaunches(fused, None, None, None, runs if bias_grad else 0)
    n_mt = cdiv(N, pl.dq_m)
    wpp, runs = plan_runs(BW, n_mt * H, 1, q.device, tiles.FWD_PROGRAMS_PER_SM, windows_per_program)
    dq_l = Launch(_win_bwd_dq_kernel, (runs * n_mt, H),
                  (*qkv_do, *_rows4(o_arg, geo), *g3, sb_h, *rest, wpp, scale, *geo_args),
                  dict(BLOCK_M=pl.dq_m, BLOCK_N=pl.dq_n, HAS_BIAS=has_bias, ONE_TILE=pl.n_pad <= pl.dq_n,
                       num_warps=pl.dq_warps, **common))
    n_nt = cdiv(N, pl.kv_n)
    wpp, runs = plan_runs(BW, n_nt * H, 1, q.device, tiles.FWD_PROGRAMS_PER_SM, windows_per_program)
    db_in_kv = bias_grad and nr <= pl.kv_m  # one query tile covers the [NR, NR] bias table's rows
    kv_l = Launch(_win_bwd_dkdv_kernel, (runs * n_nt, H),
                  (*qkv_do, *g3, *g_kv, sb_h, *rest, wpp, scale, *geo_args),
                  dict(BLOCK_M=pl.kv_m, BLOCK_N=pl.kv_n, HAS_BIAS=has_bias, BIAS_GRAD=db_in_kv,
                       ONE_BUFFER=offsets is not None, num_warps=pl.kv_warps, **common))
    if not bias_grad or db_in_kv:
        return _BwdLaunches(None, dq_l, kv_l, None, runs if db_in_kv else 0)
    n_tiles = cdiv(N, pl.db_m) * cdiv(N, pl.db_n)
    wpp, runs = plan_runs(BW, n_tiles * H, 1, q.device, tiles.BWD_PROGRAMS_PER_SM, windows_per_program)
    db_l = Launch(_win_bwd_dbias_kernel, (runs * n_tiles, H), (*qkv_do, sb_h, *rest, wpp, scale, *geo_args),
                  dict(BLOCK_M=pl.db_m, BLOCK_N=pl.db_n, num_warps=pl.db_warps, **common))
    return _BwdLaunches(None, dq_l, kv_l, db_l, runs)


def backward(do, q, k, v, bias, mask, out, stats, scale: float, precision: str, block: int = 0,
             bias_grad: bool = False, windows_per_program: Optional[int] = None, tables=None, dqkv=None,
             geo: Optional[Geometry] = None):
    """Returns (dq, dk, dv, dbias); dbias [H,N,N] in bias.dtype, or None unless ``bias_grad``.
    ``out`` is read only when ``make_plan(...).reads_out`` (may be None otherwise). ``dqkv``: a
    packed gradient [BW,N,3,H,D] (image rows [T,3,H,D] with ``geo``) to write dq, dk, dv into, then
    returned as its :func:`qkv_views` (the kernels get the tensor itself and offsets into it, not
    views of it); new [BW,N,H,D]-layout tensors otherwise.
    ``geo``: every [BW,H,N,D] tensor above is image rows [T, H, D] instead (see :func:`forward`)."""
    BW, H, N, D = _shape(q, geo)
    nW = geo.nW if geo is not None else mask.shape[0] if mask is not None else 1
    if dqkv is None:
        dq, dk, dv = _out_empty(q, geo), _out_empty(k, geo), _out_empty(v, geo)
        # (the pointers each kernel writes: the single-kernel backward's three, the dK/dV kernel's two)
        offsets, fused_ptrs, kv_ptrs = None, (dq, dk, dv), (dk, dv)
    else:
        if dqkv.stride(-1) != 1:
            raise ValueError("window backward: the packed gradient needs a unit stride along D")
        dq, dk, dv = qkv_views(dqkv, geo)
        off = dk.storage_offset() - dq.storage_offset()
        # dk, dv reached from the one tensor at these offsets; the unused pointer arguments get q
        offsets, fused_ptrs, kv_ptrs = (off, 2 * off), (dqkv, q, q), (dqkv, q)
    if dq.numel() == 0:
        dbias = torch.zeros(bias.shape, dtype=bias.dtype, device=bias.device) if bias_grad else None
        return dq.zero_(), dk.zero_(), dv.zero_(), dbias
    has_bias, has_mask = bias is not None, mask is not None
    bt, sb_h, mt, nr = tables or _tables(bias, mask, N, q, _work(q, BW, H))
    reads_out = _reads_out(q, geo, block, precision)
    o_arg = out if reads_out else q  # float32 forms delta from P and dP
    key = ("bwd", q.dtype, q.device, q.shape, q.stride(), k.stride(), v.stride(), do.stride(), dq.stride(), offsets,
           reads_out and out.stride(), has_bias, has_mask, sb_h, nr, nW, scale, precision, block, bias_grad,
           windows_per_program, geo)
    go = prepared(key, _bwd_launches, q, k, v, do, dq, o_arg, has_bias, has_mask, sb_h, nr, nW, scale, precision,
                   block, bias_grad, windows_per_program, geo, offsets)
    dparts = torch.empty((go.parts, H, nr, nr), device=q.device, dtype=torch.float32) if go.parts else None
    if go.fused is not None:
        go.fused(q, k, v, bt, mt, do, stats, *fused_ptrs, stats if dparts is None else dparts)
    else:
        delta = torch.empty((BW, H, N), device=q.device, dtype=torch.float32)
        go.dq(q, k, v, bt, mt, do, o_arg, stats, delta, fused_ptrs[0])
        go.dkdv(q, k, v, bt, mt, do, stats, delta, *kv_ptrs,
                dparts if go.dbias is None and dparts is not None else delta)
        if go.dbias is not None:
            go.dbias(q, k, v, bt, mt, do, stats, delta, dparts)
    dbias = None
    if bias_grad:
        # fixed-order reduction of the per-run partial sums (torch's sum, no atomics): deterministic.
        # The [H, N, N] corner is taken before the sum, so that the sum writes it row-major: in a
        # compiled graph one kernel, where a sum of the padded tables then a row-major copy of its
        # corner took two launches
        red = dparts[0, :, :N, :N] if dparts.shape[0] == 1 else dparts[:, :, :N, :N].sum(0)
        dbias = red.to(bias.dtype)
    return dq, dk, dv, dbias


# ---------------------------------------------------------------------------------------------
# registration: custom ops for torch.compile (kernels/ops.py); the eager path has autograd Functions
# of its own below, which reuse the padded tables between forward and backward, write a packed qkv
# gradient in one piece and read image rows in place.


def _geometry(geometry: Optional[list[int]]) -> Optional[Geometry]:
    """The op's geometry argument (a :class:`Geometry`'s nine ints, or None) as a Geometry."""
    return Geometry(*geometry) if geometry is not None else None


def _op_tables(q: torch.Tensor, bias, mask, geo: Optional[Geometry]):
    """The op's tables: always padded (see PAD_TABLES_FROM: a compiled graph is paced by the GPU,
    and with ``mode="reduce-overhead"`` replayed from a CUDA graph); None for an empty call.

    The backward op may get the forward's padded tables themselves in place of bias and mask (see
    :func:`_keep_tables`): [H, NR, NR] / [nW, NR, NR] views with NR ≠ N, read as they are."""
    if not q.numel():
        return None
    n = _shape(q, geo)[2]
    nr = cdiv(n, 16) * 16
    if nr != n and any(t is not None and t.shape[-1] == nr for t in (bias, mask)):
        return (q if bias is None else bias, 0 if bias is None else bias.stride(0), q if mask is None else mask, nr)
    return _tables(bias, mask, n, q)


def _padded_buffer(tables, bias, mask, n: int) -> Optional[torch.Tensor]:
    """The [LB + LM, NR, NR] float32 buffer that :func:`_padded_tables` made for ``tables`` (None when the
    call reads bias and mask in place, or has neither)."""
    if tables is None or tables[3] == n or (bias is None and mask is None):
        return None
    return tables[0] if bias is not None else tables[2]


def _keep_tables(bias, mask, kept: torch.Tensor) -> tuple:
    """(bias, mask) for the backward op to read: the forward's padded tables ``kept`` (the forward op's
    third output; empty when it made none), so that the backward does not pad them again — one launch
    less per call in a compiled graph — or the inputs themselves. Only for a float32 bias (the
    backward returns the bias gradient in the dtype of the bias it gets) or none."""
    if not kept.numel() or (bias is not None and bias.dtype != torch.float32):
        return bias, mask
    lb = _bias_tables(bias)
    nr = kept.shape[-1]
    kb = None if bias is None else kept[:lb].expand(bias.shape[0], nr, nr) if lb == 1 else kept[:lb]
    return kb, (None if mask is None else kept[lb:])


def _op_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                mask: Optional[torch.Tensor], scale: float, precision: str, block: int,
                windows_per_program: int, geometry: Optional[list[int]] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v [BW,H,N,D], bias [H,N,N], mask [nW,N,N] (float) → out [BW,H,N,D] ([BW,N,H,D] layout),
    row statistics [BW,H,2,N], and the padded bias / mask tables [LB + LM, NR, NR] float32 the kernels
    read (an empty tensor where they read bias and mask in place): the backward reuses them.
    ``block`` 0 = auto; ``windows_per_program`` ≤ 0 lets the planner choose.
    ``geometry`` (a :class:`Geometry` as its nine ints): q/k/v and out are image rows [T,H,D]
    instead, rolled and partitioned by the kernels' addressing (see :func:`forward`)."""
    wpp = windows_per_program if windows_per_program > 0 else None
    geo = _geometry(geometry)
    tables = _op_tables(q, bias, mask, geo)
    out, stats = forward(q, k, v, bias, mask, scale, precision, block, wpp, tables, geo)
    buf = _padded_buffer(tables, bias, mask, _shape(q, geo)[2])
    return out, stats, (q.new_empty(0, dtype=torch.float32) if buf is None else buf)


def _op_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 bias: Optional[torch.Tensor], mask: Optional[torch.Tensor], out: Optional[torch.Tensor],
                 stats: torch.Tensor, scale: float, precision: str, block: int, windows_per_program: int,
                 bias_grad: bool, geometry: Optional[list[int]] = None) -> list[torch.Tensor]:
    """→ [dq, dk, dv, dbias] (dq, dk, dv shaped as q, k, v: image rows with ``geometry``); dbias
    [H,N,N] is an empty tensor unless ``bias_grad``. ``bias`` / ``mask``: the forward's inputs, or the
    forward's padded tables in their place ([H,NR,NR] / [nW,NR,NR] float32, see :func:`_keep_tables`)."""
    return _op_grads(do, q, k, v, bias, mask, out, stats, scale, precision, block, windows_per_program, bias_grad,
                     _geometry(geometry))


def _op_grads(do, q, k, v, bias, mask, out, stats, scale: float, precision: str, block: int,
              windows_per_program: int, bias_grad: bool, geo: Optional[Geometry], dqkv=None) -> list[torch.Tensor]:
    """The backward ops' body: [dq, dk, dv, dbias] by :func:`backward` on padded tables (see
    :func:`_op_tables`), written into ``dqkv`` when given; dbias an empty tensor unless ``bias_grad``."""
    dq, dk, dv, dbias = backward(do, q, k, v, bias, mask, out, stats, scale, precision, block, bias_grad,
                                 windows_per_program if windows_per_program > 0 else None,
                                 _op_tables(q, bias, mask, geo), dqkv, geo)
    # dbias is the [H, N, N] corner of the padded tables: row-major where the partials were summed,
    # a view of the one run's partial otherwise; a compiled graph expects the fake's strides
    # (inductor asserts them), so the op returns it row-major
    return [dq, dk, dv, dbias.contiguous() if dbias is not None else q.new_empty(0)]


def _reads_out(q: torch.Tensor, geo: Optional[Geometry], block: int, precision: str) -> bool:
    """Whether the backward of a call on q (window rows, or image rows with ``geo``) reads out."""
    _, _, n, d = _shape(q, geo)
    # int(): while torch.compile traces, n and d may be SymInts (automatic dynamic on a recompile,
    # dynamic=True), which make_plan's cache cannot hash; the forward's plan specialises them anyway
    return make_plan(int(n), int(d), q.dtype, block, precision).reads_out


def _save(inputs, outputs):
    q, k, v, bias, mask, scale, precision, block, wpp, *geometry = inputs
    geometry = geometry[0] if geometry else None
    out, stats, kept = outputs
    keep_out = _reads_out(q, _geometry(geometry), block, precision)
    bias, mask = _keep_tables(bias, mask, kept)
    return (q, k, v, bias, mask, out if keep_out else None, stats), (scale, precision, block, wpp), (geometry,)


OP = KernelOp("window", "window_attention", forward=_op_forward, backward=_op_backward, save=_save)
window_fwd, window_bwd = OP.fwd, OP.bwd  # torch.ops.elsa_vision.window_fwd / _bwd


def _op_forward_packed(qkv: torch.Tensor, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor], scale: float,
                       precision: str, block: int, windows_per_program: int,
                       geometry: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [BW,N,3,H,D] (image rows [T,3,H,D] with ``geometry``; q, k, v: its ``qkv_views``) → as
    ``_op_forward``."""
    return _op_forward(*qkv_views(qkv, _geometry(geometry)), bias, mask, scale, precision, block, windows_per_program,
                       geometry)


def _op_backward_packed(do: torch.Tensor, qkv: torch.Tensor, bias: Optional[torch.Tensor],
                        mask: Optional[torch.Tensor], out: Optional[torch.Tensor], stats: torch.Tensor, scale: float,
                        precision: str, block: int, windows_per_program: int, bias_grad: bool,
                        geometry: Optional[list[int]] = None) -> list[torch.Tensor]:
    """→ [dqkv (shaped as qkv), dbias]: the kernels write dq, dk, dv into their places in one tensor,
    as _PackedWindowAttention does eagerly (three gradients of views would be stacked by autograd)."""
    geo = _geometry(geometry)
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    *_, dbias = _op_grads(do, *qkv_views(qkv, geo), bias, mask, out, stats, scale, precision, block,
                          windows_per_program, bias_grad, geo, dqkv)
    return [dqkv, dbias]


def _save_packed(inputs, outputs):
    qkv, bias, mask, scale, precision, block, wpp, *geometry = inputs
    geometry = geometry[0] if geometry else None
    out, stats, kept = outputs
    geo = _geometry(geometry)
    keep_out = _reads_out(qkv_views(qkv, geo)[0], geo, block, precision)
    bias, mask = _keep_tables(bias, mask, kept)
    return (qkv, bias, mask, out if keep_out else None, stats), (scale, precision, block, wpp), (geometry,)


PACKED = KernelOp("window_packed", "window_attention", forward=_op_forward_packed, backward=_op_backward_packed,
                  save=_save_packed, bias_input=1)


def _forward_ctx(ctx, q, k, v, bias, mask, scale, precision, block, wpp, geo):
    """The forward of both autograd Functions; what the backward needs goes in ``ctx``."""
    BW, H, N, _ = _shape(q, geo)
    tables = _tables(bias, mask, N, q, _work(q, BW, H)) if q.numel() else None
    out, stats = forward(q, k, v, bias, mask, scale, precision, block, wpp, tables, geo)
    keep_out = _reads_out(q, geo, block, precision)
    ctx.args = (scale, precision, block)
    ctx.wpp, ctx.geo = wpp, geo
    ctx.tables = tables  # the padded bias / mask copies (small), reused by the backward
    return out, (bias, mask, out if keep_out else None, stats)


def _backward_ctx(ctx, dout, q, k, v, saved, bias_input: int, dqkv=None):
    """The backward of both autograd Functions → (dq, dk, dv, dbias); ``bias_input``: the bias's
    position among the Function's inputs."""
    check_first_order("window_attention")
    bias, mask, out, stats = saved
    bias_grad = bool(bias is not None and ctx.needs_input_grad[bias_input])
    return backward(dout, q, k, v, bias, mask, out, stats, *ctx.args, bias_grad, ctx.wpp, ctx.tables, dqkv,
                    ctx.geo)


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, mask, scale, precision, block, wpp, geo):
        out, saved = _forward_ctx(ctx, q, k, v, bias, mask, scale, precision, block, wpp, geo)
        ctx.save_for_backward(q, k, v, *saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, *saved = ctx.saved_tensors
        dq, dk, dv, dbias = _backward_ctx(ctx, dout, q, k, v, saved, 3)
        return dq, dk, dv, dbias, None, None, None, None, None, None


class _PackedWindowAttention(torch.autograd.Function):
    """Takes qkv [BW, N, 3, H, D] (image rows: [T, 3, H, D]) itself, so that its gradient is one
    tensor the backward kernels write in place: q, k, v taken as views outside would get three
    gradients that autograd then stacks — a copy of the size of qkv, which at Swin-T's first stage
    takes nearly as long as the attention kernels themselves."""

    @staticmethod
    def forward(ctx, qkv, bias, mask, scale, precision, block, wpp, geo):
        out, saved = _forward_ctx(ctx, *qkv_views(qkv, geo), bias, mask, scale, precision, block, wpp, geo)
        # (views of qkv kept on ctx would save the backward this call, but would hold qkv's memory
        # past saved-tensor hooks: activation checkpointing, offloading)
        ctx.save_for_backward(qkv, *saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        qkv, *saved = ctx.saved_tensors
        dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        _, _, _, dbias = _backward_ctx(ctx, dout, *qkv_views(qkv, ctx.geo), saved, 1, dqkv)
        return dqkv, dbias, None, None, None, None, None, None


def _compiled(q, k, v, qkv, bias, mask, scale: float, precision: str, block: int, wpp: int,
              geo: Optional[Geometry]) -> torch.Tensor:
    """The call as torch.compile traces it: the window custom op (its packed form when ``qkv`` is
    given: the gradient of qkv comes out of the kernels in one piece), with ``geo`` on image rows
    (the kernels roll and partition them by their addressing, as on the eager path: no copies of q,
    k, v, out or their gradients around the op)."""
    op, inputs = (OP, (q, k, v)) if qkv is None else (PACKED, (qkv,))
    if geo is None:
        return op.fwd(*inputs, bias, mask, scale, precision, block, wpp)[0]
    return op.fwd(*inputs, bias, mask, scale, precision, block, wpp, list(geo))[0]


@on_device
def window_attention(q, k, v, bias, mask, scale: float, precision: str, block: int = 0,
                     windows_per_program: Optional[int] = None, qkv: Optional[torch.Tensor] = None,
                     geo: Optional[Geometry] = None) -> torch.Tensor:
    """Launcher behind the dispatcher's "triton" window backend (inputs already validated by
    :func:`elsa_vision.window_attention`): the custom op under torch.compile, the autograd.Functions
    otherwise. ``qkv``: the packed [BW, N, 3, H, D] tensor q, k, v are the :func:`qkv_views` views of
    (then its gradient is written in one piece). Returns out [BW,H,N,D].

    ``geo`` (:func:`elsa_vision.shifted_window_attention`): q, k, v are image rows [T, H, D] (qkv
    [T, 3, H, D]) whose shifted windows the kernels read in place; returns image rows [T, H, D]."""
    # (the mask too, for a forward-AD tangent: it never requires grad, the public checks refuse that)
    how = route("shifted_window_attention" if geo is not None else "window_attention",
                (qkv, bias, mask) if qkv is not None else (q, k, v, bias, mask))
    if how is COMPILED:
        return _compiled(q, k, v, qkv, bias, mask, scale, precision, int(block or 0), int(windows_per_program or 0),
                         geo)
    block, wpp = int(block or 0), int(windows_per_program or 0) or None
    if how is not AUTOGRAD:
        views = qkv_views(qkv, geo) if qkv is not None else (q, k, v)
        return forward(*views, bias, mask, scale, precision, block, wpp, geo=geo)[0]
    if qkv is not None:
        return _PackedWindowAttention.apply(qkv, bias, mask, scale, precision, block, wpp, geo)
    return _WindowAttention.apply(q, k, v, bias, mask, scale, precision, block, wpp, geo)
