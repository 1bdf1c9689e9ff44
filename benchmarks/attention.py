"""Attention benchmark: ELSA vs PyTorch SDPA backends, forward and forward+backward, same process.

    python benchmarks/attention.py              # full sweep → benchmarks/results/<device>/attention.{csv,png}
    python benchmarks/attention.py --quick      # N 4K/16K, d 64
    python benchmarks/attention.py --hopper     # Gluon (sm_90) vs portable forward and backward vs cuDNN/flash,
                                                # bf16 → attention_hopper.{csv,png} (kernels/hopper.py's policies;
                                                # --dtype fp32: fp16x3 vs mem-efficient → attention_hopper_fp32)
    python benchmarks/attention.py --decode     # few queries against long keys (KV-cache shapes)
                                                # → attention_decode.{csv,png}
    python benchmarks/attention.py --host-phases  # where an eager call's host time goes (ViT / VGGT
                                                # short rows, bf16, packed qkv vs SDPA) → host_phases.{csv,png}
    python benchmarks/attention.py --tune fwd   # tile-shape sweep for the kernel config tables
                                                # (bwd: the dQ tile; bwdkv: the dK/dV kernel's own;
                                                # fewq: split-forward tiles and partitions for Nq ≤ 64)

TF/s counts 4·Nq·Nk·d·H·B FLOPs for a forward (2 matmuls) and 3.5× that for forward+backward.
Error: max |out − float64 oracle| over a sample of query rows (all keys); for forward+backward,
max |grad − oracle| / max |oracle| over dq, dk, dv of one head (up to 16K tokens). Peak memory: bytes
allocated above the inputs during one call. Ratios (``speedup_vs_*``): baseline time / ELSA time (> 1 = ELSA faster).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import (fmt_table, measure, measure_graphed, metadata, native_ready,  # noqa: E402
                                results_dir, save, style_axes, write_csv)

import elsa_vision  # noqa: E402
from elsa_vision import verify  # noqa: E402
from elsa_vision.kernels import attention as K  # noqa: E402

SDPA = {"math": SDPBackend.MATH, "mem_efficient": SDPBackend.EFFICIENT_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def modes(dtype: str):
    """(label, elsa precision) per dtype, and the SDPA baselines that run that dtype."""
    if dtype == "fp32":
        return [("elsa-ieee", "ieee"), ("elsa-tf32x3", "tf32x3"), ("elsa-fp16x3", "fp16x3"), ("elsa-tf32", "tf32")], \
            ["math", "mem_efficient"]
    return [("elsa", "auto")], ["math", "mem_efficient", "flash", "cudnn"]


def make(B, H, nq, nk, d, dtype, grad, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = [torch.randn(B, H, n, d, device="cuda", dtype=dtype, generator=g).requires_grad_(grad) for n in (nq, nk, nk)]
    return t


def sdpa_fn(name, q, k, v, causal):
    def f():
        with sdpa_kernel(SDPA[name]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return f


def sample_error(out, q, k, v, causal, rows=64):
    """max |out − oracle| on `rows` query rows spread over Nq (oracle in float64 on those rows only)."""
    nq = q.shape[2]
    idx = torch.linspace(0, nq - 1, min(rows, nq), device=q.device).long()
    qs = q.detach()[:, :, idx].double()
    s = torch.matmul(qs, k.detach().double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        j = torch.arange(k.shape[2], device=q.device)
        s = s.masked_fill(j[None, :] > idx[:, None] + (k.shape[2] - nq), float("-inf"))
    ref = torch.matmul(torch.softmax(s, -1), v.detach().double())
    return (out.detach()[:, :, idx].double() - ref).abs().max().item()


def grad_error(grads, q, k, v, do, causal):
    """max over dq, dk, dv of max |grad − oracle| / max |oracle|, on batch 0, head 0 (heads are
    independent; the float64 oracle of one head at 16K tokens holds a few 2 GiB matrices)."""
    ins = [t.detach()[:1, :1].double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(verify.oracle(*ins, causal=causal), ins, do[:1, :1].double())
    return max(((g.detach()[:1, :1].double() - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, ref))


def run_case(B, H, nq, nk, d, dtype_name, bwd, causal=False, budget_ms=1500, partitions=None, tag="", skip=()):
    dtype = DT[dtype_name]
    q, k, v = make(B, H, nq, nk, d, dtype, bwd)
    g = torch.Generator(device="cuda").manual_seed(1)  # seeded: gradient errors comparable across runs
    do = torch.randn(B, H, nq, d, device="cuda", dtype=dtype, generator=g) if bwd else None
    elsa_modes, base = modes(dtype_name)
    elsa_modes = [m for m in elsa_modes if m[0] not in skip]
    base = [b for b in base if f"sdpa-{b}" not in skip]
    fns = {}
    for label, prec in elsa_modes:
        def f(prec=prec, label=label):
            o = elsa_vision.attention(q, k, v, causal=causal, precision=prec, partitions=partitions)
            if bwd:
                return o, torch.autograd.grad(o, (q, k, v), do)
            return o
        fns[label] = f
    for name in base:
        sf = sdpa_fn(name, q, k, v, causal)
        def g(sf=sf):
            o = sf()
            if bwd:
                return o, torch.autograd.grad(o, (q, k, v), do)
            return o
        fns[f"sdpa-{name}"] = g
    # error vs float64 (forward: sampled rows; backward: one head's gradients up to 16K×16K; one call
    # each, outside the timing)
    errs = {}
    if not bwd or nq * nk <= 2**28:
        for label, fn in fns.items():
            try:
                errs[label] = grad_error(fn()[1], q, k, v, do, causal) if bwd else sample_error(fn(), q, k, v, causal)
            except Exception:  # noqa: BLE001 - the failure is reported by measure below
                errs[label] = None
            torch.cuda.empty_cache()
    big = nq * nk * B * H > 2**34  # one call takes a second or more: fewer warm-ups
    res = measure(fns, budget_ms=budget_ms, warmup=1 if big else 3)
    flops = 4.0 * B * H * nq * nk * d * (0.5 if causal and nq == nk else 1.0) * (3.5 if bwd else 1.0)
    rows = []
    for label, r in res.items():
        rows.append({
            "case": tag or "sweep", "pass": "fwd+bwd" if bwd else "fwd", "dtype": dtype_name, "B": B, "H": H,
            "Nq": nq, "Nk": nk, "d": d, "causal": causal, "variant": label,
            "ms": r.ms, "tflops": (flops / r.ms / 1e9) if r.ms else None,
            "peak_mib": (r.peak_bytes / 2**20) if r.peak_bytes is not None else None,
            "max_err_vs_fp64": None if bwd else errs.get(label),
            "grad_rel_err_vs_fp64": errs.get(label) if bwd else None, "error": r.error,
        })
    # ratios vs each baseline
    base_ms = {r["variant"]: r["ms"] for r in rows if r["variant"].startswith("sdpa-") and r["ms"]}
    for r in rows:
        if r["variant"].startswith("elsa") and r["ms"]:
            for bname, bms in base_ms.items():
                r[f"speedup_vs_{bname[5:]}"] = bms / r["ms"]
    del q, k, v, do, fns
    torch.cuda.empty_cache()
    return rows


def few_queries(d=64, nq=16, nk=131072, H=16):
    """Nq ≪ Nk: balanced key split (auto) against one partition."""
    q, k, v = make(1, H, nq, nk, d, torch.float32, False)
    rows = []
    for dt_name in ("fp32", "bf16"):
        dt = DT[dt_name]
        qq, kk, vv = q.to(dt), k.to(dt), v.to(dt)
        prec = "tf32x3" if dt_name == "fp32" else "auto"
        fns = {"elsa-split(auto)": lambda: elsa_vision.attention(qq, kk, vv, precision=prec),
               "elsa-1-partition": lambda: elsa_vision.attention(qq, kk, vv, precision=prec, partitions=1),
               "sdpa-mem_efficient": sdpa_fn("mem_efficient", qq, kk, vv, False)}
        if dt_name != "fp32":
            fns["sdpa-flash"] = sdpa_fn("flash", qq, kk, vv, False)
        res = measure(fns, budget_ms=500)
        info = {}
        K.forward(qq, kk, vv, None, 1 / math.sqrt(d), False, elsa_vision.resolve_precision(prec, dt), summaries=info)
        one = res["elsa-1-partition"].ms
        for label, r in res.items():
            rows.append({"case": "few_queries", "pass": "fwd", "dtype": dt_name, "B": 1, "H": H, "Nq": nq, "Nk": nk,
                         "d": d, "variant": label, "ms": r.ms, "peak_mib": (r.peak_bytes or 0) / 2**20,
                         "partitions": info["n_part"] if "auto" in label else 1,
                         "speedup_vs_1_partition": (one / r.ms) if r.ms and one else None, "error": r.error})
    return rows


def decode_sweep(nqs=(16, 1041, 4 * 1041), dtypes=("bf16", "fp32")) -> list[dict]:
    """Streaming shapes: Nq ∈ {16, one 1041-token frame, four frames} against Nk up to a million
    keys (a KV cache of ~1000 frames), bf16 and fp32, forward. Half-precision rows are measured twice:
    eager calls (case "decode": the host's work in each call's time) and CUDA-graph replays (case
    "decode-graphed": the kernels alone, as a captured decode step runs them)."""
    rows = []
    for nq, nk in itertools.product(nqs, (131072, 416400, 1041000)):
        for dtn in dtypes:
            skip = ("sdpa-math", "elsa-ieee", "elsa-tf32") if dtn == "fp32" else ("sdpa-math",)
            new = run_case(1, 16, nq, nk, 64, dtn, False, budget_ms=800, tag="decode", skip=skip)
            if dtn != "fp32":
                new += graphed_case(nq, nk, dtn)
            rows += new
            print(fmt_table(new, ["case", "dtype", "Nq", "Nk", "variant", "ms", "tflops", "max_err_vs_fp64"]), flush=True)
    return rows


def graphed_case(nq, nk, dtn, d=64, H=16) -> list[dict]:
    """CUDA-graph replays of ELSA, flash and cuDNN at one decode shape (case "decode-graphed")."""
    q, k, v = make(1, H, nq, nk, d, DT[dtn], False)
    fns = {"elsa": lambda: elsa_vision.attention(q, k, v)}
    fns.update({f"sdpa-{b}": sdpa_fn(b, q, k, v, False) for b in ("flash", "cudnn")})
    res = measure_graphed(fns, rounds=20)
    flops = 4.0 * H * nq * nk * d
    rows = [{"case": "decode-graphed", "pass": "fwd", "dtype": dtn, "B": 1, "H": H, "Nq": nq, "Nk": nk, "d": d,
             "causal": False, "variant": n, "ms": r.ms, "tflops": flops / r.ms / 1e9 if r.ms else None,
             "error": r.error} for n, r in res.items()]
    base = {r["variant"]: r["ms"] for r in rows if r["variant"].startswith("sdpa-") and r["ms"]}
    for r in rows:
        if r["variant"] == "elsa" and r["ms"]:
            r.update({f"speedup_vs_{b[5:]}": ms / r["ms"] for b, ms in base.items()})
    del q, k, v, fns
    torch.cuda.empty_cache()
    return rows


def plot_decode(rows, path):
    """Per dtype: the fastest SDPA backend's time over ELSA's (its fastest mode) against Nk, a line per Nq
    (dashed: CUDA-graph replays)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, dtn in zip(axes, ("bf16", "fp32")):
        for (nq, kind), color in zip(itertools.product(sorted({r["Nq"] for r in rows}), ("decode", "decode-graphed")),
                                     itertools.cycle(("C0", "C0", "C1", "C1", "C2", "C2"))):
            pts = []
            for nk in sorted({r["Nk"] for r in rows}):
                case = [r for r in rows if r["dtype"] == dtn and r["Nq"] == nq and r["Nk"] == nk and r["ms"]
                        and r.get("case", "decode") == kind]
                elsa = [r["ms"] for r in case if r["variant"].startswith("elsa")]
                base = [r["ms"] for r in case if r["variant"].startswith("sdpa")]
                if elsa and base:
                    pts.append((nk, min(base) / min(elsa)))
            if pts:
                ax.plot(*zip(*pts), marker="o", color=color, ls="--" if kind != "decode" else "-",
                        label=f"Nq = {nq}" + (" (graphed)" if kind != "decode" else ""))
        ax.axhline(1.0, color="gray", lw=0.8)
        style_axes(ax, "keys (Nk)", "fastest SDPA time / ELSA time", f"decode shapes, {dtn}, H=16, d=64", ylog=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# Tile shapes tried by --tune: (block_m, block_n, num_warps, num_stages) per (pass, dtype, precision, d).
# Kept short: each candidate is a separate compile.
CANDIDATES = {
    ("fwd", "bf16", "native", 64): [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 2), (64, 128, 4, 3), (128, 32, 4, 4)],
    ("fwd", "bf16", "native", 128): [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 2)],
    ("fwd", "bf16", "native", 32): [(128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3)],
    ("fwd", "fp32", "tf32x3", 64): [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 4)],
    ("fwd", "fp32", "tf32x3", 128): [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2)],
    ("fwd", "fp32", "tf32x3", 32): [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3)],
    ("fwd", "fp32", "fp16x3", 64): [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3),
                                    (128, 64, 8, 2), (128, 32, 8, 4)],
    ("fwd", "fp32", "fp16x3", 128): [(128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 3)],
    ("fwd", "fp32", "fp16x3", 32): [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2)],
    # a fifth entry False turns off the Kahan compensation of the strict-fp32 running sums; a sixth
    # folds the keys a chunk at a time (Config.chunk), the other way to bound that rounding
    ("fwd", "fp32", "ieee", 64): [(64, 64, 4, 2), (64, 64, 4, 2, False), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2),
                                  (64, 64, 8, 2), (32, 64, 2, 2), (64, 64, 4, 2, False, 2048),
                                  (64, 64, 4, 2, False, 1024), (32, 64, 4, 2, False, 2048)],
    ("fwd", "fp32", "ieee", 128): [(64, 32, 4, 2), (32, 64, 4, 2), (32, 32, 4, 2), (32, 64, 4, 2, False)],
    ("fwd", "fp32", "tf32", 64): [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3)],
    ("bwd", "bf16", "native", 64): [(64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
                                   (128, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 1), (64, 32, 4, 3)],
    ("bwd", "bf16", "native", 128): [(64, 64, 8, 2), (64, 32, 4, 2), (128, 64, 8, 2)],
    ("bwd", "fp32", "tf32x3", 64): [(64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2),
                                     (64, 128, 8, 2), (128, 32, 8, 2), (64, 64, 4, 1)],
    ("bwd", "fp32", "tf32x3", 128): [(32, 32, 4, 1), (64, 32, 4, 2), (64, 64, 8, 2)],
    ("bwd", "fp32", "fp16x3", 64): [(128, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 2),
                                     (64, 32, 4, 2), (128, 128, 8, 2)],
    ("bwd", "fp32", "fp16x3", 128): [(64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2)],
    # the dK/dV kernel alone (the dQ kernel keeps bwd_config's tile): (query rows, keys, warps, stages)
    ("bwdkv", "bf16", "native", 64): [(32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 4, 4), (64, 128, 8, 3), (64, 128, 4, 2),
                                      (16, 128, 4, 4), (64, 64, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2)],
    ("bwdkv", "bf16", "native", 128): [(32, 64, 4, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 128, 4, 2), (64, 128, 8, 2),
                                       (16, 128, 8, 3)],
    ("bwdkv", "fp32", "tf32x3", 64): [(64, 128, 8, 2), (32, 128, 4, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2),
                                      (64, 128, 8, 1), (16, 128, 8, 2)],
    ("bwdkv", "fp32", "fp16x3", 64): [(64, 128, 8, 2), (32, 128, 4, 2), (32, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3),
                                      (64, 64, 4, 2), (32, 64, 4, 3)],
    ("bwdkv", "fp32", "fp16x3", 128): [(32, 64, 4, 2), (32, 128, 8, 2), (64, 64, 4, 2), (64, 128, 8, 2), (16, 128, 8, 2)],
}


