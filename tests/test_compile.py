"""torch.compile of ELSA's ops and of patched models.

CPU (Triton interpreter; the ops are opaque custom ops there): fullgraph compile with aot_eager of
the ops and of a patched VGGT stand-in, outputs and gradients equal to eager, dynamic shapes
without a recompile per shape. GPU (``-m gpu``; the ops are triton_ops that inductor decomposes
into launches of the Triton kernels): inductor's results against eager and the float64 oracle,
no Python of this package run by a compiled graph, dynamic shapes, the compile modes.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import elsa_vision
from conftest import DEVICE
from elsa_vision import verify

sys.path.insert(0, str(Path(__file__).resolve().parent))

GPU = torch.cuda.is_available()


def _counting(backend: str, count=None):
    """A torch.compile backend that records, for each graph it compiles, how many ELSA forwards the
    graph calls (see oracle_check.elsa_forward_calls), or what ``count(gm)`` says."""
    from oracle_check import elsa_forward_calls
    graphs = []

    def compile_graph(gm, example_inputs):
        graphs.append((count or elsa_forward_calls)(gm))
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)
    return compile_graph, graphs


def _qkv(B, H, N, D, dtype=torch.float32, grad=True, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, device=DEVICE, dtype=dtype).requires_grad_(grad) for _ in range(3)]


def _grads(fn, *inputs, seed=1):
    out = fn(*inputs)
    go = torch.randn(out.shape, generator=torch.Generator(device=DEVICE).manual_seed(seed), device=DEVICE,
                     dtype=out.dtype)
    return out, torch.autograd.grad(out, [t for t in inputs if t.requires_grad], go)


# ---------------------------------------------------------------------------------------------
# CPU (and GPU): graphs, gradients, dynamic shapes


def test_dynamic_shapes_do_not_recompile():
    """One graph serves every batch and token count (attention with a bias gradient, and windows)."""
    backend, graphs = _counting("inductor" if GPU else "aot_eager")
    torch._dynamo.reset()

    def step(q, k, v, bias):
        return elsa_vision.attention(q, k, v, bias=bias, causal=True)

    c = torch.compile(step, fullgraph=True, backend=backend, dynamic=True)
    for B, N in ((3, 36), (4, 50), (3, 80)):  # (B ≠ H: duck sizing would tie them; N both sides of 64)
        q, k, v = _qkv(B, 2, N, 32, seed=B)
        bias = torch.randn(2, N, N, device=DEVICE, requires_grad=True)
        out, grads = _grads(c, q, k, v, bias)
        ref, ref_grads = _grads(step, q, k, v, bias)
        assert verify.max_err(out, ref) <= 1e-6
        assert all(verify.max_err(a, b) <= 1e-5 for a, b in zip(grads, ref_grads))
    assert graphs == [1]  # one graph (its backward compiled with it) for every shape, one ELSA call in it
    torch._dynamo.reset()


def test_window_dynamic_batch():
    backend, graphs = _counting("inductor" if GPU else "aot_eager")
    torch._dynamo.reset()
    nW, H, N, D = 4, 2, 49, 32
    bias = torch.randn(H, N, N, device=DEVICE, requires_grad=True)
    mask = torch.where(torch.rand(nW, N, N, device=DEVICE) < 0.3, -100.0, 0.0)

    def step(q, k, v):
        return elsa_vision.window_attention(q, k, v, bias=bias, mask=mask)

    c = torch.compile(step, fullgraph=True, backend=backend)
    for batch in (2, 3, 1):
        q, k, v = _qkv(batch * nW, H, N, D, seed=batch)
        torch._dynamo.mark_dynamic(q, 0), torch._dynamo.mark_dynamic(k, 0), torch._dynamo.mark_dynamic(v, 0)
        out, grads = _grads(c, q, k, v)
        ref, ref_grads = _grads(step, q, k, v)
        assert verify.max_err(out, ref) <= 1e-6
        assert all(verify.max_err(a, b) <= 1e-5 for a, b in zip(grads, ref_grads))
    assert len(graphs) == 1
    torch._dynamo.reset()


def test_window_tokens_and_bias_symbolic():
    """Window attention with a bias, in training, where the token count is symbolic: dynamic=True
    (one full graph; the bias check once broke the graph on a tuple of SymInts), and the default
    compile, whose recompile for a second token count makes it symbolic (saving for the backward
    once hashed a SymInt in a planner's cache and raised)."""
    H, D = 2, 16

    def step(q, k, v, bias):
        return elsa_vision.window_attention(q, k, v, bias=bias)

    for dynamic, fullgraph in ((True, True), (None, False)):
        torch._dynamo.reset()
        c = torch.compile(step, fullgraph=fullgraph, backend="inductor" if GPU else "aot_eager", dynamic=dynamic)
        for N in (20, 24, 28):
            q, k, v = _qkv(8, H, N, D, seed=N)
            bias = torch.randn(H, N, N, device=DEVICE, requires_grad=True)
            out, grads = _grads(c, q, k, v, bias)
            ref, ref_grads = _grads(step, q, k, v, bias)
            assert verify.max_err(out, ref) <= 1e-6
            assert all(verify.max_err(a, b) <= 1e-5 for a, b in zip(grads, ref_grads))
    torch._dynamo.reset()


@pytest.mark.parametrize("packed,image", [(True, None), (False, None), (True, (7, 10))],
                         ids=["packed", "apart", "packed-padded"])
def test_shifted_windows_compiled_in_place(packed, image):
    """Shifted windows under compile: image rows go into the window op as they are (the kernels roll
    and partition them by their addressing; no roll in the graph), outputs and gradients as eager's,
    one graph for every batch size; a padded map (``image_size``) likewise."""
    backend, graphs = _counting("inductor" if GPU else "aot_eager")
    rolls = []

    def counting(gm, example_inputs):
        rolls.append(sum(1 for n in gm.graph.nodes if n.op == "call_function" and "roll" in str(n.target)))
        return backend(gm, example_inputs)
    torch._dynamo.reset()
    ih, iw, ws, sh, H, D = 8, 12, 4, 2, 2, 16
    nW = (ih // ws) * (iw // ws)
    bias = torch.randn(H, ws * ws, ws * ws, device=DEVICE, requires_grad=True)
    mask = torch.where(torch.rand(nW, ws * ws, ws * ws, device=DEVICE) < 0.3, -100.0, 0.0)

    def step(*args):  # (q, k, v or the packed qkv), then the bias
        return elsa_vision.shifted_window_attention(*args[:-1], window_size=ws, shift_size=sh, bias=args[-1],
                                                    mask=mask, precision="ieee", image_size=image)  # (one product: the
        # interpreter's quickest; the kernels' addressing is every precision's)

    c = torch.compile(step, fullgraph=True, backend=counting)
    for batch in (2, 3):
        g = torch.Generator(device=DEVICE).manual_seed(batch)
        shape = (batch, ih, iw, 3, H, D) if packed else (batch, ih, iw, H, D)
        ins = [torch.randn(shape, generator=g, device=DEVICE).requires_grad_() for _ in range(1 if packed else 3)]
        for t in ins:
            torch._dynamo.mark_dynamic(t, 0)
        out, grads = _grads(c, *ins, bias)
        ref, ref_grads = _grads(step, *ins, bias)
        assert verify.max_err(out, ref) <= 1e-6
        assert all(verify.max_err(a, b) <= 1e-5 for a, b in zip(grads, ref_grads))
    assert len(graphs) == 1 and graphs[0] == 1 and rolls == [0]
    torch._dynamo.reset()


def test_dynamic_swin_backbone_compiles_as_timms():
    """torch.compile(dynamic=True) of a patched Swin backbone fed images of several sizes (maps
    padded to different grids, the blocks' shift masks built per call): no graph break — the
    attention module's float ``scale``, a symbol under dynamic=True, passes the checks unread — and
    no more graphs than timm's own model compiles for the same sizes, outputs as eager's. (On a GPU
    machine: CUDA tensors under inductor, its fused norms and projections within float32 rounding.)"""
    timm = pytest.importorskip("timm")
    counts = {}
    for patched in (False, True):
        torch.manual_seed(0)
        m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, depths=(2,),
                              num_heads=(2,), embed_dim=32, drop_path_rate=0.0, strict_img_size=False,
                              features_only=True).eval().to(DEVICE)
        m.layers_0.blocks[0].attn.fused_attn = False  # (the module's scale then reaches the call)
        if patched:
            elsa_vision.patch(m)
        backend, graphs = _counting("inductor" if GPU else "aot_eager")
        torch._dynamo.reset()
        c = torch.compile(m, backend=backend, dynamic=True)
        for hw in ((44, 52), (60, 36), (48, 40)):
            x = torch.randn(1, 3, *hw, generator=torch.Generator().manual_seed(hw[0])).to(DEVICE)
            with torch.no_grad():
                out, ref = c(x), m(x)
            assert all(verify.max_err(a, b) <= (1e-5 * max(1.0, b.abs().max().item()) if GPU else 1e-6)
                       for a, b in zip(out, ref))
        counts[patched] = len(graphs)
        # the patched graphs call ELSA's window forward, once per block (2 blocks); timm's none
        assert graphs and all(n == (2 if patched else 0) for n in graphs), (patched, graphs)
    torch._dynamo.reset()
    assert counts[True] == counts[False], counts


@pytest.mark.parametrize("name,tags", [("vit_tiny_patch16_224", False), ("vit_tiny_patch16_224", True),
                                       ("eva02_tiny_patch14_224", False)])
def test_compiled_patched_timm_guards_miss_no_attribute(name, tags, monkeypatch):
    """The guards of a compiled patched model ask for no attribute a module lacks before every call:
    each such guard would re-raise nn.Module.__getattr__'s AttributeError (the adapters read the
    optional attributes of timm's modules through registry.module_attr: from the module's dicts;
    with dynamo's recursive dict tags on, submodules from ``_modules`` and other names as
    attributes, so that a name the module lacks — none in a ViT's attention, EVA's lacks
    ``attn_dim`` and ``num_kv_groups`` — is asked for at every call there)."""
    timm = pytest.importorskip("timm")
    m = timm.create_model(name, pretrained=False, img_size=28 if "eva" in name else 32, depth=2).eval()
    elsa_vision.patch(m)
    x = torch.randn(1, 3, *(2 * [28 if "eva" in name else 32]))
    backend, graphs = _counting("aot_eager")
    import torch._dynamo.config as dc
    misses = []
    lookup = torch.nn.Module.__getattr__

    def counted(self, attr):
        try:
            return lookup(self, attr)
        except AttributeError:
            misses.append((type(self).__name__, attr))
            raise
    with dc.patch(use_recursive_dict_tags_for_guards=tags), torch.no_grad():
        torch._dynamo.reset()
        c = torch.compile(m, backend=backend, fullgraph=True)
        c(x)
        monkeypatch.setattr(torch.nn.Module, "__getattr__", counted)
        for _ in range(2):
            c(x)
    assert len(graphs) == 1 and misses == []
    torch._dynamo.reset()


def _module_tag_safety(compiled_model) -> dict:
    """{source: tag-safe} of the module nodes (timm's and torch.nn's classes) of the compiled
    frame's guard tree."""
    import re
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    code = type(compiled_model._orig_mod).forward.__code__
    tree = str(_debug_get_cache_entry_list(code)[0].guard_manager)
    found = re.findall(r"GuardManager: source=(L\['self'\][^,]*), .*type=<class '((?:timm|torch\.nn\.modules)\.[^']+)'>, "
                       r"tag_safe=\((True|False)", tree)
    return {src: safe == "True" for src, _, safe in found}


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "swin_tiny_patch4_window7_224"])
def test_compiled_patched_guards_skip_unchanged_modules(name):
    """With dynamo's recursive dict tags (on by default in torch 2.11), a compiled model's guards
    skip every module subtree whose dicts are unchanged since the last call. A patched model keeps
    that wherever timm's own does: what the patch puts on a module (its state, its forward) and what
    a trace reads of it are modules, dicts and plain values (registry.PatchState). Before, no
    patched module's subtree was (each one's guards ran in full before every call: 4.5x timm's
    guard time for a compiled ViT-B)."""
    timm = pytest.importorskip("timm")
    import torch._dynamo.config as dc
    if not hasattr(dc, "use_recursive_dict_tags_for_guards"):
        pytest.skip("this torch has no recursive dict tags for guards")
    kw = dict(img_size=32, depth=2) if "vit" in name else dict(img_size=56, window_size=7, depths=(2, 2), num_heads=(1, 2),
                                                               embed_dim=16)
    ref = timm.create_model(name, pretrained=False, **kw).eval().to(DEVICE)
    m = copy.deepcopy(ref)
    elsa_vision.patch(m)
    x = torch.randn(1, 3, kw["img_size"], kw["img_size"], device=DEVICE)
    safety = []
    with dc.patch(use_recursive_dict_tags_for_guards=True), torch.no_grad():
        for model in (ref, m):
            torch._dynamo.reset()
            c = torch.compile(model, backend="aot_eager", fullgraph=True)
            c(x)
            safety.append(_module_tag_safety(c))
    torch._dynamo.reset()
    lost = [src for src, safe in safety[0].items() if safe and src in safety[1] and not safety[1][src]]
    patched = [src for src in safety[1] if src.endswith("['attn']")]
    assert patched and lost == [], lost


