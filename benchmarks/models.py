"""Model benchmark: timm ViT / Swin with ELSA against timm's own attention, same process, interleaved.

    python benchmarks/models.py --quick            # the headline cases, a few minutes
    python benchmarks/models.py --family vit       # ViT-T/S/B x 224/384/512/768/1024 x batch 8/64
    python benchmarks/models.py --family swin      # Swin-T, SwinV2-T x 224/256/384/512 x batch 8/64
    python benchmarks/models.py --quick --profile  # + CUDA time and launches per kernel, aten ops, per variant
    python benchmarks/models.py --quick --host     # + host time per call and its share of the wall time
    python benchmarks/models.py                    # both (run the two families separately to stay
                                                   # under a 10-minute job limit)

Per case (model, image size, batch, forward | training step, fp32 | bf16 autocast), three variants
run interleaved on one set of weights:

  elsa       the model patched with ``elsa_vision.patch`` (a deep copy of the native model)
  fused      timm's SDPA path (``module.fused_attn = True``; for Swin v1 this is timm's
             experimental fused path). Swin v2 has no fused path: the column stays empty.
  unfused    timm's explicit softmax(q kᵀ) path (``module.fused_attn = False``)

and with ``--nofuse``, ``elsa_nofuse``: for Swin models ``patch(fuse_windows=False)`` (ELSA in the
attention modules only, timm's cyclic shift and window partition / merge copies around them), to
show what running the blocks' shifted windows in place adds; for ViT models
``patch(fuse_residual=False)`` (the blocks' own residual adds and norms), to show what the fused
residual passes add. ``--nofuse OPTION ...`` sets those patch options False instead, e.g.
``--nofuse fuse_position_bias`` (Swin's position bias by the module's own gather, and v2's MLP).
With ``--compile default --static-launch``, also ``elsa_static``: the patched model compiled with
inductor's static launcher for user-defined Triton kernels (ELSA's) as well as its own
(:data:`STATIC_LAUNCH_OPTIONS`), against ``elsa`` (Triton's launcher for them, inductor's default):
``static_speedup_vs_elsa``, and ``user_kernel_launchers`` (which launcher each user-defined kernel
inductor loaded got). With ``--compile MODE --with-eager``, also ``elsa_eager``: the patched model (a
copy) run eagerly in the same rounds, and ``compile_speedup_vs_eager`` (> 1: compiling the patched
model gains). ``--no-unfused`` leaves out the ``unfused`` baseline where timm's SDPA path exists
(one compile fewer: ``max-autotune`` compiles take minutes). With ``--python-host``, also
``elsa_python``: the same patched model with its eager attention calls on the Python host path
rather than replayed from C++ (kernels/native.py), and ``native_speedup_vs_python``. On a GPU the
native replay is built or loaded before the first case (the CSV's ``native`` column says whether it
was ready).

A training step is forward + backward + SGD step. fp32 runs with ``torch.set_float32_matmul_precision
("highest")`` (native attention is true fp32; ELSA's "auto" runs its float32-accurate fp16x3 mode);
pass ``--matmul high`` to let both use TF32 (ELSA's ``tf32`` mode). Columns: median latency (ms) and
peak memory above the weights (MiB) per variant, ``speedup_vs_<baseline>`` = baseline ms / ELSA ms
(> 1: ELSA faster), with ``speedup_vs_<baseline>_lo`` / ``_hi`` the 95% confidence interval of the
median of the per-round ratios (``round_speedup_vs_<baseline>``; rounds are interleaved, so each
round's ratio is paired: ``harness.paired_ratio``) — an interval that holds 1 does not tell the
two apart in that run, ``mem_vs_<baseline>`` = ELSA MiB / baseline MiB, and for forward cases
``max_diff`` = max |ELSA − fused (or unfused)| of the outputs. A variant that runs out of memory
is recorded with its error and the others still run. ``--graphs`` adds each variant replayed from a
CUDA graph (``<variant>_graph_ms``, ``graph_speedup_vs_<baseline>``): a training step of a small
model launches many small kernels, and eagerly the host's launch work can set the pace;
replayed, the GPU does (what a captured step or ``torch.compile(mode="reduce-overhead")`` gets).
``--compile MODE`` runs every variant under ``torch.compile`` instead (``default``, ``reduce-overhead``
or ``max-autotune``; compiled during the warm-up calls, the optimizer step eager), in a ``compile``
column and a ``_compile_<mode>`` file name; no memory columns in the two modes that capture CUDA
graphs (their pools are allocated while capturing, in the warm-up), and in those two modes
``<variant>_cudagraph_skips``: the variant's graphs inductor left out of CUDA graphs (0: every graph
replayed from one). ``--host`` adds each variant's host time per call — started with the GPU
idle, not waited for: its Python, dispatch and launches (``<variant>_host_ms``) — and that time's
share of the wall time (``<variant>_host_share``): near 1, the host paces the variant and its ratio
moves with the host's speed, not the GPU's. Every call above is timed from an idle GPU, so the
host's work before its first kernel counts; ``--queued K`` adds each variant timed over K calls
queued back to back and waited for once (``<variant>_queued_ms`` a call,
``queued_speedup_vs_<baseline>``), where that work of each call overlaps the GPU's previous one:
a GPU-paced row then shows the GPU's ratio, as a loop that does not wait for its results sees it.

Writes benchmarks/results/<device>/<name>.csv and <name>.png (speedups per case).
"""
from __future__ import annotations

