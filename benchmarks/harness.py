"""Shared benchmark harness: interleaved timing with CUDA events, peak memory, run metadata, CSV + PNG.

Every benchmark script builds a list of *cases*; each case has several *variants* (ELSA and the
baselines) that compute the same thing. ``measure`` runs the variants of one case interleaved —
warm-up, then rounds of one call of each variant in turn — so clock and thermal drift hit every
variant alike, and reports the median time per variant. ``paired_ratio`` turns two variants' rounds
into a speedup with a confidence interval: where a step is paced by a host whose speed drifts,
two runs of the same code can differ by more than a change does, and the interval says whether a
ratio is distinguishable from parity in that run.
"""
from __future__ import annotations

import csv
import datetime as _dt
import gc
import math
import os
import platform
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

RESULTS = Path(__file__).resolve().parent / "results"


# The device type a tool runs on ("cpu" from its --device cpu; None: the GPU where there is one)
_DEVICE_TYPE: Optional[str] = None


def use_device(device: str) -> None:
    """Stamp rows (and name the results folder) for ``device``, a tool's --device: a CPU run on a
    GPU host is the CPU's, not the GPU's."""
    global _DEVICE_TYPE
    _DEVICE_TYPE = torch.device(device).type


def on_gpu() -> bool:
    """Whether the tool's calls run on the GPU: CUDA here and not a --device cpu run
    (:func:`use_device`). Timing, memory and synchronisation follow it."""
    return torch.cuda.is_available() and _DEVICE_TYPE != "cpu"


def metadata() -> dict:
    """Device, versions and date: stamped on every row; with the state of the native replay of eager
    calls (kernels/native.py: ready, off, failed; idle where no kernel was loaded)."""
    import sys
    import triton
    dev = torch.cuda.get_device_name() if on_gpu() else platform.processor() or "cpu"
    native = sys.modules.get("elsa_vision.kernels.native")
    return {"device": dev, "torch": torch.__version__, "triton": triton.__version__,
            "date": _dt.date.today().isoformat(), "native": native.status()[0] if native else "idle"}


def native_ready() -> str:
    """Build or load the native replay of eager calls before timing (kernels/native.py: otherwise the
    first eligible call builds it, inside whatever that call times); its state."""
    if not torch.cuda.is_available():
        return "off"
    from elsa_vision.kernels import native
    native.load()
    state, why = native.status()
    print(f"native replay of eager calls: {state}{' (' + why.splitlines()[0][:200] + ')' if why else ''}", flush=True)
    return state


def device_slug(name: Optional[str] = None) -> str:
    name = name or metadata()["device"]
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower() or "cpu"


def results_dir(name: Optional[str] = None) -> Path:
    """benchmarks/results/<device>/ (or $ELSA_RESULTS_DIR)."""
    d = Path(os.environ.get("ELSA_RESULTS_DIR") or RESULTS / device_slug(name))
    d.mkdir(parents=True, exist_ok=True)
    return d


def sync():
    if on_gpu():
        torch.cuda.synchronize()


def _time_once(fn: Callable[[], object], calls: int = 1) -> float:
    """Milliseconds a call, over ``calls`` calls made back to back and waited for once at the end
    (CUDA events on GPU, perf_counter on CPU). With one call the GPU starts idle, so the host's work
    before the call's first kernel counts; with more, that work of each later call overlaps the
    GPU's previous one, as in a loop that does not wait for its results."""
    if on_gpu():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / calls
    import time
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) * 1e3 / calls


def host_time(fn: Callable[[], object], rounds: int = 5) -> float:
    """Median milliseconds one call takes to return on the host, started with the GPU idle and not
    waited for: its Python, dispatch and launches. Close to the call's wall time (:func:`measure`),
    the host paces the call, not the GPU. (A call that waits on the GPU inside, or whose launches
    fill the GPU's queue, counts that wait here too: then the GPU is the slower side anyway.)"""
    import time
    times = []
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    sync()
    return statistics.median(times)


def peak_memory(fn: Callable[[], object]) -> Optional[int]:
    """Peak bytes allocated during one call above what was allocated before it (None on CPU)."""
    if not on_gpu():
        return None
    gc.collect()
    sync()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return torch.cuda.max_memory_allocated() - base


@dataclass
class Result:
    variant: str
    ms: Optional[float]          # median; None if it failed (OOM, unsupported)
    peak_bytes: Optional[int]
    error: str = ""
    samples: tuple = ()          # ms of each timed round, in round order (paired across the variants of a case)


