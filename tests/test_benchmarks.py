"""The benchmark harness's timing loop and the window benchmark's CPU smoke mode."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import harness  # noqa: E402


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


@pytest.mark.parametrize("args", [["--smoke", "--shapes", "swinT-s3", "--dtypes", "fp32", "--profile"]])
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


def test_windows_benchmark_blocks_smoke(tmp_path):
    """--blocks: timm's Swin block _attn against ELSA's module-level and block-fused patches."""
    from benchmarks import windows
    import csv
    windows.main(["--smoke", "--blocks", "--dtypes", "fp32", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "windows_blocks.csv")))
    assert {r["variant"] for r in rows} == {"timm-sdpa", "timm-math", "elsa-window", "elsa-block"}
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
    assert all(r["ms"] and not r["error"] for r in rows), [r for r in rows if r["error"]]
