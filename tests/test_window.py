"""Windowed attention (Swin): the Triton window kernel (under TRITON_INTERPRET=1 on CPU), the chunked
reference backend, the public API's validation, dispatch, and GPU runs at real Swin sizes.

Correctness rule (elsa_vision.verify.tolerance): against a float64 oracle, max|elsa − oracle| ≤ 2 × max|torch − oracle|
+ 1e-6 where "torch" is timm's own unfused path in the inputs' dtype (q·kᵀ·scale + bias + mask,
softmax, ·v); gradients (dq, dk, dv, dbias) 3×.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

import elsa_vision
from elsa_vision import dispatch
from elsa_vision.verify import max_err, tolerance
from oracle_check import assert_fake_matches_real, assert_graph_replay_matches_eager, tf32_operand

INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interp = pytest.mark.skipif(not INTERP, reason="Triton on CPU needs TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---------------------------------------------------------------------------------------------
# helpers


def _swin_mask(nW: int, N: int, kind: str = "timm", gen=None) -> torch.Tensor:
    """[nW, N, N] additive mask shaped like Swin's shifted-window mask: tokens of a window fall in a
    few regions and only attend inside their region (timm: 0 / −100). ``kind="inf"`` uses −inf and
    makes window 1 see a single key per row (and one fully masked row)."""
    region = torch.randint(0, 3, (nW, N), generator=gen)
    region[0] = 0  # window 0: unshifted (all 0)
    same = region[:, :, None] == region[:, None, :]
    fill = -100.0 if kind == "timm" else float("-inf")
    m = torch.zeros(nW, N, N).masked_fill(~same, fill)
    if kind == "inf" and nW > 1:
        m[1] = float("-inf")
        m[1, :, 0] = 0.0
        m[1, N // 2, :] = float("-inf")  # a row that sees no key: returns 0
    return m


def _timm_path(q, k, v, bias, mask, scale, dtype, tf32=False):
    """timm's unfused WindowAttention math in ``dtype`` (float64 = the oracle). ``tf32``: both
    matmuls read tf32-rounded operands (float32 accumulation), as torch's TF32 mode would."""
    BW, H, N, _ = q.shape
    r = tf32_operand if tf32 else (lambda t: t)
    a = r(q.to(dtype) * scale) @ r(k.to(dtype)).transpose(-2, -1)
    if bias is not None:
        a = a + bias.to(dtype).reshape(-1, N, N)
    if mask is not None:
        nW = mask.shape[0]
        a = a.view(-1, nW, H, N, N) + mask.to(dtype).unsqueeze(1).unsqueeze(0)
        a = a.view(-1, H, N, N)
    # rows whose keys are all -inf give 0 (the kernel's and the oracle's convention)
    mx = a.amax(-1, keepdim=True)
    e = torch.exp(a - torch.where(torch.isneginf(mx), 0, mx))
    z = e.sum(-1, keepdim=True)
    p = e / torch.where(z > 0, z, 1)
    return r(p) @ r(v.to(dtype))


def _inputs(B, nW, H, N, D, dtype, *, bias=True, mask="timm", seed=0, layout="timm"):
    g = torch.Generator().manual_seed(seed)
    BW = B * nW
    if layout == "timm":  # q/k/v as views of one qkv buffer, exactly as timm's WindowAttention makes them
        qkv = torch.randn(BW, N, 3, H, D, generator=g).to(dtype).permute(2, 0, 3, 1, 4)
        q, k, v = (qkv[i].detach().requires_grad_(True) for i in range(3))
    else:
        q, k, v = (torch.randn(BW, H, N, D, generator=g).to(dtype).requires_grad_(True) for _ in range(3))
    b = (torch.randn(H, N, N, generator=g) * 2).requires_grad_(True) if bias else None
    m = _swin_mask(nW, N, mask, g) if mask else None
    return q, k, v, b, m


def _check(q, k, v, bias, mask, *, scale=None, grads=True, seed=1, **kw):
    """Run window_attention and compare output (and gradients) with the oracle under the §7 rule
    (precision="tf32": against the same math on tf32-rounded operands)."""
    D = q.shape[-1]
    sc = scale if scale is not None else 1 / math.sqrt(D)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    out = elsa_vision.window_attention(q, k, v, bias=bias, mask=mask, scale=scale, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = _timm_path(q, k, v, bias, mask, sc, q.dtype, tf32=kw.get("precision") == "tf32")
    orc = _timm_path(q, k, v, bias, mask, sc, torch.float64)
    e, r = max_err(out, orc), max_err(ref, orc)
    assert e <= tolerance(r, q.dtype), f"output: err {e:.3g} vs torch {r:.3g}"
    if not grads:
        return out
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(q.device, q.dtype)
    gx = torch.autograd.grad(out, leaves, g)
    gr = torch.autograd.grad(ref, leaves, g)
    go = torch.autograd.grad(orc, leaves, g.double())
    for name, a, b, c in zip("q k v bias".split(), gx, gr, go):
        assert a.shape == c.shape
        e, r = max_err(a, c), max_err(b, c)
        assert e <= tolerance(r, q.dtype, grad=True), f"d{name}: err {e:.3g} vs torch {r:.3g}"
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernel under the interpreter: every tiling mode, block size and dtype

F32 = (torch.float32, "ieee")
F32X3 = (torch.float32, "tf32x3")
F16X3 = (torch.float32, "fp16x3")
BF16 = (torch.bfloat16, "auto")
F16 = (torch.float16, "auto")

# (N, nW, H, D, block, (dtype, precision), bias, mask); batch 2 throughout. The backward is the fused
# single kernel for half precision at N_pad ≤ 64 and D ≤ 32, the tiled three-kernel one otherwise.
CASES = [
    (49, 4, 2, 32, 64, F32, True, "timm"),        # Swin-T window, fp32 strict, tiled backward
    (49, 4, 2, 32, 128, BF16, True, "timm"),      # fused backward
    (49, 64, 1, 16, 256, F32X3, True, "timm"),    # nW = 64 (Swin-T stage 1), small D
    (49, 64, 1, 16, 64, F16, True, "timm"),       # (batch 1 here: the interpreter is slow)
    (50, 1, 2, 32, 64, F32, True, None),          # odd N, no mask
    (50, 4, 2, 32, 256, BF16, False, "inf"),      # −inf mask, a fully masked row, no bias
    (64, 4, 2, 32, 64, F32X3, False, "timm"),     # SwinV2 window 8, mask only
    (64, 1, 2, 32, 128, BF16, True, None),
    (144, 4, 1, 32, 64, F32, True, "timm"),       # window 12: three 64-wide key tiles folded
    (144, 1, 1, 32, 128, F32X3, True, None),      # two 128-wide tiles
    (144, 4, 1, 32, 256, BF16, True, "timm"),     # one 256-wide tile (16-row query strips)
    (256, 1, 1, 32, 256, F32, True, "timm"),      # SwinV2 window 16
    (256, 4, 1, 32, 64, BF16, True, "timm"),
    (100, 4, 1, 64, "auto", F32, True, "timm"),   # wider head dims
    (20, 4, 2, 80, "auto", BF16, True, "timm"),   # D = 80 (padded tile), N_pad = 32
    (7, 1, 3, 128, "auto", F32X3, True, None),    # D = 128
    (49, 4, 2, 32, 64, F16X3, True, "timm"),      # float16 split: one key tile, dbias in the dk/dv kernel
    (144, 4, 1, 32, 64, F16X3, True, "timm"),     # folded key tiles with their own scales, dbias kernel
    (100, 2, 1, 64, "auto", F16X3, False, "inf"),
]


@needs_interp
@pytest.mark.parametrize("N,nW,H,D,block,dp,bias,mask", CASES,
                         ids=[f"N{c[0]}-nW{c[1]}-H{c[2]}-D{c[3]}-B{c[4]}-{str(c[5][0])[6:]}-{c[5][1]}"
                              f"{'-bias' if c[6] else ''}{'-' + c[7] if c[7] else ''}" for c in CASES])
def test_triton_matches_oracle(N, nW, H, D, block, dp, bias, mask):
    dtype, precision = dp
    batch = 1 if (nW == 64 and dtype == torch.float16) else 2
    q, k, v, b, m = _inputs(batch, nW, H, N, D, dtype, bias=bias, mask=mask)
    out = _check(q, k, v, b, m, block=block, precision=precision, backend="triton")
    if mask == "inf":
        assert torch.all(out[1::nW, :, N // 2] == 0)  # window 1's fully masked row


@needs_interp
@pytest.mark.parametrize("N,block", [(49, 64), (144, 64)], ids=["one-tile", "folded"])
def test_fp16x3_per_window_scales(N, block):
    """fp16x3 in the window kernels scales each window's tiles by their own powers of two: windows
    whose q, v and upstream gradient are 1e-6…1e4 times their neighbours' (k the inverse: the same
    logits) each keep float32 accuracy. Every window is checked on its own, its errors divided by
    its oracle's largest magnitude (the rule's absolute 1e-6 would pass the small windows)."""
    q, k, v, _, m = _inputs(1, 4, 2, N, 32, torch.float32, bias=False, layout="bhnd")
    s = torch.tensor([1.0, 1e-6, 1e4, 1e-3]).view(4, 1, 1, 1)
    q, k, v = (t.detach() * f for t, f in ((q, s), (k, 1 / s), (v, s)))
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)) * s
    runs = {}
    for name, dtype in (("elsa", torch.float32), ("torch", torch.float32), ("oracle", torch.float64)):
        ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        if name == "elsa":
            out = elsa_vision.window_attention(*ins, mask=m, block=block, precision="fp16x3", backend="triton")
        else:
            out = _timm_path(*ins, None, m.to(dtype), 1 / math.sqrt(32), dtype)
        runs[name] = [out, *torch.autograd.grad(out, ins, g.to(dtype))]
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        for w in range(4):
            a, b, c = (runs[n][i][w] for n in ("elsa", "torch", "oracle"))
            top = c.abs().max()
            e, r = max_err(a / top.float(), c / top), max_err(b / top.float(), c / top)
            assert e <= tolerance(r, torch.float32, grad=i > 0), f"{what} window {w}: err {e:.3g} vs torch {r:.3g}"


@needs_interp
@pytest.mark.parametrize("N,block", [(16, 64), (144, 64)], ids=["one-tile", "folded"])
def test_fp16x3_nonfinite_element_spares_the_rest_of_its_window(N, block):
    """An inf in one element of q leaves the fp16x3 window scales to the finite elements: the
    window's other rows and the other windows stay float32-accurate, that row is not finite (its
    scale once came from the inf, and the window's other rows were silently averages of v)."""
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 2, N, 16, generator=g) for _ in range(3))
    q[0, 0, 1, 0] = float("inf")
    out = elsa_vision.window_attention(q, k, v, block=block, precision="fp16x3", backend="triton")
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4, -1) @ v.double()
    rows = [i for i in range(N) if i != 1]
    assert max_err(out[0, 0, rows], ref[0, 0, rows]) < 1e-5
    assert max_err(out[1], ref[1]) < 1e-5 and max_err(out[0, 1], ref[0, 1]) < 1e-5
    assert not torch.isfinite(out[0, 0, 1]).all()


