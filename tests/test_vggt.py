"""VGGT adapter: exact attention, lean memory, token merging.

CPU tests run on a tiny stand-in of vggt's module tree (tests/vggt_standin.py, served through
``register_classes``) with the Triton kernels in the interpreter; with ``vggt`` importable the same
checks run on the real model (random weights, small images; marked slow); a FastVGGT checkout
(``$FASTVGGT_SRC`` or third_party/FastVGGT) is checked in a subprocess, since it installs under the
same package name as vggt. GPU tests (``-m gpu``) use the real model at 392×518.

Model-level rule (elsa_vision.verify.tolerance): max |patched − oracle| ≤ 2 · max |unpatched − oracle| + 1e-6 per
output, the oracle being the unpatched model in float64.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import elsa_vision
from elsa_vision.adapters import registry
from elsa_vision.adapters import vggt as A
from elsa_vision.adapters.vggt import lean as AL
from elsa_vision.verify import max_err, tolerance

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vggt_standin as V  # noqa: E402

OUTPUTS = ("pose_enc", "depth", "depth_conf", "world_points", "world_points_conf")
HAS_VGGT = importlib.util.find_spec("vggt") is not None and importlib.util.find_spec("vggt.models") is not None
ROOT = Path(__file__).resolve().parents[1]


# the blocks' fused residual passes serve this file's test-sized calls too (see conftest.fused_blocks)
pytestmark = pytest.mark.usefixtures("fused_blocks")


@pytest.fixture(scope="module")
def standin():
    remove = A.register_classes(**V.CLASSES)
    yield
    remove()


def make_standin(seed=0, **kw):
    torch.manual_seed(seed)
    return V.VGGT(**kw).eval()


def frames(S=3, B=1, hw=(42, 70), seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, S, 3, *hw, generator=g)


def run(model, x, **autocast):
    with torch.no_grad():
        if autocast:
            with torch.autocast(**autocast):
                return {k: v for k, v in model(x).items() if k in OUTPUTS}
        return {k: v for k, v in model(x).items() if k in OUTPUTS}


def oracle_outputs(model, x):
    """The unpatched model in float64 (on a copy)."""
    m64 = copy.deepcopy(model).double()
    elsa_vision.unpatch(m64)
    return run(m64, x.double())


def assert_rule(out, ref, oracle, keys=OUTPUTS, what=""):
    for key in keys:
        e, r = max_err(out[key], oracle[key]), max_err(ref[key], oracle[key])
        assert math.isfinite(e) and e <= tolerance(r, out[key].dtype), \
            f"{what}{key}: |patched - oracle| = {e:.3g} > 2 x |unpatched - oracle| ({r:.3g}) + 1e-6"


def assert_equal(a, b, keys=OUTPUTS):
    for key in keys:
        assert torch.equal(a[key], b[key]), f"{key} differs by {max_err(a[key], b[key]):.3g}"


def calls(model):
    return {n: (s.calls, s.delegated) for n, s in registry.patched_modules(model)}


# --------------------------------------------------------------------------------------------
# Stand-in model: exact attention
# --------------------------------------------------------------------------------------------

STANDIN_ATTN = {"aggregator.patch_embed.blocks.0.attn", "camera_head.trunk.0.attn",
                *(f"aggregator.{kind}_blocks.{i}.attn" for kind in ("frame", "global") for i in range(4))}
# the blocks whose residual stream runs fused in inference (DINOv2's NestedTensorBlock, a subclass, included)
STANDIN_BLOCKS = {"camera_head.trunk.0", "aggregator.patch_embed.blocks.0",
                  *(f"aggregator.{kind}_blocks.{i}" for kind in ("frame", "global") for i in range(4))}


def test_patch_report_and_unpatch_restores_bitwise(standin):
    m = make_standin()
    x = frames()
    before = run(m, x)
    ptrs = {n: p.data_ptr() for n, p in m.state_dict().items()}
    report = elsa_vision.patch(m, precision="ieee")
    assert set(report.patched["vggt"]) == STANDIN_ATTN
    assert set(report.patched["vggt.Block"]) == STANDIN_BLOCKS
    assert [n for n, _ in report.skipped["vggt-aggregator"]] == ["aggregator"]
    run(m, x)
    stats = calls(m)
    assert all(c >= 1 and d == 0 for c, d in stats.values()), stats
    assert {n: p.data_ptr() for n, p in m.state_dict().items()} == ptrs  # parameters reused, keys unchanged
    assert elsa_vision.unpatch(m) == len(STANDIN_ATTN) + len(STANDIN_BLOCKS)
    assert not any("forward" in mod.__dict__ or "_elsa" in mod.__dict__ for mod in m.modules())
    assert_equal(run(m, x), before)


def test_model_outputs_follow_the_tolerance_rule(standin):
    m = make_standin()
    x = frames()
    ref, oracle = run(m, x), oracle_outputs(m, x)
    with elsa_vision.patched(m, precision="ieee"):
        out = run(m, x)
        stats = calls(m)  # (else the rule compares the model's own forward with itself)
    assert len(stats) == len(STANDIN_ATTN) + len(STANDIN_BLOCKS)
    assert all(c >= 1 and d == 0 for c, d in stats.values()), stats
    assert_rule(out, ref, oracle)


def test_blocks_fuse_the_residual_stream_in_inference(standin):
    """The blocks' fused residual passes: the tolerance rule with and without them, every block call
    served, with autograd (gradients as the block's own ops') or without."""
    m = make_standin()
    x = frames()
    ref, oracle = run(m, x), oracle_outputs(m, x)
    for fuse in (True, False):
        report = elsa_vision.patch(m, precision="ieee", fuse_residual=fuse)
        assert set(report.patched.get("vggt.Block", ())) == (STANDIN_BLOCKS if fuse else set())
        assert_rule(run(m, x), ref, oracle, what=f"fuse_residual={fuse}")
        blocks = {n: s for n, s in registry.patched_modules(m) if n in STANDIN_BLOCKS}
        assert all(s.calls >= 1 and s.delegated == 0 for s in blocks.values())
        elsa_vision.unpatch(m)
    with torch.no_grad():
        depth0 = m(x)["depth"]
    m.zero_grad()
    m(x)["depth"].sum().backward()
    g_ref = [p.grad.clone() for p in m.aggregator.global_blocks[0].parameters()]
    elsa_vision.patch(m, precision="ieee")
    m.zero_grad()
    m(x)["depth"].sum().backward()
    for p, g in zip(m.aggregator.global_blocks[0].parameters(), g_ref):
        assert torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6 * g.abs().max().item())
    state = m.aggregator.global_blocks[0]._elsa
    assert state.delegated == 0 and state.calls == 1           # the fused passes' backward
    with torch.no_grad():
        assert torch.allclose(m(x)["depth"], depth0, rtol=1e-4, atol=1e-5)
        dino = m.aggregator.patch_embed.blocks[0]
        with pytest.raises(AssertionError, match="xFormers"):   # a list: DINOv2's nested path, the block's own
            dino([x.new_zeros(1, 3, 64)])
        assert any("list" in why for why in dino._elsa.delegate_reasons)
    elsa_vision.unpatch(m)


def _module_cases():
    rope = V.RotaryPositionEmbedding2D()
    return {
        # (module, x shape, frames × grid for positions or None)
        "frame": (V.Attention(64, 2, qk_norm=True, rope=rope), (3, 11, 64), (3, (2, 3))),
        "global": (V.Attention(64, 2, qk_norm=True, rope=rope), (1, 33, 64), (1, (4, 7))),
        "unfused": (V.Attention(64, 2, qk_norm=True, rope=rope, fused_attn=False), (2, 11, 64), (2, (2, 3))),
        "memeff": (V.MemEffAttention(64, 2), (2, 9, 64), None),
        "head_dim_128": (V.Attention(128, 1), (1, 5, 128), None),
    }


def _positions(n_seq, grid, special=5):
    h, w = grid
    pos = V.PositionGetter()(n_seq, h, w, "cpu") + 1
    return torch.cat([torch.zeros(n_seq, special, 2, dtype=pos.dtype), pos], dim=1)


@pytest.mark.parametrize("case", list(_module_cases()))
def test_attention_module_follows_the_tolerance_rule(standin, case):
    torch.manual_seed(0)
    mod, shape, layout = _module_cases()[case]
    mod.eval()
    x = torch.randn(shape)
    pos = None
    if layout is not None:
        seqs, grid = layout
        pos = _positions(shape[0], grid) if seqs == shape[0] else None
    kw = {} if pos is None else {"pos": pos}
    with torch.no_grad():
        ref = mod(x, **kw)
        oracle = copy.deepcopy(mod).double()(x.double(), **kw)
        with elsa_vision.patched(mod, precision="ieee"):
            out = mod(x, **kw)
            assert mod._elsa.calls == 1 and mod._elsa.delegated == 0
    assert out.dtype == ref.dtype and out.shape == ref.shape
    e, r = max_err(out, oracle), max_err(ref, oracle)
    assert e <= tolerance(r, out.dtype), (case, e, r)


def test_autocast_follows_sdpa(standin):
    """Under autocast attention runs in the autocast dtype, as SDPA does."""
    torch.manual_seed(0)
    mod = V.Attention(64, 2, qk_norm=True, rope=V.RotaryPositionEmbedding2D()).eval()
    x, pos = torch.randn(1, 33, 64), _positions(1, (4, 7))
    with torch.no_grad():
        oracle = copy.deepcopy(mod).double()(x.double(), pos=pos)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = mod(x, pos=pos)
            with elsa_vision.patched(mod):
                out = mod(x, pos=pos)
                assert mod._elsa.calls == 1 and mod._elsa.delegated == 0, mod._elsa.delegate_reasons
    assert out.dtype == ref.dtype == torch.bfloat16
    e, r = max_err(out, oracle), max_err(ref, oracle)
    assert e <= tolerance(r, out.dtype), (e, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_a_compiled_graph_is_the_modules(standin, dtype):
    """Under torch.compile the adapter forms vggt's 2-D RoPE from each token's position (the module
    sizes its table by positions.max(), a value dynamo cannot trace): one graph, no break, and the
    module's values (its products and casts, the table rows as the module computes them; aot_eager,
    whose ops are eager's: inductor may keep a half-precision t's angles in float32, see _rope)."""
    from elsa_vision.adapters.vggt.attention import _rope
    mod = V.Attention(64, 2, qk_norm=True, rope=V.RotaryPositionEmbedding2D()).eval()
    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 2, 23, 32, generator=g).to(dtype)
    pos = torch.randint(0, 40, (2, 23, 2), generator=g)
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    try:
        got = torch.compile(lambda t, pos: _rope(mod, t, pos), backend="aot_eager")(t, pos)
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    finally:
        torch._dynamo.reset()
    want = mod.rope(t, pos)
    assert got.dtype == want.dtype and torch.allclose(got.float(), want.float(), rtol=0, atol=1e-6 if dtype ==
                                                      torch.float32 else 0)
    assert torch.equal(_rope(mod, t, pos), want)  # (eagerly the module itself)


def test_unsupported_inputs_go_to_the_original_forward(standin):
    torch.manual_seed(0)
    rope = V.RotaryPositionEmbedding2D()
    drop = V.Attention(64, 2, qk_norm=True, rope=rope, attn_drop=0.5).train()
    x, pos = torch.randn(1, 11, 64), _positions(1, (2, 3))
    torch.manual_seed(3)
    want = drop(x, pos=pos)
    with elsa_vision.patched(drop):
        torch.manual_seed(3)
        got = drop(x, pos=pos)
        assert drop._elsa.delegate_reasons == {"attention dropout in training": 1}
    assert torch.equal(got, want)

    memeff = V.MemEffAttention(64, 2).eval()
    with elsa_vision.patched(memeff):
        with pytest.raises(AssertionError):
            memeff(torch.randn(1, 6, 64), attn_bias=torch.zeros(1))
        with pytest.raises(AssertionError):
            memeff(torch.randn(1, 6, 64), pos=_positions(1, (1, 1), special=5))
        assert memeff._elsa.delegated == 2


class _VendoredAttention(V.Attention):
    """A class with vggt's attention forward that nothing registered yet."""


