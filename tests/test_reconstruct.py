"""demos/reconstruct.py: frame sampling, clear errors, and a CPU run with random weights on tiny
generated images (needs vggt; slow: it builds the 1B-parameter model)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "demos"))
cv2 = pytest.importorskip("cv2")
import reconstruct as R  # noqa: E402

HAS_VGGT = importlib.util.find_spec("vggt") is not None and importlib.util.find_spec("vggt.models") is not None


def write_images(folder: Path, n=3, hw=(60, 80)):
    folder.mkdir(parents=True, exist_ok=True)
    y, x = np.mgrid[0:hw[0], 0:hw[1]]
    for i in range(n):
        img = np.stack([(x * 3 + i * 20) % 255, (y * 4) % 255, ((x + y) * 2 + i * 40) % 255], -1).astype(np.uint8)
        cv2.imwrite(str(folder / f"img_{i:02d}.png"), img)
    return folder


def test_uniform_sampling():
    assert R.uniform_indices(5, 10) == [0, 1, 2, 3, 4]
    assert R.uniform_indices(100, 3) == [0, 50, 99]
    idx = R.uniform_indices(1000, 400)
    assert len(set(idx)) == 400 and idx[0] == 0 and idx[-1] == 999


def test_folder_and_video_inputs(tmp_path):
    frames, labels = R.read_frames(write_images(tmp_path / "imgs", n=5), 3)
    assert labels == ["img_00.png", "img_02.png", "img_04.png"] and frames[0].shape == (60, 80, 3)
    video = tmp_path / "clip.avi"
    out = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 10, (80, 60))
    if not out.isOpened():
        pytest.skip("this OpenCV build cannot write MJPG video")
    for i in range(8):
        out.write(np.full((60, 80, 3), i * 30, np.uint8))
    out.release()
    frames, labels = R.read_frames(video, 3)
    assert labels == ["clip.avi#0", "clip.avi#4", "clip.avi#7"]
    assert abs(int(frames[1].mean()) - 120) <= 3  # the 5th frame, not a neighbour
    images = R.preprocess(frames, width=70)
    assert tuple(images.shape) == (3, 3, 56, 70) and 0.0 <= float(images.min()) <= float(images.max()) <= 1.0


def test_synthetic_scene(tmp_path):
    R.write_synthetic_scene(tmp_path / "scene", 5)
    frames, labels = R.read_frames(tmp_path / "scene", 5)
    assert labels == [f"{i:05d}.png" for i in range(5)] and frames[0].shape == (500, 700, 3)
    assert not np.array_equal(frames[0], frames[4]) and frames[2].std() > 10  # textured, and the camera moves
    with pytest.raises(SystemExit):  # never writes into a folder that holds something
        R.parse_args([str(tmp_path / "scene"), "--synthetic"])


def test_clear_errors(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(R.DemoError, match="no images found"):
        R.read_frames(empty, 4)
    with pytest.raises(R.DemoError, match="does not exist"):
        R.read_frames(tmp_path / "missing", 4)
    with pytest.raises(R.DemoError, match="multiple of 14"):
        R.preprocess([np.zeros((10, 10, 3), np.uint8)], width=100)
    monkeypatch.setitem(sys.modules, "vggt", None)  # as if vggt were not installed
    monkeypatch.setitem(sys.modules, "vggt.models", None)
    monkeypatch.setitem(sys.modules, "vggt.models.vggt", None)
    args = R.parse_args([str(tmp_path), "--random-weights"])
    with pytest.raises(R.DemoError, match="pip install git\\+https://github.com/facebookresearch/vggt"):
        R.load_model(args)
    with pytest.raises(SystemExit):
        R.parse_args([str(tmp_path), "--baseline", "--lean"])
    with pytest.raises(SystemExit):
        R.parse_args([str(tmp_path), "--offload"])
    monkeypatch.setitem(sys.modules, "trimesh", None)  # a writer missing: refused before the model runs
    with pytest.raises(SystemExit):
        R.parse_args([str(tmp_path), "--random-weights"])
    assert "trimesh" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_VGGT, reason="vggt is not installed")
def test_unreachable_weights_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True, raising=False)  # read at import time
    args = R.parse_args([str(tmp_path), "--weights", "facebook/VGGT-1B"])
    with pytest.raises(R.DemoError, match="--random-weights"):
        R.load_model(args)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VGGT, reason="vggt is not installed")
def test_reconstruct_random_weights_on_cpu(tmp_path):
    src = write_images(tmp_path / "imgs", n=3)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the reference scan on CPU: fast
    proc = subprocess.run([sys.executable, str(ROOT / "demos" / "reconstruct.py"), str(src), "--random-weights",
                           "--device", "cpu", "--width", "70", "--frames", "3", "--out", str(out), "--lean",
                           "--offload", "--merge", "--quiet"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["frames"] == 3 and summary["image_size_hw"] == [56, 70] and summary["attention"] == "elsa"
    assert summary["tokens_per_frame"] == 5 + 4 * 5 and summary["global_tokens"] == 75
    assert summary["patched_modules"] == 76 + 1 + 2 and summary["lean_memory"] and summary["token_merging"]["ratio"] == 0.9
    assert summary["lean_offload"]
    header = (out / "points.ply").read_bytes()[:300].decode("latin1")
    assert f"element vertex {summary['points_written']}" in header and summary["points_written"] > 0
    cams = json.loads((out / "cameras.json").read_text())["cameras"]
    assert len(cams) == 3 and np.allclose(np.array(cams[0]["camera_to_world"])[3], [0, 0, 0, 1])
    depth = np.load(out / "depth" / "depth.npz")
    assert depth["depth"].shape == (3, 56, 70)
    for name in ("scene.glb", "preview.png", "depth/depth_0002.png"):
        assert (out / name).stat().st_size > 0


def test_distributed_needs_torchrun(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        R.parse_args([str(tmp_path), "--distributed"])
    assert "torchrun" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        R.parse_args([str(tmp_path), "--distributed", "--baseline"])
    assert "--baseline" in capsys.readouterr().err
    assert R.parse_args([str(tmp_path), "--distributed", "--merge"]).merge == 0.9
    assert R.shard_sizes(5, 2) == [3, 2] and R.shard_sizes(7, 3) == [3, 2, 2]


def test_merge_argument(tmp_path, capsys):
    """--merge takes nothing (ratio 0.9), a ratio, or 'fast' (TokenMerging.fast()); anything else is
    refused with what it takes."""
    assert R.parse_args([str(tmp_path), "--merge"]).merge == 0.9
    assert R.parse_args([str(tmp_path), "--merge", "0.5"]).merge == 0.5
    assert R.parse_args([str(tmp_path), "--merge", "fast"]).merge == "fast"
    for bad in ("quick", "1.5"):
        with pytest.raises(SystemExit):
            R.parse_args([str(tmp_path), "--merge", bad])
        assert "--merge" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VGGT, reason="vggt is not installed")
@pytest.mark.parametrize("merge", [False, True])
def test_reconstruct_distributed_on_cpu_equals_one_process(tmp_path, merge):
    """Two CPU processes (gloo) under torchrun, the frames split 2 + 1: rank 0 writes the same depth
    and cameras as one process (float32 rounding of the sharded global attention aside), with token
    merging too."""
    src = write_images(tmp_path / "imgs", n=3)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    common = [str(src), "--random-weights", "--device", "cpu", "--width", "70", "--frames", "3", "--quiet",
              *(["--merge", "0.5"] if merge else [])]
    one = subprocess.run([sys.executable, str(ROOT / "demos" / "reconstruct.py"), *common, "--out",
                          str(tmp_path / "one")], capture_output=True, text=True, env=env, timeout=900)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(ROOT / "demos" / "reconstruct.py"), *common, "--out", str(tmp_path / "two"),
                          "--distributed"], capture_output=True, text=True, env=env, timeout=900)
    assert two.returncode == 0, two.stderr[-3000:]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["frames_per_process"] == [2, 1] and summary["frames"] == 3
    a, b = (np.load(tmp_path / d / "depth" / "depth.npz") for d in ("one", "two"))
    assert np.allclose(a["depth"].astype(np.float32), b["depth"].astype(np.float32), rtol=1e-3, atol=1e-3)
    cams = [json.loads((tmp_path / d / "cameras.json").read_text())["cameras"] for d in ("one", "two")]
    for c1, c2 in zip(*cams):
        assert np.allclose(c1["camera_to_world"], c2["camera_to_world"], atol=1e-3)
