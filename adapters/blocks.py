"""Pre-norm transformer blocks: the block's residual stream in fused passes.

timm's ViT ``Block`` and VGGT's ``Block`` compute
``h = norm1(x); x = x + ls1(attn(h)); h = norm2(x); x = x + ls2(mlp(h))`` (``ls``: LayerScale
or Identity; the drop-paths identities: eval mode, or a drop rate of 0). :class:`PreNormBlock` runs the same with
launches of :func:`elsa_vision.kernels.residual.residual_norm` around the block's own ``attn`` and
``mlp`` modules (patched or not): norm1(x); the first residual with norm2 of its result; the
second residual with its LayerScale (without one, PyTorch's add: the same bits, one pass). The residual stream is bitwise the block's own; the LayerNorm outputs agree to
float32 rounding. Under CUDA autocast a LayerNorm output that feeds only linear layers, which
autocast casts anyway, is written in the autocast dtype directly.

Under autograd (training) the passes with a norm record one backward pass each (kernels/residual.py:
the LayerNorm's input gradient plus the residual stream's, and the branch's gradient through
``ls(y)``, in one pass); the last residual is PyTorch's add. It serves a call only where nothing can
tell the difference and the residual stream has at least :data:`MIN_ELEMENTS` elements
(:data:`MIN_TRAINING_ELEMENTS` under autograd; smaller calls are paced by the host, where the block's
own ops cost less), and delegates to the block's own forward otherwise (counted in
``module._elsa.delegated``): a small call, a module in training mode
with an active drop-path, hooks on the norms, the LayerScales or the drop-paths (which this forward does
not call), tensors on a device without the kernels, dtypes or widths the kernel does not take, a
compiled graph (inductor fuses these passes itself), or CPU autocast. Patch option
``fuse_residual=False`` leaves the blocks alone.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from torch import nn

from ..dispatch import autocast_dtype, triton_serves
from ..kernels.limits import RESIDUAL_DTYPES, RESIDUAL_MAX_WIDTH
from .registry import Adapter, PatchState, adapter_of, check_flag, hooked, is_patched, module_attr, replaced, state_of

# Below this many residual-stream elements a block call is paced by the host, not the GPU: the fused
# launches (two a block, three with a LayerScale after the MLP) then cost more host time than the
# block's own ops (a few tens of microseconds a block), and the GPU time they save is smaller.
# Measured on an H200 with eager attention calls replayed from C++ (bf16 inference at 224 px against
# timm's SDPA path, with the passes / without; the MLP residual then a launch too):
# at 4.8M elements ViT-S batch 64 0.89× / 1.02× and ViT-B batch 32 0.80× / 0.97×; at 9.7M ViT-S
# batch 128 1.13× / 1.07× and ViT-B batch 64 1.25× / 1.07× (vit_fwd_replay_nofuse.csv,
# vit_b_fwd_min_work.csv, vit_s_fwd_min_work.csv). VGGT is above it from eight frames.
MIN_ELEMENTS = 1 << 23
# The same under autograd: each pass with a norm is then an autograd Function whose Python forward and
# backward cost far more host time than PyTorch's own LayerNorm and add ops. ViT-S and ViT-B at 224 px,
# batch 64 (9.7M elements for ViT-B) measured slower through them on an H100 host whose training step
# is host-paced (ViT-S: 11 ms of kernels in a 36 ms step), ViT-B at 512 px, batch 16 (12.6M) the
# same; ViT-B at 384 px, batch 64 (28M) 1.14× faster (H200).
MIN_TRAINING_ELEMENTS = 1 << 24


@functools.lru_cache(maxsize=None)
def _triton_serves(device_type: str) -> bool:
    return triton_serves(device_type)  # (the environment it reads is fixed once Triton is imported)


def _scale(ls: nn.Module) -> Optional[torch.Tensor]:
    """A LayerScale's gamma (None for Identity)."""
    if isinstance(ls, nn.Identity):
        return None
    g = ls._parameters.get("gamma")
    return g if g is not None else ls.gamma


def _layer_scale(ls: nn.Module, width: int) -> bool:
    """Identity, or a LayerScale (``x * gamma``, or its in-place form: the same values) of [width]."""
    if isinstance(ls, nn.Identity):
        return True
    gamma = getattr(ls, "gamma", None)
    return (type(ls).__name__ == "LayerScale" and isinstance(gamma, torch.Tensor)
            and tuple(gamma.shape) == (width,) and not replaced(ls))


