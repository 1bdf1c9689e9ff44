"""Verification tools: the float64 oracle, the tolerance rule, the six drift metrics, the structure proof.

    python -m elsa_vision.verify structure --nq 16 --nk 131072      # partitions and phase-2 evidence
    python -m elsa_vision.verify drift --n 1024 --dtype float32      # six drift metrics vs float64
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Callable, Optional

import torch

from .api import attention, resolve_precision
from .checks import bias4, check_qkv, check_scale


def _scores(q, k, bias, scale, causal, dtype):
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(dtype)
    if causal:
        nq, nk = q.shape[-2], k.shape[-2]
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (nk - nq), float("-inf"))
    return s


def oracle(q, k, v, *, bias=None, scale=None, causal=False, return_probs=False):
    """Dense float64 softmax attention: out [B,H,Nq,D] float64 (and P [B,H,Nq,Nk]). Rows with no
    visible key give 0. Memory O(B·H·Nq·Nk): for checking, not for production."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=torch.float64, device=bias.device).masked_fill_(~bias, float("-inf"))
    s = _scores(q, k, bias, scale, causal, torch.float64)
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isneginf(m), 0.0, m))
    z = e.sum(-1, keepdim=True)
    p = e / torch.where(z > 0, z, 1.0)
    out = torch.matmul(p, v.to(torch.float64))
    return (out, p) if return_probs else out


def capture(step: Callable[[], object], warmup: int = 1, *, mode: str = "global",
            reset: Optional[Callable[[], None]] = None):
    """``step`` (no arguments) captured once into a CUDA graph → (graph, what the captured call
    returned). The warm-up runs on a side stream, as capture requires (it also initialises
    autograd's streams); ``step`` must not synchronise with the host. ``reset`` runs between the
    warm-up and the capture (e.g. to undo a training step's updates). ``mode`` is the capture error
    mode (``"thread_local"`` where another thread allocates while the graph is captured, e.g. a
    DataLoader's pin-memory thread)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        out = step()
    return graph, out


def unzero_residual_norms(model: torch.nn.Module) -> int:
    """Set to 1 the weights of normalisation layers that are initialised to exactly 0; returns how many.

    timm's Swin v2 starts with its residual post-norms at zero (``_init_respostnorm``), so a model
    built with ``pretrained=False`` ignores its attention output entirely: comparing patched and
    unpatched random-weight models would prove nothing. Call this on such models before comparing
    them. Pretrained weights never need it."""
    n = 0
    with torch.no_grad():
        for m in model.modules():
            w = getattr(m, "weight", None)
            if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)) and w is not None and not w.any():
                w.fill_(1.0)
                n += 1
    return n


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def tolerance(ref_err: float, dtype: torch.dtype, grad: bool = False) -> float:
    """The pass rule of every exactness test: max |elsa − oracle| ≤ k · max |same-dtype torch reference
    − oracle| + 1e-6, with k = 2 for outputs and 3 for gradients (``grad``). The oracle is float64
    dense softmax attention (:func:`oracle`); the same-dtype reference is plain PyTorch attention in
    the inputs' own dtype, so the bound is tied to what that dtype can do."""
    return (3.0 if grad else 2.0) * ref_err + 1e-6


def drift(q, k, v, *, bias=None, scale=None, causal=False, precision="auto", backend="auto") -> dict:
    """The six drift metrics of the ELSA paper (supplementary §C) of one ELSA call against float64.

    P̂ is the attention matrix that ELSA's saved row statistics define (the one its backward
    reconstructs): exp(s − lse) with s = q kᵀ·scale + bias computed in the inputs' dtype and lse
    from the kernel. Ŷ is the kernel's output. Returns a dict of floats:

      p_max_abs       max |P̂ − P|                     y_max_abs     max |Ŷ − Y|
      p_rel_l2        ‖P̂ − P‖₂ / ‖P‖₂                 y_rel_l2      ‖Ŷ − Y‖₂ / ‖Y‖₂
      js_mean         mean Jensen–Shannon divergence of rows (nats)
      argmax_rate     fraction of rows whose top key differs
      p_row_max_abs_p50/p95/p99, y_row_max_abs_p50/p95/p99: percentiles over rows of the per-row max drift

    Memory O(B·H·Nq·Nk) in float64: use moderate sizes.
    """
    check_qkv(q, k, v, "drift")
    d = q.shape[-1]
    sc = check_scale(scale, d, "drift")
    b4 = bias4(bias, *q.shape[:3], k.shape[2], q, "drift")
    y, lse = attention(q, k, v, bias=bias, scale=scale, causal=causal, precision=precision, backend=backend,
                       return_lse=True)
    y_ref, p_ref = oracle(q, k, v, bias=b4, scale=sc, causal=causal, return_probs=True)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = _scores(q, k, b4, sc, causal, cdt).double()
    p_hat = torch.exp(s - lse.double()[..., None])
    p_hat = torch.nan_to_num(p_hat, nan=0.0)
    dp = p_hat - p_ref
    dy = y.double() - y_ref

    def js(a, b):
        mid = 0.5 * (a + b)
        def kl(x):
            return torch.where(x > 0, x * (torch.log(x.clamp_min(1e-300)) - torch.log(mid.clamp_min(1e-300))), 0.0).sum(-1)
        return 0.5 * kl(a) + 0.5 * kl(b)

    row_p = dp.abs().amax(-1).flatten()
    row_y = dy.abs().amax(-1).flatten()
    qs = torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64, device=row_p.device)
    rp, ry = torch.quantile(row_p.cpu(), qs.cpu()), torch.quantile(row_y.cpu(), qs.cpu())
    return {
        "p_max_abs": dp.abs().max().item(),
        "p_rel_l2": (dp.norm() / p_ref.norm()).item(),
        "js_mean": js(p_hat, p_ref).mean().item(),
        "argmax_rate": (p_hat.argmax(-1) != p_ref.argmax(-1)).double().mean().item(),
        "y_max_abs": dy.abs().max().item(),
        "y_rel_l2": (dy.norm() / y_ref.norm().clamp_min(1e-300)).item(),
        "p_row_max_abs_p50": rp[0].item(), "p_row_max_abs_p95": rp[1].item(), "p_row_max_abs_p99": rp[2].item(),
        "y_row_max_abs_p50": ry[0].item(), "y_row_max_abs_p95": ry[1].item(), "y_row_max_abs_p99": ry[2].item(),
    }


