"""elsa_vision.attention against the float64 oracle: Triton kernels (interpreter on CPU) and the
reference backend; forward and backward; every bias form; causal; partitions; errors; compile."""
import pytest
import torch

import elsa_vision
from elsa_vision import BackendFallbackWarning, NotSupportedError, verify
from oracle_check import DropGradient, assert_close_to_oracle, assert_fake_matches_real, check_case, torch_same_dtype

from conftest import DEVICE

BACKENDS = ["triton", "reference"]


def rand(*shape, dtype=torch.float32, seed=0, device=DEVICE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def qkv(B, H, Nq, Nk, D, dtype=torch.float32, seed=0):
    return rand(B, H, Nq, D, dtype=dtype, seed=seed), rand(B, H, Nk, D, dtype=dtype, seed=seed + 1), \
        rand(B, H, Nk, D, dtype=dtype, seed=seed + 2)


# ------------------------------------------------------------------ forward, shapes and precisions

@pytest.mark.parametrize("nq,nk", [(1, 1), (7, 7), (64, 64), (197, 197), (257, 257), (300, 331), (16, 100), (100, 16)])
@pytest.mark.parametrize("d", [32, 64, 80])
def test_forward_shapes(nq, nk, d):
    prec = ["ieee", "tf32x3", "tf32", "fp16x3"][(nq + d) % 4]
    check_case(*qkv(1, 2, nq, nk, d, seed=nq + d), precision=prec, backend="triton", grads=False)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3", "tf32", "auto"])
def test_precisions(precision):
    check_case(*qkv(2, 2, 50, 70, 64), precision=precision, backend="triton", grads=False)


@pytest.mark.parametrize("magnitude", [(1e-3, 30.0, 1e-6), (1e4, 1e-5, 1e20), (1e-12, 1e-12, 1e-30)])
def test_fp16x3_magnitudes(magnitude):
    """fp16x3 scales each head's q, k, v by powers of two into float16's range: inputs far outside
    it (and a head of zeros) keep float32 accuracy. The interpreter runs the real split."""
    q, k, v = (t * m for t, m in zip(qkv(2, 2, 50, 70, 64, seed=5), magnitude))
    v[1, 0] = 0.0
    check_case(q, k, v, precision="fp16x3", backend="triton", grads=False)


@pytest.mark.parametrize("magnitude", [(1e-3, 30.0, 1e-6, 1e-8), (1e4, 1e-5, 1e15, 1e6), (1e-8, 1e-8, 1e-10, 1e-10),
                                       (1.0, 1.0, 1e-24, 1e-4)])
def test_fp16x3_backward_magnitudes(magnitude):
    """fp16x3's backward scales q, k, v and dO (the fourth factor) per head and dS per row: gradients
    of inputs far outside float16's range keep float32 accuracy. Each gradient is compared after
    division by its oracle's largest magnitude (the rule's absolute 1e-6 would pass any gradient of
    tiny inputs). The interpreter runs the real split."""
    from elsa_vision import verify
    from oracle_check import assert_close_to_oracle, torch_same_dtype
    q, k, v = (t * m for t, m in zip(qkv(2, 2, 50, 70, 64, seed=6), magnitude))
    v[1, 0] = 0.0
    do = rand(2, 2, 50, 64, seed=9) * magnitude[3]
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(elsa_vision.attention(*ins, precision="fp16x3", backend="triton"), ins, do)
    ins = [t.double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(verify.oracle(*ins), ins, do.double())
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    same = torch.autograd.grad(torch_same_dtype(*ins), ins, do)
    for name, g, r, s in zip(("dq", "dk", "dv"), got, ref, same):
        m = r.abs().max()
        assert m > 1e-30, name
        assert_close_to_oracle(g / m.float(), r / m, s / m.float(), name=name, grad=True)


def test_fp16x3_outlier_feature():
    """v's scales are per feature column: one feature 1e9 times larger than the rest leaves the other
    output columns float32-accurate (a per-head scale would give them absolute errors of ~2⁻³⁸·1e9)."""
    from elsa_vision import verify
    q, k, v = qkv(1, 2, 40, 70, 32, seed=9)
    v[..., 0] *= 1e9
    out = elsa_vision.attention(q, k, v, precision="fp16x3", backend="triton")
    ref = verify.oracle(q, k, v)
    rest = (out[..., 1:].double() - ref[..., 1:]).abs().amax() / ref[..., 1:].abs().amax()
    assert rest < 1e-6, rest
    assert (out[..., 0].double() - ref[..., 0]).abs().amax() / ref[..., 0].abs().amax() < 1e-6


@pytest.mark.parametrize("where", ["q", "k", "v", "dO"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_fp16x3_nonfinite_element_spares_the_rest_of_its_head(where, value):
    """An inf or NaN element leaves the fp16x3 scales to the head's finite elements: rows (and, for
    v, output columns) that never meet it stay float32-accurate. Its head's scale once came from
    the non-finite maximum (the lowest power of two), every other float16 part of the head
    underflowed to zero, and the other rows were silently plain averages of v. The rows that meet
    it are inf or NaN, not a finite number."""
    from elsa_vision import verify
    q, k, v = qkv(1, 2, 24, 40, 32, seed=13)
    do = rand(1, 2, 24, 32, seed=14)
    t = {"q": q, "k": k, "v": v, "dO": do}[where]
    t[0, 0, 3, 5] = value
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out = elsa_vision.attention(*ins, precision="fp16x3", backend="triton")
    grads = torch.autograd.grad(out, ins, do)
    refs = [x.double().requires_grad_() for x in (q, k, v)]
    ref = verify.oracle(*refs)
    ref_grads = torch.autograd.grad(ref, refs, do.double())
    # what never meets the element: head 1 everywhere; in head 0, rows other than 3 (q, dO), the
    # output columns other than 5 (v); a key's inf reaches every row of its head
    assert torch.isfinite(out[0, 1]).all()
    assert (out[0, 1].double() - ref[0, 1]).abs().max() < 1e-5
    for g, r in zip(grads, ref_grads):
        assert (g[0, 1].double() - r[0, 1]).abs().max() < 1e-4
    if where == "q":
        rest = [i for i in range(24) if i != 3]
        assert (out[0, 0, rest].double() - ref[0, 0, rest]).abs().max() < 1e-5
        assert not torch.isfinite(out[0, 0, 3]).all()
    elif where == "v":
        cols = [i for i in range(32) if i != 5]
        assert (out[0, 0, :, cols].double() - ref[0, 0, :, cols]).abs().max() < 1e-5
        assert not torch.isfinite(out[0, 0, :, 5]).any()
    elif where == "dO":
        assert (out[0, 0].double() - ref[0, 0]).abs().max() < 1e-5
        rest = [i for i in range(24) if i != 3]
        assert (grads[0][0, 0, rest].double() - ref_grads[0][0, 0, rest]).abs().max() < 1e-4
    else:
        assert not torch.isfinite(out[0, 0]).all(dim=-1).any()


@pytest.mark.parametrize("backward", [False, True])
def test_fp16x3_scales_in_chunks(backward, monkeypatch):
    """fp16x3's head scales (attention._f16_scales) with each tensor's rows cut into chunks (a pass of
    column maxima, then one that makes the scales) are those of one program per tensor, bit for bit:
    the largest |x·c| of q, k, dO per head and of v per column (per head in the backward) in
    [2^13, 2^14); with Nq ≠ Nk, strided q, an outlier column of v."""
    from elsa_vision.kernels import attention as K
    B, H, Nq, Nk, D = 2, 3, 37, 150, 64
    g = torch.Generator(device=DEVICE).manual_seed(5)
    q = torch.randn(B, Nq, H, D, generator=g, device=DEVICE).transpose(1, 2) * 1e-3
    k = torch.randn(B, H, Nk, D, generator=g, device=DEVICE) * 30
    v = torch.randn(B, H, Nk, D, generator=g, device=DEVICE)
    v[1, 2, 140, 7] = 5e5  # (in the last chunk)
    do = torch.randn(B, H, Nq, D, generator=g, device=DEVICE) if backward else None
    chunked = K._f16_scales(q, k, v, do)
    monkeypatch.setattr(K, "_scale_chunks", lambda *args: 1)
    assert torch.equal(chunked, K._f16_scales(q, k, v, do))
    c = chunked.view(B, H, -1).double()
    tops = [(q.double().abs().amax((2, 3)) * c[..., 0]), (k.double().abs().amax((2, 3)) * c[..., 1])]
    if backward:
        tops += [v.double().abs().amax((2, 3)) * c[..., 2], do.double().abs().amax((2, 3)) * c[..., 3]]
    else:
        tops.append(v.double().abs().amax(2) * c[..., 2:])
    for top in tops:
        assert ((top >= 2 ** 13) & (top < 2 ** 14)).all()


@pytest.mark.parametrize("magnitude", [(1.0, 1.0, 1.0), (1e-3, 30.0, 1e-6), (1e4, 1e-12, 1e20)])
def test_fp16x3_split_pass(magnitude):
    """The Gluon forward's fp16x3 operands (kernels/hopper.split, a plain Triton kernel): for q, k
    (one scale per head) and v (one per feature column), strided inputs included, the float16
    parts are split_f16's (hi the nearest float16 of x·c at row r, lo that of the rest at row N + r),
    hold x·c to its bound, |hi + lo − x·c| ≤ 2⁻²²·|x·c| + 2⁻²⁵, with the largest |x·c| of a head
    (column) in [2^13, 2^14)."""
    hopper = pytest.importorskip("elsa_vision.kernels.hopper")
    from elsa_vision.kernels import attention as K
    B, H, Nq, Nk, D = 2, 3, 37, 70, 64
    g = torch.Generator(device=DEVICE).manual_seed(3)
    q = torch.randn(B, Nq, H, D, generator=g, device=DEVICE).transpose(1, 2) * magnitude[0]
    k = torch.randn(B, H, Nk, D, generator=g, device=DEVICE) * magnitude[1]
    v = torch.randn(B, H, Nk, D, generator=g, device=DEVICE) * magnitude[2]
    v[0, 1, :, 5] *= 1e6  # an outlier column keeps its own scale
    scales = K._f16_scales(q, k, v).view(B, H, 2 + D)
    parts = hopper.split(q, k, v, scales.view(B * H, -1))
    for x, p, c, dims in ((q, parts[0], scales[..., :1, None], (2, 3)), (k, parts[1], scales[..., 1:2, None], (2, 3)),
                          (v, parts[2], scales[..., None, 2:], (2,))):
        n = x.shape[2]
        assert p.dtype == torch.float16 and p.shape == (B, H, 2 * n, D)
        hi = (x * c).half()
        assert torch.equal(p[:, :, :n], hi) and torch.equal(p[:, :, n:], (x * c - hi.float()).half())
        xc = x.double() * c.double()
        top = xc.abs().amax(dim=dims)
        assert ((top >= 2 ** 13) & (top < 2 ** 14)).all()
        err = (p[:, :, :n].double() + p[:, :, n:].double() - xc).abs()
        assert (err <= 2 ** -22 * xc.abs() + 2 ** -25).all(), err.max()


@pytest.mark.parametrize("magnitude", [(1.0, 1.0, 1.0, 1.0), (1e-3, 30.0, 1e-6, 1e-8)])
def test_fp16x3_backward_split_pass(magnitude):
    """The Gluon backward's fp16x3 operands and row statistics (kernels/hopper._bwd_split, a plain
    Triton kernel), strided inputs included: q, k, v, dO split at their head scales as split_f16
    does (hi at row r, lo at row N + r); q once more with both parts times w_i (common.dk_units,
    exact powers of two); the planes m, delta = rowsum(dO∘O)·c_dO·c_v, 1/S, f (common.ds_units), u,
    and rows from Nq to the padded length (+inf, 0, 0, 1, 0)."""
    hopper = pytest.importorskip("elsa_vision.kernels.hopper")
    from elsa_vision.kernels import attention as K
    B, H, Nq, Nk, D, nqp = 2, 3, 37, 70, 64, 64
    g = torch.Generator(device=DEVICE).manual_seed(4)
    q = torch.randn(B, Nq, H, D, generator=g, device=DEVICE).transpose(1, 2) * magnitude[0]
    k = torch.randn(B, H, Nk, D, generator=g, device=DEVICE) * magnitude[1]
    v = torch.randn(B, H, Nk, D, generator=g, device=DEVICE) * magnitude[2]
    do = torch.randn(B, H, Nq, D, generator=g, device=DEVICE) * magnitude[3]
    out = torch.randn(B, Nq, H, D, generator=g, device=DEVICE).transpose(1, 2)
    m = torch.randn(B, H, Nq, generator=g, device=DEVICE) * 10
    s_sum = torch.rand(B, H, Nq, generator=g, device=DEVICE) * 3000 + 1
    stats = torch.stack([m, s_sum], 2).contiguous()
    scales = K._f16_scales(q, k, v, do)
    rows = torch.empty(5, B * H, nqp, device=DEVICE)
    qp, q2p, dop, kp, vp = hopper._bwd_split(do, q, k, v, out, stats, scales, rows)
    c = scales.view(B, H, 4, 1, 1)
    for x, p, cx in ((q, qp, c[:, :, 0]), (k, kp, c[:, :, 1]), (v, vp, c[:, :, 2]), (do, dop, c[:, :, 3])):
        n = x.shape[2]
        assert p.dtype == torch.float16 and p.shape == (B, H, 2 * n, D)
        hi = (x * cx).half()
        assert torch.equal(p[:, :, :n], hi) and torch.equal(p[:, :, n:], (x * cx - hi.float()).half())
    planes = rows.view(5, B, H, nqp)
    # r = 1/S as the kernel formed it: exactly PyTorch's under the interpreter, within 2 ulp on a GPU
    # (Triton's float32 division there is div.full.f32); the units below are checked bitwise from it
    r, exact = planes[2, :, :, :Nq], 1.0 / s_sum
    assert torch.equal(r, exact) if DEVICE == "cpu" else ((r - exact).abs() <= 2 ** -22 * exact).all()
    t = torch.exp2(torch.clamp(-torch.floor(torch.log2(r)), max=10))  # (dk_units' t_i ≈ S_i)
    w = (1.0 / t).half()[..., None]
    assert torch.equal(q2p[:, :, :Nq], qp[:, :, :Nq] * w) and torch.equal(q2p[:, :, Nq:], qp[:, :, Nq:] * w)
    units = c[:, :, 3, 0] * c[:, :, 2, 0]
    delta = (out.double() * do.double()).sum(-1) * units  # (float32 sums: to D·2⁻²⁴ of Σ|o·dO|)
    bound = D * 2 ** -24 * (out.double() * do.double()).abs().sum(-1) * units
    assert ((planes[1, :, :, :Nq].double() - delta).abs() <= bound).all()
    f = torch.exp2(-torch.floor(torch.log2(r)) - 16) / D
    for i, x in ((0, m), (2, r), (3, f), (4, t * 2.0 ** -16 / D)):
        assert torch.equal(planes[i, :, :, :Nq], x), i
    pad = planes[:, :, :, Nq:]
    assert (pad[0] == float("inf")).all() and (pad[1] == 0).all() and (pad[2] == 0).all()
    assert (pad[3] == 1).all() and (pad[4] == 0).all()


@pytest.mark.parametrize("B,H,per", [(1, 16, 5), (3, 5, 2), (3, 5, 10), (3, 5, 15), (4, 2, 7), (2, 3, 100),
                                     (100, 16, 335), (1, 11, 4), (31, 12, 341)])
def test_fp16x3_split_chunks_cover_once(B, H, per):
    """The Gluon fp16x3 forward's chunks of batch·heads (hopper._chunks): every (b, h) exactly once,
    at most ``per`` in a chunk, each chunk whole batch elements or heads of one element, as few
    chunks as that allows, of at most two sizes."""
    hopper = pytest.importorskip("elsa_vision.kernels.hopper")
    seen = torch.zeros(B, H, dtype=torch.int64)
    shapes = set()
    n_chunks = 0
    for bs, hs in hopper._chunks(B, H, per):
        n_chunks += 1
        part = seen[bs, hs]
        assert part.numel() <= per and (part.shape[0] == 1 or part.shape[1] == H)
        shapes.add(tuple(part.shape))
        seen[bs, hs] += 1
    assert (seen == 1).all() and len(shapes) <= 2
    if per >= B * H:
        assert n_chunks == 1
    elif per >= H:
        assert n_chunks == -(-B // (per // H))  # whole elements, as many as fit
    else:
        assert n_chunks == B * -(-H // per)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nq,nk,d", [(7, 7, 32), (197, 197, 64), (33, 90, 80)])
def test_half(dtype, nq, nk, d):
    out = check_case(*qkv(1, 2, nq, nk, d, dtype=dtype), backend="triton", grads=False)
    assert out.dtype == dtype


@pytest.mark.parametrize("d", [16, 48, 96, 128])
def test_head_dims(d):
    check_case(*qkv(1, 1, 20, 40, d), precision="ieee", backend="triton", grads=False)


def test_reference_backend_forward():
    for nq, nk, d in [(1, 1, 8), (197, 197, 64), (300, 1500, 32)]:
        check_case(*qkv(2, 2, nq, nk, d), backend="reference", grads=False)


# ------------------------------------------------------------------ bias, causal, partitions

BIAS_SHAPES = {
    "nq_nk": lambda B, H, nq, nk: (nq, nk),
    "h_nq_nk": lambda B, H, nq, nk: (H, nq, nk),
    "b_1_nq_nk": lambda B, H, nq, nk: (B, 1, nq, nk),
    "b_1_1_nk": lambda B, H, nq, nk: (B, 1, 1, nk),
    "full": lambda B, H, nq, nk: (B, H, nq, nk),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", list(BIAS_SHAPES))
def test_bias_forms_with_grad(backend, form):
    B, H, nq, nk = 2, 2, 37, 45
    bias = rand(*BIAS_SHAPES[form](B, H, nq, nk), seed=9)
    check_case(*qkv(B, H, nq, nk, 32), bias=bias, backend=backend, precision="ieee")


def test_bool_mask_and_expanded_bias():
    B, H, nq, nk = 2, 2, 20, 33
    keep = rand(B, 1, nq, nk, seed=3) > -0.5
    check_case(*qkv(B, H, nq, nk, 32), bias=keep, backend="triton", grads=False)
    # a stride-0 expanded bias is read through its strides and gets the right (summed) gradient
    base = rand(1, H, nq, nk, seed=4)
    check_case(*qkv(B, H, nq, nk, 32), bias=base.expand(B, H, nq, nk), backend="triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nq,nk", [(40, 40), (23, 57), (57, 23), (1, 30)])
def test_causal(backend, nq, nk):
    check_case(*qkv(1, 2, nq, nk, 32), causal=True, backend=backend, grads=nq <= nk)


@pytest.mark.parametrize("partitions", [1, 2, 3, 7])
def test_partitions(partitions):
    q, k, v = qkv(1, 2, 9, 200, 64)
    out = check_case(q, k, v, backend="triton", partitions=partitions, grads=False)
    base = elsa_vision.attention(q, k, v, backend="triton", partitions=1)
    assert verify.max_err(out, base) < 2e-6


def test_partitions_causal_bias():
    q, k, v = qkv(2, 2, 30, 150, 32)
    bias = rand(2, 30, 150, seed=5)
    check_case(q, k, v, bias=bias, causal=True, backend="triton", partitions=4)


@pytest.mark.parametrize("nq", [1, 16, 40])
def test_few_query_tiles(nq):
    """The few-query tile (a KV-cache step) on the split path, bf16, against the oracle rule."""
    from elsa_vision.kernels import attention as K
    from elsa_vision.kernels import tiles
    q, k, v = qkv(1, 2, nq, 300, 64, dtype=torch.bfloat16)
    out, _ = K.forward(q, k, v, None, 0.125, False, "native", 3, config=tiles.FEWQ)
    ref = verify.oracle(q.double(), k.double(), v.double(), scale=0.125)
    assert_close_to_oracle(out, ref, torch_same_dtype(q, k, v, scale=0.125))


def test_partition_plan_balances_waves(monkeypatch):
    """balance_waves splits a long-key grid whose last wave is mostly empty, and nothing else."""
    from elsa_vision.kernels import tiles
    monkeypatch.setattr(tiles, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)  # only its type and index are read
    # 1041 queries × 16 heads in 128-row tiles: 144 programs on 132 SMs, a second wave of 12
    assert tiles.plan_partitions(16, 1041, 416400, 128, 64, dev)[0] == 1
    n_part, part_len = tiles.plan_partitions(16, 1041, 416400, 128, 64, dev, balance_waves=True)
    programs = 144 * n_part
    assert 1 < n_part <= 8 and programs / (-(-programs // 132) * 132) >= tiles.WAVE_FILL
    assert n_part * part_len >= 416400 > (n_part - 1) * part_len
    # short key sets and grids that already fill their waves stay whole
    assert tiles.plan_partitions(16, 1041, 1041, 128, 64, dev, balance_waves=True)[0] == 1
    assert tiles.plan_partitions(16, 16384, 16384, 128, 64, dev, balance_waves=True)[0] == 1


def test_fully_masked_rows_return_zero():
    B, H, nq, nk = 1, 2, 12, 40
    q, k, v = qkv(B, H, nq, nk, 32)
    bias = torch.zeros(B, H, nq, nk, device=DEVICE)
    bias[:, :, 3] = float("-inf")
    for backend in BACKENDS:
        for parts in ([None, 3] if backend == "triton" else [None]):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = elsa_vision.attention(qq, kk, vv, bias=bias, backend=backend, partitions=parts)
            assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
            assert torch.isfinite(out).all()
            out.sum().backward()
            assert all(torch.isfinite(t.grad).all() for t in (qq, kk, vv))
    # causal with Nq > Nk: the first rows see no key
    q2 = rand(1, 1, 20, 32, seed=11)
    out = elsa_vision.attention(q2, k[:, :1, :5], v[:, :1, :5], causal=True, backend="triton")
    assert torch.equal(out[:, :, :15], torch.zeros_like(out[:, :, :15]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_masked_by_a_finite_fill(dtype):
    """A bias that masks with a large finite fill (``masked_fill(~keep, -1e9)``): a row it masks
    everywhere has m ≈ −1e9, where float32's spacing is 64. Its backward must still recompute
    P = 1/N per key (the forward's uniform row), which a log-sum-exp folded into one float32 would
    round to P = 1: gradients N× too large in half precision. That row's query is zero, so its
    logits are −1e9 exactly and the oracle's row is uniform too (with q·k added, float64 would see
    the softmax of q·k under the fill, which no float32 logit holds). Rows masked in part, too."""
    q, k, v = qkv(1, 2, 24, 40, 32, seed=41)
    q[:, :, 3] = 0.0
    q, k, v = (t.to(dtype) for t in (q, k, v))
    bias = torch.zeros(1, 2, 24, 40, device=DEVICE)
    bias[:, :, 3] = -1e9                      # masked everywhere
    bias[:, :, 5, 7:] = -1e9                  # masked but for 7 keys
    bias[:, 1, 11, ::2] = -1e9                # every other key
    for precision, parts in ((("auto", None),) if dtype != torch.float32 else (("ieee", None), ("ieee", 3),
                                                                             ("fp16x3", None))):
        check_case(q, k, v, bias=bias, backend="triton", precision=precision, partitions=parts)


def test_empty_keys():
    q, k, v = qkv(1, 2, 5, 0, 32)
    out = elsa_vision.attention(q, k, v)
    assert out.shape == (1, 2, 5, 32) and not out.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_or_heads(backend):
    """No batch element or no head: an empty output (and gradients), not a launch of no programs."""
    for B, H in ((0, 2), (2, 0)):
        q, k, v = (t.requires_grad_() for t in qkv(B, H, 5, 7, 32))
        out, lse = elsa_vision.attention(q, k, v, backend=backend, return_lse=True)
        out.sum().backward()
        assert out.shape == (B, H, 5, 32) and lse.shape == (B, H, 5) and q.grad.shape == q.shape
    packed = rand(0, 5, 3, 2, 32).requires_grad_()
    elsa_vision.attention_packed(packed, backend=backend).sum().backward()
    assert packed.grad.shape == packed.shape


# ------------------------------------------------------------------ backward

@pytest.mark.parametrize("nq,nk,d", [(1, 1, 32), (7, 7, 64), (197, 197, 64), (257, 100, 32), (50, 257, 80)])
def test_backward_shapes(nq, nk, d):
    check_case(*qkv(1, 2, nq, nk, d, seed=nq), precision="ieee", backend="triton")


@pytest.mark.parametrize("precision", ["tf32x3", "fp16x3", "tf32"])
def test_backward_precisions(precision):
    check_case(*qkv(2, 2, 40, 60, 64), precision=precision, backend="triton", bias=rand(2, 40, 60, seed=2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_half(dtype):
    check_case(*qkv(1, 2, 70, 50, 64, dtype=dtype), backend="triton", bias=rand(2, 70, 50, seed=2).to(dtype))


def test_backward_deterministic():
    q, k, v = qkv(2, 2, 45, 77, 32)
    bias = rand(2, 45, 77, seed=1)
    grads = []
    for _ in range(2):
        ins = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = elsa_vision.attention(*ins[:3], bias=ins[3], causal=True, backend="triton")
        out.backward(torch.ones_like(out))
        grads.append([t.grad for t in ins])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_reference_gradcheck_float64():
    q, k, v = (t.double().requires_grad_() for t in qkv(1, 2, 6, 9, 8))
    bias = rand(2, 6, 9, seed=3).double().requires_grad_()

    def f(q, k, v, bias):
        return elsa_vision.attention(q, k, v, bias=bias, causal=True, backend="reference")
    assert torch.autograd.gradcheck(f, (q, k, v, bias))


def test_double_backward_raises():
    q, k, v = (t.requires_grad_() for t in qkv(1, 1, 8, 8, 32))
    out = elsa_vision.attention(q, k, v, backend="triton")
    with pytest.raises(RuntimeError, match="double backward"):
        (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        g.sum().backward()


def test_bias_without_grad_gets_none():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 8, 8, 32))
    bias = rand(2, 8, 8)
    elsa_vision.attention(q, k, v, bias=bias, backend="triton").sum().backward()
    assert bias.grad is None and q.grad is not None


@pytest.mark.parametrize("packed", [False, True])
def test_eager_backward_fills_no_statistics_gradient(packed):
    """The eager autograd Function's second output (the row statistics [B, H, 2, N], float32) takes
    no gradient: its backward gets none, rather than a zero tensor autograd would allocate and fill
    at every backward; the gradients are those of the custom ops' path, bitwise."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from elsa_vision.kernels import attention as K

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default,
                        torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default):
                self.shapes.append(tuple(out.shape))
            return out

    B, H, N, D = 2, 3, 40, 16
    x = rand(B, N, 3, H, D).requires_grad_() if packed else None
    q, k, v = (x.permute(2, 0, 3, 1, 4).unbind(0) if packed else
               (t.requires_grad_() for t in qkv(B, H, N, N, D, seed=4)))
    leaves = [x] if packed else [q, k, v]
    op, inputs = (K.PACKED, (x,)) if packed else (K.OP, (q, k, v))
    out, stats = op.function.apply(*inputs, None, D ** -0.5, False, "ieee", 0)
    assert not stats.requires_grad
    do = rand(*out.shape, seed=7)
    with Made() as made:
        grads = torch.autograd.grad(out, leaves, do)
    assert (B, H, 2, N) not in made.shapes
    out2, _ = op.fwd(*inputs, None, D ** -0.5, False, "ieee", 0)
    assert torch.equal(out, out2)
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(out2, leaves, do)))


def test_eager_backward_without_an_output_gradient():
    """A graph through the output that brings it no gradient (None: a later Function's backward
    returned none) gives the inputs none through attention, where a zero gradient used to be filled
    and run through the kernels."""
    from elsa_vision.kernels import attention as K

    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 8, 8, 16, seed=2))
    out, _ = K.OP.function.apply(q, k, v, None, 0.25, False, "ieee", 0)
    dq, dk = torch.autograd.grad((DropGradient.apply(out) + q.sum()).sum(), (q, k), allow_unused=True)
    assert torch.equal(dq, torch.full_like(q, out.numel())) and dk is None  # (q.sum() broadcast over out)


# ------------------------------------------------------------------ layouts, autocast, compile

def test_non_contiguous_inputs():
    B, N, H, D = 2, 33, 3, 32
    x = rand(B, N, 3, H, D)
    q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)  # timm's qkv layout: strided views
    assert not q.is_contiguous()
    check_case(q, k, v, backend="triton", precision="ieee")


def test_autocast_follows_sdpa():
    q, k, v = qkv(1, 2, 16, 16, 32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = elsa_vision.attention(q, k, v)
    assert out.dtype == torch.bfloat16


def test_autocast_repeat_casts_k_and_v_too(monkeypatch):
    """A q already in the autocast dtype beside float32 k and v: the repeat of the call (which may
    skip the checks) still hands the backend all three in the autocast dtype, as the first call."""
    from elsa_vision import api, dispatch
    seen = []
    for op in ("attention", "window_attention", "shifted_window_attention"):
        def spy(q, k, v, *args, _run=dispatch.TRITON.run[op], **kw):
            seen.append(tuple(t.dtype for t in (q, k, v)))
            return _run(q, k, v, *args, **kw)
        monkeypatch.setitem(dispatch.TRITON.run, op, spy)
    calls = [(lambda q, k, v: elsa_vision.attention(q, k, v, backend="triton"), (1, 2, 8, 16)),
             (lambda q, k, v: elsa_vision.window_attention(q, k, v, backend="triton"), (4, 2, 16, 16)),
             (lambda q, k, v: elsa_vision.shifted_window_attention(q, k, v, window_size=2, shift_size=1,
                                                                   backend="triton"), (1, 4, 4, 2, 16))]
    for call, shape in calls:
        api._CALLS.clear()
        seen.clear()
        q = torch.randn(*shape, device=DEVICE).bfloat16()
        k, v = (torch.randn(*shape, device=DEVICE) for _ in range(2))
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            first, repeat = call(q, k, v), call(q, k, v)
        assert seen == [(torch.bfloat16,) * 3] * 2
        assert torch.equal(first, repeat)


def test_repeated_shifted_window_calls_are_kept_packed_or_not():
    """A repeat of a shifted_window_attention call reuses the checks' decisions (kept), packed qkv
    as well as separate q, k, v."""
    from elsa_vision import api
    qkv = torch.randn(1, 4, 4, 3, 2, 16, device=DEVICE)
    for args in ((qkv,), tuple(qkv.unbind(3))):
        api._CALLS.clear()
        for _ in range(2):
            elsa_vision.shifted_window_attention(*args, window_size=2, shift_size=1, backend="triton")
        assert len(api._CALLS) == 1, len(args)


def test_autocast_leaves_float64_alone():
    """Autocast casts no float64 tensor (SDPA's float64 call stays float64 under it): neither do the
    public functions, which once ran float64 inputs in bfloat16."""
    q, k, v = (t.double() for t in qkv(1, 2, 16, 16, 32))
    exact = verify.oracle(q, k, v)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        outs = [elsa_vision.attention(q, k, v), elsa_vision.window_attention(q, k, v),
                elsa_vision.attention_packed(torch.stack((q, k, v), 2).transpose(1, 3))]
    assert sdpa.dtype == torch.float64
    for out in outs:
        assert out.dtype == torch.float64
        assert (out - exact).abs().max() < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_keeps_bool_mask_and_checks_int_bias(backend):
    """Under autocast only floating tensors are cast: a bool keep-mask still masks, an integer
    bias is still refused (as outside autocast)."""
    q, k, v = qkv(1, 2, 16, 16, 32)
    keep = torch.rand(16, 16, generator=torch.Generator().manual_seed(1)) > 0.5
    keep[:, 0] = True
    keep = keep.to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        masked = elsa_vision.attention(q, k, v, bias=keep, backend=backend)
        additive = elsa_vision.attention(q, k, v, bias=torch.zeros(16, 16, device=DEVICE).masked_fill(~keep, float("-inf")),
                                         backend=backend)
        with pytest.raises(TypeError, match="floating point"):
            elsa_vision.attention(q, k, v, bias=keep.int(), backend=backend)
    assert torch.equal(masked, additive)


def test_lse_of_a_nan_row_is_nan_on_every_backend():
    """A NaN in a row's logits (from q or the bias): the row's output and its lse are NaN on the
    Triton backend as on the reference one; other rows unchanged; +inf stays the lse of a row that
    sees no key."""
    q, k, v = qkv(1, 1, 4, 4, 16)
    bias = torch.zeros(1, 1, 4, 4, device=q.device)
    bias[0, 0, 1, 2] = float("nan")
    bias[0, 0, 3] = float("-inf")
    qn = q.clone()
    qn[0, 0, 2, 3] = float("nan")
    for a, b in ((q, bias), (qn, None)):
        got = [elsa_vision.attention(a, k, v, bias=b, return_lse=True, backend=be) for be in ("triton", "reference")]
        (o1, l1), (o2, l2) = got
        assert torch.equal(l1.isnan(), l2.isnan()) and torch.equal(o1.isnan(), o2.isnan())
        assert l1.isnan().any() and torch.allclose(l1[~l1.isnan()], l2[~l2.isnan()], rtol=1e-5, atol=1e-6)
    _, lse = elsa_vision.attention(q, k, v, bias=bias, return_lse=True, backend="triton")
    assert lse[0, 0, 3] == float("inf")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_rows_stay_nan(backend):
    """A NaN input gives NaN in its row on every backend (not 0, which is for rows with no visible key)."""
    q, k, v = qkv(1, 1, 5, 7, 16 if backend == "reference" else 32)
    q[0, 0, 1, 0] = float("nan")
    out = elsa_vision.attention(q, k, v, backend=backend)
    assert out[0, 0, 1].isnan().all() and not out[0, 0, [0, 2, 3, 4]].isnan().any()


def test_torch_compile_fullgraph():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 24, 24, 32))
    bias = rand(2, 24, 24)

    def step(q, k, v):
        return elsa_vision.attention(q, k, v, bias=bias, causal=True).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    step(q2, k2, v2).backward()
    assert torch.allclose(q.grad, q2.grad, atol=1e-6)


# ------------------------------------------------------------------ dispatch and input checks

def test_dispatch_explains_refusals():
    q, k, v = qkv(1, 1, 8, 8, 32, dtype=torch.float64)
    with pytest.raises(NotSupportedError, match=r"triton: .*dtype torch.float64"):
        elsa_vision.attention(q, k, v, backend="triton")
    out = elsa_vision.attention(q, k, v)  # auto falls back to the reference backend
    assert out.dtype == torch.float64
    q, k, v = qkv(1, 1, 8, 8, 8)
    with pytest.raises(NotSupportedError, match=r"head dim 8 outside \[16, 256\]"):
        elsa_vision.attention(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        elsa_vision.attention(q, k, v, backend="flash")


def test_dispatch_memo_follows_the_interpreter_flag_and_never_hides_a_refusal(monkeypatch):
    from elsa_vision import dispatch
    p = dispatch.Problem(op="attention", device="cpu", dtype=torch.float32, head_dim=32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.select(p).name == "triton" and dispatch.select(p).name == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the Triton backend no longer serves CPU tensors
    assert dispatch.select(p).name == "reference"
    for _ in range(2):
        with pytest.raises(NotSupportedError, match="device 'cpu' not supported"):
            dispatch.select(p, "triton")
    with pytest.raises(ValueError, match="unknown backend"):
        dispatch.select(p, "flash")


def test_hopper_kernels_off_under_an_unchecked_triton_are_said_once(monkeypatch):
    """On an sm_90 GPU, an attention call of a kind the Hopper kernels serve, while they are off
    because the installed Triton is not a checked version, warns once (BackendFallbackWarning);
    not for calls they would not serve, not off Hopper, not with ELSA_HOPPER=0, not under a
    checked Triton. (Problems on the "cuda" device type select without a GPU: no tensor.)"""
    import warnings
    from elsa_vision import dispatch
    from elsa_vision.kernels import launch

    def said(p, capability=(9, 0), checked=False, env="1"):
        monkeypatch.setattr(dispatch, "_WARNED", set())
        monkeypatch.setattr(dispatch, "_CHOSEN", {})
        monkeypatch.setattr(dispatch, "_cuda_capability", lambda: capability)
        monkeypatch.setattr(launch, "CHECKED", checked)
        monkeypatch.setenv("ELSA_HOPPER", env)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                dispatch.clear_memo()
                assert dispatch.select(p).name == "triton"
        return [str(w.message) for w in caught if issubclass(w.category, BackendFallbackWarning)]

    half = dispatch.Problem(op="attention", device="cuda", dtype=torch.bfloat16, head_dim=64, precision="native")
    msgs = said(half)
    assert len(msgs) == 1 and "Hopper kernels cannot run here" in msgs[0] and "ELSA_HOPPER=0" in msgs[0]
    assert len(said(half._replace(dtype=torch.float32, precision="fp16x3"))) == 1
    for quiet in (half._replace(head_dim=32), half._replace(has_bias=True), half._replace(op="window_attention"),
                  half._replace(dtype=torch.float32, precision="tf32"),
                  half._replace(dtype=torch.float32, precision="fp16x3", head_dim=128)):
        assert said(quiet) == [], quiet
    assert said(half, capability=(8, 0)) == []
    assert said(half, checked=True) == []
    assert said(half, env="0") == []


def test_repeated_calls_keep_their_checks():
    """A repeated attention call skips the checks it passed before (api._CALLS), but never a
    refusal: arguments that hash alike (1, 1.0, True) are told apart by type, and calls whose
    inputs the checks convert (a bool or lower-dim bias, an autocast cast) are checked every time."""
    from elsa_vision import api
    api._CALLS.clear()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=g) for _ in range(3))
    kw = dict(backend="reference")
    first = elsa_vision.attention(q, k, v, scale=1, causal=True, partitions=1, **kw)
    assert torch.equal(elsa_vision.attention(q, k, v, scale=1, causal=True, partitions=1, **kw), first)
    assert len(api._CALLS) == 1
    for bad, err, msg in (({"scale": True}, TypeError, "scale must be a Python number"),
                          ({"causal": 1}, TypeError, "causal must be True or False"),
                          ({"partitions": True}, ValueError, "partitions")):
        for _ in range(2):
            with pytest.raises(err, match=msg):
                elsa_vision.attention(q, k, v, **{"scale": 1, "causal": True, "partitions": 1, **bad}, **kw)
    with pytest.raises(TypeError, match="share a dtype"):
        elsa_vision.attention(q, k.double(), v, scale=1, causal=True, partitions=1, **kw)
    b2 = torch.randn(8, 8, generator=g)
    for _ in range(2):  # a [Nq, Nk] bias is viewed as 4-D on every call: not kept
        assert torch.equal(elsa_vision.attention(q, k, v, bias=b2, **kw), elsa_vision.attention(q, k, v, bias=b2[None, None], **kw))
    keep = b2 > 0
    for _ in range(2):
        assert torch.equal(elsa_vision.attention(q, k, v, bias=keep, **kw),
                           elsa_vision.attention(q, k, v, bias=torch.where(keep, 0.0, float("-inf"))[None, None], **kw))
    assert len(api._CALLS) == 2  # the first call and the 4-D bias
    out, lse = elsa_vision.attention(q, k, v, return_lse=True, **kw)
    out2, lse2 = elsa_vision.attention(q, k, v, return_lse=True, **kw)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    qg = q.clone().requires_grad_()
    for _ in range(2):  # who wants a gradient is part of the signature
        elsa_vision.attention(qg, k, v, **kw).sum().backward()
        assert qg.grad is not None and qg.grad.abs().sum() > 0
        qg.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            assert elsa_vision.attention(q, k, v, **kw).dtype == torch.bfloat16


@pytest.mark.parametrize("bias_shape", [None, (1, 2, 37, 45), (2, 1, 1, 45)])
def test_custom_ops_fake_matches_real(bias_shape):
    """What torch.compile plans from the attention ops' fakes is what they return (a bias broadcast
    along queries gets its gradient summed over them)."""
    from elsa_vision.kernels import attention as K
    q = torch.randn(2, 2, 37, 16, device=DEVICE)
    k, v = torch.randn(2, 2, 45, 16, device=DEVICE), torch.randn(2, 2, 45, 16, device=DEVICE)
    bias = None if bias_shape is None else torch.randn(bias_shape, device=DEVICE)
    args = (q, k, v, bias, 0.25, False, "ieee", 0)
    assert_fake_matches_real(torch.ops.elsa_vision.attention_fwd.default, *args)
    out, stats = K.attention_fwd(*args)
    assert_fake_matches_real(torch.ops.elsa_vision.attention_bwd.default, torch.randn_like(out), q, k, v, bias, out,
                             stats, 0.25, False, "ieee", bias is not None)


@pytest.mark.parametrize("dtype,causal,with_bias", [(torch.float32, False, False), (torch.float32, True, True),
                                                     (torch.bfloat16, False, True)])
def test_packed_call_is_the_view_call(dtype, causal, with_bias):
    """attention_packed(qkv) gives what attention() gives on qkv's q, k, v views, bitwise (the same
    kernels at the same strides), and qkv's gradient as one contiguous tensor holding the three
    gradients; within the oracle rule of the float64 reference."""
    B, N, H, D = 2, 45, 2, 32
    packed = rand(B, N, 3, H, D, dtype=dtype).requires_grad_()
    views = packed.detach().clone().requires_grad_()
    bias = rand(H, N, N, seed=5).requires_grad_() if with_bias else None
    kw = dict(bias=bias, causal=causal)
    out = elsa_vision.attention_packed(packed, **kw)
    ref = elsa_vision.attention(*views.permute(2, 0, 3, 1, 4).unbind(0), **kw)
    do = rand(*out.shape, dtype=dtype, seed=9)
    grads = torch.autograd.grad(out, [packed] + ([bias] if with_bias else []), do)
    ref_grads = torch.autograd.grad(ref, [views] + ([bias] if with_bias else []), do)
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert grads[0].shape == packed.shape and grads[0].is_contiguous()
    p64 = packed.detach().double().requires_grad_()
    oracle = elsa_vision.attention_packed(p64, causal=causal, backend="reference",
                                          bias=None if bias is None else bias.detach().double())
    (oracle_grad,) = torch.autograd.grad(oracle, p64, do.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert verify.max_err(out, oracle) <= tol
    assert verify.max_err(grads[0], oracle_grad) <= 2 * tol * max(1.0, oracle_grad.abs().max().item())


@pytest.mark.parametrize("backend", [*BACKENDS, "eca"])
def test_repeated_packed_call_is_the_first(backend):
    """A repeated packed call goes straight to the backend chosen for its signature, which then gets
    qkv alone (no q, k, v views): the same output and gradient as the first call, on every backend."""
    causal = backend == "eca"  # (ECA runs causal CPU calls only)
    if backend == "eca" and DEVICE != "cpu":
        pytest.skip("ECA is a CPU backend")
    results = []
    for _ in range(3):
        packed = rand(2, 19, 3, 2, 16).requires_grad_()
        out = elsa_vision.attention_packed(packed, causal=causal, backend=backend)
        (grad,) = torch.autograd.grad(out, packed, rand(*out.shape, seed=4))
        results.append((out.detach(), grad))
    assert all(torch.equal(o, results[0][0]) and torch.equal(g, results[0][1]) for o, g in results[1:])


def test_packed_custom_ops_fake_matches_real():
    """The packed ops' fakes: what compile plans is what they return (qkv's gradient in qkv's shape)."""
    from elsa_vision.kernels import attention as K
    qkv = torch.randn(2, 37, 3, 2, 16, device=DEVICE)
    bias = torch.randn(2, 1, 1, 37, device=DEVICE)
    args = (qkv, bias, 0.25, True, "ieee", 0)
    assert_fake_matches_real(torch.ops.elsa_vision.attention_packed_fwd.default, *args)
    out, stats = K.PACKED.fwd(*args)
    assert_fake_matches_real(torch.ops.elsa_vision.attention_packed_bwd.default, torch.randn_like(out), qkv, bias,
                             out, stats, 0.25, True, "ieee", True)


@pytest.mark.parametrize("make,err,msg", [
    (lambda: [1.0], TypeError, "qkv must be a torch.Tensor"),
    (lambda: torch.randn(2, 5, 2, 2, 16), ValueError, r"\[B, N, 3, H, D\]"),
    (lambda: torch.randn(2, 5, 3, 16), ValueError, r"reshape the projection output"),
])
def test_packed_input_errors(make, err, msg):
    with pytest.raises(err, match=msg):
        elsa_vision.attention_packed(make())


def test_inference_matches_the_autograd_path():
    """Without a gradient to record, the Triton launcher skips the autograd Function: same output."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 37, 16, generator=g).to(DEVICE) for _ in range(3))
    with torch.no_grad():
        a = elsa_vision.attention(q, k, v, backend="triton")
    b = elsa_vision.attention(q.requires_grad_(), k, v, backend="triton")
    assert b.requires_grad and torch.equal(a, b.detach())


@pytest.mark.parametrize("make,err,msg", [
    (lambda q, k, v: (q[0], k, v, {}), ValueError, "must be 4-D"),
    (lambda q, k, v: (q, k.half(), v, {}), TypeError, "share a dtype"),
    (lambda q, k, v: (q, k[:1], v, {}), ValueError, "batch and head dims differ"),
    (lambda q, k, v: (q, k, v[:, :, :3], {}), ValueError, "tokens but v has"),
    (lambda q, k, v: (q[..., :16], k, v, {}), ValueError, "head dims differ"),
    (lambda q, k, v: (q, k, v, {"bias": torch.zeros(3, 8, 8, device=q.device)}), ValueError, "does not broadcast"),
    (lambda q, k, v: (q, k, v, {"scale": float("nan")}), ValueError, "finite"),
    (lambda q, k, v: (q, k, v, {"precision": "fp64"}), ValueError, "precision must be one of"),
    (lambda q, k, v: (q, k, v, {"bias": torch.zeros(8, 8, dtype=torch.int32, device=q.device)}), TypeError,
     "floating point"),
    (lambda q, k, v: (q.int(), k.int(), v.int(), {}), TypeError, "not supported"),
    (lambda q, k, v: ("q", k, v, {}), TypeError, "torch.Tensor"),
    (lambda q, k, v: (None, k, v, {}), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: (q, k, v, {"return_lse": "no"}), TypeError, "return_lse must be True or False"),
    (lambda q, k, v: (q, k, v, {"partitions": 0}), ValueError, "partitions"),
    (lambda q, k, v: (q, k, v, {"partitions": True}), ValueError, "partitions"),
    (lambda q, k, v: (q, k, v, {"scale": True}), TypeError, "scale must be a Python number"),
    (lambda q, k, v: (q, k, v, {"scale": 10 ** 400}), ValueError, "finite"),
    (lambda q, k, v: (q, k, v, {"causal": "no"}), TypeError, "causal must be True or False"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0], {}), ValueError, "head dim is 0"),
    (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0], {"backend": "bogus"}), Exception, "bogus"),
    (lambda q, k, v: (q.double(), k[:, :, :0].double(), v[:, :, :0].double(), {"backend": "triton"}),
     Exception, "float64"),
    (lambda q, k, v: (q.to_sparse(), k, v, {}), TypeError, r"q is a torch.sparse_coo tensor.*to_dense\(\)"),
    (lambda q, k, v: (q, k, v, {"bias": torch.zeros(8, 8, device=q.device).to_sparse()}), TypeError,
     "bias is a torch.sparse_coo tensor"),
    (lambda q, k, v: (torch.nested.nested_tensor(list(q)), k, v, {}), TypeError, "q is a nested tensor.*to_padded"),
])
def test_input_errors(make, err, msg):
    q, k, v = qkv(2, 2, 8, 8, 32)
    a, b, c, kw = make(q, k, v)
    with pytest.raises(err, match=msg):
        elsa_vision.attention(a, b, c, **kw)


def test_head_dim_past_the_triton_limit():
    """The largest head dim is each backend's to declare: past Triton's 256, "auto" runs the
    reference backend (exactly), and asking for Triton says why not."""
    q, k, v = qkv(1, 1, 4, 4, 264)
    with pytest.raises(NotSupportedError, match=r"triton: head dim 264 outside \[16, 256\]"):
        elsa_vision.attention(q, k, v, backend="triton")
    out = elsa_vision.attention(q, k, v)
    assert torch.equal(out, elsa_vision.attention(q, k, v, backend="reference"))


# ------------------------------------------------------------------ verify tools

def test_drift_metrics():
    q, k, v = qkv(1, 2, 64, 64, 32)
    d = verify.drift(q, k, v, precision="ieee")
    assert set(d) >= {"p_max_abs", "p_rel_l2", "js_mean", "argmax_rate", "y_max_abs", "y_rel_l2"}
    assert d["argmax_rate"] == 0.0 and d["p_max_abs"] < 1e-5 and d["y_rel_l2"] < 2e-6
    d16 = verify.drift(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert 1e-4 < d16["y_max_abs"] < 5e-2  # bf16 drift is visible, and bounded


def test_structure_proof():
    # 480 keys: 15 tiles of 32 (interpreter) or 8 of 64, the last partial (GPU): four partitions either way
    q, k, v = qkv(1, 2, 16, 480, 64)
    rep = verify.structure(q, k, v, partitions=4)
    assert rep["partitions"] == 4 and rep["two_pass"] and rep["phase2_reads_summaries"]
    assert rep["summary_shapes"]["W"] == [2, 4, 16, 64]
    rep1 = verify.structure(q, k, v, partitions=1)
    assert rep1["partitions"] == 1 and not rep1["two_pass"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_bias_gradients(backend):
    """A bias of ±60 (logits far from 0): the backward recomputes P = 2^((s − m)·log2 e) / S from the
    saved (m, S); from a rounded lse it would carry ulp(lse) on every P, 3–4× PyTorch's error."""
    q, k, v = qkv(1, 2, 64, 64, 32, seed=31)
    check_case(q, k, v, bias=30 * rand(2, 64, 64, seed=32), backend=backend, precision="ieee")


@pytest.mark.parametrize("nq,nk,causal,bias_shape,chunk",
                         [(40, 300, False, None, 64), (70, 257, True, (2, 70, 257), 96), (5, 3, False, None, 32),
                          (33, 200, True, None, 32), (16, 130, False, (1, 1, 1, 130), 1000)])
def test_chunked_scan(nq, nk, causal, bias_shape, chunk):
    """Config.chunk: the interior key tiles folded a chunk at a time, chunks merged through Out (the
    two-level scan inside a program). Oracle rule, and the statistics equal the unchunked run's up
    to rounding; rows that see no key (causal, Nq > Nk) stay 0."""
    from elsa_vision.kernels import attention as K
    from oracle_check import assert_close_to_oracle, torch_same_dtype
    q, k, v = qkv(2, 2, nq, nk, 32, seed=nq + nk)
    bias = None if bias_shape is None else rand(*bias_shape, seed=5)
    if bias is not None and bias.dim() == 3:
        bias = bias[None]  # the launcher takes a 4-D bias (the API adds leading size-1 dims)
    plain = K.Config(32, 32, 1, 1, kahan=False)
    out, st = K.forward(q, k, v, bias, 32 ** -0.5, causal, "ieee", 1, config=K.Config(32, 32, 1, 1, kahan=False, chunk=chunk))
    out0, st0 = K.forward(q, k, v, bias, 32 ** -0.5, causal, "ieee", 1, config=plain)
    assert_close_to_oracle(out, verify.oracle(q, k, v, bias=bias, causal=causal),
                           torch_same_dtype(q, k, v, bias=bias, causal=causal))
    lse, lse0 = K.natural_lse(st, bias is not None), K.natural_lse(st0, bias is not None)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse0))
    assert verify.max_err(lse[torch.isfinite(lse)], lse0[torch.isfinite(lse0)]) < 1e-5
    if causal and nq > nk:
        assert not out[:, :, : nq - nk].any()


@pytest.mark.parametrize("precision", ["fp16x3", "tf32x3", "tf32"])
@pytest.mark.parametrize("nq,nk,causal,partitions", [(40, 300, False, 1), (7, 20, False, 1), (70, 70, True, 1),
                                                     (16, 257, False, 3), (5, 3, False, 1)])
def test_pipelined_forward_is_the_plain_loop(precision, nq, nk, causal, partitions):
    """Config.pipeline issues the next key tile's q·kᵀ before this tile's softmax: an instruction
    order, nothing else. Outputs and row statistics bitwise equal to the plain loop's, also for
    partitions and key ranges with one full tile or none."""
    from elsa_vision.kernels import attention as K
    q, k, v = qkv(2, 2, nq, nk, 64, seed=nq + nk)
    warps = 1 if K.INTERPRET else 4
    plain, piped = K.Config(32, 32, warps, 1), K.Config(32, 32, warps, 1, pipeline=True)
    out0, st0 = K.forward(q, k, v, None, 0.125, causal, precision, partitions, config=plain)
    out1, st1 = K.forward(q, k, v, None, 0.125, causal, precision, partitions, config=piped)
    assert torch.equal(out0, out1) and torch.equal(st0, st1)


@pytest.mark.parametrize("dtype,precision", [(torch.bfloat16, "native"), (torch.float32, "fp16x3"),
                                             (torch.float32, "tf32x3"), (torch.float32, "ieee")])
@pytest.mark.parametrize("causal,with_bias", [(False, False), (True, True)])
def test_early_dp_is_the_late_order(dtype, precision, causal, with_bias):
    """The dK/dV kernel's dPᵀ issued before or after the exponentials (early_dp_default): the same
    gradients, bitwise."""
    from elsa_vision.kernels import attention as K
    q, k, v = qkv(1, 2, 70, 70 if causal else 90, 64, dtype=dtype, seed=7)
    bias = rand(1, 2, 70, k.shape[2], seed=8) if with_bias else None
    out, st = K.forward(q, k, v, bias, 0.125, causal, precision)
    do = rand(*out.shape, dtype=dtype, seed=9)
    late = K.backward(do, q, k, v, bias, out, st, 0.125, causal, precision, with_bias, early_dp=False)
    early = K.backward(do, q, k, v, bias, out, st, 0.125, causal, precision, with_bias, early_dp=True)
    assert all(torch.equal(a, b) for a, b in zip(late, early) if a is not None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_cosine_attention(backend):
    """Swin v2 at its clamp: unit q/k times τ = 100 plus a bias gives logits of ±100, where a
    backward that recomputed P from a rounded log-sum-exp (ulp(100) ≈ 8e-6) would be 3–4× less
    accurate than PyTorch."""
    B, H, n, d = 2, 2, 49, 32
    q, k, v = qkv(B, H, n, n, d, seed=21)
    q = torch.nn.functional.normalize(q, dim=-1)
    k = torch.nn.functional.normalize(k, dim=-1)
    bias = 16 * torch.sigmoid(rand(H, n, n, seed=22))
    check_case(q, k, v, bias=bias, scale=100.0, backend=backend, precision="ieee")


@pytest.mark.parametrize("nq,nk,d,bshape,seed", [(23, 9, 80, (9,), 45887), (64, 40, 32, (2, 1, 1, 40), 3)])
def test_query_broadcast_bias_gradient(nq, nk, d, bshape, seed):
    """A bias broadcast along queries (a key-padding bias) sums dS down each key's column, where a
    per-row error of delta no longer cancels: float32 forms delta from P and dP then (with
    rowsum(dO ⊙ O) the first case came out at 5× PyTorch's error)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2 if len(bshape) == 4 else 1, 1, n, d, generator=g).to(DEVICE) for n in (nq, nk, nk))
    bias = torch.randn(bshape, generator=g).to(DEVICE)
    check_case(q, k, v, bias=bias, precision="ieee", backend="triton", seed=seed)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_batch_chunks_past_the_grid_limit(monkeypatch, backend):
    """More batch·heads than CUDA's grid axis holds (65535): the call runs in chunks of the batch,
    and each chunk's rows, lse and gradients are bitwise those of one call (the limit lowered to 4
    here: chunks of 2, 2 and 1 batch elements; a bias per batch element is sliced with them)."""
    import elsa_vision.api as api
    g = torch.Generator().manual_seed(0)
    dt = torch.float64 if backend == "reference" else torch.float32
    q, k, v = (torch.randn(5, 2, 19, 16, generator=g, dtype=dt).to(DEVICE) for _ in range(3))
    bias = torch.randn(5, 1, 19, 19, generator=g, dtype=dt).to(DEVICE)
    do = torch.randn(5, 2, 19, 16, generator=g, dtype=dt).to(DEVICE)

    def run():
        ins = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out, lse = elsa_vision.attention(*ins[:3], bias=ins[3], causal=True, return_lse=True, backend=backend,
                                         partitions=1 if backend == "triton" else None)
        return (out, lse, *torch.autograd.grad(out, ins, do))

    want = run()
    calls = []
    real = api._in_batch_chunks
    monkeypatch.setattr(api, "_in_batch_chunks", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(api, "MAX_GRID_YZ", 4)
    api.clear_caches()  # (the first call's decision is kept per signature, shapes included)
    got = run()
    assert calls, "the chunked path did not run"
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, want):
        assert torch.equal(a, b), name


def test_grid_past_cuda_limit_is_a_clear_error():
    from elsa_vision.kernels import launch
    launch.check_grid(test_grid_past_cuda_limit_is_a_clear_error, (7, 65535, 3))
    with pytest.raises(ValueError, match="65535 programs on its 2nd or 3rd axis"):
        launch.check_grid(test_grid_past_cuda_limit_is_a_clear_error, (1, 65536))


def test_launch_leading_arguments(monkeypatch):
    """A planned launch whose leading arguments mix tensors and descriptors of them (launch.Launch's
    ``leading``, the Gluon kernels' calls) passes Triton's own launch (the interpreter's, a
    profiler's) the call's tensors and descriptors made of them in the kernel's order, then the
    scalars; with launches skipped (a custom op's fake implementation) it launches nothing."""
    from elsa_vision.kernels import launch
    seen = []

    class Kernel:  # (what Triton's JITFunction offers a launch: fn[grid](*args, **meta))
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append((grid, args, meta))

    monkeypatch.setattr(launch, "tritons_own_path", lambda: True)
    describe = lambda t: ("descriptor", t.numel())  # noqa: E731
    a, b = torch.zeros(2), torch.ones(3)
    plan = launch.Launch(Kernel(), (4,), (7, 0.5), {"BLOCK": 16}, leading=((0, describe), 1, (1, describe), 0))
    plan(a, b)
    grid, args, meta = seen.pop()
    assert grid == (4, 1, 1) and meta == {"BLOCK": 16}
    assert args[0] == ("descriptor", 2) and args[1] is b and args[2] == ("descriptor", 3) and args[3] is a
    assert args[4:] == (7, 0.5)
    with launch.allocations_only():
        plan(a, b)
    assert not seen


def test_forward_mode_ad_is_refused_by_the_triton_kernels():
    """Dual tensors (torch.autograd.forward_ad, which runs under no_grad too): the Triton kernels
    compute no tangent, so every family's entry refuses the call instead of returning an output
    without one; the reference backend computes it."""
    import torch.autograd.forward_ad as fwAD
    from elsa_vision.kernels.residual import residual_norm
    from elsa_vision.kernels.rope import qk_norm_rope
    assert hasattr(fwAD, "_current_level")  # (ops.forward_ad_on's cheap test; without it every call unpacks)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 17, 16, device=DEVICE) for _ in range(3))
    tq = torch.randn_like(q)
    with fwAD.dual_level(), torch.no_grad():
        qd = fwAD.make_dual(q, tq)
        tangent = fwAD.unpack_dual(elsa_vision.attention(qd, k, v, backend="reference")).tangent
        assert tangent is not None and tangent.abs().max() > 0
        for call in (lambda: elsa_vision.attention(qd, k, v, backend="triton"),
                     lambda: elsa_vision.window_attention(qd, k, v, backend="triton"),
                     lambda: residual_norm(fwAD.make_dual(q, tq), q, None, torch.nn.LayerNorm(16).to(DEVICE)),
                     lambda: qk_norm_rope(fwAD.make_dual(torch.randn(1, 5, 64, device=DEVICE), torch.ones(1, 5, 64,
                                          device=DEVICE)), 2, (torch.empty(1, 5, 2, 16, device=DEVICE),))):
            with pytest.raises(NotImplementedError, match="forward-mode AD"):
                call()
        r, _ = residual_norm(fwAD.make_dual(q, tq), q)  # (the residual alone: PyTorch's ops, tangent kept)
        assert torch.equal(fwAD.unpack_dual(r).tangent, tq)
    assert elsa_vision.attention(q, k, v, backend="triton").shape == q.shape  # (no level open: served)


def test_entry_points_run_on_their_tensors_device(monkeypatch):
    """launch.on_device: an entry point whose first tensor is on a CUDA device other than the
    current one runs with that device current (launches take the current device's kernels and
    stream); on the current device, or off CUDA, it runs as it is. (CUDA faked: a CPU machine.)"""
    import contextlib
    from elsa_vision.kernels import attention as K, launch
    entered = []

    @contextlib.contextmanager
    def device(idx):
        entered.append(idx)
        yield
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0)
    seen = []
    entry = launch.on_device(lambda *args, **kwargs: seen.append(list(entered)) or "ran")
    t = torch.zeros(1)
    assert entry(None, t) == "ran" and entered == [] and seen == [[]]  # (CPU: as it is)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 1)
    assert entry(None, t, 3) == "ran" and entered == [1] and seen[-1] == [1]
    assert entry(None, None, qkv=t) == "ran" and entered == [1, 1]  # (a packed call's qkv by keyword)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    assert entry(t) == "ran" and entered == [1, 1]
    from elsa_vision.kernels import nearest, position_bias, residual, rope, segment_mean, window
    for fn in (K.attention, K.backward, window.window_attention, position_bias.continuous_position_bias,
               position_bias.relative_position_bias, residual.residual_norm, rope.qk_norm_rope, nearest.nearest,
               segment_mean.segment_mean):  # (each family's entry carries it)
        assert fn.__wrapped__ is not None


def test_launch_mode_is_per_thread():
    """A launch mode (a fake's allocations_only(), a trace's traceable()) holds for its own thread
    only: another thread's eager call meanwhile computes its output, and exits interleaved across
    threads leave no mode set."""
    import threading
    from elsa_vision.kernels import attention as K, launch
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 33, 16) for _ in range(3))
    from elsa_vision.kernels.reference import attention as reference
    want = reference(q, k, v, scale=0.25)

    def err():
        out, _ = K.OP.run(q, k, v, None, 0.25, False, "ieee", 0)
        return (out - want).abs().max().item()

    entered, release, errs = threading.Event(), threading.Event(), []

    def rehearse():
        with launch.allocations_only():
            entered.set()
            release.wait()
    held = threading.Thread(target=rehearse)
    held.start()
    entered.wait()
    other = threading.Thread(target=lambda: errs.append((launch.tracing(), err())))
    other.start()
    other.join()
    release.set()
    held.join()
    assert errs[0][0] is False and errs[0][1] < 1e-5
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with launch.allocations_only():
            first_in.set()
            second_in.wait()
        first_out.set()

    def second():
        first_in.wait()
        with launch.traceable():
            second_in.set()
            first_out.wait()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not launch.tracing() and err() < 1e-5


def test_tma_readable_layouts():
    """What the Hopper kernels read in place by TMA (the rest goes to the portable kernels, or, for
    dO, is copied first): unit last stride, 16-byte aligned strides, no broadcast dimension."""
    hopper = pytest.importorskip("elsa_vision.kernels.hopper")
    t = torch.randn(2, 3, 64, 64).to(torch.bfloat16)
    assert hopper._tma_readable(t)
    assert hopper._tma_readable(t.transpose(1, 2))  # token-major views (timm's packed qkv)
    assert not hopper._tma_readable(t.transpose(-1, -2))
    assert hopper._tma_readable(t[..., :60])  # (120 bytes of each 128-byte row)
    assert not hopper._tma_readable(torch.randn(2, 3, 64, 60).to(torch.bfloat16))  # rows of 120 bytes
    assert not hopper._tma_readable(t[:, :1].expand(2, 3, 64, 64))  # heads broadcast (stride 0)
    assert hopper._tma_readable(t[:, :1])  # a size-1 dimension's stride is never stepped


@pytest.mark.parametrize("bh,nq,bm", [(16, 4096, 192), (32, 4096, 192), (11, 2500, 192), (5, 3500, 128),
                                      (128, 4096, 192), (16, 2048, 192), (1, 100000, 192), (3, 200, 128)])
def test_hopper_tail_plan(bh, nq, bm):
    """hopper._tail (the forward's last round re-cut into items of bm − 64 rows): its item count is
    that of the rows the whole items from t0 on would cover, counted head by head; the re-cut
    items fit one round of the programs, and no round is added. (The kernel's item map is checked
    bit for bit against whole items on the GPU: test_hopper_gpu.py::test_forward_tail_items.)"""
    hopper = pytest.importorskip("elsa_vision.kernels.hopper")
    cdiv = lambda a, b: -(-a // b)
    n_m = cdiv(nq, bm)
    n_items = n_m * bh
    for programs in (132, 114, 78, 16):
        programs = min(programs, n_items)
        t0, total = hopper._tail(n_items, n_m, bm, nq, bh, programs)
        if t0 == total:
            assert total == n_items
            continue
        assert t0 == (n_items // programs) * programs and 0 < total - t0 <= programs
        rows = {}  # head → the rows the whole items from t0 on cover
        for w in range(t0, n_items):
            head, first = divmod(w, n_m)
            rows[head] = rows.get(head, 0) + min(bm, nq - first * bm)
        assert total - t0 == sum(cdiv(r, bm - 64) for r in rows.values())
        assert cdiv(total, programs) == cdiv(n_items, programs)


def test_hopper_programs_per_sm():
    """hopper.per_sm_programs: two resident forward programs per SM only with one consumer
    warpgroup (64-row items) and where two programs' shared memory (two Q buffers, the K and V
    rings, the output staging tile) fits an SM's; the short-row config (hopper.config) is one."""
    hopper = pytest.importorskip("elsa_vision.kernels.hopper")
    bm, bn, stages, _ = hopper.config(64, 197)
    assert bm == 64 and hopper.per_sm_programs(bm, bn, stages, 64, 2, 1) == 2
    assert hopper.config(64, 257)[0] > 64 and hopper.per_sm_programs(*hopper.config(64, 257)[:3], 64, 2, 1) == 1
    assert hopper.per_sm_programs(64, 128, 2, 128, 2, 1) == 1  # d = 128: 177 KiB a program
    assert hopper.per_sm_programs(64, 128, 2, 64, 2, 2) == 1  # fp16x3's hi and lo tiles
    assert hopper.per_sm_programs(64, 64, 2, 128, 2, 1) == 2


@pytest.mark.parametrize("forced", [None, True, False])
def test_hopper_forward_plans_the_overlapped_softmax_where_measured(forced, monkeypatch):
    """hopper.overlaps as the forward's planned launch applies it: the overlapped softmax at D = 128
    over more than SHORT_ROWS keys in bf16/fp16 (where it measured faster), not at D = 64, not over
    SHORT_ROWS keys or fewer, not for fp16x3's float16 parts; hopper.OVERLAP True/False forces it
    everywhere. (Bit for bit the plain step on the GPU: test_hopper_gpu.py::
    test_overlapped_softmax_is_bitwise_the_plain_one.)"""
    hopper = pytest.importorskip("elsa_vision.kernels.hopper")
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)  # (no GPU here: the plan only reads the count)
    monkeypatch.setattr(hopper, "OVERLAP", forced)
    for d, n, split, causal, measured in [(128, 577, False, False, True), (128, 16384, False, True, True),
                                          (128, hopper.SHORT_ROWS + 1, False, False, True),
                                          (128, hopper.SHORT_ROWS, False, False, False),
                                          (128, 197, False, True, False), (64, 4096, False, False, False),
                                          (64, 4096, True, False, False)]:
        rows = 2 * n if split else n  # (fp16x3's parts: a hi and a lo row per row)
        q = torch.empty(1, 2, rows, d, dtype=torch.float16 if split else torch.bfloat16)
        plan = hopper._forward_launch(q, q, q, torch.empty_like(q), d ** -0.5, causal, split)
        expected = measured if forced is None else forced
        assert plan.meta["OVERLAP"] is expected, (d, n, split, causal)


def test_hopper_d128_short_rows_plan(monkeypatch):
    """hopper.SHORT_ROWS_D128 as the forward's planned launch applies it: off by default (D = 128
    rows in 128-row blocks of two warpgroups, one program per SM); set, rows of at most that many
    queries as 64-row items over 64-key tiles, two programs per SM (maxnreg halved so that both are
    resident), longer rows and D = 64 as before. (The kernel under the oracle rule on the GPU:
    test_hopper_gpu.py::test_short_rows_in_64_row_items.)"""
    hopper = pytest.importorskip("elsa_vision.kernels.hopper")
    monkeypatch.setattr(hopper, "sm_count", lambda index: 132)

    def plan(d, n, causal=False):
        q = torch.empty(4, 8, n, d, dtype=torch.bfloat16)
        return hopper._forward_launch(q, q, q, torch.empty_like(q), d ** -0.5, causal, False)

    p = plan(128, 197)
    assert (p.meta["BLOCK_M"], p.meta["BLOCK_N"], "maxnreg" in p.meta) == (128, 128, False)
    monkeypatch.setattr(hopper, "SHORT_ROWS_D128", 1041)
    for causal in (False, True):
        p = plan(128, 1041, causal)
        assert (p.meta["BLOCK_M"], p.meta["BLOCK_N"], p.meta["STAGES"], p.meta.get("maxnreg")) == (64, 64, 2, 128)
        items = 4 * 8 * -(-1041 // 64)
        assert p.grid[0] == (items if causal else min(items, 2 * 132))
    assert (plan(128, 1042).meta["BLOCK_M"], plan(64, 577).meta["BLOCK_M"]) == (128, 192)
