"""patch() checks every option before it touches any module: a bad value raises with what is wrong
and how to fix it, and the model is left exactly as it was (no half-patched model)."""
import sys
from pathlib import Path

import pytest
import torch

import elsa_vision
from elsa_vision.adapters import registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
timm = pytest.importorskip("timm")


def _untouched(model, before):
    assert registry.patched_modules(model) == []
    assert not any("_elsa" in m.__dict__ or "forward" in m.__dict__ for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def _swin():
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, depths=(2,),
                             num_heads=(2,), embed_dim=32, window_size=7)


@pytest.mark.parametrize("options,error,message", [
    (dict(fuse_windows="yes please"), TypeError, "fuse_windows must be True or False"),
    (dict(fuse_windows=1), TypeError, "fuse_windows must be True or False"),
    (dict(precision="fp64"), ValueError, "precision must be one of"),
    (dict(backend="flash"), ValueError, "unknown backend"),
    (dict(lean_memory="all"), TypeError, "lean_memory must be True/False or a sequence of layer indices"),
    (dict(lean_memory=[1, 2.5]), TypeError, "lean_memory must be True/False or a sequence"),
    (dict(lean_chunk=0), ValueError, "lean_chunk must be a positive int"),
    (dict(lean_chunk=True), ValueError, "lean_chunk must be a positive int"),
    (dict(head_chunk=-1), ValueError, "head_chunk must be a positive int"),
    (dict(head_chunk=2.0), ValueError, "head_chunk must be a positive int"),
    (dict(lean_offload="no"), TypeError, "lean_offload must be True or False"),
    (dict(lean_offload=True), ValueError, "pass lean_memory=True"),
    (dict(token_merging=0.9), TypeError, "token_merging must be an elsa_vision.TokenMerging"),
    (dict(no_such_option=1), TypeError, "unknown option"),
])
def test_bad_option_leaves_a_timm_model_untouched(options, error, message):
    model = _swin()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=message):
        elsa_vision.patch(model, **options)
    _untouched(model, before)


def test_good_options_patch():
    model = _swin()
    report = elsa_vision.patch(model, fuse_windows=False, lean_chunk=4096, head_chunk=None)
    assert report.num_patched > 0
    assert elsa_vision.unpatch(model) == report.num_patched


def test_a_model_dependent_refusal_patches_nothing():
    """A value that fits the options but not the model (layers past the aggregator's depth) raises
    while patch() asks every module, before it binds any: the attention modules met earlier in the
    walk stay unpatched."""
    import vggt_standin as V
    from elsa_vision.adapters import vggt as A
    remove = A.register_classes(**V.CLASSES)
    try:
        torch.manual_seed(0)
        model = V.VGGT().eval()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match="outside the aggregator's"):
            elsa_vision.patch(model, lean_memory=[0, 99])
        _untouched(model, before)
    finally:
        remove()
