"""The benchmark harness's timing loop, the window benchmark's CPU smoke mode, the attention
training sweep's plot, and frames.py's sweep, accuracy columns, capacity estimate, plot and memory
rehearsal on the VGGT stand-in."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

import elsa_vision

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks import harness  # noqa: E402
import vggt_standin as V  # noqa: E402
from elsa_vision.adapters import vggt as A  # noqa: E402


@pytest.fixture(scope="module")
def standin():
    """The VGGT stand-in's classes served by the adapter (as in test_vggt.py)."""
    remove = A.register_classes(**V.CLASSES)
    yield
    remove()


def make_standin(seed=0):
    torch.manual_seed(seed)
    return V.VGGT().eval()


def test_profile_rows_count_launches_and_aten_ops(monkeypatch):
    """On CUDA a profile row carries each kernel's launch count, and kind "op" rows the aten
    operators dispatched during the call by count (what runs outside a compiled graph's kernels);
    the summary line gives both totals. The profiler is faked: its events are what the rows say."""
    import types
    import torch.profiler as tp
    CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda name, dev, us: types.SimpleNamespace(name=name, device_type=dev, device_time_total=us,  # noqa: E731
                                                     self_cpu_time_total=us)
    events = [ev("nvjet_gemm", CUDA, 400.0), ev("nvjet_gemm", CUDA, 600.0), ev("_win_fwd_kernel", CUDA, 250.0),
              ev("aten::mm", CPU, 5.0), ev("aten::mm", CPU, 5.0), ev("aten::copy_", CPU, 3.0),
              ev("Torch-Compiled Region", CPU, 9.0)]
    asked = []

    class Fake:
        def __init__(self, activities):
            asked.append(set(activities))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events
    monkeypatch.setattr(tp, "profile", Fake)
    rows, line = harness.profile_rows(lambda: None, {"variant": "elsa"})
    assert asked == [{tp.ProfilerActivity.CUDA, tp.ProfilerActivity.CPU}]
    kern = {r["kernel"]: r for r in rows if r["kind"] == "kernel"}
    assert kern["nvjet_gemm"]["calls"] == 2 and kern["nvjet_gemm"]["cuda_ms"] == pytest.approx(1.0)
    assert kern["_win_fwd_kernel"]["calls"] == 1
    assert {r["kernel"]: r["calls"] for r in rows if r["kind"] == "op"} == {"aten::mm": 2, "aten::copy_": 1}
    cat = {r["category"]: r["calls"] for r in rows if r["kind"] == "category"}
    assert sum(cat.values()) == 3 and line.endswith("; 3 kernels, 3 aten ops")
    # on the CPU the rows are operator time, and no op rows are added
    rows, line = harness.profile_rows(lambda: None, {}, device="cpu")
    assert asked[-1] == {tp.ProfilerActivity.CPU} and not any(r["kind"] == "op" for r in rows)


def test_measure_varies_the_order_so_no_variant_always_follows_the_same_one():
    log = []
    variants = {n: (lambda n=n: log.append(n)) for n in "abcd"}
    res = harness.measure(variants, warmup=1, rounds=12, memory=False)
    assert set(res) == set("abcd") and all(r.ms is not None for r in res.values())
    timed = log[4:]  # after one warm-up call each
    assert len(timed) == 48
    rounds = [timed[i:i + 4] for i in range(0, 48, 4)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    for n in "abcd":
        before = {r[r.index(n) - 1] for r in rounds if r.index(n) > 0}
        assert len(before) >= 2, (n, before)
    assert harness.measure(variants, warmup=0, rounds=12, memory=False).keys() == res.keys()
    log.clear()
    harness.measure(variants, warmup=0, rounds=12, memory=False)
    assert log == timed  # seeded: the same orders every run


def test_measure_records_a_failing_variant():
    def boom():
        raise RuntimeError("not supported here")
    res = harness.measure({"ok": lambda: None, "bad": boom}, warmup=1, rounds=3, memory=False)
    assert res["ok"].ms is not None and res["bad"].ms is None and "not supported here" in res["bad"].error


def test_host_time_counts_the_calls_own_time_not_the_rest():
    """host_time is the median of single calls, each started after a sync: a call that sleeps
    5 ms every other time has a 5 ms host time by its median, never the sum of several calls."""
    import time
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.005 if len(calls) % 2 else 0.0)
    ms = harness.host_time(fn, rounds=5)  # calls 1, 3, 5 sleep
    assert len(calls) == 5 and 4.5 <= ms < 50