def _layer_norm(norm: nn.Module) -> bool:
    """An ``nn.LayerNorm`` over the last dimension, or timm's subclass of it without its fast-norm
    option (which normalizes in the autocast dtype)."""
    timm_norm = type(norm).__name__ == "LayerNorm" and type(norm).__module__ == "timm.layers.norm"
    return ((type(norm) is nn.LayerNorm or timm_norm) and len(norm.normalized_shape) == 1
            and not getattr(norm, "_fast_norm", False))


def _inert(drop: nn.Module) -> bool:
    """A drop-path that passes its input through in this call."""
    return isinstance(drop, nn.Identity) or not drop.training or getattr(drop, "drop_prob", 1.0) == 0.0


def _feeds_linear(module: nn.Module, attention: bool) -> bool:
    """Whether ``module``'s forward reads its input only through linear layers that autocast casts
    (so an input already in the autocast dtype gives the same result): an attention patched by this
    package, or an MLP whose ``fc1`` is an ``nn.Linear``; and no hooks that would see the input."""
    if hooked(module):
        return False
    return is_patched(module) if attention else type(module._modules.get("fc1")) is nn.Linear


class PreNormBlock(Adapter):
    """The forward of a pre-norm block (see the module docstring). Subclasses set ``targets``,
    ``attend`` (how the block calls its attention) and, where the class's forward must have one
    of a few parameter lists (its body is known for those), ``signatures``."""

    options = frozenset({"fuse_residual"})
    signatures: Optional[tuple[tuple[str, ...], ...]] = None

    def check_options(self, options):
        check_flag(options, "fuse_residual", True)
        super().check_options(options)

    def skip_reason(self, module, options):
        if not options.get("fuse_residual", True):
            return "fuse_residual=False: the block's own residual adds and norms run"
        if options.get("backend", "auto") not in ("auto", "triton"):
            return f"backend={options['backend']!r}: the fused residual passes are Triton kernels"
        params = tuple(inspect.signature(type(module).forward).parameters)[1:]
        if self.signatures is not None and params not in self.signatures:
            return f"its forward takes {params}, not one of {self.signatures}"
        for name in ("norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2"):
            if not isinstance(getattr(module, name, None), nn.Module):
                return f"no {name} submodule"
        for name in ("norm1", "norm2"):
            norm = getattr(module, name)
            if not _layer_norm(norm):
                return f"{name} is not an nn.LayerNorm over the last dimension (timm's: without fast norm)"
        width = module.norm1.normalized_shape[0]
        if module.norm2.normalized_shape[0] != width or not 0 < width <= RESIDUAL_MAX_WIDTH:
            return (f"norms of {width} and {module.norm2.normalized_shape[0]} features "
                    f"(the kernel takes equal widths of 1 to {RESIDUAL_MAX_WIDTH})")
        for name in ("ls1", "ls2"):
            if not _layer_scale(getattr(module, name), width):
                return f"{name} is neither Identity nor a LayerScale of [{width}]"
        return None

    def attend(self, block, h, *args, **kwargs):
        raise NotImplementedError

    @staticmethod
    def why_not(block, x: torch.Tensor) -> Optional[str]:
        """Why this call must run the block's own forward (None: the fused passes serve it). (Runs
        on every call: submodules and parameters are read from the module's dicts, not through
        nn.Module's attribute lookup.)"""
        if torch.compiler.is_compiling():
            return "compiled (inductor fuses the residual passes itself)"
        if not isinstance(x, torch.Tensor):
            return f"input of type {type(x).__name__} (DINOv2's blocks take lists of tensors through xFormers)"
        # (the size first: host-paced calls are the ones whose host time this check adds to)
        if x.numel() < MIN_ELEMENTS:
            return "a small residual stream (host time paces the call: the block's own ops cost less of it)"
        if x.numel() < MIN_TRAINING_ELEMENTS and torch.is_grad_enabled() and (
                x.requires_grad or any(p.requires_grad for p in block.parameters())):
            return "a small residual stream under autograd (host time paces the step: the block's own ops cost less)"
        mods = block._modules
        n1, ls1, d1, n2, ls2, d2 = parts = (mods["norm1"], mods["ls1"], mods["drop_path1"], mods["norm2"],
                                            mods["ls2"], mods["drop_path2"])
        if not (_inert(d1) and _inert(d2)) or (block.training and module_attr(block, "sample_drop_ratio", 0.0) > 0):
            return "drop-path in training"
        if module_attr(n1, "_fast_norm", False) or module_attr(n2, "_fast_norm", False):
            return "timm's fast norm"
        for m in parts:  # (backward hooks too: a call autograd records runs the fused passes' backward)
            if hooked(m, global_hooks=False, backward=True) or replaced(m):
                return "hooks or a replaced forward on a norm, LayerScale or drop-path"
        if hooked(None, backward=True):
            return "global module hooks (they would see the norms' calls)"
        if not _triton_serves(x.device.type):
            return f"tensors on {x.device.type} without the Triton kernels there"
        if x.device.type != "cuda" and autocast_dtype(x.device.type) is not None:
            return "CPU autocast"
        if x.dtype not in RESIDUAL_DTYPES or x.shape[-1] != n1.normalized_shape[0]:
            return f"input {x.dtype} [..., {x.shape[-1]}]"
        for p in (*n1._parameters.values(), *n2._parameters.values(), _scale(ls1), _scale(ls2)):
            if p is not None and (p.dtype not in RESIDUAL_DTYPES or p.device != x.device):
                return "norm or LayerScale parameters of a dtype or device the kernel does not take"
        return None

    def forward(self, block, state: PatchState, x, *args, **kwargs):
        why = self.why_not(block, x)
        if why:
            return state.delegate(x, *args, reason=why, **kwargs)
        y = self.attend(block, pre_norm(block, x), *args, **kwargs)
        if not _branch(y, x):  # an attention output the kernel does not take: the block's own ops
            x = x + block.ls1(y)
            return x + block.ls2(block.mlp(block.norm2(x)))
        x, h = attention_residual(block, x, y)
        y = block.mlp(h)
        return mlp_residual(block, x, y) if _branch(y, x) else x + block.ls2(y)


