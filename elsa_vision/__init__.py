"""elsa-vision: exact softmax attention as a two-level monoid scan, in Triton, with drop-in patching
for timm ViT / Swin and VGGT.

    import elsa_vision
    out = elsa_vision.attention(q, k, v)        # q/k/v [B, H, N, D]
    out = elsa_vision.attention_packed(qkv)     # qkv [B, N, 3, H, D]: its gradient written in one piece
    out = elsa_vision.window_attention(q, k, v, bias=rel_bias, mask=shift_mask)  # Swin windows
    out = elsa_vision.window_attention_packed(qkv, bias=rel_bias, mask=shift_mask)  # qkv [B·nW, N, 3, H, D]
    out = elsa_vision.shifted_window_attention(qkv, window_size=7, shift_size=3, bias=rel_bias, mask=shift_mask)
                                                # qkv [B, height, width, 3, H, D]: roll + windows in the kernel
    report = elsa_vision.patch(model)           # timm / VGGT models
"""
import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "kernels")) and _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")):
    # Source checkout: kernels/ and adapters/ sit beside this folder (an install maps them to
    # elsa_vision.kernels / elsa_vision.adapters); let the import system find them there too.
    __path__.append(_root)

from .api import (attention, attention_packed, clear_caches, patch, patched, resolve_precision,
                  shifted_window_attention, unpatch, window_attention, window_attention_packed)
from .dispatch import BACKENDS, BackendFallbackWarning, NotSupportedError

__all__ = ["attention", "attention_packed", "window_attention", "window_attention_packed", "shifted_window_attention",
           "patch", "unpatch", "patched", "resolve_precision", "clear_caches", "verify", "BACKENDS", "NotSupportedError",
           "BackendFallbackWarning"]
__version__ = "0.1.0"

from .adapters.vggt import TokenMerging  # noqa: E402  (VGGT token merging, an option of patch())

__all__.append("TokenMerging")


def __getattr__(name):
    # elsa_vision.verify on first use: imported here eagerly, ``python -m elsa_vision.verify`` would
    # find the module already loaded and warn (runpy's RuntimeWarning)
    if name == "verify":
        import importlib
        return importlib.import_module(".verify", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
