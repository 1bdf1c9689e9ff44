"""The VGGT block adapter: vggt's ``Block`` (the aggregator's frame and global blocks, the camera
head's trunk; the FastVGGT fork's too) with its residual stream in fused passes in
inference (see adapters/blocks.py)."""
from __future__ import annotations

from ..blocks import PreNormBlock
from .common import BLOCK_TARGETS, VGGTAdapter


class VGGTBlockAdapter(PreNormBlock, VGGTAdapter):
    """vggt's ``Block.forward(x, pos=None)``, the fork's ``(x, pos=None, global_merging=None)`` and
    DINOv2's ``NestedTensorBlock.forward(x_or_x_list)`` (the patch embedding's blocks: a tensor runs
    ``Block.forward(x)``, a list, xFormers' nested path, the block's own forward):
    ``norm1`` → ``attn(·[, pos=pos, global_merging=…])`` → ``x + ls1(·)`` → ``norm2`` → ``mlp`` →
    ``x + ls2(·)`` in eval mode."""

    name = "vggt.Block"
    targets = BLOCK_TARGETS
    extra = "block"
    signatures = (("x", "pos"), ("x", "pos", "global_merging"), ("x_or_x_list",))

    def attend(self, block, h, *args, **kwargs):
        # the block's forward passes these to attn by keyword (MemEffAttention takes attn_bias second)
        kwargs.update(zip(("pos", "global_merging"), args))
        return block.attn(h, **kwargs)
