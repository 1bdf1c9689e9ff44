"""The eager replay (kernels/native.py, native.cpp). On the CPU: plans whose recipes launch nothing,
so that the C++ autograd function, the buffers and views, the saved tensors, the bias-gradient
rule, the Python call-back for a missing backward recipe, released plans and the double-backward
error are exercised without a GPU. On a GPU (``-m gpu``): recorded calls replayed, bitwise the
Python path's."""
import pytest
import torch
from oracle_check import DropGradient

native = pytest.importorskip("elsa_vision.kernels.native")


@pytest.fixture(scope="module")
def ext():
    if not native.requested():
        pytest.skip("ELSA_NATIVE=0")
    try:
        module = native._build()  # (the CPU suite runs under the interpreter, where load() keeps it off)
    except Exception as e:  # (no C++ compiler or ninja here)
        pytest.skip(f"the extension does not build here: {e}")
    module.set_recorder(lambda plan, *rest: RECORDERS[plan](plan, *rest))
    yield module
    module.set_recorder(native._record_backward)  # (the recorder is the process's: give it back)


RECORDERS: dict = {}  # plan id → the test's recorder for it
F32 = 6  # c10::ScalarType::Float
# slot 2 (the first buffer, allocated [2, 4, 3]) viewed as [2, 3, 4]
_out_view = (2, [2, 3, 4], [12, 1, 3], 0)


def _plan(ext, calls: list, what: str = "probe"):
    """A plan on (x [2, 3, 4], bias [3, 4] or None): out a transposed view of a new buffer, stats a
    second buffer returned as allocated; saved (x, bias, out); the backward's recipe recorded by
    ``record``."""
    def record(plan, dout, saved, bias_grad):
        calls.append((plan, dout.shape, [None if t is None else t.shape for t in saved], bias_grad))
        return [dout * 2, (dout.sum(0) if bias_grad else torch.empty(0))]

    plan = ext.new_plan(what, 2, [([2, 4, 3], [12, 3, 1], F32), ([6], [1], F32)], [],
                        [_out_view, (3, [6], [1], 0)], [0, 1, 2], 1, 1)
    RECORDERS[plan] = record
    return plan


def test_forward_allocates_the_recipes_views(ext):
    calls = []
    plan = _plan(ext, calls)
    x = torch.randn(2, 3, 4)
    out, stats = ext.call_forward(plan, 0, x, None)
    assert out.shape == (2, 3, 4) and out.stride() == (12, 1, 3) and out.dtype == torch.float32
    assert out._base is not None and out._base.shape == (2, 4, 3)  # (a view of the buffer as allocated)
    assert stats.shape == (6,) and stats._base is None and not out.requires_grad
    out2, _ = ext.call_forward(plan, 0, x)
    assert out2.data_ptr() != out.data_ptr()  # (a new buffer per call)


def test_backward_calls_back_then_replays(ext):
    calls = []
    plan = _plan(ext, calls)
    x = torch.randn(2, 3, 4, requires_grad=True)
    out, stats = ext.call(plan, 0, x, None)
    assert out.requires_grad and not stats.requires_grad and out.grad_fn is not None
    g = torch.randn(2, 3, 4)
    (dx,) = torch.autograd.grad(out, x, g)
    assert len(calls) == 1 and calls[0][2] == [(2, 3, 4), None, (2, 3, 4)] and calls[0][3] is False
    torch.testing.assert_close(dx, 2 * g, rtol=0, atol=0)
    # a recipe for this layout: the next backward replays it (its buffer: uninitialised, its shape as recorded)
    ext.add_backward(plan, False, g, 4, [([2, 3, 4], [12, 4, 1], F32)], [], [(4, [2, 3, 4], [12, 4, 1], 0),
                                                                           (-1, [], [], 0)])
    out, _ = ext.call(plan, 0, x, None)
    (dx,) = torch.autograd.grad(out, x, g)
    assert len(calls) == 1 and dx.shape == (2, 3, 4) and dx.stride() == (12, 4, 1)
    assert _replayed(out)
    # another output-gradient layout has no recipe: called back again
    out, _ = ext.call(plan, 0, x, None)
    (dx,) = torch.autograd.grad(out, x, g.transpose(1, 2).contiguous().transpose(1, 2))
    assert len(calls) == 2


