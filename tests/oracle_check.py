"""The exactness rule as test helpers: compare against the float64 oracle with a bound tied to the
error of a plain torch implementation in the inputs' own dtype (``elsa_vision.verify.tolerance``)."""
from __future__ import annotations

import math

import torch

from elsa_vision import verify


def round_tf32(x):
    """float32 → nearest tf32 value (what cuBLAS feeds a tf32 tensor-core product)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def tf32_operand(t):
    """t with tf32-rounded values forward and an identity gradient (autograd's matmuls then read
    the rounded operands), as a TF32 matmul sees it."""
    return t + (round_tf32(t.detach()) - t.detach())


def torch_same_dtype(q, k, v, bias=None, scale=None, causal=False, tf32=False):
    """Plain softmax attention in the inputs' dtype (the 'same-dtype reference' of the rule).
    ``tf32``: both matmuls take tf32-rounded operands with float32 accumulation, on any device."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    r = tf32_operand if tf32 else (lambda t: t)
    try:
        s = torch.matmul(r(q), r(k).transpose(-1, -2)) * scale
        if bias is not None:
            s = s + (torch.zeros(bias.shape, dtype=s.dtype, device=s.device).masked_fill_(~bias, float("-inf"))
                     if bias.dtype == torch.bool else bias.to(s.dtype))
        if causal:
            nq, nk = q.shape[-2], k.shape[-2]
            i = torch.arange(nq, device=q.device)[:, None]
            j = torch.arange(nk, device=q.device)[None, :]
            s = s.masked_fill(j > i + (nk - nq), float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)  # in the inputs' dtype, as plain PyTorch code would
        return torch.matmul(r(p), r(v))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def at_unit_scale(got, ref64, *others):
    """(got, ref64, *others) divided by ref64's largest magnitude where that is below 1: the rule's
    absolute 1e-6 then stays below the values' own scale (a gradient of tiny inputs, |dk| ~ 1e-17,
    would otherwise pass as all zeros). Values of scale ≥ 1 are returned as they are."""
    m = ref64.abs().max().item()
    assert m > 0, "the oracle's values are all zero: the comparison would check nothing"
    if m >= 1:
        return (got, ref64, *others)
    return (got / m, ref64 / m, *(o / m for o in others))


def assert_close_to_oracle(out, ref64, same, *, name="out", grad=False, rel_l2=None):
    """|out − oracle| ≤ k·|same − oracle| + 1e-6 (k = 2, 3 for gradients); optional rel-L2 bound."""
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    err = verify.max_err(out, ref64)
    ref_err = verify.max_err(same, ref64)
    tol = verify.tolerance(ref_err, out.dtype, grad=grad)
    assert err <= tol, f"{name}: max err {err:.3e} > {tol:.3e} (same-dtype torch err {ref_err:.3e})"
    if rel_l2 is not None:
        r = ((out.double() - ref64).norm() / ref64.norm().clamp_min(1e-300)).item()
        assert r <= rel_l2, f"{name}: relative L2 {r:.3e} > {rel_l2:.1e}"
    return err


