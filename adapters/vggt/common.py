"""What the VGGT adapters share: the classes they serve (matched by class object, with the
forward signature each has) and the lean-memory option."""
from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Collection
from dataclasses import dataclass
from typing import Callable, Sequence


from ..registry import Adapter, check_count, check_flag, register_extra


ATTENTION_TARGETS = ("vggt.layers.attention:Attention", "vggt.layers.attention:MemEffAttention")


AGGREGATOR_TARGETS = ("vggt.models.aggregator:Aggregator",)


BLOCK_TARGETS = ("vggt.layers.block:Block", "vggt.layers.block:NestedTensorBlock")  # (DINOv2's: the patch embedding)


DPT_HEAD_TARGETS = ("vggt.heads.dpt_head:DPTHead",)


CAMERA_HEAD_TARGETS = ("vggt.heads.camera_head:CameraHead",)


TRACK_HEAD_TARGETS = ("vggt.heads.track_head:TrackHead",)


EXTRA: dict[str, list[type]] = {"attention": [], "aggregator": [], "block": [], "dpt_head": [], "camera_head": [],
                                "track_head": []}


def register_classes(*, attention: Sequence[type] = (), aggregator: Sequence[type] = (),
                     block: Sequence[type] = (), dpt_head: Sequence[type] = (), camera_head: Sequence[type] = (),
                     track_head: Sequence[type] = ()) -> Callable[[], None]:
    """Serve classes that carry vggt's code outside the ``vggt`` package (a vendored copy, a test
    stand-in) as if they were vggt's own. Returns a function that removes them again.

    attention: classes with the forward of vggt's ``Attention`` ``(x, pos=None)``, ``MemEffAttention``
        ``(x, attn_bias=None, pos=None)``, or the FastVGGT fork's (the same plus ``global_merging``);
        and vggt's attribute names (qkv, q_norm, k_norm, rope, attn_drop, proj, proj_drop,
        num_heads, head_dim, scale, fused_attn).
    aggregator: classes with vggt's ``Aggregator`` forward and attributes (frame_blocks,
        global_blocks, depth, aa_block_size, patch_size, patch_start_idx, _process_frame_attention,
        _process_global_attention).
    block: ``Block``-like classes (norm1, attn, ls1, norm2, mlp, ls2) that lean mode may run in chunks.
    dpt_head: classes with ``DPTHead``'s forward(aggregated_tokens_list, images, patch_start_idx,
        frames_chunk_size=8) and ``_forward_impl(..., frames_start_idx, frames_end_idx)``.
    camera_head: classes whose ``trunk`` (a sequence of ``Block``-like modules) attends over frames,
        as vggt's ``CameraHead`` (sharded with ``process_group``).
    track_head: classes that read the first frame's features, as vggt's ``TrackHead`` (refused with
        ``process_group``).
    """
    def validate(key, cls):
        if key == "attention":
            attention_kind(cls)  # validates the forward signature now, not at the first call

    return register_extra(EXTRA, (("attention", attention), ("aggregator", aggregator), ("block", block),
                                  ("dpt_head", dpt_head), ("camera_head", camera_head), ("track_head", track_head)),
                          validate)


@dataclass(frozen=True)
class Kind:
    signature: inspect.Signature
    memeff: bool  # forward(x, attn_bias=None, pos=None, ...)
    fork: bool    # FastVGGT fork: forward(..., global_merging=None)


_KINDS: dict[type, Kind] = {}


def attention_kind(cls: type) -> Kind:
    """Which of vggt's attention forwards ``cls`` has (from its own forward's signature)."""
    kind = _KINDS.get(cls)
    if kind is None:
        sig = inspect.signature(cls.forward)
        params = sig.parameters
        if "x" not in params or "pos" not in params:
            raise TypeError(f"{cls.__module__}.{cls.__qualname__}.forward{sig} is not vggt's attention forward "
                            "(x, pos=None) / (x, attn_bias=None, pos=None)")
        kind = _KINDS[cls] = Kind(sig, memeff="attn_bias" in params, fork="global_merging" in params)
    return kind


def is_fork_aggregator(cls: type) -> bool:
    fn = getattr(cls, "_process_global_attention", None)
    return fn is not None and "global_merging" in inspect.signature(fn).parameters


_BLOCKS = Adapter()  # only its lazy import of the target classes is used


_BLOCKS.targets = BLOCK_TARGETS


def block_classes() -> tuple[type, ...]:
    return (*_BLOCKS.classes(), *EXTRA["block"])


class VGGTAdapter(Adapter):
    """What the VGGT adapters share: their classes are vggt's (``targets``) and those registered
    under ``extra`` with :func:`register_classes`, and the VGGT options are checked once for all."""

    extra: str = ""

    def classes(self) -> tuple[type, ...]:
        return tuple(dict.fromkeys([*super().classes(), *EXTRA[self.extra]]))

    def check_options(self, options: dict) -> None:
        check_options(options)


def check_options(options: dict) -> None:
    """The VGGT options' types and ranges (see the package docstring); ``patch`` runs this before it
    touches any module. What depends on the model (layer indices against its depth, token merging on
    the FastVGGT fork) is checked by the adapters' skip_reason, also before any module is patched."""
    from .merging import TokenMerging
    tm = options.get("token_merging")
    if tm is not None and not isinstance(tm, TokenMerging):
        raise TypeError(f"token_merging must be an elsa_vision.TokenMerging or None, got {type(tm).__name__}")
    lean = options.get("lean_memory")
    if not (lean is None or isinstance(lean, bool)):
        # a collection, not an iterator: the layers are read again at every call
        if isinstance(lean, (str, bytes)) or not isinstance(lean, Collection) or not all(
                hasattr(type(i), "__index__") and not isinstance(i, bool) for i in lean):
            raise TypeError(f"lean_memory must be True/False or a sequence of layer indices (ints), got {lean!r}")
    offload = check_flag(options, "lean_offload", False)
    if offload and lean_option(options) is None:
        raise ValueError("lean_offload=True moves the layers lean_memory keeps to host memory: "
                         "pass lean_memory=True (or a list of layers) with it")
    check_count(options, "lean_chunk", "tokens")
    check_count(options, "head_chunk", "frames", none_ok=True)
    for name in ("lean_chunk", "head_chunk"):  # (read by lean mode only: alone they would do nothing)
        if options.get(name) is not None and lean_option(options) is None:
            raise ValueError(f"{name} sets the chunks of lean_memory's passes: pass lean_memory=True (or a list "
                             f"of layers) with it, or leave {name} out")
    from .sharded import check_group
    check_group(options)


LEAN_CHUNK = 1 << 16  # lean_chunk's default: tokens per chunk of the global blocks' projections and MLP


def lean_option(options: dict):
    """The lean_memory option when requested (True, or a sequence of layers — an empty one keeps
    only the last layer), else None."""
    lean = options.get("lean_memory")
    return None if lean is None or lean is False else lean


class CallScope:
    """A value that holds during one aggregator call, in the context that runs it (a ContextVar),
    with a count of such calls running in any context: while the count is 0, :meth:`get` returns None
    without reading the ContextVar — torch.compile cannot trace that read, and a model outside such
    calls then compiles in one graph (a module compiled inside one reads it, with a graph break:
    correct)."""

    def __init__(self, name: str):
        self._var = contextvars.ContextVar(name, default=None)
        self._running = 0

    def get(self):
        return self._var.get() if self._running else None

    @contextlib.contextmanager
    def holding(self, value):
        """Run the block of a ``with`` with :meth:`get` returning ``value``."""
        token = self._var.set(value)
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._var.reset(token)