import argparse
import copy
import gc
import itertools
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import (fmt_table, host_time, measure, measure_graphed, native_ready,  # noqa: E402
                                paired_ratio, profile_rows, results_dir, use_device, write_csv)

import elsa_vision  # noqa: E402
from elsa_vision.adapters.blocks import PreNormBlock  # noqa: E402
from elsa_vision.adapters.registry import patched_modules  # noqa: E402
from elsa_vision.dispatch import device_problem  # noqa: E402
from elsa_vision.verify import unzero_residual_norms  # noqa: E402

VIT = {"ViT-T": "vit_tiny_patch16_224", "ViT-S": "vit_small_patch16_224", "ViT-B": "vit_base_patch16_224"}
SWIN = {"Swin-T": "swin_tiny_patch4_window7_224", "SwinV2-T": "swinv2_tiny_window8_256"}
VIT_SIZES = (224, 384, 512, 768, 1024)
SWIN_SIZES = (224, 256, 384, 512)
BATCHES = (8, 64)
BASELINES = ("fused", "unfused")


@dataclass(frozen=True)
class Case:
    model: str      # short name (ViT-T, Swin-T, ...)
    size: int
    batch: int
    mode: str       # "fwd" or "train"
    dtype: str      # "fp32" or "bf16"

    @property
    def label(self) -> str:
        return f"{self.model} {self.size}px b{self.batch} {self.mode} {self.dtype}"


def all_cases(family: str, sizes=None, batches=None) -> list[Case]:
    """The full grid of a family; ``sizes`` / ``batches`` replace the default lists."""
    out = []
    fams = {"vit": [(VIT, VIT_SIZES)], "swin": [(SWIN, SWIN_SIZES)], "all": [(VIT, VIT_SIZES), (SWIN, SWIN_SIZES)]}
    for names, default_sizes in fams[family]:
        grid = itertools.product(names, sizes or default_sizes, batches or BATCHES, ("fwd", "train"), ("fp32", "bf16"))
        out += [Case(*g) for g in grid if fits(g[0], g[1])]
    return out


def fits(model: str, size: int) -> bool:
    """SwinV2-T (window 8, patch 4, 4 stages) needs every stage's feature map divisible by 8: size % 256 == 0."""
    return model != "SwinV2-T" or size % 256 == 0


