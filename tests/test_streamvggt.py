"""StreamVGGT adapter: batch (frame-causal) and streaming (KV cache) calls on ELSA.

CPU tests run on a stand-in of StreamVGGT's module tree (tests/streamvggt_standin.py) with the
Triton kernels in the interpreter; with ``streamvggt`` importable the same checks run on its real
aggregator (random weights, a small configuration). GPU tests (``-m gpu``) use the real aggregator
at its full size with 392×518 frames.

Rule (elsa_vision.verify.tolerance): max |patched − oracle| ≤ 2 · max |unpatched − oracle| + 1e-6 per
output (3× for gradients), the oracle being the unpatched model in float64.
"""
from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import elsa_vision
from elsa_vision.adapters import streamvggt as A
from elsa_vision.adapters.registry import patched_modules
from elsa_vision.verify import max_err, tolerance

sys.path.insert(0, str(Path(__file__).resolve().parent))
import streamvggt_standin as SV  # noqa: E402

HAS_STREAMVGGT = importlib.util.find_spec("streamvggt") is not None


@pytest.fixture(scope="module")
def standin():
    remove = A.register_classes(**SV.CLASSES)
    yield
    remove()


def make(seed=0):
    torch.manual_seed(seed)
    return SV.StreamVGGT().eval()


def frames(S=3, hw=(28, 42), seed=1):
    return torch.rand(1, S, 3, *hw, generator=torch.Generator().manual_seed(seed))


def run(model, x, mode):
    with torch.no_grad():
        out = model(x) if mode == "batch" else model.inference(x)
    return {k: out[k] for k in ("tokens", "pose_enc")}


def assert_rule(out, ref, oracle, what=""):
    for key in out:
        e, r = max_err(out[key], oracle[key]), max_err(ref[key], oracle[key])
        assert math.isfinite(e) and e <= tolerance(r, out[key].dtype), \
            f"{what}{key}: |patched - oracle| = {e:.3g} > 2 x |unpatched - oracle| ({r:.3g}) + 1e-6"


def delegated(model) -> dict:
    return {n: s.delegate_reasons for n, s in patched_modules(model) if s.delegated}


def test_patch_report_and_unpatch_bitwise(standin):
    model, x = make(), frames()
    before = run(model, x, "stream")
    report = elsa_vision.patch(model)
    # frame + global blocks (4 + 4), the camera trunk (1), the patch embed's MemEffAttention (1); the aggregator
    assert len(report.patched["streamvggt"]) == 10 and report.patched["streamvggt-aggregator"] == ["aggregator"]
    assert elsa_vision.unpatch(model) == 11
    after = run(model, x, "stream")
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("mode", ["batch", "stream"])
def test_follows_the_rule(standin, mode, monkeypatch):
    model, x = make(), frames()
    ref = run(model, x, mode)
    oracle = run(copy.deepcopy(model).double(), x.double(), mode)
    elsa_vision.patch(model)
    built = []
    make_mask = SV.frame_mask
    monkeypatch.setattr(SV, "frame_mask", lambda L, n, *a: built.append((L, n)) or make_mask(L, n, *a))
    out = run(model, x, mode)
    assert_rule(out, ref, oracle, f"{mode} ")
    assert not delegated(model)
    if mode == "batch":  # the camera head's [S, S] mask only: the aggregator's [S·P, S·P] one is never formed
        assert built and all(n == 1 for _, n in built)


def test_stream_equals_batch(standin):
    """Streaming frame by frame gives the aggregator tokens of the batch (frame-causal) call."""
    model, x = make(), frames(S=4)
    oracle = run(copy.deepcopy(model).double(), x.double(), "batch")["tokens"]
    elsa_vision.patch(model)
    stream, batch = run(model, x, "stream")["tokens"], run(model, x, "batch")["tokens"]
    states = [st for _, st in patched_modules(model)]
    assert states and all(st.calls >= 1 and st.delegated == 0 for st in states)  # (ELSA's, not the originals')
    assert max_err(stream, oracle) <= 2 * max_err(batch, oracle) + 1e-6


def test_stream_caches_are_kv_caches(standin):
    model, x = make(), frames(S=5)
    elsa_vision.patch(model, kv_reserve=2)
    with torch.no_grad():
        out = model.inference(x)
    past, past_camera = out["caches"]
    P = x.shape[-2] // 14 * (x.shape[-1] // 14) + 5
    for cache in past:
        assert isinstance(cache, A.KVCache) and cache.entries == 5 and cache.entry_len == P
        assert cache[0].shape == (1, 2, 5, P, 32) and cache.capacity >= 5 * P
    # the camera trunk appends at each of its 2 refinement iterations, one token per frame
    assert all(isinstance(c, A.KVCache) and c.entries == 10 and c.entry_len == 1 for c in past_camera)


