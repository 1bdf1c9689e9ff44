"""Swin window-attention benchmark: ELSA's window kernel vs timm's own two paths, same process, interleaved.

    python benchmarks/windows.py            # all shapes, fp32 + bf16, fwd and fwd+bwd, block sweep
    python benchmarks/windows.py --quick    # the four Swin-T stages + SwinV2 window 8 and 16, no sweep
    python benchmarks/windows.py --tune --shapes swinT-s1,swinT-s4,v2w16-s1   # kernel tuning switches
    python benchmarks/windows.py --quick --profile   # + CUDA time per kernel and host time per call
    python benchmarks/windows.py --blocks   # Swin blocks' whole _attn: shift + windows + attention
    python benchmarks/windows.py --quick --compile default   # every variant under torch.compile
    python benchmarks/windows.py --quick --compile default --chain 6   # 6 independent ops per compiled call
    → benchmarks/results/<device>/windows.csv and windows.png (windows_quick.* with --quick,
      windows_blocks.* with --blocks)

Shapes: Swin-T at 224² and batch 64 — B·nW = 4096/1024/256/64 windows of N = 49 tokens, heads 3/6/12/24,
d = 32 — and SwinV2-T window 8 (N = 64, 256²) and window 16 (N = 256, 256²) stages. Stages with more
than one window use the shifted-window mask (timm's 0/−100), as the shifted blocks do.

Variants (all take q, k, v [B·nW, H, N, d] as the strided views timm's qkv projection gives, the
relative-position bias [H, N, N] as a leaf that requires grad, and the mask [nW, N, N]):
  timm-sdpa   timm's fused path: attn_mask = bias + the mask expanded to [B·nW, H, N, N], then SDPA
  timm-math   timm's unfused path: q·scale @ kᵀ + bias + mask (broadcast by window), softmax, @ v
  elsa-generic  elsa_vision.attention with the same expanded [B·nW, H, N, N] bias (for reference)
  elsa        elsa_vision.window_attention, block="auto"; elsa-b64/128/256 the block sweep
  elsa-qkv    elsa_vision.window_attention_packed on the qkv leaf (the Swin v1 adapter's call): one
              gradient for qkv written by the kernels, where every other variant's three view
              gradients are stacked by autograd
fp32 runs under torch's default matmul precision ("highest": timm's matmuls are IEEE float32 and ELSA
runs fp16x3). fwd+bwd computes dq, dk, dv and dbias.

--blocks: the unit is a Swin-T block's whole ``_attn(x)`` — x [64, R, R, C] → cyclic shift → window
partition → WindowAttention (qkv, attention, proj) → window merge → reverse shift — one block per
stage (shifted at stages 1-3; stage 4 is one window), fwd and fwd+bwd (gradients of x and of the
attention's parameters), fp32 and bf16 autocast. Variants: timm-sdpa / timm-math (the block as timm
runs it), elsa-window (``patch(fuse_windows=False)``: ELSA inside WindowAttention, timm's shift and
partition copies around it) and elsa-block (``patch()``: one shifted_window_attention call on the
feature map, no copies).

--chain K: each timed call runs the op on K independent inputs (K blocks of a stage, each with its own
qkv and bias table; one mask), and ms is the call's median time divided by K: the time per op (so
are the profile rows' host_ms, cuda_ms and calls; peak_mib stays the call's, K ops' worth).
Compiled, the K ops are one graph, so the compiled function's per-call host path (dynamo's guards,
the autograd runtime around the graph, the backward's launch) is paid once per K ops, as in a
compiled model; with K = 1 (the default) a call of a few kernels measures mostly that path on either
side. Unlike a model's blocks the K ops do not depend on each other, so inductor may share or fuse
work across them (timm's paths expand the shared mask once per call).

Columns: ms (median), peak_mib (allocated above the inputs during one call), speedup =
min(timm-sdpa, timm-math) ms / variant ms (> 1: faster than timm's better path), mem_ratio = variant peak /
that path's peak. graph_ms / graph_speedup: the same calls replayed from CUDA graphs (on a GPU), which
removes the host's work (Python, autograd, launches) from the timing: at the late stages every path
spends longer launching than computing, so ``ms`` there measures the host, ``graph_ms`` the GPU (what a
captured training step or torch.compile(mode="reduce-overhead") gets).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import (cuda_breakdown, fmt_table, measure, measure_graphed, results_dir, sync,  # noqa: E402
                                write_csv)

import elsa_vision  # noqa: E402
from elsa_vision.adapters.registry import patched_modules  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (name, batch·nW, nW, heads, N)
SHAPES = [
    ("swinT-s1", 4096, 64, 3, 49), ("swinT-s2", 1024, 16, 6, 49), ("swinT-s3", 256, 4, 12, 49),
    ("swinT-s4", 64, 1, 24, 49),
    ("v2w8-s1", 4096, 64, 3, 64), ("v2w8-s2", 1024, 16, 6, 64), ("v2w8-s3", 256, 4, 12, 64),
    ("v2w8-s4", 64, 1, 24, 64),
    ("v2w16-s1", 1024, 16, 3, 256), ("v2w16-s2", 256, 4, 6, 256), ("v2w16-s3", 64, 1, 12, 256),
]
QUICK = ("swinT-s1", "swinT-s2", "swinT-s3", "swinT-s4", "v2w8-s1", "v2w16-s1")
HEAD_DIM = 32
BASELINES = ("timm-sdpa", "timm-math")


def shifted_mask(nW: int, N: int, device) -> torch.Tensor:
    """timm's shifted-window mask for a side of √nW windows of √N×√N tokens, shift √N // 2."""
    ws = int(math.isqrt(N))
    side = int(math.isqrt(nW)) * ws
    img = torch.zeros(1, side, side, 1)
    cnt = 0
    sl = (slice(0, -ws), slice(-ws, -ws // 2), slice(-ws // 2, None))
    for h in sl:
        for w in sl:
            img[:, h, w, :] = cnt
            cnt += 1
    win = img.view(1, side // ws, ws, side // ws, ws, 1).permute(0, 1, 3, 2, 4, 5).reshape(-1, N)
    m = win.unsqueeze(1) - win.unsqueeze(2)
    return m.masked_fill(m != 0, -100.0).masked_fill(m == 0, 0.0).to(device)


DEVICE = "cuda"


def make_inputs(BW, nW, H, N, dtype, grad, seed=0):
    """qkv [B·nW, N, 3, H, d] (as timm's qkv projection gives it), bias [H, N, N], mask [nW, N, N] or None."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = torch.randn(BW, N, 3, H, HEAD_DIM, device=DEVICE, dtype=dtype, generator=g).requires_grad_(grad)
    bias = (torch.randn(H, N, N, device=DEVICE, generator=g) * 0.5).requires_grad_(grad)
    mask = shifted_mask(nW, N, DEVICE) if nW > 1 else None
    return qkv, bias, mask


def timm_sdpa(q, k, v, bias, mask, dtype):
    """timm WindowAttention, fused_attn=True: the mask is expanded to [B·nW, H, N, N] and added."""
    BW, H, N, _ = q.shape
    attn_mask = bias.unsqueeze(0).to(dtype)
    if mask is not None:
        nW = mask.shape[0]
        m = mask.view(1, nW, 1, N, N).expand(BW // nW, -1, H, -1, -1)
        attn_mask = attn_mask + m.reshape(-1, H, N, N).to(dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def timm_math(q, k, v, bias, mask, dtype):
    """timm WindowAttention, fused_attn=False."""
    BW, H, N, D = q.shape
    attn = (q * D ** -0.5) @ k.transpose(-2, -1)
    attn = attn + bias.unsqueeze(0).to(dtype)
    if mask is not None:
        nW = mask.shape[0]
        attn = attn.view(-1, nW, H, N, N) + mask.unsqueeze(1).unsqueeze(0).to(dtype)
        attn = attn.view(-1, H, N, N)
    return attn.softmax(-1) @ v


def elsa_generic(q, k, v, bias, mask, dtype):
    BW, H, N, _ = q.shape
    b = bias.unsqueeze(0)
    if mask is not None:
        nW = mask.shape[0]
        b = b + mask.view(1, nW, 1, N, N).expand(BW // nW, -1, H, -1, -1).reshape(-1, H, N, N)
    return elsa_vision.attention(q, k, v, bias=b)


def elsa_window(block):
    def f(q, k, v, bias, mask, dtype):
        return elsa_vision.window_attention(q, k, v, bias=bias, mask=mask, block=block, backend="triton")
    return f


def elsa_packed(block):
    """elsa_vision.window_attention_packed on the qkv leaf itself (what the Swin v1 adapter calls):
    the gradient of qkv comes out of the kernels in one piece, not as three view gradients stacked."""
    def f(qkv, bias, mask, dtype):
        return elsa_vision.window_attention_packed(qkv, bias=bias, mask=mask, block=block, backend="triton")
    f.packed = True
    return f


def elsa_tuned(**knobs):
    """elsa (auto) with the window kernels' tuning switches (kernels/tiles.py, and the table
    padding threshold of kernels/window.py) set (see --tune): ``f.switches`` is a context manager
    that the timing wraps around the whole call, its backward included (the backward plans its
    launches when it runs). Caches are cleared on entering and leaving it, so a tuned variant's
    eager time includes planning its launches afresh every call: compare tuned variants by their
    CUDA-graph replays (graph_ms)."""
    from elsa_vision.kernels import tiles as T, window as W
    where = {n: (T if hasattr(T, n) else W) for n in knobs}

    @contextlib.contextmanager
    def switches():
        old = {n: getattr(where[n], n) for n in knobs}
        for n, val in knobs.items():
            setattr(where[n], n, val)
        elsa_vision.clear_caches()
        try:
            yield
        finally:
            for n, val in old.items():
                setattr(where[n], n, val)
            elsa_vision.clear_caches()

    f = elsa_window("auto")  # (a function of its own: it takes the attribute)
    f.switches = switches
    return f


TUNE = {
    "pps2": dict(FWD_PROGRAMS_PER_SM=2, BWD_PROGRAMS_PER_SM=2),
    "pps4": dict(FWD_PROGRAMS_PER_SM=4, BWD_PROGRAMS_PER_SM=4),
    "pps16": dict(FWD_PROGRAMS_PER_SM=16, BWD_PROGRAMS_PER_SM=8),
    "pps64": dict(FWD_PROGRAMS_PER_SM=64, BWD_PROGRAMS_PER_SM=16),
    "bwd4": dict(BWD_PROGRAMS_PER_SM=4),
    "bias-regs": dict(BIAS_IN_REGISTERS=True),
    "stages1": dict(STAGES=1),
    "stages3": dict(STAGES=3),
    "pad": dict(PAD_TABLES_FROM=0),           # bias / mask tables always padded (vectorised loads)
    "nopad": dict(PAD_TABLES_FROM=1 << 40),   # half precision never: in place at row stride N
}


def variants(sweep: bool, generic: bool):
    vs = {"timm-sdpa": timm_sdpa, "timm-math": timm_math}
    if generic:
        vs["elsa-generic"] = elsa_generic
    vs["elsa"] = elsa_window("auto")
    vs["elsa-qkv"] = elsa_packed("auto")
    if sweep:
        for b in (64, 128, 256):
            vs[f"elsa-b{b}"] = elsa_window(b)
    return vs


def run_case(name, BW, nW, H, N, dtype_name, bwd, vs, rounds, profile=None, compile_mode=None, chain=1):
    """Rows of one (shape, dtype, mode): every variant timed interleaved. ``profile`` (a list): also
    one profiled call per variant, its CUDA time per kernel and the host time of the call
    (``host_ms``: wall time of the call without waiting for the GPU; above the kernels' total, the
    GPU idles between launches). ``compile_mode``: every variant's call — timm's strided q, k, v
    views included — under torch.compile(mode=…, fullgraph=True), its backward compiled with it;
    compiled in the warm-up, in a fresh dynamo state per case (no CUDA-graph replays then).
    ``chain``: each call runs the op on that many independent (qkv, bias) pairs (see --chain);
    times are per op."""
    dtype = DT[dtype_name]
    made = [make_inputs(BW, nW, H, N, dtype, bwd, seed=i) for i in range(chain)]
    qkvs, biases, mask = [m[0] for m in made], [m[1] for m in made], made[0][2]
    leaves = (*qkvs, *biases)
    grad_outs = [torch.randn(BW, H, N, HEAD_DIM, device=DEVICE, dtype=dtype) for _ in range(chain)]

    def views(fn):
        def one(qkv, bias, mask):
            if getattr(fn, "packed", False):
                return fn(qkv, bias, mask, dtype)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # timm's strided q, k, v views
            return fn(q, k, v, bias, mask, dtype)

        def f(qkvs, biases, mask):
            return [one(qkv, bias, mask) for qkv, bias in zip(qkvs, biases)]
        return torch.compile(f, mode=compile_mode, fullgraph=True) if compile_mode else f

    if compile_mode:
        torch._dynamo.reset()
    called = {n: views(fn) for n, fn in vs.items()}

    def wrap(n):
        fn = called[n]
        switches = getattr(vs[n], "switches", contextlib.nullcontext)  # (--tune: forward and backward)
        if not bwd:
            def f():
                with switches(), torch.no_grad():
                    return fn(qkvs, biases, mask)
        else:
            def f():
                with switches():
                    return torch.autograd.grad(fn(qkvs, biases, mask), leaves, grad_outs)
        return f

    res = {n: _per_op(r, chain) for n, r in measure({n: wrap(n) for n in vs}, rounds=rounds).items()}
    # the same calls replayed from CUDA graphs: GPU time without the host's launch work
    gres = {n: _per_op(r, chain) for n, r in measure_graphed({n: wrap(n) for n in vs if res[n].ms is not None},
                                                                rounds=rounds).items()} \
        if DEVICE == "cuda" and not compile_mode else {}
    if profile is not None:
        for n in vs:
            if res[n].ms is None:
                continue
            f = wrap(n)
            host = []
            for _ in range(5):
                sync()
                t = time.perf_counter()
                f()
                host.append((time.perf_counter() - t) * 1e3)
            sync()
            _, kernels = cuda_breakdown(f, top=8, device=DEVICE)  # on CPU (--smoke): operator self time
            # per op, as ms and host_ms (a kernel whose work the K ops share, such as timm's
            # expanded mask, counts a fraction of a launch)
            kernels = [{**k, "cuda_ms": k["cuda_ms"] / chain, "calls": k["calls"] / chain} if chain > 1 else k
                       for k in kernels]
            head = {"shape": name, "dtype": dtype_name, "mode": "fwd+bwd" if bwd else "fwd", "variant": n,
                    "chain": chain, "ms": res[n].ms, "host_ms": sorted(host)[2] / chain}
            profile += [{**head, **k} for k in kernels] or [head]
            print(f"  profile {n}: {res[n].ms:.3f} ms, host {head['host_ms']:.3f} ms; "
                  + ", ".join(f"{k['kernel'][:40]} {k['cuda_ms']:.3f}" for k in kernels[:5]), flush=True)
    base = [res[b] for b in BASELINES if res[b].ms is not None]
    best = min(base, key=lambda r: r.ms) if base else None
    gbase = [gres[b] for b in BASELINES if b in gres and gres[b].ms is not None]
    gbest = min(gbase, key=lambda r: r.ms) if gbase else None
    rows = []
    for n, r in res.items():
        rows.append({
            "shape": name, "BW": BW, "nW": nW, "H": H, "N": N, "d": HEAD_DIM, "dtype": dtype_name,
            "mode": "fwd+bwd" if bwd else "fwd", "variant": n, "block": n.split("-b")[-1] if "-b" in n else "",
            "chain": chain, "ms": r.ms, "peak_mib": None if r.peak_bytes is None else r.peak_bytes / 2**20,
            "best_timm": best.variant if best else "",
            "speedup": (best.ms / r.ms) if (best and r.ms) else None,
            "mem_ratio": (r.peak_bytes / best.peak_bytes) if (best and r.peak_bytes and best.peak_bytes) else None,
            "graph_ms": gres[n].ms if n in gres else None,
            "graph_best_timm": gbest.variant if gbest else "",
            "graph_speedup": (gbest.ms / gres[n].ms) if (gbest and n in gres and gres[n].ms) else None,
            "error": r.error or (gres[n].error if n in gres else ""),
        })
    del made, qkvs, biases, mask
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def _per_op(r, chain: int):
    """A measurement of calls that each ran ``chain`` ops, as the time of one op (peak memory and
    errors as measured: the call's)."""
    return r if chain == 1 or r.ms is None else dataclasses.replace(r, ms=r.ms / chain)


# Swin-T at 224² (stage, resolution, dim, heads, shift): one block per stage, batch 64
BLOCKS = [("swinT-s1", 56, 96, 3, 3), ("swinT-s2", 28, 192, 6, 3), ("swinT-s3", 14, 384, 12, 3),
          ("swinT-s4", 7, 768, 24, 0)]
BLOCK_BATCH = 64
BLOCK_BASELINES = ("timm-sdpa", "timm-math")


def run_block_case(name, res, dim, heads, shift, dtype_name, bwd, rounds):
    """Rows of one Swin block's _attn (see the module docstring, --blocks), variants interleaved."""
    import copy
    from timm.models.swin_transformer import SwinTransformerBlock
    torch.manual_seed(0)
    blk = SwinTransformerBlock(dim, (res, res), num_heads=heads, window_size=7, shift_size=shift).to(DEVICE)
    blocks = {"timm-sdpa": blk, "timm-math": copy.deepcopy(blk), "elsa-window": copy.deepcopy(blk),
              "elsa-block": copy.deepcopy(blk)}
    blocks["timm-sdpa"].attn.fused_attn = True
    blocks["timm-math"].attn.fused_attn = False
    elsa_vision.patch(blocks["elsa-window"], fuse_windows=False)
    elsa_vision.patch(blocks["elsa-block"])
    amp = dtype_name == "bf16"
    x = torch.randn(BLOCK_BATCH, res, res, dim, device=DEVICE, requires_grad=bwd)
    grad_out = torch.randn(BLOCK_BATCH, res, res, dim, device=DEVICE)

    def wrap(b):
        leaves = [x] + [p for p in b.attn.parameters() if p.requires_grad]

        def f():
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=amp), torch.set_grad_enabled(bwd):
                out = b._attn(x)
            if bwd:
                return torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
            return out
        return f
    fns = {n: wrap(b) for n, b in blocks.items()}
    res_e = measure(fns, rounds=rounds)
    res_g = measure_graphed({n: f for n, f in fns.items() if res_e[n].ms is not None}, rounds=rounds) \
        if DEVICE == "cuda" else {}
    best = min((res_e[b] for b in BLOCK_BASELINES if res_e[b].ms), key=lambda r: r.ms, default=None)
    gbest = min((res_g[b] for b in BLOCK_BASELINES if b in res_g and res_g[b].ms), key=lambda r: r.ms, default=None)
    rows = []
    for n, r in res_e.items():
        g = res_g.get(n)
        rows.append({
            "shape": name, "res": res, "C": dim, "H": heads, "shift": shift, "batch": BLOCK_BATCH, "dtype": dtype_name,
            "mode": "fwd+bwd" if bwd else "fwd", "variant": n, "ms": r.ms,
            "peak_mib": None if r.peak_bytes is None else r.peak_bytes / 2**20,
            "best_timm": best.variant if best else "",
            "speedup": (best.ms / r.ms) if (best and r.ms) else None,
            "mem_ratio": (r.peak_bytes / best.peak_bytes) if (best and r.peak_bytes and best.peak_bytes) else None,
            "graph_ms": g.ms if g else None, "graph_best_timm": gbest.variant if gbest else "",
            "graph_speedup": (gbest.ms / g.ms) if (gbest and g and g.ms) else None,
            "error": r.error or (g.error if g else ""),
        })
    delegated = sum(s.delegated for b in blocks.values() for _, s in patched_modules(b))
    assert delegated == 0, "a patched block delegated to timm's _attn: the benchmark would not measure ELSA"
    return rows


def plot(rows, path):
    """Per dtype × mode: speedup vs timm's better path (eager; CUDA-graph replay when measured) and
    peak-memory ratio, log scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(dt, m) for dt in ("fp32", "bf16") for m in ("fwd", "fwd+bwd")]
    panels = [p for p in panels if any(r["dtype"] == p[0] and r["mode"] == p[1] for r in rows)]
    cols = [("speedup", "speedup vs best timm (eager)", (1.0, 1.5, 3.0))]
    if any(r.get("graph_speedup") for r in rows):
        cols.append(("graph_speedup", "speedup, CUDA-graph replay", (1.0, 1.5, 3.0)))
    cols.append(("mem_ratio", "peak memory / best timm", (1.0,)))
    fig, axes = plt.subplots(len(panels), len(cols), figsize=(9 * len(cols), 3.4 * len(panels)), squeeze=False)
    names = [v for v in dict.fromkeys(r["variant"] for r in rows) if v not in BASELINES]
    for row_axes, (dt, mode) in zip(axes, panels):
        sub = [r for r in rows if r["dtype"] == dt and r["mode"] == mode]
        shapes = list(dict.fromkeys(r["shape"] for r in sub))
        width = 0.8 / max(1, len(names))
        for ax, (key, label, lines) in zip(row_axes, cols):
            for i, n in enumerate(names):
                ys = [next((r[key] for r in sub if r["shape"] == s and r["variant"] == n), None) for s in shapes]
                ax.bar([x + i * width for x in range(len(shapes))], [y or 0 for y in ys], width, label=n)
            for y, style in zip(lines, ("-", "--", ":")):
                ax.axhline(y, color="k" if y == 1 else "r", lw=0.8, ls=style)
            ax.set_yscale("log")
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes, fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(f"{dt} {mode}")
        row_axes[0].legend(fontsize=7, ncol=len(names))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the Swin-T stages and two SwinV2 shapes, no block sweep, fewer rounds")
    ap.add_argument("--shapes", help="comma-separated shape names (see SHAPES)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--no-fwd", action="store_true", help="forward+backward only")
    ap.add_argument("--no-generic", action="store_true", help="skip elsa_vision.attention on the expanded mask")
    ap.add_argument("--out", help="results folder (default benchmarks/results/<device>)")
    ap.add_argument("--tune", nargs="?", const="all", metavar="SWITCHES",
                    help="also run elsa with kernels/window.py's tuning switches varied (programs per SM, "
                         "bias in registers, pipeline stages, table padding): all, or a comma-separated "
                         f"subset of {','.join(TUNE)} → windows_tune.*")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one call per variant: CUDA time per kernel and host time → <stem>_profile.csv")
    ap.add_argument("--blocks", action="store_true",
                    help="time the Swin-T blocks' whole _attn instead (shift + windows + attention; see above)")
    ap.add_argument("--smoke", action="store_true",
                    help="check this script on CPU (TRITON_INTERPRET=1): one window per image, one head, 1 round")
    ap.add_argument("--compile", choices=["default", "reduce-overhead", "max-autotune"],
                    help="every variant's call under torch.compile in this mode (fullgraph, backward included) "
                         "→ <stem>_compile_<mode>.*")
    ap.add_argument("--chain", type=int, default=1, metavar="K",
                    help="each timed call runs the op on K independent inputs (K blocks of a stage); times per "
                         "op; compiled, one graph of K ops (see above) → <stem>_chain<K>.*")
    a = ap.parse_args(argv)
    if a.chain < 1:
        ap.error(f"--chain must be at least 1, got {a.chain}")
    if a.chain > 1 and (a.blocks or a.tune):
        ap.error("--chain repeats the attention calls; not with --blocks or --tune")
    if a.compile and (a.blocks or a.tune):
        ap.error("--compile times the attention calls; not with --blocks or --tune")
    if a.no_bwd and a.no_fwd:
        ap.error("--no-fwd and --no-bwd leave nothing to time")
    global DEVICE
    if a.smoke:
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            ap.error("--smoke runs ELSA's kernels on the CPU through Triton's interpreter: set TRITON_INTERPRET=1")
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks/windows.py needs a CUDA GPU (or --smoke on CPU with TRITON_INTERPRET=1)")
    torch.backends.cuda.matmul.allow_tf32 = False  # timm's fp32 matmuls in IEEE float32 (torch default)
    names = a.shapes.split(",") if a.shapes else (QUICK if a.quick else [s[0] for s in SHAPES])
    unknown = sorted(set(names) - {s[0] for s in SHAPES})
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; choose from {[s[0] for s in SHAPES]}")
    bad = sorted(set(a.dtypes.split(",")) - set(DT))
    if bad:
        ap.error(f"--dtypes: unknown {bad}; choose from {list(DT)}")
    shapes = [s for s in SHAPES if s[0] in names]
    if a.smoke:
        shapes = [(n, nW, nW, 1, N) for n, _, nW, _, N in shapes]
    vs = variants(sweep=not (a.quick or a.tune), generic=not (a.quick or a.no_generic or a.tune))
    if a.tune:
        names = list(TUNE) if a.tune == "all" else a.tune.split(",")
        unknown = sorted(set(names) - set(TUNE))
        if unknown:
            ap.error(f"--tune: unknown switch(es) {unknown}; choose from {list(TUNE)}")
        vs.update({f"elsa-{n}": elsa_tuned(**TUNE[n]) for n in names})
    rounds = 1 if a.smoke else 5 if a.quick else 15
    if a.blocks:
        return run_blocks(a, rounds)
    rows, prof = [], ([] if a.profile else None)
    for dtype_name in a.dtypes.split(","):
        for bwd in [m for m in (False, True) if not (a.no_bwd and m or a.no_fwd and not m)]:
            for name, BW, nW, H, N in shapes:
                rows += run_case(name, BW, nW, H, N, dtype_name, bwd, vs, rounds, prof, a.compile, a.chain)
                done = [r for r in rows if r["shape"] == name and r["dtype"] == dtype_name and r["mode"] == ("fwd+bwd" if bwd else "fwd")]
                print(fmt_table(done, ["shape", "dtype", "mode", "variant", "ms", "peak_mib", "speedup", "mem_ratio", "graph_ms",
                                       "graph_speedup", "error"]), flush=True)
    outdir = Path(a.out) if a.out else results_dir()
    if a.smoke and not a.out:
        outdir = Path("/tmp/elsa_windows_smoke")
    stem = "windows_tune" if a.tune else "windows_quick" if a.quick else "windows"
    if a.compile:
        stem += f"_compile_{a.compile.replace('-', '_')}"
    if a.chain > 1:
        stem += f"_chain{a.chain}"
    csv = write_csv(rows, outdir / f"{stem}.csv")
    plot(rows, outdir / f"{stem}.png")
    print(f"\nwrote {csv} and {outdir / (stem + '.png')}")
    if prof:
        print(f"wrote {write_csv(prof, outdir / (stem + '_profile.csv'))}")
    elsa = [r for r in rows if r["variant"] in ("elsa", "elsa-qkv") and r["shape"].startswith("swinT")]
    if elsa:
        print("\nSwin-T stages, elsa (auto) vs best timm path (floor: fwd+bwd speedup ≥ 1.5, mem_ratio < 1):")
        print(fmt_table(elsa, ["shape", "dtype", "mode", "variant", "ms", "best_timm", "speedup", "mem_ratio",
                               "graph_ms", "graph_best_timm", "graph_speedup"]))


def run_blocks(a, rounds):
    rows = []
    stages = BLOCKS if not a.shapes else [b for b in BLOCKS if b[0] in a.shapes.split(",")]
    if a.smoke:  # the interpreter: one small block
        stages = [("smoke", 14, 32, 1, 3)]
        global BLOCK_BATCH
        BLOCK_BATCH = 1
    for dtype_name in a.dtypes.split(","):
        for bwd in [m for m in (False, True) if not (a.no_bwd and m or a.no_fwd and not m)]:
            for stage in stages:
                done = run_block_case(*stage, dtype_name, bwd, rounds)
                rows += done
                print(fmt_table(done, ["shape", "dtype", "mode", "variant", "ms", "peak_mib", "speedup", "mem_ratio",
                                       "graph_ms", "graph_speedup", "error"]), flush=True)
    outdir = Path(a.out) if a.out else (Path("/tmp/elsa_windows_smoke") if a.smoke else results_dir())
    csv = write_csv(rows, outdir / "windows_blocks.csv")
    plot(rows, outdir / "windows_blocks.png")
    print(f"\nwrote {csv} and {outdir / 'windows_blocks.png'}")


if __name__ == "__main__":
    main()