def quick_cases() -> list[Case]:
    """The cases the performance goals name: ViT-T fp32 forward at 768/1024 px and training step at
    768 px (batch 16), ViT-B fp32 forward at 1024 px (batch 4), ViT-B bf16 at 224 px (training step
    batch 64, inference batch 256), Swin-T and SwinV2-T training steps in bf16 and fp32, plus one
    bf16 ViT-S forward and the Swin inference rows."""
    cs = [Case("ViT-T", s, 8, "fwd", "fp32") for s in (768, 1024)]
    cs += [Case("ViT-T", 768, 16, "train", "fp32"), Case("ViT-B", 1024, 4, "fwd", "fp32")]
    cs.append(Case("ViT-S", 224, 64, "fwd", "bf16"))
    cs += [Case("ViT-B", 224, 64, "train", "bf16"), Case("ViT-B", 224, 256, "fwd", "bf16")]
    native = {"Swin-T": 224, "SwinV2-T": 256}  # each model's own resolution
    cs += [Case(m, native[m], 64, "train", dt) for m in SWIN for dt in ("bf16", "fp32")]
    cs += [Case(m, native[m], 8, "fwd", "bf16") for m in SWIN]
    return cs


def nofuse_options(case: Case, names: Sequence[str]) -> dict:
    """The patch options of the ``elsa_nofuse`` variant: ``names`` set False, or with none named the
    family's fused blocks off (Swin: fuse_windows, ViT: fuse_residual)."""
    if names:
        return {n: False for n in names}
    return {"fuse_windows": False} if case.model in SWIN else {"fuse_residual": False}


# torch.compile options of the elsa_static variant (--static-launch). Inductor picks a kernel's
# launcher where it compiles it; its compile workers get only use_static_triton_launcher from this
# process's config, so this variant compiles in this process (compile_threads=1), where the option
# is in force. (Compile time only: the steps run as any compiled step.)
STATIC_LAUNCH_OPTIONS = {"static_launch_user_defined_triton_kernels": True, "compile_threads": 1}


def user_kernel_launchers() -> str:
    """Which launcher inductor gave each user-defined Triton kernel it has loaded in this process:
    "name: static|triton" entries (both when two compiled variants gave it both)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner, HeuristicType
    kinds: dict = {}
    for o in gc.get_objects():
        # (type(): isinstance reads __class__, which some deprecated proxies among the objects warn on)
        if issubclass(type(o), CachingAutotuner) and getattr(o, "heuristic_type", None) == HeuristicType.USER_AUTOTUNE:
            for launcher in o.launchers:
                runner = getattr(launcher, "__globals__", {}).get("runner")
                owner = getattr(runner, "__self__", runner)
                kinds.setdefault(o.fn.__name__, set()).add("static" if "Statically" in type(owner).__name__
                                                            else "triton")
    return "; ".join(f"{n}: {'|'.join(sorted(k))}" for n, k in sorted(kinds.items()))


def build(case: Case, device: str) -> torch.nn.Module:
    import timm
    name = {**VIT, **SWIN}[case.model]
    # drop_path_rate=0 so every variant does the same work
    model = timm.create_model(name, pretrained=False, img_size=case.size, drop_path_rate=0.0).to(device)
    unzero_residual_norms(model)  # so that max_diff sees Swin v2's attention (zero post-norms at init)
    return model


def set_fused(model: torch.nn.Module, fused: bool) -> bool:
    """Switch timm's attention path on every module that has one; False if none has."""
    found = False
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused
            found = True
    return found


def make_fn(model, x, case: Case, fused=None, compile_mode: Optional[str] = None,
            compile_options: Optional[dict] = None):
    """A callable running one forward (no grad) or one training step of ``model`` on ``x``; with
    ``compile_mode``, the model's forward (and its backward) through ``torch.compile`` in that mode
    (the optimizer step stays eager), with inductor ``compile_options`` in the default mode."""
    amp = case.dtype == "bf16"
    dev = x.device.type
    run = model
    # timm's path set once: each variant has its own model (run_case), and a switch per call
    # would cost the baseline host time (a walk over every module) or recompile a compiled graph
    if fused is not None:
        set_fused(model, fused)
    if compile_mode is not None:
        if compile_options:  # (torch.compile takes a mode or options, not both)
            run = torch.compile(model, options=compile_options)
        else:
            run = torch.compile(model, mode=None if compile_mode == "default" else compile_mode)

    if case.mode == "fwd":
        model.eval()

        def f():
            with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
                return run(x)
        return f
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    target = torch.randint(0, 1000, (x.shape[0],), device=x.device)

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(run(x).float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _counting_skips(name: str, fn, skips: dict):
    """``fn`` adding to ``skips[name]`` the graphs inductor compiled during its calls but left out of
    CUDA graphs (dynamo's ``cudagraph_skips`` counter; the reason goes to the ``perf_hints`` log)."""
    def skipped() -> int:  # (read afresh: whoever clears dynamo's counters drops the Counter)
        return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]

    def f():
        before = skipped()
        try:
            return fn()
        finally:
            skips[name] = skips.get(name, 0) + skipped() - before
    return f


