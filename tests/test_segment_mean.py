"""kernels/segment_mean.py: token merging's merge (each merged row the mean of its tokens) against
merging.merge_mean's torch path — bitwise on the CPU interpreter in float32/float64 (the same
summation order and a correctly rounded quotient; the interpreter's bfloat16 casts truncate, so one
bfloat16 ulp there), within one rounding of the float64 mean on a GPU."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from elsa_vision.adapters.vggt import merging as M
from elsa_vision.kernels import segment_mean as KS


def _same_on_cpu(got, want):
    """Bitwise, except one ulp for bfloat16 (the interpreter truncates its float32 → bfloat16 casts)."""
    ulp = 2.0 ** -7 * want.double().abs() if got.dtype == torch.bfloat16 else 0.0
    assert ((got.double() - want.double()).abs() <= ulp).all()


def _plan(B, N, nm, seed):
    """A random plan: N tokens into nm merged rows, every row with at least one token."""
    g = torch.Generator().manual_seed(seed)
    slot = torch.cat([torch.arange(nm).expand(B, nm), torch.randint(0, nm, (B, N - nm), generator=g)], dim=1)
    slot = torch.stack([s[torch.randperm(N, generator=g)] for s in slot]).to(DEVICE)
    counts = torch.zeros(B, nm, device=DEVICE).scatter_add_(1, slot, torch.ones(B, N, device=DEVICE))
    return M.MergePlan(slot, counts, N, nm, torch.arange(nm, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("B,N,nm,H,D", [(2, 50, 20, 3, 8), (1, 9, 1, 2, 6), (3, 33, 33, 1, 16)])
def test_segment_mean_is_the_merge(B, N, nm, H, D, dtype):
    plan = _plan(B, N, nm, seed=N + nm)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(B, H, N, D, generator=g) * 3).to(dtype).to(DEVICE).transpose(1, 2)  # [B, N, H, D], strided
    order, offsets = KS.segments(plan.slot, plan.counts)
    assert (plan.slot.gather(1, order.long()).diff(dim=1) >= 0).all()  # sorted by merged row …
    same_row = plan.slot.gather(1, order.long()).diff(dim=1) == 0
    assert (order.diff(dim=1)[same_row] > 0).all()                      # … tokens ascending within one
    got = KS.segment_mean(x, order, offsets)
    assert got.shape == (B, nm, H, D) and got.dtype == dtype and got.is_contiguous()
    if DEVICE == "cpu":
        _same_on_cpu(got, M.merge_mean(x, plan))
    else:
        want = torch.zeros(B, nm, H, D, dtype=torch.float64, device=DEVICE)
        size = torch.zeros_like(want)  # the mean of |x|: what the sum's rounding errors scale with
        for b in range(B):
            want[b].index_add_(0, plan.slot[b], x[b].double())
            size[b].index_add_(0, plan.slot[b], x[b].double().abs())
        count = plan.counts.double()[:, :, None, None]
        want, size = want / count, size / count
        acc_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
        # one rounding to the dtype, plus (count − 1) float32 (float64) additions and the division
        bound = torch.finfo(dtype).eps / 2 * want.abs() + count * acc_eps * size
        assert ((got.double() - want).abs() <= bound).all()
        assert torch.equal(got, KS.segment_mean(x, order, offsets))  # deterministic


def test_merge_mean_takes_the_kernel_with_segments():
    """merge_mean runs the kernel when the plan carries segments and equals the torch path then."""
    plan = _plan(2, 40, 15, seed=3)
    x = torch.randn(2, 40, 2, 8, device=DEVICE).to(torch.bfloat16)
    with_segments = M.MergePlan(plan.slot, plan.counts, 40, 15, plan.destinations,
                                segments=KS.segments(plan.slot, plan.counts))
    got, want = M.merge_mean(x, with_segments), M.merge_mean(x, plan)
    if DEVICE == "cpu":
        _same_on_cpu(got, want)
    else:  # (the CUDA torch path sums in its sort's order: one bfloat16 rounding apart at most)
        assert ((got.double() - want.double()).abs() <= 2.0 ** -7 * want.double().abs()).all()


def test_segment_mean_rejects_what_it_cannot_serve():
    plan = _plan(1, 10, 4, seed=1)
    order, offsets = KS.segments(plan.slot, plan.counts)
    with pytest.raises(ValueError, match=r"x \[B, N, H, D\]"):
        KS.segment_mean(torch.randn(1, 10, 8, device=DEVICE), order, offsets)
    with pytest.raises(ValueError, match="do not fit"):
        KS.segment_mean(torch.randn(1, 11, 2, 4, device=DEVICE), order, offsets)


def test_index_layouts_and_bad_inputs():
    """order and offsets of any layout give the contiguous ones' result bit for bit; an integer x
    and a 1-D offsets are refused with what is wrong."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 10, 2, 4, generator=g).to(DEVICE)
    order = torch.stack([torch.randperm(10, generator=g) for _ in range(2)]).to(DEVICE)
    offsets = torch.tensor([[0, 3, 7, 10], [0, 1, 5, 10]], device=DEVICE)
    want = KS.segment_mean(x, order, offsets)
    got = KS.segment_mean(x, order.T.contiguous().T, offsets.T.contiguous().T)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="floating-point"):
        KS.segment_mean(x.int(), order, offsets)
    with pytest.raises(ValueError, match="offsets"):
        KS.segment_mean(x, order, offsets[0])


def test_merge_mean_with_derivatives_takes_the_torch_path():
    """The kernel has no derivative: merge_mean of a tensor that wants a gradient (or carries a
    forward-AD tangent) takes PyTorch's ops, whose gradient and tangent are the merge's own, and
    segment_mean itself refuses such a tensor."""
    import torch.autograd.forward_ad as fwAD
    plan = _plan(2, 30, 11, seed=4)
    with_segments = M.MergePlan(plan.slot, plan.counts, 30, 11, plan.destinations,
                                segments=KS.segments(plan.slot, plan.counts))
    x = torch.randn(2, 30, 2, 4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 11, 2, 4, device=DEVICE, dtype=torch.float64)
    (M.merge_mean(x, with_segments) * w).sum().backward()
    want = (w / plan.counts.double()[:, :, None, None]).gather(
        1, plan.slot[:, :, None, None].expand(2, 30, 2, 4))  # d/dx of Σ w·mean: w / count of x's row
    assert torch.allclose(x.grad, want)
    with pytest.raises(ValueError, match="no backward"):
        KS.segment_mean(x, *with_segments.segments)
    t = torch.randn(2, 30, 2, 4, device=DEVICE, dtype=torch.float64)
    with fwAD.dual_level(), torch.no_grad():
        dual = fwAD.make_dual(x.detach(), t)
        tangent = fwAD.unpack_dual(M.merge_mean(dual, with_segments)).tangent
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            KS.segment_mean(dual, *with_segments.segments)
    assert tangent is not None and torch.allclose(tangent, M.merge_mean(t, plan))