def paired_ratio(base: Result, new: Result, level: float = 0.95) -> Optional[tuple[float, float, float]]:
    """(median, lo, hi) of the per-round speedups base_r / new_r of two variants measured in the same
    rounds of :func:`measure` (paired: one round's calls ran back to back, so drift between rounds
    cancels in each ratio). [lo, hi] is the distribution-free confidence interval of that median at
    ``level`` — the order statistics of the sorted ratios that a Binomial(n, ½) count bounds (for
    n = 15 rounds at 95%: the 4th and the 12th). None when either variant failed or they have fewer
    than 6 rounds in common (no interval at 95% below that)."""
    n = min(len(base.samples), len(new.samples))
    if base.ms is None or new.ms is None or n < 6:
        return None
    ratios = sorted(b / e for b, e in zip(base.samples[:n], new.samples[:n]))
    # the largest k with P(Binomial(n, 1/2) < k) <= (1 - level) / 2: [ratios[k - 1], ratios[n - k]]
    tail, cdf, k = (1.0 - level) / 2.0, 0.0, 0
    while True:
        nxt = cdf + math.comb(n, k) / 2.0 ** n
        if nxt > tail:
            break
        cdf, k = nxt, k + 1
    if k == 0:
        return None
    return statistics.median(ratios), ratios[k - 1], ratios[n - k]


def warmup_frames(S: int) -> int:
    """Frames whose call compiles the kernels a call of S frames takes: the kernels specialise on the
    token count's class (its remainder mod 128, for the last tile's width and Triton's divisibility
    by 16), which S mod 128 fixes whatever the tokens per frame; at least 4 frames (past every
    length threshold of the dispatch), S itself up to 131 frames."""
    if S <= 131:
        return S
    return S % 128 if S % 128 >= 4 else S % 128 + 128


def measure(variants: dict[str, Callable[[], object]], *, warmup: int = 3, rounds: int = 10,
            min_time_ms: float = 0.0, budget_ms: float = 0.0, memory: bool = True,
            calls: int = 1, before_rounds: Optional[Callable[[], object]] = None) -> dict[str, Result]:
    """Time the variants of one case interleaved, in a new (seeded) order every round; returns name → Result.

    A variant that raises (OOM, not supported) is recorded with its error and dropped from the
    rounds. ``min_time_ms`` raises ``rounds`` until each variant has run at least that long;
    ``budget_ms`` lowers ``rounds`` (to no fewer than 3) so the timed rounds fit in that budget.
    ``calls``: each round's time is that of ``calls`` calls queued back to back, per call
    (:func:`_time_once`). ``before_rounds`` is called once, after the warm-ups and before the first
    timed round (e.g. to note how many graphs torch.compile has compiled so far).
    """
    alive = dict(variants)
    errors: dict[str, str] = {}
    peaks: dict[str, Optional[int]] = {}
    for name, fn in list(alive.items()):
        try:
            for _ in range(warmup):
                fn()
            sync()
            peaks[name] = peak_memory(fn) if memory else None
        except Exception as e:  # noqa: BLE001 - a failing variant is a result, not a crash
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            alive.pop(name)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    times: dict[str, list[float]] = {n: [] for n in alive}
    if budget_ms and alive:
        one = sum(_time_once(fn) for fn in alive.values()) * calls
        rounds = max(3, min(rounds, int(budget_ms / max(one, 1e-3))))
    if before_rounds is not None:
        before_rounds()
    r = 0
    while alive and (r < rounds or (min_time_ms and min(sum(t) for t in times.values()) < min_time_ms)):
        # a call can be measurably slower right after some variants (e.g. after timm's unfused
        # window path), so each round runs them in a new order: no variant always follows the
        # same one (rotating would keep the neighbours)
        order = list(alive.items())
        random.Random(r).shuffle(order)
        for name, fn in order:
            times[name].append(_time_once(fn, calls))
        r += 1
        if r > 10 * max(rounds, 1):
            break
    out = {n: Result(n, statistics.median(t), peaks.get(n), samples=tuple(t)) for n, t in times.items()}
    for n, e in errors.items():
        out[n] = Result(n, None, None, e)
    return out


def graphed(fn: Callable[[], object], warmup: int = 3) -> Callable[[], None]:
    """``fn``'s launches captured once into a CUDA graph; returns its replay.

    Timing the replay leaves out the host's work (Python, argument checks, dispatch, kernel
    launches): what a captured training step or ``torch.compile(mode="reduce-overhead")`` runs.
    A call whose host work takes longer than its kernels (a late Swin stage: little GPU work behind
    autograd and many launches) is measured eagerly at the host's speed; replayed, at the GPU's.
    ``fn`` must not synchronise with the host. Captured by :func:`elsa_vision.verify.capture` (its
    warm-up runs on a side stream, as capture requires)."""
    from elsa_vision.verify import capture
    graph, _ = capture(fn, warmup)
    return graph.replay