def test_kv_cache_grows_in_place_and_keeps_its_entries():
    cache = A.KVCache(reserve=1)
    ks, vs = [], []
    for i in range(40):
        k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
        assert cache.capacity >= cache.tokens and cache.capacity <= max(cache.tokens + 8 * 4,
                                                                         math.ceil(cache.tokens * 9 / 8) + 4)
    assert torch.equal(cache.keys(), torch.cat(ks, 2)) and torch.equal(cache.values(), torch.cat(vs, 2))
    k5, v5 = cache
    assert k5.shape == (2, 3, 40, 4, 8) and torch.equal(v5[:, :, 7], vs[7])
    assert "entries=40" in repr(cache)


def test_kv_cache_refuses_what_it_cannot_hold():
    cache = A.KVCache()
    cache.append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="same batch, heads and tokens"):
        cache.append(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    with pytest.raises(ValueError, match="same autocast setting"):
        cache.append(torch.randn(1, 2, 3, 4, dtype=torch.bfloat16), torch.randn(1, 2, 3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="differ"):
        cache.append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 5))
    with pytest.raises(IndexError):
        cache[2]
    with pytest.raises(ValueError, match="one device"):
        cache.append(torch.randn(1, 2, 3, 4, device="meta"), torch.randn(1, 2, 3, 4, device="meta"))
    with pytest.raises(IndexError, match="empty"):
        A.KVCache()[0]
    with pytest.raises(ValueError, match="positive int"):
        A.KVCache(reserve=0)


def test_streaming_with_gradients_runs_the_original(standin):
    model, x = make(), frames(S=2)
    ref = model.inference(x)["tokens"]
    elsa_vision.patch(model)
    out = model.inference(x)  # grad mode on: the cached calls run the original forward, with its tuple caches
    assert torch.allclose(out["tokens"], ref, atol=1e-5) and isinstance(out["caches"][0][0], tuple)
    assert any("streaming with gradients enabled" in r for r in delegated(model).values())
    with torch.no_grad():
        tokens, _, past = model.aggregator(x[:, :1], past_key_values=[None] * 4, use_cache=True)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        model.aggregator(x[:, 1:2], past_key_values=past, use_cache=True)


def test_a_cache_never_reaches_the_original_forward(standin):
    """A call the original forward would have to serve (here: hooks on attn_drop) raises when it is
    given a KVCache: the original would normalise and rotate the cached keys a second time."""
    model, x = make(), frames(S=2)
    elsa_vision.patch(model)
    with torch.no_grad():
        _, _, past = model.aggregator(x[:, :1], past_key_values=[None] * 4, use_cache=True)
        model.aggregator.global_blocks[0].attn.attn_drop.register_forward_hook(lambda *a: None)
        with pytest.raises(RuntimeError, match="cannot read a KVCache"):
            model.aggregator(x[:, 1:2], past_key_values=past, use_cache=True)


def test_batch_gradients_follow_the_rule(standin):
    model, x = make(), frames(S=3)
    w = torch.randn(4, 1, 3, 11, 128, generator=torch.Generator().manual_seed(5))

    def grads(m, x):
        m.zero_grad()
        (m(x)["tokens"] * w.to(x.dtype)).sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if "global_blocks" in n and "qkv.weight" in n}

    ref = grads(model, x)
    oracle = grads(copy.deepcopy(model).double(), x.double())
    elsa_vision.patch(model)
    out = grads(model, x)
    assert not delegated(model)
    for n in out:
        e, r = max_err(out[n], oracle[n]), max_err(ref[n], oracle[n])
        assert e <= tolerance(r, torch.float32, grad=True), f"{n}: {e:.3g} vs {r:.3g}"


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("frame_len,N", [(5, 15), (7, 7), (4, 10)])
def test_frame_causal_attention(backend, frame_len, N):
    g = torch.Generator().manual_seed(frame_len * N)
    q, k, v = (torch.randn(2, 3, N, 16, generator=g, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 3, N, 16, generator=g)
    mask = SV.frame_mask(N, frame_len, torch.float64, "cpu")

    def dense(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))

    res = {}
    for name, fn, args in (("elsa", lambda *t: A.frame_causal_attention(*t, frame_len, backend=backend), (q, k, v)),
                           ("same", dense, (q, k, v)),
                           ("oracle", dense, tuple(t.detach().double().requires_grad_() for t in (q, k, v)))):
        out = fn(*args)
        res[name] = (out, *torch.autograd.grad(out, args, do.to(out.dtype)))
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        e, r = max_err(res["elsa"][i], res["oracle"][i]), max_err(res["same"][i], res["oracle"][i])
        assert e <= tolerance(r, torch.float32, grad=i > 0), f"{what}: {e:.3g} vs {r:.3g}"