def test_compiled_patched_guards_still_see_changes():
    """Skipping the guards of unchanged modules leaves every change a patched model's trace read
    guarded: a module option changed after compiling (attention dropout switched on in training
    sends that module's calls to timm's forward) recompiles, and unpatch() after compiling runs
    timm's forward, with timm's values."""
    timm = pytest.importorskip("timm")
    import torch._dynamo.config as dc
    if not hasattr(dc, "use_recursive_dict_tags_for_guards"):
        pytest.skip("this torch has no recursive dict tags for guards")
    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2).to(DEVICE)
    m = copy.deepcopy(ref)
    elsa_vision.patch(m)
    x = torch.randn(2, 3, 32, 32, device=DEVICE)
    backend, graphs = _counting("aot_eager")
    with dc.patch(use_recursive_dict_tags_for_guards=True):
        torch._dynamo.reset()
        c = torch.compile(m, backend=backend, fullgraph=True)
        for _ in range(2):
            torch.testing.assert_close(c(x), ref(x), rtol=1e-4, atol=1e-4)
        assert len(graphs) == 1 and graphs[0] == 2  # both attention calls are ELSA's
        m.blocks[1].attn.attn_drop.p = 0.5  # in training: timm's forward (its dropout mask)
        c(x)
        assert len(graphs) > 1 and graphs[-1] == 1
        elsa_vision.unpatch(m)
        m.blocks[1].attn.attn_drop.p = 0.0
        n = len(graphs)
        torch.testing.assert_close(c(x), ref(x), rtol=1e-4, atol=1e-4)
        assert len(graphs) == n + 1 and graphs[-1] == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("packed", [False, True])