def tune(kinds=("fwd", "bwd"), N=16384, only=None):
    """Time the CANDIDATES tile shapes at N tokens (B=1, H=16) and print the best per entry."""
    out = []
    for (kind, dtn, prec, d), cands in CANDIDATES.items():
        if kind not in kinds or (only and only not in (dtn, prec)):
            continue
        q, k, v = make(1, 16, N, N, d, DT[dtn], False)
        fns = {}
        for cand in cands:
            cfg = K.Config(*cand)
            name = "{}x{}w{}s{}".format(*cand) + ("" if cfg.kahan else "-nokahan") + \
                (f"-chunk{cfg.chunk}" if cfg.chunk else "")
            if kind == "fwd":
                fns[name] = lambda cfg=cfg: K.forward(q, k, v, None, d ** -0.5, False, prec, 1, config=cfg)
            else:
                o, stats = K.forward(q, k, v, None, d ** -0.5, False, prec, 1)
                do = torch.randn_like(o)
                which = {"bwd": "config", "bwdkv": "kv"}[kind]
                fns[name] = lambda cfg=cfg, o=o, stats=stats, do=do, which=which: K.backward(
                    do, q, k, v, None, o, stats, d ** -0.5, False, prec, False, **{which: cfg})
        res = measure(fns, warmup=1, rounds=5, memory=False)
        flops = 4.0 * 16 * N * N * d * (1.0 if kind == "fwd" else 2.5)
        ranked = sorted((r.ms, n) for n, r in res.items() if r.ms)
        for n, r in res.items():
            out.append({"kind": kind, "dtype": dtn, "precision": prec, "d": d, "config": n, "ms": r.ms,
                        "tflops": flops / r.ms / 1e9 if r.ms else None, "error": r.error})
        print(f"{kind} {dtn} {prec} d={d}: " + ", ".join(f"{n} {flops / ms / 1e9:.1f}" for ms, n in ranked),
              flush=True)
        del q, k, v, fns
        torch.cuda.empty_cache()
    return out