def measure_graphed(variants: dict[str, Callable[[], object]], *, rounds: int = 10,
                    budget_ms: float = 0.0) -> dict[str, Result]:
    """:func:`measure` of each variant's CUDA-graph replay (see :func:`graphed`); no peak memory (the
    graphs keep their own memory pools). A variant that cannot be captured is recorded with its error."""
    replays: dict[str, Callable[[], object]] = {}
    errors: dict[str, str] = {}
    for name, fn in variants.items():
        try:
            replays[name] = graphed(fn)
        except Exception as e:  # noqa: BLE001 - an uncapturable variant is a result, not a crash
            errors[name] = f"graph capture: {type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}"
            torch.cuda.set_stream(torch.cuda.default_stream())  # a failed capture can leave its stream current
            torch.cuda.synchronize()
    out = measure(replays, warmup=1, rounds=rounds, budget_ms=budget_ms, memory=False)
    out.update({n: Result(n, None, None, e) for n, e in errors.items()})
    del replays
    gc.collect()
    torch.cuda.empty_cache()
    return out


def style_axes(ax, xlabel: str, ylabel: str, title: str, ylog: bool = True) -> None:
    """The sweep plots' axes: log₂ x, log y (or linear), labels, grid, a small legend."""
    ax.set_xscale("log", base=2)
    if ylog:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def write_csv(rows: list[dict], path: Path) -> Path:
    """Write rows (dicts; the union of keys is the header, metadata first) to ``path``."""
    meta = metadata()
    rows = [{**meta, **r} for r in rows]
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def save(rows: list[dict], outdir: Path, name: str, plot: Callable[[list[dict], Path], None]) -> None:
    """``name``.csv and, drawn by ``plot``, ``name``.png in outdir."""
    write_csv(rows, outdir / f"{name}.csv")
    plot(rows, outdir / f"{name}.png")
    print(f"wrote {outdir / name}.csv/.png")


def fmt_table(rows: list[dict], cols: list[str]) -> str:
    """A plain text table of ``cols`` for the console / README."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return "" if v is None else str(v)
    data = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(d[i]) for d in data)) if data else len(c) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(d) for d in data])


# Kernel-name patterns → category of a CUDA time breakdown (first match wins: SDPA's kernels are
# CUTLASS kernels too, so they are tested before the GEMMs).
KERNEL_CATEGORIES = (
    ("elsa attention", r"^_(fwd|merge|bwd_\w+|win_\w+)_kernel"),
    ("sdpa", r"flash|fmha|cudnn|sdpa|attention|efficient_attention"),
    ("gemm", r"gemm|xmma|cutlass|nvjet|wgmma|sm\d\d_|ampere_|cublas"),
    ("index / scatter / sort", r"index|scatter|gather|sort|radix|segment|unique|cub::"),
    ("normalization", r"layer_?norm|rms_?norm|group_?norm|batch_?norm"),
    ("reduction", r"reduce|argmax|max_|sum_"),
    ("elementwise / copy", r"elementwise|vectorized|copy|cat|fill|unrolled"),
)


def kernel_category(name: str) -> str:
    import re
    for cat, pat in KERNEL_CATEGORIES:
        if re.search(pat, name, re.IGNORECASE):
            return cat
    return "other"


def cuda_breakdown(fn: Callable[[], object], top: int = 12, device: str = "cuda",
                   ops: Optional[dict] = None) -> tuple[list[dict], list[dict]]:
    """Run ``fn`` once under torch.profiler and return (time per kernel category, the ``top`` kernels),
    each row with its milliseconds (column ``cuda_ms``), launch count (``calls``) and share of the
    total kernel time. ``device="cpu"`` breaks down CPU operator time instead (self time, no GPU
    needed). ``ops``, a dict, receives the count of every aten operator dispatched during the call
    (nested ones included; CUDA only): in a compiled call, what runs outside inductor's generated
    kernels — extern GEMMs, and copies autograd or a runtime wrapper adds around the graph."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device == "cuda"
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    activities = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
    if cuda and ops is not None:
        activities.append(ProfilerActivity.CPU)
    sync()
    with profile(activities=activities) as prof:
        fn()
        sync()
    kernels: dict[str, float] = {}
    calls: dict[str, int] = {}
    for ev in prof.events():
        us = ev.device_time_total if cuda else ev.self_cpu_time_total
        if ev.device_type == kind and us > 0:
            kernels[ev.name] = kernels.get(ev.name, 0.0) + us / 1e3
            calls[ev.name] = calls.get(ev.name, 0) + 1
        elif cuda and ops is not None and ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith("aten::"):
            ops[ev.name] = ops.get(ev.name, 0) + 1
    if not kernels:  # e.g. no CUPTI in a sandboxed driver: say so rather than report zeros
        return [], []
    total = sum(kernels.values())
    cats: dict[str, list] = {}
    for name, ms in kernels.items():
        c = cats.setdefault(kernel_category(name), [0.0, 0])
        c[0] += ms
        c[1] += calls[name]
    by_cat = [{"category": c, "cuda_ms": ms, "calls": n, "share": ms / total}
              for c, (ms, n) in sorted(cats.items(), key=lambda t: -t[1][0])]
    by_kernel = [{"category": kernel_category(n), "kernel": n[:120], "cuda_ms": ms, "calls": calls[n],
                  "share": ms / total} for n, ms in sorted(kernels.items(), key=lambda t: -t[1])[:top]]
    return by_cat, by_kernel