def test_register_classes_is_undone_by_its_remove():
    mod = _VendoredAttention(64, 2)
    assert elsa_vision.patch(mod).num_patched == 0
    remove = A.register_classes(attention=[_VendoredAttention])
    assert elsa_vision.patch(mod).num_patched == 1
    elsa_vision.unpatch(mod)
    remove()
    assert elsa_vision.patch(mod).num_patched == 0
    with pytest.raises(TypeError, match="not vggt's attention forward"):
        A.register_classes(attention=[torch.nn.Linear])


# --------------------------------------------------------------------------------------------
# Lean memory
# --------------------------------------------------------------------------------------------


def test_lean_memory_keeps_predictions_and_is_reversible(standin):
    m = make_standin()
    x = frames()
    original = run(m, x)
    with elsa_vision.patched(m, precision="ieee"):
        full = run(m, x)
        with torch.no_grad():
            layers, _ = m.aggregator(x)
    assert all(isinstance(t, torch.Tensor) for t in layers)
    report = elsa_vision.patch(m, precision="ieee", lean_memory=(1, 3))
    assert report.patched["vggt-aggregator"] == ["aggregator"]
    assert sorted(report.patched["vggt-dpt-head"]) == ["depth_head", "point_head"]
    lean = run(m, x)
    assert_equal(lean, full)  # no token chunking at this size: the very same operations
    with torch.no_grad():
        kept, _ = m.aggregator(x)
    assert isinstance(kept, A.LeanLayerList) and len(kept) == 4
    assert [t is None for t in list.__iter__(kept)] == [True, False, True, False]
    assert torch.equal(kept[1], layers[1]) and torch.equal(kept[-1], layers[3])
    with pytest.raises(LookupError, match="lean_memory"):
        kept[0]
    elsa_vision.unpatch(m)
    assert "_process_frame_attention" not in m.aggregator.__dict__
    assert_equal(run(m, x), original)


