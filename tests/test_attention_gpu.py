"""GPU tests (``pytest -m gpu``): the Triton kernels at real sizes against the float64 oracle, and the
structure of the two-level scan (partition plan, phase 2 reading the summaries)."""
import pytest
import torch

import elsa_vision
from elsa_vision import verify
from oracle_check import assert_close_to_oracle, assert_graph_replay_matches_eager, check_case, torch_same_dtype

pytestmark = pytest.mark.gpu


def qkv(B, H, nq, nk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, n, d, device="cuda", generator=g).to(dtype) for n in (nq, nk, nk)]


@pytest.mark.parametrize("n", [197, 1041, 4096])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "ieee"), (torch.float32, "tf32x3"), (torch.float32, "fp16x3"),
                                             (torch.float32, "tf32"), (torch.bfloat16, "auto"), (torch.float16, "auto")])
def test_fwd_bwd_real_sizes(n, d, dtype, precision):
    check_case(*qkv(2, 4, n, n, d, dtype, seed=n + d), precision=precision, backend="triton")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_shape", [None, (8, 1500, 1500), (2, 1, 1500, 1500)])
def test_bias_causal_real_sizes(causal, bias_shape):
    q, k, v = qkv(2, 8, 1500, 1500, 64, torch.float32)
    bias = None if bias_shape is None else torch.randn(bias_shape, device="cuda")
    check_case(q, k, v, bias=bias, causal=causal, precision="tf32x3", backend="triton")


@pytest.mark.parametrize("causal", [False, True])
def test_strict_fp32_bias_long_rows(causal):
    """Strict float32 beyond 8K keys (the chunked scan by default) with a bias, causal or not."""
    q, k, v = qkv(1, 2, 10000, 10000, 64, torch.float32, seed=4)
    bias = torch.randn(2, 10000, 10000, device="cuda")
    check_case(q, k, v, bias=bias, causal=causal, precision="ieee", backend="triton")


@pytest.mark.parametrize("n", [16384, 65536])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "tf32x3"), (torch.float32, "ieee"), (torch.bfloat16, "auto")])
def test_forward_long_rows_sampled(n, dtype, precision):
    """Long sequences: the oracle on 64 sampled query rows against every key."""
    q, k, v = qkv(1, 4, n, n, 64, dtype, seed=1)
    out = elsa_vision.attention(q, k, v, precision=precision)
    idx = torch.linspace(0, n - 1, 64, device="cuda").long()
    qs = q[:, :, idx]
    ref = verify.oracle(qs, k, v)
    same = torch_same_dtype(qs, k, v)
    assert_close_to_oracle(out[:, :, idx], ref, same, rel_l2=2e-6 if dtype == torch.float32 else None)


@pytest.mark.parametrize("n", [16384, 65536])
@pytest.mark.parametrize("chunk", [1024, 4096])
def test_chunked_strict_fp32_long_rows(n, chunk):
    """The chunked scan (Config.chunk) with the uncompensated 64×64 strict-float32 tile: the 2e-6
    relative-L2 bound that the plain tile misses beyond 8K keys."""
    from elsa_vision.kernels import attention as K
    q, k, v = qkv(1, 4, n, n, 64, torch.float32, seed=2)
    out, _ = K.forward(q, k, v, None, 0.125, False, "ieee", 1, config=K.Config(64, 64, 4, 2, kahan=False, chunk=chunk))
    idx = torch.linspace(0, n - 1, 64, device="cuda").long()
    qs = q[:, :, idx]
    assert_close_to_oracle(out[:, :, idx], verify.oracle(qs, k, v), torch_same_dtype(qs, k, v), rel_l2=2e-6)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal,with_bias", [(False, False), (True, True)])
