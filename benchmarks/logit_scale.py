"""Swin v2's logit_scale gradient in float32 against the float64 oracle: timm's formula in its own
order of operations, the same formula with τ multiplied into normalize(q) before the product (the
order ELSA's adapter takes), and the patched model (CPU; the Triton kernels under the interpreter).

    TRITON_INTERPRET=1 python benchmarks/logit_scale.py                 # 40 weight draws × 2 inputs
    python benchmarks/logit_scale.py --draws 4 --inputs 0 --backend reference

The gradient of a block's logit_scale has one entry per head, each a float32 sum over every token
pair of every window; its rounding error depends on the order of the float32 operations, and the
oracle rule's 3 × native error (elsa_vision.verify.tolerance) is then at the luck of that order.
Per draw (the weights' seed), input and block the CSV gives max |gradient − oracle| of each of the
three, and whether ELSA's is within the rule against timm's order alone (``within_timm``) and
against the larger of the two orders' errors (``within_orders``). The model is the padded test
model of tests/test_timm.py (a 12 × 12 map under 8 × 8 windows, then 6 × 6).
→ benchmarks/results/<cpu>/swinv2_logit_scale_rounding.{csv,png}
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import metadata, results_dir, save  # noqa: E402

import elsa_vision  # noqa: E402
from elsa_vision import verify  # noqa: E402
from elsa_vision.adapters import registry  # noqa: E402
from elsa_vision.dispatch import device_problem  # noqa: E402


def tau_in_q_forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
    """timm's Swin v2 WindowAttention.forward (x [B·nW, N, C], mask [nW, N, N] or None) with τ
    multiplied into normalize(q) before the product instead of into the product after it: the
    same float32 arithmetic in another order. (No dropout: the models here have none.)"""
    B_, N, C = x.shape
    bias = None if self.q_bias is None else torch.cat((self.q_bias, self.k_bias, self.v_bias))
    qkv = F.linear(x, self.qkv.weight, bias)
    q, k, v = qkv.reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    tau = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
    attn = (F.normalize(q, dim=-1) * tau) @ F.normalize(k, dim=-1).transpose(-2, -1)
    table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
    rpb = table[self.relative_position_index.view(-1)].view(N, N, -1).permute(2, 0, 1)
    attn = attn + 16 * torch.sigmoid(rpb).unsqueeze(0)
    if mask is not None:
        nw = mask.shape[0]
        attn = (attn.view(-1, nw, self.num_heads, N, N) + mask[None, :, None]).view(-1, self.num_heads, N, N)
    return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(B_, N, C))


def padded_model(seed: int) -> torch.nn.Module:
    """The padded Swin v2 test model, weights of ``seed``, residual norms made non-zero."""
    import timm
    torch.manual_seed(seed)
    m = timm.create_model("swinv2_tiny_window8_256", pretrained=False, img_size=48, depths=(2, 2), num_heads=(2, 4),
                          embed_dim=32, drop_path_rate=0.0)
    verify.unzero_residual_norms(m)
    return m


def logit_scale_errors(seed: int, input_seed: int = 0, backend: str = "auto") -> list[dict]:
    """One row per block of :func:`padded_model` (``seed``) on the image of ``input_seed``: max
    |error| of the logit_scale gradient in timm's order, with τ in q, and patched (``backend``),
    against the float64 model; ``unit`` = max(1, max |oracle|), the rule's scale; ``within_timm`` /
    ``within_orders``: ELSA's error within the rule against timm's order's error / the larger of
    the two orders' errors; ``served``: every patched module served every call."""
    from timm.models import swin_transformer_v2 as v2
    m = padded_model(seed)
    x = torch.randn(1, 3, 48, 48, generator=torch.Generator().manual_seed(input_seed))
    names = [n for n, _ in m.named_parameters() if n.endswith("logit_scale")]

    def grads(model, x, w):
        loss = (model(x) * w).sum()
        return torch.autograd.grad(loss, [model.get_parameter(n) for n in names])
    torch.manual_seed(0)
    m64 = copy.deepcopy(m).double()
    with torch.no_grad():
        w = torch.randn_like(m(x))
    timm_order, oracle = grads(m, x, w), grads(m64, x.double(), w.double())
    own = v2.WindowAttention.forward
    v2.WindowAttention.forward = tau_in_q_forward
    try:
        tau_in_q = grads(m, x, w)
    finally:
        v2.WindowAttention.forward = own
    elsa_vision.patch(m, backend=backend)
    elsa = grads(m, x, w)
    served = all(st.calls > 0 and not st.delegated for _, st in registry.patched_modules(m))
    rows = []
    for n, e, t, f, o in zip(names, elsa, timm_order, tau_in_q, oracle):
        unit = max(1.0, o.abs().max().item())
        errs = {k: verify.max_err(g, o) for k, g in (("timm", t), ("tau_in_q", f), ("elsa", e))}
        rule = lambda ref: verify.tolerance(ref / unit, e.dtype, grad=True) * unit  # noqa: E731
        rows.append({"seed": seed, "input": input_seed, "block": n.removesuffix(".attn.logit_scale"),
                     "heads": o.numel(), "unit": unit, **{f"{k}_err": v for k, v in errs.items()},
                     "within_timm": errs["elsa"] <= rule(errs["timm"]),
                     "within_orders": errs["elsa"] <= rule(max(errs["timm"], errs["tau_in_q"])),
                     "tau_in_q_within_timm": errs["tau_in_q"] <= rule(errs["timm"]),
                     "timm_within_tau_in_q": errs["timm"] <= rule(errs["tau_in_q"]),
                     "served": served, "backend": backend})
    return rows