def test_measure_queued_calls_times_each_round_over_that_many_calls():
    """measure(calls=K): each round calls the variant K times back to back and records the time a
    call; the warm-up and the budget's probe are single calls."""
    n = {"a": 0}

    def a():
        n["a"] += 1
        time.sleep(0.002)

    res = harness.measure({"a": a}, warmup=2, rounds=4, memory=False, calls=3)
    assert n["a"] == 2 + 4 * 3
    assert len(res["a"].samples) == 4 and all(t >= 2.0 for t in res["a"].samples)
    assert res["a"].ms < 6.0  # (a call's time, not the round's three)


def test_paired_ratio_interval_is_the_binomial_order_statistics():
    """The speedup's interval: the per-round ratios base_r / new_r, sorted, between the order
    statistics a Binomial(n, ½) count bounds at 95% (n = 15: the 4th and 12th; n = 6: the extremes);
    none under 6 rounds or for a failed variant. Rounds pair by index: a slow round on both sides
    cancels in its ratio, where the ratio of the two medians would not see it."""
    new = harness.Result("new", 1.0, None, samples=(1.0,) * 15)
    base = harness.Result("base", 1.07, None, samples=tuple(1.0 + 0.01 * i for i in range(15)))
    med, lo, hi = harness.paired_ratio(base, new)
    assert (med, lo, hi) == pytest.approx((1.07, 1.03, 1.11))
    six = harness.paired_ratio(harness.Result("b", 1.0, None, samples=(3, 1, 2, 6, 5, 4)),
                               harness.Result("n", 1.0, None, samples=(1,) * 6))
    assert six == pytest.approx((3.5, 1.0, 6.0))
    assert harness.paired_ratio(harness.Result("b", 1.0, None, samples=(1.0,) * 5), new) is None
    assert harness.paired_ratio(harness.Result("b", None, None, error="OOM"), new) is None
    # drift: both sides twice as slow in half the rounds; each round's ratio is 1.25
    drift = tuple(2.0 if i % 2 else 1.0 for i in range(8))
    paired = harness.paired_ratio(harness.Result("b", 1.0, None, samples=tuple(1.25 * t for t in drift)),
                                  harness.Result("n", 1.0, None, samples=drift))
    assert paired == pytest.approx((1.25, 1.25, 1.25))


def test_measure_keeps_each_rounds_time_in_round_order():
    """Result.samples: one time per round for every variant (what paired_ratio pairs), their median the
    reported time."""
    import statistics
    res = harness.measure({"a": lambda: None, "b": lambda: None}, warmup=1, rounds=7, memory=False)
    for r in res.values():
        assert len(r.samples) == 7 and r.ms == statistics.median(r.samples)


def test_models_benchmark_host_columns(tmp_path, monkeypatch):
    """benchmarks/models.py --host --queued 2: each variant's host time and its share of the wall
    time, its time a call over two calls queued back to back, and the speedups' per-round
    intervals, on a patched ViT-T small enough for the interpreter. (On the
    CPU every call is the host's and the share is about one, but the two timings are separate calls
    on a shared machine: only their ratio's bookkeeping is checked.)"""
    pytest.importorskip("timm")
    import csv
    from benchmarks import models
    monkeypatch.setenv("ELSA_RESULTS_DIR", str(tmp_path))
    models.main(["--models", "ViT-T", "--sizes", "32", "--batches", "2", "--modes", "fwd", "--dtypes", "bf16",
                 "--warmup", "1", "--rounds", "6", "--budget-s", "0", "--host", "--device", "cpu",
                 "--queued", "2", "--name", "host"])
    (row,) = list(csv.DictReader(open(tmp_path / "host.csv")))
    for v in ("elsa", "fused", "unfused"):
        host, wall = float(row[f"{v}_host_ms"]), float(row[f"{v}_ms"])
        assert host > 0 and wall > 0, row
        assert float(row[f"{v}_host_share"]) == pytest.approx(host / wall), row
        assert float(row[f"{v}_queued_ms"]) > 0, row
    for b in ("fused", "unfused"):  # (--queued 2: two calls a round, the time a call)
        q = float(row[f"queued_speedup_vs_{b}"])
        assert q == pytest.approx(float(row[f"{b}_queued_ms"]) / float(row["elsa_queued_ms"])), row
        assert float(row[f"queued_speedup_vs_{b}_lo"]) <= float(row[f"queued_speedup_vs_{b}_hi"]), row
    with pytest.raises(SystemExit):
        models.main(["--queued", "1", "--device", "cpu"])
    # six rounds: the per-round ratios' interval (their extremes) around their median
    for b in ("fused", "unfused"):
        lo, mid, hi = (float(row[k]) for k in (f"speedup_vs_{b}_lo", f"round_speedup_vs_{b}", f"speedup_vs_{b}_hi"))
        assert 0 < lo <= mid <= hi, row