def test_host_ops_for_the_hopper_calls(packed, monkeypatch):
    """A traced call the Hopper kernels would take (kernels.attention._hopper_in_graph; forced here)
    goes into the graph as the opaque host op (one graph, the op in it), whose body picks the
    kernels per call; outputs and gradients are eager's, bit for bit (the same host code runs).
    (Under the interpreter every op is opaque: that the host ops run the Gluon kernels, forward and
    backward, is test_hopper_gpu's test_compiled_calls_take_the_hopper_kernels.)"""
    from elsa_vision.kernels import attention as K
    from oracle_check import elsa_forward_calls
    monkeypatch.setattr(K, "_hopper_in_graph", lambda *args: True)
    names = []

    def backend(gm, example_inputs):
        names.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        assert elsa_forward_calls(gm) == 1
        return gm.forward
    g = torch.Generator(device=DEVICE).manual_seed(2)
    if packed:
        ins = [torch.randn(2, 40, 3, 2, 16, generator=g, device=DEVICE).requires_grad_()]
        step = lambda t: elsa_vision.attention_packed(t, causal=True)  # noqa: E731
    else:
        ins = _qkv(2, 2, 40, 16)
        step = lambda q, k, v: elsa_vision.attention(q, k, v, causal=True)  # noqa: E731
    torch._dynamo.reset()
    out, grads = _grads(torch.compile(step, fullgraph=True, backend=backend), *ins)
    ref, ref_grads = _grads(step, *ins)
    assert any("_host_fwd" in n for n in names)
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    torch._dynamo.reset()