@pytest.mark.parametrize("magnitude", [(1.0, 1.0, 1.0), (1e-3, 30.0, 1e-6), (40.0, 1e-4, 1e5)])
def test_fp16x3_forward(d, causal, with_bias, magnitude):
    """The float16-split forward under the oracle rule (float32's, relative L2 ≤ 2e-6 included) at
    magnitudes far from float16's range (q, k, v scaled as given; the power-of-two scaling must
    bring each into range), on the default tile of each head dim, with partial tiles."""
    from elsa_vision.kernels import attention as K
    q, k, v = qkv(1, 8, 4097, 4097, d, torch.float32, seed=4)
    q, k, v = (t * m for t, m in zip((q, k, v), magnitude))
    bias = torch.randn(1, 8, 4097, 4097, device="cuda") if with_bias else None
    out, _ = K.forward(q, k, v, bias, d ** -0.5, causal, "fp16x3", 1)
    idx = torch.linspace(0, 4096, 64, device="cuda").long()
    if causal:  # rows idx of a causal problem: the full problem's references, sampled
        ref = verify.oracle(q, k, v, bias=bias, causal=True)[:, :, idx]
        same = torch_same_dtype(q, k, v, bias=bias, causal=True)[:, :, idx]
    else:
        qs, bs = q[:, :, idx], (bias[:, :, idx] if with_bias else None)
        ref, same = verify.oracle(qs, k, v, bias=bs), torch_same_dtype(qs, k, v, bias=bs)
    assert_close_to_oracle(out[:, :, idx], ref, same, rel_l2=2e-6)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal,with_bias", [(False, False), (True, True)])
@pytest.mark.parametrize("magnitude", [(1.0, 1.0, 1.0, 1.0), (1e-3, 30.0, 1e-6, 1e-8), (40.0, 1e-4, 1e5, 1e6)])
def test_fp16x3_backward(d, causal, with_bias, magnitude):
    """The float16-split backward (dq, dk, dv and, with the bias, its delta and dbias kernels)
    under the oracle rule at N = 4097, with q, k, v and dO (the fourth factor) far from float16's
    range, on the default tiles of each head dim."""
    q, k, v = qkv(1, 4, 4097, 4097, d, torch.float32, seed=5)
    q, k, v = (t * m for t, m in zip((q, k, v), magnitude))
    bias = torch.randn(1, 4, 4097, 4097, device="cuda") if with_bias else None
    # (each gradient at its own scale: |dk| ~ 1e-17 here would pass the rule's absolute 1e-6 as zeros)
    check_case(q, k, v, bias=bias, causal=causal, precision="fp16x3", backend="triton", do_scale=magnitude[3],
               unit_scale=True)


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "tf32x3"), (torch.float32, "fp16x3"),
                                             (torch.float32, "ieee"), (torch.bfloat16, "auto"), (torch.float16, "auto")])
@pytest.mark.parametrize("nq,nk", [(1, 131072), (16, 131072), (64, 100000), (1041, 104100)])
def test_few_queries_split(nq, nk, dtype, precision):
    """Split launches against the oracle: few queries (half precision: the few-query tile), a float32
    MMA grid split to fill its waves (1041 queries), and (float32) against one partition (ieee: the
    chunked scan; partitions longer than one uncompensated sum may fold get the compensated tile)."""
    q, k, v = qkv(1, 16, nq, nk, 64, dtype, seed=3)
    rep = verify.structure(q, k, v, precision=precision)
    if nq <= 64:
        assert rep["partitions"] > 1 and rep["two_pass"], rep
    if nq == 1041 and precision in ("tf32x3", "fp16x3") and torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert rep["partitions"] > 1, rep  # 144 programs on 132 SMs: a second wave of 12 unless split
    out = elsa_vision.attention(q, k, v, precision=precision)
    idx = torch.linspace(0, nq - 1, min(nq, 32), device="cuda").long()
    ref = verify.oracle(q[:, :, idx], k, v)
    if dtype != torch.float32:
        assert_close_to_oracle(out[:, :, idx], ref, torch_same_dtype(q[:, :, idx], k, v))
        return
    one = elsa_vision.attention(q, k, v, precision=precision, partitions=1)
    assert verify.max_err(out[:, :, idx], ref) < 2e-6
    assert verify.max_err(out, one) < 2e-6