@needs_interp
@pytest.mark.parametrize("scale", [1e-6, 0.0], ids=["tiny", "zero"])
def test_fp16x3_key_tile_far_below_its_window(scale):
    """A window folded over several key tiles, one of whose v is 1e-6 of the others' or all zero
    (zero-padded tokens through a projection without bias): delta sums over every key, so a scale
    taken from that tile alone pushed dS past float16's range (inf/NaN gradients); the backward
    takes one v scale per window."""
    q, k, v, b, m = _inputs(1, 4, 1, 144, 32, torch.float32, layout="bhnd")
    with torch.no_grad():
        v[:, :, 64:128] *= scale
    _check(q, k, v, b, m, block=64, precision="fp16x3", backend="triton")


@needs_interp
@pytest.mark.parametrize("wpp", [1, 3])
def test_runs_of_windows_and_dbias_partials(wpp):
    """Force several runs per head (the last one short): the per-run dbias partials are summed."""
    from elsa_vision.kernels import window as W
    q, k, v, b, m = _inputs(2, 4, 2, 49, 32, torch.float32)
    sc = 1 / math.sqrt(32)
    for precision in ("ieee", "tf32x3"):
        out, lse, _ = torch.ops.elsa_vision.window_fwd(q, k, v, b, m, sc, precision, 64, wpp)
        ref = _timm_path(q, k, v, b, m, sc, torch.float64)
        assert max_err(out, ref) < 1e-5
        do = torch.randn_like(out)
        dq, dk, dv, db = W.backward(do, q, k, v, b, m, out, lse, sc, precision, 64, True, wpp)
        go = torch.autograd.grad(ref, (q, k, v, b), do.double())
        for a, c in zip((dq, dk, dv, db), go):
            assert max_err(a, c) < 2e-5
    # the half-precision fused backward, too
    qh, kh, vh = (t.detach().bfloat16() for t in (q, k, v))
    out, lse, _ = torch.ops.elsa_vision.window_fwd(qh, kh, vh, b, m, sc, "native", 64, wpp)
    do = torch.randn_like(out)
    _, _, _, db = W.backward(do, qh, kh, vh, b, m, out, lse, sc, "native", 64, True, wpp)
    _, _, _, db1 = W.backward(do, qh, kh, vh, b, m, out, lse, sc, "native", 64, True, 8)
    assert torch.allclose(db, db1, atol=1e-4)


@needs_interp
@pytest.mark.parametrize("N,kind", [(64, "cosine"), (144, "large-bias")])
def test_large_logits(N, kind):
    """Float32 gradients (dbias most) where the logits are large: Swin v2 at its logit-scale clamp
    (unit q/k times τ = 100 plus 16·sigmoid(cpb)), and a relative-position bias of ±40. A backward
    that recomputes P from log2-domain logits and a rounded log-sum-exp, with delta from the
    output, is 3–8× less accurate than PyTorch here."""
    q, k, v, b, m = _inputs(2, 4, 2, N, 32, torch.float32, bias=True, mask="timm", seed=0)
    scale = None
    with torch.no_grad():
        if kind == "cosine":
            q.copy_(torch.nn.functional.normalize(q, dim=-1))
            k.copy_(torch.nn.functional.normalize(k, dim=-1))
            b.copy_(16 * torch.sigmoid(b))
            scale = 100.0
        else:
            b.mul_(15)
    _check(q, k, v, b, m, scale=scale, block=64, precision="ieee", backend="triton")