@pytest.mark.parametrize("which", ["attention", "window", "shifted"])
def test_packed_gradient_comes_out_whole(which):
    """A packed call (attention_packed, window_attention_packed, shifted windows on a packed qkv)
    compiled: the backward graph takes qkv's gradient from the op as one tensor — no stack or cat
    of three gradients (a copy the size of qkv) — and the gradients are eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    joins = []

    def count_joins(gm, example_inputs):
        joins.append(sum(1 for n in gm.graph.nodes
                         if n.op == "call_function" and str(n.target).split(".")[1:2] in (["stack"], ["cat"])))
        return make_boxed_func(gm)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    H, D = 2, 16
    if which == "attention":
        qkv = torch.randn(2, 37, 3, H, D, generator=g, device=DEVICE)
        bias = torch.randn(H, 37, 37, generator=g, device=DEVICE)
        step = lambda t, b: elsa_vision.attention_packed(t, bias=b, causal=True)  # noqa: E731
    else:
        bias = torch.randn(H, 16, 16, generator=g, device=DEVICE)
        if which == "window":
            qkv = torch.randn(6, 16, 3, H, D, generator=g, device=DEVICE)
            step = lambda t, b: elsa_vision.window_attention_packed(t, bias=b)  # noqa: E731
        else:
            qkv = torch.randn(2, 8, 8, 3, H, D, generator=g, device=DEVICE)
            mask = torch.where(torch.rand(4, 16, 16, generator=g, device=DEVICE) < 0.3, -100.0, 0.0)
            step = lambda t, b: elsa_vision.shifted_window_attention(t, window_size=4, shift_size=2,  # noqa: E731
                                                                     bias=b, mask=mask)
    qkv.requires_grad_()
    bias.requires_grad_()
    torch._dynamo.reset()
    c = torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm),
                                                                 bw_compiler=count_joins))
    out, grads = _grads(c, qkv, bias)
    ref, ref_grads = _grads(step, qkv, bias)
    assert verify.max_err(out, ref) <= 1e-6 and all(verify.max_err(a, b) <= 1e-5 for a, b in zip(grads, ref_grads))
    assert joins == [0]
    if GPU:  # inductor: the kernels write into the one gradient tensor it allocates, not into views of it
        torch._dynamo.reset()
        out, grads = _grads(torch.compile(step, fullgraph=True), qkv, bias)
        assert verify.max_err(out, ref) <= 1e-6 and all(verify.max_err(a, b) <= 1e-5
                                                        for a, b in zip(grads, ref_grads))
    torch._dynamo.reset()


def test_vggt_standin_aggregator_fullgraph():
    """A patched VGGT stand-in compiles in one graph (frame and global attention, the fused norm +
    RoPE of inference), with ELSA's ops in it, and returns what eager returns."""
    import vggt_standin as V
    from elsa_vision.adapters import vggt as A
    from oracle_check import elsa_forward_calls, op_calls

    def count(gm):  # (attention forwards, fused q/k norm + RoPE calls)
        return elsa_forward_calls(gm), op_calls(gm, ("qk_norm_rope",), ("_qk_norm_rope_kernel",))
    remove = A.register_classes(**V.CLASSES)
    try:
        torch.manual_seed(0)
        m = V.VGGT().eval().to(DEVICE)
        x = torch.rand(1, 3, 3, 42, 70, device=DEVICE)
        elsa_vision.patch(m)
        with torch.no_grad():
            ref = m.aggregator(x)[0][-1]
            backend, graphs = _counting("inductor" if GPU else "aot_eager", count)
            torch._dynamo.reset()
            out = torch.compile(m.aggregator, fullgraph=True, backend=backend)(x)[0][-1]
            assert verify.max_err(out, ref) <= 1e-5 * max(1.0, ref.abs().max().item())
            # frame and global attention, each with its q and k from the fused kernel (see _token_tables)
            assert len(graphs) == 1 and min(graphs[0]) >= 2 * m.aggregator.depth
            # without fullgraph too (torch.compile's default): the model's RoPE would break every
            # block's graph at positions.max().item(); the adapter forms it traceably
            torch._dynamo.reset()
            graphs.clear()
            torch._dynamo.utils.counters.clear()
            out = torch.compile(m.aggregator, backend=backend)(x)[0][-1]
            assert len(graphs) == 1 and min(graphs[0]) >= 2 * m.aggregator.depth
            assert not torch._dynamo.utils.counters["graph_break"]
        assert verify.max_err(out, ref) <= 1e-5 * max(1.0, ref.abs().max().item())
    finally:
        elsa_vision.unpatch(m)
        remove()
        torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# GPU: inductor launches the kernels itself


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision,causal", [(torch.bfloat16, "auto", True), (torch.float16, "auto", False),
                                                    (torch.float32, "fp16x3", True), (torch.float32, "ieee", False)])
