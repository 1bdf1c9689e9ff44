"""VGGT on ELSA: exact attention for vggt's attention modules, lean aggregator memory, and token
merging (FastVGGT's method) for upstream VGGT.

    import elsa_vision
    from vggt.models.vggt import VGGT

    model = VGGT.from_pretrained("facebook/VGGT-1B").cuda().eval()
    elsa_vision.patch(model)                                     # exact attention on ELSA
    elsa_vision.patch(model, lean_memory=True)                   # + keep only the layers the heads read
    elsa_vision.patch(model, token_merging=elsa_vision.TokenMerging(ratio=0.9, seed=0))
    elsa_vision.unpatch(model)                                   # bitwise back to the original

What gets patched (matched by class object):

* ``vggt.layers.attention.Attention`` and ``MemEffAttention``: the aggregator's frame blocks
  (B·S, P, 1024), its global blocks (B, S·P, 1024), the DINOv2 patch-embed blocks and the camera-head
  trunk (head dim 128). The ELSA forward is the original one with SDPA replaced:
  qkv → q_norm / k_norm → the module's own 2-D RoPE on q and k → softmax(q kᵀ/√d) v → proj → proj_drop.
  Under CUDA autocast q/k arrive in float32 and v in bfloat16/float16; like SDPA, attention then runs
  in the autocast dtype. Outside autocast float32 runs in the requested ``precision``. Attention
  dropout in training, xFormers ``attn_bias`` and other inputs the original would reject are handed
  to the original forward (counted in ``module._elsa.delegated``).
* ``vggt.layers.block.Block`` (and the fork's): in inference its residual adds, LayerScales and
  norms run as three fused passes around its own attention and MLP (adapters/blocks.py; patch option
  ``fuse_residual=False`` leaves the blocks alone).
* ``vggt.models.aggregator.Aggregator``, only when ``lean_memory``, ``token_merging`` or
  ``process_group`` is given,
  and ``vggt.heads.dpt_head.DPTHead`` with ``lean_memory``.

The FastVGGT fork (https://github.com/mystorm16/FastVGGT) installs under the same ``vggt`` package
name; its ``Attention`` (whose forward takes ``global_merging``) is recognised from its class and its
own token merging (``merging.merge.token_merge_bipartite2d``) runs with attention on ELSA.

Patch options (keywords of ``elsa_vision.patch``):

* ``precision``: float32 matmul mode of the attention (see ``elsa_vision.attention``).
* ``backend``: ``"auto"`` (default), ``"triton"`` or ``"reference"``.
* ``lean_memory``: ``True`` keeps the aggregator outputs of layers 4, 11, 17, 23 (what VGGT's DPT
  heads read) and the last layer (what the camera head reads); a sequence of layer indices keeps those
  and the last. The other entries of the returned list are ``None`` and indexing them raises
  ``LookupError``; predictions are unchanged. Lean mode also bounds transient memory: frame blocks run
  in frame chunks, and global blocks form norm1 → q/k/v (stored in the attention dtype), the output
  projection and the MLP in chunks of ``lean_chunk`` tokens (default 65536) — the same per-token
  operations, so values agree to rounding. The heads already process frames in chunks
  (``DPTHead.frames_chunk_size``, 8 frames); in lean mode they write each chunk into preallocated
  outputs instead of concatenating a list of chunks (``head_chunk`` frames per chunk, default the
  head's own 8). Inference only: an aggregator in training mode runs its original forward.
* ``lean_offload`` (with ``lean_memory``): the kept layers other than the last — those only the DPT
  heads read — go to host memory (see _host_buffer) as the aggregator produces them, concatenated a few frames
  at a time on the device; the heads copy back the frames of each chunk. The device then holds one
  [B, S, P, 2C] layer instead of five (at 392×518, 3.4 GB float32 per 400 frames each), for the
  price of one device-to-host and one host-to-device pass over them. Values are unchanged (copies).
* ``token_merging``: a :class:`TokenMerging` (upstream VGGT only, inference only).
* ``process_group``: a torch.distributed ProcessGroup; every rank calls the model on its own
  contiguous shard of the frames and gets their predictions, global attention and the camera
  head's trunk spanning the ranks (sharded.py). Composes with ``lean_memory`` and
  ``token_merging`` (the whole sequence's merged set on every rank); the track head raises.

Modules: common.py (the classes served, the lean option), attention.py (the attention adapter),
block.py (the block adapter),
merging.py (token merging), lean.py (lean memory: the aggregator and DPT-head adapters), sharded.py
(frames across ranks: the camera- and track-head adapters, the context global attention reads).
"""
from ..registry import register
from .attention import VGGTAttentionAdapter
from .block import VGGTBlockAdapter
from .common import (AGGREGATOR_TARGETS, ATTENTION_TARGETS, BLOCK_TARGETS, CAMERA_HEAD_TARGETS, DPT_HEAD_TARGETS,
                     TRACK_HEAD_TARGETS, register_classes)
from .lean import HEAD_LAYERS, LeanLayerList, VGGTAggregatorAdapter, VGGTDPTHeadAdapter
from .sharded import VGGTCameraHeadAdapter, VGGTTrackHeadAdapter
from .merging import MergePlan, TokenMerging, destination_pattern, merge_mean, merge_plan, similarity_rows, unmerge

__all__ = ["AGGREGATOR_TARGETS", "ATTENTION_TARGETS", "BLOCK_TARGETS", "CAMERA_HEAD_TARGETS", "DPT_HEAD_TARGETS",
           "HEAD_LAYERS", "TRACK_HEAD_TARGETS", "VGGTCameraHeadAdapter", "VGGTTrackHeadAdapter",
           "LeanLayerList", "MergePlan", "TokenMerging", "VGGTAggregatorAdapter", "VGGTAttentionAdapter",
           "VGGTBlockAdapter", "VGGTDPTHeadAdapter", "destination_pattern", "merge_mean", "merge_plan",
           "register_classes", "similarity_rows", "unmerge"]

for _adapter in (VGGTAttentionAdapter(), VGGTBlockAdapter(), VGGTAggregatorAdapter(), VGGTDPTHeadAdapter(),
                 VGGTCameraHeadAdapter(), VGGTTrackHeadAdapter()):
    register(_adapter)
