"""Frames across GPUs: time, memory per GPU and scaling of sharded attention and of VGGT's
aggregator (``patch(model, process_group=...)``) against one GPU, under torchrun.

    torchrun --nproc-per-node 2 benchmarks/distributed.py --frames 400,1000 --dtypes bf16,fp32
        → benchmarks/results/<device>/distributed_<ranks>.{csv,png}
    torchrun --nproc-per-node 2 benchmarks/distributed.py --device cpu --parts attention --frames 2 --tokens 64
        (a CPU smoke run over gloo)

Per frame count and dtype, two parts:

* ``attention``: global attention over frames × ``--tokens`` tokens (H = 16, d = 64, random), each
  rank holding a contiguous shard of the queries and keys: ``elsa_vision.distributed.attention``
  against ``elsa_vision.attention`` over the whole sequence on rank 0 alone (the one-GPU baseline,
  the other ranks waiting).
* ``aggregator``: VGGT's aggregator (random weights, 392×518 frames, ``lean_memory=True``; with
  ``--merge`` also ``token_merging=TokenMerging()``), every
  rank running its share of the frames, against the whole sequence on rank 0 alone (needs vggt).

Each row: ranks, frames, part, dtype, the slowest rank's seconds, every rank's peak memory, the
one-GPU seconds and peak, speed-up (one GPU / sharded) and scaling efficiency (speed-up / ranks);
attention rows also the sharded output's max |Δ| and relative L2 against the one-GPU output (the
shards are slices of the same tensors). Rows are written after each one.
A part that runs out of memory on one GPU leaves the baseline empty; ``--no-baseline`` skips it. A
rank that runs out of memory inside a sharded call leaves the others waiting in the collective
until the process group's timeout (``--timeout-s``), which then ends the run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import (memory_at_peak, metadata, profile_rows, results_dir, save, style_axes,  # noqa: E402
                                use_device, warmup_frames, write_csv)

import elsa_vision  # noqa: E402
from elsa_vision import distributed  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def shards(n: int, ranks: int) -> list[int]:
    return [n // ranks + (r < n % ranks) for r in range(ranks)]


def timed(fn, device, barrier=True, group=None):
    """(seconds, peak bytes or None, error or None) of one call without gradients, after a barrier of
    ``group`` (``barrier=False``: rank 0 alone, the one-GPU baseline)."""
    if barrier:
        dist.barrier(group)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    err = None
    try:
        with torch.no_grad():
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        err = "out of memory"
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return seconds, peak, err


def _sharded_runs(groups: dict, res: dict):
    """(name, group, overlap, this rank in the group, the group's size) of each group of ``groups``
    (name → (group or None off it, overlap)) that this rank belongs to, in order; ``res[name]`` is
    None for the others. Every run ends at a barrier of all ranks (the others wait there)."""
    for name, (group, overlap) in groups.items():
        if group is not None and dist.get_rank(group) >= 0:
            yield name, group, overlap, dist.get_rank(group), dist.get_world_size(group)
        else:
            res[name] = None
        dist.barrier()


def attention_part(frames, tokens, dtype, device, baseline, groups, memory=None):
    """One-GPU (rank 0 alone, when ``baseline``) and sharded global attention over frames × tokens,
    forward (inference), sharded over each group of ``groups`` (name → (group, overlap)) in turn.
    Returns ({name: timing on this rank, None off the group}, one-GPU timing, {name: agreement}):
    the shards are slices of the same tensors as the one-GPU call, and the group's rank 0 compares
    the gathered sharded output with the one-GPU output (max |Δ| and relative L2, both in float32)."""
    rank = dist.get_rank()
    n = frames * tokens

    def make(i, rows=slice(None)):
        # every rank draws the same whole tensor and keeps its rows: shards of one problem
        g = torch.Generator(device=device).manual_seed(i)
        return torch.randn(1, 16, n, 64, device=device, dtype=dtype, generator=g)[:, :, rows].clone()

    one = ref = None
    if baseline:
        if rank == 0:
            q, k, v = make(0), make(1), make(2)
            # compiles outside the timing; kept for the agreement check on the host (on the GPU it would
            # count in the one-GPU peak)
            ref = elsa_vision.attention(q, k, v).cpu()
            one = timed(lambda: elsa_vision.attention(q, k, v), device, barrier=False)
            if memory is not None and device.type == "cuda":
                memory += [dict(r, frames=frames, run="one GPU") for r in memory_at_peak(lambda: elsa_vision.attention(q, k, v))]  # noqa: E501
            del q, k, v
        dist.barrier()
    res, agree = {}, {}
    for name, group, overlap, r, world in _sharded_runs(groups, res):
        counts = [c * tokens for c in shards(frames, world)]
        lo = sum(counts[:r])
        q, k, v = (make(i, slice(lo, lo + counts[r])) for i in range(3))
        call = lambda: distributed.attention(q, k, v, group=group, overlap=overlap)  # noqa: E731
        with torch.no_grad():
            call()  # warm-up (compile, communicators)
            res[name] = timed(call, device, group=group)
            out = call() if baseline else None
        if baseline:
            # point-to-point rather than a gather: the shards may be uneven
            if r == 0:
                parts = [out] + [torch.empty(1, 16, c, 64, device=device, dtype=dtype) for c in counts[1:]]
                for p in range(1, world):
                    dist.recv(parts[p], src=p, group=group)
                diff = (torch.cat(parts, dim=2).float() - ref.to(device).float())
                agree[name] = (diff.abs().max().item(), (diff.norm() / ref.float().norm()).item())
            else:
                dist.send(out.contiguous(), dst=0, group=group)
        q = k = v = out = None  # (freed before the next group's shards)
    return res, one, agree


def aggregator_part(frames, dtype, device, baseline, hw, groups, profiled=None, merge=False, depth=24,
                    offload=False, memory=None):
    """One-GPU (rank 0 alone, when ``baseline``) and sharded aggregator over ``frames`` frames, sharded
    over each group of ``groups`` (name → (group, overlap)) in turn. ``merge``: with FastVGGT's token
    merging, TokenMerging(), on both. ``depth``: the first ``depth`` of the aggregator's 24 block
    pairs only (every pair does the same work; with ``offload`` the kept layers go to host memory,
    so the device peak is the full depth's). ``profiled`` / ``memory``: lists that receive, on rank
    0, the CUDA-time breakdown (harness.profile_rows) / the allocations at the peak
    (harness.memory_at_peak) of one extra one-GPU call and one extra sharded call per group (the
    other ranks run theirs plainly)."""
    try:
        from vggt.models.aggregator import Aggregator
    except ImportError as e:
        raise SystemExit(f"--parts aggregator needs vggt (pip install git+https://github.com/facebookresearch/vggt): {e}")
    rank = dist.get_rank()
    opts = dict(lean_memory=True, **({"token_merging": elsa_vision.TokenMerging()} if merge else {}),
                **({"lean_offload": True} if offload else {}))
    torch.manual_seed(0)
    agg = Aggregator(depth=depth).to(device).eval()
    # made on the host: each rank's device holds its own frames only (rank 0 all of them for the baseline)
    images = torch.rand(1, frames, 3, *hw, generator=torch.Generator().manual_seed(1))
    auto = (lambda: torch.autocast(device.type, dtype)) if dtype != torch.float32 else None

    def run(model, x):
        with torch.no_grad():
            if auto is None:
                return model(x)
            with auto():
                return model(x)

    def extras(fn, head):
        if profiled is not None:
            rows, line = profile_rows(fn, head)
            profiled.extend(rows)
            print(f"{head}: {line}", flush=True)
        if memory is not None:
            try:
                memory.extend(dict(r, **head) for r in memory_at_peak(fn))
            except Exception as e:  # (a diagnostic: the timings stand without it)
                print(f"{head}: memory_at_peak failed: {e!r}", flush=True)

    one = None
    if baseline:
        if rank == 0:
            elsa_vision.patch(agg, **opts)
            whole = images.to(device)
            run(agg, whole[:, :warmup_frames(frames)])  # compile outside the timing (the same kernels)
            one = timed(lambda: run(agg, whole), device, barrier=False)
            extras(lambda: run(agg, whole), {"frames": frames, "run": "one GPU"})
            del whole
            elsa_vision.unpatch(agg)
        dist.barrier()
    res = {}
    default_overlap = distributed.OVERLAP
    for name, group, overlap, r, world in _sharded_runs(groups, res):
        counts = shards(frames, world)
        lo = sum(counts[:r])
        elsa_vision.patch(agg, process_group=group, **opts)
        local = images[:, lo:lo + counts[r]].to(device)
        distributed.OVERLAP = overlap  # (the aggregator's calls take the module's default)
        try:
            # warm-up: every rank compiles the kernels its timed call takes (the collectives run too)
            run(agg, local[:, :warmup_frames(counts[r])])
            res[name] = timed(lambda: run(agg, local), device, group=group)
            if profiled is not None or memory is not None:
                dist.barrier(group)
                if r == 0:
                    extras(lambda: run(agg, local), {"frames": frames, "run": f"rank 0 of {name}"})
                else:  # as many calls as rank 0's extras make: the ring's collectives pair up
                    for _ in range((profiled is not None) + (memory is not None)):
                        run(agg, local)
        finally:
            distributed.OVERLAP = default_overlap
            elsa_vision.unpatch(agg)
        local = None
    return res, one, {}


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in dict.fromkeys((r["part"], r["dtype"], r["ranks"], r["overlap"]) for r in rows):
        pts = [(r["frames"], r["efficiency"]) for r in rows
               if (r["part"], r["dtype"], r["ranks"], r["overlap"]) == key and r.get("efficiency")]
        if pts:
            part, dt, ranks, overlap = key
            ax.plot(*zip(*pts), marker="o", label=f"{part} {dt}, {ranks} ranks" + ("" if overlap else ", no overlap"))
    ax.axhline(1.0, color="gray", lw=0.8)
    style_axes(ax, "frames", "scaling efficiency (speed-up / ranks)", "sharded against one GPU", ylog=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", default="400,1000")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--parts", default="attention,aggregator")
    ap.add_argument("--ranks", help="the sharded runs' sizes, each the first ranks of the launch (e.g. 2,4 under "
                                    "--nproc-per-node 4: one baseline for both); default all of them")
    ap.add_argument("--overlap", default="off", help="on, off or on,off: the ring's transfers beside its kernels "
                                                     "(distributed.attention's overlap)")
    ap.add_argument("--tokens", type=int, default=1041, help="tokens per frame of the attention part")
    ap.add_argument("--height", type=int, default=392)
    ap.add_argument("--width", type=int, default=518)
    ap.add_argument("--depth", type=int, default=24,
                    help="aggregator: the first DEPTH of its 24 block pairs (a run too long for the full depth)")
    ap.add_argument("--offload", action="store_true",
                    help="aggregator: lean_offload (the kept layers in host memory) on both runs")
    ap.add_argument("--no-baseline", action="store_true", help="skip the one-GPU runs")
    ap.add_argument("--merge", action="store_true", help="aggregator: with token merging (TokenMerging()) on both runs")
    ap.add_argument("--profile", action="store_true",
                    help="aggregator: also write rank 0's CUDA-time breakdown of a one-GPU and a sharded call "
                         "(distributed_<name>_profile.csv)")
    ap.add_argument("--memory", action="store_true",
                    help="also write what is allocated at rank 0's peak of a one-GPU call (both parts) and of a "
                         "sharded call (aggregator) (distributed_<name>_memory.csv; CUDA only)")
    ap.add_argument("--name", help="results file stem after distributed_ (default: the launch's rank count)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (NCCL, one GPU a rank) or cpu (gloo)")
    ap.add_argument("--out", help="results folder (default benchmarks/results/<device>)")
    ap.add_argument("--timeout-s", type=float, default=900,
                    help="process-group timeout: how long the other ranks wait in a collective for one that failed")
    a = ap.parse_args(argv)
    bad = [p for p in a.parts.split(",") if p not in ("attention", "aggregator")]
    bad += [d for d in a.dtypes.split(",") if d not in DT]
    if bad:
        ap.error(f"unknown --parts / --dtypes {bad}: parts are attention, aggregator; dtypes {list(DT)}")
    if a.device not in ("cuda", "cpu") or (a.device == "cuda" and not torch.cuda.is_available()):
        ap.error(f"--device {a.device!r}: cuda (with GPUs here) or cpu")
    use_device(a.device)
    try:
        if min(int(f) for f in a.frames.split(",")) < 1 or a.tokens < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--frames takes positive ints (comma-separated) and --tokens a positive int, got {a.frames!r} / "
                 f"{a.tokens}")
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("benchmarks/distributed.py runs under torchrun, e.g. torchrun --nproc-per-node 2 "
                         "benchmarks/distributed.py")
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=a.timeout_s))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [int(r) for r in a.ranks.split(",")] if a.ranks else [world]
    overlaps = {"on": True, "off": False}
    if any(not 1 <= r <= world for r in sizes) or any(o not in overlaps for o in a.overlap.split(",")):
        raise SystemExit(f"--ranks takes sizes from 1 to {world} and --overlap on/off, got {a.ranks!r} / {a.overlap!r}")
    groups = {}  # name → (group, overlap); new_group is collective: every rank makes every group
    for r in sizes:
        g = dist.group.WORLD if r == world else dist.new_group(list(range(r)))
        for o in a.overlap.split(","):
            groups[f"{r}" + (" overlap" if o == "on" else "")] = (g if rank < r else None, overlaps[o])
    rows = []
    profiled = [] if a.profile else None
    memory = [] if a.memory else None
    meta = metadata() if rank == 0 else {}
    outdir = Path(a.out) if a.out else results_dir()
    stem = f"distributed_{a.name or world}"
    if rank == 0:
        outdir.mkdir(parents=True, exist_ok=True)
    try:
        for part in a.parts.split(","):
            for frames in (int(f) for f in a.frames.split(",")):
                for dtn in a.dtypes.split(","):
                    if part == "attention":
                        res, one, agree = attention_part(frames, a.tokens, DT[dtn], device, not a.no_baseline,
                                                         groups, memory)
                    else:
                        res, one, agree = aggregator_part(frames, DT[dtn], device, not a.no_baseline,
                                                          (a.height, a.width), groups, profiled, a.merge, a.depth,
                                                          a.offload, memory)
                    for name, (_, overlap) in groups.items():
                        everyone = [None] * world
                        dist.all_gather_object(everyone, res[name])
                        if rank:
                            continue
                        everyone = [e for e in everyone if e is not None]
                        label = part + ("+merge" if a.merge and part == "aggregator" else "")
                        row = {"ranks": len(everyone), "overlap": overlap, "frames": frames, "part": label,
                               "depth": a.depth if part == "aggregator" else None, "dtype": dtn,
                               "seconds": max(e[0] for e in everyone),
                               "peak_gib_per_rank": ";".join(f"{e[1] / 2**30:.2f}" if e[1] is not None else ""
                                                             for e in everyone),
                               "error": next((e[2] for e in everyone if e[2]), None)}
                        if one is not None:
                            row.update(one_gpu_seconds=one[0],
                                       one_gpu_peak_gib=None if one[1] is None else one[1] / 2**30,
                                       one_gpu_error=one[2])
                            if not one[2] and not row["error"]:
                                row["speedup"] = one[0] / row["seconds"]
                                row["efficiency"] = row["speedup"] / row["ranks"]
                                if one[1] and everyone[0][1]:
                                    row["peak_vs_one_gpu"] = max(e[1] for e in everyone) / one[1]
                        if name in agree:
                            row.update(max_abs_vs_one_gpu=agree[name][0], rel_l2_vs_one_gpu=agree[name][1])
                        rows.append(dict(row, **meta))
                        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                        # written after every row: a long run cut short keeps what it measured
                        save(rows, outdir, stem, plot)
                    if rank == 0 and profiled:
                        write_csv([dict(r, **meta) for r in profiled], outdir / f"{stem}_profile.csv")
                    if rank == 0 and memory:
                        write_csv([dict(r, **meta) for r in memory], outdir / f"{stem}_memory.csv")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