def test_models_benchmark_nofuse_options(tmp_path, monkeypatch):
    """benchmarks/models.py --nofuse OPTION ...: the elsa_nofuse variant is patched with those options
    False; with none named, the family's fused blocks off (Swin: fuse_windows, ViT: fuse_residual)."""
    pytest.importorskip("timm")
    import csv
    from benchmarks import models
    seen = []
    real = models.elsa_vision.patch
    monkeypatch.setattr(models.elsa_vision, "patch", lambda m, **kw: seen.append(kw) or real(m, **kw))
    monkeypatch.setenv("ELSA_RESULTS_DIR", str(tmp_path))
    models.main(["--models", "ViT-T", "--sizes", "32", "--batches", "2", "--modes", "fwd", "--dtypes", "bf16",
                 "--warmup", "1", "--rounds", "2", "--device", "cpu", "--name", "nofuse",
                 "--nofuse", "fuse_position_bias", "fuse_residual"])
    (row,) = list(csv.DictReader(open(tmp_path / "nofuse.csv")))
    assert float(row["elsa_nofuse_ms"]) > 0, row
    assert seen == [dict(precision="auto"), dict(precision="auto", fuse_position_bias=False, fuse_residual=False)]
    swin, vit = models.Case("Swin-T", 224, 8, "fwd", "bf16"), models.Case("ViT-T", 224, 8, "fwd", "bf16")
    assert models.nofuse_options(swin, []) == {"fuse_windows": False}
    assert models.nofuse_options(vit, []) == {"fuse_residual": False}


@pytest.mark.parametrize("args", [["--smoke", "--shapes", "swinT-s4", "--dtypes", "fp32", "--profile"]])
def test_windows_benchmark_smoke(tmp_path, args):
    from benchmarks import windows
    import csv
    windows.main(args + ["--out", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "windows.csv")))
    assert {r["variant"] for r in rows} >= {"timm-sdpa", "timm-math", "elsa", "elsa-b64", "elsa-b256"}
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
    assert all(r["ms"] and not r["error"] for r in rows), [r for r in rows if r["error"]]
    prof = list(csv.DictReader(open(tmp_path / "windows_profile.csv")))
    assert {(r["variant"], r["mode"]) for r in prof} == {(r["variant"], r["mode"]) for r in rows}
    assert all(float(r["host_ms"]) > 0 for r in prof) and any(r.get("kernel") for r in prof)


@pytest.mark.parametrize("chain", [1, 2])
def test_windows_benchmark_compile_smoke(tmp_path, chain):
    """--compile: every variant's call (forward and backward) compiled whole, no variant failing;
    --chain 2: two independent ops per compiled call, rows per op."""
    from benchmarks import windows
    import csv
    windows.main(["--smoke", "--quick", "--shapes", "swinT-s4", "--dtypes", "fp32", "--compile", "default",
                  "--chain", str(chain), "--out", str(tmp_path)])
    stem = "windows_quick_compile_default" + ("_chain2" if chain == 2 else "")
    rows = list(csv.DictReader(open(tmp_path / f"{stem}.csv")))
    assert {r["variant"] for r in rows} == {"timm-sdpa", "timm-math", "elsa", "elsa-qkv"}
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
    assert {r["chain"] for r in rows} == {str(chain)}
    assert all(r["ms"] and not r["error"] for r in rows), [r for r in rows if r["error"]]


@pytest.mark.parametrize("args, message", [(["--chain", "0"], "--chain must be at least 1"),
                                           (["--chain", "2", "--blocks"], "not with --blocks or --tune")])
def test_windows_benchmark_chain_refusals(args, message, capsys):
    """--chain below 1, or with --blocks / --tune, is refused with the option's message."""
    from benchmarks import windows
    with pytest.raises(SystemExit):
        windows.main(["--smoke", *args])
    assert message in capsys.readouterr().err


def test_windows_chain_times_per_op():
    """A call of K ops is reported as one op's time: ms divided by K, None (a failed variant) kept,
    peak memory and errors the call's."""
    from benchmarks import windows
    from benchmarks.harness import Result
    r = Result("elsa", 6.0, 1024, "")
    assert windows._per_op(r, 1) is r
    assert windows._per_op(r, 2) == Result("elsa", 3.0, 1024, "")
    failed = Result("elsa", None, None, "OOM")
    assert windows._per_op(failed, 6) is failed