def summary(rows: list[dict]) -> str:
    """Counts over the rows (each a block's gradient tensor): who exceeded which rule; geometric means."""
    def gm(k):
        return math.exp(sum(math.log(max(r[k], 1e-30)) for r in rows) / len(rows))
    out = [f"{len(rows)} gradient tensors: ELSA over the rule against timm's order "
           f"{sum(not r['within_timm'] for r in rows)}, against the larger of the two orders "
           f"{sum(not r['within_orders'] for r in rows)}; τ in q over the rule against timm's order "
           f"{sum(not r['tau_in_q_within_timm'] for r in rows)}, timm's order over it against τ in q "
           f"{sum(not r['timm_within_tau_in_q'] for r in rows)}",
           "geometric mean |error|: timm {:.3g}, τ in q {:.3g}, ELSA {:.3g}; largest {:.3g}, {:.3g}, {:.3g}".format(
               gm("timm_err"), gm("tau_in_q_err"), gm("elsa_err"),
               *(max(r[k] for r in rows) for k in ("timm_err", "tau_in_q_err", "elsa_err")))]
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    worse = [max(r["timm_err"], r["tau_in_q_err"]) for r in rows]
    ax.scatter([r["timm_err"] for r in rows], [r["elsa_err"] for r in rows], s=9, label="ELSA vs timm's order")
    ax.scatter(worse, [r["elsa_err"] for r in rows], s=9, marker="x", label="ELSA vs the worse of the two orders")
    ax.scatter([r["timm_err"] for r in rows], [r["tau_in_q_err"] for r in rows], s=9, marker="^",
               label="τ in q vs timm's order")
    lo = min(min(r["timm_err"], r["elsa_err"], r["tau_in_q_err"]) for r in rows) / 2
    hi = max(max(r["timm_err"], r["elsa_err"], r["tau_in_q_err"]) for r in rows) * 2
    xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
    ax.plot(xs, [3 * x + 1e-6 for x in xs], "k--", lw=1, label="rule: 3·x + 1e-6 (unit 1)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("float32 order's max |error| (x)")
    ax.set_ylabel("max |error|")
    r0 = rows[0]
    ax.set_title(f"Swin v2 logit_scale gradient vs float64, {len(rows)} block tensors\n"
                 f"{r0['device']}, torch {r0['torch']}, {r0['date']}, backend {r0['backend']}", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=40, help="weight seeds 0 .. draws-1")
    ap.add_argument("--inputs", type=int, nargs="+", default=[0, 1], help="input image seeds")
    ap.add_argument("--backend", default="auto", help="ELSA backend passed to patch()")
    ap.add_argument("--out", help="results folder (default benchmarks/results/<cpu>)")
    ap.add_argument("--name", default="swinv2_logit_scale_rounding")
    a = ap.parse_args(argv)
    if a.draws < 1 or not a.inputs:
        ap.error(f"--draws takes at least 1 weight draw and --inputs at least one seed, got {a.draws} / {a.inputs}")
    why = device_problem("cpu", a.backend)
    if why:
        ap.error(f"--backend: {why}")
    rows = []
    for inp in a.inputs:
        for seed in range(a.draws):
            rows += logit_scale_errors(seed, inp, a.backend)
    if not all(r["served"] for r in rows):
        print("some patched modules delegated calls: ELSA's rows are not all ELSA's", file=sys.stderr)
    meta = metadata()
    save(rows, Path(a.out) if a.out else results_dir(), a.name, lambda rs, p: plot([{**meta, **r} for r in rs], p))
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
