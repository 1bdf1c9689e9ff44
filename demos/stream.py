"""Online (streaming) 3D reconstruction with StreamVGGT on ELSA attention.

    python demos/stream.py walk.mp4 --out out/stream                       # every frame, as it is decoded
    python demos/stream.py walk.mp4 --frames 1000 --stride 2 --every 100   # every 2nd frame, 1000 of them
    python demos/stream.py path/to/images/ --baseline                      # native attention, to compare
    python demos/stream.py path/to/images/ --tiny --device cpu --width 140 --frames 4   # offline smoke run

Frames are read one at a time as they are decoded (a video through OpenCV, or a folder of images
sorted by name), resized like vggt's ``load_and_preprocess_images(mode="crop")`` (width 518 → 392×518
for 4:3 input; frames of another size are first resized to the first frame's) and fed to the model
one by one: each step runs StreamVGGT's aggregator against the key/value cache of the frames before
it, then the camera, depth and point heads, exactly as the body of ``StreamVGGT.inference``'s loop
does (the aggregator under autocast, the heads without). Nothing of a past frame stays on the device
except the model's caches; the host keeps each frame's confidence-filtered points and its camera.

The model is StreamVGGT's released checkpoint (``lch01/StreamVGGT``, ``checkpoints.pth``, from the
Hugging Face hub), a local checkpoint (``--weights checkpoints.pth``), random weights
(``--random-weights``), or a small random model for offline smoke runs (``--tiny``).

Writes to ``--out`` every ``--every`` frames and at the end:
  points.ply      coloured points from the point head, confidence-filtered per frame (binary PLY)
  cameras.json    per frame: world-to-camera extrinsic (OpenCV), camera-to-world, intrinsic, source
and at the end:
  latency.csv     per frame: ms (the model's step, synchronized), allocated and peak GiB (CUDA only)
  summary.json    frames, tokens per frame, attention mode, time, latency, peak memory, points

Ctrl-C stops the stream and still writes what was reconstructed so far.

Needs StreamVGGT's source (not on PyPI: clone https://github.com/wzzheng/StreamVGGT and put its src/
on PYTHONPATH), transformers and the demo extras (``pip install elsa-vision[demo]``: opencv,
huggingface_hub, tqdm).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reconstruct as R  # noqa: E402

DemoError = R.DemoError
STREAMVGGT_INSTALL = ("clone https://github.com/wzzheng/StreamVGGT and put its src/ on PYTHONPATH, e.g.\n"
                      "    git clone https://github.com/wzzheng/StreamVGGT && "
                      "export PYTHONPATH=$PWD/StreamVGGT/src:$PYTHONPATH")
HUB_REPO, HUB_FILE = "lch01/StreamVGGT", "checkpoints.pth"

QUIET = False  # --quiet: no progress bar


def _bar(**kw):
    """A tqdm progress bar, or a stand-in without one when tqdm is missing or --quiet is given."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None and not QUIET:
        return tqdm(**kw)

    class _NoBar:
        def update(self, n=1):
            pass

        def set_postfix(self, *a, **k):
            pass

        def close(self):
            pass

    return _NoBar()


# ------------------------------------------------------------------------------------------------
# Frames, read lazily
# ------------------------------------------------------------------------------------------------