def test_bias_gradient_only_where_the_bias_requires_one(ext):
    calls = []
    plan = _plan(ext, calls)
    x = torch.randn(2, 3, 4, requires_grad=True)
    bias = torch.randn(3, 4)
    out, _ = ext.call(plan, 0, x, bias)
    out.backward(torch.ones(2, 3, 4))
    assert calls[-1][3] is False and bias.grad is None
    bias.requires_grad_(True)
    out, _ = ext.call(plan, 0, x, bias)
    out.backward(torch.ones(2, 3, 4))
    assert calls[-1][3] is True
    torch.testing.assert_close(bias.grad, torch.full((3, 4), 2.0), rtol=0, atol=0)


def test_no_output_gradient_gives_no_input_gradient(ext):
    """A later node that returns no gradient for the output: the plan's backward is not called back
    and gives x none through it (as the Python Function does)."""
    calls = []
    plan = _plan(ext, calls)
    x = torch.randn(2, 3, 4, requires_grad=True)
    out, _ = ext.call(plan, 0, x, None)
    (dx,) = torch.autograd.grad((DropGradient.apply(out) + x.sum()).sum(), (x,))
    assert calls == [] and torch.equal(dx, torch.full_like(x, out.numel()))


def test_double_backward_is_refused(ext):
    calls = []
    plan = _plan(ext, calls, what="attention")
    x = torch.randn(2, 3, 4, requires_grad=True)
    out, _ = ext.call(plan, 0, x, None)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


def test_malformed_plans_raise(ext):
    buf = [([24], [1], F32)]
    with pytest.raises(RuntimeError, match="an output must be a view of a buffer"):
        ext.new_plan("probe", 2, buf, [], [(0, [2], [1], 0), (2, [2], [1], 0)], [0, 1], 1, 1)
    with pytest.raises(RuntimeError, match="returns \\(out, statistics\\)"):
        ext.new_plan("probe", 2, buf, [], [(2, [2], [1], 0)], [0, 1], 1, 1)
    with pytest.raises(RuntimeError, match="must begin with the inputs up to the bias"):
        ext.new_plan("probe", 2, buf, [], [(2, [2], [1], 0), (2, [2], [1], 0)], [0, 2], 1, 1)
    with pytest.raises(RuntimeError, match="unknown plan"):
        ext.call_forward(1 << 40, 0, torch.randn(2))


def test_a_released_plan_lives_on_in_its_graphs(ext):
    """release() forgets a plan for new calls; a graph built from it still runs its backward."""
    calls = []
    plan = _plan(ext, calls)
    live = ext.live_plans()
    x = torch.randn(2, 3, 4, requires_grad=True)
    out, _ = ext.call(plan, 0, x, None)
    ext.release(plan)
    assert ext.live_plans() == live - 1
    with pytest.raises(RuntimeError, match="unknown plan"):
        ext.call(plan, 0, x, None)
    (dx,) = torch.autograd.grad(out, x, torch.ones(2, 3, 4))
    assert len(calls) == 1 and torch.equal(dx, torch.full_like(x, 2.0))


# ---------------------------------------------------------------------------------------------
# GPU: recorded recipes replayed, bitwise the Python path's results


def _replayed(t: torch.Tensor) -> bool:
    """Whether ``t`` came out of the C++ replay (its autograd node is the extension's Replay)."""
    fn = t.grad_fn
    return type(fn).__name__ == "CppFunction" and "Replay" in fn.name()


def _ready():
    if not native.load():
        pytest.skip(f"native path not available: {native.status()}")


