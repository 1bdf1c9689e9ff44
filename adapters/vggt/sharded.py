"""VGGT with its frames sharded across ranks: ``patch(model, process_group=group)``.

Every rank of ``group`` calls the model on its own contiguous shard of the frames, in rank order
(rank 0 holds the first frames; shards may differ in length, each at least one frame), and gets
the predictions of its own frames — those one process would give for them from all the frames:

* frame attention and everything per frame (patch embed, MLPs, the DPT heads) run locally;
* the aggregator's global attention and the camera head's trunk (which attends over frames) run
  through :func:`elsa_vision.distributed.attention`: this rank's queries against every rank's keys
  (patch the whole model: an aggregator or camera head whose attention modules are not patched with
  the same group raises at its call, and such an attention call that would need the original
  forward raises instead of attending locally; a camera head left unpatched — the aggregator
  patched alone — cannot be detected and attends to this rank's frames only);
* the first frame's special camera and register tokens (VGGT gives frame 0 its own) are rank 0's:
  the other ranks' frames all take the "other frames" tokens.

Gradients follow (training runs the same way; the per-rank parameter gradients then add up to the
single-process ones, as DistributedDataParallel's all-reduce does). ``lean_memory`` composes (an
inference option, as without a group); ``token_merging`` composes too, with the same merged set
as one process's: the destinations are the whole sequence's, each rank assigns its own sources
against every rank's destinations, and the sums that make the merged tokens are all-reduced (see
merging.sharded_merge_plan), so every rank holds the whole merged set — about a third of the
tokens at FastVGGT's settings. The track head reads the first frame's features on every rank and
raises when called with a group.
"""
from __future__ import annotations

import os
import weakref
from typing import Optional

import torch

from ..registry import PatchState, adapter_of, bypass_reason, is_patched, state_of
from .common import CAMERA_HEAD_TARGETS, TRACK_HEAD_TARGETS, CallScope, VGGTAdapter


# Attention modules whose calls span the ranks when they are patched with a process group: the
# aggregator's global blocks' and the camera trunk's, marked when their aggregator / camera head is
# patched. The group itself is read from the module's own patch options at each call (so a module
# re-patched without a group runs locally), and the marking holds outside the aggregator's forward:
# vggt's training mode recomputes checkpointed blocks in the backward.
SPANNING: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def mark_spanning(blocks) -> None:
    for b in blocks:
        attn = getattr(b, "attn", None)
        if attn is not None:
            SPANNING.add(attn)


def sharded_group(module, options: dict) -> Optional[object]:
    """The process group this attention module's calls span (None: they are local)."""
    group = options.get("process_group")
    return group if group is not None and module in SPANNING else None


def _spanning_refusal(blocks, adapter_cls, group, where: str) -> Optional[str]:
    """Why this rank cannot run the blocks' attention across the group (None: it can): an attention
    left to the original (excluded, patched separately) would attend to this rank's frames only,
    and one whose call the original forward must take (hooks on attn_drop, attention dropout in
    training) cannot span the ranks."""
    for i, b in enumerate(blocks):
        attn = getattr(b, "attn", None)
        if not (attn is not None and is_patched(attn) and isinstance(adapter_of(state := state_of(attn)), adapter_cls)
                and state.options.get("process_group") is group):
            return (f"{where}[{i}].attn is not patched with this process_group, so its attention would see this "
                    "rank's frames only; patch the whole model with process_group (without include/exclude "
                    "patterns that leave these modules out)")
        why = bypass_reason(attn)
        if why:
            return (f"{where}[{i}].attn spans the ranks of a process group, which the original forward cannot: "
                    f"{why}")
    return None


def check_spanning(blocks, adapter_cls, group, where: str, frames: int, device) -> list[int]:
    """Every rank's frame count (``frames`` here), in rank order, after checking on every rank that
    each block's attention can span the ranks (:func:`_spanning_refusal`): one all-gather carries
    the counts and each rank's verdict, so that all ranks raise together rather than one raising
    while the others wait for it in the ring."""
    from ...distributed import agree
    return [c for c, in agree([frames], _spanning_refusal(blocks, adapter_cls, group, where), group, device,
                              f"rank(s) {{ranks}} of the process group cannot run {where}'s attention across the "
                              "ranks (their error says why); this rank stops with them", exc=RuntimeError)]


def rank_of(group) -> int:
    import torch.distributed as dist
    return dist.get_rank(group)


# The frame counts of the sharded aggregator call running now (rank order), from which its global
# blocks' attention knows every rank's key count without a collective of its own.
FRAME_COUNTS = CallScope("elsa_vggt_frame_counts")


def spanning_call(counts: list):
    """Run the block of a ``with`` as a sharded aggregator call over ``counts`` frames per rank."""
    return FRAME_COUNTS.holding(tuple(counts))


def key_lengths(group, tokens: int) -> Optional[list[int]]:
    """Every rank's key count for a spanning attention call with ``tokens`` keys on this rank, when a
    sharded aggregator call runs (its global blocks: frames × tokens per frame); None otherwise (the
    camera trunk, a recomputed block in training) or when a rank holds no frame — decided from what
    every rank knows, so that all of them take the same path (distributed.attention then gathers)."""
    counts = FRAME_COUNTS.get()
    if counts is None or min(counts) <= 0:
        return None
    mine = counts[rank_of(group)]
    if tokens % mine:
        raise RuntimeError(f"a global block of a sharded aggregator call got {tokens} tokens for this rank's {mine} "
                           "frames: not a whole number per frame")
    return [c * (tokens // mine) for c in counts]


def first_frame_tokens_elsewhere(agg) -> dict:
    """On a rank other than the first: the aggregator's special tokens with the first frame's slot
    holding the other frames' tokens (instance attributes shadowing the parameters for one call;
    gradients reach the parameters through the concatenation)."""
    out = {}
    for name in ("camera_token", "register_token"):
        t = getattr(agg, name)  # [1, 2, X, C]: slot 0 frame 0's, slot 1 the other frames'
        out[name] = torch.cat([t[:, 1:2], t[:, 1:2]], dim=1)
    return out


def check_group(options: dict) -> None:
    """``process_group``: absent, None, or a ProcessGroup of an initialised torch.distributed. None
    under a multi-process launch (WORLD_SIZE > 1) is refused: ``torch.distributed.group.WORLD`` is
    None until ``init_process_group`` runs, and the model would then run each rank's frames alone."""
    if "process_group" not in options:
        return
    group = options["process_group"]
    if group is None:
        if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            raise ValueError("patch(): process_group=None in a multi-process launch (WORLD_SIZE > 1): call "
                             "torch.distributed.init_process_group before taking torch.distributed.group.WORLD "
                             "(it is None until then), or leave process_group out to run each process alone")
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
        if options.get("process_group") is None:
            return "only used with process_group"
        mark_spanning(module.trunk)
        return None

    def forward(self, head, state: PatchState, *args, **kwargs):
        from .attention import VGGTAttentionAdapter
        check_spanning(head.trunk, VGGTAttentionAdapter, state.options["process_group"], "camera head trunk", 0,
                       next(head.parameters()).device)
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
