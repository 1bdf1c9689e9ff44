"""Tile and launch-shape tables of the kernel families: what each kernel's tiles, warps and pipeline
depths are for a dtype, head dim, float32 mode and length, and how work is split over the GPU.

The tables were chosen by sweeping candidates on an H200 (``benchmarks/attention.py --tune``,
``benchmarks/windows.py --tune``) and reading ptxas's register, spill and shared-memory reports
for sm_90; the measured numbers are in benchmarks/results/ and docs/ARCHITECTURE.md. Under the CPU
interpreter the shapes are small and fixed (the interpreter pays per loop step, not per register).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from .launch import INTERPRET, cdiv, host_cache, pow2, sm_count
from .limits import WINDOW_BLOCKS as BLOCKS

# ---------------------------------------------------------------------------------------------
# attention (kernels/attention.py)

# strict float32: keys one uncompensated running sum may fold within the 2e-6 relative-L2 bound
PLAIN_KEYS = 8192

@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    kahan: bool = True  # strict float32 only: compensated tile-to-tile sums
    chunk: int = 0      # float32 forward: keys per chunk of the in-program two-level scan (0 = off)
    pipeline: bool = False  # forward: the next key tile's q·kᵀ issued before this one's softmax


def fwd_config(dtype: torch.dtype, d_pad: int, precision: str, nk: int = 0, has_bias: bool = False,
               nq: int = 0) -> Config:
    """Forward tile shape by dtype / padded head dim / float32 mode: the fastest of the candidates in
    benchmarks/attention.py --tune.

    A few half-precision queries against many keys (a KV-cache step: ``nq`` ≤ 64, ``nk`` ≥ 4096)
    take ``FEWQ``: the call is bound by reading K and V, and the 128-row, 8-warp tile would spend 8×
    the products and exponentials on padding rows at Nq = 16.

    Strict float32 with d ≤ 64 runs uncompensated 64×64 tiles; beyond PLAIN_KEYS keys, where the
    error of one running sum passes 2e-6 relative L2, the keys are folded 2048 at a time (``chunk``,
    the in-program two-level scan), which keeps the compensated tiles' accuracy at the uncompensated
    tiles' speed. At d = 128 the Kahan-compensated 32×32 tiles measured fastest.

    ``pipeline`` (the split float32 modes without a bias, from 2048 keys; the interpreter runs it
    at every length so that the CPU tests cover it; outputs bitwise equal either way): on where it
    measured faster (fp16x3 d = 64, tf32x3 d = 64 / 128), off where the live extra score tile
    costs more than it hides (short rows, fp16x3 d = 32 / 128, a bias, half precision)."""
    if INTERPRET:
        cfg = Config(32, 32, 1, 1)
    elif dtype != torch.float32 and 0 < nq <= 64 and nk >= 4096 and d_pad <= 128:
        cfg = FEWQ
    else:
        cfg = _fwd_tiles(dtype, d_pad, precision, nk, has_bias)
    if (dtype == torch.float32 and not has_bias and (INTERPRET or nk >= 2048)
            and (precision == "fp16x3" and d_pad == 64 or precision == "tf32x3" and d_pad in (64, 128))):
        cfg = dataclasses.replace(cfg, pipeline=True)
    return cfg


# Half-precision few-query tile: one warpgroup's 64 rows (the smallest wgmma tile). The sweep
# (benchmarks/attention.py --tune fewq, H100, H = 16, d = 64) put it first at Nq = 16 and 64 against
# 131K keys and at Nq = 16 against 1M, ahead of 16-row tiles (mma.sync, 1-4% slower), 128-key
# tiles and the 128-row default; the planner's partition count beat fixed ones of 264-1056.
FEWQ = Config(64, 64, 4, 3)  # (d ≤ 128: three stages of 64-key K and V tiles take 96 KiB of shared memory)


def _fwd_tiles(dtype: torch.dtype, d_pad: int, precision: str, nk: int, has_bias: bool) -> Config:
    if dtype != torch.float32:
        if d_pad <= 32:
            return Config(128, 64, 4, 3)
        if d_pad <= 64:
            # rows under 4K keys: one-warpgroup programs of 64 rows, with the narrow last key tile
            # (tail_width), measured faster than 128 × 64 at 197-1041 tokens and equal at 4097
            return Config(64, 64, 4, 3) if nk < 4096 else Config(128, 64, 8, 3)
        if d_pad <= 128:
            return Config(64, 64, 4, 3)
        return Config(64, 32, 4, 2)
    if precision == "ieee":
        if d_pad <= 64:
            return Config(64, 64, 4, 2, kahan=False, chunk=0 if nk <= PLAIN_KEYS else 2048)
        return Config(32, 32, 4, 2) if d_pad <= 128 else Config(32, 32, 4, 1)
    if precision == "fp16x3":  # float16 parts: half tf32x3's shared memory and registers
        return Config(128, 64, 8, 3) if d_pad <= 64 else (Config(128, 64, 8, 2) if d_pad <= 128 else Config(64, 32, 4, 1))
    if d_pad <= 32 and not (precision == "tf32x3" and has_bias):
        # (with a bias the 128×128 tf32x3 tile needs 256 KiB of shared memory, over sm_90's 227)
        return Config(128, 128, 8, 3) if precision == "tf32x3" else Config(128, 64, 4, 3)
    if d_pad <= 64:
        return Config(128, 64, 8, 3) if precision == "tf32x3" else Config(128, 64, 4, 3)
    if d_pad <= 128:
        return Config(128, 32, 8, 2)
    return Config(32, 32, 4, 1)


def tail_width(n, block: int, causal_keys: bool = False) -> int:
    """Width of the last, partial tile of a loop over ``n`` positions in steps of ``block``: the
    remainder rounded up to a power of two, at least 16 (the smallest tensor-core product side), or
    ``block`` itself when that saves nothing, ``n`` divides evenly or is symbolic (a traced call's
    sizes stay unguarded), or the loop runs over keys under a causal mask (``causal_keys``: its
    bound is the diagonal, not ``n``). ViT's 197 tokens in 64-wide tiles: 3 full tiles and a 16-wide one, where
    a fourth 64-wide tile would spend 59 of its 64 columns on padding.

    Loops of 32-wide tiles keep them: there the narrow tile saves half a tile and its separate code
    after the software-pipelined loop measured slower (the half-precision backward at 197 tokens,
    dQ's keys and dK/dV's queries 32 at a time; docs/RESULTS.md, "Short rows in the portable forward"). The
    interpreter takes it at every width, so that the CPU tests cover it."""
    if causal_keys or type(n) is not int or n % block == 0 or (block < 64 and not INTERPRET):
        return block
    return min(block, pow2(n % block))


def bwd_config(dtype: torch.dtype, d_pad: int, precision: str, nq: int = 0) -> Config:
    """Backward tile shape (same sweep): block_n small enough that the dK/dV accumulators stay in registers.

    Half precision takes larger dQ tiles from 4096 queries on (faster over the whole backward at
    4K-16K); ViT-sized rows (197 or 1500) keep smaller ones, where fewer programs would fill the
    GPU less well."""
    if INTERPRET:
        return Config(32, 32, 1, 1)
    if dtype != torch.float32:
        if d_pad <= 64:
            return Config(128, 64, 8, 3) if nq >= 4096 else Config(64, 32, 4, 3)
        if d_pad <= 128:
            return Config(64, 64, 4, 2) if nq >= 4096 else Config(64, 32, 4, 2)
        return Config(32, 32, 4, 1)
    if precision == "fp16x3":
        return Config(128, 64, 8, 3) if d_pad <= 64 else (Config(128, 32, 8, 2) if d_pad <= 128 else Config(64, 32, 4, 1))
    if precision == "tf32x3" and d_pad <= 64:
        return Config(128, 64, 8, 2)
    # strict float32 (FMA products) stages its operands through shared memory: no multi-buffering
    stages = 1 if precision == "ieee" else 2
    if d_pad <= 64:
        return Config(64, 32, 4, stages)
    if d_pad <= 128:
        return Config(32, 32, 4, 1)
    return Config(16, 16, 4, 1)


def early_dp_default(dtype: torch.dtype, d_pad: int, precision: str) -> bool:
    """Whether the dK/dV kernel issues dPᵀ = v·dOᵀ right after Sᵀ, before the exponentials, so that
    the tensor cores work under them (the dQ kernel always does). Bitwise the same gradients either
    way; on where it measured faster (bf16/fp16 d ≤ 64, fp16x3), off where the extra live
    [BLOCK_N, BLOCK_M] tile costs registers (bf16 d = 128, tf32x3, ieee)."""
    if dtype != torch.float32:
        return d_pad <= 64
    return precision == "fp16x3"


def kv_config(dtype: torch.dtype, d_pad: int, precision: str, dq_cfg: Config) -> Config:
    """Tile shape of the dK/dV kernel: block_m query rows per step, block_n keys per program (the
    MMAs' M side). Measured separately from the dQ kernel's (benchmarks/attention.py --tune bwdkv);
    elsewhere the dQ tile with its larger side as keys."""
    if not INTERPRET:
        if dtype != torch.float32:
            if d_pad <= 64:
                return Config(*_KV_HALF_64)
            if d_pad <= 128:
                return Config(*_KV_HALF_128)
        elif precision == "tf32x3" and d_pad <= 64:
            return Config(*_KV_TF32X3_64)
        elif precision == "fp16x3" and d_pad <= 128:
            return Config(*(_KV_FP16X3_64 if d_pad <= 64 else _KV_FP16X3_128))
    return Config(min(dq_cfg.block_m, dq_cfg.block_n), max(dq_cfg.block_m, dq_cfg.block_n),
                  dq_cfg.num_warps, dq_cfg.num_stages)


def plan_partitions(batch_heads: int, nq: int, nk: int, block_m: int, block_n: int, device: torch.device,
                    requested: Optional[int] = None, balance_waves: bool = False) -> tuple[int, int]:
    """(n_part, part_len): how phase 1 splits the keys. part_len is a multiple of block_n.

    One partition when (query blocks × batch·heads) gives every SM a program; otherwise keys are
    split so the phase-1 grid reaches about two programs per SM, each partition with the same number
    of key tiles (±1 over all partitions). The summaries cost P float32 copies of the output, so a
    grid that already fills the SMs once is not split (at N = 1041, B·H = 16 a split doubled the
    peak memory for no gain) — except, with ``balance_waves``, a long key set (≥ WAVE_MIN_TILES
    tiles a partition) whose grid leaves the last wave mostly empty: there the smallest split up to
    8 that fills WAVE_FILL of the waves is taken (1041 queries × 16 heads in 128-row tiles are 144
    programs on 132 SMs: a second wave of 12). Callers set it where one program runs per SM at a
    time and there is no persistent kernel to balance the items itself (the float32 MMA modes).

    Sizes may be symbolic (torch.compile with dynamic shapes): the arithmetic takes torch.sym_min /
    sym_max, so a traced graph is guarded only on whether the grid fills the GPU, not on the sizes.
    """
    n_tiles = _max(1, cdiv(nk, block_n))
    if requested is not None:
        want = _max(1, _min(int(requested), n_tiles))
    else:
        base = cdiv(nq, block_m) * batch_heads
        sms = sm_count(device.index or 0) if device.type == "cuda" else 1
        if base >= sms:
            if not balance_waves:
                return 1, n_tiles * block_n
            return _balanced_waves(base, n_tiles, block_n, sms)
        # a partition shorter than four tiles pays more in summary traffic than it gains in parallelism
        want = _max(1, _min(_min(n_tiles, cdiv(2 * sms, base)), n_tiles // 4))
    tiles_per = cdiv(n_tiles, want)
    return cdiv(n_tiles, tiles_per), tiles_per * block_n


WAVE_MIN_TILES = 32
WAVE_FILL = 0.9


def _balanced_waves(base, n_tiles: int, block_n: int, sms: int) -> tuple[int, int]:
    """(n_part, part_len) for a grid of ``base`` programs that already covers the SMs: see
    plan_partitions(balance_waves=True). Plain ints only (a traced call's sizes would guard on every
    candidate); symbolic sizes keep one partition."""
    if not (isinstance(base, int) and isinstance(n_tiles, int)):
        return 1, n_tiles * block_n
    fill = lambda p: base * p / (cdiv(base * p, sms) * sms)  # noqa: E731 - busy share of the waves
    best = 1
    for p in range(2, 9):
        if fill(best) >= WAVE_FILL or n_tiles // p < WAVE_MIN_TILES:
            break
        if fill(p) > fill(best):
            best = p
    tiles_per = cdiv(n_tiles, best)
    return cdiv(n_tiles, tiles_per), tiles_per * block_n


_KV_HALF_64 = (32, 128, 4, 4)
_KV_HALF_128 = (64, 64, 4, 2)
_KV_TF32X3_64 = (64, 128, 8, 2)
_KV_FP16X3_64 = (64, 128, 8, 3)
_KV_FP16X3_128 = (32, 128, 8, 2)


# ---------------------------------------------------------------------------------------------
# windows (kernels/window.py)

# Programs per SM the planners aim for (a few resident per SM hide latency; the rest is loop length).
# The single-kernel backward holds two programs per SM (255 registers): with two per SM its runs are
# one wave, twice as long, 7-9% faster than four per SM on Swin-T's image rows (bf16, H100; no change
# on window rows, nor for the tiled dbias kernel that also plans with it; benchmarks/windows.py
# --tune bwd4).
FWD_PROGRAMS_PER_SM = 8
BWD_PROGRAMS_PER_SM = 2
# Tuning switches (benchmarks/windows.py --tune; call elsa_vision.clear_caches() after changing
# one): keep the bias tile in registers across a run instead of re-reading it (an L1 hit) per
# window; pipelining depth of the window loop.
BIAS_IN_REGISTERS = False
STAGES = 2
# Without a mask a pipeline stage of the half-precision single-tile forward and single-kernel
# backward holds only q, k, v (12 KB at Swin's 49 tokens, d = 32); the mask's float32 tile (16 KB)
# is what makes a third stage cost occupancy (Swin-T image rows, bf16, H100: with the mask a third
# stage makes the backward 1.4-1.5x slower and the forward no faster; without it the forward at
# stage 1 takes 102 against 118 µs, the backward 129 against 168).
OPEN_STAGES = 3
# No register cap (ptx .maxnreg): ptxas gives most window kernels 255 registers (sm_90, Triton 3.6),
# two 4-warp programs per SM; capping at 168 or 128 spills 150-950 bytes per thread in every
# kernel except the bf16 forward (benchmarks/window_compile.py).
# float32 dq kernel: widest window (N_pad) whose whole row is one key tile (see _win_bwd_dq_kernel)
ONE_TILE_DQ_MAX = 64


def choose_block(n: int) -> int:
    """``block="auto"``: the key tile for windows of ``n`` tokens, from benchmarks/windows.py (every
    Swin-T and SwinV2-T stage, float32 and bf16).

    Windows of 33-64 tokens (Swin 7×7, SwinV2 8×8): 256. Every block gives them the same single
    tile; 256 only makes each program run at least four windows (256 and 64 measured a tie, with
    the variant order shuffled each round). Smaller windows keep 64 (256 would mean runs of 8-16
    windows, fewer programs). Larger windows: 64, folding 64-wide key tiles — faster than the single
    pass of 256 at N = 256, and in float32 a 128- or 256-wide score tile spills (see
    :func:`make_plan`)."""
    return 256 if pow2(n) == 64 else 64


@dataclass(frozen=True)
class Plan:
    """How one call is tiled (see the module docstring)."""
    block: int
    n_pad: int
    single: bool          # forward: N ≤ block, the whole window is one key tile
    fwd_m: int            # forward query tile
    fwd_n: int            # forward key tile
    fwd_warps: int
    fused_bwd: bool       # backward: one kernel, one [N_pad, N_pad] tile per window
    reads_out: bool       # tiled half-precision backward: delta = rowsum(dO ⊙ O) (see _win_bwd_dq_kernel)
    fused_warps: int
    dq_m: int             # tiled backward, dq kernel: query tile it owns, key tile of its loop
    dq_n: int
    dq_warps: int
    kv_m: int             # dk/dv kernel: query tile of its loop, key tile it owns
    kv_n: int
    kv_warps: int
    db_m: int             # dbias kernel: the bias tile it owns
    db_n: int
    db_warps: int
    min_windows: int      # G = max(1, block // N_pad): shortest run of windows per forward program
    bias_regs: bool       # single-tile kernels hold the head's bias tile in registers for the whole run
    stages: int           # software-pipelining depth of the backward's loops over windows
    fwd_stages: int       # and of the forward's
    open_stages: int      # both, for a call without a mask (0: as with one; see OPEN_STAGES)

    def fwd_depth(self, has_mask: bool) -> int:
        """num_stages of the forward for a call with / without a mask table."""
        return self.open_stages if self.open_stages and not has_mask else self.fwd_stages

    def bwd_depth(self, has_mask: bool) -> int:
        """num_stages of the backward's kernels for a call with / without a mask table."""
        return self.open_stages if self.open_stages and not has_mask else self.stages


# Backward tiles (query tile, key tile, warps) per precision class, from ptxas reports for sm_90 at
# head dim ≤ 64: the largest shapes that do not spill. Triton's 3xTF32 and IEEE-FMA dots keep several
# copies of their operands in registers, so those classes get narrower key tiles. fp16x3 (float16
# parts) takes the half-precision tiles although its dk/dv kernel then spills (~0.5 KB per thread at
# N = 49): its float32 forward+backward of Swin-T and SwinV2 stages measured faster than with the
# 3xTF32 tiles (benchmarks/results/nvidia-h200/windows_fp16x3_tiles.txt).
_BWD_TILES = {
    #          dq kernel      dk/dv kernel    dbias kernel
    "half":   ((64, 64, 4), (64, 64, 4), (64, 64, 4)),
    "tf32":   ((64, 32, 4), (64, 16, 4), (64, 32, 4)),
    "tf32x3": ((64, 32, 4), (64, 16, 4), (64, 32, 4)),
    "fp16x3": ((64, 64, 4), (64, 64, 4), (64, 64, 4)),
    "ieee":   ((64, 32, 8), (64, 32, 8), (32, 32, 8)),
}


def _precision_class(dtype: torch.dtype, precision: str) -> str:
    if dtype in (torch.float16, torch.bfloat16):
        return "half"
    return precision if precision in ("ieee", "tf32x3", "fp16x3") else "tf32"


@host_cache(maxsize=None)
def make_plan(n: int, d: int, dtype: torch.dtype, block: int, precision: str = "native") -> Plan:
    """Tile shapes for windows of ``n`` tokens, head dim ``d``, key tile ``block`` (0: :func:`choose_block`).

    Chosen from ptxas reports for sm_90 (registers, spills, shared memory): a float32 [BM, BN] tile
    costs BM·BN / (32·warps) registers per thread. The forward's single tile is [min(N_pad, 64), N_pad]
    up to N_pad = 128 and [16, 256] for N_pad = 256 (a 64×256 score tile spills). The single-kernel
    backward (five dots on [N_pad, N_pad] tiles) fits registers for half precision and TF32 with
    N_pad ≤ 64; otherwise the backward runs as three kernels with the tiles of ``_BWD_TILES``."""
    block = block or choose_block(n)
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
    n_pad = pow2(n)
    d_pad = pow2(d)
    cls = _precision_class(dtype, precision)
    single = n_pad <= block
    fwd_n = n_pad if single else block
    # Four warps throughout: with eight, Triton lays 64-row (wgmma) and 32-row tiles out as eight warps
    # along the rows, which computes every product twice. Key tiles wider than 64 keep 16 query rows
    # (a 64×128 float32 score tile already spills).
    fwd_m = min(n_pad, 64) if fwd_n <= 64 else 16
    fused = n_pad <= 64 and cls == "half" and d_pad <= 32
    (dq_m, dq_n, w1), (kv_m, kv_n, w2), (db_m, db_n, w3) = _BWD_TILES[cls]
    if cls != "half" and n_pad <= ONE_TILE_DQ_MAX:
        # float32 forms delta from P and dP: with the whole row in one key tile that is free (three
        # dots a window instead of five on 32-wide tiles; ptxas sm_90, Triton 3.6: no spill in tf32
        # and ieee, 56 bytes in 3xTF32, which spills a few dozen with the 32-wide tiles too)
        dq_n = n_pad
    stages = fwd_stages = STAGES
    # shared memory: the k and v tiles of every pipeline stage must fit (H100: 227 KiB per block)
    esize = 2 if cls == "half" else 4
    kv_bytes = lambda width, st: 2 * width * d_pad * esize * st  # noqa: E731
    if kv_bytes(fwd_n, fwd_stages) > 96 * 1024:
        fwd_stages = 1
    while kv_bytes(fwd_n, 1) > 128 * 1024:
        fwd_n //= 2  # the window no longer fits one key tile: fold several
    single = fwd_n >= n_pad
    if d_pad >= 64:
        # wider operand tiles: narrower key tiles, and at 128 one pipeline stage (shared memory)
        cap = 16 if (cls != "half" or d_pad >= 128) else 32
        dq_n, kv_n, db_n = min(dq_n, cap), min(kv_n, cap), min(db_n, cap)
        if d_pad >= 128:
            fwd_m, stages, fwd_stages = min(fwd_m, 32), 1, 1
    if INTERPRET:
        # the CPU interpreter pays per loop step, not per register: fewer, wider backward tiles
        dq_n = kv_n = db_n = 64
        db_m = 64
    return Plan(block=block, n_pad=n_pad, single=single, fwd_m=fwd_m, fwd_n=fwd_n, fwd_warps=4,
                fused_bwd=fused, reads_out=not fused and cls == "half", fused_warps=4,
                dq_m=dq_m, dq_n=dq_n, dq_warps=w1, kv_m=kv_m, kv_n=kv_n, kv_warps=w2,
                db_m=db_m, db_n=db_n, db_warps=w3, min_windows=max(1, block // n_pad),
                bias_regs=BIAS_IN_REGISTERS, stages=stages, fwd_stages=fwd_stages,
                open_stages=OPEN_STAGES if fused else 0)  # (fused: the forward is one tile too)


@host_cache(maxsize=1024)
def plan_runs(bw: int, programs_per_run: int, min_windows: int, device: torch.device, per_sm: int,
              requested: Optional[int] = None) -> tuple[int, int]:
    """(windows per program, runs): split the BW windows of each head into runs of consecutive
    windows so that runs × programs_per_run is about ``per_sm`` programs per SM (never runs shorter
    than ``min_windows``). ``requested`` forces the run length (tests)."""
    if requested is not None and requested > 0:
        wpp = int(requested)
    else:
        sms = sm_count(device.index or 0) if device.type == "cuda" else 1
        runs = _max(1, _min(bw, cdiv(per_sm * sms, programs_per_run)))
        wpp = _max(min_windows, cdiv(bw, runs))
    wpp = _max(1, _min(wpp, bw))
    return wpp, cdiv(bw, wpp)


def _min(a, b):
    # (torch.sym_min / sym_max: no guard when a size is symbolic; on ints, min / max)
    return min(a, b) if type(a) is int and type(b) is int else torch.sym_min(a, b)


def _max(a, b):
    return max(a, b) if type(a) is int and type(b) is int else torch.sym_max(a, b)