def structure(q, k, v, *, bias=None, scale=None, causal=False, precision="auto",
              partitions: Optional[int] = None) -> dict:
    """Evidence that the Triton forward is the two-level scan, for one problem.

    Runs phase 1 and phase 2 of the Triton backend and reports: the number of key partitions and
    the phase-1 grid; the shapes of the (m, S, W) summaries phase 1 wrote to global memory; that
    merging those summaries in torch reproduces the kernel's output (``summary_merge_max_diff``);
    and that phase 2 really reads them: re-running phase 2 with partition 0's summaries replaced by
    the identity changes the output (``phase2_reads_summaries``).
    """
    from .kernels import attention as K
    from .kernels.reference import merge

    check_qkv(q, k, v, "structure")
    if q.is_cuda and q.get_device() != torch.cuda.current_device():  # (the launches below: on q's device)
        with torch.cuda.device(q.device):
            return structure(q, k, v, bias=bias, scale=scale, causal=causal, precision=precision,
                             partitions=partitions)
    d = q.shape[-1]
    sc = check_scale(scale, d, "structure")
    b4 = bias4(bias, *q.shape[:3], k.shape[2], q, "structure")
    prec = resolve_precision(precision, q.dtype)
    info: dict = {}
    out, stats = K.forward(q, k, v, b4, sc, bool(causal), prec, partitions, summaries=info)
    B, H, Nq, D = q.shape
    rep = {
        "shape": {"B": B, "H": H, "Nq": Nq, "Nk": k.shape[2], "D": D, "dtype": str(q.dtype).replace("torch.", ""),
                  "precision": prec, "causal": bool(causal)},
        "partitions": info["n_part"], "partition_len": info["part_len"],
        "block_m": info["block_m"], "block_n": info["block_n"], "phase1_grid": list(info["phase1_grid"]),
    }
    if info["n_part"] == 1:
        rep.update(two_pass=False, note="one partition fills the GPU: phase 2 is phase 1's epilogue (no summaries)")
        return rep
    ms, ss, ws = info["m"], info["S"], info["W"]
    rep["summary_shapes"] = {"m": list(ms.shape), "S": list(ss.shape), "W": list(ws.shape)}
    rep["summary_bytes"] = ms.numel() * 4 + ss.numel() * 4 + ws.numel() * 4
    # torch merge of the summaries (m in natural units on the bias path, else log2 units)
    to_nat = 1.0 if b4 is not None else math.log(2.0)
    state = (ms[:, 0] * to_nat, ss[:, 0], ws[:, 0])
    for p in range(1, ms.shape[1]):
        state = merge(state, (ms[:, p] * to_nat, ss[:, p], ws[:, p]))
    m, s, w = state
    merged = torch.where((s > 0)[..., None], w / torch.where(s > 0, s, 1)[..., None], 0.0)[..., :D]
    rep["summary_merge_max_diff"] = max_err(merged.view(B, H, Nq, D), out.float())
    ms2, ss2, ws2 = ms.clone(), ss.clone(), ws.clone()
    ms2[:, 0], ss2[:, 0], ws2[:, 0] = float("-inf"), 0.0, 0.0
    out2, stats2 = torch.empty_like(out), torch.empty_like(stats)
    K.phase2(ms2, ss2, ws2, out2, stats2, b4 is not None)
    rep["phase2_reads_summaries"] = bool(max_err(out2, out) > 0)
    rep["two_pass"] = rep["phase2_reads_summaries"] and rep["summary_merge_max_diff"] < 1e-2
    return rep


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="elsa-verify", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["structure", "drift"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--n", type=int, default=4096, help="tokens (Nq = Nk unless given)")
    ap.add_argument("--nq", type=int)
    ap.add_argument("--nk", type=int)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--partitions", type=int)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    nq, nk = a.nq or a.n, a.nk or a.n
    g = torch.Generator(device=a.device).manual_seed(0)
    dt = _DTYPES[a.dtype]
    q = torch.randn(a.batch, a.heads, nq, a.d, device=a.device, dtype=dt, generator=g)
    k = torch.randn(a.batch, a.heads, nk, a.d, device=a.device, dtype=dt, generator=g)
    v = torch.randn(a.batch, a.heads, nk, a.d, device=a.device, dtype=dt, generator=g)
    if a.what == "structure":
        rep = structure(q, k, v, causal=a.causal, precision=a.precision, partitions=a.partitions)
    else:
        rep = drift(q, k, v, causal=a.causal, precision=a.precision)
    print(json.dumps(rep, indent=2))
    if a.what == "structure" and rep["partitions"] > 1 and not rep["two_pass"]:
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