def test_windows_benchmark_blocks_smoke(tmp_path):
    """--blocks: timm's Swin block _attn against ELSA's module-level and block-fused patches."""
    from benchmarks import windows
    import csv
    windows.main(["--smoke", "--blocks", "--dtypes", "fp32", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "windows_blocks.csv")))
    assert {r["variant"] for r in rows} == {"timm-sdpa", "timm-math", "elsa-window", "elsa-block"}
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
    assert all(r["ms"] and not r["error"] for r in rows), [r for r in rows if r["error"]]


def test_training_plot_reads_the_sweep_rows(tmp_path):
    """benchmarks/attention.py --train's plot from the rows of a real sweep (the committed H100 CSV):
    every shape gets its bars, eager and replayed, per dtype."""
    import csv
    from benchmarks import attention as AB
    path = ROOT / "benchmarks" / "results" / "nvidia-h100-80gb-hbm3" / "attention_train.csv"
    rows = []
    for r in csv.DictReader(path.open()):
        r.update({k: int(r[k]) for k in ("B", "H", "Nq", "d")}, causal=r["causal"] == "True",
                 speedup_vs_best_sdpa=float(r["speedup_vs_best_sdpa"]) if r["speedup_vs_best_sdpa"] else None)
        rows.append(r)
    assert {r["case"] for r in rows} == {"train-eager", "train-graphed"}
    assert {(r["B"], r["H"], r["Nq"], r["d"], r["causal"]) for r in rows} == set(AB.TRAIN_SHAPES)
    AB.plot_training(rows, tmp_path / "train.png")
    assert (tmp_path / "train.png").stat().st_size > 0


def test_host_phases_arithmetic_and_plot(tmp_path):
    """--host-phases: stamps → µs per phase (the spans between consecutive stamps, summing to the
    call), stamps out of order refused; the plot of ELSA's two rows (replayed, Python path by phase)
    and an SDPA row."""
    from benchmarks import attention as AB
    got = AB.phases(0.0, 1e-6, 4e-6, 5e-6, 7e-6, 1.1e-5, 1.2e-5)
    assert list(got) == list(AB.PHASES)
    assert [round(v, 6) for v in got.values()] == [1.0, 3.0, 1.0, 2.0, 4.0, 1.0]
    with pytest.raises(ValueError, match="out of order"):
        AB.phases(0.0, 2e-6, 1e-6, 3e-6, 4e-6, 5e-6, 6e-6)
    rows = [{"variant": "elsa", "B": 4, "H": 12, "Nq": 197, "forward_us": 2.0, "grad_us": 4.0, "gpu_us": 9.0},
            {"variant": "elsa-python", "B": 4, "H": 12, "Nq": 197, **{f"{p}_us": v for p, v in got.items()},
             "gpu_us": 9.0},
            {"variant": "sdpa", "B": 4, "H": 12, "Nq": 197, "forward_us": 3.0, "grad_us": 5.0, "gpu_us": None}]
    AB.plot_host_phases(rows, tmp_path / "phases.png")
    assert (tmp_path / "phases.png").stat().st_size > 0


def test_host_phases_hooks_stamp_the_bodies_and_restore_them(monkeypatch):
    """timed_bodies over the benchmark's loop (_back_to_back): an eager packed call's forward and
    backward bodies stamped in order on every timed call, the gradient unchanged, and the
    Function's own methods back afterwards (also after an error)."""
    from benchmarks import attention as AB
    from elsa_vision.kernels import attention as K
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # (CPU tensors: nothing to wait for)
    fn = K.PACKED.function
    forward, backward = fn.forward, fn.backward
    qkv = torch.randn(2, 21, 3, 2, 16).requires_grad_()
    do = torch.randn(2, 2, 21, 16)
    (plain,) = torch.autograd.grad(elsa_vision.attention_packed(qkv), qkv, do)
    samples, outs = [], []
    with AB.timed_bodies(fn, {}) as st:
        AB._back_to_back(lambda: outs.append(elsa_vision.attention_packed(qkv)) or outs[-1], qkv, do, 2,
                         lambda t0, t1, t2: samples.append(AB.phases(t0, st["f0"], st["f1"], t1, st["b0"], st["b1"],
                                                                     t2)), warmup=1)
        (timed,) = torch.autograd.grad(elsa_vision.attention_packed(qkv), qkv, do)
    assert len(samples) == 2 and all(sum(p.values()) > 0 for p in samples) and len(outs) == 3
    assert torch.equal(plain, timed)
    assert fn.forward is forward and fn.backward is backward
    with pytest.raises(RuntimeError, match="inside"):
        with AB.timed_bodies(fn, {}):
            raise RuntimeError("inside")
    assert fn.forward is forward and fn.backward is backward