def test_inductor_attention_follows_the_oracle_rule(dtype, precision, causal):
    """Forward and gradients (q, k, v and a bias) of the inductor-compiled call against the float64
    oracle under the tolerance rule, and against the eager call."""
    from oracle_check import assert_close_to_oracle, torch_same_dtype
    q, k, v = _qkv(2, 4, 1000, 64, dtype)
    bias = torch.randn(4, 1000, 1000, device="cuda", requires_grad=True)

    def step(q, k, v, bias):
        return elsa_vision.attention(q, k, v, bias=bias, causal=causal, precision=precision)

    torch._dynamo.reset()
    out, grads = _grads(torch.compile(step, fullgraph=True), q, k, v, bias)
    eager, eager_grads = _grads(step, q, k, v, bias)
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref, ref_grads = _grads(lambda *t: verify.oracle(*t[:3], bias=t[3], causal=causal), *ins64)
    # compiled within the eager call's own distance from the oracle of the eager call
    assert verify.max_err(out, eager) <= verify.max_err(eager, ref) + 1e-6 * eager.abs().max().item()
    same_ins = [t.detach().clone().requires_grad_() for t in (q, k, v)] + [bias.detach().clone().requires_grad_()]
    same, same_grads = _grads(lambda *t: torch_same_dtype(*t[:3], bias=t[3], causal=causal), *same_ins)
    assert_close_to_oracle(out, ref, same)
    for name, a, r, s in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, same_grads):
        assert_close_to_oracle(a, r, s, name=name, grad=True)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_compiled_graph_runs_no_python_of_ours(monkeypatch):
    """Once compiled, a training step of attention and windows launches the kernels from inductor's
    code: the host launchers of the kernel families are never called."""
    from elsa_vision.kernels import attention as K, window as W
    q, k, v = _qkv(2, 4, 512, 64, torch.bfloat16)
    wq, wk, wv = _qkv(64, 3, 49, 32, torch.bfloat16, seed=3)
    wb = torch.randn(3, 49, 49, device="cuda", requires_grad=True)

    def step(q, k, v, wq, wk, wv, wb):
        a = elsa_vision.attention(q, k, v).float().square().mean()
        return a + elsa_vision.window_attention(wq, wk, wv, bias=wb).float().square().mean()

    torch._dynamo.reset()
    c = torch.compile(step, fullgraph=True)
    inputs = (q, k, v, wq, wk, wv, wb)
    c(*inputs).backward()
    want = [t.grad.clone() for t in inputs]

    def called(*args, **kwargs):
        raise AssertionError("a compiled graph called a host launcher")
    for mod in (K, W):
        monkeypatch.setattr(mod, "forward", called)
        monkeypatch.setattr(mod, "backward", called)
    for t in inputs:
        t.grad = None
    c(*inputs).backward()
    assert all(torch.equal(t.grad, w) for t, w in zip(inputs, want))  # the same kernels, the same results
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compile_modes_on_a_patched_vit(mode):
    timm = pytest.importorskip("timm")
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, depth=2).cuda()
    x = torch.randn(4, 3, 64, 64, device="cuda")
    elsa_vision.patch(m)
    skipped = lambda: torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]  # noqa: E731
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = m(x).float()
        torch._dynamo.reset()
        before = skipped()
        c = torch.compile(m, fullgraph=True, mode=mode)
        for _ in range(3):  # (reduce-overhead records its CUDA graph on a later call)
            out = c(x).float()
    assert verify.max_err(out, ref) <= 2e-2 * max(1.0, ref.abs().max().item())
    # the graph is replayed from a CUDA graph, not run by inductor without one (which it does, with a
    # perf_hints log line, for a graph holding an op that cannot be captured)
    assert skipped() == before
    torch._dynamo.reset()


