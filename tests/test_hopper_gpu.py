"""GPU tests (``pytest -m gpu``) of the Hopper half-precision forward (kernels/hopper.py) against the
float64 oracle, forward and the portable backward run from its statistics. Skipped where the GPU
is not sm_90 or the Gluon path is off."""
import pytest
import torch

import elsa_vision
from elsa_vision import verify
from oracle_check import assert_close_to_oracle, check_case, torch_same_dtype

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    """Every supported call on the Gluon forward, whatever the measured dispatch policy says."""
    from elsa_vision.kernels import hopper
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and hopper.ENABLED):
        pytest.skip("the Gluon forward runs on sm_90 with its switch on")
    monkeypatch.setattr(hopper, "EVERYWHERE", True)
    return hopper


def qkv(B, H, nq, nk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, n, d, device="cuda", generator=g).to(dtype) for n in (nq, nk, nk)]


def served(q, k, v):
    from elsa_vision.kernels import hopper
    return hopper.supports(q, k, v, None, "native")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 197, 1041, 4097])
def test_forward_backward(n, d, causal, dtype):
    q, k, v = qkv(2, 3, n, n, d, dtype, seed=n + d)
    assert served(q, k, v)
    check_case(q, k, v, causal=causal, backend="triton", grads=n > 1, seed=n)


@pytest.mark.parametrize("nq,nk", [(300, 1000), (1000, 300), (129, 255), (1, 77), (64, 1)])
def test_cross_lengths_causal(nq, nk):
    """Bottom-right causal with Nq ≠ Nk: rows that see no key (Nq > Nk) return 0 with (+inf, 1)
    statistics, as on the portable path."""
    from elsa_vision.kernels import attention as K, hopper
    q, k, v = qkv(2, 4, nq, nk, 64, torch.bfloat16, seed=nq)
    out, stats = K.forward(q, k, v, None, 0.125, True, "native")
    hopper.ENABLED = False
    try:
        out_p, stats_p = K.forward(q, k, v, None, 0.125, True, "native")
    finally:
        hopper.ENABLED = True
    ref = verify.oracle(q.double(), k.double(), v.double(), causal=True, scale=0.125)
    same = torch_same_dtype(q, k, v, causal=True, scale=0.125)
    assert_close_to_oracle(out, ref.nan_to_num(0.0), same.nan_to_num(0.0))
    assert torch.equal(torch.isinf(stats[:, :, 0]), torch.isinf(stats_p[:, :, 0]))
    seen = torch.isfinite(stats_p[:, :, 0])
    lse = stats[:, :, 0][seen] + torch.log2(stats[:, :, 1][seen])
    lse_p = stats_p[:, :, 0][seen] + torch.log2(stats_p[:, :, 1][seen])
    torch.testing.assert_close(lse, lse_p, atol=1e-5, rtol=0)


def test_token_major_layout_read_in_place():
    """timm's packed qkv ([B, N, 3, H, D] permuted): strided q/k/v are read by TMA without a copy."""
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv_ = torch.randn(8, 197, 3, 12, 64, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = qkv_.permute(2, 0, 3, 1, 4).unbind(0)
    assert not q.is_contiguous() and served(q, k, v)
    check_case(q, k, v, backend="triton")


@pytest.mark.parametrize("d,causal", [(64, False), (128, False), (64, True)])
def test_long_rows_sampled(d, causal):
    q, k, v = qkv(1, 4, 16384, 16384, d, torch.bfloat16, seed=5)
    assert served(q, k, v)
    out = elsa_vision.attention(q, k, v, causal=causal, backend="triton")
    idx = torch.linspace(0, 16383, 64, device="cuda").long()
    qs = q[:, :, idx]
    mask = None
    if causal:  # sampled row i sees keys ≤ idx[i]: a boolean mask carries the diagonal
        mask = (torch.arange(16384, device="cuda")[None, :] <= idx[:, None])[None, None]
    ref = verify.oracle(qs, k, v, bias=mask)
    same = torch_same_dtype(qs, k, v, bias=mask)
    assert_close_to_oracle(out[:, :, idx], ref, same)


def test_deterministic():
    """Bitwise the same output and statistics on repeated calls (no atomics, a fixed schedule)."""
    from elsa_vision.kernels import attention as K
    q, k, v = qkv(4, 8, 2048, 2048, 64, torch.bfloat16, seed=7)
    a = K.forward(q, k, v, None, 0.125, False, "native")
    b = K.forward(q, k, v, None, 0.125, False, "native")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_dispatch_policy(monkeypatch):
    """Without EVERYWHERE, the measured policy: D = 128 (causal from 2048 keys), D = 64 from 1024
    keys (causal from 4096); shorter rows stay on the portable forward."""
    from elsa_vision.kernels import hopper
    monkeypatch.setattr(hopper, "EVERYWHERE", False)
    for n, d, causal, want in [(577, 64, False, False), (1041, 64, False, True), (2048, 64, True, False),
                               (4096, 64, True, True), (197, 128, False, True), (1041, 128, True, False),
                               (2048, 128, True, True)]:
        q, k, v = qkv(1, 1, n, n, d, torch.bfloat16)
        assert hopper.serves(q, k, v, None, "native", causal) == want, (n, d, causal)