def serves(block: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``block`` is patched by a :class:`PreNormBlock` adapter that serves a call on ``x``
    (callers that run a block's parts themselves, VGGT's lean mode, then use the functions below,
    so that their values are the patched block's bitwise)."""
    return (is_patched(block) and isinstance(adapter_of(state_of(block)), PreNormBlock)
            and PreNormBlock.why_not(block, x) is None)


def _branch(y, x: torch.Tensor) -> bool:
    """Whether a branch output ``y`` is one the kernel adds to ``x``."""
    return (isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype in RESIDUAL_DTYPES
            and y.get_device() == x.get_device())


def _norm_dtype(r_dtype: torch.dtype, consumer: nn.Module, attention: bool, device_type: str) -> torch.dtype:
    """The dtype a norm's output is written in: the LayerNorm's own (its input's; float32 under
    autocast), or the autocast dtype where the consumer would cast it to that anyway."""
    cast = autocast_dtype(device_type)
    if cast is None:
        return r_dtype
    return cast if _feeds_linear(consumer, attention) else torch.float32


def pre_norm(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm1(x) as the patched block forms it (rows of x independent: any token slice of x gives
    the same rows)."""
    from ..kernels.residual import residual_norm
    mods = block._modules
    return residual_norm(x, None, None, mods["norm1"], _norm_dtype(x.dtype, mods["attn"], True, x.device.type))[1]


def attention_residual(block: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + ls1(y), norm2 of it) for the attention output y, as the patched block forms them."""
    from ..kernels.residual import residual_dtype, residual_norm
    mods = block._modules
    g = _scale(mods["ls1"])
    return residual_norm(x, y, g, mods["norm2"], _norm_dtype(residual_dtype(x, y, g), mods["mlp"], False,
                                                              x.device.type))


def mlp_residual(block: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + ls2(y) for the MLP output y, as the patched block forms it."""
    g = _scale(block._modules["ls2"])
    if g is None:  # (PyTorch's add: the same bits in one pass, without a planned launch's Python)
        return x + y
    from ..kernels.residual import residual_norm
    return residual_norm(x, y, g)[0]