@pytest.mark.gpu
def test_reduce_overhead_training_of_a_patched_vit():
    """Training steps of a patched ViT under ``mode="reduce-overhead"``: forward and backward
    replayed from CUDA graphs (none left out), gradients as the eager patched step's."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, depth=2, drop_path_rate=0.0).cuda()
    x = torch.randn(8, 3, 64, 64, device="cuda")
    elsa_vision.patch(m)
    skipped = lambda: torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]  # noqa: E731

    def loss(f):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return f(x).float().square().mean()

    loss(m).backward()
    eager = {n: p.grad.clone() for n, p in m.named_parameters()}
    torch._dynamo.reset()
    before = skipped()
    c = torch.compile(m, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # (the CUDA graphs are recorded on a later step, then replayed)
        m.zero_grad(set_to_none=True)
        loss(c).backward()
    assert skipped() == before
    for n, p in m.named_parameters():
        scale = max(1e-6, eager[n].abs().max().item())
        assert verify.max_err(p.grad, eager[n]) <= 5e-2 * scale, n
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw,size", [("vit_tiny_patch16_224", dict(depth=2), 224),
                                          ("swin_tiny_patch4_window7_224", dict(depths=(2, 2), num_heads=(3, 6)), 224),
                                          # 64 × 64 and 32 × 32 maps under 7 × 7 windows: padded
                                          ("swin_tiny_patch4_window7_224", dict(depths=(2, 2), num_heads=(3, 6),
                                                                                img_size=256), 256),
                                          ("swinv2_tiny_window8_256", dict(depths=(2, 2), num_heads=(3, 6)), 256)])
def test_inductor_training_step_of_patched_timm(name, kw, size):
    """A compiled training step of a patched model: one graph, gradients as the eager patched step's."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, drop_path_rate=0.0, **kw).cuda()
    x = torch.randn(8, 3, size, size, device="cuda")
    elsa_vision.patch(m)

    def step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(x).float().square().mean()

    step(x).backward()
    eager = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    backend, graphs = _counting("inductor")
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend=backend)(x).backward()
    assert len(graphs) == 1 and graphs[0] > 0, graphs  # (one graph, and ELSA's forwards in it)
    for n, p in m.named_parameters():
        if n in eager:
            scale = max(1e-6, eager[n].abs().max().item())
            assert verify.max_err(p.grad, eager[n]) <= 5e-2 * scale, n
    torch._dynamo.reset()