CASES = {  # (B, H, N, D, dtype, precision, causal, bias: None | "fixed" | "grad")
    "vit-bf16": (4, 12, 197, 64, torch.bfloat16, "native", False, None),
    "vit-fp16": (4, 12, 197, 64, torch.float16, "native", False, None),
    "frames-bf16-causal": (2, 4, 1041, 64, torch.bfloat16, "native", True, None),
    "d128-bias": (2, 4, 300, 128, torch.bfloat16, "native", False, "fixed"),
    "fp32-ieee": (2, 4, 197, 64, torch.float32, "ieee", False, None),
    "fp32-tf32x3-bias": (2, 4, 197, 32, torch.float32, "tf32x3", False, "fixed"),
    "bias-gradient": (2, 4, 197, 64, torch.bfloat16, "native", False, "grad"),
    "fp16x3": (2, 4, 197, 64, torch.float32, "fp16x3", False, None),
}


def _inputs(case, packed, seed=0):
    B, H, N, D, dtype, precision, causal, bias = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(B, N, 3, H, D, device="cuda", generator=g).to(dtype).requires_grad_()
    b = None if bias is None else torch.randn(H, N, N, device="cuda", generator=g).expand(B, H, N, N)
    if bias == "grad":
        b = b.detach().clone().requires_grad_()
    return qkv, b, D ** -0.5, causal, precision


