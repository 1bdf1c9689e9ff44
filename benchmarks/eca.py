"""ECA on the CPU: Exact Causal Attention (kernels/eca.py) against the reference backend's causal
path and PyTorch's CPU SDPA (is_causal=True), same process, interleaved.

    python benchmarks/eca.py            # L 1K…8K (16K forward), d 64/128, float32 → benchmarks/results/<cpu>/eca.{csv,png}
    python benchmarks/eca.py --quick    # L 1K/2K/4K, d 64
    python benchmarks/eca.py --breakdown 4096   # where ECA's time goes at one length (products, additions, softmax)

Multiply-adds are counted: ECA's by its instrumented products (kernels.eca.count_multiply_adds),
the others' as the standard causal count, L(L+1)/2·d per product (what a kernel that skips the
masked half does; SDPA's CPU kernel works on blocks, so it does a little more). Peak memory: the
process's resident-set growth during one call, sampled every millisecond (torch's CPU allocator
has no counters), after returning freed memory to the system.
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import fmt_table, measure, metadata, results_dir, save, style_axes, write_csv  # noqa: E402

import elsa_vision  # noqa: E402
from elsa_vision.kernels import eca  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _trim():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def rss_peak(fn) -> int:
    """Resident-set growth (bytes) during one call of fn, sampled every millisecond."""
    _trim()
    base = _rss()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    peak[0] = max(peak[0], _rss())
    return peak[0] - base


def variants(L: int, d: int, bwd: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, L, d, generator=g).requires_grad_(bwd) for _ in range(3))
    do = torch.randn(1, 1, L, d, generator=g)

    def wrap(f):
        def call():
            o = f()
            if bwd:
                torch.autograd.grad(o, (q, k, v), do)
            return o
        return call

    return (q, k, v), {
        "eca": wrap(lambda: elsa_vision.attention(q, k, v, causal=True, backend="eca")),
        "reference": wrap(lambda: elsa_vision.attention(q, k, v, causal=True, backend="reference")),
        "sdpa-cpu": wrap(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }


def standard_macs(L: int, d: int, products: int) -> int:
    return products * L * (L + 1) // 2 * d


def run_case(L: int, d: int, bwd: bool, rounds: int) -> list[dict]:
    (q, k, v), fns = variants(L, d, bwd)
    errs = {}
    if L <= 4096 and not bwd:  # max |out − float64 oracle| (the oracle holds L² float64s)
        ref = elsa_vision.verify.oracle(*(t.detach().double() for t in (q, k, v)), causal=True)
        with torch.no_grad():
            errs = {name: (fn().double() - ref).abs().max().item() for name, fn in fns.items()}
        del ref
    products = 6 if bwd else 2  # forward: QKᵀ, PV; backward adds dV, dP, dQ, dK
    with eca.count_multiply_adds() as c:
        fns["eca"]()
    macs = {"eca": c[0], "reference": standard_macs(L, d, products), "sdpa-cpu": standard_macs(L, d, products)}
    mem = {name: rss_peak(fn) for name, fn in fns.items()}
    res = measure(fns, warmup=1, rounds=rounds, memory=False)
    best = min(r.ms for n, r in res.items() if n != "eca" and r.ms)
    rows = []
    for name, r in res.items():
        rows.append({"pass": "fwd+bwd" if bwd else "fwd", "dtype": "fp32", "L": L, "d": d, "variant": name,
                     "ms": r.ms, "speedup_vs_best_other": best / r.ms if r.ms and name == "eca" else None,
                     "multiply_adds": macs[name], "macs_per_L2d_per_product": macs[name] / (L * L * d * products),
                     "peak_rss_mib": mem[name] / 2**20, "max_err_vs_fp64": errs.get(name),
                     "threads": torch.get_num_threads()})
    return rows


def breakdown(L: int, d: int) -> list[dict]:
    """ECA forward at one length, stage by stage: its matrix products alone (the same shapes as
    plain matmuls), the block additions, the softmax over the materialised S."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, L, d, generator=g) for _ in range(3))
    scale = d ** -0.5
    s = eca.masked_product(q, k) * scale
    p = torch.softmax(s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf")), -1)
    n, kk = L // 4, d // 4
    a, b = torch.randn(1, 1, n, kk), torch.randn(1, 1, kk, n)
    pa, vb = torch.randn(1, 1, n, n), torch.randn(1, 1, n, kk)
    fns = {
        "stage I (Mask(QKᵀ))": lambda: eca.masked_product(q, k),
        "stage I products only (24 + 10 half as full)": lambda: [a @ b for _ in range(29)],
        "stage II (P·V)": lambda: eca.tri_product(p, v),
        "stage II products only": lambda: [pa @ vb for _ in range(29)],
        "softmax over S (mask, exp, normalise)": lambda: torch.softmax(s.masked_fill(
            torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf")), -1),
        "plain tril(QKᵀ) (full product)": lambda: (q @ k.transpose(-1, -2)).tril_(),
        "sdpa-cpu causal forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    res = measure(fns, warmup=1, rounds=5, memory=False)
    return [{"L": L, "d": d, "part": name, "ms": r.ms} for name, r in res.items()]


def plot(rows, path):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, pas in zip(axes, ("fwd", "fwd+bwd")):
        for d, var in itertools.product(sorted({r["d"] for r in rows}), ("eca", "reference", "sdpa-cpu")):
            pts = sorted((r["L"], r["ms"]) for r in rows if r["pass"] == pas and r["d"] == d and r["variant"] == var
                         and r["ms"])
            if pts:
                ax.plot(*zip(*pts), marker="o", ls="-" if var == "eca" else "--", label=f"d={d} {var}")
        style_axes(ax, "L (causal, B = H = 1)", "ms", f"float32 {pas}")
    m = metadata()
    fig.suptitle(f"ECA vs reference vs CPU SDPA — {m['device']}, {torch.get_num_threads()} threads, torch {m['torch']}, "
                 f"{m['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--breakdown", type=int, metavar="L")
    ap.add_argument("--out", help="results folder (default benchmarks/results/<cpu>)")
    a = ap.parse_args(argv)
    if a.breakdown is not None and a.breakdown < 4:
        ap.error(f"--breakdown L takes a sequence length of at least 4, got {a.breakdown}")
    outdir = Path(a.out) if a.out else results_dir()
    outdir.mkdir(parents=True, exist_ok=True)
    if a.breakdown:
        rows = [r for d in (64, 128) for r in breakdown(a.breakdown, d)]
        print(fmt_table(rows, ["L", "d", "part", "ms"]))
        write_csv(rows, outdir / f"eca_breakdown_{a.breakdown}.csv")
        return
    plan = [(L, d, bwd) for d in (64,) for L in (1024, 2048, 4096) for bwd in (False, True)] if a.quick else \
        [(L, d, bwd) for d in (64, 128) for L in (1024, 2048, 4096, 8192) for bwd in (False, True)] + \
        [(16384, d, False) for d in (64, 128)]
    rows = []
    for L, d, bwd in plan:
        new = run_case(L, d, bwd, rounds=3 if L >= 8192 else 5)
        rows += new
        print(fmt_table(new, ["pass", "L", "d", "variant", "ms", "speedup_vs_best_other", "macs_per_L2d_per_product",
                              "peak_rss_mib", "max_err_vs_fp64"]), flush=True)
    save(rows, outdir, "eca_quick" if a.quick else "eca", plot)


if __name__ == "__main__":
    main()