@pytest.mark.parametrize("hooked", [False, True])
def test_lean_memory_frees_the_aggregators_dead_inputs(standin, monkeypatch, hooked):
    """The normalized images and the patch tokens are freed once the token sequence exists (the
    aggregator never reads them again); the caller's images are never touched; with a hook on the
    patch embedding (someone may keep its output) nothing is freed."""
    m = make_standin()
    x = frames()
    x0 = x.clone()
    with elsa_vision.patched(m, precision="ieee"):
        full = run(m, x)
    freed = []
    real = AL._PatchEmbedOnce.release

    def release(self):
        dead = list(self.dead)
        real(self)
        freed.extend(t.untyped_storage().size() for t in dead)
    monkeypatch.setattr(AL._PatchEmbedOnce, "release", release)
    if hooked:
        m.aggregator.patch_embed.register_forward_hook(lambda *a: None)
    with elsa_vision.patched(m, precision="ieee", lean_memory=(1, 3)):
        lean = run(m, x)
    assert_equal(lean, full)
    assert torch.equal(x, x0)
    assert freed == ([] if hooked else [0, 0])
    assert "patch_embed" not in m.aggregator.__dict__ and isinstance(m.aggregator.patch_embed, torch.nn.Module)


def test_lean_memory_respects_hooks_grads_and_block_wrappers(standin):
    """What lean memory runs in pieces or frees must not be observable: a hook deep in the patch
    embedding keeps its output intact, a grad-enabled call can still backpropagate, hooks on an
    aggregator block see the one whole call they would see unpatched."""
    m = make_standin()
    x = frames()
    kept = []
    h = m.aggregator.patch_embed.norm.register_forward_hook(lambda mod, i, o: kept.append(o))
    with elsa_vision.patched(m, precision="ieee", lean_memory=(1, 3)):
        run(m, x)
    h.remove()
    assert kept and kept[0].untyped_storage().size() > 0 and torch.isfinite(kept[0]).all()
    with elsa_vision.patched(m, precision="ieee", lean_memory=(1, 3)):
        xg = x.clone().requires_grad_()
        m(xg)["depth"].sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    seen, inner = [], []
    h = m.aggregator.frame_blocks[1].register_forward_hook(lambda mod, i, o: seen.append(tuple(o.shape)))
    h2 = m.aggregator.frame_blocks[2].ls1.register_forward_hook(lambda mod, i, o: inner.append(tuple(o.shape)))
    with elsa_vision.patched(m, precision="ieee", lean_memory=(1, 3), lean_chunk=7):
        run(m, x)
    h.remove()
    h2.remove()
    assert seen == [(3, 20, 64)]  # the hooked block ran whole
    assert inner == [(1, 20, 64)] * 3  # a hook inside a block does not stop the chunking


def test_lean_offload_with_global_attention_first(standin):
    m = make_standin()
    m.aggregator.aa_order = ["global", "frame"]
    x = frames()
    with elsa_vision.patched(m, precision="ieee"):
        full = run(m, x)
    with elsa_vision.patched(m, precision="ieee", lean_memory=(1, 3)):
        lean = run(m, x)
        assert m.aggregator._elsa.calls == 1 and m.aggregator._elsa.delegated == 0
    assert_equal(lean, full)  # (no token chunking at this size: the same operations, global blocks first)
    with elsa_vision.patched(m, precision="ieee", lean_memory=(1, 3), lean_offload=True):
        assert_equal(run(m, x), lean)
        assert m.aggregator._elsa.calls == 1 and m.aggregator._elsa.delegated == 0


