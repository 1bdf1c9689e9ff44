"""kernels/rope.py: fused q/k LayerNorm + 2-D RoPE against the modules it stands in for (the
stand-in's copy of vggt's RotaryPositionEmbedding2D and torch's LayerNorm). CPU: interpreter."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from elsa_vision.adapters.vggt import attention as A
from elsa_vision.kernels import rope as KR
from vggt_standin import Attention, PositionGetter, RotaryPositionEmbedding2D


def _pos(B, h, w, special=5):
    pos = PositionGetter()(B, h, w, torch.device(DEVICE)) + 1
    return torch.cat([torch.zeros(B, special, 2, dtype=pos.dtype, device=DEVICE), pos], dim=1)


@pytest.mark.parametrize("D,affine,use_rope", [(64, True, True), (32, True, True), (64, False, True), (64, True, False),
                                               (16, True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_matches_the_modules(D, affine, use_rope, dtype):
    torch.manual_seed(0)
    B, H, h, w = 2, 3, 3, 5
    N = 5 + h * w
    y = torch.randn(B, N, 3 * H * D, device=DEVICE).to(dtype)        # a qkv projection's output
    norm = torch.nn.LayerNorm(D, elementwise_affine=affine).to(DEVICE)
    if affine:
        with torch.no_grad():
            norm.weight.normal_(1, 0.3)
            norm.bias.normal_(0, 0.3)
    rope, pos = (RotaryPositionEmbedding2D(), _pos(B, h, w)) if use_rope else (None, None)
    tables = rope._compute_frequency_components(D // 2, int(pos.max()) + 1, y.device, torch.float32) if use_rope else None
    for j in range(2):
        ref = norm(y.view(B, N, 3, H, D)[:, :, j].float().transpose(1, 2))    # [B, H, N, D], float32 as under autocast
        if use_rope:
            ref = rope(ref, pos)
        out = torch.empty(B, N, H, D, dtype=dtype, device=DEVICE)
        KR.qk_norm_rope(y[..., j * H * D:], H, out, norm, pos, tables)
        got = out.transpose(1, 2).float()
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=0, atol=4e-6)
        else:  # one rounding of the float32 value to bfloat16 (up to one ulp apart where that value sits on a tie)
            torch.testing.assert_close(got, ref.to(dtype).float(), rtol=2 ** -7, atol=1e-6)


def test_qk_norm_rope_rejects_bad_shapes():
    y = torch.randn(1, 4, 3 * 2 * 12, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        KR.qk_norm_rope(y, 2, torch.empty(1, 4, 2, 12, device=DEVICE))
    with pytest.raises(ValueError, match="does not fit"):
        KR.qk_norm_rope(y, 2, torch.empty(1, 5, 2, 16, device=DEVICE))


def test_fused_path_is_taken_only_where_it_is_exact():
    m = Attention(48, num_heads=3, qk_norm=True, rope=RotaryPositionEmbedding2D()).to(DEVICE)
    x = torch.randn(1, 20, 48, device=DEVICE)
    pos = _pos(1, 3, 5)
    with torch.no_grad():
        assert A._fused_qk(m, x, pos) is not None
        h = m.q_norm.register_forward_hook(lambda *a: None)
        assert A._fused_qk(m, x, pos) is None          # a hook expects the module to run
        h.remove()
        m.k_norm = torch.nn.RMSNorm(16).to(DEVICE)
        assert A._fused_qk(m, x, pos) is None          # only LayerNorm / Identity
    m.k_norm = torch.nn.LayerNorm(16).to(DEVICE)
    assert A._fused_qk(m, x, pos) is None              # gradients: the modules' own autograd
    with torch.no_grad():
        assert A._fused_qk(m, x, pos - 2) is None      # negative positions: the module raises, as upstream
        assert A._fused_qk(m, x, pos.float()) is None