# --tune fewq: query tiles, key tiles and partition counts for a few queries against many keys
FEWQ_TILES = [(16, 64, 4, 3), (16, 128, 4, 3), (16, 256, 4, 3), (16, 128, 4, 4), (32, 128, 4, 3), (64, 64, 4, 3),
              (64, 128, 4, 3), (128, 64, 8, 3)]
FEWQ_PARTS = (None, 264, 528, 1056)


def tune_fewq(only=None) -> list[dict]:
    """Time FEWQ_TILES × FEWQ_PARTS (None: the planner's count) of the split forward at Nq ∈ {16, 64}
    and Nk ∈ {128K, 1M} (H = 16, d = 64) beside FlashAttention, each with its error against float32
    SDPA; print the best per case."""
    out = []
    for (nq, nk), (dtn, prec) in itertools.product(((16, 131072), (64, 131072), (16, 1041000)),
                                                   (("bf16", "native"), ("fp32", "tf32x3"), ("fp32", "fp16x3"))):
        if only and only not in (dtn, prec):
            continue
        q, k, v = make(1, 16, nq, nk, 64, DT[dtn], False)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        fns = {"default": lambda: K.forward(q, k, v, None, 0.125, False, prec)}
        if dtn != "fp32":
            fns["sdpa-flash"] = sdpa_fn("flash", q, k, v, False)
        for tile, parts in itertools.product(FEWQ_TILES, FEWQ_PARTS):
            if dtn == "fp32" and tile[1] > 128:
                continue
            cfg = K.Config(*tile)
            fns["{}x{}w{}s{}".format(*tile) + f"-p{parts or 'auto'}"] = (
                lambda cfg=cfg, parts=parts: K.forward(q, k, v, None, 0.125, False, prec, parts, config=cfg))
        errs = {}
        for name, fn in fns.items():
            try:
                o = fn()
                errs[name] = (o[0] if isinstance(o, tuple) else o).float().sub(ref).abs().max().item()
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
                errs[name] = repr(e)[:80]
        res = measure(fns, warmup=1, rounds=5, memory=False)
        floor = 2 * nk * 16 * 64 * q.element_size() / 1e9  # K and V read once, GB
        ranked = sorted((r.ms, n) for n, r in res.items() if r.ms)
        for n, r in res.items():
            out.append({"kind": "fewq", "dtype": dtn, "precision": prec, "Nq": nq, "Nk": nk, "config": n, "ms": r.ms,
                        "gb_per_s": floor / r.ms * 1e3 if r.ms else None, "max_err_vs_fp32": errs.get(n),
                        "error": r.error})
        print(f"fewq Nq={nq} Nk={nk} {dtn} {prec}: " + ", ".join(f"{n} {ms:.3f}" for ms, n in ranked[:6]), flush=True)
        del q, k, v, fns, ref
        torch.cuda.empty_cache()
    return out


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sweep = [r for r in rows if r["case"] == "sweep" and r["d"] == 64 and r["ms"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, pas in zip(axes, ("fwd", "fwd+bwd")):
        for (dt, var) in sorted({(r["dtype"], r["variant"]) for r in sweep if r["pass"] == pas}):
            pts = sorted((r["Nq"], r["tflops"]) for r in sweep if r["pass"] == pas and r["dtype"] == dt and r["variant"] == var)
            if pts:
                ax.plot(*zip(*pts), marker="o", ls="-" if var.startswith("elsa") else "--", label=f"{dt} {var}")
        style_axes(ax, "tokens N (B=1, H=16, d=64)", "TF/s", f"attention {pas}")
    m = metadata()
    fig.suptitle(f"ELSA vs SDPA — {m['device']}, torch {m['torch']}, triton {m['triton']}, {m['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def hopper_sweep(passes=("fwd", "fwd+bwd"), dtype: str = "bf16") -> list[dict]:
    """bf16, B·H·N² ≈ 2^25·16 per point, CUDA-graph replays, interleaved: kernels/hopper.py's Gluon
    forward (every shape it supports, its softmax overlap as ``hopper.overlaps`` chooses; and forced
    on and off, "elsa-gluon-overlap" and "elsa-gluon-plain"; up to 2048 tokens also in 64-row items
    of one warpgroup, ``hopper.SHORT_ROWS`` at d = 64 and ``SHORT_ROWS_D128`` at d = 128,
    "elsa-gluon-64rows") against the portable Triton forward, cuDNN and flash; and
    forward + backward: the Gluon forward and backward, the Gluon forward with the portable
    backward ("elsa-gluon-fwd"), the portable pair, cuDNN and flash. These rows set the policies
    of ``hopper.serves`` and ``hopper.serves_backward``. ``dtype="fp32"``: float32 in ``fp16x3`` at
    d = 64 (the same variants) against SDPA's mem-efficient backend, the fastest exact float32 one."""
    from elsa_vision.kernels import hopper
    fp32 = dtype == "fp32"
    precision = "fp16x3" if fp32 else "auto"

    def elsa(q, k, v, do, causal, fwd, bwd, overlap=None, rows64=0):
        def f():
            before = (hopper.ENABLED, hopper.EVERYWHERE, hopper.BACKWARD, hopper.OVERLAP, hopper.SHORT_ROWS,
                      hopper.SHORT_ROWS_D128)
            hopper.ENABLED, hopper.EVERYWHERE, hopper.BACKWARD, hopper.OVERLAP = fwd, fwd, bwd, overlap
            if rows64:  # (the switch of q's head dim: SHORT_ROWS also moves overlaps' threshold at D = 128)
                if q.shape[-1] <= 64:
                    hopper.SHORT_ROWS = rows64
                else:
                    hopper.SHORT_ROWS_D128 = rows64
            try:
                out = elsa_vision.attention(q, k, v, causal=causal, precision=precision)
                return out if do is None else torch.autograd.grad(out, (q, k, v), do)
            finally:
                (hopper.ENABLED, hopper.EVERYWHERE, hopper.BACKWARD, hopper.OVERLAP, hopper.SHORT_ROWS,
                 hopper.SHORT_ROWS_D128) = before
        return f

    def sdpa(name, q, k, v, do, causal):
        fwd = sdpa_fn(name, q, k, v, causal)
        return fwd if do is None else (lambda: torch.autograd.grad(fwd(), (q, k, v), do))

    rows = []
    for ps, d, causal, n in itertools.product(passes, (64,) if fp32 else (64, 128), (False, True),
                                              (197, 577, 1041, 2048, 4096, 8192, 16384)):
        bwd = ps != "fwd"
        bh = min(3072, max(16, (1 << 29) // (n * n)))
        q, k, v = make(1, bh, n, n, d, DT[dtype], bwd)
        do = torch.randn_like(q) if bwd else None
        variants = {"elsa-gluon": (True, True), "elsa-gluon-overlap": (True, True, True),
                    "elsa-gluon-plain": (True, True, False), "elsa-gluon-64rows": (True, True, None, n),
                    "elsa-gluon-fwd": (True, False), "elsa-portable": (False, False)}
        for label in ("elsa-gluon-fwd",) if not bwd else ("elsa-gluon-overlap", "elsa-gluon-plain"):
            del variants[label]
        if bwd or n > 2048 or (d <= 64 and n <= 256):  # (d = 64 rows up to 256 are 64-row items already)
            del variants["elsa-gluon-64rows"]
        fns = {label: elsa(q, k, v, do, causal, *how) for label, how in variants.items()}
        fns.update({f"sdpa-{s}": sdpa(s, q, k, v, do, causal)
                    for s in (("mem_efficient",) if fp32 else ("cudnn", "flash"))})
        if bwd:
            errs = {label: grad_error(fn(), q, k, v, do, causal) for label, fn in fns.items()}
        else:
            errs = {label: sample_error(fn(), q, k, v, causal) for label, fn in fns.items()}
        res = measure_graphed(fns, rounds=10)
        flops = 4.0 * bh * n * n * d * (0.5 if causal else 1.0) * (3.5 if bwd else 1.0)
        best = min(r.ms for label, r in res.items() if label.startswith("sdpa") and r.ms)
        for label, r in res.items():
            rows.append({"case": "hopper", "pass": ps, "dtype": dtype, "B": 1, "H": bh, "Nq": n, "Nk": n, "d": d,
                         "causal": causal, "variant": label, "ms": r.ms,
                         "tflops": flops / (r.ms * 1e-3) / 1e12 if r.ms else None,
                         "speedup_vs_best_sdpa": best / r.ms if r.ms else None,
                         ("grad_rel_err_vs_fp64" if bwd else "max_err_vs_fp64"): errs[label]})
        print(fmt_table(rows[-len(fns):], ["pass", "d", "causal", "Nq", "H", "variant", "ms", "tflops",
                                           "speedup_vs_best_sdpa",
                                           "grad_rel_err_vs_fp64" if bwd else "max_err_vs_fp64"]), flush=True)
        del q, k, v, do, fns
        torch.cuda.empty_cache()
    return rows


# (B, H, N, d, causal) of --train: ViT-B/16 at 224 px (197 tokens, 64 images × 12 heads), 577 and
# VGGT's 1041-token frames with ≥ 768 batch·heads, and the long rows of the floors
TRAIN_SHAPES = [(64, 12, 197, 64, False), (64, 12, 577, 64, False), (48, 16, 1041, 64, False),
                (1, 16, 4096, 64, False), (1, 16, 16384, 64, False), (1, 16, 4096, 128, False),
                (1, 16, 16384, 128, False), (1, 16, 16384, 64, True)]


def training_sweep(dtypes=("bf16", "fp16")) -> list[dict]:
    """Half-precision forward + backward (one ``autograd.grad``) at TRAIN_SHAPES: ELSA, cuDNN and
    flash; eager calls (each call's host work in its time) and CUDA-graph replays, interleaved;
    gradient error of one head against float64."""
    def elsa(q, k, v, do, causal):
        return lambda: torch.autograd.grad(elsa_vision.attention(q, k, v, causal=causal), (q, k, v), do)

    def sdpa(name, q, k, v, do, causal):
        fwd = sdpa_fn(name, q, k, v, causal)
        return lambda: torch.autograd.grad(fwd(), (q, k, v), do)

    rows = []
    for dtn, (B, H, n, d, causal) in itertools.product(dtypes, TRAIN_SHAPES):
        q, k, v = make(B, H, n, n, d, DT[dtn], True)
        do = torch.randn_like(q)
        fns = {"elsa": elsa(q, k, v, do, causal), "sdpa-cudnn": sdpa("cudnn", q, k, v, do, causal),
               "sdpa-flash": sdpa("flash", q, k, v, do, causal)}
        errs = {label: grad_error(fn(), q, k, v, do, causal) for label, fn in fns.items()}
        eager = measure(fns, rounds=10, memory=False)
        replay = measure_graphed(fns, rounds=10)
        flops = 4.0 * B * H * n * n * d * 3.5 * (0.5 if causal else 1.0)
        for kind, res in (("eager", eager), ("graphed", replay)):
            best = min((r.ms for label, r in res.items() if label.startswith("sdpa") and r.ms), default=None)
            for label, r in res.items():
                rows.append({"case": f"train-{kind}", "pass": "fwd+bwd", "dtype": dtn, "B": B, "H": H, "Nq": n,
                             "Nk": n, "d": d, "causal": causal, "variant": label, "ms": r.ms,
                             "tflops": flops / (r.ms * 1e-3) / 1e12 if r.ms else None,
                             "speedup_vs_best_sdpa": best / r.ms if r.ms and best else None,
                             "grad_rel_err_vs_fp64": errs[label], "error": r.error})
        print(fmt_table(rows[-6:], ["case", "dtype", "B", "H", "Nq", "d", "causal", "variant", "ms", "tflops",
                                    "speedup_vs_best_sdpa", "grad_rel_err_vs_fp64"]), flush=True)
        del q, k, v, do, fns
        torch.cuda.empty_cache()
    return rows


def plot_training(rows, path):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, kind in zip(axes, ("eager", "graphed")):
        sel = [r for r in rows if r["case"] == f"train-{kind}" and r["variant"].startswith("elsa")]
        labels = sorted({(r["B"], r["H"], r["Nq"], r["d"], r["causal"]) for r in sel}, key=lambda t: (t[3], t[2], t[4]))
        for j, dtn in enumerate(sorted({r["dtype"] for r in sel})):
            ys = [next((r["speedup_vs_best_sdpa"] for r in sel if (r["B"], r["H"], r["Nq"], r["d"], r["causal"]) == t
                        and r["dtype"] == dtn), None) or 0 for t in labels]
            ax.bar([i + 0.35 * j - 0.175 for i in range(len(labels))], ys, width=0.35, label=f"ELSA {dtn}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([f"{b}×{h}×{n}\nd{d}{' causal' if c else ''}" for b, h, n, d, c in labels], fontsize=7)
        ax.set_ylabel("best SDPA ms / ELSA ms")
        ax.set_title(f"forward + backward, {kind}")
        ax.legend(fontsize=7)
    m = metadata()
    fig.suptitle(f"ELSA vs the fastest SDPA backend — {m['device']}, torch {m['torch']}, triton {m['triton']}, {m['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_hopper(rows, path):
    import matplotlib.pyplot as plt
    passes = sorted({r["pass"] for r in rows}, key=len)
    dims = sorted({r["d"] for r in rows})
    dtype = rows[0]["dtype"]
    fig, axes = plt.subplots(len(passes), 2 * len(dims), figsize=(10 * len(dims), 4.6 * len(passes)), squeeze=False)
    for row_axes, ps in zip(axes, passes):
        for ax, (d, causal) in zip(row_axes, itertools.product(dims, (False, True))):
            for var in ("elsa-gluon", "elsa-gluon-fwd", "elsa-portable", "sdpa-cudnn", "sdpa-flash",
                        "sdpa-mem_efficient"):
                pts = sorted((r["Nq"], r["tflops"]) for r in rows if r["pass"] == ps and r["d"] == d
                             and r["causal"] == causal and r["variant"] == var and r["tflops"])
                if pts:
                    ax.plot(*zip(*pts), marker="o", ls="-" if var.startswith("elsa") else "--", label=var)
            style_axes(ax, "tokens N", "TF/s", f"{dtype} {ps}, d={d}{', causal' if causal else ''}", ylog=False)
    m = metadata()
    fig.suptitle(f"Gluon vs portable kernels — {m['device']}, torch {m['torch']}, triton {m['triton']}, {m['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# (B, H, N, d) of --host-phases: ViT-B/16 at 224 px with 4 and 64 images, VGGT's 1041-token frames
HOST_SHAPES = [(4, 12, 197, 64), (64, 12, 197, 64), (48, 16, 1041, 64)]
PHASES = ("entry", "forward_body", "return", "to_backward", "backward_body", "backward_return")


def phases(t0, f0, f1, t1, b0, b1, t2) -> dict:
    """One eager call's host time in µs by phase, from perf_counter stamps: the call's start (t0),
    the autograd Function's forward body entered and left (f0, f1), the call returned (t1), then
    ``autograd.grad`` called (t1), the backward body entered and left (b0, b1), and grad returned
    (t2)."""
    stamps = (t0, f0, f1, t1, b0, b1, t2)
    if any(b < a for a, b in zip(stamps, stamps[1:])):
        raise ValueError(f"stamps out of order: {stamps}")
    return {name: (b - a) * 1e6 for name, a, b in zip(PHASES, stamps, stamps[1:])}


@contextlib.contextmanager
def timed_bodies(function: type, stamps: dict):
    """The autograd Function ``function``'s forward and backward, each stamping ``stamps`` (f0, f1,
    b0, b1: perf_counter) as it enters and leaves its body; restored on exit."""
    forward, backward = function.forward, function.backward

    def timed(body, enter, leave):
        def run(ctx, *args):
            stamps[enter] = time.perf_counter()
            out = body(ctx, *args)
            stamps[leave] = time.perf_counter()
            return out
        return staticmethod(run)

    function.forward, function.backward = timed(forward, "f0", "f1"), timed(backward, "b0", "b1")
    try:
        yield stamps
    finally:
        function.forward, function.backward = staticmethod(forward), staticmethod(backward)


def _back_to_back(forward, qkv, do, iterations: int, record, warmup: int = 50) -> None:
    """``forward()`` then ``autograd.grad`` of its output, ``warmup`` + ``iterations`` times back to
    back (the GPU synchronised every 50 calls, so that the launch queue never fills and blocks the
    host); ``record(t0, t1, t2)`` gets each timed call's perf_counter stamps: start, forward
    returned, grad returned."""
    for i in range(warmup + iterations):
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        torch.autograd.grad(out, qkv, do)
        t2 = time.perf_counter()
        if i >= warmup:
            record(t0, t1, t2)
        if i % 50 == 0:
            torch.cuda.synchronize()


def host_phases(shapes=HOST_SHAPES, iterations: int = 500) -> list[dict]:
    """Eager forward + ``autograd.grad`` of ELSA's packed call (qkv [B, N, 3, H, D], bf16) against
    SDPA's (default backend choice) on the same projection's views: each call's host time, medians
    over ``iterations`` calls timed back to back (:func:`_back_to_back`), and the same call's GPU
    time replayed from a CUDA graph. ELSA twice: as users call it (``elsa``: replayed from C++ where
    kernels/native.py is ready) and on the Python host path (``elsa-python``, by phase: :func:`phases`);
    ``elsa`` and SDPA as two spans (forward, grad). The eager calls are paced by the host where the
    host time exceeds the GPU time."""
    from elsa_vision.kernels import native
    rows = []
    for B, H, n, d in shapes:
        qkv = torch.randn(B, n, 3, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16)
        forwards = {"elsa": lambda: elsa_vision.attention_packed(qkv),
                    "sdpa": lambda: F.scaled_dot_product_attention(*qkv.permute(2, 0, 3, 1, 4).unbind(0))}
        gpu = measure_graphed({name: (lambda f=f: torch.autograd.grad(f(), qkv, do)) for name, f in forwards.items()},
                              rounds=10)
        gpu["elsa-python"] = gpu["elsa"]  # (the same kernels)
        samples = {"elsa": [], "elsa-python": [], "sdpa": []}
        two_spans = lambda name: lambda t0, t1, t2: samples[name].append(  # noqa: E731
            {"forward": (t1 - t0) * 1e6, "grad": (t2 - t1) * 1e6})
        _back_to_back(forwards["elsa"], qkv, do, iterations, two_spans("elsa"))
        with native.python_path(), timed_bodies(K.PACKED.function, {}) as st:
            _back_to_back(forwards["elsa"], qkv, do, iterations, lambda t0, t1, t2: samples["elsa-python"].append(
                phases(t0, st["f0"], st["f1"], t1, st["b0"], st["b1"], t2)))
        _back_to_back(forwards["sdpa"], qkv, do, iterations, two_spans("sdpa"))
        for variant, got in samples.items():
            med = {f"{k}_us": statistics.median(s[k] for s in got) for k in got[0]}
            rows.append({"case": "host-phases", "dtype": "bf16", "B": B, "H": H, "Nq": n, "Nk": n, "d": d,
                         "variant": variant, **med,
                         "host_us": statistics.median(sum(s.values()) for s in got),
                         "gpu_us": gpu[variant].ms * 1e3 if gpu[variant].ms else None, "iterations": iterations})
        print(fmt_table(rows[-3:], ["B", "H", "Nq", "variant", "host_us", "gpu_us"]), flush=True)
        del qkv, do, forwards
        torch.cuda.empty_cache()
    return rows


def plot_host_phases(rows, path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.7 * len(rows)))
    labels = []
    for i, r in enumerate(rows):
        by_phase = r["variant"] == "elsa-python"
        spans = [(p, r.get(f"{p}_us")) for p in (PHASES if by_phase else ("forward", "grad"))]
        first = next(j for j, x in enumerate(rows) if x["variant"] == r["variant"]) == i
        name = {"elsa": "ELSA (native)", "elsa-python": "ELSA, Python path", "sdpa": "SDPA"}[r["variant"]]
        left = 0.0
        for j, (p, w) in enumerate(spans):
            color = f"C{j}" if by_phase else (("0.45", "0.7") if r["variant"] == "sdpa" else ("C8", "C9"))[j]
            ax.barh(i, w, left=left, color=color, label=f"{name}: {p}" if first else None)
            left += w
        if r["gpu_us"]:
            ax.plot([r["gpu_us"]] * 2, [i - 0.4, i + 0.4], color="k", lw=2,
                    label="its GPU time (CUDA-graph replay)" if i == 0 else None)
        labels.append(f"{r['variant']} {r['B']}×{r['H']}×{r['Nq']}")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xlabel("µs per eager forward + autograd.grad (median)")
    m = metadata()
    ax.set_title(f"Where an eager call's host time goes (bf16, packed qkv)\n{m['device']}, torch {m['torch']}, "
                 f"triton {m['triton']}, {m['date']}", fontsize=8)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", choices=["fwd", "bwd", "bwdkv", "both", "fewq"],
                    help="tile-shape sweep: forward, backward (dQ tile), the dK/dV kernel's tile, fwd+bwd, or "
                         "the split forward's tiles and partitions for a few queries against many keys")
    ap.add_argument("--only", help="with --tune: one dtype or precision (e.g. ieee, bf16); with --decode: one dtype")
    ap.add_argument("--out", help="results folder (default benchmarks/results/<device>)")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--hopper", action="store_true",
                    help="the Gluon (sm_90) forward and backward against the portable ones")
    ap.add_argument("--passes", default="fwd,fwd+bwd", help="with --hopper: fwd, fwd+bwd or both (comma-separated)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="with --hopper: bf16, or float32 in fp16x3 against mem-efficient (→ attention_hopper_fp32)")
    ap.add_argument("--decode", action="store_true", help="few queries against long keys (KV-cache shapes)")
    ap.add_argument("--train", action="store_true",
                    help="half-precision forward + backward at ViT, VGGT and long-row shapes (TRAIN_SHAPES)")
    ap.add_argument("--nq", help="with --decode: query counts (comma-separated; default 16,1041,4164)")
    ap.add_argument("--host-phases", action="store_true",
                    help="an eager call's host time by phase against its GPU time and SDPA's (HOST_SHAPES)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU")
    outdir = Path(a.out) if a.out else results_dir()
    outdir.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    if a.hopper:
        passes = tuple(a.passes.split(","))
        save(hopper_sweep(passes, a.dtype), outdir,
             "attention_hopper" + ("_fp32" if a.dtype == "fp32" else "")
             + ("" if passes == ("fwd", "fwd+bwd") else "_" + "_".join(p.replace("+", "") for p in passes)),
             plot_hopper)
        return
    if a.host_phases:
        native_ready()
        save(host_phases(), outdir, "host_phases", plot_host_phases)
        return
    if a.train:
        dts = (a.only,) if a.only else ("bf16", "fp16")
        save(training_sweep(dts), outdir, "attention_train" + (f"_{a.only}" if a.only else ""), plot_training)
        return
    if a.decode:
        kw = {"nqs": tuple(int(n) for n in a.nq.split(","))} if a.nq else {}
        if a.only:
            kw["dtypes"] = (a.only,)
        save(decode_sweep(**kw), outdir, "attention_decode" + ("_" + "_".join(kw.get("dtypes", ())) if a.only else "")
             + (f"_nq{a.nq.replace(',', '-')}" if a.nq else ""), plot_decode)
        return
    if a.tune == "fewq":
        write_csv(tune_fewq(only=a.only), outdir / "tune_fewq.csv")
        return
    if a.tune:
        rows = tune(("fwd", "bwd") if a.tune == "both" else (a.tune,), only=a.only)
        write_csv(rows, outdir / f"tune_{a.tune}.csv")
        return
    H = 16
    # (Nq, Nk, d, dtypes, passes, variants skipped): bounded so the whole sweep takes minutes
    slow_fp32 = ("elsa-ieee", "sdpa-math")
    if a.quick:
        plan = [(n, n, 64, ("fp32", "bf16"), ("fwd", "fwd+bwd"), ()) for n in (4096, 16384)]
    else:
        plan = [(n, n, 64, ("fp32", "bf16", "fp16"), ("fwd", "fwd+bwd"), ()) for n in (197, 1041, 4096)]
        plan += [(16384, 16384, 64, ("fp32", "bf16", "fp16"), ("fwd",), ()),
                 (16384, 16384, 64, ("fp32", "bf16"), ("fwd+bwd",), ("elsa-ieee",)),
                 (65536, 65536, 64, ("fp32", "bf16"), ("fwd",), ("sdpa-math",)),
                 (65536, 65536, 64, ("bf16",), ("fwd+bwd",), ("sdpa-math",)),
                 (104100, 104100, 64, ("bf16",), ("fwd",), ("sdpa-math",))]
        plan += [(n, n, d, ("fp32", "bf16"), ("fwd", "fwd+bwd"), slow_fp32 if n > 4096 else ())
                 for n in (4096, 16384) for d in (32, 128)]
    if a.no_bwd:
        plan = [p[:4] + (("fwd",),) + p[5:] for p in plan]
    rows = []
    for nq, nk, d, dtypes, passes, skip in plan:
        for dtn, pas in itertools.product(dtypes, passes):
            new = run_case(1, H, nq, nk, d, dtn, pas == "fwd+bwd", skip=skip)
            rows += new
            print(fmt_table(new, ["pass", "dtype", "Nq", "d", "variant", "ms", "tflops", "peak_mib", "max_err_vs_fp64",
                                  "grad_rel_err_vs_fp64"]),
                  flush=True)
    rows += few_queries()
    print(fmt_table(rows[-7:], ["dtype", "Nq", "Nk", "variant", "ms", "partitions", "speedup_vs_1_partition"]))
    save(rows, outdir, "attention_quick" if a.quick else "attention", plot)


if __name__ == "__main__":
    main()