def test_attention_delegations_and_option_checks(standin):
    """MC dropout (attn_drop in train under an eval model) and hooks on attn_drop go to the original
    forward; an empty lean_memory list keeps the last layer only; bad options raise at patch time."""
    mod = V.Attention(64, num_heads=2, attn_drop=0.5, fused_attn=False).eval()
    mod.attn_drop.train()
    x = torch.randn(2, 9, 64)
    elsa_vision.patch(mod)
    torch.manual_seed(0)
    out = mod(x)
    assert mod._elsa.delegated == 1
    elsa_vision.unpatch(mod)
    torch.manual_seed(0)
    assert torch.equal(out, mod(x))
    mod.attn_drop.eval()
    mod.attn_drop.register_forward_hook(lambda *a: None)
    elsa_vision.patch(mod)
    mod(x)
    assert "hooks on attn_drop" in " ".join(mod._elsa.delegate_reasons)
    elsa_vision.unpatch(mod)
    m = make_standin()
    with elsa_vision.patched(m, lean_memory=[]) as report:
        assert report.num_patched > len(STANDIN_ATTN)
        with torch.no_grad():
            layers, _ = m.aggregator(frames())
        assert layers.kept == frozenset({3}) and layers[-1].shape[-1] > 0
        with pytest.raises(LookupError, match="dropped by lean_memory"):
            layers[0]
    with pytest.raises(ValueError, match="backend"):
        elsa_vision.patch(m, backend="bogus")
    wide = V.Attention(1024, num_heads=2).eval()  # head dim 512: beyond ELSA's 256, SDPA's call
    xw = torch.randn(1, 5, 1024)
    with torch.no_grad(), elsa_vision.patched(wide):
        assert torch.equal(wide(xw), wide._elsa.original(xw)) and wide._elsa.delegated == 1
    # float64: the fused q/k norm + RoPE kernel (float32 inside) is not used
    mod = V.Attention(64, 2, qk_norm=True, rope=V.RotaryPositionEmbedding2D()).double().eval()
    x, pos = torch.randn(2, 11, 64, dtype=torch.float64), _positions(2, (2, 3))
    with torch.no_grad():
        ref = mod(x, pos=pos)
        with elsa_vision.patched(mod, backend="reference"):
            assert (mod(x, pos=pos) - ref).abs().max() < 1e-12
    with pytest.raises(ValueError, match="ratio"):
        A.TokenMerging(ratio=True)


def test_lean_memory_chunks_follow_the_tolerance_rule(standin):
    m = make_standin()
    x = frames()
    ref, oracle = run(m, x), oracle_outputs(m, x)
    with elsa_vision.patched(m, precision="ieee", lean_memory=(1, 3), lean_chunk=7, head_chunk=1):
        out = run(m, x)
        # 3 frames of 20 tokens > 7 tokens: each frame block runs frame by frame
        assert m.aggregator.frame_blocks[0].attn._elsa.calls == 3
        assert m.aggregator.global_blocks[0].attn._elsa.calls == 1
    assert_rule(out, ref, oracle, what="lean_chunk=7: ")


@pytest.mark.parametrize("lean_chunk", [1 << 16, 7])
def test_lean_offload_keeps_predictions(standin, lean_chunk):
    """lean_offload: the kept layers but the last leave the device (here the host is the device too,
    so this checks the bookkeeping: the per-frame concatenation, the outputs list, the heads reading
    frame chunks back from it); the predictions are those of lean_memory alone, bitwise."""
    m = make_standin()
    x = frames()
    with elsa_vision.patched(m, precision="ieee", lean_memory=(1, 3), lean_chunk=lean_chunk, head_chunk=2):
        lean = run(m, x)
        with torch.no_grad():
            layers, _ = m.aggregator(x)
    with elsa_vision.patched(m, precision="ieee", lean_memory=(1, 3), lean_chunk=lean_chunk, head_chunk=2,
                             lean_offload=True):
        out = run(m, x)
        with torch.no_grad():
            kept, _ = m.aggregator(x)
    assert_equal(out, lean)
    assert kept.offloaded and not layers.offloaded
    assert torch.equal(kept[1], layers[1]) and torch.equal(kept[3], layers[3])
    with pytest.raises(LookupError, match="lean_memory"):
        kept[2]


def test_offload_buffer_pins_small_layers_only(monkeypatch):
    """Layers over _PIN_LIMIT and failed pinned allocations get pageable host memory, not an error
    (torch's pinned allocator rounds to a power of two: 3000-frame layers would pin over 100 GB)."""
    calls = []
    real_empty = torch.empty

    def empty(*shape, pin_memory=False, **kw):
        calls.append(pin_memory)
        if pin_memory:
            if fail:
                raise RuntimeError("CUDA error: out of memory")
            return real_empty(*shape, **kw)  # stands in for a pinned buffer on a CPU-only machine
        return real_empty(*shape, **kw)

    monkeypatch.setattr(AL.torch, "empty", empty)
    monkeypatch.setattr(AL, "_PIN_LIMIT", 1024)
    fail = False
    assert AL._host_buffer((2, 128), torch.float32, True).shape == (2, 128) and calls == [True]
    calls.clear()
    AL._host_buffer((2, 129), torch.float32, True)  # 1032 bytes > the limit: never pinned
    assert calls == [False]
    calls.clear()
    fail = True
    assert AL._host_buffer((4, 4), torch.bfloat16, True).dtype == torch.bfloat16 and calls == [True, False]
    calls.clear()
    AL._host_buffer((4, 4), torch.float32, False)
    assert calls == [False]


def test_lean_offload_needs_lean_memory(standin):
    m = make_standin()
    with pytest.raises(ValueError, match="lean_memory"):
        elsa_vision.patch(m, lean_offload=True)
    with pytest.raises(TypeError, match="lean_offload"):
        elsa_vision.patch(m, lean_memory=True, lean_offload="yes")


def test_lean_memory_refuses_to_hide_a_layer_a_head_reads(standin):
    m = make_standin()  # its DPT heads read layers 1 and 3; lean_memory=True keeps VGGT's 4, 11, 17, 23 + last
    with elsa_vision.patched(m, lean_memory=True):
        with pytest.raises(LookupError, match="layer 1 was dropped"):
            run(m, frames(S=2))
    with pytest.raises(ValueError, match="outside"):
        elsa_vision.patch(m, lean_memory=[9])
    assert not registry.patched_modules(m)


# --------------------------------------------------------------------------------------------
# Token merging
# --------------------------------------------------------------------------------------------


