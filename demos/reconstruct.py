"""Multi-view 3D reconstruction with VGGT on ELSA attention.

    python demos/reconstruct.py path/to/images/ --frames 200 --out out/scene
    python demos/reconstruct.py walk.mp4 --frames 400 --lean --merge        # long video, one GPU
    python demos/reconstruct.py walk.mp4 --frames 1000 --lean --merge fast  # TokenMerging.fast()
    python demos/reconstruct.py walk.mp4 --frames 2000 --lean --offload     # longest: layers in host memory
    python demos/reconstruct.py path/to/images/ --baseline                   # native attention, to compare
    torchrun --nproc-per-node 4 demos/reconstruct.py walk.mp4 --frames 4000 --lean --distributed
                                              # frames sharded over 4 GPUs; rank 0 writes the results
    python demos/reconstruct.py path/to/images/ --random-weights --device cpu --width 140   # offline smoke run
    python demos/reconstruct.py /tmp/scene --synthetic --frames 400 --random-weights --lean  # offline timing run

Input: a folder of images (sorted by name) or a video (OpenCV); N frames are sampled uniformly.
Frames are resized like vggt's ``load_and_preprocess_images(mode="crop")`` (width 518 → 392×518 for
4:3 input). The model is ``facebook/VGGT-1B`` from the Hugging Face hub, a local checkpoint
(``--weights model.pt`` / a ``from_pretrained`` folder) or random weights (``--random-weights``).

Writes to ``--out``:
  points.ply      coloured point cloud, confidence-filtered (binary PLY)
  scene.glb       the points and one frustum per camera (trimesh)
  cameras.json    per frame: world-to-camera extrinsic (OpenCV), camera-to-world, intrinsic, source
  depth/          colourised depth PNGs; depth.npz holds depth and confidence (float16)
  preview.png     sampled frames, their depth, and a view of the points with the cameras
  summary.json    frames, tokens, attention mode, time, peak memory, points

Needs vggt (``pip install git+https://github.com/facebookresearch/vggt``) and the demo extras
(``pip install elsa-vision[demo]``: opencv, huggingface_hub, trimesh, matplotlib, tqdm, pillow).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

VGGT_INSTALL = "pip install git+https://github.com/facebookresearch/vggt"
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
VIDEO_EXTS = (".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg")


class DemoError(Exception):
    """A problem the user can fix; printed without a traceback."""


QUIET = False  # --quiet: no progress bars at all


def _tqdm(iterable=None, **kw):
    if QUIET:
        kw["disable"] = True
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress bars are a nicety
        class tqdm:  # noqa: N801
            def __init__(self, it=None, **_):
                self.it = it

            def __iter__(self):
                return iter(self.it)

            def update(self, n=1):
                pass

            def close(self):
                pass
    return tqdm(iterable, **kw)


# ------------------------------------------------------------------------------------------------
# Frames
# ------------------------------------------------------------------------------------------------

def uniform_indices(total: int, n: int) -> list[int]:
    """n indices spread evenly over range(total) (all of them when n >= total)."""
    if n >= total:
        return list(range(total))
    return [int(round(i)) for i in np.linspace(0, total - 1, n)]


def read_frames(source: Path, n: int) -> tuple[list[np.ndarray], list[str]]:
    """Up to n RGB uint8 frames [h, w, 3] sampled uniformly, and a label per frame."""
    import cv2
    if not source.exists():
        raise DemoError(f"input {source} does not exist")
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_EXTS)
        if not files:
            raise DemoError(f"no images found in {source} (looked for {', '.join(IMAGE_EXTS)})")
        files = [files[i] for i in uniform_indices(len(files), n)]
        frames = []
        for f in _tqdm(files, desc="reading images", unit="img"):
            img = cv2.imread(str(f), cv2.IMREAD_COLOR)
            if img is None:
                raise DemoError(f"cannot read image {f}")
            frames.append(cv2.cvtColor(img, cv2.COLOR_BGR2RGB))
        return frames, [f.name for f in files]
    cap = cv2.VideoCapture(str(source))
    if not cap.isOpened():
        kind = "video" if source.suffix.lower() in VIDEO_EXTS else "image folder or video"
        raise DemoError(f"cannot open {source} as a {kind} (OpenCV could not decode it)")
    total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    if total <= 0:  # some containers do not report a count: read them all once
        total = 0
        while cap.grab():
            total += 1
        cap.release()
        cap = cv2.VideoCapture(str(source))
    if total == 0:
        raise DemoError(f"no frames found in video {source}")
    wanted = uniform_indices(total, n)
    want = set(wanted)
    frames, labels = [], []
    bar = _tqdm(total=len(wanted), desc="reading video", unit="frame")
    for i in range(total):  # sequential grab/retrieve: exact frames, unlike seeking in many codecs
        if not cap.grab():
            break
        if i in want:
            ok, img = cap.retrieve()
            if ok:
                frames.append(cv2.cvtColor(img, cv2.COLOR_BGR2RGB))
                labels.append(f"{source.name}#{i}")
                bar.update()
        if len(frames) == len(wanted):
            break
    bar.close()
    cap.release()
    if not frames:
        raise DemoError(f"no frames could be decoded from {source}")
    return frames, labels


def write_synthetic_scene(folder: Path, n: int, seed: int = 0) -> None:
    """``n`` 700×500 PNG frames of a textured plane (400 random rectangles on a 2400×600 canvas) seen by
    a camera sliding sideways: an offline input of any length for timing runs (``--synthetic``)."""
    import cv2
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    H, W = 600, 2400
    world = np.zeros((H, W, 3), np.uint8)
    for _ in range(400):
        x, y = rng.integers(0, W - 60), rng.integers(0, H - 60)
        w, h = rng.integers(10, 120, 2)
        colour = tuple(int(c) for c in rng.integers(0, 255, 3))
        cv2.rectangle(world, (int(x), int(y)), (int(x + w), int(y + h)), colour, -1)
    for i in range(n):
        x0 = int((W - 700) * i / max(1, n - 1))
        cv2.imwrite(str(folder / f"{i:05d}.png"), world[50:550, x0:x0 + 700])


def preprocess(frames: list[np.ndarray], width: int = 518) -> torch.Tensor:
    """[S, 3, H, W] in [0, 1], like vggt's load_and_preprocess_images(mode="crop"): width ``width``,
    height scaled by the aspect ratio and rounded to a multiple of 14, centre-cropped to ``width`` if
    taller. Every frame takes the size computed from the first one."""
    import cv2
    if width % 14 or width < 14:
        raise DemoError(f"--width must be a positive multiple of 14 (the patch size), got {width}")
    h0, w0 = frames[0].shape[:2]
    height = max(14, int(round(h0 * width / w0 / 14)) * 14)
    out = []
    for f in frames:
        img = cv2.resize(f, (width, height), interpolation=cv2.INTER_CUBIC if width > f.shape[1] else cv2.INTER_AREA)
        if height > width:
            top = (height - width) // 2
            img = img[top:top + width]
        out.append(torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1))
    return torch.stack(out).float().div_(255.0)


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------

def load_model(args):
    try:
        from vggt.models.vggt import VGGT
    except ImportError as e:
        raise DemoError(f"vggt is not installed ({e}); install it with:\n    {VGGT_INSTALL}") from None
    if args.random_weights:
        torch.manual_seed(args.seed)
        return VGGT(enable_track=False), "random"
    w = Path(args.weights).expanduser()
    if not w.exists() and (w.suffix in (".pt", ".pth", ".bin", ".safetensors") or w.is_absolute()
                           or str(args.weights).startswith((".", "~"))):
        raise DemoError(f"--weights {args.weights}: no such file or folder (or give a Hugging Face repo id, "
                        "e.g. facebook/VGGT-1B)")
    if w.is_file():
        try:
            if w.suffix == ".safetensors":
                from safetensors.torch import load_file
                state = load_file(str(w))
            else:
                state = torch.load(str(w), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - pickle, zip and safetensors errors differ
            raise DemoError(f"{w} is not a readable checkpoint ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
        if not isinstance(state, dict):
            raise DemoError(f"{w} holds a {type(state).__name__}, not a VGGT state dict")
        model = VGGT(enable_track=False)
        missing, unexpected = model.load_state_dict(state, strict=False)
        real_missing = [k for k in missing if not k.startswith("track_head.")]
        if real_missing:
            raise DemoError(f"{w} is not a VGGT checkpoint: {len(real_missing)} missing keys, e.g. {real_missing[:3]}")
        return model, str(w)
    try:
        model = VGGT.from_pretrained(str(w) if w.is_dir() else args.weights, enable_track=False)
    except Exception as e:  # noqa: BLE001 - hub errors come in many types (offline, 404, gated, auth)
        raise DemoError(f"could not load weights {args.weights!r}: {type(e).__name__}: {str(e).splitlines()[0][:200]}\n"
                        "  offline? download model.pt once and pass --weights /path/to/model.pt, "
                        "or run with --random-weights") from None
    return model, args.weights


def autocast_dtype(device: torch.device, name: str):
    if name == "fp32" or device.type != "cuda":
        return None
    if name == "auto":
        return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def infer(model, images: torch.Tensor, device: torch.device, dtype, progress: bool):
    """One forward with a progress bar over the aggregator's global layers; returns predictions,
    seconds and peak bytes."""
    bar = _tqdm(total=len(model.aggregator.global_blocks), desc="aggregator", unit="layer", disable=not progress)

    def tick(*_):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        bar.update()

    # ls1 runs once per global block in every mode; a hook on the block or its attention would make
    # lean mode run them whole (it keeps hooked calls intact) and lose its chunking
    hooks = [b.ls1.register_forward_hook(tick) for b in model.aggregator.global_blocks]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            if dtype is not None:
                with torch.autocast(device.type, dtype=dtype):
                    preds = model(images.to(device))
            else:
                preds = model(images.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        for h in hooks:
            h.remove()
        bar.close()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return preds, seconds, peak


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------

def write_ply(path: Path, xyz: np.ndarray, rgb: np.ndarray) -> None:
    """Binary little-endian PLY with float xyz and uchar rgb."""
    rec = np.empty(len(xyz), dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("r", "u1"), ("g", "u1"), ("b", "u1")])
    rec["x"], rec["y"], rec["z"] = xyz[:, 0], xyz[:, 1], xyz[:, 2]
    rec["r"], rec["g"], rec["b"] = rgb[:, 0], rgb[:, 1], rgb[:, 2]
    header = ("ply\nformat binary_little_endian 1.0\n"
              f"element vertex {len(xyz)}\n"
              "property float x\nproperty float y\nproperty float z\n"
              "property uchar red\nproperty uchar green\nproperty uchar blue\nend_header\n")
    with open(path, "wb") as f:
        f.write(header.encode("ascii"))
        f.write(rec.tobytes())


def frustum_mesh(cam_to_world: np.ndarray, intrinsic: np.ndarray, hw: tuple[int, int], size: float):
    """An open pyramid (apex at the camera centre, base on the image plane at depth ``size``)."""
    import trimesh
    h, w = hw
    fx, fy, cx, cy = intrinsic[0, 0], intrinsic[1, 1], intrinsic[0, 2], intrinsic[1, 2]
    corners = np.array([[(u - cx) / fx, (v - cy) / fy, 1.0] for u, v in ((0, 0), (w, 0), (w, h), (0, h))]) * size
    verts = np.vstack([[0.0, 0.0, 0.0], corners])
    verts = verts @ cam_to_world[:3, :3].T + cam_to_world[:3, 3]
    faces = np.array([[0, 1, 2], [0, 2, 3], [0, 3, 4], [0, 4, 1]])
    return trimesh.Trimesh(vertices=verts, faces=faces, process=False)


def colourise(depth: np.ndarray) -> np.ndarray:
    """[H, W] depth → [H, W, 3] uint8 (turbo, near = warm), robust to outliers."""
    import cv2
    valid = np.isfinite(depth)
    lo, hi = (np.percentile(depth[valid], [2, 98]) if valid.any() else (0.0, 1.0))
    t = np.clip((depth - lo) / max(hi - lo, 1e-8), 0, 1)
    t = np.where(valid, 1.0 - t, 0.0)
    return cv2.cvtColor(cv2.applyColorMap((t * 255).astype(np.uint8), cv2.COLORMAP_TURBO), cv2.COLOR_BGR2RGB)


def save_outputs(out: Path, images: torch.Tensor, preds: dict, labels: list[str], args) -> dict:
    import cv2
    from vggt.utils.geometry import closed_form_inverse_se3, unproject_depth_map_to_point_map
    from vggt.utils.pose_enc import pose_encoding_to_extri_intri

    S, _, H, W = images.shape
    extr, intr = pose_encoding_to_extri_intri(preds["pose_enc"].float(), (H, W))
    extr, intr = extr[0].cpu().numpy().astype(np.float64), intr[0].cpu().numpy().astype(np.float64)
    cam_to_world = closed_form_inverse_se3(extr)
    depth = preds["depth"][0, ..., 0].float().cpu().numpy()
    depth_conf = preds["depth_conf"][0].float().cpu().numpy()
    if args.points == "depth":
        xyz = unproject_depth_map_to_point_map(depth[..., None], extr, intr)
        conf = depth_conf
    else:
        xyz = preds["world_points"][0].float().cpu().numpy()
        conf = preds["world_points_conf"][0].float().cpu().numpy()
    rgb = (images.permute(0, 2, 3, 1).numpy() * 255).round().clip(0, 255).astype(np.uint8)

    # confidence filter: keep the top (100 - percentile)% of finite points, then subsample
    finite = np.isfinite(xyz).all(-1) & np.isfinite(conf)
    thresh = np.percentile(conf[finite], args.conf_percentile) if finite.any() else np.inf
    keep = finite & (conf >= thresh)
    pts, cols = xyz[keep], rgb[keep]
    if len(pts) > args.max_points:
        sel = np.random.default_rng(0).choice(len(pts), args.max_points, replace=False)
        pts, cols = pts[sel], cols[sel]
    write_ply(out / "points.ply", pts.astype(np.float32), cols)

    # scene.glb: points + frustums sized to the scene
    import trimesh
    centres = cam_to_world[:, :3, 3]
    extent = np.percentile(np.linalg.norm(pts - np.median(pts, 0), axis=1), 90) if len(pts) else 1.0
    size = 0.05 * float(extent) if extent > 0 else 0.05
    scene = trimesh.Scene()
    if len(pts):
        scene.add_geometry(trimesh.PointCloud(pts, colors=np.hstack([cols, np.full((len(cols), 1), 255, np.uint8)])),
                           geom_name="points")
    cmap = _turbo(S)
    for i in range(S):
        fr = frustum_mesh(cam_to_world[i], intr[i], (H, W), size)
        fr.visual.vertex_colors = np.tile(np.append(cmap[i], 255), (len(fr.vertices), 1))
        scene.add_geometry(fr, geom_name=f"camera_{i:04d}")
    scene.export(str(out / "scene.glb"))

    cams = [{"frame": i, "source": labels[i], "image_size_hw": [H, W],
             "extrinsic_world_to_camera": extr[i].tolist(), "camera_to_world": cam_to_world[i].tolist(),
             "intrinsic": intr[i].tolist()} for i in range(S)]
    (out / "cameras.json").write_text(json.dumps({"convention": "OpenCV (x right, y down, z forward)",
                                                  "cameras": cams}, indent=1))

    ddir = out / "depth"
    ddir.mkdir(exist_ok=True)
    for old in ddir.glob("depth_*.png"):  # a previous run's maps (maybe of more frames) would mislead
        old.unlink()
    np.savez(ddir / "depth.npz", depth=depth.astype(np.float16), confidence=depth_conf.astype(np.float16))
    for i in _tqdm(range(S), desc="writing depth maps", unit="map"):
        cv2.imwrite(str(ddir / f"depth_{i:04d}.png"), cv2.cvtColor(colourise(depth[i]), cv2.COLOR_RGB2BGR))

    _preview(out / "preview.png", rgb, depth, pts, cols, centres)
    return {"points_written": int(len(pts)), "confidence_threshold": float(thresh), "points_source": args.points}


def _turbo(n: int) -> np.ndarray:
    import cv2
    ramp = np.linspace(0, 255, max(n, 1)).astype(np.uint8)[:, None]
    return cv2.cvtColor(cv2.applyColorMap(ramp, cv2.COLORMAP_TURBO), cv2.COLOR_BGR2RGB)[:, 0]


def _preview(path: Path, rgb, depth, pts, cols, centres) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    S = len(rgb)
    picks = uniform_indices(S, min(S, 6))
    fig = plt.figure(figsize=(3 * len(picks) + 5, 5.5))
    grid = fig.add_gridspec(2, len(picks) + 2)
    for j, i in enumerate(picks):
        ax = fig.add_subplot(grid[0, j])
        ax.imshow(rgb[i])
        ax.set_title(f"frame {i}", fontsize=8)
        ax.axis("off")
        ax = fig.add_subplot(grid[1, j])
        ax.imshow(colourise(depth[i]))
        ax.axis("off")
    ax = fig.add_subplot(grid[:, len(picks):], projection="3d")
    if len(pts):
        sel = np.random.default_rng(0).choice(len(pts), min(len(pts), 30000), replace=False)
        ax.scatter(pts[sel, 0], pts[sel, 2], -pts[sel, 1], c=cols[sel] / 255.0, s=0.3, linewidths=0)
    ax.plot(centres[:, 0], centres[:, 2], -centres[:, 1], "r.-", ms=3, lw=0.8, label="cameras")
    ax.set_xlabel("x")
    ax.set_ylabel("z")
    ax.set_zlabel("-y")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"{len(pts):,} points, {S} cameras", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------

def start_distributed(args):
    """The default process group of a torchrun launch (NCCL on CUDA, gloo on the CPU)."""
    import torch.distributed as dist
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return dist.group.WORLD


def shard_sizes(frames: int, ranks: int) -> list[int]:
    """Contiguous shares of ``frames`` over ``ranks``, the first ones a frame larger when it does not divide."""
    return [frames // ranks + (r < frames % ranks) for r in range(ranks)]


def gather_predictions(preds: dict, seconds: float, peak):
    """Rank 0: every rank's predictions concatenated over frames (dim 1, in rank order), the slowest
    rank's seconds and every rank's peak; other ranks: (None, seconds, peaks)."""
    import torch.distributed as dist
    mine = ({k: v.cpu() for k, v in preds.items()}, seconds, peak)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None, seconds, None
    return ({k: torch.cat([g[0][k] for g in gathered], dim=1) for k in gathered[0][0]},
            max(g[1] for g in gathered), [g[2] for g in gathered])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", type=Path, help="folder of images or a video file")
    p.add_argument("--synthetic", action="store_true",
                   help="first write --frames frames of a synthetic textured scene into INPUT (a new or empty "
                        "folder): offline timing runs at any frame count")
    p.add_argument("--frames", type=int, default=100, help="frames to sample uniformly (default 100)")
    p.add_argument("--out", type=Path, default=Path("out/reconstruction"), help="output folder")
    p.add_argument("--weights", default="facebook/VGGT-1B",
                   help="hub id, local from_pretrained folder, or checkpoint file (.pt/.safetensors)")
    p.add_argument("--random-weights", action="store_true", help="random weights, no download (smoke runs)")
    p.add_argument("--seed", type=int, default=0, help="seed for --random-weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="autocast dtype on CUDA (auto: bf16 on Ampere+, else fp16); fp32 = no autocast")
    p.add_argument("--width", type=int, default=518, help="input width in pixels, a multiple of 14 (default 518)")
    p.add_argument("--baseline", action="store_true", help="native attention (SDPA), unpatched, for comparison")
    p.add_argument("--merge", nargs="?", const="0.9", default=None, metavar="RATIO|fast",
                   help="token merging in global attention (FastVGGT's method), ratio default 0.9; 'fast': "
                        "TokenMerging.fast() (cheaper merge assignment, fewer destinations, ratio 0.9)")
    p.add_argument("--merge-seed", type=int, default=0)
    p.add_argument("--lean", action="store_true",
                   help="keep only the aggregator layers the heads read and bound transient memory")
    p.add_argument("--offload", action="store_true",
                   help="with --lean: keep the layers only the depth/point heads read in host memory "
                        "(for the longest sequences)")
    p.add_argument("--backend", choices=("auto", "triton", "reference"), default="auto",
                   help="ELSA backend (auto: Triton on CUDA, the reference scan elsewhere)")
    p.add_argument("--precision", choices=("auto", "ieee", "fp16x3", "tf32x3", "tf32"), default="auto",
                   help="float32 attention mode with --dtype fp32")
    p.add_argument("--points", choices=("depth", "head"), default="depth",
                   help="points from depth + cameras (default) or from the point head")
    p.add_argument("--conf-percentile", type=float, default=50.0,
                   help="drop points below this confidence percentile (default 50)")
    p.add_argument("--max-points", type=int, default=2_000_000)
    p.add_argument("--distributed", action="store_true",
                   help="under torchrun: each process runs its contiguous share of the frames on its own GPU "
                        "(patch(model, process_group=...)), rank 0 gathers the predictions and writes them")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.frames < 1:
        p.error("--frames must be >= 1")
    if args.baseline and (args.merge is not None or args.lean):
        p.error("--merge and --lean are ELSA patch options; they cannot be combined with --baseline")
    if args.offload and not args.lean:
        p.error("--offload moves the layers --lean keeps to host memory: add --lean")
    if args.distributed and args.baseline:
        p.error("--distributed shards the frames through ELSA's patch: it cannot be combined with --baseline")
    if args.distributed and "WORLD_SIZE" not in os.environ:
        p.error("--distributed runs under torchrun (it reads RANK / WORLD_SIZE / LOCAL_RANK), e.g. "
                "torchrun --nproc-per-node 2 demos/reconstruct.py ... --distributed")
    if args.merge is not None and args.merge != "fast":
        try:
            args.merge = float(args.merge)
        except ValueError:
            p.error(f"--merge takes a ratio in [0, 1] or 'fast', got {args.merge!r}")
        if not 0.0 <= args.merge <= 1.0:
            p.error("--merge RATIO must be in [0, 1]")
    if not 0.0 <= args.conf_percentile < 100.0:
        p.error("--conf-percentile must be in [0, 100)")
    if args.max_points < 1:
        p.error("--max-points must be >= 1")
    if args.synthetic and args.input.exists() and (not args.input.is_dir() or any(args.input.iterdir())):
        p.error(f"--synthetic writes frames into INPUT, but {args.input} is a file or a non-empty folder; "
                "name a new folder")
    check_setup(p, args, ("cv2", "trimesh", "matplotlib"))
    return args


def check_setup(p: argparse.ArgumentParser, args, modules: tuple[str, ...]) -> None:
    """The demos' last argument checks, before any model loads (a missing writer found after minutes
    of inference loses the result): --out names a folder, ``modules`` are installed, and the device
    and backend can run."""
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} is a file; name a folder")
    import importlib.util
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        p.error(f"missing module(s) to read the input or write the results: {', '.join(missing)}; "
                "install them with pip install 'elsa-vision[demo]'")
    from elsa_vision.dispatch import device_problem
    why = device_problem(args.device, args.backend)
    if why:
        p.error(f"--device / --backend: {why}")


def main(argv=None) -> dict:
    global QUIET
    args = parse_args(argv)
    QUIET = args.quiet
    if args.synthetic:
        import importlib.util
        if importlib.util.find_spec("vggt") is None:  # (before any frame is written into INPUT)
            raise DemoError(f"vggt is not installed; install it with:\n    {VGGT_INSTALL}")
        write_synthetic_scene(args.input, args.frames)
    group = start_distributed(args) if args.distributed else None
    rank = 0 if group is None else torch.distributed.get_rank()
    frames, labels = read_frames(args.input, args.frames)
    images = preprocess(frames, args.width)
    S, _, H, W = images.shape
    if rank == 0:
        print(f"{S} frames at {H}x{W} from {args.input}")
    device = torch.device(args.device)
    shards = None
    if group is not None:
        shards = shard_sizes(S, torch.distributed.get_world_size())
        if min(shards) < 1:
            raise DemoError(f"--distributed: {S} frames cannot give each of {len(shards)} processes one")
        device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}") if device.type == "cuda" else device
        start = sum(shards[:rank])
        images_all, images = images, images[start:start + shards[rank]]

    t0 = time.perf_counter()
    model, weights = load_model(args)
    model = model.to(device).eval()
    load_s = time.perf_counter() - t0

    import elsa_vision
    report = tm = None
    if not args.baseline:
        tm = None if args.merge is None else (
            elsa_vision.TokenMerging.fast(seed=args.merge_seed) if args.merge == "fast"
            else elsa_vision.TokenMerging(ratio=args.merge, seed=args.merge_seed))
        extra = {} if group is None else {"process_group": group}
        report = elsa_vision.patch(model, precision=args.precision, backend=args.backend,
                                   lean_memory=args.lean, lean_offload=args.offload, token_merging=tm, **extra)
        if rank == 0:
            print(report)
    dtype = autocast_dtype(device, args.dtype)
    preds, seconds, peak = infer(model, images, device, dtype, progress=not args.quiet and rank == 0)
    preds = {k: v for k, v in preds.items() if isinstance(v, torch.Tensor)}
    peaks = None
    if group is not None:
        preds, seconds, peaks = gather_predictions(preds, seconds, peak)
        if rank != 0:
            torch.distributed.destroy_process_group()
            return {}
        images = images_all
        peak = max(peaks) if all(p is not None for p in peaks) else None
        print(f"{len(shards)} processes, frames per process {shards}")
    print(f"inference: {seconds:.2f} s" + (f", peak memory {peak / 2**30:.2f} GiB" if peak is not None else "")
          + (" (the largest of the processes')" if peaks else ""))

    args.out.mkdir(parents=True, exist_ok=True)
    saved = save_outputs(args.out, images, preds, labels, args)
    P = model.aggregator.patch_start_idx + (H // 14) * (W // 14)
    summary = {
        "input": str(args.input), "frames": S, "image_size_hw": [H, W], "tokens_per_frame": P,
        "global_tokens": S * P, "attention": "native" if args.baseline else "elsa",
        "token_merging": None if tm is None else {"ratio": tm.ratio, "seed": tm.seed, "similarity_dim": tm.similarity_dim,
                                                  "reuse": tm.reuse},
        "lean_memory": args.lean, "lean_offload": args.offload, "dtype": "fp32" if dtype is None else str(dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "weights": weights, "model_load_seconds": round(load_s, 3), "inference_seconds": round(seconds, 3),
        "peak_memory_gib": None if peak is None else round(peak / 2**30, 3),
        "patched_modules": None if report is None else report.num_patched,
        "processes": 1 if shards is None else len(shards), "frames_per_process": shards,
        "peak_memory_gib_per_process": None if not peaks or None in peaks else [round(p / 2**30, 3) for p in peaks],
        "torch": torch.__version__, **saved,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if group is not None:
        torch.distributed.destroy_process_group()
    print(f"wrote {args.out}/: points.ply ({saved['points_written']:,} points), scene.glb, cameras.json, "
          "depth/, preview.png, summary.json")
    return summary


if __name__ == "__main__":
    try:
        main()
    except DemoError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
