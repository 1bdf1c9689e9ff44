"""Fine-tune a timm Swin (v1 or v2) with ELSA attention in training, on an ImageFolder dataset.

    # your data: <root>/train/<class>/*.jpg and <root>/val/<class>/*.jpg (or one folder, split 90/10)
    python demos/finetune_swin.py --data /path/to/root --model swinv2_tiny_window8_256 --img-size 256 --pretrained

    # offline: generate a small learnable dataset of coloured shapes first, then train on it
    python demos/finetune_swin.py --synthetic out/shapes --epochs 5

    # the same run twice from one seed — ELSA and timm's native attention — and both loss curves in one plot
    python demos/finetune_swin.py --synthetic out/shapes --epochs 5 --compare-native

    # each training step captured once in a CUDA graph and replayed (GPU): the host launches one graph
    # per step instead of every kernel, so the step runs at the GPU's pace
    python demos/finetune_swin.py --synthetic out/shapes --epochs 5 --compare-native --cuda-graph

``elsa_vision.patch(model)`` is the only change to an ordinary timm training loop: the Swin window
attention (relative-position bias, shift mask; v2's cosine attention and continuous position bias)
runs on ELSA forward and backward, and its gradients reach qkv, the bias table / cpb_mlp and
logit_scale as in timm. Attention dropout (if set) delegates to timm's own forward for those calls.

Outputs in --out (default out/finetune_<model>): checkpoints ``<run>_last.pt`` / ``<run>_best.pt``
(model, optimizer, epoch, accuracy, args), ``history.json`` (per-step loss, per-epoch validation
accuracy, training-step seconds per epoch, total time) and with --compare-native ``loss_curves.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SHAPES = ("circle", "square", "triangle", "cross", "ring", "star")


# --------------------------------------------------------------------------------------------
# synthetic data


def _polygon(cx, cy, r, n, rot, star=False):
    pts = []
    for i in range(n * (2 if star else 1)):
        rr = r * (0.45 if star and i % 2 else 1.0)
        a = rot + i * math.pi * 2 / (n * (2 if star else 1))
        pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
    return pts


def draw_shape(shape: str, size: int, rng: np.random.Generator):
    """One RGB image (PIL) of ``shape`` with random size, position and rotation on a noisy grey-ish
    background. The shape's hue leans towards a band of its own (the bands overlap), so a model
    trained from scratch picks up colour within a few hundred steps and needs the shape to do better."""
    import colorsys
    from PIL import Image, ImageDraw
    k = SHAPES.index(shape) if shape in SHAPES else 0
    bg = rng.integers(60, 200) + rng.integers(-25, 26, 3)
    noise = rng.normal(0, 18, (size, size, 3))
    img = Image.fromarray(np.clip(bg + noise, 0, 255).astype(np.uint8))
    hue = (k + rng.uniform(-0.6, 0.6)) / len(SHAPES) % 1.0
    lum = rng.uniform(0.25, 0.45) if bg.mean() > 128 else rng.uniform(0.6, 0.85)  # contrast with the background
    fill = tuple(int(255 * c) for c in colorsys.hls_to_rgb(hue, lum, rng.uniform(0.6, 1.0)))
    r = rng.uniform(0.18, 0.34) * size
    cx, cy = rng.uniform(r, size - r, 2)
    rot = rng.uniform(0, 2 * math.pi)
    d = ImageDraw.Draw(img)
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "ring":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fill, width=max(2, int(r * 0.3)))
    elif shape == "square":
        d.polygon(_polygon(cx, cy, r, 4, rot), fill=fill)
    elif shape == "triangle":
        d.polygon(_polygon(cx, cy, r, 3, rot), fill=fill)
    elif shape == "star":
        d.polygon(_polygon(cx, cy, r, 5, rot, star=True), fill=fill)
    elif shape == "cross":
        w = r * 0.35
        for a in (rot, rot + math.pi / 2):
            dx, dy = math.cos(a), math.sin(a)
            px, py = -dy * w, dx * w
            d.polygon([(cx - dx * r + px, cy - dy * r + py), (cx + dx * r + px, cy + dy * r + py),
                       (cx + dx * r - px, cy + dy * r - py), (cx - dx * r - px, cy - dy * r - py)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")
    return img


def make_synthetic(root: Path, classes: int, per_class: int, val_per_class: int, size: int, seed: int = 0) -> Path:
    """Write an ImageFolder tree root/{train,val}/<shape>/NNNNN.png (skipped if already there)."""
    if not 2 <= classes <= len(SHAPES):
        raise ValueError(f"--classes must be in [2, {len(SHAPES)}], got {classes}")
    spec = {"classes": classes, "per_class": per_class, "val_per_class": val_per_class, "size": size, "seed": seed}
    marker = root / "synthetic.json"
    if marker.exists():
        if json.loads(marker.read_text()) == spec:
            return root
        import shutil  # made here with other settings: start over, so no stale class folder stays
        for split in ("train", "val"):
            shutil.rmtree(root / split, ignore_errors=True)
        marker.unlink()
    elif root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise SystemExit(f"--synthetic {root} exists and was not made by this script; name a new or empty folder")
    from tqdm import tqdm
    rng = np.random.default_rng(seed)
    jobs = [(split, s, i) for split, n in (("train", per_class), ("val", val_per_class))
            for s in SHAPES[:classes] for i in range(n)]
    for split, s, i in tqdm(jobs, desc=f"generating shapes in {root}", leave=False):
        p = root / split / s / f"{i:05d}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        draw_shape(s, size, rng).save(p)
    marker.write_text(json.dumps(spec))
    return root


def loaders(root: Path, img_size: int, batch: int, workers: int, seed: int):
    """(train, val) DataLoaders and the class names; a root without train/ and val/ is split 90/10."""
    from torchvision import datasets, transforms
    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    t_train = transforms.Compose([transforms.RandomResizedCrop(img_size, scale=(0.6, 1.0), antialias=True),
                                  transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    t_val = transforms.Compose([transforms.Resize((img_size, img_size), antialias=True), transforms.ToTensor(), norm])
    if (root / "train").is_dir() and (root / "val").is_dir():
        train = datasets.ImageFolder(root / "train", t_train)
        val = datasets.ImageFolder(root / "val", t_val)
        classes = train.classes
    else:
        full_t = datasets.ImageFolder(root, t_train)
        full_v = datasets.ImageFolder(root, t_val)
        perm = torch.randperm(len(full_t), generator=torch.Generator().manual_seed(seed)).tolist()
        n_val = max(1, len(perm) // 10)
        train = torch.utils.data.Subset(full_t, perm[n_val:])
        val = torch.utils.data.Subset(full_v, perm[:n_val])
        classes = full_t.classes
    g = torch.Generator().manual_seed(seed)  # same shuffling for the ELSA and the native run
    tl = torch.utils.data.DataLoader(train, batch_size=batch, shuffle=True, num_workers=workers, drop_last=len(train) > batch,
                                     generator=g, pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0)
    vl = torch.utils.data.DataLoader(val, batch_size=batch, shuffle=False, num_workers=workers)
    return tl, vl, classes


# --------------------------------------------------------------------------------------------
# training


def build_model(a, num_classes: int, elsa: bool):
    import timm
    import elsa_vision
    torch.manual_seed(a.seed)  # identical initial weights for every run
    kw = dict(json.loads(a.model_kwargs)) if a.model_kwargs else {}
    try:
        model = timm.create_model(a.model, pretrained=a.pretrained, num_classes=num_classes, img_size=a.img_size,
                                  drop_path_rate=a.drop_path, **kw)
    except TypeError as e:  # (an argument the model's constructor does not take, from --model-kwargs)
        raise SystemExit(f"{a.model}: {e}; check --model-kwargs ({a.model_kwargs or 'none given'})") from None
    except (OSError, RuntimeError) as e:
        if not a.pretrained:
            raise
        raise SystemExit(f"{a.model}: pretrained weights could not be loaded ({type(e).__name__}); offline? "
                         "Drop --pretrained, or fetch them once online (they are cached).") from None
    model = model.to(a.device)
    if elsa:
        report = elsa_vision.patch(model, precision=a.precision, backend=a.backend)
        print(report)
        if report.num_patched == 0:
            raise SystemExit(f"{a.model}: no attention module was patched; is it a timm Swin?")
    return model


@torch.no_grad()
def evaluate(model, loader, device, amp: bool) -> float:
    model.eval()
    correct = total = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=amp):
            pred = model(x).argmax(-1)
        correct += (pred == y).sum().item()
        total += y.numel()
    return correct / max(total, 1)


def _train_step(model, opt, x, y, amp: bool, dev_type: str) -> torch.Tensor:
    """Forward, backward, gradient clipping, AdamW step; returns the loss (not synchronised)."""
    with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=amp):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    opt.step()
    return loss.detach()


class CapturedStep:
    """:func:`_train_step` captured once in a CUDA graph and replayed on static input buffers.

    Capture needs a few eager warm-up steps (on a side stream); their updates are undone in place
    (parameters restored, AdamW's moments and step counts zeroed — the graph keeps these tensors'
    addresses), so the run starts from the same weights as an eager one. The optimizer must be
    AdamW(capturable=True) with a tensor learning rate, which the scheduler updates in place."""

    def __init__(self, model, opt, x, y, amp: bool, dev_type: str, warmup: int = 3):
        with torch.cuda.device(x.device):  # streams and capture on the model's GPU, not the current one
            self._capture(model, opt, x, y, amp, dev_type, warmup)

    def _capture(self, model, opt, x, y, amp, dev_type, warmup):
        from elsa_vision.verify import capture
        self.x, self.y = x.clone(), y.clone()
        params = [p for p in model.parameters() if p.requires_grad]
        saved = [p.detach().clone() for p in params]

        def step():  # (the gradients are None when the step is captured: its backward writes them)
            opt.zero_grad(set_to_none=True)
            return _train_step(model, opt, self.x, self.y, amp, dev_type)

        def reset():  # undo the warm-up's updates in place (the graph keeps these tensors' addresses)
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
                for state in opt.state.values():
                    for v in state.values():
                        if torch.is_tensor(v):
                            v.zero_()
            opt.zero_grad(set_to_none=True)  # the captured backward then writes (not adds) the gradients

        try:
            # thread_local: the DataLoader's pin-memory thread keeps allocating pinned host memory
            # while the step is captured, which the default (global) mode forbids
            self.graph, self.loss = capture(step, warmup, mode="thread_local", reset=reset)
        except RuntimeError as e:
            raise SystemExit(f"--cuda-graph: the training step could not be captured ({str(e).splitlines()[0]}); "
                             "run without --cuda-graph") from None

    def __call__(self, x, y) -> torch.Tensor:
        with torch.cuda.device(self.x.device):
            self.x.copy_(x, non_blocking=True)
            self.y.copy_(y, non_blocking=True)
            self.graph.replay()
        return self.loss


def train_run(a, tag: str, elsa: bool, root: Path, out: Path) -> dict:
    """One training run; returns its history {"loss": [...], "val_acc": [...], "seconds": s}."""
    from tqdm import tqdm
    tl, vl, classes = loaders(root, a.img_size, a.batch, a.workers, a.seed)
    model = build_model(a, len(classes), elsa)
    if a.cuda_graph:  # the step reads the learning rate from a tensor the scheduler updates in place
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(a.lr, device=a.device), weight_decay=0.05,
                                capturable=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.05)
    steps_per_epoch = len(tl) if not a.max_steps else min(len(tl), a.max_steps)
    total = max(1, steps_per_epoch * a.epochs)
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    amp = a.amp == "bf16"
    dev_type = a.device.split(":")[0]
    # epoch_seconds: the training steps of each epoch alone (no evaluation or checkpoint), so the
    # first epoch's one-time costs (kernel compiles, data-loader start, cold file cache) show apart
    hist = {"run": tag, "loss": [], "val_acc": [], "epoch_seconds": [], "classes": classes}
    best = -1.0
    step_fn = None
    t0 = time.time()
    for epoch in range(a.epochs):
        model.train()
        t_epoch = time.time()
        bar = tqdm(tl, total=steps_per_epoch, desc=f"{tag} epoch {epoch + 1}/{a.epochs}")
        for step, (x, y) in enumerate(bar):
            if step >= steps_per_epoch:
                break
            x, y = x.to(a.device, non_blocking=True), y.to(a.device, non_blocking=True)
            if a.cuda_graph:
                if step_fn is None:
                    step_fn = CapturedStep(model, opt, x, y, amp, dev_type)
                loss = step_fn(x, y)
            else:
                loss = _train_step(model, opt, x, y, amp, dev_type)
                opt.zero_grad(set_to_none=True)
            sched.step()
            hist["loss"].append(loss.item())
            bar.set_postfix(loss=f"{hist['loss'][-1]:.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
        hist["epoch_seconds"].append(time.time() - t_epoch)  # loss.item() synchronized every step
        acc = evaluate(model, vl, a.device, amp)
        hist["val_acc"].append(acc)
        print(f"{tag} epoch {epoch + 1}: train loss {np.mean(hist['loss'][-steps_per_epoch:]):.4f}, val acc {acc:.3f}, "
              f"steps {hist['epoch_seconds'][-1]:.1f} s")
        # plain types only (paths as strings), so torch.load's default weights_only mode reads it
        args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
        ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1, "val_acc": acc,
                "classes": classes, "args": args}
        torch.save(ckpt, out / f"{tag}_last.pt")
        if acc > best:
            best = acc
            torch.save(ckpt, out / f"{tag}_best.pt")
    hist["seconds"] = time.time() - t0
    if elsa:
        from elsa_vision.adapters.registry import patched_modules
        hist["delegated_calls"] = sum(s.delegated for _, s in patched_modules(model))
    return hist


def plot_curves(hists: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for h in hists:
        loss = np.asarray(h["loss"])
        ax.plot(loss, alpha=0.35, lw=0.8)
        k = max(1, len(loss) // 50)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(len(smooth)) + k - 1, smooth, color=ax.lines[-1].get_color(), lw=1.8,
                label=f"{h['run']} (val acc {h['val_acc'][-1]:.3f}, {h['seconds']:.0f} s)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Swin fine-tuning: ELSA vs native attention (same seed, same data order)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_args(a, ap) -> None:
    """Argument errors (exit 2) before any data is made or read."""
    import timm
    from elsa_vision.api import PRECISIONS
    from elsa_vision.dispatch import device_problem
    for name, lo in (("batch", 1), ("epochs", 1), ("max_steps", 0), ("workers", 0), ("per_class", 1),
                     ("val_per_class", 1), ("img_size", 32)):
        if getattr(a, name) < lo:
            ap.error(f"--{name.replace('_', '-')} must be ≥ {lo}, got {getattr(a, name)}")
    if a.synthetic is not None and not 2 <= a.classes <= len(SHAPES):
        ap.error(f"--classes must be in [2, {len(SHAPES)}], got {a.classes}")
    if not a.lr > 0:
        ap.error(f"--lr must be > 0, got {a.lr}")
    if a.precision not in PRECISIONS:
        ap.error(f"--precision must be one of {', '.join(PRECISIONS)}, got {a.precision!r}")
    why = device_problem(a.device, a.backend)
    if why:
        ap.error(f"--device / --backend: {why}")
    if a.cuda_graph and not a.device.startswith("cuda"):
        ap.error(f"--cuda-graph captures the training step in a CUDA graph: it needs a CUDA --device, got {a.device!r}")
    if a.model_kwargs:
        try:
            if not isinstance(json.loads(a.model_kwargs), dict):
                raise ValueError
        except ValueError:
            ap.error(f"--model-kwargs must be a JSON object, e.g. '{{\"depths\": [2, 2]}}', got {a.model_kwargs!r}")
    if not timm.is_model(a.model):
        ap.error(f"--model {a.model!r} is not a timm model name (e.g. swin_tiny_patch4_window7_224, "
                 "swinv2_tiny_window8_256)")
    if "swin" not in a.model:
        ap.error(f"--model {a.model!r} is not a timm Swin (v1 or v2): this demo fine-tunes Swin models, whose "
                 "window attention ELSA serves (e.g. swin_tiny_patch4_window7_224, swinv2_tiny_window8_256)")
    if not 0.0 <= a.drop_path < 1.0:
        ap.error(f"--drop-path is a probability in [0, 1), got {a.drop_path}")
    if a.backend == "eca":
        ap.error("--backend eca runs causal attention only; Swin's windows take auto, triton or reference")


def check_data(root: Path, ap) -> None:
    """An ImageFolder layout with at least two classes (train/ and val/, or one class-folder root)."""
    from torchvision import datasets
    if not root.is_dir():
        ap.error(f"--data {root} is not a directory")
    has_train, has_val = (root / "train").is_dir(), (root / "val").is_dir()
    if has_train != has_val:
        ap.error(f"--data {root} has {'train/' if has_train else 'val/'} but no {'val/' if has_train else 'train/'}: "
                 "give both, or a root whose sub-folders are the classes (split 90/10 here)")
    for d in ([root / "train", root / "val"] if has_train else [root]):
        try:
            found = datasets.ImageFolder(d)
        except (FileNotFoundError, RuntimeError) as e:
            ap.error(f"--data: {d} is not an image folder ({str(e).splitlines()[0]}); expected "
                     f"{d}/<class>/<image files>")
        if len(found.classes) < 2:
            ap.error(f"--data: {d} has {len(found.classes)} class folder(s); classification needs at least 2")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=Path, help="ImageFolder root (train/ and val/ inside, or one folder)")
    src.add_argument("--synthetic", type=Path, help="generate coloured shapes here (offline) and train on them")
    ap.add_argument("--classes", type=int, default=4, help=f"synthetic: number of shapes (2..{len(SHAPES)})")
    ap.add_argument("--per-class", type=int, default=400, help="synthetic: training images per class")
    ap.add_argument("--val-per-class", type=int, default=100, help="synthetic: validation images per class")
    ap.add_argument("--model", default="swin_tiny_patch4_window7_224",
                    help="a timm Swin v1/v2 name, e.g. swinv2_tiny_window8_256")
    ap.add_argument("--model-kwargs", default="", help='extra timm.create_model kwargs as JSON, e.g. \'{"depths": [2, 2]}\'')
    ap.add_argument("--pretrained", action="store_true", help="load timm's pretrained weights (downloads)")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--max-steps", type=int, default=0, help="cap the steps per epoch (smoke runs)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--drop-path", type=float, default=0.1)
    ap.add_argument("--amp", choices=["bf16", "fp32"], help="default: bf16 on a GPU, fp32 on a CPU")
    ap.add_argument("--precision", default="auto", help="ELSA float32 mode: auto, ieee, fp16x3, tf32x3, tf32")
    ap.add_argument("--backend", default="auto", help="ELSA backend: auto, triton, reference")
    ap.add_argument("--compare-native", action="store_true", help="also train with timm's attention; plot both")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, help="checkpoints, history.json, loss_curves.png (default out/finetune_<model>)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture the training step once in a CUDA graph and replay it (CUDA only; AdamW runs "
                         "capturable; the warm-up steps capture needs are undone)")
    a = ap.parse_args(argv)
    check_args(a, ap)
    a.amp = a.amp or ("bf16" if a.device.startswith("cuda") else "fp32")
    out = a.out or Path("out") / f"finetune_{a.model}"
    if out.exists() and not out.is_dir():
        ap.error(f"--out {out} is a file; name a folder")
    if a.synthetic is not None:
        root = make_synthetic(a.synthetic, a.classes, a.per_class, a.val_per_class, a.img_size, a.seed)
    else:
        root = a.data
        check_data(root, ap)
    out.mkdir(parents=True, exist_ok=True)
    runs = [("elsa", True)] + ([("native", False)] if a.compare_native else [])
    hists = [train_run(a, tag, elsa, root, out) for tag, elsa in runs]
    (out / "history.json").write_text(json.dumps(hists))
    for h in hists:
        later = h["epoch_seconds"][1:]
        print(f"{h['run']}: final val acc {h['val_acc'][-1]:.3f}, {h['seconds']:.1f} s"
              + (f" (training steps after the first epoch: {sum(later) / len(later):.2f} s per epoch)" if later else "")
              + (f", {h['delegated_calls']} delegated call(s)" if h.get("delegated_calls") else "")
              + (" (counted while capturing: each replay repeats them)" if h.get("delegated_calls") and a.cuda_graph
                 else ""))
    if a.compare_native:
        e, n = hists
        k = min(len(e["loss"]), len(n["loss"]))
        diff = max(abs(x - y) for x, y in zip(e["loss"][:k], n["loss"][:k]))
        print(f"max |loss_elsa − loss_native| over {k} steps: {diff:.3g}")
        plot_curves(hists, out / "loss_curves.png")
        print(f"wrote {out / 'loss_curves.png'}")
    print(f"checkpoints and history in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
