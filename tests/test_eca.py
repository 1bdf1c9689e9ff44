"""The ECA backend (kernels/eca.py): its identities checked exactly, its multiply-add count, and
causal attention forward and backward under the float64-oracle rule."""
import pytest
import torch

import elsa_vision
from elsa_vision import dispatch
from elsa_vision.dispatch import NotSupportedError, Problem
from elsa_vision.kernels import eca
from oracle_check import check_case


def ints(*shape, seed=0):
    """Integer-valued float64: every product and sum below is exact, so identities compare with ==."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).double()


@pytest.mark.parametrize("L,d,depth", [(16, 8, 1), (64, 16, 1), (64, 16, 2), (256, 64, 3)])
def test_stage1_blocks_exact(L, d, depth):
    """Algorithm 1: every block S₁…S₁₀ of Mask(QKᵀ) equals the direct product, exactly."""
    q, k = ints(3, L, d, seed=1), ints(3, L, d, seed=2)
    s = eca.masked_product(q, k, depth, base=4)
    direct = (q @ k.transpose(-1, -2)).tril()
    for got, want in zip(eca._tri_blocks(s), eca._tri_blocks(direct)):
        assert torch.equal(got, want)
    assert torch.equal(s, direct)


@pytest.mark.parametrize("L,d,depth", [(16, 8, 1), (64, 16, 1), (64, 16, 2), (256, 64, 3)])
def test_stage2_blocks_exact(L, d, depth):
    """Algorithm 2: every block O₁…O₁₆ of P·V (P lower-triangular) equals the direct product, exactly;
    so do the upper-triangular product used by the backward."""
    p, v = ints(3, L, L, seed=3).tril(), ints(3, L, d, seed=4)
    o = eca.tri_product(p, v, depth, base=4)
    for got, want in zip(eca._blocks(o), eca._blocks(p @ v)):
        assert torch.equal(got, want)
    assert torch.equal(eca.upper_product(p, v, depth, base=4), p.transpose(-1, -2) @ v)


def test_identities_float64_random():
    """The same on float64 normal blocks: equal to the direct products to rounding."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 128, 32, generator=g, dtype=torch.float64) for _ in range(3))
    p = torch.randn(2, 128, 128, generator=g, dtype=torch.float64).tril()
    torch.testing.assert_close(eca.masked_product(q, k, 2, 8), (q @ k.transpose(-1, -2)).tril(), rtol=0, atol=1e-12)
    torch.testing.assert_close(eca.tri_product(p, v, 2, 8), p @ v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("stage", ["masked", "tri"])
def test_multiply_adds_one_level(stage):
    """One level: 24 full products of (L/4)×(d/4)×(L/4) and 10 half ones, each n(n+1)/2·k at row
    blocks of one — 29/64·L²d plus the half products' diagonals (5·L·d/16) — against the standard
    L(L+1)/2·d."""
    L, d = 256, 64
    n, k = L // 4, d // 4
    a, b = torch.randn(L, d), torch.randn(L, d)
    p = torch.randn(L, L).tril()
    with eca.count_multiply_adds() as c:
        eca.masked_product(a, b, 1, base=1) if stage == "masked" else eca.tri_product(p, b, 1, base=1)
    assert c[0] == 24 * n * n * k + 10 * n * (n + 1) // 2 * k
    assert c[0] == 29 * L * L * d // 64 + 5 * L * d // 16
    assert c[0] < L * (L + 1) // 2 * d


def test_multiply_adds_recursive():
    """Depth 3: ≤ 0.445·L²d per product (the limit is 4/9); each level's half products recurse."""
    L, d = 1024, 64
    a, b = torch.randn(L, d), torch.randn(L, d)
    with eca.count_multiply_adds() as c:
        eca.masked_product(a, b, 3, base=1)
    assert c[0] / (L * L * d) <= 0.445
    with eca.count_multiply_adds() as c2:
        eca.tri_product(torch.randn(L, L).tril(), b, 3, base=1)
    assert c2[0] == c[0]


@pytest.mark.parametrize("L,d", [(1, 8), (7, 5), (64, 16), (197, 30), (256, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_oracle(L, d, dtype):
    """Causal attention through backend="eca", forward and gradients, under the oracle rule; L and d
    not divisible by 4 take the zero padding."""
    g = torch.Generator().manual_seed(L + d)
    q, k, v = (torch.randn(2, 3, L, d, generator=g).to(dtype) for _ in range(3))
    check_case(q, k, v, causal=True, backend="eca", grads=L > 1, seed=L)


def test_attention_long_rows():
    """L = 4096, d = 64 in float32 (two levels of padding-free blocks), forward and gradients."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 1, 4096, 64, generator=g) for _ in range(3))
    check_case(q, k, v, causal=True, backend="eca")


@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_nonfinite_token_reaches_no_earlier_row(where, value):
    """An inf or NaN in the last token's q or k: the rows before it, which never see it, are the
    reference backend's (the identities' block sums once carried it into their logits)."""
    q, k, v = (torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    {"q": q, "k": k}[where][0, 0, 15, 0] = value
    got = elsa_vision.attention(q, k, v, causal=True, backend="eca")
    want = elsa_vision.attention(q, k, v, causal=True, backend="reference")
    assert torch.isfinite(got[:, :, :15]).all()
    assert (got[:, :, :15] - want[:, :, :15]).abs().max() < 1e-5


def test_one_large_token_leaves_the_other_rows_accurate():
    """The last token's q and k 10⁴ times the others': the logits' products take rows scaled to one
    range (scaled_masked_product), so the rows that never see that token keep plain float32's
    accuracy (their error once followed the large token's, 1e-3 at this size)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 64, 16, generator=g, dtype=torch.float64) for _ in range(3))
    q[..., 63, :] *= 1e4
    k[..., 63, :] *= 1e4
    exact = torch.softmax((q @ k.transpose(-1, -2) / 4).masked_fill(torch.ones(64, 64).triu(1).bool(), -float("inf")),
                          -1) @ v
    got = elsa_vision.attention(q.float(), k.float(), v.float(), causal=True, backend="eca")
    assert (got[..., :63, :].double() - exact[..., :63, :]).abs().max() < 2e-6


def test_bfloat16_computed_in_float32():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 100, 32, generator=g).bfloat16() for _ in range(3))
    check_case(q, k, v, causal=True, backend="eca")


def test_lse_and_its_gradient():
    """return_lse: the rows' natural log-sum-exp, and a loss through it differentiates like the oracle's."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 50, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, lse = elsa_vision.attention(q, k, v, causal=True, backend="eca", return_lse=True)
    s = (q @ k.transpose(-1, -2)) * 16 ** -0.5
    s = s.masked_fill(torch.ones(50, 50, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=0, atol=1e-6)
    ge = torch.autograd.grad((out.sum() + eca.attention(q, k, v, 0.25)[1].sum()), (q, k, v))
    ref = torch.softmax(s, -1) @ v
    gr = torch.autograd.grad(ref.sum() + torch.logsumexp(s, -1).sum(), (q, k, v))
    for a, b in zip(ge, gr):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kwargs,nk,reason", [
    ({}, 64, "causal attention only"),
    ({"causal": True, "bias": torch.zeros(64, 64)}, 64, "bias not supported"),
    ({"causal": True}, 80, "Nq == Nk"),
])
def test_refusals_say_why(kwargs, nk, reason):
    q = torch.randn(1, 1, 64, 16)
    k = v = torch.randn(1, 1, nk, 16)
    with pytest.raises(NotSupportedError, match=reason):
        elsa_vision.attention(q, k, v, backend="eca", **kwargs)


def test_auto_takes_eca_from_the_measured_threshold(monkeypatch):
    """``auto`` on the CPU (Triton not serving it) takes ECA only for causal calls from
    AUTO_MIN_KEYS keys; below, or with no threshold, the reference backend."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch.clear_memo()
    p = Problem(op="attention", device="cpu", dtype=torch.float32, head_dim=64, causal=True, keys=8192)
    monkeypatch.setattr(eca, "AUTO_MIN_KEYS", None)
    assert dispatch.select(p).name == "reference"
    monkeypatch.setattr(eca, "AUTO_MIN_KEYS", 4096)
    dispatch.clear_memo()
    assert dispatch.select(p).name == "eca"
    assert dispatch.select(p._replace(keys=1024)).name == "reference"
    assert dispatch.select(p._replace(causal=False)).name == "reference"
    dispatch.clear_memo()
