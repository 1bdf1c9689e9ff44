"""Quickstart: put ELSA into a timm ViT and a Swin, check it against native attention, time it.

    python demos/quickstart.py              # GPU if there is one, else a small CPU run
    python demos/quickstart.py --device cpu

What it does, per model (random weights, built locally — nothing is downloaded):

1. ``report = elsa_vision.patch(model)`` and prints the report (which modules run on ELSA);
2. checks the patched model against the unpatched one with the project's rule: with the unpatched
   model in float64 as the oracle, max |ELSA − oracle| ≤ 2 × max |native − oracle| + 1e-6 for the
   float32 forward (and, on a GPU, for the bf16-autocast forward);
3. times native attention (timm's own path) against ELSA, interleaved in one process: forward in
   float32 and bf16 autocast and a bf16 training step on a GPU; a float32 forward on a CPU —
   latency and, on a GPU, peak memory.

Exit status 1 if any check fails. On a CPU without ``TRITON_INTERPRET=1`` ELSA runs on its
reference backend (plain torch), so the CPU timings show the mechanics, not the kernels' speed.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import elsa_vision
from elsa_vision.adapters.registry import patched_modules
from elsa_vision.verify import max_err, tolerance, unzero_residual_norms

# (timm name, image size, batch on GPU, batch on CPU)
MODELS = [
    ("vit_small_patch16_224", 224, 32, 2),
    ("swin_tiny_patch4_window7_224", 224, 32, 1),
]


def build(name: str, device: str) -> torch.nn.Module:
    import timm
    # drop_path_rate=0: stochastic depth would make two runs of one model differ
    model = timm.create_model(name, pretrained=False, drop_path_rate=0.0).to(device).eval()
    unzero_residual_norms(model)  # random-weight Swin v2 would otherwise ignore its attention
    return model


def check(native, patched, x, oracle_out, amp: bool) -> tuple[bool, float, float]:
    """(passed, |elsa − oracle|, |native − oracle|) for one forward."""
    dev = x.device.type
    with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
        e_nat = max_err(native(x), oracle_out)
        e_elsa = max_err(patched(x), oracle_out)
    return e_elsa <= tolerance(e_nat, x.dtype), e_elsa, e_nat


def variants(native, patched, x, amp: bool, train: bool) -> dict:
    dev = x.device.type

    def fwd(m):
        def f():
            with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
                return m(x)
        return f

    def step(m):
        opt = torch.optim.SGD(m.parameters(), lr=1e-6)

        def f():
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
                loss = m(x).float().logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return f

    make = step if train else fwd
    return {"native": make(native), "elsa": make(patched)}


def measure(fns: dict, warmup: int, rounds: int, gpu: bool) -> dict:
    """{name: (median ms, peak MiB or None)}: the variants run in turns, one call each per round
    (so that a slow stretch of the machine falls on all of them), after ``warmup`` calls each;
    ``gpu``: synchronise around each call and record its peak memory."""
    times = {name: [] for name in fns}
    peaks = {}
    for name, f in fns.items():
        for _ in range(warmup):
            f()
    for _ in range(rounds):
        for name, f in fns.items():
            if gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            f()
            if gpu:
                torch.cuda.synchronize()
                peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated() - base)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {n: (statistics.median(t), peaks[n] / 2**20 if n in peaks else None) for n, t in times.items()}


def table(rows: list[dict], cols: list[str]) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else "" if v is None else str(v)
    data = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(d[i]) for d in data]) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(d) for d in data])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, help="override the batch size")
    ap.add_argument("--rounds", type=int, help="timed rounds per variant (default 20 on GPU, 3 on CPU)")
    a = ap.parse_args(argv)
    for name in ("batch", "rounds"):  # argument errors exit 2; exit 1 means a check failed
        if getattr(a, name) is not None and getattr(a, name) < 1:
            ap.error(f"--{name} must be ≥ 1, got {getattr(a, name)}")
    from elsa_vision.dispatch import device_problem
    why = device_problem(a.device)
    if why:
        ap.error(f"--device: {why}")
    dev = a.device
    gpu = torch.device(dev).type == "cuda"
    if gpu:
        # native fp32 is true fp32 here, so ELSA runs a float32-accurate mode ("auto" → fp16x3)
        torch.set_float32_matmul_precision("highest")
    rounds = a.rounds or (20 if gpu else 3)
    rows, ok = [], True
    for name, size, b_gpu, b_cpu in MODELS:
        batch = a.batch or (b_gpu if gpu else b_cpu)
        torch.manual_seed(0)
        native = build(name, dev)
        patched = copy.deepcopy(native)
        report = elsa_vision.patch(patched)
        print(f"\n== {name}  batch {batch}, {size} px, {dev}")
        print(report)
        x = torch.randn(batch, 3, size, size, device=dev)
        with torch.no_grad():
            oracle_out = copy.deepcopy(native).double()(x.double())
        for amp in ([False, True] if gpu else [False]):
            passed, e_elsa, e_nat = check(native, patched, x, oracle_out, amp)
            ok &= passed
            print(f"  {'bf16 autocast' if amp else 'float32'} output vs float64: ELSA {e_elsa:.3g}, "
                  f"native {e_nat:.3g}  -> {'ok' if passed else 'FAIL (ELSA error > 2x native + 1e-6)'}")
        cases = [("forward fp32", False, False)]
        if gpu:
            cases += [("forward bf16", True, False), ("train step bf16", True, True)]
        for label, amp, train in cases:
            res = measure(variants(native, patched, x, amp, train), warmup=2 if gpu else 1, rounds=rounds, gpu=gpu)
            (nat, nat_mib), (els, els_mib) = res["native"], res["elsa"]
            rows.append({"model": name, "batch": batch, "case": label, "native ms": nat, "elsa ms": els,
                         "speedup": nat / els, "native MiB": nat_mib, "elsa MiB": els_mib})
        delegated = sum(s.delegated for _, s in patched_modules(patched))
        if delegated:
            print(f"  note: {delegated} call(s) were delegated to the original forward")
    cols = ["model", "batch", "case", "native ms", "elsa ms", "speedup", "native MiB", "elsa MiB"]
    print("\n" + table(rows, cols))
    print("\nall outputs match native attention (float64-oracle rule)" if ok else "\nFAILED: see the checks above")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
