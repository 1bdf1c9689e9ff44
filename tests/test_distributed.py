"""elsa_vision.distributed on CPU processes (gloo): sharded attention, forward and gradients, equal to
one process's attention over the whole sequence."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import elsa_vision
from elsa_vision import distributed

B, H, D = 2, 3, 16


def _full(n: int, dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, n, D, generator=g).to(dtype) for _ in range(4)]  # q, k, v, dO


def _worker(rank, world, init_file, lengths, causal, backend, dtype, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        q, k, v, do = _full(sum(lengths), dtype)
        start = sum(lengths[:rank])
        rows = slice(start, start + lengths[rank])
        ql, kl, vl = (t[:, :, rows].clone().requires_grad_() for t in (q, k, v))
        out = distributed.attention(ql, kl, vl, causal=causal, backend=backend)
        out.backward(do[:, :, rows])
        torch.save({"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad},
                   os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(lengths, causal, backend, dtype):
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(len(lengths), init, lengths, causal, backend, dtype, tmp), nprocs=len(lengths))
        parts = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(len(lengths))]
    return {key: torch.cat([p[key] for p in parts], dim=2) for key in ("out", "dq", "dk", "dv")}


@pytest.mark.parametrize("lengths", [[5, 9], [4, 7, 6], [1, 12, 3]])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend,dtype,tol", [("reference", torch.float64, 1e-12), ("triton", torch.float32, 2e-6)])
def test_sharded_equals_one_process(lengths, causal, backend, dtype, tol):
    """Uneven shards over 2 and 3 ranks: every rank's output rows and its q/k/v gradients equal one
    process's attention over the whole sequence (reference backend in float64; the Triton kernels,
    under the interpreter on CPU, in float32)."""
    if backend == "triton" and not elsa_vision.dispatch.triton_serves("cpu"):
        pytest.skip("the Triton kernels serve CPU tensors only under TRITON_INTERPRET=1")
    got = _run(lengths, causal, backend, dtype)
    q, k, v, do = _full(sum(lengths), dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = elsa_vision.attention(q, k, v, causal=causal, backend=backend)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    for name, want in (("out", out.detach()), ("dq", dq), ("dk", dk), ("dv", dv)):
        torch.testing.assert_close(got[name], want, rtol=0, atol=tol, msg=name)


def test_needs_a_process_group():
    q = torch.randn(1, 1, 4, 8)
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.attention(q, q, q)