def test_planned_launches_tell_dtypes_apart():
    """One shape in float32, bf16, fp16, then float32 again, each split and merged by phase 2: every
    dtype keeps its own planned launches (a float32 call's merge kernel, reused for a bf16 output of
    the same shape, once stored float32 values into it)."""
    q, k, v = qkv(1, 16, 16, 131072, 64, torch.float32, seed=4)
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float32):
        qq, kk, vv = q.to(dt), k.to(dt), v.to(dt)
        out = elsa_vision.attention(qq, kk, vv, precision="tf32x3" if dt == torch.float32 else "auto")
        ref = verify.oracle(qq, kk, vv)
        assert_close_to_oracle(out, ref, torch_same_dtype(qq, kk, vv), name=str(dt),
                               rel_l2=2e-6 if dt == torch.float32 else None)


def test_causal_split_and_cross_lengths():
    q, k, v = qkv(1, 8, 300, 5000, 64, torch.bfloat16, seed=5)
    check_case(q, k, v, causal=True, backend="triton", partitions=4)
    check_case(q, k, v, causal=True, backend="triton")


def test_deterministic_backward_gpu():
    q, k, v = qkv(2, 8, 3000, 3000, 64, torch.bfloat16, seed=7)
    bias = torch.randn(8, 3000, 3000, device="cuda")
    res = []
    for _ in range(2):
        ins = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        o = elsa_vision.attention(*ins[:3], bias=ins[3])
        o.backward(torch.ones_like(o))
        res.append([t.grad for t in ins])
    for a, b in zip(*res):
        assert torch.equal(a, b)


@pytest.mark.parametrize("nq,nk,dtype", [(197, 197, torch.float32), (2048, 2048, torch.bfloat16), (16, 60000, torch.bfloat16)],
                         ids=["vit-fp32", "bf16", "split"])
def test_cuda_graph_capture_gpu(nq, nk, dtype):
    """Forward + backward (with a bias gradient) captured once in a CUDA graph and replayed on new
    values in the same buffers: bitwise equal to eager calls; the split case covers phase 2."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 4, nq, nk, 64, dtype, seed=3))
    bias = torch.randn(4, nq, nk, device="cuda", requires_grad=True)
    go = torch.randn(q.shape, device="cuda", dtype=dtype)

    def step():
        o = elsa_vision.attention(q, k, v, bias=bias)
        return (o, *torch.autograd.grad(o, (q, k, v, bias), go))

    def refill():
        for t in (q, k, v, bias, go):
            t.copy_(torch.randn_like(t))

    assert_graph_replay_matches_eager(step, refill)


def test_compile_training_step_gpu():
    q, k, v = (t.requires_grad_() for t in qkv(2, 8, 1000, 1000, 64, torch.bfloat16))

    @torch.compile(fullgraph=True)
    def step(q, k, v):
        return elsa_vision.attention(q, k, v).float().square().mean()

    step(q, k, v).backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_peak_memory_linear():
    """No N×N tensor: forward+backward at N=32K allocates O(N) beyond the inputs."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 16, 32768, 32768, 64, torch.bfloat16))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = elsa_vision.attention(q, k, v)
    o.backward(torch.ones_like(o))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    io = q.numel() * q.element_size()
    assert extra < 8 * io, f"extra {extra / 2**20:.0f} MiB vs one input {io / 2**20:.0f} MiB"


