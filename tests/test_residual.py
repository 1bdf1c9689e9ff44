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