def _on_python_path(fn):
    """``fn`` with its eager calls on the Python host path (kernels/native.py's python_path)."""
    from elsa_vision.kernels import native

    def call():
        with native.python_path():
            return fn()
    return call


def _record(row: dict, tag: str, results: dict) -> None:
    """The columns of a second timing of a case's variants (``tag``: queued, graph):
    ``<variant>_<tag>_ms`` (and ``_error``), ``<tag>_speedup_vs_<baseline>`` with its per-round
    interval where the rounds were kept, ``nofuse_<tag>_speedup_vs_<baseline>``."""
    for name, r in results.items():
        row[f"{name}_{tag}_ms"] = r.ms
        if r.error:
            row[f"{name}_{tag}_error"] = r.error
    e, nf = results.get("elsa"), results.get("elsa_nofuse")
    for b in BASELINES:
        r = results.get(b)
        if r is None or not r.ms:
            continue
        if e is not None and e.ms:
            row[f"{tag}_speedup_vs_{b}"] = r.ms / e.ms
            ci = paired_ratio(r, e)
            if ci is not None:
                _, row[f"{tag}_speedup_vs_{b}_lo"], row[f"{tag}_speedup_vs_{b}_hi"] = ci
        if nf is not None and nf.ms:
            row[f"nofuse_{tag}_speedup_vs_{b}"] = r.ms / nf.ms


