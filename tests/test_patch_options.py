"""patch() checks every option before it touches any module: a bad value raises with what is wrong
and how to fix it, and the model is left exactly as it was (no half-patched model). Each option is
tried with a value of the wrong type and one out of range, on a small Swin (timm) and on the VGGT
stand-in (tests/vggt_standin.py)."""
import sys
from pathlib import Path

import pytest
import torch

import elsa_vision
from elsa_vision.adapters import registry
from elsa_vision.adapters import vggt as A

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vggt_standin as V  # noqa: E402

MODEL_METHODS = ("forward", "_attn", "_elsa")  # what patching sets on an instance


def _swin():
    timm = pytest.importorskip("timm")
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, depths=(2,),
                             num_heads=(2,), embed_dim=32, window_size=7)


def _vggt():
    torch.manual_seed(0)
    return V.VGGT().eval()


MODELS = {"swin": _swin, "vggt": _vggt}


@pytest.fixture(scope="module", autouse=True)
def standin_classes():
    remove = A.register_classes(**V.CLASSES)
    yield
    remove()


def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {n: {a: m.__dict__.get(a) for a in MODEL_METHODS} for n, m in model.named_modules()})


def _untouched(model, before):
    state, attrs = before
    assert registry.patched_modules(model) == []
    assert {n: {a: m.__dict__.get(a) for a in MODEL_METHODS} for n, m in model.named_modules()} == attrs
    assert all(a not in m.__dict__ for m in model.modules() for a in MODEL_METHODS)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


BAD = [
    # (options, error, message): for each option a value of the wrong type, then one out of range
    (dict(fuse_windows="yes please"), TypeError, "fuse_windows must be True or False"),
    (dict(fuse_windows=1), TypeError, "fuse_windows must be True or False"),
    (dict(fuse_position_bias="no"), TypeError, "fuse_position_bias must be True or False"),
    (dict(precision=32), ValueError, "precision must be one of"),
    (dict(precision="fp64"), ValueError, "precision must be one of"),
    (dict(backend=None), ValueError, "unknown backend"),
    (dict(backend="flash"), ValueError, "unknown backend"),
    (dict(lean_memory="all"), TypeError, "lean_memory must be True/False or a sequence of layer indices"),
    (dict(lean_memory=[1, 2.5]), TypeError, "lean_memory must be True/False or a sequence"),
    (dict(lean_memory=(i for i in (1, 3))), TypeError, "lean_memory must be True/False or a sequence"),
    (dict(lean_chunk=True), TypeError, "lean_chunk must be a positive int"),
    (dict(lean_chunk="4096"), TypeError, "lean_chunk must be a positive int"),
    (dict(lean_chunk=0), ValueError, "lean_chunk must be a positive int"),
    (dict(head_chunk=2.0), TypeError, "head_chunk must be a positive int"),
    (dict(head_chunk=-1), ValueError, "head_chunk must be a positive int"),
    (dict(lean_offload="no"), TypeError, "lean_offload must be True or False"),
    (dict(lean_offload=True), ValueError, "pass lean_memory=True"),
    (dict(lean_chunk=4096), ValueError, "lean_chunk sets the chunks of lean_memory's passes"),
    (dict(head_chunk=2), ValueError, "head_chunk sets the chunks of lean_memory's passes"),
    (dict(kv_reserve=4), ValueError, "kv_reserve works through"),
    (dict(lean_memory=True, lean_offload=None), TypeError, "lean_offload must be True or False"),
    (dict(token_merging=0.9), TypeError, "token_merging must be an elsa_vision.TokenMerging"),
    (dict(token_merging={"ratio": 0.5}), TypeError, "token_merging must be an elsa_vision.TokenMerging"),
    (dict(include="blocks.*"), TypeError, r"include must be a list of glob patterns.*include=\['blocks"),
    (dict(exclude=[1]), TypeError, "exclude must be a list of glob patterns"),
    (dict(no_such_option=1), TypeError, "unknown option"),
]


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("options,error,message", BAD)
def test_bad_option_leaves_the_model_untouched(model_name, options, error, message):
    model = MODELS[model_name]()
    before = _snapshot(model)
    with pytest.raises(error, match=message):
        elsa_vision.patch(model, **options)
    _untouched(model, before)