class FrameSource:
    """The frames of a video or an image folder, decoded one at a time: iterating yields
    (RGB uint8 [h, w, 3], label) for every ``stride``-th frame, at most ``limit`` of them (all when
    None). The input is checked when the source is made, before any model is loaded."""

    def __init__(self, source: Path, limit: int | None = None, stride: int = 1):
        import cv2
        self.source, self.limit, self.stride = source, limit, stride
        self.files: list[Path] | None = None
        self.total: int | None = None  # frames that will be yielded, when known up front
        if not source.exists():
            raise DemoError(f"input {source} does not exist")
        if source.is_dir():
            files = sorted(p for p in source.iterdir() if p.suffix.lower() in R.IMAGE_EXTS)
            if not files:
                raise DemoError(f"no images found in {source} (looked for {', '.join(R.IMAGE_EXTS)})")
            self.files = files[::stride][:limit]
            self.total = len(self.files)
            return
        cap = cv2.VideoCapture(str(source))
        if not cap.isOpened():
            kind = "video" if source.suffix.lower() in R.VIDEO_EXTS else "image folder or video"
            raise DemoError(f"cannot open {source} as a {kind} (OpenCV could not decode it)")
        count = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        cap.release()
        if count > 0:  # some containers do not report a count; then the bar has no total
            self.total = -(-count // stride) if limit is None else min(limit, -(-count // stride))

    def __iter__(self):
        import cv2
        if self.files is not None:
            for f in self.files:
                img = cv2.imread(str(f), cv2.IMREAD_COLOR)
                if img is None:
                    raise DemoError(f"cannot read image {f}")
                yield cv2.cvtColor(img, cv2.COLOR_BGR2RGB), f.name
            return
        cap = cv2.VideoCapture(str(self.source))
        try:
            i = n = 0
            while self.limit is None or n < self.limit:
                if not cap.grab():  # sequential grab/retrieve: exact frames, unlike seeking
                    break
                if i % self.stride == 0:
                    ok, img = cap.retrieve()
                    if ok:
                        yield cv2.cvtColor(img, cv2.COLOR_BGR2RGB), f"{self.source.name}#{i}"
                        n += 1
                i += 1
        finally:
            cap.release()


class Preprocessor:
    """reconstruct.preprocess one frame at a time, every frame at the size the first one sets."""

    def __init__(self, width: int):
        self.width = width
        self.first_hw: tuple[int, int] | None = None

    def __call__(self, frame: np.ndarray) -> torch.Tensor:
        """[1, 3, H, W] in [0, 1]."""
        import cv2
        if self.first_hw is None:
            self.first_hw = frame.shape[:2]
        elif frame.shape[:2] != self.first_hw:
            h0, w0 = self.first_hw
            frame = cv2.resize(frame, (w0, h0), interpolation=cv2.INTER_AREA)
        return R.preprocess([frame], self.width)


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------

def _import_streamvggt(full: bool):
    import importlib.util
    try:
        found = importlib.util.find_spec("streamvggt") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise DemoError(f"streamvggt is not importable; {STREAMVGGT_INSTALL}")
    try:
        from streamvggt.heads.camera_head import CameraHead
        from streamvggt.heads.dpt_head import DPTHead
        from streamvggt.models.aggregator import Aggregator
        if full:
            from streamvggt.models.streamvggt import StreamVGGT
        else:
            StreamVGGT = None
    except ImportError as e:
        missing = (getattr(e, "name", None) or "").split(".")[0]
        if missing == "streamvggt":
            raise DemoError(f"streamvggt is incomplete ({e}); {STREAMVGGT_INSTALL}") from None
        if missing in ("transformers", "huggingface_hub"):
            raise DemoError(f"StreamVGGT needs {missing} ({e}); install it with:\n    pip install {missing}") from None
        raise DemoError(f"cannot import StreamVGGT: {e}") from None
    return Aggregator, CameraHead, DPTHead, StreamVGGT


class TinyStreamVGGT(torch.nn.Module):
    """StreamVGGT's module tree at a small size (embed dim 64, 2 aggregator layers, a conv patch
    embed): the same attribute names and per-frame calls, random weights, for offline smoke runs."""

    def __init__(self, img_size: int = 518, patch_size: int = 14, embed_dim: int = 64):
        super().__init__()
        Aggregator, CameraHead, DPTHead, _ = _import_streamvggt(full=False)
        self.aggregator = Aggregator(img_size=img_size, patch_size=patch_size, embed_dim=embed_dim, depth=2,
                                     num_heads=4, patch_embed="conv")
        self.camera_head = CameraHead(dim_in=2 * embed_dim, trunk_depth=2, num_heads=4)
        # the DPT heads read 4 aggregator layers: with 2 layers, each twice
        dpt = dict(dim_in=2 * embed_dim, patch_size=patch_size, features=32, out_channels=[16, 32, 64, 64],
                   intermediate_layer_idx=[0, 0, 1, 1])
        self.point_head = DPTHead(output_dim=4, activation="inv_log", conf_activation="expp1", **dpt)
        self.depth_head = DPTHead(output_dim=2, activation="exp", conf_activation="expp1", **dpt)
        self.track_head = None


def _load_state(path: Path) -> dict:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle and zip errors differ
        raise DemoError(f"{path} is not a readable checkpoint ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise DemoError(f"{path} holds a {type(state).__name__}, not a StreamVGGT state dict")
    return state


def load_model(args):
    """(model, description of its weights)."""
    if args.tiny:
        torch.manual_seed(args.seed)
        return TinyStreamVGGT(), "random (tiny)"
    _, _, _, StreamVGGT = _import_streamvggt(full=True)
    if args.random_weights:
        torch.manual_seed(args.seed)
        return StreamVGGT(), "random"
    w = Path(args.weights).expanduser()
    if w.is_file():
        path = w
    elif (w.exists() or w.suffix in (".pt", ".pth", ".bin") or w.is_absolute()
          or str(args.weights).startswith((".", "~"))):
        what = "is a folder, not a checkpoint file" if w.is_dir() else "no such checkpoint file"
        raise DemoError(f"--weights {args.weights}: {what} (or give a Hugging Face repo id holding {HUB_FILE}, "
                        f"e.g. {HUB_REPO})")
    else:
        try:
            from huggingface_hub import hf_hub_download
            path = Path(hf_hub_download(repo_id=args.weights, filename=HUB_FILE))
        except Exception as e:  # noqa: BLE001 - hub errors come in many types (offline, 404, gated, auth)
            raise DemoError(f"could not download {HUB_FILE} from {args.weights!r}: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''}\n"
                            f"  offline? download it once and pass --weights /path/to/{HUB_FILE}, "
                            "or run with --random-weights") from None
    state = _load_state(path)
    model = StreamVGGT()
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes that differ
        raise DemoError(f"{path} is not a StreamVGGT checkpoint: {' '.join(str(e).split())[:300]}") from None
    if missing or unexpected:  # StreamVGGT's own demo loads strictly
        raise DemoError(f"{path} is not a StreamVGGT checkpoint: {len(missing)} missing keys {missing[:3]}, "
                        f"{len(unexpected)} unexpected keys {unexpected[:3]}")
    return model, str(path) if w.is_file() else f"{args.weights} ({HUB_FILE})"


# ------------------------------------------------------------------------------------------------
# The streaming step
# ------------------------------------------------------------------------------------------------

class Stream:
    """The state of one stream: the aggregator's and camera head's caches and the frame index."""

    def __init__(self, model):
        self.model = model
        self.past_key_values = [None] * model.aggregator.depth
        self.past_key_values_camera = [None] * model.camera_head.trunk_depth
        self.frame = 0

    def step(self, image: torch.Tensor, dtype) -> dict:
        """One frame, [1, 3, H, W] on the model's device: the body of StreamVGGT.inference's loop
        (without the track head). Returns the frame's predictions (device tensors)."""
        model = self.model
        device_type = image.device.type
        images = image.unsqueeze(0)  # [B=1, S=1, 3, H, W]
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            aggregator_output = model.aggregator(images, past_key_values=self.past_key_values, use_cache=True,
                                                 past_frame_idx=self.frame)
        if isinstance(aggregator_output, tuple) and len(aggregator_output) == 3:
            aggregated_tokens, patch_start_idx, self.past_key_values = aggregator_output
        else:
            aggregated_tokens, patch_start_idx = aggregator_output
        with torch.autocast(device_type, enabled=False):
            pose_enc, self.past_key_values_camera = model.camera_head(
                aggregated_tokens, past_key_values_camera=self.past_key_values_camera, use_cache=True)
            camera_pose = pose_enc[-1][:, 0, :]
            depth, depth_conf = model.depth_head(aggregated_tokens, images=images, patch_start_idx=patch_start_idx)
            pts3d, pts3d_conf = model.point_head(aggregated_tokens, images=images, patch_start_idx=patch_start_idx)
        self.frame += 1
        return {"pts3d_in_other_view": pts3d[:, 0], "conf": pts3d_conf[:, 0], "depth": depth[:, 0],
                "depth_conf": depth_conf[:, 0], "camera_pose": camera_pose}


# ------------------------------------------------------------------------------------------------
# What the host keeps per frame, and the outputs
# ------------------------------------------------------------------------------------------------

def camera_from_pose(pose_enc: torch.Tensor, hw: tuple[int, int]):
    """[9] pose encoding → (world-to-camera 3×4, camera-to-world 4×4, intrinsic 3×3), float64 numpy."""
    from streamvggt.utils.pose_enc import pose_encoding_to_extri_intri
    extr, intr = pose_encoding_to_extri_intri(pose_enc.float().reshape(1, 1, 9), hw)
    extr = extr[0, 0].cpu().numpy().astype(np.float64)
    intr = intr[0, 0].cpu().numpy().astype(np.float64)
    rot, t = extr[:, :3], extr[:, 3]
    c2w = np.eye(4)
    c2w[:3, :3], c2w[:3, 3] = rot.T, -rot.T @ t
    return extr, c2w, intr


def keep_points(pts: np.ndarray, conf: np.ndarray, rgb: np.ndarray, percentile: float, cap: int,
                rng: np.random.Generator):
    """The frame's finite points at or above its confidence percentile, at most ``cap`` of them
    (a random subset): (xyz float32 [n, 3], rgb uint8 [n, 3])."""
    pts, conf, rgb = pts.reshape(-1, 3), conf.reshape(-1), rgb.reshape(-1, 3)
    finite = np.isfinite(pts).all(-1) & np.isfinite(conf)
    if not finite.any():
        return np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint8)
    keep = np.flatnonzero(finite & (conf >= np.percentile(conf[finite], percentile)))
    if len(keep) > cap:
        keep = np.sort(rng.choice(keep, cap, replace=False))
    return pts[keep].astype(np.float32), rgb[keep]


def _finite(x):
    """Non-finite floats as null: cameras.json stays strict JSON whatever random weights predict."""
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x if math.isfinite(x) else None


def _replace(path: Path, write) -> None:
    """Write through a temporary file: a viewer reading the growing outputs never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_reconstruction(out: Path, frames: list[dict], hw: tuple[int, int], max_points: int) -> int:
    """points.ply and cameras.json of the frames so far; returns the points written."""
    pts = np.concatenate([f["xyz"] for f in frames]) if frames else np.zeros((0, 3), np.float32)
    cols = np.concatenate([f["rgb"] for f in frames]) if frames else np.zeros((0, 3), np.uint8)
    if len(pts) > max_points:
        sel = np.sort(np.random.default_rng(0).choice(len(pts), max_points, replace=False))
        pts, cols = pts[sel], cols[sel]
    _replace(out / "points.ply", lambda p: R.write_ply(p, pts, cols))
    cams = [{"frame": i, "source": f["label"], "image_size_hw": list(hw),
             "extrinsic_world_to_camera": _finite(f["extrinsic"].tolist()),
             "camera_to_world": _finite(f["camera_to_world"].tolist()),
             "intrinsic": _finite(f["intrinsic"].tolist())} for i, f in enumerate(frames)]
    text = json.dumps({"convention": "OpenCV (x right, y down, z forward); world = the first frame's camera",
                       "cameras": cams}, indent=1)
    _replace(out / "cameras.json", lambda p: p.write_text(text))
    return int(len(pts))


def write_latency(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["frame", "ms", "allocated_gib", "peak_gib"])
        for r in rows:
            w.writerow([r["frame"], f"{r['ms']:.3f}",
                        "" if r["allocated_gib"] is None else f"{r['allocated_gib']:.4f}",
                        "" if r["peak_gib"] is None else f"{r['peak_gib']:.4f}"])


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", type=Path, help="video file or folder of images (sorted by name)")
    p.add_argument("--frames", type=int, default=None, help="stop after N frames (default: all)")
    p.add_argument("--stride", type=int, default=1, help="take every K-th frame of the input (default 1)")
    p.add_argument("--out", type=Path, default=Path("out/stream"), help="output folder")
    p.add_argument("--every", type=int, default=50,
                   help="write points.ply and cameras.json every M frames (default 50; 0: only at the end)")
    p.add_argument("--weights", default=HUB_REPO,
                   help=f"checkpoint file, or a Hugging Face repo id holding {HUB_FILE} (default {HUB_REPO})")
    p.add_argument("--random-weights", action="store_true", help="random weights, no download (smoke runs)")
    p.add_argument("--tiny", action="store_true",
                   help="a small random model for offline smoke runs (StreamVGGT's modules at embed dim 64, "
                        "2 layers); implies --random-weights")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="autocast dtype of the aggregator on CUDA (auto: bf16 on Ampere+, else fp16); "
                        "fp32 = no autocast; the heads run in float32 as in StreamVGGT")
    p.add_argument("--width", type=int, default=518, help="input width in pixels, a multiple of 14 (default 518)")
    p.add_argument("--baseline", action="store_true", help="native attention (SDPA), unpatched, for comparison")
    p.add_argument("--backend", choices=("auto", "triton", "reference"), default="auto",
                   help="ELSA backend (auto: Triton on CUDA, the reference scan elsewhere)")
    p.add_argument("--precision", choices=("auto", "ieee", "fp16x3", "tf32x3", "tf32"), default="auto",
                   help="float32 attention mode with --dtype fp32")
    p.add_argument("--kv-reserve", type=int, default=None, metavar="ENTRIES",
                   help="entries each new key/value cache allocates up front (ELSA; default the adapter's, 32)")
    p.add_argument("--conf-percentile", type=float, default=50.0,
                   help="per frame, drop points below this confidence percentile (default 50)")
    p.add_argument("--frame-points", type=int, default=20_000,
                   help="points kept per frame at most, a random subset (default 20000)")
    p.add_argument("--max-points", type=int, default=2_000_000, help="points written at most (default 2000000)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.frames is not None and args.frames < 1:
        p.error("--frames must be >= 1")
    if args.stride < 1:
        p.error("--stride must be >= 1")
    if args.every < 0:
        p.error("--every must be >= 0")
    if args.kv_reserve is not None and args.kv_reserve < 1:
        p.error("--kv-reserve must be >= 1")
    if args.baseline and args.kv_reserve is not None:
        p.error("--kv-reserve is an ELSA patch option; it cannot be combined with --baseline")
    if args.tiny:
        args.random_weights = True
    if not 0.0 <= args.conf_percentile < 100.0:
        p.error("--conf-percentile must be in [0, 100)")
    if args.frame_points < 1 or args.max_points < 1:
        p.error("--frame-points and --max-points must be >= 1")
    if args.width % 14 or args.width < 14:
        p.error(f"--width must be a positive multiple of 14 (the patch size), got {args.width}")
    R.check_setup(p, args, ("cv2",))
    return args


def main(argv=None) -> dict:
    global QUIET
    args = parse_args(argv)
    QUIET = args.quiet
    source = FrameSource(args.input, args.frames, args.stride)  # input errors before the model loads
    device = torch.device(args.device)

    t0 = time.perf_counter()
    model, weights = load_model(args)
    model = model.to(device).eval()
    load_s = time.perf_counter() - t0

    import elsa_vision
    report = None
    if not args.baseline:
        opts = {} if args.kv_reserve is None else {"kv_reserve": args.kv_reserve}
        report = elsa_vision.patch(model, precision=args.precision, backend=args.backend, **opts)
        print(report)
    dtype = R.autocast_dtype(device, args.dtype)
    cuda = device.type == "cuda"

    args.out.mkdir(parents=True, exist_ok=True)
    stream, prep = Stream(model), Preprocessor(args.width)
    kept: list[dict] = []  # per frame, host only: points, colours, camera, label
    rows: list[dict] = []
    rng = np.random.default_rng(args.seed)
    hw = None
    interrupted = False
    bar = _bar(total=source.total, desc="streaming", unit="frame")
    if cuda:
        torch.cuda.synchronize(device)
    t_stream = time.perf_counter()
    try:
        with torch.no_grad():
            for frame, label in source:
                image = prep(frame)  # [1, 3, H, W] on the host
                if hw is None:
                    hw = tuple(image.shape[-2:])
                    print(f"frames at {hw[0]}x{hw[1]} from {args.input}")
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                t = time.perf_counter()
                pred = stream.step(image.to(device), dtype)
                if cuda:
                    torch.cuda.synchronize(device)
                ms = (time.perf_counter() - t) * 1e3
                pts = pred["pts3d_in_other_view"][0].float().cpu().numpy()
                conf = pred["conf"][0].float().cpu().numpy()
                extr, c2w, intr = camera_from_pose(pred["camera_pose"][0], hw)
                del pred  # nothing of this frame stays on the device but the caches
                rgb = (image[0].permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype(np.uint8)
                xyz, cols = keep_points(pts, conf, rgb, args.conf_percentile, args.frame_points, rng)
                alloc = torch.cuda.memory_allocated(device) / 2**30 if cuda else None
                peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
                kept.append({"xyz": xyz, "rgb": cols, "extrinsic": extr, "camera_to_world": c2w,
                             "intrinsic": intr, "label": label})
                rows.append({"frame": len(rows), "ms": ms, "allocated_gib": alloc, "peak_gib": peak})
                bar.set_postfix({"ms": f"{ms:.0f}", **({"GiB": f"{alloc:.2f}/{peak:.2f}"} if cuda else {})},
                                refresh=False)
                bar.update()
                if args.every and len(kept) % args.every == 0:
                    write_reconstruction(args.out, kept, hw, args.max_points)
    except KeyboardInterrupt:
        interrupted = True
        print(f"\ninterrupted after {len(kept)} frames; writing what was reconstructed", file=sys.stderr)
    finally:
        bar.close()
    total_s = time.perf_counter() - t_stream
    if not kept:
        raise DemoError(f"no frames could be decoded from {args.input}")

    points = write_reconstruction(args.out, kept, hw, args.max_points)
    write_latency(args.out / "latency.csv", rows)
    H, W = hw
    last = [r["ms"] for r in rows[-10:]]
    peaks = [r["peak_gib"] for r in rows if r["peak_gib"] is not None]
    summary = {
        "input": str(args.input), "frames": len(kept), "stride": args.stride, "image_size_hw": [H, W],
        "tokens_per_frame": model.aggregator.patch_start_idx + (H // 14) * (W // 14),
        "attention": "native" if args.baseline else "elsa",
        "dtype": "fp32" if dtype is None else str(dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "weights": weights, "model_load_seconds": round(load_s, 3),
        "total_seconds": round(total_s, 3),
        "frames_per_second": round(len(kept) / total_s, 3) if total_s > 0 else None,
        "median_ms_last_10": round(float(np.median(last)), 3),
        "first_frame_ms": round(rows[0]["ms"], 3),
        "peak_memory_gib": round(max(peaks), 4) if peaks else None,
        "final_allocated_gib": None if rows[-1]["allocated_gib"] is None else round(rows[-1]["allocated_gib"], 4),
        "points": points, "conf_percentile": args.conf_percentile, "frame_points": args.frame_points,
        "patched_modules": None if report is None else report.num_patched,
        "interrupted": interrupted, "torch": torch.__version__,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{len(kept)} frames in {total_s:.2f} s; median {summary['median_ms_last_10']:.1f} ms/frame over the last "
          f"{len(last)}" + (f", peak memory {summary['peak_memory_gib']:.2f} GiB" if peaks else ""))
    print(f"wrote {args.out}/: points.ply ({points:,} points), cameras.json, latency.csv, summary.json")
    return summary


if __name__ == "__main__":
    try:
        main()
    except DemoError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # before the stream started (a Ctrl-C while streaming writes the results)
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
