"""demos/stream.py: a CPU stream of synthetic frames through a small random StreamVGGT (``--tiny``),
patched and native, its outputs, and clear errors. Needs StreamVGGT's source on PYTHONPATH (not on
PyPI), transformers and OpenCV; skips without them."""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demos" / "stream.py"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


MISSING = [m for m in ("streamvggt", "cv2", "transformers") if not _importable(m)]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"not importable: {', '.join(MISSING)}")


def _env():
    """This interpreter's import path (the streamvggt source included) for the demo's process; no
    Triton interpreter: on CPU the reference scan serves, and fast."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(ROOT)]
    spec = importlib.util.find_spec("streamvggt") if not MISSING else None
    if spec is not None and spec.submodule_search_locations:
        paths += [str(Path(p).parent) for p in spec.submodule_search_locations]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, str(DEMO), *map(str, args)], capture_output=True, text=True,
                          env=_env(), timeout=timeout)


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "demos"))
    import reconstruct as R
    folder = tmp_path_factory.mktemp("stream") / "scene"
    R.write_synthetic_scene(folder, 5)  # 700×500 frames: 98×140 at --width 140
    return folder


@pytest.mark.parametrize("baseline", [False, True], ids=["elsa", "native"])
def test_tiny_stream_on_cpu(scene, tmp_path, baseline):
    out = tmp_path / "out"
    proc = _run(scene, "--tiny", "--random-weights", "--device", "cpu", "--width", 140, "--frames", 4,
                "--every", 2, "--out", out, *(["--baseline"] if baseline else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("module(s) patched" in proc.stdout) != baseline

    summary = json.loads((out / "summary.json").read_text())
    assert summary["frames"] == 4 and summary["image_size_hw"] == [98, 140]
    assert summary["tokens_per_frame"] == 5 + 7 * 10
    assert summary["attention"] == ("native" if baseline else "elsa")
    assert summary["median_ms_last_10"] > 0 and summary["points"] > 0 and summary["peak_memory_gib"] is None

    header = (out / "points.ply").read_bytes()[:300].decode("latin1")
    assert header.startswith("ply\n") and f"element vertex {summary['points']}\n" in header

    cams = json.loads((out / "cameras.json").read_text())["cameras"]
    assert [c["frame"] for c in cams] == [0, 1, 2, 3]
    assert [c["source"] for c in cams] == [f"{i:05d}.png" for i in range(4)]
    c2w = np.array(cams[0]["camera_to_world"])
    extr = np.array(cams[0]["extrinsic_world_to_camera"])
    assert c2w.shape == (4, 4) and extr.shape == (3, 4) and np.array(cams[0]["intrinsic"]).shape == (3, 3)
    assert np.allclose(c2w[:3, :3] @ extr[:, :3], np.eye(3), atol=1e-4) and np.allclose(c2w[3], [0, 0, 0, 1])

    with open(out / "latency.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["frame"] for r in rows] == ["0", "1", "2", "3"] and all(float(r["ms"]) > 0 for r in rows)
    assert all(r["allocated_gib"] == "" and r["peak_gib"] == "" for r in rows)  # CPU: no memory columns
    assert not list(out.glob("*.tmp"))


def test_video_stride_and_frames(scene, tmp_path):
    import cv2
    video = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 10, (700, 500))
    if not writer.isOpened():
        pytest.skip("this OpenCV build cannot write MJPG video")
    for f in sorted(scene.glob("*.png")):
        writer.write(cv2.imread(str(f)))
    writer.release()
    out = tmp_path / "out"
    proc = _run(video, "--tiny", "--device", "cpu", "--width", 70, "--stride", 2, "--frames", 2, "--out", out,
                "--quiet", "--every", 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cams = json.loads((out / "cameras.json").read_text())["cameras"]
    assert [c["source"] for c in cams] == ["clip.avi#0", "clip.avi#2"]
    assert json.loads((out / "summary.json").read_text())["image_size_hw"] == [56, 70]


def test_missing_input_is_a_clear_error(tmp_path):
    proc = _run(tmp_path / "no_such_video.mp4", "--tiny", "--device", "cpu", "--out", tmp_path / "out", timeout=120)
    assert proc.returncode != 0
    assert "does not exist" in proc.stderr and "no_such_video.mp4" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_missing_packages_are_clear_errors(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "demos"))
    import stream as S
    args = S.parse_args([str(tmp_path), "--random-weights", "--device", "cpu"])
    for name in [m for m in sys.modules if m == "streamvggt.models.streamvggt"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if transformers were not installed
    with pytest.raises(S.DemoError, match="pip install transformers"):
        S.load_model(args)
    monkeypatch.setitem(sys.modules, "streamvggt", None)  # as if streamvggt were not on the path
    with pytest.raises(S.DemoError, match="https://github.com/wzzheng/StreamVGGT"):
        S.load_model(args)