@pytest.mark.parametrize("field,value", [("ratio", 1.5), ("ratio", True), ("protect", -0.1), ("protect", True),
                                         ("start_layer", -1), ("start_layer", True), ("cell", (0, 2)),
                                         ("similarity_dtype", torch.int8), ("similarity_dim", 0),
                                         ("similarity_dim", True), ("similarity_dim", 8.0), ("reuse", 0),
                                         ("reuse", 2.0), ("reuse", True)])
def test_token_merging_values_are_checked_when_made(field, value):
    with pytest.raises((TypeError, ValueError), match=f"TokenMerging.{field}"):
        A.TokenMerging(**{field: value})


def test_good_options_patch():
    model = _swin()
    report = elsa_vision.patch(model, fuse_windows=False, head_chunk=None, include=["layers.*"], exclude=())
    assert report.num_patched > 0
    assert elsa_vision.unpatch(model) == report.num_patched
    model = _vggt()
    report = elsa_vision.patch(model, lean_memory=range(2), lean_chunk=64, head_chunk=1, lean_offload=True,
                               token_merging=A.TokenMerging(ratio=0.5))
    assert "vggt-aggregator" in report.patched and "vggt-dpt-head" in report.patched
    assert elsa_vision.unpatch(model) == report.num_patched


def test_a_model_dependent_refusal_patches_nothing():
    """A value that fits the options but not the model (layers past the aggregator's depth) raises
    while patch() asks every module, before it binds any: the attention modules met earlier in the
    walk stay unpatched."""
    model = _vggt()
    before = _snapshot(model)
    with pytest.raises(ValueError, match="outside the aggregator's"):
        elsa_vision.patch(model, lean_memory=[0, 99])
    _untouched(model, before)


@pytest.mark.parametrize("options,owner", [
    (dict(token_merging=A.TokenMerging(ratio=0.5)), "vggt-aggregator"),
    (dict(lean_memory=True), "vggt-dpt-head / vggt-aggregator"),
])
def test_a_vggt_option_on_a_model_without_its_modules_raises(options, owner):
    """An option that works through VGGT's modules only, on a model that has none (a timm Swin),
    raises rather than silently doing nothing; its off values (None, False) are accepted."""
    model = _swin()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=f"works through {owner} modules"):
        elsa_vision.patch(model, **options)
    _untouched(model, before)
    assert elsa_vision.patch(model, lean_memory=False, token_merging=None).num_patched > 0


def test_patching_again_with_the_same_anchored_options_is_a_no_op():
    model = _vggt()
    n = elsa_vision.patch(model, lean_memory=True, token_merging=A.TokenMerging(ratio=0.5)).num_patched
    report = elsa_vision.patch(model, lean_memory=True, token_merging=A.TokenMerging(ratio=0.5))
    assert report.num_patched == 0 and len(report.already) == n


def test_patching_again_with_other_options_warns_and_keeps_the_first():
    import warnings
    model = _swin()
    part = elsa_vision.patch(model, include=["layers.0.blocks.0*"], precision="ieee").num_patched
    with warnings.catch_warnings():  # the modules patched before are not this call's: no warning
        warnings.simplefilter("error")
        elsa_vision.patch(model, exclude=["layers.0.blocks.0*"], precision="tf32")
    elsa_vision.unpatch(model)
    assert part > 0
    n = elsa_vision.patch(model, precision="ieee").num_patched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(elsa_vision.patch(model, precision="ieee").already) == n  # the same options: quiet
    with pytest.warns(UserWarning, match=r"already patched with other options keep those"):
        report = elsa_vision.patch(model, precision="tf32")
    assert report.num_patched == 0 and len(report.already) == n
    assert all(st.options["precision"] == "ieee" for _, st in registry.patched_modules(model))


