"""VGGT with its frames sharded across ranks: ``patch(model, process_group=group)``.

Every rank of ``group`` calls the model on its own contiguous shard of the frames, in rank order
(rank 0 holds the first frames; shards may differ in length, each at least one frame), and gets
the predictions of its own frames — those one process would give for them from all the frames:

* frame attention and everything per frame (patch embed, MLPs, the DPT heads) run locally;
* the aggregator's global attention and the camera head's trunk (which attends over frames) run
  through :func:`elsa_vision.distributed.attention`: this rank's queries against every rank's keys;
* the first frame's special camera and register tokens (VGGT gives frame 0 its own) are rank 0's:
  the other ranks' frames all take the "other frames" tokens.

Gradients follow (training runs the same way; the per-rank parameter gradients then add up to the
single-process ones, as DistributedDataParallel's all-reduce does). ``lean_memory`` composes (an
inference option, as without a group); ``token_merging`` with a group is refused (its destination
set would have to be chosen across ranks). The track head reads the first frame's features on
every rank and raises when called with a group.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Optional

import torch

from ..registry import PatchState
from .common import CAMERA_HEAD_TARGETS, TRACK_HEAD_TARGETS, VGGTAdapter


@dataclass(frozen=True)
class Sharding:
    group: object            # the torch.distributed ProcessGroup
    modules: frozenset       # ids of the attention modules whose calls span the ranks


SHARDING: contextvars.ContextVar[Optional[Sharding]] = contextvars.ContextVar("elsa_vggt_sharding", default=None)
_RUNNING = [0]  # sharded calls running now, in any context (see merging._RUNNING: the same reason)


def sharded_group(module) -> Optional[object]:
    """The process group this attention module's call spans, if it runs inside a sharded call."""
    if not _RUNNING[0]:
        return None
    s = SHARDING.get()
    return s.group if s is not None and id(module) in s.modules else None


@contextlib.contextmanager
def sharding(group, blocks):
    """Run the block of a ``with`` with the attention of ``blocks`` (modules with ``.attn``) spanning
    the ranks of ``group``."""
    token = SHARDING.set(Sharding(group, frozenset(id(b.attn) for b in blocks if hasattr(b, "attn"))))
    _RUNNING[0] += 1
    try:
        yield
    finally:
        _RUNNING[0] -= 1
        SHARDING.reset(token)


def rank_of(group) -> int:
    import torch.distributed as dist
    return dist.get_rank(group)


def first_frame_tokens_elsewhere(agg) -> dict:
    """On a rank other than the first: the aggregator's special tokens with the first frame's slot
    holding the other frames' tokens (instance attributes shadowing the parameters for one call;
    gradients reach the parameters through the concatenation)."""
    out = {}
    for name in ("camera_token", "register_token"):
        t = getattr(agg, name)  # [1, 2, X, C]: slot 0 frame 0's, slot 1 the other frames'
        out[name] = torch.cat([t[:, 1:2], t[:, 1:2]], dim=1)
    return out


def check_group(group) -> None:
    """``process_group``: None or an initialised torch.distributed ProcessGroup."""
    if group is None:
        return
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("patch(): process_group needs torch.distributed initialised "
                           "(torch.distributed.init_process_group) before patching")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"patch(): process_group must be a torch.distributed ProcessGroup (the default one is "
                        f"torch.distributed.group.WORLD), got {type(group).__name__}")


class VGGTCameraHeadAdapter(VGGTAdapter):
    """With a process group: the camera head's trunk attends over the frames of every rank."""

    name = "vggt-camera-head"
    targets = CAMERA_HEAD_TARGETS
    options = frozenset({"process_group"})

    extra = "camera_head"

    def skip_reason(self, module, options):
        return None if options.get("process_group") is not None else "only used with process_group"

    def forward(self, head, state: PatchState, *args, **kwargs):
        with sharding(state.options["process_group"], head.trunk):
            return state.original(*args, **kwargs)


class VGGTTrackHeadAdapter(VGGTAdapter):
    """With a process group: refuses to run (the track head follows points from the first frame,
    whose features only rank 0 holds)."""

    name = "vggt-track-head"
    targets = TRACK_HEAD_TARGETS
    options = frozenset({"process_group"})

    extra = "track_head"

    def skip_reason(self, module, options):
        return None if options.get("process_group") is not None else "only used with process_group"

    def forward(self, head, state: PatchState, *args, **kwargs):
        raise NotImplementedError("VGGT's track head (query_points) is not supported on a model patched with "
                                  "process_group: it tracks from the first frame's features, which only rank 0 "
                                  "holds; call the model without query_points, or patch a copy without process_group")