# --------------------------------------------------------------------------------------------
# benchmarks/frames.py: its sweep, accuracy columns, capacity estimate and plot, on the stand-in
# --------------------------------------------------------------------------------------------


def test_frames_benchmark_logic_on_the_standin(standin, tmp_path, monkeypatch):
    from benchmarks import frames as FB
    monkeypatch.setattr(FB, "DEVICE", "cpu")
    m = make_standin()

    def apply(model, variant, dtype):
        opts = FB.VARIANTS[variant]
        if opts is None:
            return lambda: None
        elsa_vision.patch(model, backend="reference", lean_memory=(1, 3) if opts.get("lean_memory") else False,
                          lean_offload=bool(opts.get("lean_offload")),
                          token_merging=FB.token_merging(opts))
        return lambda: elsa_vision.unpatch(model)

    variants = {v: FB.VARIANTS[v] for v in ("native", "elsa", "elsa-lean", "elsa-merge", "elsa-lean-offload",
                                            "elsa-merge-fast")}
    rows = FB.sweep(m, variants, apply, ["aggregator", "full"], ["fp32"], {"fp32": [2, 3]}, 1, False, (42, 70),
                    log=lambda s: None)
    assert len(rows) == 2 * 2 * 6 and all(r["status"] == "ok" for r in rows)
    full = {(r["frames"], r["variant"]): r for r in rows if r["part"] == "full"}
    assert full[3, "elsa-lean"]["accuracy_vs"] == "elsa" and full[3, "elsa-lean"]["depth_rel_err"] == 0
    assert full[3, "elsa-lean-offload"]["accuracy_vs"] == "elsa-lean"
    assert full[3, "elsa-lean-offload"]["depth_rel_err"] == 0
    assert full[3, "elsa"]["accuracy_vs"] == "native" and full[3, "elsa"]["depth_rel_err"] < 1e-5
    assert 0 < full[3, "elsa-merge"]["depth_rel_err"] < 0.5 and full[3, "elsa-merge"]["pose_max_abs_diff"] > 0
    assert full[3, "elsa-merge-fast"]["accuracy_vs"] == "elsa" and 0 < full[3, "elsa-merge-fast"]["depth_rel_err"] < 0.5
    assert all("speedup_vs_native" in r for r in rows)
    for r in rows:
        r["peak_gib"] = 0.25 * r["frames"] + 1
    cap = FB.capacity(rows, 10 * 2**30)
    assert {c["estimated_max_frames"] for c in cap} == {int(3 + (0.95 * 10 - 1.75) / 0.25)}
    FB.plot(rows, tmp_path / "frames.png")
    assert (tmp_path / "frames.png").stat().st_size > 0


def test_frames_benchmark_compiled_aggregator_on_the_standin(standin, monkeypatch):
    """--compile: every variant's aggregator eagerly and compiled in one process, the compiled rows
    against the compiled native one and their own eager call, with the graphs and breaks of each."""
    from benchmarks import frames as FB
    monkeypatch.setattr(FB, "DEVICE", "cpu")
    monkeypatch.setattr(FB, "COMPILE_BACKEND", "aot_eager")
    m = make_standin()

    def apply(model, variant, dtype):
        elsa_vision.patch(model)  # (the kernels: the reference backend has no fused q/k norm + RoPE, and
        # the stand-in's own RoPE reads positions.max() with .item(), a graph break, as VGGT's does)
        return lambda: elsa_vision.unpatch(model)
    prof = []
    rows = FB.sweep_compiled(m, ["native", "elsa"], apply, ["fp32"], {"fp32": [2]}, 1, (42, 70), "default",
                             log=lambda s: None, profile=prof)
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"native", "elsa", "native+compile", "elsa+compile"}
    assert all(r["status"] == "ok" and r["seconds"] > 0 for r in rows)
    assert by["elsa+compile"]["compile"] == "default" and by["elsa"]["compile"] == ""
    e = by["elsa+compile"]  # one graph, compiled in the warm-up only
    assert e["fullgraph"] and e["graphs_compiled"] == 1 and e["graph_breaks"] == 0 and e["steady"], e
    n = by["native+compile"]  # (whole or not depends on torch's tracing of the stand-in RoPE's .item())
    assert n["graphs_compiled"] >= 1 and n["steady"] and (n["graph_breaks"] == 0) == n["fullgraph"], n
    assert e["speedup_vs_eager"] > 0 and n["speedup_vs_eager"] > 0
    assert by["elsa+compile"]["speedup_vs_native"] > 0 and by["elsa"]["speedup_vs_native"] > 0
    assert by["native"]["max_rel_err"] == 0
    assert all(r["max_rel_err"] < 1e-5 for r in rows)  # (float32: the patched blocks agree to rounding)
    # one eager and one compiled call of each variant profiled (on the CPU: operator time)
    assert {r["variant"] for r in prof} == set(by) and all(r["cuda_ms"] >= 0 for r in prof)