def test_the_other_options_warning_as_an_error_leaves_the_model_as_it_was():
    """Where warnings are errors (pytest -W error), the "already patched with other options"
    warning raises before any module is bound: the part patched before stays the only part."""
    import warnings
    model = _swin()
    elsa_vision.patch(model, include=["layers.0.blocks.0*"], precision="ieee")
    before = [n for n, _ in registry.patched_modules(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="already patched with other options"):
            elsa_vision.patch(model, precision="tf32")
    assert [n for n, _ in registry.patched_modules(model)] == before


def test_a_bind_that_raises_unbinds_the_modules_bound_before_it(monkeypatch):
    """An adapter that raises while a module is bound (its initial memo) leaves none of the call's
    modules patched, those bound before it included."""
    model = _swin()
    before = _snapshot(model)
    calls = []
    real = registry.Adapter.initial_memo

    def memo(self, module, options):
        calls.append(module)
        if len(calls) == 2:
            raise RuntimeError("planted")
        return real(self, module, options)

    monkeypatch.setattr(registry.Adapter, "initial_memo", memo)
    with pytest.raises(RuntimeError, match="planted"):
        elsa_vision.patch(model)
    assert len(calls) == 2
    _untouched(model, before)


def test_patched_context_restores_only_what_it_patched():
    """``with patched(model)`` restores the modules it patched; modules patched before the block
    stay patched (with their options)."""
    model = _swin()
    first = elsa_vision.patch(model, include=["layers.0.blocks.0*"], precision="ieee").num_patched
    before = [n for n, _ in registry.patched_modules(model)]
    with elsa_vision.patched(model) as report:
        assert report.num_patched > 0 and len(report.already) == first
        assert len(registry.patched_modules(model)) == first + report.num_patched
    assert [n for n, _ in registry.patched_modules(model)] == before
    assert all(st.options["precision"] == "ieee" for _, st in registry.patched_modules(model))
    with elsa_vision.patched(model, exclude=["*"]):
        pass
    assert [n for n, _ in registry.patched_modules(model)] == before


def test_unpatch_refuses_a_replaced_method_and_restores_nothing():
    """A patched method replaced (a hook library's wrapper) or removed after patch(): unpatch raises
    before it restores any module, so the model is never left half-patched."""
    model = _swin()
    n = elsa_vision.patch(model).num_patched
    mod = next(m for m in model.modules() if registry.is_patched(m))
    method = mod._elsa.adapter.method
    object.__setattr__(mod, method, lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="replaced or removed after patch"):
        elsa_vision.unpatch(model)
    assert len(registry.patched_modules(model)) == n
    del mod.__dict__[method]
    with pytest.raises(RuntimeError, match="No module was restored"):
        elsa_vision.unpatch(model)
    assert len(registry.patched_modules(model)) == n
    with pytest.raises(TypeError, match="unpatch expects a torch.nn.Module"):
        elsa_vision.unpatch(None)


def test_module_attr_reads_what_getattr_reads():
    """registry.module_attr (the adapters' lookup of attributes a module may lack) gives what
    getattr gives for instance attributes, parameters, buffers, submodules, class attributes and
    properties, and the default for a missing name, without nn.Module.__getattr__ raising."""
    class M(torch.nn.Module):
        cls_attr = 3

        def __init__(self):
            super().__init__()
            self.width = 7
            self.w = torch.nn.Parameter(torch.ones(2))
            self.register_buffer("b", torch.zeros(2))
            self.register_parameter("none_param", None)
            self.child = torch.nn.Identity()

        @property
        def prop(self):
            return self.width * 2

    m = M()
    for name in ("width", "w", "b", "none_param", "child", "cls_attr", "prop"):
        assert registry.module_attr(m, name, "default") is getattr(m, name)
    assert registry.module_attr(m, "missing") is None and registry.module_attr(m, "missing", 5) == 5