def test_options(standin):
    with pytest.raises(ValueError, match="VGGT option"):
        elsa_vision.patch(make(), lean_memory=True)
    with pytest.raises(ValueError, match="positive int"):
        elsa_vision.patch(make(), kv_reserve=0)
    with pytest.raises(TypeError, match="positive int"):
        elsa_vision.patch(make(), kv_reserve=1.5)


def test_unfused_attention_adds_a_bool_mask_as_numbers(standin):
    """fused_attn=False: StreamVGGT's unfused path adds an attn_mask to the logits, a bool one as
    0/1; with fused_attn it is SDPA's keep-mask. The patched module follows each."""
    torch.manual_seed(0)
    x, mask = torch.randn(1, 6, 64), torch.tril(torch.ones(6, 6, dtype=torch.bool))
    for fused in (False, True):
        mod = SV.Attention(64, num_heads=2).eval()
        mod.fused_attn = fused
        with torch.no_grad():
            ref = mod(x, attn_mask=mask)
            with elsa_vision.patched(mod, backend="reference"):
                out = mod(x, attn_mask=mask)
                assert mod._elsa.delegated == 0
        assert (out - ref).abs().max() < 1e-5, fused


def test_a_backend_that_cannot_run_the_attention_is_reported_at_patch(standin):
    """backend="triton" with a head dim the kernels refuse: the module is skipped with the reason at
    patch(), as vggt's, not patched to raise at its first call."""
    mod = SV.Attention(16, num_heads=2).eval()  # head dim 8
    report = elsa_vision.patch(mod, backend="triton")
    assert not patched_modules(mod) and "head dim 8" in str(report)
    with torch.no_grad():
        mod(torch.randn(1, 5, 16))


@pytest.mark.skipif(not HAS_STREAMVGGT, reason="streamvggt is not importable")
@pytest.mark.parametrize("mode", ["batch", "stream"])
def test_real_aggregator_follows_the_rule(mode):
    from streamvggt.models.aggregator import Aggregator
    torch.manual_seed(0)
    agg = Aggregator(img_size=56, patch_size=14, embed_dim=64, depth=2, num_heads=4, patch_embed="conv").eval()
    for p in agg.parameters():
        p.data.normal_(0, 0.2)
    x = frames(S=3, hw=(42, 56))

    def tokens(a, x):
        with torch.no_grad():
            if mode == "batch":
                return torch.stack(a(x)[0])
            past, outs = [None] * a.depth, []
            for i in range(x.shape[1]):
                out, _, past = a(x[:, i:i + 1], past_key_values=past, use_cache=True, past_frame_idx=i)
                outs.append(torch.stack(out))
            return torch.cat(outs, dim=2)

    ref, oracle = tokens(agg, x), tokens(copy.deepcopy(agg).double(), x.double())
    report = elsa_vision.patch(agg)
    assert report.patched["streamvggt-aggregator"] == [""] and len(report.patched["streamvggt"]) == 4
    out = tokens(agg, x)
    assert not delegated(agg)
    e, r = max_err(out, oracle), max_err(ref, oracle)
    assert e <= tolerance(r, torch.float32), f"{e:.3g} vs {r:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_STREAMVGGT, reason="streamvggt is not importable")
def test_gpu_real_aggregator_bf16_batch_and_stream():
    """The full-size aggregator (random weights, 3 frames of 392×518) under bf16 autocast: batch and
    streaming outputs follow the rule against the float64 unpatched model, and the patched stream
    equals the patched batch to the same rule."""
    from streamvggt.models.aggregator import Aggregator
    torch.manual_seed(0)
    agg = Aggregator().cuda().eval()
    x = torch.rand(1, 3, 3, 392, 518, device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def last(a, x, mode, autocast=True):
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            if mode == "batch":
                return a(x)[0][-1].double()
            past, outs = [None] * a.depth, []
            for i in range(x.shape[1]):
                out, _, past = a(x[:, i:i + 1], past_key_values=past, use_cache=True, past_frame_idx=i)
                outs.append(out[-1].double())
            return torch.cat(outs, dim=1)

    oracle = last(copy.deepcopy(agg).double(), x.double(), "batch", autocast=False)
    ref = {m: last(agg, x, m) for m in ("batch", "stream")}
    elsa_vision.patch(agg)
    out = {m: last(agg, x, m) for m in ("batch", "stream")}
    assert not delegated(agg)
    for m in out:
        e, r = max_err(out[m], oracle), max_err(ref[m], oracle)
        assert e <= tolerance(r, torch.bfloat16), f"{m}: {e:.3g} vs {r:.3g}"