def test_frames_benchmark_records_out_of_memory(standin, monkeypatch):
    """A variant that runs out of device or page-locked host memory (a plain CUDA error) becomes an
    OOM row, is skipped at larger frame counts, and the sweep goes on with the others."""
    from benchmarks import frames as FB
    monkeypatch.setattr(FB, "DEVICE", "cpu")
    m = make_standin()
    errors = {"elsa": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20 GiB"),
              "elsa-lean": RuntimeError("CUDA error: out of memory"), "elsa-merge": RuntimeError("bad shape")}

    def apply(model, variant, dtype):
        def boom(*a, **k):
            raise errors[variant]
        if variant in errors:
            model.aggregator.forward = boom
        return lambda: model.aggregator.__dict__.pop("forward", None)

    variants = {v: FB.VARIANTS[v] for v in ("native", "elsa", "elsa-lean")}
    rows = FB.sweep(m, variants, apply, ["aggregator"], ["fp32"], {"fp32": [2, 3]}, 1, False, (42, 70),
                    log=lambda s: None)
    status = {(r["frames"], r["variant"]): r["status"] for r in rows}
    assert status[2, "native"] == status[3, "native"] == "ok"
    assert status[2, "elsa"] == "OOM" and status[2, "elsa-lean"] == "OOM (CUDA error: out of memory)"
    assert status[3, "elsa"] == status[3, "elsa-lean"] == "skipped (OOM at fewer frames)"
    with pytest.raises(RuntimeError, match="bad shape"):  # other errors are not hidden
        FB.sweep(m, {"elsa-merge": None}, apply, ["aggregator"], ["fp32"], {"fp32": [2]}, 1, False, (42, 70),
                 log=lambda s: None)

    def apply_late_failure(model, variant, dtype):  # fails at the second frame count only
        real = type(model.aggregator).forward

        def fwd(self_or_x, *a, **k):
            x = self_or_x
            if x.shape[-4] == 3:
                raise RuntimeError("bad shape")
            return real(model.aggregator, x, *a, **k)
        model.aggregator.forward = fwd
        return lambda: model.aggregator.__dict__.pop("forward", None)

    kept = []
    with pytest.raises(RuntimeError, match="bad shape"):
        FB.sweep(m, {"native": None}, apply_late_failure, ["aggregator"], ["fp32"], {"fp32": [2, 3]}, 1, False,
                 (42, 70), log=lambda s: None, rows=kept)
    assert [(r["frames"], r["status"]) for r in kept] == [(2, "ok")]  # what ran before the failure is kept


def test_frames_memory_rehearsal(standin, monkeypatch):
    """frames.py --memory-rehearsal: under the kernels' allocations-only switch the Triton forward
    only allocates (the same output layout and statistics, and a split launch's summaries), rows
    carry the peak memory and no time; launches run again after the switch."""
    from benchmarks import frames as FB
    from elsa_vision.kernels import attention as K
    from elsa_vision.kernels.launch import allocations_only
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    launched = []
    monkeypatch.setattr(K, "_fwd_kernel", type("Spy", (), {"__getitem__": lambda self, g: launched.append(g)})())
    with allocations_only():
        out, stats = K.forward(q, k, v, None, 0.25, False, "ieee")
        ref = elsa_vision.attention(q, k, v, scale=0.25, backend="reference")
        assert out.shape == q.shape and out.stride() == ref.transpose(1, 2).contiguous().transpose(1, 2).stride()
        assert stats.shape == (1, 2, 2, 20)
        long_k = torch.randn(1, 2, 200, 16)  # a split launch: its summaries are allocated too
        info = {}
        out, stats = K.forward(q, long_k, long_k, None, 0.25, False, "ieee", partitions=2, summaries=info)
        assert out.shape == q.shape and stats.shape == (1, 2, 2, 20) and info["W"].shape[1] == 2
    assert launched == []  # nothing was launched while rehearsing
    monkeypatch.setattr(FB, "DEVICE", "cpu")
    m = make_standin()

    def apply(model, variant, dtype):
        elsa_vision.patch(model, backend="triton")
        return lambda: elsa_vision.unpatch(model)

    rows = FB.sweep(m, {"elsa": {}}, apply, ["aggregator"], ["fp32"], {"fp32": [2]}, 1, False, (42, 70),
                    log=lambda s: None, rehearsal=True)
    assert [r["status"] for r in rows] == ["memory rehearsal"] and "seconds" not in rows[0]
    assert "peak_gib" in rows[0] and "speedup_vs_native" not in rows[0]
    assert launched == []  # the sweep ran the patched model under the switch
    with pytest.raises(TypeError):  # and left it: the spy is launched (and fails) again
        K.forward(q, k, v, None, 0.25, False, "ieee")
    assert launched