def profile_rows(fn: Callable[[], object], head: dict, top: int = 60, device: str = "cuda"
                 ) -> tuple[list[dict], str]:
    """cuda_breakdown of one call of ``fn`` as CSV rows (``head`` + kind "category" / "kernel", the
    ``top`` kernels: enough that two variants' compiled graphs can be compared kernel by kernel; on
    CUDA also kind "op", the ``top`` aten operators by count, column ``calls``) and a one-line
    summary."""
    ops: dict[str, int] = {}
    by_cat, by_kernel = cuda_breakdown(fn, top, device, ops if device == "cuda" else None)
    if not by_cat:
        return [], "the profiler saw no CUDA kernel (no CUPTI?)"
    rows = [{**head, "kind": "category", **r} for r in by_cat] + [{**head, "kind": "kernel", **r} for r in by_kernel]
    rows += [{**head, "kind": "op", "category": "aten op", "kernel": n, "calls": c}
             for n, c in sorted(ops.items(), key=lambda t: -t[1])[:top]]
    line = ", ".join(f"{r['category']} {r['cuda_ms']:.1f} ms ({100 * r['share']:.0f}%)" for r in by_cat)
    line += f"; {sum(r['calls'] for r in by_cat)} kernels"
    return rows, line + (f", {sum(ops.values())} aten ops" if ops else "")



def memory_at_peak(fn: Callable[[], object], top: int = 15, roots: tuple = ("elsa_vision", "vggt", "benchmarks")
                   ) -> list[dict]:
    """What is allocated at the moment of ``fn``'s peak device memory: one call under the CUDA caching
    allocator's history, replayed to its peak; the live blocks grouped by the innermost Python frame
    of a file under one of ``roots`` (file:line function), the ``top`` largest groups as rows of
    ``site``, ``gib`` and ``blocks``. Blocks allocated before the call count too (weights, inputs)
    when the history saw them: the history starts with the call, so those show as "before"."""
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    try:
        sync()
        fn()
        sync()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    dev = torch.cuda.current_device()
    trace = snap["device_traces"][dev]
    # the blocks live when the history began: allocated (in the segments) and not seen allocated since
    seen = {e["addr"] for e in trace if e["action"] == "alloc"}
    before = 0
    for seg in snap["segments"]:
        if seg.get("device", dev) != dev:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and addr not in seen:
                before += b["size"]
            addr += b["size"]

    def site(frames) -> str:
        for f in frames:
            if any(r in f["filename"] for r in roots):
                return f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}"
        return "other"

    def replay(upto: int):
        """(live blocks after event ``upto``, the index of the event at the peak, the peak)."""
        live, now, peak, at = {}, before, before, -1
        for i, e in enumerate(trace[:upto + 1]):
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e)
                now += e["size"]
                if now > peak:
                    peak, at = now, i
            elif e["action"] == "free_completed" and e["addr"] in live:
                now -= live.pop(e["addr"])[0]
        return live, at, peak

    _, at, peak = replay(len(trace) - 1)
    at_peak = {a: (size, site(e.get("frames", ()))) for a, (size, e) in replay(at)[0].items()}
    groups: dict[str, list] = {"before the call": [before, 0]}
    for size, where in at_peak.values():
        g = groups.setdefault(where, [0, 0])
        g[0] += size
        g[1] += 1
    rows = [{"site": k, "gib": v[0] / 2**30, "blocks": v[1]} for k, v in sorted(groups.items(), key=lambda t: -t[1][0])]
    return [{"site": "peak (total)", "gib": peak / 2**30, "blocks": len(at_peak)}] + rows[:top]
