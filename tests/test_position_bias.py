"""Swin's fused position biases (kernels/position_bias.py): v2's bias and its MLP's gradients, and v1's
gathered table and its gradient, under the oracle rule (float64 oracle, bound tied to the dtype that
timm's own module computes in), deterministic gradients, the checks, and their use by the patched
Swin modules — eagerly, under torch.compile, and where they must step aside (hooks on the MLP, a
relative_position_index of another formula, fuse_position_bias=False)."""
from __future__ import annotations

import math

import pytest
import torch

import elsa_vision
from conftest import DEVICE
from elsa_vision.kernels import position_bias as pb
from elsa_vision.verify import max_err, tolerance

timm = pytest.importorskip("timm")
swin1 = pytest.importorskip("timm.models.swin_transformer")
swin2 = pytest.importorskip("timm.models.swin_transformer_v2")


def _module(window, heads, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = swin2.WindowAttention(16 * heads, window_size=window, num_heads=heads).to(DEVICE)
    with torch.no_grad():  # (timm's init leaves the MLP's output near 0, where the sigmoid is flat)
        for p in m.cpb_mlp.parameters():
            p.normal_(0.0, 0.5)
    return m.to(dtype)


def _timm_bias(m, dtype=None):
    """timm's forward's bias, [H, N, N], its MLP in ``dtype`` (default: the module's)."""
    n = m.window_size[0] * m.window_size[1]
    mlp = m.cpb_mlp if dtype is None else m.cpb_mlp.to(dtype)
    table = mlp(m.relative_coords_table.to(mlp[0].weight.dtype)).view(-1, m.num_heads)
    bias = table[m.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1)
    return 16 * torch.sigmoid(bias)


def _params(m):
    return [m.cpb_mlp[0].weight, m.cpb_mlp[0].bias, m.cpb_mlp[2].weight]


def _fused(m):
    w1, b1, w2 = _params(m)
    return pb.continuous_position_bias(m.relative_coords_table.view(-1, 2), w1, b1, w2, m.window_size)


def _with_grads(fn, m, g):
    for p in m.parameters():
        p.grad = None
    out = fn(m)
    (out.double() * g).sum().backward()
    return out.detach(), [p.grad.clone() for p in _params(m)]


@pytest.mark.parametrize("window,heads", [((8, 8), 6), ((3, 5), 2), ((4, 4), 24), ((2, 3), 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_and_gradients_follow_the_oracle_rule(window, heads, dtype):
    """Parameters in ``dtype``: the native reference is timm's MLP in that dtype, the oracle the same
    parameters in float64; the kernel computes in float32 and returns the gradients in ``dtype``."""
    m = _module(window, heads, dtype=dtype)
    n = window[0] * window[1]
    g = torch.randn(heads, n, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    out, grads = _with_grads(_fused, m, g)
    assert out.dtype == torch.float32 and out.shape == (heads, n, n)
    assert all(a.dtype == dtype for a in grads)
    nat, nat_grads = _with_grads(_timm_bias, m, g)
    m64 = _module(window, heads).double()
    m64.load_state_dict(m.state_dict())
    orc, orc_grads = _with_grads(_timm_bias, m64, g)
    assert max_err(out, orc) <= tolerance(max_err(nat, orc), dtype), "bias"
    for name, a, r, o in zip(("W1", "b1", "W2"), grads, nat_grads, orc_grads):
        unit = max(1.0, o.abs().max().item())
        assert max_err(a, o) / unit <= tolerance(max_err(r, o) / unit, dtype, grad=True), name


def test_nan_propagates_as_in_pytorch():
    """A NaN in the coordinates (timm before 1.0.30 divides 0 / 0 for a window of width 1) gives NaN
    where timm's MLP does, not a number."""
    m = _module((3, 3), 2)
    with torch.no_grad():
        m.relative_coords_table.view(-1, 2)[4, 0] = float("nan")
        out, want = _fused(m), _timm_bias(m)
    assert torch.equal(out.isnan(), want.isnan()) and out.isnan().any()


def test_nan_hidden_unit_gradient_is_nan_as_in_pytorch():
    """A hidden unit whose pre-activation is NaN passes its gradient as PyTorch's ReLU backward does
    (NaN into its W1 row and b1 entry), not 0."""
    m = _module((3, 3), 2)
    with torch.no_grad():
        m.cpb_mlp[0].bias[0] = float("nan")
    g = torch.randn(2, 9, 9, dtype=torch.float64).to(DEVICE)
    (_, got), (_, want) = _with_grads(_fused, m, g), _with_grads(_timm_bias, m, g)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan())
    assert got[1][0].isnan()


def test_gradients_are_deterministic():
    m = _module((8, 8), 6)
    g = torch.randn(6, 64, 64, dtype=torch.float64).to(DEVICE)
    _, first = _with_grads(_fused, m, g)
    _, second = _with_grads(_fused, m, g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_no_gradient_wanted():
    m = _module((4, 4), 2)
    with torch.no_grad():
        out = _fused(m)
    assert not out.requires_grad
    assert max_err(out, _timm_bias(m.double()).detach()) <= 1e-5


def test_bad_arguments_say_what_is_wrong():
    m = _module((4, 4), 2)
    w1, b1, w2 = _params(m)
    coords = m.relative_coords_table.view(-1, 2)
    with pytest.raises(ValueError, match=r"\[49, 2\] for the window \(4, 4\)"):
        pb.continuous_position_bias(coords[:30], w1, b1, w2, (4, 4))
    with pytest.raises(ValueError, match="W1 \\[C, 2\\]"):
        pb.continuous_position_bias(coords, w1[:, :1], b1, w2, (4, 4))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        pb.continuous_position_bias(coords.double(), w1, b1, w2, (4, 4))
    with pytest.raises(ValueError, match="window"):
        pb.continuous_position_bias(coords, w1, b1, w2, (0, 4))
    with pytest.raises(ValueError, match="window must be two ints"):
        pb.continuous_position_bias(coords, w1, b1, w2, (4.0, 4))


def test_double_backward_is_refused():
    m = _module((4, 4), 2)
    out = _fused(m)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), _params(m)[2], create_graph=True)


# --------------------------------------------------------------------------------------------
# the patched module


def _patched_pair(window=(4, 4), heads=2, seed=0):
    m = _module(window, heads, seed)
    ref = _module(window, heads, seed)
    ref.load_state_dict(m.state_dict())
    assert elsa_vision.patch(m).num_patched == 1
    return m, ref


def _step(m, x, module=None):
    """One training step of ``m`` (the module, or its compiled form with ``module`` the module itself)."""
    module = module or m
    for p in module.parameters():
        p.grad = None
    out = m(x)
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def _check_same_step(m, ref, x, names=None):
    """One training step of the patched ``m`` and of timm's ``ref``: outputs and the named parameters'
    gradients (default: all) agree to float32 rounding."""
    out, grads = _step(m, x)
    want, want_grads = _step(ref, x)
    assert m._elsa.delegated == 0 and max_err(out, want) <= 1e-4
    for n in names or want_grads:
        assert max_err(grads[n], want_grads[n]) <= 1e-4 * max(1.0, want_grads[n].abs().max().item()), n


def test_patched_module_uses_the_kernel(monkeypatch):
    m, ref = _patched_pair()
    calls = []
    real = pb._forward
    monkeypatch.setattr(pb, "_forward", lambda *a: calls.append(1) or real(*a))
    _check_same_step(m, ref, torch.randn(4, 16, 32, device=DEVICE), ("cpb_mlp.0.weight", "cpb_mlp.0.bias",
                                                                      "cpb_mlp.2.weight"))
    assert calls == [1]


def test_hooks_on_the_mlp_keep_the_modules_own_path(monkeypatch):
    m, _ = _patched_pair()
    monkeypatch.setattr(pb, "_forward", lambda *a: pytest.fail("the kernel bypassed a hook on cpb_mlp"))
    seen = []
    m.cpb_mlp[0].register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    m(torch.randn(4, 16, 32, device=DEVICE))
    assert seen == [(1, 7, 7, 512)]


def test_an_index_of_another_formula_is_not_patched():
    m = _module((4, 4), 2)
    with torch.no_grad():
        m.relative_position_index.copy_(m.relative_position_index.flip(0))
    report = elsa_vision.patch(m)
    assert report.num_patched == 0
    (why,) = [w for _, w in report.skipped["timm.SwinV2WindowAttention"]]
    assert "relative_position_index" in why and "init_non_persistent_buffers" in why
    # timm's own index, for a non-square window and after set_window_size, is the formula's
    m = _module((3, 5), 2)
    m.set_window_size((6, 2))
    assert elsa_vision.patch(m).num_patched == 1
    out, _ = _step(m, torch.randn(2, 12, 32, device=DEVICE))
    assert m._elsa.delegated == 0 and torch.isfinite(out).all()


def test_fuse_position_bias_false_keeps_the_modules_mlp(monkeypatch):
    """patch(fuse_position_bias=False): the module's own MLP and index (timm's bias to the bit, in
    the autocast dtype under autocast), also for an index of another formula, which is then patched."""
    m, ref = _patched_pair()
    elsa_vision.unpatch(m)
    with torch.no_grad():
        for mod in (m, ref):
            mod.relative_position_index.copy_(mod.relative_position_index.flip(1))
    assert elsa_vision.patch(m, fuse_position_bias=False).num_patched == 1
    monkeypatch.setattr(pb, "_forward", lambda *a: pytest.fail("fuse_position_bias=False launched the kernel"))
    _check_same_step(m, ref, torch.randn(4, 16, 32, device=DEVICE), ("cpb_mlp.0.weight", "cpb_mlp.2.weight"))


# --------------------------------------------------------------------------------------------
# Swin v1: the learned table


def _index(wh, ww):
    """timm's relative_position_index of a wh × ww window (its formula, built as timm builds it)."""
    return swin1.get_relative_position_index(wh, ww).to(DEVICE)


def _table_grads(fn, table, g):
    table.grad = None
    out = fn(table)
    (out.double() * g).sum().backward()
    return out.detach(), table.grad.clone()


@pytest.mark.parametrize("window,heads", [((7, 7), 3), ((3, 5), 2), ((12, 12), 4), ((1, 4), 2), ((1, 1), 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_bias_is_the_tables_values_and_its_gradient_follows_the_oracle_rule(window, heads, dtype):
    """The bias is the table's values at timm's index, exactly (float32); the table's gradient, in its
    dtype, against timm's gather's (index_put in that dtype) under the float64 oracle rule."""
    wh, ww = window
    n, index = wh * ww, _index(wh, ww).view(-1)
    table = torch.randn((2 * wh - 1) * (2 * ww - 1), heads, generator=torch.Generator().manual_seed(2))
    table = table.to(DEVICE, dtype).requires_grad_()
    g = torch.randn(heads, n, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)

    def timm_gather(t):
        return t[index].view(n, n, -1).permute(2, 0, 1)

    out, grad = _table_grads(lambda t: pb.relative_position_bias(t, window), table, g)
    assert out.dtype == torch.float32 and out.shape == (heads, n, n) and grad.dtype == dtype
    assert torch.equal(out, timm_gather(table.detach()).float())
    _, nat = _table_grads(timm_gather, table, g)
    t64 = table.detach().double().requires_grad_()
    _, orc = _table_grads(timm_gather, t64, g)
    unit = max(1.0, orc.abs().max().item())
    assert max_err(grad, orc) / unit <= tolerance(max_err(nat, orc) / unit, dtype, grad=True)


def test_table_gradient_is_deterministic_and_the_no_gradient_call_makes_none():
    table = torch.randn(169, 6, device=DEVICE, requires_grad=True)
    g = torch.randn(6, 49, 49, dtype=torch.float64, device=DEVICE)
    runs = [_table_grads(lambda t: pb.relative_position_bias(t, (7, 7)), table, g)[1] for _ in range(2)]
    assert torch.equal(*runs)
    with torch.no_grad():
        out = pb.relative_position_bias(table, (7, 7))
    assert not out.requires_grad and torch.equal(out, table.detach()[_index(7, 7).view(-1)].view(49, 49, 6)
                                                 .permute(2, 0, 1))


def test_table_may_change_in_place_before_the_backward():
    """As with timm's gather (which keeps only the index), an in-place update of the table between the
    forward and the backward is no error: the backward needs only the bias gradient."""
    table = torch.randn(9, 2, device=DEVICE, requires_grad=True)
    out = pb.relative_position_bias(table, (2, 2))
    with torch.no_grad():
        table.add_(1.0)
    out.sum().backward()
    want = torch.zeros(9, 2, dtype=torch.float64).index_add_(0, _index(2, 2).view(-1).cpu(),
                                                           torch.ones(16, 2, dtype=torch.float64))
    assert torch.equal(table.grad.cpu().double(), want)


def test_table_bad_arguments_say_what_is_wrong():
    table = torch.randn(169, 6, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[49, heads\] for the window \(4, 4\)"):
        pb.relative_position_bias(table, (4, 4))
    with pytest.raises(ValueError, match="heads"):
        pb.relative_position_bias(table.view(-1), (7, 7))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        pb.relative_position_bias(table.double(), (7, 7))
    out = pb.relative_position_bias(table.requires_grad_(), (7, 7))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), table, create_graph=True)


def _v1_pair(window=(4, 4), heads=2, seed=0):
    torch.manual_seed(seed)
    m = swin1.WindowAttention(16 * heads, num_heads=heads, window_size=window).to(DEVICE)
    with torch.no_grad():  # (timm's init: a truncated normal of std 0.02; larger values test more)
        m.relative_position_bias_table.normal_()
    ref = swin1.WindowAttention(16 * heads, num_heads=heads, window_size=window).to(DEVICE)
    ref.load_state_dict(m.state_dict())
    return m, ref


def test_patched_v1_module_gathers_its_table_with_the_kernel(monkeypatch):
    m, ref = _v1_pair((4, 4), 2)
    assert elsa_vision.patch(m).num_patched == 1
    calls = []
    real = pb._table_forward
    monkeypatch.setattr(pb, "_table_forward", lambda *a: calls.append(1) or real(*a))
    _check_same_step(m, ref, torch.randn(4, 16, 32, device=DEVICE))
    assert calls == [1]


def test_v1_index_of_another_formula_is_not_patched_unless_the_fusion_is_off(monkeypatch):
    m, ref = _v1_pair((4, 4), 2)
    with torch.no_grad():
        for mod in (m, ref):
            mod.relative_position_index.copy_(mod.relative_position_index.flip(1))
    report = elsa_vision.patch(m)
    assert report.num_patched == 0
    (why,) = [w for _, w in report.skipped["timm.SwinWindowAttention"]]
    assert "relative_position_index" in why and "fuse_position_bias=False" in why
    assert elsa_vision.patch(m, backend="reference").num_patched == 1  # (a named backend reads the index)
    elsa_vision.unpatch(m)
    assert elsa_vision.patch(m, fuse_position_bias=False).num_patched == 1
    monkeypatch.setattr(pb, "_table_forward", lambda *a: pytest.fail("fuse_position_bias=False launched the kernel"))
    _check_same_step(m, ref, torch.randn(4, 16, 32, device=DEVICE))


@pytest.mark.parametrize("version", [1, 2])
def test_an_index_edited_after_patching_takes_the_modules_gather(version):
    """patch() checks the index once; an index written in place (or replaced) afterwards is checked
    again at the next call: another formula takes the module's own gather (timm's answer), timm's
    formula back takes the kernels again."""
    m, ref = _v1_pair((4, 4), 2) if version == 1 else _patched_pair()
    if version == 1:
        assert elsa_vision.patch(m).num_patched == 1
    x = torch.randn(4, 16, 32, device=DEVICE)
    _check_same_step(m, ref, x)
    assert m._elsa.memo["index_ok"]
    canonical = m.relative_position_index.clone()
    with torch.no_grad():
        for mod in (m, ref):
            mod.relative_position_index.copy_(mod.relative_position_index.flip(1))
    _check_same_step(m, ref, x)
    assert not m._elsa.memo["index_ok"]
    for mod in (m, ref):  # a new tensor, timm's formula again
        mod.relative_position_index = canonical.clone()
    _check_same_step(m, ref, x)
    assert m._elsa.memo["index_ok"]


def test_a_module_built_in_inference_mode_is_served():
    """An index made under torch.inference_mode (no version counter) is followed by identity."""
    with torch.inference_mode():
        m, ref = _v1_pair((4, 4), 2)
        assert elsa_vision.patch(m).num_patched == 1
        x = torch.randn(4, 16, 32, device=DEVICE)
        assert max_err(m(x), ref(x)) <= 1e-4 and m._elsa.memo["index_ok"]


def test_an_eager_call_between_compiled_calls_does_not_recompile():
    """The compiled graph reads the index check's kept answer, there from patch() on: an eager call
    in between (an eval pass, code around a graph break) leaves the graph's guards as they were."""
    m, _ = _patched_pair()
    x = torch.randn(4, 16, 32, device=DEVICE)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    c = torch.compile(m, backend=backend)
    with torch.no_grad():
        c(x)
        m(x)
        c(x)
    assert len(graphs) == 1
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# both under torch.compile


def _patched_for_compile(version, window, heads):
    """(patched module, the name of its bias op) for Swin ``version`` 1 or 2."""
    if version == 1:
        m, _ = _v1_pair(window, heads)
        elsa_vision.patch(m)
        return m, "swin_table_bias"
    return _patched_pair(window, heads)[0], "swin_cpb"


@pytest.mark.parametrize("version", [1, 2])
def test_compiled_module_calls_the_op(version):
    """A fullgraph compile of the patched module traces the op (aot_eager on the CPU, where the op is
    opaque; inductor on a GPU): gradients as the eager call's."""
    m, op = _patched_for_compile(version, (4, 4), 2)
    x = torch.randn(4, 16, 32, device=DEVICE)
    want, want_grads = _step(m, x)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("inductor" if DEVICE == "cuda" else "aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    c = torch.compile(m, fullgraph=True, backend=backend)
    out, grads = _step(c, x, m)
    torch._dynamo.reset()
    assert any(op in o for o in ops), ops
    assert max_err(out, want) <= 1e-5
    for n, g in want_grads.items():
        assert max_err(grads[n], g) <= 1e-5 * max(1.0, g.abs().max().item()), n


@pytest.mark.gpu
@pytest.mark.parametrize("version,window", [(1, (7, 7)), (2, (8, 8))])
def test_compiled_graph_launches_the_kernels_itself(monkeypatch, version, window):
    """Once compiled, the module's training step makes the position bias with inductor's launches of
    the kernels: the host launcher is never called (the ops hold the host functions themselves; what
    those would call to launch is pb.launch)."""
    m, _ = _patched_for_compile(version, window, 6)
    x = torch.randn(8, window[0] * window[1], 96, device="cuda")
    torch._dynamo.reset()
    c = torch.compile(m, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, want = _step(c, x, m)
        monkeypatch.setattr(pb, "launch", lambda *a, **k: pytest.fail("a compiled graph called the host launcher"))
        _, grads = _step(c, x, m)
    torch._dynamo.reset()
    assert all(torch.equal(grads[n], g) for n, g in want.items())
    assert math.isfinite(sum(g.abs().sum().item() for g in grads.values()))