def test_distributed_benchmark_cpu_smoke(tmp_path):
    """benchmarks/distributed.py under torchrun on three CPU processes (gloo): the attention part writes
    its rows for two and three ranks, the ring's transfers overlapped or not, each with the one-process
    baseline and the scaling columns."""
    import csv
    import os
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the reference backend: fast
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                           str(ROOT / "benchmarks" / "distributed.py"), "--device", "cpu", "--parts", "attention",
                           "--frames", "2,3", "--tokens", "16", "--dtypes", "fp32", "--ranks", "2,3",
                           "--overlap", "on,off", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "distributed_3.csv")))
    assert [(r["frames"], r["part"], r["ranks"], r["overlap"]) for r in rows] == [
        (f, "attention", n, o) for f in ("2", "3") for n in ("2", "3") for o in ("True", "False")]
    assert all(float(r["seconds"]) > 0 and float(r["efficiency"]) > 0 for r in rows)
    assert all(float(r["rel_l2_vs_one_gpu"]) < 1e-5 for r in rows)  # the shards make up the same problem
    assert (tmp_path / "distributed_3.png").stat().st_size > 0


def test_models_benchmark_static_launch_variant(tmp_path, monkeypatch):
    """benchmarks/models.py --compile default --static-launch: an elsa_static variant compiled with
    STATIC_LAUNCH_OPTIONS (torch.compile recorded here and left out: the CPU has no launcher to
    compare), its ratio to elsa in the row; refused without --compile default."""
    pytest.importorskip("timm")
    import csv
    from benchmarks import models
    compiled = []
    monkeypatch.setattr(models.torch, "compile", lambda model, **kw: compiled.append(kw) or model)
    monkeypatch.setenv("ELSA_RESULTS_DIR", str(tmp_path))
    models.main(["--models", "ViT-T", "--sizes", "32", "--batches", "2", "--modes", "fwd", "--dtypes", "bf16",
                 "--warmup", "1", "--rounds", "2", "--device", "cpu", "--name", "static", "--compile", "default",
                 "--static-launch"])
    (row,) = list(csv.DictReader(open(tmp_path / "static.csv")))
    assert float(row["elsa_static_ms"]) > 0 and float(row["static_speedup_vs_elsa"]) > 0, row
    assert row["user_kernel_launchers"] == ""  # (none loaded on the CPU)
    assert compiled.count({"options": models.STATIC_LAUNCH_OPTIONS}) == 1 and {"mode": None} in compiled
    with pytest.raises(SystemExit):
        models.main(["--static-launch", "--compile", "reduce-overhead", "--device", "cpu"])


def test_models_benchmark_with_eager_and_no_unfused(tmp_path, monkeypatch):
    """benchmarks/models.py --compile MODE --with-eager --no-unfused: an elsa_eager variant (a copy of
    the patched model, not compiled) with compile_speedup_vs_eager in the row, no unfused variant
    (one compile fewer), torch.compile called for elsa and fused only (recorded and left out here),
    each variant's CUDA-graph skips counted during its own calls; --with-eager refused without
    --compile; max_diff of outputs that, as under CUDA graphs, live in one pool the next call
    overwrites (the ELSA model's here offset by one, so the difference is known)."""
    pytest.importorskip("timm")
    import csv
    from benchmarks import models
    compiled = []
    skips = models.torch._dynamo.utils.counters
    pool = []

    def pooled(out):
        if not pool or pool[0].shape != out.shape or pool[0].dtype != out.dtype:
            pool[:] = [torch.empty_like(out)]
        return pool[0].copy_(out)

    def compile(model, **kw):  # (the first model compiled, ELSA's, reports a CUDA-graph skip per call)
        compiled.append(model)
        first = len(compiled) == 1

        def run(*args):
            if first:
                skips["inductor"]["cudagraph_skips"] += 1
            return pooled(model(*args) + 1 if first else model(*args))
        return run
    monkeypatch.setattr(models.torch, "compile", compile)
    monkeypatch.setenv("ELSA_RESULTS_DIR", str(tmp_path))
    models.main(["--models", "ViT-T", "--sizes", "32", "--batches", "2", "--modes", "fwd", "--dtypes", "bf16",
                 "--warmup", "1", "--rounds", "2", "--device", "cpu", "--name", "eager", "--compile",
                 "max-autotune", "--with-eager", "--no-unfused"])
    (row,) = list(csv.DictReader(open(tmp_path / "eager.csv")))
    assert float(row["elsa_eager_ms"]) > 0, row
    # (every call of the compiled ELSA model counted, none of the others')
    assert int(row["elsa_cudagraph_skips"]) >= 3 and row["fused_cudagraph_skips"] == "0", row
    assert float(row["compile_speedup_vs_eager"]) == pytest.approx(float(row["elsa_eager_ms"]) / float(row["elsa_ms"]))
    assert not row.get("unfused_ms") and float(row["fused_ms"]) > 0, row
    assert row["max_diff_vs"] == "fused" and 0.9 <= float(row["max_diff"]) <= 1.1, row
    assert len(compiled) == 2 and compiled[0] is not compiled[1]
    with pytest.raises(SystemExit):
        models.main(["--with-eager", "--device", "cpu"])