def check_case(q, k, v, *, bias=None, causal=False, precision="auto", backend="auto", partitions=None,
               grads=True, scale=None, seed=0, do_scale=1.0, unit_scale=False):
    """Forward (and gradients, for an upstream gradient dO ~ N(0, do_scale²)) of elsa_vision.attention
    vs the oracle; returns the elsa output. ``unit_scale``: each gradient compared at its own scale
    (:func:`at_unit_scale`), for inputs whose gradients are far below 1."""
    import elsa_vision
    ins = [q, k, v] + ([bias] if bias is not None and bias.is_floating_point() else [])
    ins = [t.detach().requires_grad_(grads) for t in ins]
    qq, kk, vv = ins[:3]
    bb = ins[3] if len(ins) == 4 else bias
    out = elsa_vision.attention(qq, kk, vv, bias=bb, causal=causal, precision=precision, backend=backend,
                                partitions=partitions, scale=scale)
    ins64 = [t.detach().double().requires_grad_(grads) for t in ins]
    b64 = ins64[3] if len(ins64) == 4 else bias
    ref = verify.oracle(*ins64[:3], bias=b64, causal=causal, scale=scale)
    tf32 = q.dtype == torch.float32 and (precision == "tf32" or (
        precision == "auto" and torch.get_float32_matmul_precision() != "highest"))
    same_ins = [t.detach().requires_grad_(grads) for t in ins]
    sb = same_ins[3] if len(same_ins) == 4 else bias
    same = torch_same_dtype(*same_ins[:3], bias=sb, causal=causal, scale=scale, tf32=tf32)
    strict = q.dtype == torch.float32 and precision in ("ieee", "tf32x3", "fp16x3")
    assert_close_to_oracle(out, ref, same, rel_l2=2e-6 if strict else None)
    if grads:
        g = torch.Generator(device=q.device).manual_seed(seed)
        do = (torch.randn(out.shape, generator=g, device=q.device, dtype=torch.float32) * do_scale).to(q.dtype)
        ge = torch.autograd.grad(out, ins, do)
        gr = torch.autograd.grad(ref, ins64, do.double())
        gs = torch.autograd.grad(same, same_ins, do)
        for n, a, r, s_ in zip(["dq", "dk", "dv", "dbias"], ge, gr, gs):
            assert_close_to_oracle(*(at_unit_scale(a, r, s_) if unit_scale else (a, r, s_)), name=n, grad=True)
    return out


class DropGradient(torch.autograd.Function):
    """The identity (a copy) whose backward returns no gradient: a graph through it brings the
    tensor before it none (None, not zeros)."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return None


def assert_graph_replay_matches_eager(step, refill):
    """Capture ``step`` (no arguments; returns a tuple of tensors) once in a CUDA graph, call ``refill``
    to write new values into its input buffers, replay, and check the captured outputs are bitwise
    those of an eager ``step()`` on the new values."""
    graph, captured = verify.capture(step)
    with torch.no_grad():
        refill()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)


def assert_fake_matches_real(op, *args):
    """A custom op's fake (meta) outputs have the real outputs' shapes, dtypes and strides (on every
    dim longer than 1): torch.compile plans its buffers from the fake, and inductor asserts the
    strides of what the real op returns."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = op(*args)
    mode = FakeTensorMode()
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        fake = op(*fake_args)
    real = real if isinstance(real, (list, tuple)) else [real]
    fake = fake if isinstance(fake, (list, tuple)) else [fake]
    assert len(real) == len(fake)
    for i, (r, f) in enumerate(zip(real, fake)):
        assert r.shape == f.shape and r.dtype == f.dtype, f"output {i}: {r.shape} {r.dtype} vs fake {f.shape} {f.dtype}"
        rs = [s for s, n in zip(r.stride(), r.shape) if n > 1]
        fs = [s for s, n in zip(f.stride(), f.shape) if n > 1]
        assert rs == fs, f"output {i} {tuple(r.shape)}: strides {r.stride()} but the fake has {f.stride()}"


def elsa_forward_calls(gm) -> int:
    """How many ELSA attention forwards a traced graph calls: the forward ops themselves where they
    are opaque custom ops (the CPU interpreter; the host ops of calls the Hopper kernels take), or
    the launches of the forward kernels that torch.compile traced them into (triton_ops on the GPU)."""
    return op_calls(gm, ("attention_fwd", "attention_packed_fwd", "window_fwd", "window_packed_fwd",
                         "attention_host_fwd", "attention_packed_host_fwd"), ("_fwd_kernel", "_win_fwd_kernel"))


def op_calls(gm, ops, kernels) -> int:
    """How many calls of the ops ``elsa_vision::<op>`` (op in ``ops``) a traced graph makes, each
    opaque or traced into launches of one of ``kernels`` (Triton kernels' names)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        if target.startswith("elsa_vision.") and target.split(".")[1] in ops:
            n += 1
        elif "triton_kernel_wrapper" in target:
            fn = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            n += getattr(fn, "fn", fn).__name__ in kernels
    return n