def test_destination_pattern():
    frames_, grid, special = 3, (3, 5), 5
    h, w = grid
    P = special + h * w
    base = A.TokenMerging(protect=0.0)
    dst, src = A.destination_pattern(frames_, grid, special, base)
    assert torch.equal(torch.sort(torch.cat([dst, src])).values, torch.arange(frames_ * P))
    is_dst = torch.zeros(frames_ * P, dtype=torch.bool)
    is_dst[dst] = True
    is_dst = is_dst.view(frames_, P)
    assert is_dst[0].all() and is_dst[:, :special].all()
    grid_dst = is_dst[1:, special:].view(frames_ - 1, h, w)
    for y0 in range(0, h, 2):        # exactly one destination per 2x2 cell, partial edge cells included
        for x0 in range(0, w, 2):
            assert (grid_dst[:, y0:y0 + 2, x0:x0 + 2].sum(dim=(1, 2)) == 1).all()
    prot = A.TokenMerging(protect=0.1)
    dst_p, _ = A.destination_pattern(frames_, grid, special, prot)
    assert dst_p.numel() == dst.numel() + round(0.1 * frames_ * P)
    assert set(dst.tolist()) <= set(dst_p.tolist())
    again, _ = A.destination_pattern(frames_, grid, special, prot)
    other, _ = A.destination_pattern(4, (6, 8), special, A.TokenMerging(seed=1))
    assert torch.equal(again, dst_p)
    assert not torch.equal(other, A.destination_pattern(4, (6, 8), special, A.TokenMerging(seed=0))[0])


@pytest.mark.parametrize("ratio,sim_dtype", [(0.9, torch.float32), (0.2, torch.float32), (0.9, torch.bfloat16),
                                             (0.2, torch.bfloat16)])
def test_merge_plan_merges_into_the_most_similar_destination(ratio, sim_dtype):
    """bf16: the fused kernel (interpreter on CPU); float32: the chunked matmul path."""
    cfg = A.TokenMerging(ratio=ratio, similarity_dtype=sim_dtype)
    frames_, grid, special = 3, (3, 5), 5
    N = frames_ * (special + 15)
    metric = torch.randn(2, N, 16, generator=torch.Generator().manual_seed(0))
    plan = A.merge_plan(metric, frames_, grid, special, cfg)
    dst, src = A.destination_pattern(frames_, grid, special, cfg)
    r = min(int(ratio * N), src.numel())
    assert plan.num_merged == N - r
    assert plan.counts.sum(1).tolist() == [float(N)] * 2
    cos = F.normalize(metric.float(), dim=-1).to(sim_dtype).double()  # the operands the search multiplies
    sim = cos[:, src] @ cos[:, dst].transpose(1, 2)                  # [B, Ns, Nd]
    best_sim, best = sim.max(-1)
    for b in range(2):
        assert torch.equal(plan.slot[b, dst], torch.arange(dst.numel()))
        merged = plan.slot[b, src] < dst.numel()
        assert int(merged.sum()) == r
        assert torch.equal(plan.slot[b, src][merged], best[b][merged])
        if r < src.numel():  # the most similar sources merge first
            assert best_sim[b][merged].min() >= best_sim[b][~merged].max()
            assert sorted(plan.slot[b, src][~merged].tolist()) == list(range(dst.numel(), N - r))


