"""VGGT vs frame count: ELSA against native SDPA, with and without token merging, lean vs default
memory; the FastVGGT fork side by side when its source is available.

    python benchmarks/frames.py --quick                         # 8/16/32 frames, bf16, a few minutes
    python benchmarks/frames.py --dtype fp32 --frames 50,100 --parts aggregator --variants native,elsa
    python benchmarks/frames.py --dtype bf16 --frames 400 --variants native,elsa,elsa-merge,elsa-lean
    python benchmarks/frames.py --dtype bf16 --frames 1000,2000 --parts full --variants elsa-lean-merge
    python benchmarks/frames.py --dtype bf16 --frames 400,2000 --parts full --variants elsa-lean,elsa-lean-offload
    python benchmarks/frames.py --dtype bf16 --frames 400 --parts aggregator --variants elsa,elsa-merge --profile
    python benchmarks/frames.py --dtype bf16 --frames 100 --parts aggregator --variants native,elsa --compile default
    python benchmarks/frames.py --dtype bf16 --frames 2000,3000 --parts full --variants elsa-lean,elsa-lean-offload \
        --memory-rehearsal                                      # peak memory only (see rehearse_attention)

Writes benchmarks/results/<device>/frames.csv and frames.png (time and peak memory vs frames), and
prints a table and, per variant with two or more frame counts, the largest frame count its memory
trend predicts for this GPU.

Model: upstream VGGT (``vggt`` importable, e.g. PYTHONPATH=third_party/vggt for a clone of its
repository there), random weights (or ``--weights model.pt``), images 392×518 (1041 tokens per
frame), built once on the GPU and reused.
Parts: ``aggregator`` (model.aggregator(images)) and ``full`` (model(images): aggregator + camera,
depth and point heads). dtypes: ``bf16`` (autocast, as VGGT's demo runs) and ``fp32`` (no autocast;
matmul precision "highest" for every linear layer; ELSA in ``--fp32-precision``, default ``fp16x3``
— what ``patch()`` runs under "highest" — or ``tf32x3``, both float32-class accurate).

Variants: native (unpatched: SDPA), elsa (patched), elsa-lean (lean_memory=True), elsa-merge
(TokenMerging(ratio=0.9)), elsa-merge-fast (TokenMerging.fast()), elsa-lean-merge, elsa-lean-merge-proj
(+ similarity_dim=64), elsa-lean-merge-reuse (+ reuse=2), elsa-lean-merge-protect5 (+ protect=0.05: half of
FastVGGT's protected destinations), elsa-lean-merge-fast (all three), elsa-lean-offload (+
lean_offload=True: the layers only the DPT heads read in host memory), elsa-lean-offload-merge.
FastVGGT fork (bf16 only; it casts its model to bf16): fastvggt-native / fastvggt-elsa (its merging
from block 0, SDPA or ELSA), fastvggt-nomerge-native / -elsa. The fork installs under the same package name ``vggt``, so it runs in a subprocess whose
sys.path starts with the fork's source (``--fastvggt PATH``, $FASTVGGT_SRC or third_party/FastVGGT).

Timing: one case of VGGT at hundreds of frames takes tens of seconds, so each variant runs
``--repeats`` times (default 1; minimum reported) and every run records its time (CUDA events) and
its peak memory above what was allocated before the call (weights, input) — not the harness's
separate warm-up / memory / timing calls. A warm-up pass compiles every kernel a frame count's
calls take before they are timed (at that frame count up to 131 frames, beyond it at one of the
same class, :func:`benchmarks.harness.warmup_frames`; ``--no-warmup`` skips it: then ELSA's times include Triton's
compile, seconds; column warm_up).
Variants of one case run back to back (interleaved across repeats). A variant that runs out of
memory is recorded as OOM and skipped at larger frame counts.

Accuracy of merging (full model, the fixed synthetic input): depth and world-point relative L2
error and max |Δ pose encoding| of each variant against its reference — elsa-merge vs elsa,
elsa-lean-merge vs elsa-lean, elsa vs native, elsa-lean vs elsa (should be 0), fastvggt-elsa vs
fastvggt-native, fastvggt-native vs fastvggt-nomerge-native.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness import fmt_table, metadata, profile_rows, results_dir, warmup_frames, write_csv  # noqa: E402

VARIANTS = {  # name → patch options (None = unpatched); order = run order (references first)
    "native": None,
    "elsa": {},
    "elsa-nofuse": {"fuse_residual": False},  # the blocks' own residual adds and norms around ELSA
    "elsa-lean": {"lean_memory": True},
    "elsa-lean-nofuse": {"lean_memory": True, "fuse_residual": False},
    "elsa-merge": {"token_merging": True},
    "elsa-merge-fast": {"token_merging": "fast"},
    "elsa-lean-merge": {"lean_memory": True, "token_merging": True},
    # the cheaper assignments of TokenMerging, one at a time and as the fast preset
    "elsa-lean-merge-proj": {"lean_memory": True, "token_merging": {"similarity_dim": 64}},
    "elsa-lean-merge-reuse": {"lean_memory": True, "token_merging": {"reuse": 2}},
    "elsa-lean-merge-fast": {"lean_memory": True, "token_merging": "fast"},
    # fewer destinations: half of FastVGGT's protected tokens (what the fast preset takes), alone
    "elsa-lean-merge-protect5": {"lean_memory": True, "token_merging": {"protect": 0.05}},
    "elsa-lean-offload": {"lean_memory": True, "lean_offload": True},
    "elsa-lean-offload-merge": {"lean_memory": True, "lean_offload": True, "token_merging": True},
}
FORK_VARIANTS = {  # name → (fork merging on?, patched?)
    "fastvggt-nomerge-native": (False, False),
    "fastvggt-native": (True, False),
    "fastvggt-nomerge-elsa": (False, True),
    "fastvggt-elsa": (True, True),
}
REFERENCE = {"elsa": "native", "elsa-nofuse": "native", "elsa-lean": "elsa", "elsa-lean-nofuse": "elsa-lean",
             "elsa-merge": "elsa",
             "elsa-lean-merge": "elsa-lean",
             "elsa-merge-fast": "elsa", "elsa-lean-merge-proj": "elsa-lean", "elsa-lean-merge-reuse": "elsa-lean",
             "elsa-lean-merge-fast": "elsa-lean", "elsa-lean-merge-protect5": "elsa-lean",
             "elsa-lean-offload": "elsa-lean", "elsa-lean-offload-merge": "elsa-lean-merge",
             "fastvggt-elsa": "fastvggt-native", "fastvggt-native": "fastvggt-nomerge-native",
             "fastvggt-nomerge-elsa": "fastvggt-nomerge-native"}
DTYPES = {"bf16": torch.bfloat16, "fp32": None}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for the logic's smoke test
DEFAULT_FRAMES = {"bf16": [50, 100, 200, 400], "fp32": [50, 100]}


def csv_list(kind):
    def parse(s):
        return [kind(x) for x in s.split(",") if x.strip()]
    return parse


def synthetic_frames(S: int, hw=(392, 518), seed=0, device=None) -> torch.Tensor:
    """[1, S, 3, H, W] in [0, 1]: one smooth random texture seen with a sliding camera (a fixed input)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    H, W = hw
    base = torch.rand(1, 3, H // 16 + 1, W // 8 + 1, generator=g)
    canvas = torch.nn.functional.interpolate(base, size=(H, 2 * W), mode="bicubic", align_corners=False).clamp(0, 1)
    canvas = canvas.to(device or DEVICE)
    shifts = torch.linspace(0, W - 1, S).round().long().tolist()
    return torch.stack([canvas[0, :, :, s:s + W] for s in shifts])[None]


# ------------------------------------------------------------------------------------------------
# One measured call
# ------------------------------------------------------------------------------------------------

def free_memory():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def out_of_memory(e: BaseException):
    """The status of a row whose call raised ``e`` when it ran out of memory, else None. Besides the
    device allocator's OutOfMemoryError, a failed page-locked host allocation (lean_offload) surfaces
    as a plain CUDA error."""
    if isinstance(e, torch.OutOfMemoryError):
        return "OOM"
    if isinstance(e, RuntimeError) and "out of memory" in str(e).lower():
        return "OOM (" + str(e).splitlines()[0][:60] + ")"
    return None


def timed_call(fn):
    """(output, ms, peak bytes above the allocation before the call) of one call."""
    free_memory()
    if DEVICE != "cuda":
        t = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t) * 1e3, 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = fn()
    b.record()
    b.synchronize()
    return out, a.elapsed_time(b), torch.cuda.max_memory_allocated() - base