def _fresh_interpreter(script: str, **env):
    """Run ``script`` in a new Python process at the repository root (``env``: variables to set, or
    with None to remove)."""
    import os
    import subprocess
    full = {**os.environ, **{k: v for k, v in env.items() if v is not None}}
    for k in (k for k, v in env.items() if v is None):
        full.pop(k, None)
    return subprocess.run([sys.executable, "-c", script], env=full, cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=900)


_FIRST_CALL_SCRIPT = r"""
import torch, timm, elsa_vision
torch.manual_seed(0)
vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=4)
swin = timm.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4, embed_dim=24,
                         depths=(2, 2), num_heads=(2, 4), num_classes=4)
for m in (vit, swin):
    elsa_vision.patch(m)
    x = torch.randn(2, 3, *m.patch_embed.img_size)
    # fullgraph: a graph break raises; this is the process's first ELSA call of each family
    torch.compile(m, fullgraph=True, backend="aot_eager")(x).square().mean().backward()
print("OK")
"""


def test_fullgraph_when_the_first_call_is_compiled():
    """A compiled call that is the process's first (nothing run eagerly before it: the kernel modules
    not yet imported by the dispatch layer) is one graph for a patched ViT and Swin. In this test
    session earlier tests have run eagerly, so this runs in a fresh interpreter."""
    pytest.importorskip("timm")
    r = _fresh_interpreter(_FIRST_CALL_SCRIPT)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