def _call(packed, qkv, bias, scale, causal, precision, autograd=True):
    from elsa_vision.kernels import attention as K
    from elsa_vision.kernels.reference import qkv_views
    op, tensors = (K.PACKED, (qkv,)) if packed else (K.OP, qkv_views(qkv))
    args = (*tensors, bias, scale, causal, precision, 0)
    return op, args, (op.apply(*args) if autograd else op.run(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("first", ["autograd", "no-grad"])
@pytest.mark.parametrize("packed", [False, True], ids=["views", "packed"])
@pytest.mark.parametrize("case", list(CASES))
def test_replay_is_bitwise_the_python_path(case, packed, first):
    """Calls of one signature, each on new tensors (new addresses, new TMA maps): the first recorded
    (Python path; with autograd or without), the next replayed from C++ (forward and backward;
    portable kernels, and Gluon ones with their tensor maps encoded by the replay); outputs,
    statistics and gradients bitwise the Python path's, with autograd and without. Bodies a recipe
    cannot replay (fp16x3's scales pass; the bias gradient's reduction) keep the Python path for
    that part, with the same results."""
    _ready()
    native.clear_plans()
    precision = CASES[case][5]

    def step(seed, autograd=True):
        qkv, bias, scale, causal, prec = _inputs(case, packed, seed)
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        go = torch.randn(qkv.shape[0], qkv.shape[3], qkv.shape[1], qkv.shape[4], device="cuda", generator=g)
        go = go.to(qkv.dtype)
        leaves = [qkv] + ([bias] if bias is not None and bias.requires_grad else [])
        op, args, (out, stats) = _call(packed, qkv, bias, scale, causal, prec, autograd)
        grads = torch.autograd.grad(out, leaves, go) if autograd else ()
        return op, args, out, [out, stats, *grads]

    with native.python_path():
        want = {seed: step(seed)[3] for seed in (1, 2)}
        want_inf = {seed: step(seed, autograd=False)[3] for seed in (1, 2)}
    op, args, _, got = step(1, autograd=first == "autograd")  # (recorded)
    for a, b in zip(got, (want if first == "autograd" else want_inf)[1]):
        assert torch.equal(a, b)
    plan = native._PLANS.get(native._key(op, args))
    served = precision != "fp16x3"  # (its scales pass is an unplanned launch: the Python path)
    assert (type(plan) is int) == served, (plan, native.status())
    for seed in (1, 2, 1, 2):
        _, _, out, got = step(seed)
        assert _replayed(out) == served
        for a, b in zip(got, want[seed]):
            assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
        _, _, _, got = step(seed, autograd=False)
        for a, b in zip(got, want_inf[seed]):
            assert a.stride() == b.stride() and torch.equal(a, b)
    if served:
        bias_grad = CASES[case][7] == "grad"  # (a bias gradient: its backward is Python's, no recipe)
        assert native._ext.backward_recipes(plan) == (0 if bias_grad else 1)


@pytest.mark.gpu
def test_aliased_inputs_do_not_share_a_plan_with_distinct_ones():
    """attention(x, x, x) then attention(q, k, v) of the same layout: the recipe of the first maps k
    and v to x's slot, so the second must not replay it (the signature keeps which inputs alias)."""
    _ready()
    from elsa_vision.kernels import attention as K
    native.clear_plans()
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(2, 4, 197, 64, device="cuda", generator=g).bfloat16()
    q, k, v = (torch.randn(2, 4, 197, 64, device="cuda", generator=g).bfloat16() for _ in range(3))
    for _ in range(2):
        K.OP.run(x, x, x, None, 0.125, False, "native", 0)
    with native.python_path():
        want = K.OP.run(q, k, v, None, 0.125, False, "native", 0)
    for _ in range(2):
        got = K.OP.run(q, k, v, None, 0.125, False, "native", 0)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    keys = [key for key in native._PLANS if key[0] is K.OP]
    assert len(keys) == 2 and all(type(native._PLANS[key]) is int for key in keys)


@pytest.mark.gpu
def test_launch_modes_take_the_python_path():
    """Under allocations_only() (the memory rehearsal) a call launches nothing and records nothing,
    and a planned signature is not replayed there."""
    _ready()
    from elsa_vision.kernels import attention as K
    from elsa_vision.kernels.launch import allocations_only
    native.clear_plans()
    q, k, v = (torch.randn(2, 4, 197, 64, device="cuda").bfloat16() for _ in range(3))
    with allocations_only():
        K.OP.run(q, k, v, None, 0.125, False, "native", 0)
        K.OP.run(q, k, v, None, 0.125, False, "native", 0)
    assert not native._PLANS
    K.OP.run(q, k, v, None, 0.125, False, "native", 0)
    assert type(native._PLANS[native._key(K.OP, (q, k, v, None, 0.125, False, "native", 0))]) is int
    torch.cuda.synchronize()
    with allocations_only():  # (a replay here would launch the kernels: time, and writes)
        out, _ = K.OP.run(q, k, v, None, 0.125, False, "native", 0)
    assert out.shape == q.shape


@pytest.mark.gpu
def test_replayed_vit_training_steps_match_the_python_path():
    """A patched timm ViT's bf16 training steps: the replayed steps' loss and every parameter
    gradient bitwise the Python path's."""
    timm = pytest.importorskip("timm")
    _ready()
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", num_classes=10, img_size=96).cuda()
    import elsa_vision
    elsa_vision.patch(model)
    x = torch.randn(8, 3, 96, 96, device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    with native.python_path():
        want = step()
    native.clear_plans()
    for _ in range(3):
        got = step()
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    plans = [p for p in native._PLANS.values() if type(p) is int]
    assert plans and all(native._ext.backward_recipes(p) >= 1 for p in plans)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # (a repeated packed call is replayed)
        qkv = model.blocks[0].attn.qkv(model.patch_embed(x)).reshape(8, -1, 3, 6, 64)
        replayed = [_replayed(elsa_vision.attention_packed(qkv)) for _ in range(2)]
        assert replayed == [False, True]


def test_a_released_plans_call_back_records_nothing(monkeypatch):
    """A graph built from a plan that clear_plans() released since calls back for a backward layout
    with no recipe: its gradients come from the Python backward, with no recording tried (which
    would warn that it failed and keep the layout on Python for the plans to come)."""
    class Op:
        what = "probe"

        @staticmethod
        def backward(dout, x, scale, bias_grad):
            return dout * scale, None

    plan = 1 << 40
    monkeypatch.setitem(native._INFO, plan, (Op, (3.0,), ()))
    monkeypatch.setattr(native, "_ext", None)  # (a recording would need it)
    assert plan not in native._LIVE
    before = set(native._PYTHON_BACKWARDS)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dx, _ = native._record_backward(plan, torch.ones(2), [torch.zeros(2)], False)
    assert torch.equal(dx, torch.full((2,), 3.0)) and native._PYTHON_BACKWARDS == before