def test_logit_scale_benchmark_smoke(tmp_path):
    """benchmarks/logit_scale.py on one weight draw (reference backend): a row per block of the padded
    Swin v2 model with the three orders' errors, the rules' verdicts, and a PNG."""
    from benchmarks import logit_scale
    import csv
    assert logit_scale.main(["--draws", "1", "--inputs", "0", "--backend", "reference", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "swinv2_logit_scale_rounding.csv")))
    assert [r["block"] for r in rows] == [f"layers.{i}.blocks.{j}" for i in (0, 1) for j in (0, 1)]
    assert [int(r["heads"]) for r in rows] == [2, 2, 4, 4]
    assert all(0 < float(r[k]) < 1e-3 for r in rows for k in ("timm_err", "tau_in_q_err", "elsa_err"))
    assert all(r["served"] == "True" for r in rows)
    assert (tmp_path / "swinv2_logit_scale_rounding.png").stat().st_size > 0


def test_pv_overlap_counts_exponentials_between_the_waits():
    """window_compile.pv_overlap: per steady-state tile (a wait leaving one MMA group in flight,
    then the wait for all), the exponentials issued between the two; a tile whose full wait comes
    first counts 0; a full wait with no partial one before it counts nothing."""
    pytest.importorskip("triton")
    from benchmarks.window_compile import pv_overlap
    listing = "\n".join([
        "HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR16].tnspB, R88, gsb0 ;",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",            # a prologue's full wait: not a tile
        "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
        "MUFU.EX2 R24, R24 ;", "MUFU.EX2 R25, R25 ;",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
        "FMNMX R23, R24, R25, !PT ;",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "MUFU.EX2 R26, R26 ;",
    ])
    assert pv_overlap(listing) == [2, 0]


def test_key_loop_spills_counts_local_traffic_inside_the_innermost_mma_loops():
    """window_compile.key_loop_spills: local loads/stores inside each innermost loop (a backward
    branch) that holds a partial warpgroup-MMA wait; spills outside it (an item's prologue), loops
    without such a wait, and the out-of-line mbarrier retries after EXIT do not count."""
    pytest.importorskip("triton")
    from benchmarks.window_compile import key_loop_spills

    def at(addr, op):
        return f"        /*{addr:04x}*/                   {op} ;"
    listing = "\n".join([
        at(0x00, "STL [R1], R2"),                       # prologue spill: outside every loop
        at(0x10, "LDL R2, [R1]"),                       # item loop starts here
        at(0x20, "WARPGROUP.DEPBAR.LE gsb0, 0x1"),      # key loop starts here
        at(0x30, "LDL R3, [R1+0x4]"),
        at(0x40, "STL [R1+0x4], R3"),
        at(0x50, "@P0 BRA 0x20"),                       # key loop's back edge
        at(0x60, "IADD3 R4, R4, 0x1, RZ"),              # a loop with no MMA wait: not a key loop
        at(0x70, "LDL R5, [R1+0x8]"),
        at(0x80, "@P1 BRA 0x60"),
        at(0x90, "@P2 BRA 0x10"),                       # item loop: holds the key loop
        at(0xa0, "EXIT"),
        at(0xb0, "LDL R6, [R1+0xc]"),                   # a retry stub branching back: not a loop
        at(0xc0, "BRA 0x20"),
    ])
    assert key_loop_spills(listing) == [2]