_STATIC_SCRIPT = r"""
import time, torch, timm, elsa_vision
from torch._inductor.async_compile import AsyncCompile
from benchmarks.models import user_kernel_launchers
t0 = time.time()
while not AsyncCompile.use_process_pool():  # (until its workers are up, inductor compiles in this process)
    assert time.time() - t0 < 300, "inductor's compile workers did not start"
    time.sleep(0.5)
torch.manual_seed(0)
m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(2, 2), num_heads=(3, 6),
                      drop_path_rate=0.0).cuda()
elsa_vision.patch(m)
x = torch.randn(4, 3, 224, 224, device="cuda")
q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", requires_grad=True) for _ in range(3))

def step(x, q, k, v):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return m(x).float().square().mean() + elsa_vision.attention(q, k, v).float().square().mean()

step(x, q, k, v).backward()
eager = [p.grad.clone() for p in (*m.parameters(), q, k, v)]
m.zero_grad(set_to_none=True)
q.grad = k.grad = v.grad = None
torch.compile(step, fullgraph=True)(x, q, k, v).backward()
for p, e in zip((*m.parameters(), q, k, v), eager):
    assert (p.grad - e).abs().max().item() <= 5e-2 * max(1e-6, e.abs().max().item())
print("LAUNCHERS=" + user_kernel_launchers())
"""


@pytest.mark.gpu
def test_static_launcher_switch_reaches_the_compile_workers():
    """README's switch for compiled steps paced by the host: with
    TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1 in the environment, inductor's compile
    workers (default settings; the script waits until they are up, so that they, not the parent,
    compile the kernels) give every ELSA kernel of a Swin training step and an attention call its
    static launcher, and the gradients are the eager step's."""
    pytest.importorskip("timm")
    r = _fresh_interpreter(_STATIC_SCRIPT, TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS="1",
                           TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",  # (compiled here, not loaded from an earlier run)
                           TORCHINDUCTOR_COMPILE_THREADS=None)
    assert r.returncode == 0, r.stderr[-3000:]
    listing = [line[len("LAUNCHERS="):] for line in r.stdout.splitlines() if line.startswith("LAUNCHERS=")]
    assert listing and listing[0], f"no user-defined kernel was loaded: {r.stdout[-2000:]}"
    launchers = dict(e.split(": ") for e in listing[0].split("; "))
    # the window blocks' forward and fused backward, and the attention call's forward and backward
    want = {"_win_fwd_kernel", "_win_bwd_fused_kernel", "_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"}
    assert want <= set(launchers), launchers
    assert all(kind == "static" for kind in launchers.values()), launchers
