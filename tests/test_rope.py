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
@pytest.mark.parametrize("parts", [1, 2])
def test_qk_norm_rope_matches_the_modules(D, affine, use_rope, dtype, parts):
    torch.manual_seed(0)
    B, H, h, w = 2, 3, 3, 5
    N = 5 + h * w
    y = torch.randn(B, N, 3 * H * D, device=DEVICE).to(dtype)        # a qkv projection's output
    norms = [torch.nn.LayerNorm(D, elementwise_affine=affine, eps=1e-6 * (1 + j)).to(DEVICE) for j in range(2)]
    if affine:
        with torch.no_grad():
            for norm in norms:
                norm.weight.normal_(1, 0.3)
                norm.bias.normal_(0, 0.3)
    rope, pos = (RotaryPositionEmbedding2D(), _pos(B, h, w)) if use_rope else (None, None)
    tables = rope._compute_frequency_components(D // 2, int(pos.max()) + 1, y.device, torch.float32) if use_rope else None
    # parts = 2: q and k in one call; parts = 1: each alone (k as the slice starting at its columns)
    calls = [(y, [0, 1])] if parts == 2 else [(y[..., j * H * D:], [j]) for j in range(2)]
    for x, js in calls:
        outs = [torch.empty(B, N, H, D, dtype=dtype, device=DEVICE) for _ in js]
        KR.qk_norm_rope(x, H, outs, [norms[j] for j in js], pos, tables)
        for j, out in zip(js, outs):
            ref = norms[j](y.view(B, N, 3, H, D)[:, :, j].float().transpose(1, 2))  # [B, H, N, D], float32 as under autocast
            if use_rope:
                ref = rope(ref, pos)
            got = out.transpose(1, 2).float()
            if dtype == torch.float32:
                torch.testing.assert_close(got, ref, rtol=0, atol=4e-6)
            else:  # one rounding of the float32 value to bfloat16 (up to one ulp apart where that value sits on a tie)
                torch.testing.assert_close(got, ref.to(dtype).float(), rtol=2 ** -7, atol=1e-6)


def test_qk_norm_rope_spans_programs_and_strided_outputs():
    """Token blocks over several programs and batches (the last one partial), outputs as slices of
    larger buffers (the chunked path's), no norm."""
    torch.manual_seed(1)
    B, H, D, h, w = 3, 2, 16, 9, 15
    N = 5 + h * w                                                     # 140: three blocks of 64, the last partial
    y = torch.randn(B, N, 3 * H * D, device=DEVICE)
    rope, pos = RotaryPositionEmbedding2D(), _pos(B, h, w)
    tables = rope._compute_frequency_components(D // 2, int(pos.max()) + 1, y.device, torch.float32)
    bufs = [torch.full((B, N + 7, H, D), float("nan"), device=DEVICE) for _ in range(2)]
    outs = [b[:, 3:3 + N] for b in bufs]
    KR.qk_norm_rope(y, H, outs, None, pos, tables)
    for j, out in enumerate(outs):
        ref = rope(y.view(B, N, 3, H, D)[:, :, j].transpose(1, 2), pos)
        torch.testing.assert_close(out.transpose(1, 2), ref, rtol=0, atol=4e-6)
        assert bufs[j][:, :3].isnan().all() and bufs[j][:, 3 + N:].isnan().all()   # nothing written outside


def test_qk_norm_rope_rejects_bad_shapes():
    y = torch.randn(1, 4, 3 * 2 * 12, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        KR.qk_norm_rope(y, 2, [torch.empty(1, 4, 2, 12, device=DEVICE)])
    with pytest.raises(ValueError, match="do not fit"):
        KR.qk_norm_rope(y, 2, [torch.empty(1, 5, 2, 16, device=DEVICE)])
    y = torch.randn(1, 4, 3 * 2 * 16, device=DEVICE)
    outs = [torch.empty(1, 4, 2, 16, device=DEVICE) for _ in range(2)]
    with pytest.raises(ValueError, match="do not fit"):          # q and k of different dtypes
        KR.qk_norm_rope(y, 2, [outs[0], outs[1].half()])
    with pytest.raises(ValueError, match="1 or 2 outputs"):
        KR.qk_norm_rope(y, 2, outs * 2)
    with pytest.raises(ValueError, match="same affine"):
        KR.qk_norm_rope(y, 2, outs, [torch.nn.LayerNorm(16), torch.nn.LayerNorm(16, bias=False)])


def test_fused_path_is_taken_only_where_it_is_exact():
    m = Attention(48, num_heads=3, qk_norm=True, rope=RotaryPositionEmbedding2D()).to(DEVICE)
    x = torch.randn(1, 20, 48, device=DEVICE)
    pos = _pos(1, 3, 5)
    with torch.no_grad():
        assert A._fused_qk(m, x, pos, "auto") is not None and A._fused_qk(m, x, pos, "triton") is not None
        assert A._fused_qk(m, x, pos, "reference") is None  # (a model patched for it launches no kernel)
        h = m.q_norm.register_forward_hook(lambda *a: None)
        assert A._fused_qk(m, x, pos, "auto") is None          # a hook expects the module to run
        h.remove()
        m.k_norm = torch.nn.RMSNorm(16).to(DEVICE)
        assert A._fused_qk(m, x, pos, "auto") is None          # only LayerNorm / Identity
    m.k_norm = torch.nn.LayerNorm(16).to(DEVICE)
    assert A._fused_qk(m, x, pos, "auto") is None              # gradients: the modules' own autograd
    with torch.no_grad():
        assert A._fused_qk(m, x, pos - 2, "auto") is None      # negative positions: the module raises, as upstream
        assert A._fused_qk(m, x, pos.float(), "auto") is None


def test_token_tables_hold_the_modules_rows():
    """In a compiled graph the fused kernel reads a row per token and direction (_token_tables):
    that row is the module's own table row of the token's position."""
    rope, pos = RotaryPositionEmbedding2D(), _pos(2, 3, 5)
    rows, (cos, sin) = A._token_tables(rope, pos, 32)
    want = rope._compute_frequency_components(16, int(pos.max()) + 1, pos.device, torch.float32)
    assert rows.shape == pos.shape and cos.shape == sin.shape == (pos.numel(), 16)
    assert torch.equal(cos[rows], want[0][pos]) and torch.equal(sin[rows], want[1][pos])


@pytest.mark.parametrize("chunk", [None, 8])
def test_fused_qk_in_a_compiled_graph(chunk):
    """Inside torch.compile (fullgraph, aot_eager) vggt's q and k still come from the fused kernel,
    through per-token table rows, with the eager call's values, in one graph without a break."""
    from oracle_check import op_calls
    torch.manual_seed(3)
    m = Attention(64, num_heads=2, qk_norm=True, rope=RotaryPositionEmbedding2D()).to(DEVICE)
    x = torch.randn(2, 17, 64, device=DEVICE)
    pos = _pos(2, 3, 4)
    calls = []

    def backend(gm, example_inputs):
        calls.append(op_calls(gm, ("qk_norm_rope",), ("_qk_norm_rope_kernel",)))
        return gm.forward

    with torch.no_grad():
        want = A.project_qkv(m, x, pos, chunk)
        torch._dynamo.reset()
        try:
            got = torch.compile(lambda x, pos: A.project_qkv(m, x, pos, chunk), fullgraph=True, backend=backend)(x, pos)
        finally:
            torch._dynamo.reset()
    assert calls == [1 if chunk is None else 5]  # (lean chunks of 8 tokens: 4 of each sample's 17)
    assert all(torch.allclose(g, w, rtol=0, atol=1e-6) for g, w in zip(got, want))


def test_qk_norm_rope_traces_as_one_op():
    """Called inside torch.compile (fullgraph, aot_eager), q and k come from the registered op, which
    writes both outputs (its mutated arguments), with the eager call's values."""
    torch.manual_seed(2)
    B, H, D, h, w = 1, 2, 16, 3, 4
    N = 5 + h * w
    y = torch.randn(B, N, 3 * H * D, device=DEVICE)
    rope, pos = RotaryPositionEmbedding2D(), _pos(B, h, w)
    tables = rope._compute_frequency_components(D // 2, int(pos.max()) + 1, y.device, torch.float32)
    norms = [torch.nn.LayerNorm(D).to(DEVICE) for _ in range(2)]

    def f(y):
        outs = [y.new_empty(B, N, H, D) for _ in range(2)]
        KR.qk_norm_rope(y, H, outs, norms, pos, tables)
        return outs[0] + 1, outs[1] * 2

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(y)
    assert all(torch.equal(a, b) for a, b in zip(got, f(y)))


def test_pos_and_norm_vectors_are_checked():
    """pos must be an integer [B, n, 2] (a shared [1, n, 2] one was read past its end for the
    other batches; a float one failed inside Triton), and the norms' weight and bias dense."""
    B, n, H, D = 2, 8, 2, 16
    x = torch.randn(B, n, H * D, device=DEVICE)
    out = torch.empty(B, n, H, D, device=DEVICE)
    tables = (torch.ones(n, D // 2, device=DEVICE), torch.zeros(n, D // 2, device=DEVICE))
    pos = torch.randint(0, n, (B, n, 2), device=DEVICE)
    for bad in (pos[:1], pos.float(), pos[0]):
        with pytest.raises(ValueError, match="pos must be an integer"):
            KR.qk_norm_rope(x, H, [out], None, bad, tables)
    norm = torch.nn.LayerNorm(D).to(DEVICE)
    norm.weight = torch.nn.Parameter(torch.rand(2 * D, device=DEVICE)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        KR.qk_norm_rope(x, H, [out], [norm])
