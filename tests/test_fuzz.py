"""Property-based shape fuzzing: random shapes, head dims, bias forms, causal and partitions, all
against the float64 oracle (Triton kernels in the interpreter on CPU, real kernels on GPU)."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from oracle_check import check_case


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 3))
    nq = draw(st.integers(1, 48))
    nk = draw(st.integers(1, 48))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    if dtype != torch.float32:
        # With a handful of keys a half-precision output is one or two roundings, and the max over
        # so few values makes "≤ 2× PyTorch's error" a coin toss (seen at Nk = 2: 2.3×). The
        # backward's delta also comes from the rounded output (as FlashAttention's does).
        nk = max(nk, 16)
    d = draw(st.sampled_from([16, 24, 32, 40, 64, 80]))
    # (causal rows see as few as one key: the same coin toss for half precision, which is covered
    # causally at real sizes by the GPU tests)
    causal = draw(st.booleans()) and dtype == torch.float32
    form = draw(st.sampled_from([None, "nk", "nq_nk", "h_nq_nk", "b_1_nq_nk", "b_h_1_nk"]))
    shape = {None: None, "nk": (nk,), "nq_nk": (nq, nk), "h_nq_nk": (H, nq, nk), "b_1_nq_nk": (B, 1, nq, nk),
             "b_h_1_nk": (B, H, 1, nk)}[form]
    partitions = draw(st.sampled_from([None, 1, 2, 5]))
    precision = draw(st.sampled_from(["ieee", "tf32x3", "auto"]))
    seed = draw(st.integers(0, 2**16))
    return B, H, nq, nk, d, causal, shape, partitions, dtype, precision, seed


# derandomize: every run draws the same examples (a CI failure is reproducible, not a coin toss);
# set derandomize=False to explore others
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(problems())
def test_fuzz_against_oracle(prob):
    _check_problem(prob)


# Found by the fuzzer: strict float32 dK with a bias gradient, causal, Nq < Nk — within the bound on
# the GPU, and in the interpreter since the kernels take their float scalars as float32 (as the GPU
# does) instead of computing with the interpreter's float64 Python floats.
def test_fuzz_found_dk_with_bias_grad():
    _check_problem((1, 1, 24, 46, 32, True, (24, 46), None, torch.float32, "ieee", 3338))


def _check_problem(prob):
    B, H, nq, nk, d, causal, bshape, partitions, dtype, precision, seed = prob
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g).to(DEVICE, dtype) for n in (nq, nk, nk))
    bias = None if bshape is None else torch.randn(bshape, generator=g).to(DEVICE)
    # Gradients only where every row sees a key (a fully masked row has no meaningful same-dtype
    # reference).
    grads = not (causal and nq > nk)
    # With one key the softmax is constant: the true dq, dk and dbias are exactly 0, PyTorch's
    # softmax backward returns exact zeros, and the kernels' values are rounding noise of
    # dP − delta (|dP| ~ 10) that the rule's 1e-6 absolute slack cannot resolve.
    grads = grads and nk > 1
    check_case(q, k, v, bias=bias, causal=causal, precision=precision, backend="triton", partitions=partitions,
               grads=grads, seed=seed)