def _qkv(mod, x, pos):
    B, N, C = x.shape
    qkv = mod.qkv(x).reshape(B, N, 3, mod.num_heads, mod.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = mod.q_norm(q), mod.k_norm(k)
    return mod.rope(q, pos), mod.rope(k, pos), v


def _brute_force_merged(mod, x, pos, slot, M):
    """Mean-merge q/k/v by explicit groups, dense softmax over the M merged tokens, proj, copy back."""
    q, k, v = _qkv(mod, x, pos)
    B, H, N, D = q.shape
    out = torch.empty_like(x)
    for b in range(B):
        groups = [torch.nonzero(slot[b] == m).squeeze(1) for m in range(M)]
        qm, km, vm = (torch.stack([t[b][:, g].mean(1) for g in groups], dim=1) for t in (q, k, v))
        att = torch.softmax(qm @ km.transpose(-1, -2) / math.sqrt(D), dim=-1) @ vm       # [H, M, D]
        y = mod.proj(att.transpose(0, 1).reshape(M, H * D))
        out[b] = y[slot[b]]
    return out


def test_merged_attention_matches_a_brute_force_merge(standin):
    cfg = A.TokenMerging(similarity_dtype=torch.float32, seed=5)
    m = make_standin()
    x = frames(S=3, B=2)
    attn = m.aggregator.global_blocks[2].attn
    seen = []
    hook = attn.register_forward_hook(lambda mod, args, kwargs, out: seen.append((args[0], kwargs["pos"], out)),
                                      with_kwargs=True)
    with elsa_vision.patched(m, precision="ieee", token_merging=cfg):
        run(m, x)
    hook.remove()
    (xin, pos, out), = seen
    plan = A.merge_plan(xin, 3, (3, 5), 5, cfg)
    assert plan.num_merged < xin.shape[1]
    with torch.no_grad():
        ref = _brute_force_merged(attn, xin, pos, plan.slot, plan.num_merged)
        oracle = _brute_force_merged(copy.deepcopy(attn).double(), xin.double(), pos, plan.slot, plan.num_merged)
    e, r = max_err(out, oracle), max_err(ref, oracle)
    assert e <= tolerance(r, out.dtype), (e, r)


def test_merging_is_deterministic_and_batch_independent(standin):
    m = make_standin()
    x = frames(S=3, B=2)
    plain = elsa_vision.patch(m, precision="ieee")
    exact = run(m, x)
    elsa_vision.unpatch(m)
    with elsa_vision.patched(m, precision="ieee", token_merging=A.TokenMerging(seed=0)):
        a, b = run(m, x), run(m, x)
        single = run(m, x[1:])
        assert all(d == 0 for _, d in calls(m).values())
    assert_equal(a, b)
    for key in OUTPUTS:
        assert torch.allclose(a[key][1:], single[key], rtol=1e-5, atol=1e-5), key
        assert not torch.equal(a[key], exact[key]), f"{key}: merging changed nothing"
    with elsa_vision.patched(m, precision="ieee", token_merging=A.TokenMerging(seed=1)):
        c = run(m, x)
    assert any(not torch.equal(a[k], c[k]) for k in OUTPUTS)
    with elsa_vision.patched(m, precision="ieee", token_merging=A.TokenMerging(start_layer=4)):
        assert_equal(run(m, x), exact)  # no global layer reaches start_layer
    assert plain.num_patched == len(STANDIN_ATTN) + len(STANDIN_BLOCKS)


def test_strided_norm_weights_take_the_modules(standin):
    """q/k LayerNorm weights that are strided views (tied or sliced parameters): the fused q/k norm +
    RoPE kernel reads them densely, so the call runs the modules themselves, to the same values."""
    torch.manual_seed(0)
    mod = V.Attention(64, 2, qk_norm=True, rope=V.RotaryPositionEmbedding2D()).eval()
    for norm in (mod.q_norm, mod.k_norm):
        norm.weight = torch.nn.Parameter(torch.randn(64)[::2])
    x, pos = torch.randn(2, 11, 64), _positions(2, (2, 3))
    with torch.no_grad():
        ref = mod(x, pos=pos)
        with elsa_vision.patched(mod, precision="ieee"):
            assert (mod(x, pos=pos) - ref).abs().max() < 1e-5 and mod._elsa.delegated == 0


def test_lean_memory_runs_a_forward_wrapped_after_patching(standin):
    """Another library wrapping a patched attention's forward after patch() (accelerate's hooks, a
    capture tool): lean mode, which otherwise calls ELSA's attention itself, runs the wrapper."""
    m = make_standin()
    x = frames(S=2)
    with elsa_vision.patched(m, backend="reference", lean_memory=(1, 3)):
        attn = m.aggregator.global_blocks[1].attn
        seen, inner = [], attn.forward
        attn.forward = lambda *a, **k: seen.append(1) or inner(*a, **k)
        run(m, x)
        attn.__dict__["forward"] = inner  # (the patched forward back where patch() put it)
    assert seen


def test_reference_backend_launches_no_fused_kernel(standin, monkeypatch):
    """A model patched with backend="reference" runs no Triton kernel of its own: the fused q/k norm
    + RoPE and token merging's nearest search take their torch paths (under "auto" they launch)."""
    from elsa_vision.kernels import nearest as NK, rope as RK
    launched = []
    for mod, name in ((RK, "qk_norm_rope"), (NK, "nearest")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: launched.append(_name) or _real(*a, **k))
    m = make_standin()
    x = frames(S=2)
    merge = A.TokenMerging(similarity_dtype=torch.bfloat16)
    for backend in ("reference", "auto"):
        launched.clear()
        with elsa_vision.patched(m, backend=backend, token_merging=merge):
            run(m, x)
        assert (set(launched) == {"qk_norm_rope", "nearest"}) if backend == "auto" else not launched, backend


def test_similarity_dim_searches_the_projected_rows():
    """similarity_dim k: the plan is the full search's on the rows projected onto k fixed random
    directions; k ≥ C is the full dimension itself."""
    frames_, grid, special = 3, (3, 5), 5
    metric = torch.randn(2, frames_ * (special + 15), 16, generator=torch.Generator().manual_seed(2))
    cfg = A.TokenMerging(similarity_dtype=torch.float32, similarity_dim=6, seed=3)
    rows = A.similarity_rows(metric, cfg)
    assert rows.shape == (2, metric.shape[1], 6)
    assert torch.equal(rows, A.similarity_rows(metric, cfg))  # fixed directions
    full = A.TokenMerging(similarity_dtype=torch.float32, seed=3)
    proj = A.merge_plan(metric, frames_, grid, special, cfg)
    assert torch.equal(proj.slot, A.merge_plan(rows, frames_, grid, special, full).slot)
    assert not torch.equal(proj.slot, A.merge_plan(metric, frames_, grid, special, full).slot)
    wide = A.TokenMerging(similarity_dtype=torch.float32, similarity_dim=16, seed=3)
    assert A.similarity_rows(metric, wide) is metric
    assert torch.equal(A.merge_plan(metric, frames_, grid, special, wide).slot,
                       A.merge_plan(metric, frames_, grid, special, full).slot)


@pytest.mark.parametrize("reuse,plans", [(1, 4), (2, 2), (3, 2), (8, 1)])
def test_reuse_makes_one_plan_per_reuse_blocks(standin, monkeypatch, reuse, plans):
    """reuse r: plans are made at global layers 0, r, 2r, … (the stand-in has 4) and the blocks
    between reuse them; reuse 1 is the default's output, bitwise."""
    from elsa_vision.adapters.vggt import merging as AM
    made = []
    real = AM.merge_plan
    monkeypatch.setattr(AM, "merge_plan", lambda *a, **k: made.append(1) or real(*a, **k))
    m = make_standin()
    x = frames(S=3, B=2)
    with elsa_vision.patched(m, precision="ieee", token_merging=A.TokenMerging(seed=0, reuse=reuse)):
        out = run(m, x)
    assert len(made) == plans
    assert all(torch.isfinite(out[k]).all() for k in OUTPUTS)
    with elsa_vision.patched(m, precision="ieee", token_merging=A.TokenMerging(seed=0)):
        default = run(m, x)
    if reuse == 1:
        assert_equal(out, default)
    else:
        assert any(not torch.equal(out[k], default[k]) for k in OUTPUTS)


def test_fast_preset():
    """TokenMerging.fast(): the projected similarity, reused plans and fewer protected tokens of the
    preset's constants, any other field settable, and its fields checked like any TokenMerging's;
    its destinations are the default's less the protected tokens it drops."""
    from elsa_vision.adapters.vggt import merging as M
    fast = A.TokenMerging.fast()
    assert (fast.similarity_dim, fast.reuse, fast.protect, fast.ratio) == (
        M.FAST_SIMILARITY_DIM, M.FAST_REUSE, M.FAST_PROTECT, 0.9)
    assert A.TokenMerging.fast(ratio=0.5, seed=2, reuse=1) == A.TokenMerging(
        ratio=0.5, seed=2, similarity_dim=M.FAST_SIMILARITY_DIM, reuse=1, protect=M.FAST_PROTECT)
    frames_, grid, special = 40, (28, 37), 5
    n = frames_ * (special + grid[0] * grid[1])
    dst_default, _ = M.destination_pattern(frames_, grid, special, A.TokenMerging())
    dst_fast, src_fast = M.destination_pattern(frames_, grid, special, fast)
    assert dst_default.numel() - dst_fast.numel() == round(0.1 * n) - round(M.FAST_PROTECT * n)
    assert dst_fast.numel() + src_fast.numel() == n
    with pytest.raises(ValueError, match="reuse"):
        A.TokenMerging.fast(reuse=0)


def test_fast_preset_runs_the_standin(standin):
    """The preset on the stand-in (reference backend): finite outputs that differ from the default
    merging's (another assignment), the same shapes."""
    m = make_standin()
    x = frames()
    with elsa_vision.patched(m, backend="reference", token_merging=A.TokenMerging(seed=0)):
        default = run(m, x)
    with elsa_vision.patched(m, backend="reference", token_merging=A.TokenMerging.fast(seed=0)):
        fast = run(m, x)
    for k in OUTPUTS:
        assert fast[k].shape == default[k].shape and torch.isfinite(fast[k]).all()
    assert any(not torch.equal(fast[k], default[k]) for k in OUTPUTS)


def test_merging_at_other_resolutions(standin):
    m = make_standin()
    for hw, S in (((56, 42), 2), ((28, 98), 4)):
        x = frames(S=S, hw=hw)
        with elsa_vision.patched(m):
            exact = run(m, x)
        with elsa_vision.patched(m, token_merging=A.TokenMerging(ratio=0.5)):
            out = run(m, x)
            assert m.aggregator._elsa.calls == 1 and m.aggregator._elsa.delegated == 0
        assert all(torch.isfinite(out[k]).all() for k in OUTPUTS)
        assert out["depth"].shape == (1, S, *hw, 1)
        assert not torch.equal(out["depth"], exact["depth"])  # (the global attention ran on merged tokens)


def test_token_merging_validation(standin):
    with pytest.raises(ValueError, match="ratio"):
        A.TokenMerging(ratio=1.5)
    with pytest.raises(ValueError, match="cell"):
        A.TokenMerging(cell=(0, 2))
    m = make_standin()
    with pytest.raises(TypeError, match="TokenMerging"):
        elsa_vision.patch(m, token_merging=0.9)
    assert elsa_vision.TokenMerging is A.TokenMerging


# --------------------------------------------------------------------------------------------
# The real vggt (random weights) when it is importable
# --------------------------------------------------------------------------------------------

needs_vggt = pytest.mark.skipif(not HAS_VGGT, reason="vggt is not installed "
                                "(pip install git+https://github.com/facebookresearch/vggt)")


@pytest.fixture(scope="module")
def real_vggt():
    from vggt.models.vggt import VGGT
    torch.manual_seed(0)
    model = VGGT(enable_track=False).eval()
    x = frames(S=3, hw=(56, 70), seed=2)
    return model, x, run(model, x)


@needs_vggt
@pytest.mark.slow
def test_real_vggt_outputs_follow_the_rule_and_unpatch(real_vggt):
    model, x, ref = real_vggt
    report = elsa_vision.patch(model, precision="ieee", backend="reference")
    names = report.patched["vggt"]
    assert len(names) == 24 + 24 + 24 + 4
    assert sum(n.startswith("aggregator.patch_embed.") for n in names) == 24
    assert sum(n.startswith("camera_head.trunk.") for n in names) == 4
    out = run(model, x)
    assert all(d == 0 for _, d in calls(model).values())
    elsa_vision.unpatch(model)
    assert_equal(run(model, x), ref)
    model.double()  # the oracle, in place: 1B parameters do not need two copies
    try:
        oracle = run(model, x.double())
    finally:
        model.float()
    assert_rule(out, ref, oracle, what="real vggt: ")


@needs_vggt
@pytest.mark.slow
def test_real_vggt_lean_memory_and_merging(real_vggt):
    model, x, ref = real_vggt
    with elsa_vision.patched(model, backend="reference"):
        full = run(model, x)
    with elsa_vision.patched(model, backend="reference", lean_memory=True):
        lean = run(model, x)
        with torch.no_grad():
            layers, _ = model.aggregator(x)
    assert_equal(lean, full)
    assert [i for i, t in enumerate(list.__iter__(layers)) if t is not None] == [4, 11, 17, 23]
    with elsa_vision.patched(model, backend="reference", lean_memory=True, lean_offload=True):
        assert_equal(run(model, x), lean)
    with elsa_vision.patched(model, backend="reference", token_merging=A.TokenMerging(seed=0)):
        a, b = run(model, x), run(model, x)
    assert_equal(a, b)
    for key in OUTPUTS:
        assert torch.isfinite(a[key]).all() and a[key].shape == ref[key].shape


@needs_vggt
def test_real_vggt_global_attention_on_triton(real_vggt):
    model, _, _ = real_vggt
    attn = model.aggregator.global_blocks[5].attn
    x, pos = torch.randn(1, 2 * 21, 1024, generator=torch.Generator().manual_seed(0)), _positions(2, (4, 4))
    pos = pos.view(1, 42, 2)
    with torch.no_grad():
        ref = attn(x, pos=pos)
        oracle = copy.deepcopy(attn).double()(x.double(), pos=pos)
        with elsa_vision.patched(attn, precision="ieee", backend="triton"):
            out = attn(x, pos=pos)
    e, r = max_err(out, oracle), max_err(ref, oracle)
    assert e <= tolerance(r, out.dtype), (e, r)


# --------------------------------------------------------------------------------------------
# The FastVGGT fork (its own `vggt` package: checked in a subprocess)
# --------------------------------------------------------------------------------------------

FORK_SRC = Path(os.environ.get("FASTVGGT_SRC", ROOT / "third_party" / "FastVGGT"))

FORK_CHECK = textwrap.dedent("""
    import copy, json, sys, torch
    sys.path.insert(0, sys.argv[1])
    import vggt.layers.attention as fork
    from pathlib import Path
    assert Path(fork.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), fork.__file__
    from vggt.layers.rope import RotaryPositionEmbedding2D, PositionGetter
    import elsa_vision
    from elsa_vision.verify import max_err, tolerance
    torch.manual_seed(0)
    attn = fork.Attention(64, num_heads=2, qk_norm=True, rope=RotaryPositionEmbedding2D(100),
                          patch_width=4, patch_height=4).eval()
    S, P = 3, 5 + 16
    x = torch.randn(1, S * P, 64)
    pos = PositionGetter()(S, 4, 4, "cpu") + 1
    pos = torch.cat([torch.zeros(S, 5, 2, dtype=pos.dtype), pos], 1).view(1, S * P, 2)
    result = {}
    with torch.no_grad():
        for merging in (0, None):
            ref = attn(x, pos=pos, global_merging=merging)
            oracle = copy.deepcopy(attn).double()(x.double(), pos=pos, global_merging=merging)
            with elsa_vision.patched(attn, precision="ieee") as report:
                out = attn(x, pos=pos, global_merging=merging)
                delegated = attn._elsa.delegated
            e, r = max_err(out, oracle), max_err(ref, oracle)
            result[str(merging)] = dict(ok=e <= tolerance(r, out.dtype), err=e, ref_err=r, delegated=delegated,
                                        patched=report.num_patched)
    print(json.dumps(result))
""")


@pytest.mark.skipif(not (FORK_SRC / "merging" / "merge.py").is_file(),
                    reason="FastVGGT source not found (set FASTVGGT_SRC)")
def test_fastvggt_fork_merged_attention_runs_on_elsa():
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    env.pop("PYTHONPATH", None)  # the fork's `vggt` must win over an installed upstream vggt
    proc = subprocess.run([sys.executable, "-c", FORK_CHECK, str(FORK_SRC)], capture_output=True, text=True,
                          env=env, cwd=str(ROOT), timeout=300)
    if proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr:
        pytest.skip(f"FastVGGT's dependencies are missing: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for merging, r in result.items():
        assert r["ok"] and r["delegated"] == 0 and r["patched"] == 1, (merging, r)


# --------------------------------------------------------------------------------------------
# GPU: the real model at 392x518 (`pytest -m gpu`)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_vggt():
    from vggt.models.vggt import VGGT
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = VGGT(enable_track=False)
    model = model.cuda().eval()  # .cuda(): buffers from legacy constructors are made on the CPU
    x = frames(S=4, hw=(392, 518), seed=3).cuda()
    return model, x


@needs_vggt
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "fp32"])
def test_gpu_real_vggt_follows_the_rule(gpu_vggt, mode):
    model, x = gpu_vggt
    ac = dict(device_type="cuda", dtype=torch.bfloat16) if mode == "bf16" else {}
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # fp32 reference without TF32; ELSA runs tf32x3
    try:
        ref = run(model, x, **ac)
        with elsa_vision.patched(model):
            out = run(model, x, **ac)
            assert all(d == 0 for _, d in calls(model).values())
        model.double()
        try:
            oracle = run(model, x.double())
        finally:
            model.float()
    finally:
        torch.set_float32_matmul_precision(prev)
    assert_rule(out, ref, oracle, what=f"{mode}: ")