@pytest.mark.parametrize("bias_seed", range(4))
@pytest.mark.parametrize("n", [49, 64, 144])
def test_large_logits_cosine_attention_gpu(n, bias_seed):
    """Swin v2 at its clamp: unit q/k times τ = 100 plus a bias, logits of ±100. (Before the
    logits were formed by an explicit FMA, one bias draw in ten failed the rule in strict float32:
    see test_backward_probabilities_are_the_forwards.)"""
    q, k, v = qkv(8, 4, n, n, 32, torch.float32, seed=n)
    q = torch.nn.functional.normalize(q, dim=-1)
    k = torch.nn.functional.normalize(k, dim=-1)
    g = torch.Generator(device="cuda").manual_seed(bias_seed)
    bias = 16 * torch.sigmoid(torch.randn(4, n, n, device="cuda", generator=g))
    check_case(q, k, v, bias=bias, scale=100.0, backend="triton", precision="ieee")
    check_case(q, k, v, bias=bias, scale=100.0, backend="triton", precision="tf32x3")


def _identity_read_back(call, q, k, n):
    """(P as the forward gives it, P as the backward recomputes it) of ``call(q, k, v)`` with n = d
    keys: the output for the identity as values, and the transposed dV for the identity as output
    gradient (the backward's dV = Pᵀ·dO)."""
    eye = torch.eye(n, device="cuda").expand(*q.shape[:2], n, n)
    forward = call(q, k, eye)
    v = torch.randn(*q.shape[:2], n, n, device="cuda", requires_grad=True)
    (dv,) = torch.autograd.grad(call(q, k, v), v, eye)
    return forward, dv.transpose(-1, -2)


@pytest.mark.parametrize("n", [32, 64], ids=["partial-tile", "full-tile"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_backward_probabilities_are_the_forwards(with_bias, n):
    """The backward recomputes the forward's P bitwise (strict float32, logits of ±100, the keys
    in one tile): with a bias, q·k·scale + b written as a product and a sum was contracted into one
    FMA in one kernel and not in another, P differed by an ulp of the logit, and dV's error reached
    4.6× PyTorch's (kernels/common.py, fma). (Under the interpreter the forward's division by S
    rounds apart from the backward's product with 1/S: a GPU test.) n = d keys: one forward key
    tile, masked or full (the contraction differed in the full one)."""
    q, k, _ = qkv(2, 4, n, n, n, torch.float32, seed=5)
    q = torch.nn.functional.normalize(q, dim=-1)
    k = torch.nn.functional.normalize(k, dim=-1)
    g = torch.Generator(device="cuda").manual_seed(6)
    bias = 16 * torch.sigmoid(torch.randn(4, n, n, device="cuda", generator=g)) if with_bias else None
    forward, backward = _identity_read_back(
        lambda q, k, v: elsa_vision.attention(q, k, v, bias=bias, scale=100.0, backend="triton", precision="ieee"),
        q, k, n)
    assert torch.equal(forward, backward)


@pytest.mark.parametrize("n", [32, 64])
def test_window_backward_probabilities_are_the_forwards(n):
    """As test_backward_probabilities_are_the_forwards for the window kernels (strict float32,
    bias and shift mask, windows of n = d tokens): every kernel of the family forms the logits
    with one FMA, whether it holds the bias tile or loads it. (The kernels before that passed it
    too: a guard.)"""
    nW = 2
    q, k, _ = qkv(2 * nW, 3, n, n, n, torch.float32, seed=7)
    q = torch.nn.functional.normalize(q, dim=-1)
    k = torch.nn.functional.normalize(k, dim=-1)
    g = torch.Generator(device="cuda").manual_seed(8)
    bias = 16 * torch.sigmoid(torch.randn(3, n, n, device="cuda", generator=g))
    mask = torch.zeros(nW, n, n, device="cuda").masked_fill_(torch.rand(nW, n, n, device="cuda", generator=g) < 0.3,
                                                          -100.0)
    forward, backward = _identity_read_back(
        lambda q, k, v: elsa_vision.window_attention(q, k, v, bias=bias, mask=mask, scale=100.0, precision="ieee"),
        q, k, n)
    assert torch.equal(forward, backward)
