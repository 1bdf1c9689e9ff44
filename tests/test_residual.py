"""The fused residual passes (kernels/residual.py): the residual bitwise PyTorch's, the LayerNorm
within the oracle rule (float64 oracle, bound tied to the output dtype), the checks."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from elsa_vision.kernels.residual import residual_dtype, residual_norm
from elsa_vision.verify import max_err, tolerance

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _case(shape, x_dtype, y_dtype, g_dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[-1]
    x = (torch.randn(shape, generator=g) * 3 + 1).to(x_dtype)
    y = torch.randn(shape, generator=g).to(y_dtype)
    gamma = None if g_dtype is None else (torch.rand(C, generator=g) * 0.2 - 0.05).to(g_dtype)
    norm = torch.nn.LayerNorm(C, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0, generator=g)
        norm.bias.normal_(generator=g)
    return [t.to(device) if t is not None else None for t in (x, y, gamma)] + [norm.to(device)]


def _check_norm(h, r, norm):
    """h against the float64 LayerNorm of r, within the rule's bound for h's dtype (PyTorch's own
    float32 LayerNorm rounded to h's dtype is the native reference)."""
    w, b = norm.weight.double(), norm.bias.double()
    orc = F.layer_norm(r.double(), norm.normalized_shape, w, b, norm.eps)
    nat = F.layer_norm(r.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps).to(h.dtype)
    unit = max(1.0, orc.abs().max().item())
    tol = tolerance(max_err(nat, orc) / unit, h.dtype) * unit
    assert max_err(h, orc) <= tol, f"LayerNorm: {max_err(h, orc):.3g} > {tol:.3g}"


def _run_cases(device, shapes):
    dtypes = [(F32, BF16, F32), (F32, F16, F32), (F32, F32, None), (BF16, BF16, BF16), (F16, F16, F16),
              (F32, BF16, None), (BF16, F32, BF16)]
    for shape, (xd, yd, gd) in itertools.product(shapes, dtypes):
        x, y, gamma, norm = _case(shape, xd, yd, gd, device)
        for out in (None, BF16, F32):
            r, h = residual_norm(x, y, gamma, norm, out)
            ref = x + (y if gamma is None else y * gamma)
            assert r.dtype == ref.dtype == residual_dtype(x, y, gamma)
            assert torch.equal(r, ref), (shape, xd, yd, gd)
            assert h.dtype == (out or r.dtype) and h.shape == x.shape
            _check_norm(h, ref, norm)
        # the norm alone: the residual is x itself
        r, h = residual_norm(x, norm=norm, out_dtype=BF16)
        assert r is x
        _check_norm(h, x, norm)
        # the residual alone
        r, h = residual_norm(x, y, gamma)
        assert h is None and torch.equal(r, x + (y if gamma is None else y * gamma))


def test_residual_norm_small_cases():
    # widths: a power of two, one between (masked columns), one narrow; rows not a multiple of the
    # block, and (at 1024 features) more rows than one program takes (CPU: the interpreter)
    _run_cases(DEVICE, [(3, 5, 64), (2, 7, 96), (9, 24), (2, 70, 1024)])


def test_residual_norm_layouts_and_magnitudes():
    x, y, gamma, norm = _case((4, 6, 40), F32, BF16, F32, DEVICE)
    # strided x and y (a slice along the tokens and a transposed view): the same values
    xs, ys = x.transpose(0, 1), y.transpose(0, 1)
    r, h = residual_norm(xs, ys, gamma, norm, BF16)
    assert torch.equal(r, xs + ys * gamma)
    _check_norm(h, xs + ys * gamma, norm)
    # a large common offset and spread: the two-pass variance keeps the normalised values
    big = x.double() * 1e3 + 1e4
    r, h = residual_norm(big.float(), y, gamma, norm)
    _check_norm(h, r, norm)
    # no affine parameters
    plain = torch.nn.LayerNorm(40, elementwise_affine=False, device=DEVICE)
    r, h = residual_norm(x, y, None, plain, F32)
    assert torch.allclose(h, F.layer_norm(r, (40,), eps=plain.eps), atol=2e-6, rtol=0)
    # empty rows
    r, h = residual_norm(x[:0], y[:0], gamma, norm)
    assert r.shape == h.shape == (0, 6, 40)


def test_residual_norm_refuses_bad_input():
    x, y, gamma, norm = _case((2, 3, 16), F32, BF16, F32, DEVICE)
    with pytest.raises(ValueError, match="shape"):
        residual_norm(x, y[:, :2], gamma, norm)
    with pytest.raises(ValueError, match="gamma"):
        residual_norm(x, y, gamma[:8], norm)
    with pytest.raises(ValueError, match="normalizes"):
        residual_norm(x, y, gamma, torch.nn.LayerNorm(8))
    with pytest.raises(ValueError, match="dtypes"):
        residual_norm(x.double(), y, gamma, norm)


@pytest.mark.gpu
def test_residual_norm_gpu():
    # ViT-B's and VGGT's widths (768, 1024), a masked width, long rows; a million-token tensor
    _run_cases("cuda", [(2, 197, 768), (1, 1041, 1024), (3, 50, 1000), (4, 8, 4096)])
    x, y, gamma, norm = _case((1, 1 << 20, 64), F32, BF16, F32, "cuda")
    r, h = residual_norm(x, y, gamma, norm, BF16)
    assert torch.equal(r, x + y * gamma)
    _check_norm(h, r, norm)


def _grad_case(shape, x_dtype, y_dtype, g_dtype, out_dtype, seed=1):
    """(inputs requiring grad, the LayerNorm, upstream gradients dr, dh) on the test device; a
    half-precision residual stream takes a norm of its dtype (CUDA's LayerNorm takes no mixed ones)."""
    x, y, gamma, norm = _case(shape, x_dtype, y_dtype, g_dtype, DEVICE, seed)
    norm = norm.to(residual_dtype(x, y, gamma))
    g = torch.Generator().manual_seed(seed + 1)
    dr = torch.randn(shape, generator=g).to(residual_dtype(x, y, gamma)).to(DEVICE)
    dh = torch.randn(shape, generator=g).to(out_dtype or residual_dtype(x, y, gamma)).to(DEVICE)
    leaves = [t.requires_grad_() for t in (x, y, gamma) if t is not None]
    return x, y, gamma, norm, dr, dh, leaves + list(norm.parameters())


def _native(x, y, gamma, norm, out_dtype):
    r = x + (y if gamma is None else y * gamma)
    return r, norm(r).to(out_dtype or r.dtype)


def _check_grads(what, leaves, norm, fused, native, ups):
    """Gradients of ``leaves`` and the norm's parameters through ``fused`` (this package's passes)
    and ``native`` (PyTorch's ops, also run in float64 as the oracle), each taking (leaves, norm) and
    returning the outputs ``ups`` are the gradients of: the oracle rule for gradients."""
    n64 = torch.nn.LayerNorm(norm.normalized_shape, eps=norm.eps, dtype=torch.float64, device=DEVICE)
    n64.load_state_dict({k: v.double() for k, v in norm.state_dict().items()})
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    orc = torch.autograd.grad(native(l64, n64), l64 + list(n64.parameters()), [u.double() for u in ups])
    ref = torch.autograd.grad(native(leaves, norm), leaves + list(norm.parameters()), ups)
    got = torch.autograd.grad(fused(leaves, norm), leaves + list(norm.parameters()), ups)
    for i, (a, n, o) in enumerate(zip(got, ref, orc)):
        assert a.dtype == n.dtype and a.shape == n.shape, (what, i)
        unit = max(1.0, o.abs().max().item())
        tol = tolerance(max_err(n, o) / unit, a.dtype, grad=True) * unit
        assert max_err(a, o) <= tol, f"{what}, gradient {i}: {max_err(a, o):.3g} > {tol:.3g}"


@pytest.mark.parametrize("dtypes", [(F32, F32, F32, None), (F32, BF16, F32, BF16), (F32, BF16, None, BF16),
                                    (BF16, BF16, BF16, None), (F32, F16, None, F16)])
def test_residual_norm_backward_within_the_rule(dtypes):
    """Gradients of x, y, γ and the norm's weight and bias through (r, h), and through h alone (a
    norm without a residual), within the oracle rule for gradients (float64 oracle, PyTorch's own ops
    as the native reference)."""
    xd, yd, gd, out = dtypes
    for shape in [(3, 5, 64), (2, 70, 96)]:   # (at 96 features the rows are masked; 140 rows: several programs)
        x, y, gamma, norm, dr, dh, leaves = _grad_case(shape, xd, yd, gd, out)
        leaves = leaves[:-2]  # (x, y[, γ]); the norm's parameters are added by _check_grads

        def fused(ls, n):
            return residual_norm(ls[0], ls[1], ls[2] if len(ls) > 2 else None, n, out)

        def native(ls, n):
            r = ls[0] + (ls[1] * ls[2] if len(ls) > 2 else ls[1])
            return r, n(r).to(out or r.dtype) if ls[0].dtype != torch.float64 else n(r)

        _check_grads(f"{shape} {dtypes}", leaves, norm, fused, native, (dr, dh))
    # the norm alone (norm1): h's gradient reaches x, the weight and the bias
    x, _, _, norm, _, dh, _ = _grad_case((2, 9, 64), xd, yd, gd, out)
    _check_grads(f"norm alone {dtypes}", [x], norm, lambda ls, n: residual_norm(ls[0], norm=n, out_dtype=out)[1],
                 lambda ls, n: n(ls[0]).to(out or ls[0].dtype) if ls[0].dtype != torch.float64 else n(ls[0]),
                 (dh.to(out or x.dtype),))


def test_residual_norm_backward_is_deterministic_and_leaves_frozen_inputs():
    x, y, gamma, norm, dr, dh, leaves = _grad_case((4, 33, 80), F32, BF16, F32, BF16)
    g1 = torch.autograd.grad(residual_norm(x, y, gamma, norm, BF16), leaves, (dr, dh))
    g2 = torch.autograd.grad(residual_norm(x, y, gamma, norm, BF16), leaves, (dr, dh))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    norm.requires_grad_(False)   # frozen norm, no γ: only x and y take gradients
    r, h = residual_norm(x, y, None, norm, BF16)
    gx, gy = torch.autograd.grad((r, h), (x, y), (dr.to(r.dtype), dh))
    assert gy.dtype == y.dtype and gx.dtype == x.dtype
    # the residual alone under autograd: PyTorch's ops, the same bits
    r, h = residual_norm(x, y, gamma)
    assert h is None and torch.equal(r, x + y * gamma) and r.requires_grad


def test_residual_norm_rows_of_size_one_dimensions_and_no_double_backward():
    """A contiguous tensor's size-1 dimensions may carry any stride (a transpose's): rows are read
    with stride C all the same, forward and backward; differentiating the backward raises."""
    g = torch.Generator().manual_seed(3)
    norm = torch.nn.LayerNorm(8).to(DEVICE)
    x = torch.randn(4, 8, 1, generator=g).to(DEVICE).transpose(1, 2)        # [4, 1, 8], strides (8, 1, 1)
    assert x.is_contiguous() and x.stride(-2) != 8
    r, h = residual_norm(x, norm=norm)
    torch.testing.assert_close(h, norm(x), rtol=1e-5, atol=1e-5)
    x = x.detach().requires_grad_()
    w = torch.randn(4, 8, 1, generator=g).to(DEVICE)
    (residual_norm(x, norm=norm)[1].transpose(1, 2) * w).sum().backward()  # dh: strides (8, 1, 1) again
    got = [x.grad.clone(), norm.weight.grad.clone()]
    x.grad = norm.weight.grad = norm.bias.grad = None
    (norm(x).transpose(1, 2) * w).sum().backward()
    for a, b in zip(got, [x.grad, norm.weight.grad]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    y = torch.randn(4, 1, 8, generator=g).to(DEVICE).requires_grad_()
    r, h = residual_norm(x, y, None, norm)
    (gx,) = torch.autograd.grad(h.sum(), x, create_graph=False)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(residual_norm(x, y, None, norm)[1].square().sum(), y, create_graph=True)


def test_strided_vectors_are_refused_and_the_bare_residual_is_x():
    """gamma and the LayerNorm's weight and bias are read as dense [C] vectors: a strided or
    broadcast one is refused (it was read as if dense); with neither y nor a norm, x comes back as
    it is, also under autograd (it raised)."""
    x, y = (torch.randn(4, 6, device=DEVICE) for _ in range(2))
    norm = torch.nn.LayerNorm(6).to(DEVICE)
    for gamma in (torch.rand(12, device=DEVICE)[::2], torch.tensor([0.5], device=DEVICE).expand(6)):
        with pytest.raises(ValueError, match="gamma must be a contiguous"):
            residual_norm(x, y, gamma, norm)
    strided = torch.nn.LayerNorm(6).to(DEVICE)
    strided.weight = torch.nn.Parameter(torch.rand(12, device=DEVICE)[::2])
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        residual_norm(x, y, None, strided)
    xg = x.clone().requires_grad_()
    r, h = residual_norm(xg)
    assert r is xg and h is None