@needs_vggt
@pytest.mark.gpu
def test_gpu_lean_memory_and_merging(gpu_vggt):
    model, x = gpu_vggt
    ac = dict(device_type="cuda", dtype=torch.bfloat16)
    with elsa_vision.patched(model):
        full = run(model, x, **ac)
    with elsa_vision.patched(model, lean_memory=True):
        assert_equal(run(model, x, **ac), full)
    with elsa_vision.patched(model, lean_memory=True, lean_chunk=1000):
        chunked = run(model, x, **ac)
    for key in OUTPUTS:
        rel = (chunked[key] - full[key]).norm() / full[key].norm()
        assert rel < 2e-2, (key, rel.item())
    with elsa_vision.patched(model, token_merging=A.TokenMerging(seed=0)):
        a, b = run(model, x, **ac), run(model, x, **ac)
    assert_equal(a, b)  # deterministic on the GPU too
    for key in OUTPUTS:
        assert torch.isfinite(a[key]).all()


@needs_vggt
@pytest.mark.gpu
def test_gpu_fast_merging_accuracy(gpu_vggt):
    """TokenMerging.fast() on the real model (bf16, 4 frames): deterministic, and its depth, world
    points and pose encodings move from the unmerged model's by at most three times what the default
    (FastVGGT's) assignment moves them (benchmarks/frames.py measures the same at 100-400 frames)."""
    model, x = gpu_vggt
    ac = dict(device_type="cuda", dtype=torch.bfloat16)
    with elsa_vision.patched(model):
        exact = run(model, x, **ac)
    with elsa_vision.patched(model, token_merging=A.TokenMerging(seed=0)):
        default = run(model, x, **ac)
    with elsa_vision.patched(model, token_merging=A.TokenMerging.fast(seed=0)):
        fast, again = run(model, x, **ac), run(model, x, **ac)
    assert_equal(fast, again)

    def moved(out, key):
        d = (out[key].float() - exact[key].float())
        return (d.abs().max() if key == "pose_enc" else d.norm() / exact[key].float().norm()).item()
    for key in ("pose_enc", "depth", "world_points"):
        f, dflt = moved(fast, key), moved(default, key)
        assert f <= 3 * dflt + 1e-3, f"{key}: fast moved {f:.3g}, the default assignment {dflt:.3g}"


@needs_vggt
@pytest.mark.gpu
def test_gpu_lean_memory_lowers_the_peak(gpu_vggt):
    model, _ = gpu_vggt
    x = frames(S=32, hw=(392, 518), seed=4).cuda()
    peaks, outs = {}, {}
    for name, opts in {"full": {}, "lean": {"lean_memory": True},
                       "offload": {"lean_memory": True, "lean_offload": True}}.items():
        with elsa_vision.patched(model, **opts):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            outs[name] = run(model, x, device_type="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - base
            if name == "offload":
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    kept, _ = model.aggregator(x)
                assert kept[4].device.type == "cpu" and kept[4].is_pinned() and kept[-1].is_cuda
    assert peaks["lean"] < 0.6 * peaks["full"], peaks
    assert peaks["offload"] < peaks["lean"], peaks
    assert_equal(outs["offload"], outs["lean"])  # copies, and the same per-frame head computations