@needs_interp
@pytest.mark.parametrize("N,D", [(49, 32), (100, 64)])
def test_rows_masked_by_a_finite_fill(N, D):
    """A bfloat16 call with a −1e9 mask fill (not timm's −100): a row masked everywhere has
    m ≈ −1e9, where a log-sum-exp folded into one float32 loses ln S and the backward's P would be
    1 per key, not 1/N (gradients N× too large). Both backwards: fused (N_pad ≤ 64, D ≤ 32) and
    tiled. No bias, and that row's query zero: its logits are −1e9 exactly, the oracle's row
    uniform as the kernel's."""
    q, k, v, _, _ = _inputs(1, 2, 2, N, D, torch.bfloat16, bias=False, mask=None, seed=5)
    with torch.no_grad():
        q[1::2, :, N // 2] = 0.0
    m = torch.zeros(2, N, N)
    m[1, N // 2, :] = -1e9                    # masked everywhere
    m[1, 3, 5:] = -1e9                        # masked but for 5 keys
    _check(q, k, v, None, m, backend="triton")


@needs_interp
def test_lse_and_layout():
    from elsa_vision.kernels import window as W
    from elsa_vision.kernels.attention import natural_lse
    q, k, v, b, m = _inputs(1, 4, 2, 49, 32, torch.float32)
    sc = 0.2
    out, stats = W.forward(q, k, v, b, m, sc, "ieee")
    s = (q.double() @ k.double().transpose(-1, -2)) * sc + b.double() + m.double().unsqueeze(1)
    assert stats.shape == (4, 2, 2, 49)
    assert max_err(natural_lse(stats, True), torch.logsumexp(s, -1)) < 1e-5
    # the output is laid out [BW, N, H, D]: Swin's reshape to (BW, N, H·D) is a view
    assert out.transpose(1, 2).is_contiguous()
    out2 = out.transpose(1, 2).reshape(4, 49, 64)
    assert out2.data_ptr() == out.data_ptr()


@needs_interp
def test_bias_forms_and_bool_mask():
    """[1,H,N,N] and head-shared [N,N] biases (gradient summed over heads), bool keep-masks."""
    N, H = 49, 2
    q, k, v, b, m = _inputs(2, 4, H, N, 32, torch.float32)
    keep = m == 0
    out_bool = elsa_vision.window_attention(q, k, v, bias=b, mask=keep, precision="ieee", backend="triton")
    ref = _timm_path(q, k, v, b, torch.zeros_like(m).masked_fill(~keep, float("-inf")), 32 ** -0.5, torch.float64)
    assert max_err(out_bool, ref) < 1e-5
    b4 = b.detach()[None].clone().requires_grad_(True)
    _check(q, k, v, b4, m, precision="ieee", backend="triton")
    b2 = b.detach()[0].clone().requires_grad_(True)  # one [N, N] bias for every head
    out = elsa_vision.window_attention(q, k, v, bias=b2, mask=m, precision="ieee", backend="triton")
    ref = _timm_path(q, k, v, b2.expand(H, N, N), m, 32 ** -0.5, torch.float64)
    assert max_err(out, ref) < 1e-5
    g = torch.randn_like(out)
    (db,) = torch.autograd.grad(out, b2, g)
    (dbr,) = torch.autograd.grad(ref, b2, g.double())
    assert db.shape == (N, N) and max_err(db, dbr) < 2e-5


@needs_interp
def test_all_blocks_agree_and_auto():
    """Every block size computes the same function (they differ only in tiling)."""
    q, k, v, b, m = _inputs(1, 4, 1, 144, 32, torch.float32, seed=3)
    outs = [elsa_vision.window_attention(q, k, v, bias=b, mask=m, block=blk, precision="ieee", backend="triton")
            for blk in (64, 128, 256, "auto")]
    for o in outs[1:]:
        assert max_err(o, outs[0]) < 1e-5


@needs_interp
def test_autocast_and_custom_op():
    q, k, v, b, m = _inputs(2, 4, 2, 49, 32, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = elsa_vision.window_attention(q, k, v, bias=b, mask=m, backend="triton")
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and b.grad is not None and b.grad.dtype == torch.float32
    from elsa_vision.kernels import window  # noqa: F401
    args = (q.detach(), k.detach(), v.detach(), b.detach(), m, 0.2, "ieee", 64, 0)
    torch.library.opcheck(torch.ops.elsa_vision.window_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    # with gradients and symbolic sizes (the op's save for the backward once hashed a SymInt)
    grad_args = (*(t.detach().requires_grad_() for t in (q, k, v, b)), *args[4:])
    torch.library.opcheck(torch.ops.elsa_vision.window_fwd.default, grad_args,
                          test_utils=("test_autograd_registration", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("N,dp", [(49, BF16), (50, F32X3), (144, F32)], ids=["fused-bf16", "tiled-tf32x3", "folded-ieee"])
def test_packed_qkv_matches_views(backend, N, dp):
    """window_attention_packed(qkv) = window_attention on qkv's q, k, v views, bit for bit: the same
    output, the gradient of qkv equal to the stacked view gradients, the same bias gradient."""
    if backend == "triton" and not INTERP:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    dtype, precision = dp
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(8, N, 3, 2, 32, generator=g).to(dtype)
    bias = torch.randn(2, N, N, generator=g)
    mask = _swin_mask(4, N, "timm", g)
    go = torch.randn(8, 2, N, 32, generator=g).to(dtype)
    res = []
    for packed in (True, False):
        x = qkv.clone().requires_grad_(True)
        b = bias.clone().requires_grad_(True)
        kw = dict(bias=b, mask=mask, precision=precision, backend=backend)
        if packed:
            out = elsa_vision.window_attention_packed(x, **kw)
            if backend == "triton":  # qkv itself is the Function's input: no UnbindBackward stacks the gradients
                assert type(out.grad_fn).__name__ == "_PackedWindowAttentionBackward"
        else:
            q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)
            out = elsa_vision.window_attention(q, k, v, **kw)
        res.append((out, *torch.autograd.grad(out, (x, b), go)))
    for a, c in zip(*res):
        assert torch.equal(a, c)
    with pytest.raises(ValueError, match=r"\[B·nW, N, 3, H, D\]"):
        elsa_vision.window_attention_packed(qkv[:, :, :2], backend=backend)


def test_mask_table_follows_every_write():
    """The padded [nW, NR, NR] table of a shift mask is made from the mask as it is at each call —
    also after writes that bypass the version counter (through .data, or NumPy-shared memory) —
    and not made at all for a mask the kernel reads as is (N a multiple of 16)."""
    if not (INTERP or torch.cuda.is_available()):
        pytest.skip("needs the Triton kernels")
    from elsa_vision.kernels import window as W
    dev = "cpu" if INTERP else "cuda"
    m = torch.randn(4, 49, 49)
    md = m.to(dev)
    t1 = W._tables(None, md, 49, md)[2]
    assert t1.shape == (4, 64, 64) and torch.equal(t1[:, :49, :49], md) and not t1[:, 49:].any()
    md.data.add_(1)
    assert torch.equal(W._tables(None, md, 49, md)[2][:, :49, :49], md)
    if INTERP:
        arr = md.numpy()
        arr[:] = 3.0
        assert torch.equal(W._tables(None, md, 49, md)[2][:, :49, :49], md)
    m64 = torch.randn(4, 64, 64).to(dev)
    assert W._tables(None, m64, 64, m64)[2] is m64


@pytest.mark.parametrize("N,dp", [(49, BF16), (50, F16), (144, BF16)], ids=["fused-bf16", "tiled-fp16", "folded-bf16"])
def test_padded_and_in_place_tables_agree(N, dp, monkeypatch):
    """Half precision below PAD_TABLES_FROM windows × heads: the kernels read the bias and mask at
    row stride N (no padded copies); above (and float32 always), from 16-aligned padded copies.
    Same numbers, bitwise, both ways."""
    if not (INTERP or torch.cuda.is_available()):
        pytest.skip("needs the Triton kernels")
    from elsa_vision.kernels import window as W
    dev = "cpu" if INTERP else "cuda"
    dtype, precision = dp
    q, k, v, b, m = _inputs(2, 4, 2, N, 32, dtype)
    q, k, v = (t.detach().to(dev).requires_grad_(True) for t in (q, k, v))
    b, m = b.detach().to(dev).requires_grad_(True), m.to(dev)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(dev, dtype)
    res = []
    for threshold, nr in ((0, -(-N // 16) * 16), (1 << 30, N)):
        monkeypatch.setattr(W, "PAD_TABLES_FROM", threshold)
        assert W._tables(b, m, N, q, 16)[3] == nr and W._tables(b, m, N, q, None)[3] == -(-N // 16) * 16
        out = elsa_vision.window_attention(q, k, v, bias=b, mask=m, precision=precision, backend="triton")
        res.append((out, *torch.autograd.grad(out, (q, k, v, b), go)))
    for x, y in zip(*res):
        assert torch.equal(x, y)
    _check(q, k, v, b, m, precision=precision, backend="triton")  # (and the oracle rule, in place)


def test_tables_padded_when_the_gpu_sets_the_pace(monkeypatch):
    """In place only for eager half-precision calls below PAD_TABLES_FROM windows × heads: float32, a
    call captured into a CUDA graph and the custom op (what compiled graphs run) get padded tables."""
    from elsa_vision.kernels import window as W
    q16 = torch.zeros(2, 1, 1, 1, dtype=torch.bfloat16)
    assert W._work(q16, 4, 3) == 12
    assert W._work(q16.float(), 4, 3) is None
    if torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert W._work(q16.cuda(), 4, 3) is None
        assert W._work(q16, 4, 3) == 12  # a CPU tensor is never captured
    if not (INTERP or torch.cuda.is_available()):
        pytest.skip("the padded copy is made by a Triton kernel")
    dev = "cpu" if INTERP else "cuda"
    q = torch.zeros(4, 2, 49, 32, dtype=torch.bfloat16, device=dev)
    b, m = torch.zeros(2, 49, 49, device=dev), torch.zeros(2, 49, 49, device=dev)
    assert W._op_tables(q, b, m, None)[3] == 64
    assert W._op_tables(q[:0], b, m, None) is None


def test_tables_are_laid_out_for_the_kernel():
    """A bias that is not row-major (Swin v2's is a permuted view), padded or not, comes out with
    unit column stride and row stride NR, as the kernel reads it; so does one bias broadcast over the
    heads (head stride 0), and a bf16 bias (read as float32)."""
    if not (INTERP or torch.cuda.is_available()):
        pytest.skip("needs the Triton kernels")
    from elsa_vision.kernels import window as W
    dev = "cpu" if INTERP else "cuda"
    for n in (49, 64):
        nr = -(-n // 16) * 16
        b = torch.randn(n, n, 3, device=dev).permute(2, 0, 1)
        m = torch.randn(4, n, n, device=dev)
        for bias in (b, b.to(torch.bfloat16), b[:1].expand(3, n, n)):
            t, sb_h, mt, nr_ = W._tables(bias, m, n, b)
            assert nr_ == nr and t.stride()[1:] == (nr, 1) and mt.stride() == (nr * nr, nr, 1)
            assert sb_h == (0 if bias.stride(0) == 0 else t.stride(0))
            for h in range(3):
                assert torch.equal(t.flatten()[h * sb_h:][:nr * nr].view(nr, nr)[:n, :n], bias[h].float())
            assert torch.equal(mt[:, :n, :n], m)


@needs_interp
def test_in_place_mask_change_reaches_the_kernel():
    q, k, v, b, m = _inputs(1, 4, 2, 49, 16, torch.float32)
    _check(q, k, v, b, m, grads=False, backend="triton")
    with torch.no_grad():
        m[1:] = torch.where(m[1:] == 0, -100.0, 0.0)  # regions swapped in place
    _check(q, k, v, b, m, backend="triton")


@needs_interp
def test_torch_compile_fullgraph():
    q, k, v, b, m = _inputs(2, 4, 2, 49, 32, torch.float32)

    def f(q, k, v, b):
        return elsa_vision.window_attention(q, k, v, bias=b, mask=m, precision="ieee", backend="triton")

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, b)
    ref = f(q, k, v, b)
    assert max_err(out, ref) == 0
    out.sum().backward()
    assert b.grad is not None


@pytest.mark.skipif(not (INTERP or torch.cuda.is_available()), reason="needs the Triton kernels")
@pytest.mark.parametrize("N", [49, 64])
def test_custom_ops_fake_matches_real(N):
    """What torch.compile plans from the window ops' fakes is what they return — with N = 49 the
    bias gradient is the corner of a padded sum, and Swin v1's bias is a permuted view."""
    from elsa_vision.kernels import window as W
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, _, m = (t.detach().to(dev) if t is not None else None for t in _inputs(2, 4, 2, N, 32, torch.float32))
    bias = torch.randn(N, N, 2, device=dev).permute(2, 0, 1)
    args = (q, k, v, bias, m, 32 ** -0.5, "ieee", 0, 0)
    assert_fake_matches_real(torch.ops.elsa_vision.window_fwd.default, *args)
    out, stats, kept = W.window_fwd(*args)
    assert_fake_matches_real(torch.ops.elsa_vision.window_bwd.default, torch.randn_like(out), q, k, v, bias, m, out,
                             stats, 32 ** -0.5, "ieee", 0, 0, True)
    kb, km = W._keep_tables(bias, m, kept)
    assert_fake_matches_real(torch.ops.elsa_vision.window_bwd.default, torch.randn_like(out), q, k, v, kb, km, out,
                             stats, 32 ** -0.5, "ieee", 0, 0, True)
    # the packed op: qkv [BW, N, 3, H, D] in, its gradient in one piece out
    qkv = torch.randn(q.shape[0], N, 3, 2, 32, device=dev)
    args = (qkv, bias, m, 32 ** -0.5, "ieee", 0, 0)
    assert_fake_matches_real(torch.ops.elsa_vision.window_packed_fwd.default, *args)
    out, stats, _ = W.PACKED.fwd(*args)
    assert_fake_matches_real(torch.ops.elsa_vision.window_packed_bwd.default, torch.randn_like(out), qkv, bias, m,
                             out, stats, 32 ** -0.5, "ieee", 0, 0, True)


@needs_interp
@pytest.mark.parametrize("N,dtype,lead0", [(49, torch.float32, False), (49, torch.float32, True), (49, torch.bfloat16, True),
                                           (50, torch.float32, False), (64, torch.float32, False), (49, torch.float32, None)],
                         ids=["swin-v1", "shared-bias", "bf16-shared-bias", "tiled", "unpadded", "mask-only"])
def test_backward_reuses_the_forwards_padded_tables(N, dtype, lead0):
    """The forward op returns the padded bias / mask tables it made (N not a multiple of 16) and the
    backward op reads them in place of bias and mask, so a compiled graph pads once per call, not
    twice: bitwise the same gradients, the bias gradient in the bias's shape and dtype. A bias of
    another dtype than float32 keeps its own (the gradient's dtype follows the bias the backward
    gets); with N a multiple of 16 nothing is padded and nothing kept."""
    from elsa_vision.kernels import window as W
    q, k, v, b, m = (t.detach() for t in _inputs(2, 4, 2, N, 32, dtype))
    b = None if lead0 is None else b[:1].to(dtype).expand(2, N, N) if lead0 else b
    args = (q, k, v, b, m, 32 ** -0.5, "native" if dtype != torch.float32 else "ieee", 0, 0)
    out, stats, kept = W.window_fwd(*args)
    assert kept.numel() == (0 if N % 16 == 0 else (0 if b is None else 1 if lead0 else 2) * 64 * 64 + 4 * 64 * 64)
    kb, km = W._keep_tables(b, m, kept)
    reused = kept.numel() > 0 and (b is None or b.dtype == torch.float32)
    assert (kb is not b) == (reused and b is not None) and (km is not m) == reused
    do = torch.randn_like(out)
    ref = W.window_bwd(do, q, k, v, b, m, out, stats, *args[5:], b is not None)
    got = W.window_bwd(do, q, k, v, kb, km, out, stats, *args[5:], b is not None)
    for r, g in zip(ref, got):
        assert r.shape == g.shape and r.dtype == g.dtype and torch.equal(r, g)
    if b is not None:
        assert got[3].shape == (2, N, N) and got[3].dtype == b.dtype


# ---------------------------------------------------------------------------------------------
# reference backend (pure torch, chunked over windows)


@pytest.mark.parametrize("N,nW,dtype", [(49, 4, torch.float32), (50, 1, torch.float64), (64, 4, torch.bfloat16),
                                        (144, 4, torch.float32), (256, 1, torch.float32)])
def test_reference_matches_oracle(N, nW, dtype):
    q, k, v, b, m = _inputs(2, nW, 2, N, 16, dtype, seed=5)
    _check(q, k, v, b, m, backend="reference")


def test_reference_chunks_without_expanding():
    """Small chunks (several windows per chunk, window ids crossing chunk edges) give the same result,
    and the scores of at most one chunk exist at a time."""
    from elsa_vision.kernels import reference
    q, k, v, b, m = _inputs(3, 4, 2, 49, 16, torch.float64, mask="inf", seed=6)
    b = b.detach().double().requires_grad_(True)
    full = _timm_path(q, k, v, b, m, 0.25, torch.float64)
    H, N = 2, 49
    out = reference.window_attention(q, k, v, b, m, 0.25, chunk_elems=5 * H * N * N)
    assert max_err(out, full) < 1e-12
    g = torch.randn_like(out)
    a = torch.autograd.grad(out, (q, k, v, b), g)
    c = torch.autograd.grad(full, (q, k, v, b), g)
    for x, y in zip(a, c):
        assert max_err(x, y) < 1e-12


def test_reference_on_cpu_without_interpreter(monkeypatch):
    """Without the interpreter, CPU tensors go to the reference backend (and 'triton' explains why not)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, b, m = _inputs(2, 4, 2, 49, 16, torch.float32)
    p = dispatch.Problem(op="window_attention", device="cpu", dtype=torch.float32, head_dim=16,
                         has_bias=True, has_mask=True, window_tokens=49)
    assert dispatch.select(p).name == "reference"
    with pytest.raises(elsa_vision.NotSupportedError, match="device 'cpu'"):
        elsa_vision.window_attention(q, k, v, bias=b, mask=m, backend="triton")
    _check(q, k, v, b, m)


def test_dispatch_limits():
    p = dispatch.Problem(op="window_attention", device="cuda", dtype=torch.float32, head_dim=32, window_tokens=300)
    triton_backend = next(b for b in dispatch.BACKENDS if b.name == "triton")
    assert any("300 tokens" in r for r in triton_backend.not_supported_reasons(p))
    p = dispatch.Problem(op="window_attention", device="cuda", dtype=torch.float32, head_dim=160, window_tokens=49)
    assert any("head dim 160" in r for r in triton_backend.not_supported_reasons(p))
    p = dispatch.Problem(op="window_attention", device="cuda", dtype=torch.float32, head_dim=32, window_tokens=256)
    if triton_backend.available() is None:
        assert triton_backend.not_supported_reasons(p) == []


# ---------------------------------------------------------------------------------------------
# validation: clear errors


def test_bad_inputs_raise_clear_errors():
    wa = elsa_vision.window_attention
    q = torch.randn(8, 2, 49, 16)
    m = torch.zeros(4, 49, 49)
    with pytest.raises(TypeError, match="mask is a torch.sparse_coo tensor"):
        wa(q, q, q, mask=m.to_sparse())
    with pytest.raises(TypeError, match="k is a torch.sparse_coo tensor"):
        wa(q, q.to_sparse(), q)
    x = torch.randn(1, 8, 8, 2, 16)
    for size in (0, -4, (4, 0)):
        with pytest.raises(ValueError, match="window_size must be at least 1"):
            elsa_vision.shifted_window_attention(x, x, x, window_size=size)
    with pytest.raises(TypeError, match="qkv is a torch.sparse_coo tensor"):
        elsa_vision.shifted_window_attention(torch.randn(1, 4, 4, 3, 2, 16).to_sparse(), window_size=4)
    with pytest.raises(ValueError, match="not a multiple of the mask's nW = 3"):
        wa(q, q, q, mask=torch.zeros(3, 49, 49))
    with pytest.raises(ValueError, match=r"mask must be \[nW, N, N\]"):
        wa(q, q, q, mask=torch.zeros(4, 49, 50))
    with pytest.raises(ValueError, match=r"mask must be \[nW, N, N\]"):
        wa(q, q, q, mask=torch.zeros(49, 49))
    with pytest.raises(ValueError, match=r"bias must be \[H, N, N\]"):
        wa(q, q, q, bias=torch.zeros(3, 49, 49))
    with pytest.raises(ValueError, match=r"bias must be \[H, N, N\]"):
        wa(q, q, q, bias=torch.zeros(2, 2, 49, 49))
    with pytest.raises(ValueError, match="block must be one of"):
        wa(q, q, q, block=96)
    with pytest.raises(ValueError, match="block must be one of"):
        wa(q, q, q, block=True)
    with pytest.raises(ValueError, match="self-attention inside each window"):
        wa(q, torch.randn(8, 2, 50, 16), torch.randn(8, 2, 50, 16))
    with pytest.raises(ValueError, match="takes no gradient"):
        wa(q, q, q, mask=m.clone().requires_grad_(True))
    with pytest.raises(TypeError, match="must be floating point"):
        wa(q, q, q, mask=m.long())
    with pytest.raises(ValueError, match="4-D"):
        wa(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="precision must be one of"):
        wa(q, q, q, precision="fast")
    # an unsupported head dim on the Triton backend names the limit
    p = dispatch.Problem(op="window_attention", device="cuda", dtype=torch.float32, head_dim=160, window_tokens=49)
    with pytest.raises(elsa_vision.NotSupportedError, match=r"head dim 160 outside \[16, 128\]"):
        dispatch.select(p, "triton")


def test_repeated_calls_keep_their_checks():
    """A repeated call skips the checks it passed before (api._CALLS) — but only when nothing
    they read differs: a mask that now wants a gradient, another dtype, a bool mask, an autocast that
    must cast, or another float32 matmul setting each take the checks (and their answer) again."""
    from elsa_vision import api
    api._CALLS.clear()
    qkv = torch.randn(8, 49, 3, 2, 16)
    m = torch.zeros(4, 49, 49)
    m[1:, :, 20:] = -100.0
    b = torch.randn(2, 49, 49)
    kw = dict(bias=b, mask=m, backend="reference")
    first = elsa_vision.window_attention_packed(qkv, **kw)
    assert len(api._CALLS) == 1
    assert torch.equal(elsa_vision.window_attention_packed(qkv, **kw), first)
    assert len(api._CALLS) == 1
    with pytest.raises(ValueError, match="takes no gradient"):
        elsa_vision.window_attention_packed(qkv, bias=b, mask=m.clone().requires_grad_(True), backend="reference")
    with pytest.raises(TypeError, match="must be floating point"):
        elsa_vision.window_attention_packed(qkv, bias=b, mask=m.long(), backend="reference")
    keep = m == 0  # the same mask as a bool keep-mask: converted on every call, never kept
    assert torch.allclose(elsa_vision.window_attention_packed(qkv, bias=b, mask=keep, backend="reference"),
                          elsa_vision.window_attention_packed(qkv, bias=b, mask=torch.where(keep, 0.0, float("-inf")),
                                                              backend="reference"))
    with pytest.raises(ValueError, match="precision must be one of"):
        elsa_vision.window_attention_packed(qkv, precision="fast", **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert elsa_vision.window_attention_packed(qkv, **kw).dtype == torch.bfloat16
        assert elsa_vision.window_attention_packed(qkv, **kw).dtype == torch.bfloat16
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    assert torch.equal(elsa_vision.window_attention(q, k, v, **kw), first)
    assert torch.equal(elsa_vision.window_attention(q, k, v, **kw), first)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        key = api._call_key("window_packed", (qkv, b, m), (None, "auto", "auto", "reference"))
        torch.set_float32_matmul_precision("highest")
        assert key != api._call_key("window_packed", (qkv, b, m), (None, "auto", "auto", "reference"))
    finally:
        torch.set_float32_matmul_precision(old)
    # 1 and True hash alike: the kept scale=1 must not let scale=True through
    elsa_vision.window_attention_packed(qkv, scale=1, **kw)
    elsa_vision.window_attention_packed(qkv, scale=1, **kw)
    for _ in range(2):
        with pytest.raises(TypeError, match="scale must be a Python number"):
            elsa_vision.window_attention_packed(qkv, scale=True, **kw)
    assert api._call_key("window_packed", (qkv, b, m), (torch.tensor(1.0), "auto", "auto", "reference")) is None


def test_empty_batch():
    q = torch.randn(0, 2, 49, 16, requires_grad=True)
    out = elsa_vision.window_attention(q, q, q, mask=torch.zeros(4, 49, 49))
    assert out.shape == q.shape
    out.sum().backward()


# ---------------------------------------------------------------------------------------------
# GPU: real Swin sizes (run with `pytest -m gpu`)

# (batch·nW, nW, heads, N): Swin-T stages at batch 8 (stage 1 with the shifted-window mask), SwinV2
# window 8 and window 16, and Swin-B 384 (window 12)
GPU_SHAPES = [(512, 64, 3, 49), (128, 16, 6, 49), (32, 4, 12, 49), (8, 1, 24, 49),
              (256, 64, 3, 64), (64, 16, 3, 256), (128, 16, 8, 144)]


@gpu
@needs_cuda
@pytest.mark.parametrize("BW,nW,H,N", GPU_SHAPES)
@pytest.mark.parametrize("dp", [(torch.float32, "tf32x3"), (torch.float32, "fp16x3"), (torch.float32, "ieee"),
                                (torch.bfloat16, "auto"), (torch.float16, "auto")],
                         ids=["fp32-tf32x3", "fp32-fp16x3", "fp32-ieee", "bf16", "fp16"])
@pytest.mark.parametrize("block", ["auto", 64, 128, 256])
def test_gpu_swin_sizes(BW, nW, H, N, dp, block):
    dtype, precision = dp
    q, k, v, b, m = _inputs(BW // nW, nW, H, N, 32, dtype)
    q, k, v = (t.detach().cuda().requires_grad_(True) for t in (q, k, v))
    b = b.detach().cuda().requires_grad_(True)
    _check(q, k, v, b, m.cuda(), block=block, precision=precision, backend="triton")


@pytest.mark.parametrize("N,nW", [(64, 4), (49, 4)], ids=["in-place", "padded"])
def test_bias_dtype_may_change_between_calls(N, nW):
    """Calls that differ only in the bias's dtype (read in place, so the kernel's pointer type
    differs: Swin v2's float32 fused position bias beside a half-precision one) each get a kernel
    compiled for their dtype — on a GPU the planned launches keep one per dtype — and follow the
    oracle rule in any order."""
    q, k, v, b, m = _inputs(2, nW, 2, N, 32, torch.bfloat16, seed=3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (t.detach().to(dev).requires_grad_(True) for t in (q, k, v))
    m = m.to(dev)
    for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32):
        bias = b.detach().to(dev, dtype).requires_grad_(True)
        for t in (q, k, v):
            t.grad = None
        _check(q, k, v, bias, m, backend="triton")


@gpu
@needs_cuda
def test_gpu_tf32_against_tf32_torch():
    """precision='tf32' is compared with the same math on tf32-rounded operands (what torch's TF32
    matmuls read; emulated, since whether torch honours its TF32 switch varies by version)."""
    q, k, v, b, m = _inputs(8, 64, 3, 49, 32, torch.float32)
    q, k, v = (t.detach().cuda().requires_grad_(True) for t in (q, k, v))
    b = b.detach().cuda().requires_grad_(True)
    _check(q, k, v, b, m.cuda(), precision="tf32", backend="triton")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_deterministic_and_memory(dtype):
    """Bitwise-reproducible gradients, and peak memory well under the [B·nW, H, N, N] tensor timm builds."""
    BW, nW, H, N, D = 4096, 64, 3, 49, 32
    q, k, v, b, m = _inputs(BW // nW, nW, H, N, D, dtype)
    q, k, v = (t.detach().cuda().requires_grad_(True) for t in (q, k, v))
    b, m = b.detach().cuda().requires_grad_(True), m.cuda()

    def run():
        out = elsa_vision.window_attention(q, k, v, bias=b, mask=m, backend="triton")
        return torch.autograd.grad(out, (q, k, v, b), torch.ones_like(out))

    g1 = run()
    g2 = run()
    for a, c in zip(g1, g2):
        assert torch.equal(a, c)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    # what any implementation must allocate: the four gradients and the output (and its grad)
    needed = sum(t.numel() * t.element_size() for t in (q, k, v, b)) + 2 * q.numel() * q.element_size()
    extra = torch.cuda.max_memory_allocated() - base - needed
    expanded = BW * H * N * N * 4
    assert extra < expanded / 2, f"working memory {extra / 2**20:.1f} MiB vs expanded mask {expanded / 2**20:.1f} MiB"


@gpu
@needs_cuda
@pytest.mark.parametrize("N", [49, 144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_packed_qkv_matches_views(N, dtype):
    """window_attention_packed at Swin sizes: output, qkv gradient and bias gradient bitwise those
    of window_attention on the q, k, v views."""
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(512, N, 3, 3, 32, device="cuda", generator=g).to(dtype)
    bias = torch.randn(3, N, N, device="cuda", generator=g)
    mask = _swin_mask(64, N).cuda()
    go = torch.randn(512, 3, N, 32, device="cuda", generator=g).to(dtype)
    res = []
    for packed in (True, False):
        x, b = qkv.clone().requires_grad_(True), bias.clone().requires_grad_(True)
        if packed:
            out = elsa_vision.window_attention_packed(x, bias=b, mask=mask, backend="triton")
        else:
            out = elsa_vision.window_attention(*x.permute(2, 0, 3, 1, 4).unbind(0), bias=b, mask=mask, backend="triton")
        res.append((out, *torch.autograd.grad(out, (x, b), go)))
    for a, c in zip(*res):
        assert torch.equal(a, c)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_cuda_graph_capture(dtype):
    """Forward + backward captured once in a CUDA graph (no host synchronisation, allocations from the
    graph's pool) and replayed on new values in the same buffers: bitwise equal to eager calls."""
    q, k, v, b, m = _inputs(4, 16, 6, 49, 32, dtype)
    q, k, v = (t.detach().cuda().requires_grad_(True) for t in (q, k, v))
    b, m = b.detach().cuda().requires_grad_(True), m.cuda()
    go = torch.randn(q.shape, device="cuda", dtype=dtype)

    def step():
        out = elsa_vision.window_attention(q, k, v, bias=b, mask=m, backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v, b), go))

    def refill():
        for t in (q, k, v, b, m, go):
            t.copy_(torch.randn_like(t) if t is not m else t.flip(0))

    assert_graph_replay_matches_eager(step, refill)


def test_window_empty_input_still_checks_backend_and_nan_stays_nan():
    x = torch.randn(4, 2, 7, 16)
    with pytest.raises(Exception, match="bogus"):
        elsa_vision.window_attention(x[:0], x[:0], x[:0], backend="bogus")
    q = x.clone()
    q[1, 0, 3, 0] = float("nan")
    out = elsa_vision.window_attention(q, x, x, backend="reference")
    assert out[1, 0, 3].isnan().all() and not out[0].isnan().any()


# ---------------------------------------------------------------------------------------------
# shifted_window_attention: windows read in place from image rows (Swin blocks)


def _shift_mask(ih: int, iw: int, wh: int, ww: int, sh: int, sw: int) -> torch.Tensor:
    """timm's shifted-window mask (SwinTransformerBlock.get_attn_mask) for an ih × iw image."""
    from elsa_vision.kernels.reference import Geometry, to_windows
    img = torch.zeros(ih, iw)
    cnt = 0
    for hs in ((0, -wh), (-wh, -sh), (-sh, None)):
        for ws in ((0, -ww), (-ww, -sw), (-sw, None)):
            img[hs[0]:hs[1], ws[0]:ws[1]] = cnt
            cnt += 1
    # timm partitions the region map without rolling it: the map is drawn in rolled coordinates
    win = to_windows(img.reshape(-1, 1), Geometry(1, ih, iw, wh, ww, 0, 0, ih, iw))[..., 0]
    m = win[:, None, :] - win[:, :, None]
    return m.masked_fill(m != 0, -100.0).masked_fill(m == 0, 0.0)


def _image_inputs(B, ih, iw, H, D, dtype, wh, ww, sh, sw, *, device="cpu", seed=0, mask="timm"):
    g = torch.Generator().manual_seed(seed)
    N = wh * ww
    qkv = torch.randn(B, ih, iw, 3, H, D, generator=g).to(device, dtype).requires_grad_(True)
    bias = (torch.randn(H, N, N, generator=g) * 2).to(device).requires_grad_(True)
    m = None
    if mask == "timm" and (sh or sw):
        m = _shift_mask(ih, iw, wh, ww, sh, sw).to(device)
    elif mask == "random":
        m = _swin_mask((ih // wh) * (iw // ww), N, "timm", g).to(device)
    return qkv, bias, m


def _check_shifted(qkv, bias, mask, window, shift, *, packed=True, image=None, **kw):
    """shifted_window_attention on image rows against the oracle of the same windows (the exactness rule), the
    windows taken by the reference roll + partition (exact: a permutation). ``image``: the image's
    (rows, columns) in a padded map. Returns (out, grads)."""
    from elsa_vision.kernels.reference import Geometry, to_windows
    B, ih, iw, _, H, D = qkv.shape
    geo = Geometry(B, ih, iw, *window, *shift, *(image or (ih, iw)))
    if image is not None:
        kw["image_size"] = image
    if packed:
        out = elsa_vision.shifted_window_attention(qkv, window_size=window, shift_size=shift, bias=bias, mask=mask, **kw)
    else:
        out = elsa_vision.shifted_window_attention(*qkv.unbind(3), window_size=window, shift_size=shift, bias=bias,
                                                   mask=mask, **kw)
    assert out.shape == (B, ih, iw, H, D) and out.dtype == qkv.dtype and out.is_contiguous()
    qw, kw_, vw = (to_windows(t.reshape(-1, H, D), geo).transpose(1, 2) for t in qkv.unbind(3))
    ow = to_windows(out.reshape(-1, H, D), geo).transpose(1, 2)
    sc = 1 / math.sqrt(D)
    ref = _timm_path(qw, kw_, vw, bias, mask, sc, qkv.dtype)
    orc = _timm_path(qw, kw_, vw, bias, mask, sc, torch.float64)
    e, r = max_err(ow, orc), max_err(ref, orc)
    assert e <= tolerance(r, qkv.dtype), f"output: err {e:.3g} vs torch {r:.3g}"
    g = torch.randn(ow.shape, generator=torch.Generator().manual_seed(1)).to(qkv.device, qkv.dtype)
    leaves = (qkv, bias)
    gx = torch.autograd.grad(ow, leaves, g)
    gr = torch.autograd.grad(ref, leaves, g)
    go = torch.autograd.grad(orc, leaves, g.double())
    for name, a, b, c in zip(("qkv", "bias"), gx, gr, go):
        e, r = max_err(a, c), max_err(b, c)
        assert e <= tolerance(r, qkv.dtype, grad=True), f"d{name}: err {e:.3g} vs torch {r:.3g}"
    return out, gx


# (batch, image h, w, heads, D, window, shift, (dtype, precision)): every backward form and shift
SHIFTED = [
    (2, 14, 14, 2, 32, (7, 7), (3, 3), BF16),      # Swin-T stage geometry, fused backward
    (1, 14, 21, 2, 32, (7, 7), (3, 3), F32),       # tiled float32 backward, a non-square image
    (1, 16, 16, 1, 32, (8, 8), (4, 4), F16X3),     # SwinV2 window 8
    (1, 12, 8, 2, 16, (6, 4), (3, 1), F32X3),      # non-square window, unequal shifts
    (1, 24, 12, 1, 32, (12, 12), (6, 6), BF16),    # N = 144: tiled half-precision backward
    (2, 7, 7, 2, 32, (7, 7), (0, 0), F16),         # one window, no shift (Swin-T's last stage)
]


@needs_interp
@pytest.mark.parametrize("B,ih,iw,H,D,window,shift,dp", SHIFTED,
                         ids=[f"{c[1]}x{c[2]}-w{c[5][0]}x{c[5][1]}-s{c[6][0]}{c[6][1]}-{str(c[7][0])[6:]}-{c[7][1]}"
                              for c in SHIFTED])
def test_shifted_matches_oracle(B, ih, iw, H, D, window, shift, dp):
    dtype, precision = dp
    qkv, bias, mask = _image_inputs(B, ih, iw, H, D, dtype, *window, *shift, mask="timm" if window[0] == 7 else "random")
    out, grads = _check_shifted(qkv, bias, mask, window, shift, precision=precision, backend="triton")
    # q, k, v given apart: the same kernels, bitwise
    out2, grads2 = _check_shifted(qkv, bias, mask, window, shift, packed=False, precision=precision, backend="triton")
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_shifted_is_roll_partition_window_attention(backend):
    """The definition, on each backend: roll by −shift, partition, window_attention_packed, merge,
    roll back — the same numbers (bitwise on Triton: the same kernels read the same windows)."""
    if backend == "triton" and not INTERP:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    from elsa_vision.kernels.reference import Geometry, from_windows, to_windows
    B, ih, iw, H, D, (wh, ww), (sh, sw) = 2, 14, 14, 2, 16, (7, 7), (3, 2)
    qkv, bias, mask = _image_inputs(B, ih, iw, H, D, torch.float32, wh, ww, sh, sw, mask="random")
    geo = Geometry(B, ih, iw, wh, ww, sh, sw, ih, iw)
    go = torch.randn(B, ih, iw, H, D)
    out = elsa_vision.shifted_window_attention(qkv, window_size=(wh, ww), shift_size=(sh, sw), bias=bias, mask=mask,
                                               backend=backend)
    g1 = torch.autograd.grad(out, (qkv, bias), go)
    win = to_windows(qkv.reshape(-1, 3, H, D), geo)
    ow = elsa_vision.window_attention_packed(win, bias=bias, mask=mask, backend=backend)
    ref = from_windows(ow.transpose(1, 2), geo).reshape(out.shape)
    g2 = torch.autograd.grad(ref, (qkv, bias), go)
    if backend == "triton":
        assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    else:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


# (image rows, columns, window, shift): the map is padded to the next multiple of the window
PADDED = [(5, 7, (4, 4), (2, 2)), (9, 8, (4, 4), (2, 2)), (8, 6, (4, 4), (0, 0)), (3, 10, (4, 3), (1, 2)),
          (6, 6, (4, 4), (3, 1)), (4, 5, (4, 4), (1, 2)), (2, 8, (4, 4), (3, 1))]  # (columns only; shift ≥ rows)
PADDED_IDS = [f"{r}x{c}-w{w[0]}x{w[1]}-s{s[0]}{s[1]}" for r, c, w, s in PADDED]


def _padded(rows, cols, wh, ww):
    return rows + (-rows) % wh, cols + (-cols) % ww


@pytest.mark.parametrize("window,shift", [((7, 7), (3, 3)), ((4, 3), (1, 2)), ((4, 4), (0, 0))])
def test_geometry_is_timms_roll_and_partition(window, shift):
    """to_windows of an unpadded map, which the reference backend's shifted path and the shifted
    tests' oracle both use, is timm's own torch.roll by −shift and window_partition."""
    swin = pytest.importorskip("timm.models.swin_transformer")
    from elsa_vision.kernels.reference import Geometry, to_windows
    (wh, ww), (sh, sw) = window, shift
    ih, iw = 2 * wh, 3 * ww
    img = torch.randn(2, ih, iw, 5)
    want = swin.window_partition(torch.roll(img, shifts=(-sh, -sw), dims=(1, 2)), (wh, ww)).reshape(-1, wh * ww, 5)
    assert torch.equal(to_windows(img.reshape(-1, 5), Geometry(2, ih, iw, wh, ww, sh, sw, ih, iw)), want)


@pytest.mark.parametrize("rows,cols,window,shift", PADDED, ids=PADDED_IDS)
def test_padded_geometry_is_timms_roll_then_pad(rows, cols, window, shift):
    """to_windows of a padded map — the image in its top-left corner, pad tokens after it — is timm's
    roll of the image, then its pad at the bottom and right, then the partition (the pad tokens all
    alike, as timm's projection of zeros), for the values; as a permutation of the map's tokens it is
    undone by from_windows."""
    from elsa_vision.kernels.reference import Geometry, from_windows, to_windows
    (wh, ww), (sh, sw) = window, shift
    ih, iw = _padded(rows, cols, wh, ww)
    img = torch.randn(2, rows, cols, 3)
    pad = (0, 0, 0, iw - cols, 0, ih - rows)
    timm = F.pad(torch.roll(img, shifts=(-sh, -sw), dims=(1, 2)), pad, value=0.5)
    want = to_windows(timm.reshape(-1, 3), Geometry(2, ih, iw, wh, ww, 0, 0, ih, iw))
    geo = Geometry(2, ih, iw, wh, ww, sh, sw, rows, cols)
    stored = F.pad(img, pad, value=0.5).reshape(-1, 3)
    assert torch.equal(to_windows(stored, geo), want)
    ids = torch.arange(2 * ih * iw, dtype=torch.float64)[:, None]
    assert torch.equal(from_windows(to_windows(ids, geo), geo), ids)


@pytest.mark.parametrize("rows,cols,window,shift", PADDED, ids=PADDED_IDS)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_shifted_padded_matches_oracle(rows, cols, window, shift, backend):
    """An image padded to the window's multiple (``image_size``): the exactness rule against the
    oracle of timm's windows, outputs and gradients (the pad tokens' too), on each backend; with
    timm's shift mask of the padded map where there is a shift."""
    if backend == "triton" and not INTERP:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    (wh, ww), (sh, sw) = window, shift
    ih, iw = _padded(rows, cols, wh, ww)
    qkv, bias, mask = _image_inputs(2, ih, iw, 2, 16, torch.float32, wh, ww, sh, sw)
    _check_shifted(qkv, bias, mask, window, shift, image=(rows, cols), backend=backend)


def test_shifted_padded_bf16_kernels_match_oracle():
    """The half-precision kernels on a padded Swin-like map (9 × 9 image in a 12 × 12 map, window 4,
    shift 2), q, k, v given apart and packed: bitwise the same."""
    if not INTERP:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    qkv, bias, mask = _image_inputs(1, 12, 12, 2, 32, torch.bfloat16, 4, 4, 2, 2)
    out, grads = _check_shifted(qkv, bias, mask, (4, 4), (2, 2), image=(9, 9), backend="triton")
    out2, grads2 = _check_shifted(qkv, bias, mask, (4, 4), (2, 2), image=(9, 9), packed=False, backend="triton")
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_shifted_bad_inputs_raise_clear_errors():
    swa = elsa_vision.shifted_window_attention
    qkv = torch.randn(1, 14, 14, 3, 2, 16)
    q = torch.randn(1, 14, 14, 2, 16)
    with pytest.raises(ValueError, match="not tiled by 7×6 windows; pad it"):
        swa(qkv, window_size=(7, 6))
    with pytest.raises(ValueError, match=r"shift_size \(7, 0\) must lie in \[0, window_size\)"):
        swa(qkv, window_size=7, shift_size=(7, 0))
    with pytest.raises(TypeError, match="window_size must be an int or a pair of ints"):
        swa(qkv, window_size=7.0)
    with pytest.raises(TypeError, match="shift_size must be an int or a pair of ints"):
        swa(qkv, window_size=7, shift_size=(1, 2, 3))
    with pytest.raises(ValueError, match="mask has 3 window slices but a 14×14 image has 4 windows"):
        swa(qkv, window_size=7, shift_size=3, mask=torch.zeros(3, 49, 49))
    with pytest.raises(ValueError, match=r"bias must be \[H, N, N\]"):
        swa(qkv, window_size=7, bias=torch.zeros(2, 48, 48))
    with pytest.raises(ValueError, match=r"packed qkv must be \[B, height, width, 3, H, D\]"):
        swa(q, window_size=7)
    with pytest.raises(ValueError, match="pass both k and v"):
        swa(q, q, window_size=7)
    with pytest.raises(ValueError, match="5-D"):
        swa(q[0], q[0], q[0], window_size=7)
    with pytest.raises(ValueError, match="one shape"):
        swa(q, q, q[:, :7], window_size=7)
    with pytest.raises(TypeError, match="share a dtype"):
        swa(q, q.double(), q, window_size=7)
    with pytest.raises(ValueError, match="takes no gradient"):
        swa(qkv, window_size=7, mask=torch.zeros(4, 49, 49, requires_grad=True))
    with pytest.raises(ValueError, match=r"image_size \(7, 14\) must lie within the 14×14 map and leave less than"):
        swa(qkv, window_size=7, image_size=(7, 14))
    with pytest.raises(ValueError, match="image_size"):
        swa(qkv, window_size=7, image_size=(15, 14))
    with pytest.raises(TypeError, match="image_size must be an int or a pair of ints"):
        swa(qkv, window_size=7, image_size=(14.0, 14))
    p = dispatch.Problem(op="shifted_window_attention", device="cuda", dtype=torch.float32, head_dim=32,
                         window_tokens=400)
    with pytest.raises(elsa_vision.NotSupportedError, match="window of 400 tokens exceeds 256"):
        dispatch.select(p, "triton")


def test_shifted_repeated_calls_keep_their_checks():
    """A repeated signature skips the checks (kept decisions) and still gives the checked call's
    result; a call the checks refuse is refused on a kept signature too."""
    qkv, bias, mask = _image_inputs(1, 14, 14, 2, 16, torch.float32, 7, 7, 3, 3)
    kw = dict(window_size=7, shift_size=3, bias=bias, mask=mask, backend="reference")
    a = elsa_vision.shifted_window_attention(qkv, **kw)
    b = elsa_vision.shifted_window_attention(qkv, **kw)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="shift_size"):
        elsa_vision.shifted_window_attention(qkv, **{**kw, "shift_size": 9})
    with pytest.raises(ValueError, match="mask has 1 window slices"):
        elsa_vision.shifted_window_attention(qkv, **{**kw, "mask": mask[:1]})


# Swin-T stages at batch 4 (image, heads, window, shift), SwinV2 window 8 and 16
GPU_IMAGES = [(56, 3, 7, 3), (28, 6, 7, 3), (14, 12, 7, 3), (7, 24, 7, 0), (64, 3, 8, 4), (64, 3, 16, 8)]


def _bitwise_as_taken_apart(qkv, bias, mask, w, s, precision, image=None):
    """shifted_window_attention on image rows is bitwise the kernels' own result on its windows taken
    apart (the reference roll, pad and partition, window_attention_packed, the inverse), outputs and
    gradients."""
    from elsa_vision.kernels.reference import Geometry, from_windows, to_windows
    B, ih, iw, _, H, D = qkv.shape
    geo = Geometry(B, ih, iw, w, w, s, s, *(image or (ih, iw)))
    out = elsa_vision.shifted_window_attention(qkv, window_size=w, shift_size=s, bias=bias, mask=mask,
                                               precision=precision, backend="triton", image_size=image)
    ow = elsa_vision.window_attention_packed(to_windows(qkv.reshape(-1, 3, H, D), geo), bias=bias, mask=mask,
                                             precision=precision, backend="triton")
    ref = from_windows(ow.transpose(1, 2), geo).reshape(out.shape)
    g = torch.randn(out.shape, device=out.device, dtype=out.dtype)
    assert torch.equal(out, ref)
    a = torch.autograd.grad(out, (qkv, bias), g)
    b = torch.autograd.grad(ref, (qkv, bias), g)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@gpu
@needs_cuda
@pytest.mark.parametrize("side,H,w,s", GPU_IMAGES, ids=[f"{c[0]}px-w{c[2]}" for c in GPU_IMAGES])
@pytest.mark.parametrize("dp", [(torch.float32, "fp16x3"), (torch.float32, "tf32x3"), (torch.float32, "ieee"),
                                (torch.bfloat16, "auto")], ids=["fp32-fp16x3", "fp32-tf32x3", "fp32-ieee", "bf16"])
def test_gpu_shifted_swin_sizes(side, H, w, s, dp):
    dtype, precision = dp
    qkv, bias, mask = _image_inputs(4, side, side, H, 32, dtype, w, w, s, s, device="cuda")
    _check_shifted(qkv, bias, mask, (w, w), (s, s), precision=precision, backend="triton")
    _bitwise_as_taken_apart(qkv, bias, mask, w, s, precision)


# Swin-T at 256 px: its stages' maps (64, 32, 16, 8 tokens a side) padded to the 7 × 7 windows' multiple
GPU_PADDED = [(64, 3, 7, 3), (32, 6, 7, 3), (16, 12, 7, 3), (8, 24, 7, 3)]


@gpu
@needs_cuda
@pytest.mark.parametrize("side,H,w,s", GPU_PADDED, ids=[f"{c[0]}px-w{c[2]}" for c in GPU_PADDED])
@pytest.mark.parametrize("dp", [(torch.float32, "fp16x3"), (torch.float32, "ieee"), (torch.bfloat16, "auto")],
                         ids=["fp32-fp16x3", "fp32-ieee", "bf16"])
def test_gpu_shifted_padded_swin_sizes(side, H, w, s, dp):
    """Padded maps on the GPU's kernels: the exactness rule against the oracle of timm's windows,
    and bitwise the kernels' own result on those windows taken apart."""
    dtype, precision = dp
    grid = side + (-side) % w
    qkv, bias, mask = _image_inputs(4, grid, grid, H, 32, dtype, w, w, s, s, device="cuda")
    _check_shifted(qkv, bias, mask, (w, w), (s, s), image=(side, side), precision=precision, backend="triton")
    _bitwise_as_taken_apart(qkv, bias, mask, w, s, precision, image=(side, side))
