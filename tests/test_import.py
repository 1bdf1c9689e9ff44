"""elsa_vision without Triton (macOS, Windows, MPS): the package imports, "auto" runs the reference
backend and says why, and naming the Triton backend explains what is missing."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HIDDEN_TRITON = r'''
import sys, warnings
sys.modules["triton"] = None  # hidden: every `import triton` raises ImportError
import torch
import elsa_vision
from elsa_vision import BackendFallbackWarning, NotSupportedError

loaded = sorted(m for m, mod in sys.modules.items() if mod is not None and (m == "triton" or m.startswith("triton.")))
assert not loaded, loaded
q, k, v = (torch.randn(2, 3, 9, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = elsa_vision.attention(q, k, v)
    win = elsa_vision.window_attention(q, k, v)
said = [str(w.message) for w in caught if issubclass(w.category, BackendFallbackWarning)]
assert any("triton is not installed" in m and "reference" in m for m in said), said
assert torch.equal(out, elsa_vision.attention(q, k, v, backend="reference"))
assert torch.equal(win, elsa_vision.window_attention(q, k, v, backend="reference"))
try:
    elsa_vision.attention(q, k, v, backend="triton")
except NotSupportedError as e:
    assert "triton is not installed" in str(e), e
else:
    raise AssertionError("backend='triton' ran without triton")
elsa_vision.TokenMerging(ratio=0.5)  # the VGGT options import without the kernels
try:
    import timm
except ImportError:
    timm = None
if timm is not None:
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=16).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        report = elsa_vision.patch(model)
        assert report.num_patched > 0, str(report)
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
print("ok")
'''


def test_without_triton():
    # TRITON_INTERPRET=1 makes the Triton backend claim CPU tensors: with Triton absent, "auto" must
    # still fall back to the reference backend, and say so
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", HIDDEN_TRITON], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
