"""StreamVGGT streaming benchmark: per-frame latency and memory against the frame index, patched vs
native, in one process on one GPU.

    PYTHONPATH=third_party/streamvggt/src python benchmarks/stream.py --frames 500
        → benchmarks/results/<device>/stream.{csv,png}

Each variant streams the same random frames (392×518, random weights: timing only) through
StreamVGGT's aggregator and camera head with their key/value caches — what ``StreamVGGT.inference``
runs per frame before the DPT heads, whose cost does not depend on the frame index. Per frame: the
step's time (CUDA events), the memory allocated after it and the step's peak. The patched model
(``elsa_vision.patch``) runs first, then the same model unpatched (native). At the frames in ``--check`` the
last layer's tokens of both variants are compared (max |patched − native|). A variant that runs out
of memory stops there; its last frame is in the CSV. Set
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for long streams: both variants' caches grow,
and without it freed smaller blocks stay reserved.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import metadata, results_dir, save, style_axes  # noqa: E402

import elsa_vision  # noqa: E402


def build(device):
    try:
        from streamvggt.heads.camera_head import CameraHead
        from streamvggt.models.aggregator import Aggregator
    except ImportError as e:
        raise SystemExit(f"benchmarks/stream.py needs StreamVGGT's source on PYTHONPATH (src/ of "
                         f"https://github.com/wzzheng/StreamVGGT): {e}")
    torch.manual_seed(0)
    agg, cam = Aggregator(), CameraHead(dim_in=2048)
    return agg.to(device).eval(), cam.to(device).eval()


def stream(agg, cam, images, dtype, check, keep, budget_s=None):
    """Stream images [S, 3, H, W] one at a time; a row per frame, and the last layer's tokens at
    the frames in ``check`` (into ``keep``). Stops after ``budget_s`` seconds (a row says so)."""
    past, past_cam = [None] * agg.depth, [None] * cam.trunk_depth
    rows = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    for i in range(images.shape[0]):
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            rows.append({"frame": i, "error": f"stopped: --budget-s {budget_s:g} s spent"})
            break
        torch.cuda.reset_peak_memory_stats()
        try:
            start.record()
            with torch.no_grad(), torch.autocast("cuda", dtype, enabled=dtype != torch.float32):
                tokens, _, past = agg(images[i][None, None], past_key_values=past, use_cache=True, past_frame_idx=i)
                with torch.autocast("cuda", enabled=False):
                    _, past_cam = cam(tokens, past_key_values_camera=past_cam, use_cache=True)
            end.record()
            end.synchronize()
        except torch.OutOfMemoryError:
            rows.append({"frame": i, "error": "out of memory"})
            break
        rows.append({"frame": i, "ms": start.elapsed_time(end), "allocated_gib": torch.cuda.memory_allocated() / 2**30,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                     "reserved_gib": torch.cuda.memory_reserved() / 2**30})
        if i in check:
            keep[i] = tokens[-1].float().clone()
        del tokens
    del past, past_cam
    torch.cuda.empty_cache()
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for var in dict.fromkeys(r["variant"] for r in rows):
        pts = [(r["frame"], r["ms"], r["peak_gib"]) for r in rows if r["variant"] == var and r.get("ms")]
        if pts:
            f, ms, mem = zip(*pts)
            a.plot(f, ms, label=var, lw=1)
            b.plot(f, mem, label=var, lw=1)
    style_axes(a, "frame index", "ms per frame (aggregator + camera head)", "StreamVGGT streaming latency", ylog=False)
    style_axes(b, "frame index", "peak GiB during the frame", "memory", ylog=False)
    for ax in (a, b):
        ax.set_xscale("linear")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=500)
    ap.add_argument("--height", type=int, default=392)
    ap.add_argument("--width", type=int, default=518)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--precision", default="auto", help="ELSA precision (fp32 runs)")
    ap.add_argument("--variants", default="elsa,native")
    ap.add_argument("--check", default="0,1,10,100,250,499", help="frames whose outputs are compared")
    ap.add_argument("--out", help="results folder (default benchmarks/results/<device>)")
    ap.add_argument("--name", default="stream")
    ap.add_argument("--budget-s", type=float, help="stop a variant's stream after this many seconds")
    ap.add_argument("--warmup-frames", type=int, default=None,
                    help="frames of a stream run and thrown away before each variant's timed one (default: as many "
                         "as --frames): the kernels compile per class of the cache's token count (its last tile's "
                         "width, divisibility by 16) and per plan of its key partitions, which change over the "
                         "whole stream (compiles were seen at frames 0, 3, 15, 112 and 115 of 500)")
    a = ap.parse_args(argv)
    if a.warmup_frames is None:
        a.warmup_frames = a.frames
    if a.warmup_frames < 0:
        ap.error(f"--warmup-frames takes a count ≥ 0, got {a.warmup_frames}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/stream.py needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    agg, cam = build("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    images = torch.rand(a.frames, 3, a.height, a.width, device="cuda", generator=g)
    check = {int(f) for f in a.check.split(",") if f}
    outs, rows = {}, []
    for var in a.variants.split(","):
        if var == "elsa":
            elsa_vision.patch(agg, precision=a.precision)
            elsa_vision.patch(cam, precision=a.precision)
        if a.warmup_frames > 0:
            stream(agg, cam, images[:a.warmup_frames], dtype, set(), {}, a.budget_s)
        t0 = time.perf_counter()
        outs[var] = {}
        new = stream(agg, cam, images, dtype, check, outs[var], a.budget_s)
        print(f"{var}: {len(new)} frames in {time.perf_counter() - t0:.1f} s; "
              + ", ".join(f"frame {r['frame']}: {r['ms']:.1f} ms {r['peak_gib']:.1f} GiB"
                          for r in new if r.get("ms") and r["frame"] in check), flush=True)
        elsa_vision.unpatch(agg)
        elsa_vision.unpatch(cam)
        rows += [dict(r, variant=var, dtype=a.dtype, height=a.height, width=a.width) for r in new]
    if "native" in outs:
        for var, kept in outs.items():
            for f, t in kept.items():
                ref = outs["native"].get(f)
                for r in rows:
                    if r["variant"] == var and r["frame"] == f and ref is not None:
                        r["max_diff_vs_native"] = (t - ref).abs().max().item()
        native = {r["frame"]: r for r in rows if r["variant"] == "native" and r.get("ms")}
        for r in rows:
            if r.get("ms") and r["frame"] in native:
                r["speedup_vs_native"] = native[r["frame"]]["ms"] / r["ms"]
    meta = dict(metadata(), alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    rows = [dict(r, **meta) for r in rows]
    outdir = Path(a.out) if a.out else results_dir()
    outdir.mkdir(parents=True, exist_ok=True)
    save(rows, outdir, a.name, plot)
    for r in rows:
        if r["frame"] in check:
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k not in meta})


if __name__ == "__main__":
    main()