def run_case(case: Case, device: str, warmup: int, rounds: int, precision: str, budget_ms: float = 0.0,
             profile: Optional[list] = None, graphs: bool = False, compile_mode: Optional[str] = None,
             nofuse: Optional[Sequence[str]] = None, host: bool = False, static_launch: bool = False,
             python_host: bool = False, with_eager: bool = False, unfused: bool = True, queued: int = 0) -> dict:
    """Time one case (ELSA vs timm's paths, interleaved); with ``profile`` (a list), also append one
    profiled call per variant: CUDA time per kernel category and the top kernels; with ``graphs``,
    also time each variant replayed from a CUDA graph (``<variant>_graph_ms``, ``graph_speedup_vs_<b>``);
    with ``compile_mode``, every variant is its model under ``torch.compile`` (timm's two paths on
    two copies), compiled during the warm-up calls; with ``host``, also each variant's host time
    (``<variant>_host_ms``, :func:`harness.host_time`) and its share of the wall time
    (``<variant>_host_share``: near 1, the host paces that variant); with ``static_launch`` (default
    compile mode), also ``elsa_static`` (:data:`STATIC_LAUNCH_OPTIONS`); with ``python_host``, also
    ``elsa_python``: the patched model's eager calls on the Python host path instead of their native
    replay (kernels/native.py); with ``with_eager`` (and ``compile_mode``), also ``elsa_eager``: a
    copy of the patched model run eagerly; ``unfused=False``: no ``unfused`` variant where the
    ``fused`` one exists; ``queued`` > 1: also each variant timed over that many calls queued back
    to back (``<variant>_queued_ms`` a call, ``queued_speedup_vs_<b>`` with its per-round interval):
    the host's work before a call's first kernel then overlaps the GPU's previous call."""
    row = {"model": case.model, "size": case.size, "batch": case.batch, "mode": case.mode, "dtype": case.dtype}
    if compile_mode is not None:
        row["compile"] = compile_mode
    try:
        torch.manual_seed(0)
        native = build(case, device)
        elsa = copy.deepcopy(native)
        report = elsa_vision.patch(elsa, precision=precision)
        row["patched"] = report.num_patched
        if nofuse is not None:
            elsa_nf = copy.deepcopy(native)
            elsa_vision.patch(elsa_nf, precision=precision, **nofuse_options(case, nofuse))
        if static_launch:
            elsa_st = copy.deepcopy(native)
            elsa_vision.patch(elsa_st, precision=precision)
        # (a copy: eager calls count on the patched modules' states, which a compiled model's guards
        # would then see changed)
        elsa_eager = copy.deepcopy(elsa) if with_eager and compile_mode is not None else None
        x = torch.randn(case.batch, 3, case.size, case.size, device=device)
    except Exception as e:  # noqa: BLE001 - a case that cannot be built is a result
        row["error"] = f"build: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return row
    # Swin v2's WindowAttention has no SDPA path (no fused_attn flag): only "unfused" applies
    has_fused = any(hasattr(m, "fused_attn") for m in native.modules())
    variants = {"elsa": make_fn(elsa, x, case, compile_mode=compile_mode)}
    if nofuse is not None:
        variants["elsa_nofuse"] = make_fn(elsa_nf, x, case, compile_mode=compile_mode)
    if static_launch:
        variants["elsa_static"] = make_fn(elsa_st, x, case, compile_mode=compile_mode,
                                          compile_options=STATIC_LAUNCH_OPTIONS)
    if python_host:
        variants["elsa_python"] = _on_python_path(variants["elsa"])
    if elsa_eager is not None:
        variants["elsa_eager"] = make_fn(elsa_eager, x, case)
    if has_fused:
        # (a model of its own: timm's path is set once, not switched on the baselines' every call)
        fused_model = copy.deepcopy(native) if compile_mode is not None or unfused else native
        variants["fused"] = make_fn(fused_model, x, case, fused=True, compile_mode=compile_mode)
    if unfused or not has_fused:
        variants["unfused"] = make_fn(native, x, case, fused=False, compile_mode=compile_mode)
    # CUDA-graph modes allocate their memory pool while capturing in the warm-up, before the measured
    # call: its peak there says nothing, so no memory columns under them
    graphed_compile = compile_mode in ("reduce-overhead", "max-autotune")
    if compile_mode is not None:
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
    skips: dict[str, int] = {}
    if graphed_compile:  # (whether each variant's graphs were captured, or inductor ran them without)
        variants = {n: _counting_skips(n, f, skips) for n, f in variants.items()}
    warmed: dict = {}  # graphs compiled by the end of the warm-ups

    def warm_done():
        if compile_mode is not None:
            warmed["graphs"] = counters["stats"]["unique_graphs"]
    res = measure(variants, warmup=warmup, rounds=rounds, budget_ms=budget_ms, memory=not graphed_compile,
                  before_rounds=warm_done)
    if compile_mode is not None:
        # every variant compiles in its warm-up; a graph compiled during the timed rounds or after
        # them (one more call each), or a graph break, means the timed calls were not all the
        # steady compiled step
        row["graphs_compiled"] = counters["stats"]["unique_graphs"]
        row["graph_breaks"] = sum(counters["graph_break"].values())
        for f in variants.values():
            f()
        row["steady"] = (counters["stats"]["unique_graphs"] == row["graphs_compiled"] == warmed.get("graphs")
                         and not row["graph_breaks"])
        for n in variants if graphed_compile else ():
            row[f"{n}_cudagraph_skips"] = skips.get(n, 0)
        if static_launch:
            row["user_kernel_launchers"] = user_kernel_launchers()
    for name, r in res.items():
        row[f"{name}_ms"] = r.ms
        row[f"{name}_mib"] = None if r.peak_bytes is None else r.peak_bytes / 2**20
        if r.error:
            row[f"{name}_error"] = r.error
        elif host:
            row[f"{name}_host_ms"] = host_time(variants[name], max(3, rounds))
            row[f"{name}_host_share"] = row[f"{name}_host_ms"] / r.ms
    e = res["elsa"]
    st = res.get("elsa_static")
    if st is not None and st.ms and e.ms:
        row["static_speedup_vs_elsa"] = e.ms / st.ms
    py = res.get("elsa_python")
    if py is not None and py.ms and e.ms:
        row["native_speedup_vs_python"] = py.ms / e.ms
    ee = res.get("elsa_eager")
    if ee is not None and ee.ms and e.ms:
        row["compile_speedup_vs_eager"] = ee.ms / e.ms
    for b in BASELINES:
        r = res.get(b)
        if r is not None and r.ms and e.ms:
            row[f"speedup_vs_{b}"] = r.ms / e.ms
            ci = paired_ratio(r, e)
            if ci is not None:  # (the per-round ratios' median and its 95% interval)
                row[f"round_speedup_vs_{b}"], row[f"speedup_vs_{b}_lo"], row[f"speedup_vs_{b}_hi"] = ci
            if nofuse is not None and res["elsa_nofuse"].ms:
                row[f"nofuse_speedup_vs_{b}"] = r.ms / res["elsa_nofuse"].ms
        if r is not None and r.peak_bytes and e.peak_bytes:
            row[f"mem_vs_{b}"] = e.peak_bytes / r.peak_bytes
    if queued > 1:
        _record(row, "queued", measure({n: variants[n] for n, r in res.items() if r.ms is not None}, warmup=1,
                                       rounds=rounds, budget_ms=budget_ms, memory=False, calls=queued))
    if graphs and device == "cuda":
        _record(row, "graph", measure_graphed({n: f for n, f in variants.items() if res[n].ms is not None},
                                              rounds=rounds, budget_ms=budget_ms))
    if case.mode == "fwd" and e.ms:
        base = next((b for b in BASELINES if res.get(b) is not None and res[b].ms), None)
        if base:
            try:
                # copies at once: under CUDA graphs (reduce-overhead, max-autotune) an output lives
                # in the graphs' shared pool, which the next variant's replay may overwrite
                out_e = variants["elsa"]().detach().to(torch.float32, copy=True)
                out_b = variants[base]().detach().to(torch.float32, copy=True)
                row["max_diff"] = (out_e - out_b).abs().max().item()
                row["max_diff_vs"] = base
            except Exception as ex:  # noqa: BLE001
                row["max_diff"] = None
                row["error"] = f"diff: {type(ex).__name__}"
    if profile is not None and device == "cuda":
        head = {k: row[k] for k in ("model", "size", "batch", "mode", "dtype")}
        for name, fn in variants.items():
            try:
                new, line = profile_rows(fn, {**head, "variant": name})
            except Exception as ex:  # noqa: BLE001 - an unprofilable variant is a note, not a crash
                new, line = [], type(ex).__name__
            profile += new
            print(f"  profile {name}: {line}")
    # (the blocks' residual passes hand every call autograd records to the block's own forward)
    delegated = sum(s.delegated for _, s in patched_modules(elsa) if not isinstance(s.adapter, PreNormBlock))
    if delegated:
        row["delegated_calls"] = delegated
    del native, elsa, elsa_eager, variants, x
    if nofuse is not None:
        del elsa_nf
    if static_launch:
        del elsa_st
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = [(mode, dt) for mode in ("fwd", "train") for dt in ("fp32", "bf16")
              if any(r["mode"] == mode and r["dtype"] == dt for r in rows)]
    if not groups:
        return
    fig, axes = plt.subplots(len(groups), 1, figsize=(max(8, 0.45 * len(rows) + 4), 3.2 * len(groups)), squeeze=False)
    for ax, (mode, dt) in zip(axes[:, 0], groups):
        rs = [r for r in rows if r["mode"] == mode and r["dtype"] == dt]
        xs = range(len(rs))
        for i, b in enumerate(BASELINES):
            ys = [r.get(f"speedup_vs_{b}") or 0.0 for r in rs]
            # the per-round ratios' 95% interval as an error bar (none where a row has no interval)
            lo = [max(0.0, y - r.get(f"speedup_vs_{b}_lo", y)) for y, r in zip(ys, rs)]
            hi = [max(0.0, r.get(f"speedup_vs_{b}_hi", y) - y) for y, r in zip(ys, rs)]
            err = [lo, hi]
            ax.bar([x + (i - 0.5) * 0.4 for x in xs], ys, width=0.4, label=f"vs timm {b}", yerr=err, capsize=2)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['model']} {r['size']} b{r['batch']}" for r in rs], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("speedup (native / ELSA)")
        ax.set_title(f"{'forward' if mode == 'fwd' else 'training step'}, {dt}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the headline cases only (a few minutes)")
    ap.add_argument("--family", choices=["vit", "swin", "all"], default="all")
    ap.add_argument("--models", nargs="*", choices=list(VIT) + list(SWIN), help="a subset of the models")
    ap.add_argument("--sizes", nargs="*", type=int, help="image sizes (replace the defaults; filter with --quick)")
    ap.add_argument("--batches", nargs="*", type=int, help="batch sizes (replace the defaults; filter with --quick)")
    ap.add_argument("--modes", nargs="*", choices=["fwd", "train"])
    ap.add_argument("--dtypes", nargs="*", choices=["fp32", "bf16"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per variant (at most)")
    ap.add_argument("--budget-s", type=float, default=6.0,
                    help="per case: fewer rounds (at least 3) when the timed rounds would take longer")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="start no new case after this many minutes (the CSV keeps what finished)")
    ap.add_argument("--matmul", choices=["highest", "high"], default="highest",
                    help="torch.set_float32_matmul_precision for the fp32 cases (ELSA 'auto' follows it)")
    ap.add_argument("--precision", default="auto", help="ELSA precision passed to patch()")
    ap.add_argument("--name", help="output file stem (default models[_quick][_family])")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one call per variant: CUDA time and launch count per kernel category and "
                         "kernel, and the aten operators dispatched (what runs outside a compiled graph's kernels) "
                         "→ <name>_profile.csv")
    ap.add_argument("--graphs", action="store_true",
                    help="also time each variant replayed from a CUDA graph (no host launch work): "
                         "<variant>_graph_ms, graph_speedup_vs_<baseline>")
    ap.add_argument("--nofuse", nargs="*", metavar="OPTION",
                    help="also ELSA with patch(fuse_windows=False) for Swin, patch(fuse_residual=False) for ViT "
                         "(variant elsa_nofuse); with OPTIONs, those patch options False instead "
                         "(e.g. fuse_position_bias)")
    ap.add_argument("--host", action="store_true",
                    help="also each variant's host time per call, started on an idle GPU and not waited for "
                         "(<variant>_host_ms), and its share of the wall time (<variant>_host_share: near 1, "
                         "the host's Python and launches pace that variant, not the GPU)")
    ap.add_argument("--compile", choices=["default", "reduce-overhead", "max-autotune"],
                    help="run every variant under torch.compile in this mode (compiled in the warm-up; "
                         "not with --graphs)")
    ap.add_argument("--static-launch", action="store_true",
                    help="with --compile default: also ELSA compiled with inductor's static launcher for its "
                         "kernels (variant elsa_static; static_speedup_vs_elsa, user_kernel_launchers)")
    ap.add_argument("--with-eager", action="store_true",
                    help="with --compile: also the patched model run eagerly in the same rounds (variant "
                         "elsa_eager; compile_speedup_vs_eager > 1: compiling it gains)")
    ap.add_argument("--no-unfused", action="store_true",
                    help="leave out timm's explicit-softmax baseline where its SDPA path exists (one compile "
                         "fewer under --compile)")
    ap.add_argument("--queued", type=int, default=0, metavar="K",
                    help="also time each variant over K calls queued back to back, waited for once "
                         "(<variant>_queued_ms a call, queued_speedup_vs_<baseline>): the host's work before a "
                         "call's first kernel then overlaps the GPU's previous call, as in a loop that does "
                         "not wait for its results")
    ap.add_argument("--python-host", action="store_true",
                    help="also the patched model with its eager calls on the Python host path instead of their "
                         "native replay (variant elsa_python; native_speedup_vs_python)")
    a = ap.parse_args(argv)
    if any(n < 1 for n in (a.sizes or ()) + (a.batches or ())):
        ap.error("--sizes and --batches take positive ints")
    why = device_problem(a.device)
    if why:
        ap.error(f"--device: {why}")
    use_device(a.device)
    if a.queued < 0 or a.queued == 1:
        ap.error("--queued K takes K ≥ 2 calls (0: off)")
    if a.static_launch and a.compile != "default":
        ap.error("--static-launch compares launchers of compiled steps: pass --compile default")
    if a.with_eager and not a.compile:
        ap.error("--with-eager compares a compiled patched model with its eager run: pass --compile MODE")
    if a.compile and a.graphs:
        ap.error("--compile and --graphs measure different things; pick one (reduce-overhead already replays "
                 "CUDA graphs)")
    if a.device == "cpu":
        print("note: no GPU; this runs on the CPU (reference backend unless TRITON_INTERPRET=1) — "
              "use small --sizes/--batches", file=sys.stderr)
    torch.set_float32_matmul_precision(a.matmul)
    if a.device == "cuda":
        native_ready()
    if a.quick:
        cases = [c for c in quick_cases() if (not a.sizes or c.size in a.sizes) and (not a.batches or c.batch in a.batches)]
    else:
        cases = all_cases(a.family, a.sizes, a.batches)
    keep = lambda c: ((not a.models or c.model in a.models) and (not a.modes or c.mode in a.modes)  # noqa: E731
                      and (not a.dtypes or c.dtype in a.dtypes))
    cases = [c for c in cases if keep(c)]
    if not cases:
        ap.error("no case matches the --models / --sizes / --batches / --modes / --dtypes given")
    parts = ["models"] + (["quick"] if a.quick else []) + ([a.family] if a.family != "all" and not a.quick else [])
    parts += ["-".join(m.lower() for m in a.models)] if a.models else []
    parts += [f"compile_{a.compile.replace('-', '_')}"] if a.compile else []
    name = a.name or "_".join(parts)
    out_dir = results_dir()
    rows, prof_rows = [], []
    t0 = time.time()
    for i, c in enumerate(cases):
        if a.max_minutes and time.time() - t0 > 60 * a.max_minutes:
            print(f"time limit: {len(cases) - i} case(s) not run, from {c.label}")
            break
        print(f"[{i + 1}/{len(cases)}] {c.label}", flush=True)
        rows.append(run_case(c, a.device, a.warmup, a.rounds, a.precision, 1e3 * a.budget_s,
                             prof_rows if a.profile else None, a.graphs, a.compile, a.nofuse, a.host,
                             a.static_launch, a.python_host, a.with_eager, not a.no_unfused, a.queued))
        write_csv(rows, out_dir / f"{name}.csv")  # written as we go: a killed run keeps its rows
    cols = ["model", "size", "batch", "mode", "dtype", "elsa_ms", "fused_ms", "unfused_ms", "speedup_vs_fused",
            "speedup_vs_fused_lo", "speedup_vs_fused_hi", "speedup_vs_unfused", "speedup_vs_unfused_lo",
            "speedup_vs_unfused_hi", "elsa_mib", "fused_mib", "unfused_mib", "max_diff"]
    if a.nofuse is not None:
        cols += ["elsa_nofuse_ms", "nofuse_speedup_vs_fused", "nofuse_speedup_vs_unfused"]
    if a.graphs:
        cols += ["elsa_graph_ms", "graph_speedup_vs_fused", "graph_speedup_vs_unfused"]
        if a.nofuse is not None:
            cols += ["nofuse_graph_speedup_vs_fused", "nofuse_graph_speedup_vs_unfused"]
    if a.compile:
        cols += ["graphs_compiled", "graph_breaks", "steady"]
        if a.compile != "default":
            cols += ["elsa_cudagraph_skips", "fused_cudagraph_skips"]
    if a.static_launch:
        cols += ["elsa_static_ms", "static_speedup_vs_elsa"]
    if a.python_host:
        cols += ["elsa_python_ms", "native_speedup_vs_python"]
    if a.with_eager:
        cols += ["elsa_eager_ms", "compile_speedup_vs_eager"]
    if a.host:
        cols += [f"{v}_host_share" for v in ("elsa", *BASELINES)]
    if a.queued:
        cols += ["elsa_queued_ms", "queued_speedup_vs_fused", "queued_speedup_vs_unfused"]
    print(fmt_table(rows, cols))
    errs = [(r, k) for r in rows for k in r if k.endswith("error")]
    for r, k in errs:
        print(f"  {r['model']} {r['size']} b{r['batch']} {r['mode']} {r['dtype']}: {k} = {r[k]}")
    plot(rows, out_dir / f"{name}.png")
    if prof_rows:
        write_csv(prof_rows, out_dir / f"{name}_profile.csv")
    print(f"wrote {out_dir / (name + '.csv')} and {name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