def forward(model, part, images, dtype):
    with torch.no_grad(), torch.autocast(DEVICE, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        if part == "aggregator":
            model.aggregator(images)
            return None
        preds = model(images)
    # keep what the accuracy columns need, off the GPU (it would inflate later variants' peaks)
    return {k: preds[k].float().cpu() for k in ("pose_enc", "depth", "world_points") if k in preds}


def accuracy(out, ref) -> dict:
    if out is None or ref is None:
        return {}
    cols = {}
    for key, name in (("depth", "depth_rel_err"), ("world_points", "points_rel_err")):
        if key in out and key in ref:
            cols[name] = ((out[key] - ref[key]).norm() / ref[key].norm().clamp_min(1e-30)).item()
    if "pose_enc" in out and "pose_enc" in ref:
        cols["pose_max_abs_diff"] = (out["pose_enc"] - ref["pose_enc"]).abs().max().item()
    return cols


# ------------------------------------------------------------------------------------------------
# Sweep (shared by the upstream run and the fork worker)
# ------------------------------------------------------------------------------------------------

def _variant_call(model, apply, v, dtype, call):
    """``call()`` with ``model`` set up for variant ``v`` (``apply``; undone after): (its result, None),
    or (None, the out-of-memory message). Returned outside the except block, whose traceback would
    hold the failed call's tensors."""
    undo = apply(model, v, dtype)
    try:
        return call(), None
    except RuntimeError as e:
        failed = out_of_memory(e)
        if not failed:
            raise
    finally:
        undo()
    return None, failed


def sweep(model, variants: dict, apply, parts, dtypes, frames_by_dtype, repeats, warmup, hw, log=print,
          rehearsal=False, rows=None):
    """Run every (dtype, frames, part, variant); ``apply(model, variant, dtype)`` sets the model up for
    a variant and returns an undo function. Returns CSV rows. ``rehearsal``: the whole sweep runs
    under :func:`rehearse_attention` (ELSA's attention only allocates); rows then carry the peak
    memory alone."""
    rows, oom = ([] if rows is None else rows), set()  # a caller's list keeps the rows of a failed sweep
    P = 5 + (hw[0] // 14) * (hw[1] // 14)
    with rehearse_attention() if rehearsal else contextlib.nullcontext():
        for dname in dtypes:
            dtype = DTYPES[dname]
            prev = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("highest")
            try:
                warmed = set()
                for S in frames_by_dtype[dname]:
                    w = warmup_frames(S)
                    if warmup and w not in warmed:  # compile every kernel the timed calls take
                        warmed.add(w)
                        x = synthetic_frames(w, hw)
                        for part in parts:
                            for v in variants:
                                if (dname, part, v) in oom:
                                    continue
                                _, failed = _variant_call(model, apply, v, dtype,
                                                          lambda: forward(model, part, x, dtype))
                                if failed:  # (the timed call records it; this one's memory goes first)
                                    free_memory()
                        del x
                        free_memory()
                    x = synthetic_frames(S, hw)
                    for part in parts:
                        best = {v: None for v in variants}
                        outs = {}
                        for rep in range(repeats):
                            for v in variants:
                                if (dname, part, v) in oom:
                                    continue
                                res, failed = _variant_call(model, apply, v, dtype,
                                                            lambda: timed_call(lambda: forward(model, part, x, dtype)))
                                if failed:
                                    oom.add((dname, part, v))
                                    best[v] = failed
                                    free_memory()
                                    continue
                                out, ms, peak = res
                                if best[v] is None or ms < best[v][0]:
                                    best[v] = (ms, peak)
                                outs[v] = out
                                del out
                        for v, r in best.items():
                            row = {"part": part, "dtype": dname, "frames": S, "tokens": S * P, "variant": v,
                                   "repeats": repeats, "warm_up": bool(warmup),
                                   "precision": FP32_PRECISION if dname == "fp32" and v != native_of(v) else ""}
                            if r is None:
                                row["status"] = "skipped (OOM at fewer frames)"
                            elif isinstance(r, str):
                                row["status"] = r
                            elif rehearsal:
                                row.update(status="memory rehearsal", peak_gib=r[1] / 2**30)
                            else:
                                ms, peak = r
                                row.update(status="ok", seconds=ms / 1e3, peak_gib=peak / 2**30)
                                base = best.get(native_of(v))
                                if isinstance(base, tuple):
                                    row["speedup_vs_native"] = base[0] / ms
                                    if base[1] > 0:
                                        row["memory_vs_native"] = peak / base[1]
                                ref = REFERENCE.get(v)
                                acc = accuracy(outs.get(v), outs.get(ref))
                                if acc:
                                    row.update(accuracy_vs=ref, **acc)
                            rows.append(row)
                            log(_line(row))
                        del outs
                    del x
                    free_memory()
            finally:
                torch.set_float32_matmul_precision(prev)
    return rows


COMPILE_VARIANTS = ("native", "elsa", "elsa-nofuse")  # no merging or lean mode: their Python runs per call
COMPILE_BACKEND = "inductor"  # (the CPU test of this path compiles with aot_eager)


def sweep_compiled(model, variants: list, apply, dtypes, frames_by_dtype, repeats, hw, mode: str, log=print,
                   rows=None, profile: Optional[list] = None) -> list:
    """The aggregator of every variant eagerly and under ``torch.compile(mode=mode)``, at each frame
    count, in one process: ``<variant>`` and ``<variant>+compile`` rows, the compiled ones compared
    with the compiled native aggregator (``speedup_vs_native``) and with their own eager call
    (``speedup_vs_eager``). Each patched variant is a copy of the model patched once (patching again
    would give a compiled graph new modules to guard on). The eager calls run interleaved; each
    compiled variant then runs on its own, from a fresh dynamo state: native VGGT's RoPE reads
    positions.max() with .item(), a graph break inside the aggregator's loop over blocks, on which
    dynamo gives up compiling the aggregator's code as a whole (its blocks compile alone) — a
    decision kept per code object, which a variant compiled after it would inherit. A compiled
    variant compiles at the frame count it is timed at, in two warm-up calls, with ``fullgraph=True``
    where dynamo traces the aggregator whole (column fullgraph; else with graph breaks):
    graphs_compiled and graph_breaks are the warm-up's, and a graph compiled in the timed calls
    marks the row not ``steady``. (vggt's own RoPE breaks the native graph in every block; a
    patched aggregator forms RoPE traceably and compiles whole: see adapters/vggt/attention.py's
    _rope and _token_tables.) ``max_rel_err``: the last block's output against the native eager
    call's (relative L2). With ``profile`` (a list), one eagerly and one compiled call
    of each variant at the dtype's largest frame count are profiled into it (see profile_rows):
    which kernels a compiled graph runs where the eager call ran ELSA's."""
    import copy
    rows = [] if rows is None else rows
    P = 5 + (hw[0] // 14) * (hw[1] // 14)
    counters = torch._dynamo.utils.counters
    kw = ({"backend": COMPILE_BACKEND} if COMPILE_BACKEND != "inductor"
          else {"mode": None if mode == "default" else mode})
    for dname in dtypes:
        dtype = DTYPES[dname]
        prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        copies, undos = {}, []

        def run(fn, x):
            with torch.no_grad(), torch.autocast(DEVICE, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                return fn(x)[0][-1].float()
        try:
            for v in variants:
                if VARIANTS[v] is None:
                    copies[v] = model
                else:
                    copies[v] = copy.deepcopy(model)
                    undos.append(apply(copies[v], v, dtype))
            for S in frames_by_dtype[dname]:
                x = synthetic_frames(S, hw)
                ref = run(model.aggregator, x) if "native" in variants else None
                best = {}

                def time_it(name, fn, reps):
                    for _ in range(reps):
                        out, ms, peak = timed_call(lambda: run(fn, x))
                        err = None if ref is None else ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                        del out
                        if name not in best or ms < best[name][0]:
                            best[name] = (ms, peak, err)
                for v in variants:  # (warm-up: the kernels compile)
                    run(copies[v].aggregator, x)
                for _ in range(repeats):
                    for v in variants:
                        time_it(v, copies[v].aggregator, 1)
                compiled_by = {}
                for v in variants:
                    for fullgraph in (True, False):  # (one graph where dynamo can trace it whole)
                        torch._dynamo.reset()
                        counters.clear()
                        fn = torch.compile(copies[v].aggregator, fullgraph=fullgraph, **kw)
                        try:
                            for _ in range(2):
                                run(fn, x)
                            break
                        except Exception as e:  # (dynamo's Unsupported and kin: what fullgraph refuses)
                            if not fullgraph:
                                raise
                            why = (str(e).splitlines() or [type(e).__name__])[0][:120]
                            log(f"{v}: no single graph ({why}); compiled with graph breaks")
                    graphs = counters["stats"]["unique_graphs"]
                    breaks = sum(counters["graph_break"].values())
                    time_it(f"{v}+compile", fn, repeats)
                    compiled_by[v] = (fullgraph, graphs, breaks, counters["stats"]["unique_graphs"] == graphs)
                    if profile is not None and S == max(frames_by_dtype[dname]):
                        for name, f in ((v, copies[v].aggregator), (f"{v}+compile", fn)):
                            head = {"part": "aggregator", "dtype": dname, "frames": S, "variant": name}
                            new, line = profile_rows(lambda: run(f, x), head,
                                                     device="cuda" if DEVICE == "cuda" else "cpu")
                            profile += new
                            log(f"profile {dname} {S} frames {name}: {line}")
                    del fn
                torch._dynamo.reset()
                for name, (ms, peak, err) in best.items():
                    compiled = name.endswith("+compile")
                    v = name.removesuffix("+compile")
                    row = {"part": "aggregator", "dtype": dname, "frames": S, "tokens": S * P, "variant": name,
                           "repeats": repeats, "warm_up": True, "compile": mode if compiled else "",
                           "precision": FP32_PRECISION if dname == "fp32" and VARIANTS[v] is not None else "",
                           "status": "ok", "seconds": ms / 1e3,
                           # (CUDA-graph modes allocate their pool in the warm-up: no peak of the call)
                           "peak_gib": float("nan") if compiled and mode in ("reduce-overhead", "max-autotune")
                           else peak / 2**30}
                    base = best.get("native+compile" if compiled else "native")
                    if base is not None:
                        row["speedup_vs_native"] = base[0] / ms
                    if compiled:
                        row["speedup_vs_eager"] = best[v][0] / ms
                        row.update(zip(("fullgraph", "graphs_compiled", "graph_breaks", "steady"), compiled_by[v]))
                    if err is not None:
                        row["max_rel_err"] = err
                    rows.append(row)
                    log(_line(row) + ("" if not compiled else f"  x{row['speedup_vs_eager']:.2f} vs eager, "
                                      f"{row['graphs_compiled']} graph(s), {row['graph_breaks']} break(s)"
                                      f"{'' if row['steady'] else ', NOT STEADY'}"))
                del x, ref
                free_memory()
        finally:
            for undo in undos:
                undo()
            del copies
            torch._dynamo.reset()
            torch.set_float32_matmul_precision(prev)
            free_memory()
    return rows


def profile_variants(model, variants: dict, apply, parts, dtypes, frames_by_dtype, hw, log=print) -> list[dict]:
    """One profiled call per (dtype, part, variant) at the dtype's largest frame count: where the CUDA
    time goes (attention kernels, GEMMs, the merging's index/scatter/sort work, ...)."""
    rows = []
    for dname in dtypes:
        dtype, S = DTYPES[dname], max(frames_by_dtype[dname])
        x = synthetic_frames(S, hw)
        prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            for part in parts:
                for v in variants:
                    undo = apply(model, v, dtype)
                    head = {"part": part, "dtype": dname, "frames": S, "variant": v}
                    try:
                        new, line = profile_rows(lambda: forward(model, part, x, dtype), head)
                    except RuntimeError as e:
                        new, line = [], out_of_memory(e)
                        if not line:
                            raise
                    finally:
                        undo()
                    rows += new
                    log(f"profile {dname} {part} {S} frames {v}: {line}")
                    free_memory()
        finally:
            torch.set_float32_matmul_precision(prev)
        del x
    return rows


REHEARSAL_VARIANTS = ("elsa", "elsa-lean", "elsa-lean-offload")


def rehearse_attention():
    """The switch under which ELSA's Triton kernels allocate and launch nothing
    (``elsa_vision.kernels.launch.allocations_only``, a context manager): ELSA's attention allocates
    its output, row statistics and, for a split launch, the phase-1 summaries, as a real call plans
    them, and everything else runs as is, so a call's peak memory is the real run's, in minutes
    instead of the hours of attention arithmetic at thousands of frames. Outputs are garbage: only
    the memory column means anything. Variants whose shapes depend on values (token merging) or that
    run SDPA (native) are not rehearsed."""
    from elsa_vision.kernels.launch import allocations_only
    return allocations_only()


def native_of(variant: str) -> str:
    """The SDPA run a variant's speed and memory are compared with."""
    return variant.replace("elsa", "native") if variant.startswith("fastvggt") else "native"


def _line(row) -> str:
    s = f"{row['part']:>10} {row['dtype']:>4} {row['frames']:>5} frames {row['variant']:>24}: "
    if row.get("status") != "ok":
        return s + row.get("status", "") + (f"  {row['peak_gib']:7.2f} GiB" if "peak_gib" in row else "")
    s += f"{row['seconds']:8.3f} s  {row['peak_gib']:7.2f} GiB"
    if "speedup_vs_native" in row:
        s += f"  x{row['speedup_vs_native']:.2f} speed"
    if "memory_vs_native" in row:
        s += f"  x{row['memory_vs_native']:.2f} memory"
    if "depth_rel_err" in row:
        s += f"  vs {row['accuracy_vs']}: depth {row['depth_rel_err']:.2e}"
        if "points_rel_err" in row:
            s += f" points {row['points_rel_err']:.2e}"
        s += f" pose {row['pose_max_abs_diff']:.2e}"
    return s


# ------------------------------------------------------------------------------------------------
# Upstream VGGT
# ------------------------------------------------------------------------------------------------

def build_upstream(weights):
    try:
        from vggt.models.vggt import VGGT
    except ImportError:
        sys.exit("vggt is not importable: pip install git+https://github.com/facebookresearch/vggt "
                 "(or PYTHONPATH=<the folder that holds the vggt package>, e.g. third_party/vggt for a clone of its "
                 "repository)")
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialise on the GPU: seconds instead of half a minute
        model = VGGT(enable_track=False)
    model = model.cuda()  # buffers made by legacy constructors (torch.FloatTensor) stay on the CPU above
    if weights:
        model.load_state_dict(torch.load(weights, map_location="cuda", weights_only=True), strict=False)
    return model.eval()


# ELSA's precision for the float32 cases (--fp32-precision)
FP32_PRECISION = "fp16x3"


def token_merging(opts: dict):
    """The TokenMerging of a variant's options (ratio 0.9, seed 0; None without merging)."""
    import elsa_vision
    tm = opts.get("token_merging")
    if tm == "fast":
        return elsa_vision.TokenMerging.fast(ratio=0.9, seed=0)
    if tm:
        return elsa_vision.TokenMerging(ratio=0.9, seed=0, **(tm if isinstance(tm, dict) else {}))
    return None


def upstream_apply(model, variant, dtype):
    import elsa_vision
    opts = VARIANTS[variant]
    if opts is None:
        return lambda: None
    kw = {k: v for k, v in opts.items() if k != "token_merging"}
    kw["precision"] = FP32_PRECISION if dtype is None else "auto"
    kw["token_merging"] = token_merging(opts)
    elsa_vision.patch(model, **kw)
    return lambda: elsa_vision.unpatch(model)


# ------------------------------------------------------------------------------------------------
# The FastVGGT fork, in its own process
# ------------------------------------------------------------------------------------------------

def fork_source(arg) -> Path | None:
    if arg == "none":
        return None
    src = Path(arg or os.environ.get("FASTVGGT_SRC") or ROOT / "third_party" / "FastVGGT")
    return src if (src / "merging" / "merge.py").is_file() and (src / "vggt").is_dir() else None


def fork_worker(args):
    sys.path.insert(0, str(args.fork_src))  # before anything imports `vggt`: the fork's package wins
    import vggt.layers.attention as fork_attention
    if not Path(fork_attention.__file__).resolve().is_relative_to(args.fork_src.resolve()):
        sys.exit(f"`vggt` resolves to {fork_attention.__file__}, not the fork in {args.fork_src}: an installed "
                 "upstream vggt (editable install?) shadows it; make upstream importable with PYTHONPATH instead")
    from vggt.models.vggt import VGGT
    import elsa_vision
    torch.manual_seed(0)  # as build_upstream: the same aggregator and camera-head weights
    with torch.device("cuda"):
        model = VGGT(merging=0)
    if args.weights:  # the upstream checkpoint (the fork has no point head: those keys are skipped)
        model.load_state_dict(torch.load(args.weights, map_location="cuda", weights_only=True), strict=False)
    model = model.cuda().eval().to(torch.bfloat16)
    model.update_patch_dimensions(args.width // 14, args.height // 14)

    def apply(m, variant, dtype):
        merging, patched = FORK_VARIANTS[variant]
        m.aggregator.merging = 0 if merging else None
        if patched:
            elsa_vision.patch(m)
            return lambda: elsa_vision.unpatch(m)
        return lambda: None

    variants = {v: None for v in FORK_VARIANTS if v in args.fork_variants}
    log = lambda s: print(s, flush=True)  # noqa: E731
    rows = sweep(model, variants, apply, args.parts, ["bf16"], {"bf16": args.frames_bf16}, args.repeats,
                 not args.no_warmup, (args.height, args.width), log=log)
    prof = profile_variants(model, variants, apply, args.parts, ["bf16"], {"bf16": args.frames_bf16},
                            (args.height, args.width), log=log) if args.profile else []
    Path(args.rows_out).write_text(json.dumps({"rows": rows, "profile": prof}))


def run_fork(args, src: Path, frames):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--fork-worker", "--fork-src", str(src),
               "--rows-out", str(out), "--frames-bf16", ",".join(map(str, frames)), "--parts", ",".join(args.parts),
               "--fork-variants", ",".join(args.fork_variants), "--repeats", str(args.repeats),
               "--height", str(args.height), "--width", str(args.width)] + (["--no-warmup"] if args.no_warmup else []) \
            + (["--profile"] if args.profile else []) \
            + (["--weights", str(Path(args.weights).resolve())] if args.weights else [])
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # keep upstream vggt off its path
        env["PYTHONPATH"] = str(ROOT)
        print(f"\nFastVGGT fork from {src} (subprocess)")
        proc = subprocess.run(cmd, env=env, cwd=str(ROOT))
        if proc.returncode != 0 or not out.is_file():
            print(f"FastVGGT run failed (exit {proc.returncode}); its rows are missing")
            return [], []
        got = json.loads(out.read_text())
        return got["rows"], got["profile"]


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------

def capacity(rows, total_bytes) -> list[dict]:
    """Largest frame count the peak-memory trend (linear in frames) predicts for this GPU."""
    out = []
    keys = {(r["part"], r["dtype"], r["variant"]) for r in rows}
    for part, dname, v in sorted(keys):
        pts = sorted((r["frames"], r["peak_gib"] * 2**30) for r in rows
                     if (r["part"], r["dtype"], r["variant"]) == (part, dname, v)
                     and r.get("status") in ("ok", "memory rehearsal"))
        if len(pts) < 2 or pts[-1][0] == pts[0][0]:
            continue
        (s0, m0), (s1, m1) = pts[0], pts[-1]
        slope = (m1 - m0) / (s1 - s0)
        if slope <= 0:
            continue
        est = int(s1 + (0.95 * total_bytes - m1) / slope)
        out.append({"part": part, "dtype": dname, "variant": v, "gib_per_frame": slope / 2**30,
                    "estimated_max_frames": est})
    return out


def plot(rows, path: Path):
    """Time and peak memory vs frames: a row per part; colour = variant, line = dtype."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(VARIANTS) + list(FORK_VARIANTS)
    colour = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(names)}
    parts = sorted({r["part"] for r in rows})
    fig, axes = plt.subplots(len(parts), 2, figsize=(12, 4.2 * len(parts)), squeeze=False)
    for i, part in enumerate(parts):
        series = sorted({(r["dtype"], r["variant"]) for r in rows if r["part"] == part})
        for dname, v in series:
            pts = sorted((r["frames"], r["seconds"], r["peak_gib"]) for r in rows
                         if (r["part"], r["dtype"], r["variant"]) == (part, dname, v) and r.get("status") == "ok")
            if not pts:
                continue
            f, s, m = zip(*pts)
            style = dict(color=colour.get(v), ls="--" if v.startswith("fastvggt") else (":" if dname == "fp32" else "-"),
                         marker="o" if "native" in v else "s", ms=4, label=f"{v} {dname}")
            axes[i, 0].plot(f, s, **style)
            axes[i, 1].plot(f, m, **style)
        tokens = {r["tokens"] // r["frames"] for r in rows if r["part"] == part}
        for j, (what, unit) in enumerate((("time", "s"), ("peak memory", "GiB"))):
            ax = axes[i, j]
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(f"frames ({'/'.join(map(str, sorted(tokens)))} tokens each)")
            ax.set_ylabel(f"{what} ({unit})")
            ax.set_title(f"VGGT {part}: {what}")
            ax.grid(True, which="both", alpha=0.3)
        axes[i, 0].legend(fontsize=7)
    fig.suptitle(f"VGGT vs frames on {metadata()['device']} (dotted: fp32, solid: bf16, dashed: FastVGGT fork)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8/16/32 frames, bf16, native/elsa/elsa-merge/elsa-lean")
    p.add_argument("--frames", type=csv_list(int), help="frame counts (default bf16 50,100,200,400; fp32 50,100)")
    p.add_argument("--dtype", type=csv_list(str), default=["fp32", "bf16"], help="fp32,bf16")
    p.add_argument("--parts", type=csv_list(str), default=["aggregator", "full"], help="aggregator,full")
    p.add_argument("--variants", type=csv_list(str), default=[v for v in VARIANTS if "nofuse" not in v],
                   help=",".join(VARIANTS) + " (default: all but the *-nofuse A/B variants)")
    p.add_argument("--fork-variants", type=csv_list(str), default=["fastvggt-native", "fastvggt-elsa"],
                   help=",".join(FORK_VARIANTS))
    p.add_argument("--fastvggt", default=None, help="FastVGGT source folder, or 'none' to skip it")
    p.add_argument("--repeats", type=int, default=None, help="runs per variant (default 1; --quick 2)")
    p.add_argument("--memory-rehearsal", action="store_true",
                   help="peak memory only, attention not computed (variants " + ",".join(REHEARSAL_VARIANTS)
                        + "): how many frames fit, without hours of attention")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the 2-frame compile pass: the first timed call of each variant then includes "
                        "Triton's compile (seconds; warm_up = False in the CSV)")
    p.add_argument("--weights", default=None, help="a VGGT checkpoint (.pt); default random weights")
    p.add_argument("--fp32-precision", default="fp16x3", choices=["fp16x3", "tf32x3", "ieee", "tf32"],
                   help="ELSA's float32 mode in the fp32 cases (default fp16x3, what patch() runs)")
    p.add_argument("--height", type=int, default=392)
    p.add_argument("--width", type=int, default=518)
    p.add_argument("--name", default="frames", help="output file stem (CSV + PNG)")
    p.add_argument("--compile", choices=["default", "reduce-overhead", "max-autotune"],
                   help="the aggregator of each variant (" + ",".join(COMPILE_VARIANTS) + ") eagerly and under "
                        "torch.compile in this mode, in one process (see sweep_compiled) → <name>_compile_<mode>.*")
    p.add_argument("--profile", action="store_true",
                   help="also profile one call per variant (the FastVGGT fork's too; with --compile, one eager and "
                        "one compiled call) at the largest frame count: CUDA time per kernel category and the top "
                        "kernels → <name>_profile.csv")
    # internal: the FastVGGT worker process
    p.add_argument("--fork-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fork-src", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--rows-out", help=argparse.SUPPRESS)
    p.add_argument("--frames-bf16", type=csv_list(int), help=argparse.SUPPRESS)
    args = p.parse_args()
    global FP32_PRECISION
    FP32_PRECISION = args.fp32_precision

    if not torch.cuda.is_available():
        sys.exit("benchmarks/frames.py needs a CUDA GPU")
    if args.height % 14 or args.width % 14:
        p.error("--height and --width must be multiples of 14")
    bad = [v for v in args.variants if v not in VARIANTS] + [v for v in args.fork_variants if v not in FORK_VARIANTS]
    bad += [d for d in args.dtype if d not in DTYPES] + [x for x in args.parts if x not in ("aggregator", "full")]
    if bad:
        p.error(f"unknown names {bad}; see --help")
    if args.quick:
        args.frames = args.frames or [8, 16, 32]
        args.dtype = ["bf16"]
        if args.variants == p.get_default("variants"):  # (not named on the command line)
            args.variants = ["native", "elsa", "elsa-merge", "elsa-lean"]
    args.repeats = args.repeats or (2 if args.quick else 1)
    if args.memory_rehearsal:
        if any(v not in REHEARSAL_VARIANTS for v in args.variants):
            p.error(f"--memory-rehearsal runs only {','.join(REHEARSAL_VARIANTS)}; pass --variants")
        if args.profile:
            p.error("--memory-rehearsal computes no attention: nothing to profile")
        args.fastvggt = "none"
    if args.compile:
        if args.parts != ["aggregator"] or any(v not in COMPILE_VARIANTS for v in args.variants):
            p.error(f"--compile measures the aggregator of {','.join(COMPILE_VARIANTS)}: pass --parts aggregator "
                    f"and --variants from those (merging and lean mode run Python of their own per call)")
        if args.memory_rehearsal:
            p.error("--compile times compiled calls; not with --memory-rehearsal")
        args.fastvggt = "none"
        args.name += f"_compile_{args.compile.replace('-', '_')}"
    if args.fork_worker:
        return fork_worker(args)

    hw = (args.height, args.width)
    frames_by_dtype = {d: args.frames or DEFAULT_FRAMES[d] for d in args.dtype}
    variants = {v: VARIANTS[v] for v in VARIANTS if v in args.variants}
    model = build_upstream(args.weights)
    total = torch.cuda.get_device_properties(0).total_memory - torch.cuda.memory_allocated()
    print(f"VGGT ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, random weights"
          f"{'' if not args.weights else ' → ' + args.weights}) on {metadata()['device']}; "
          f"{hw[0]}x{hw[1]}, {5 + (hw[0] // 14) * (hw[1] // 14)} tokens per frame")
    rows, prof_rows = [], []
    try:
        if args.compile:
            sweep_compiled(model, list(variants), upstream_apply, args.dtype, frames_by_dtype, args.repeats, hw,
                           args.compile, rows=rows, profile=prof_rows if args.profile else None)
        else:
            sweep(model, variants, upstream_apply, args.parts, args.dtype, frames_by_dtype, args.repeats,
                  not args.no_warmup, hw, rehearsal=args.memory_rehearsal, rows=rows)
    except BaseException:
        if rows:  # hours of GPU time: keep what was measured before the failure
            print(f"\nsweep failed; wrote the rows measured so far to "
                  f"{write_csv(rows, results_dir() / (args.name + '_partial.csv'))}")
        raise
    if args.profile and not args.compile:
        prof_rows = profile_variants(model, variants, upstream_apply, args.parts, args.dtype, frames_by_dtype, hw)
    del model
    free_memory()

    src = fork_source(args.fastvggt)
    if src is not None and "bf16" in args.dtype and args.fork_variants:
        fork_rows, fork_prof = run_fork(args, src, frames_by_dtype["bf16"])
        rows += fork_rows
        prof_rows += fork_prof
    elif args.fastvggt != "none":
        print("\nFastVGGT fork: not run (" + ("no bf16 pass" if src is not None else
              "source not found; pass --fastvggt PATH or set FASTVGGT_SRC") + ")")

    out = results_dir()
    csv_path = write_csv(rows, out / f"{args.name}.csv")
    ok = [r for r in rows if r.get("status") == "ok"]
    png = None
    if ok:
        try:
            plot(ok, out / f"{args.name}.png")
            png = out / f"{args.name}.png"
        except ImportError as e:
            print(f"no plot ({e}); pip install matplotlib")
    cols = ["part", "dtype", "frames", "variant", "seconds", "peak_gib", "speedup_vs_native", "memory_vs_native",
            "depth_rel_err", "points_rel_err", "pose_max_abs_diff", "status"]
    if args.compile:
        cols = ["dtype", "frames", "variant", "seconds", "peak_gib", "speedup_vs_native", "speedup_vs_eager",
                "max_rel_err", "fullgraph", "graphs_compiled", "graph_breaks", "steady"]
    print("\n" + fmt_table(rows, cols))
    cap = capacity(ok + [r for r in rows if r.get("status") == "memory rehearsal"], total)
    if cap:
        print("\nlargest frame count predicted by the peak-memory trend on this GPU:")
        print(fmt_table(cap, ["part", "dtype", "variant", "gib_per_frame", "estimated_max_frames"]))
        write_csv(cap, out / f"{args.name}_capacity.csv")
    if prof_rows:
        write_csv(prof_rows, out / f"{args.name}_profile.csv")
        print(f"wrote {out / (args.name + '_profile.csv')}")
    print(f"\nwrote {csv_path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
