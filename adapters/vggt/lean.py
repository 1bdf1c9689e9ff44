"""Lean memory: the aggregator keeps only the layers the heads read (optionally in host memory), runs
its blocks with bounded transient memory, and the DPT heads write their chunks into preallocated
outputs; the aggregator adapter also sets the token-merging context of a call."""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import operator
from typing import Optional

import torch

from .. import blocks
from ..registry import PatchState, adapter_of, hooked, is_patched, state_of
from .attention import VGGTAttentionAdapter, elsa_attention, merge_call, unsupported
from .common import (AGGREGATOR_TARGETS, DPT_HEAD_TARGETS, LEAN_CHUNK, VGGTAdapter, attention_kind, block_classes,
                     is_fork_aggregator, lean_option)
from .merging import AggregatorCall, Shard, merging, pattern_on
from .sharded import check_spanning, first_frame_tokens_elsewhere, mark_spanning, rank_of, spanning_call


HEAD_LAYERS = (4, 11, 17, 23)  # what VGGT's DPT heads (depth, point, track) read; the camera head reads the last


class LeanLayerList(list):
    """The aggregator's per-layer outputs with the layers nobody reads dropped (``None``).

    Indexing a dropped layer raises LookupError (never a silently wrong tensor)."""

    def __init__(self, items, kept, offloaded: bool = False):
        super().__init__(t if i in kept else None for i, t in enumerate(items))
        self.kept = frozenset(kept)
        self.offloaded = offloaded  # lean_offload: the layers only the DPT heads read are in host memory

    def __getitem__(self, i):
        if not isinstance(i, slice):
            j = operator.index(i)
            j = j + len(self) if j < 0 else j
            if 0 <= j < len(self) and j not in self.kept:
                raise LookupError(f"aggregator layer {i} was dropped by lean_memory (kept: {sorted(self.kept)}); "
                                  f"patch with lean_memory=[..., {j}] to keep it, or without lean_memory")
        return super().__getitem__(i)


def _kept_layers(depth: int, lean) -> frozenset:
    if lean is True:
        wanted = [i for i in HEAD_LAYERS if i < depth]
    else:  # (check_options has checked the type)
        wanted = [operator.index(i) for i in lean]
        bad = [i for i in wanted if not -depth <= i < depth]
        if bad:
            raise ValueError(f"lean_memory layers {bad} are outside the aggregator's {depth} layers")
    return frozenset({i % depth for i in wanted} | {depth - 1})


def _watched(module) -> bool:
    """Whether anything could hold or see what ``module`` computes: hooks anywhere in its subtree
    or global ones, or a forward replaced on the instance (another library's wrapper)."""
    return "forward" in module.__dict__ or any(hooked(m) for m in module.modules())


def _run_block(block, x, pos, per_frame: bool, chunk: int, block_classes: tuple):
    """One aggregator block in eval mode with bounded transient memory (same values as block(x, pos=pos)).
    A block with hooks of its own or a wrapped forward runs whole (they expect one call of the block);
    hooks inside it (a progress bar on ls1, say) see one call per chunk, as lean mode documents."""
    if (type(block) not in block_classes or block.training or ("forward" in block.__dict__ and not is_patched(block))
            or hooked(block, global_hooks=False)):
        return block(x, pos=pos)
    if per_frame:  # frames are independent: run the whole block a few frames at a time
        n_frames, P = x.shape[:2]
        step = max(1, chunk // max(P, 1))
        if n_frames <= step:
            return block(x, pos=pos)
        out = None
        for f0 in range(0, n_frames, step):
            y = block(x[f0:f0 + step], pos=None if pos is None else pos[f0:f0 + step])
            if out is None:
                out = y.new_empty((n_frames, *y.shape[1:]))
            out[f0:f0 + step] = y
        return out
    # one long sequence: attention sees every token; the MLP residual is per token, so run it in chunks
    if blocks.serves(block, x):  # the patched block's fused residual passes, per token chunk: its values
        y = _block_attention(block, x, pos, functools.partial(blocks.pre_norm, block))
        out = None
        for n0 in range(0, x.shape[1], chunk):
            xc, h = blocks.attention_residual(block, x[:, n0:n0 + chunk], y[:, n0:n0 + chunk])
            xc = blocks.mlp_residual(block, xc, block.mlp(h))
            if out is None:
                out = x.new_empty(x.shape, dtype=xc.dtype)
            out[:, n0:n0 + chunk] = xc
        return out
    x = x + block.ls1(_block_attention(block, x, pos))
    N = x.shape[1]
    if N <= chunk:
        return x + block.ls2(block.mlp(block.norm2(x)))
    out = None
    for n0 in range(0, N, chunk):
        xc = x[:, n0:n0 + chunk]
        y = xc + block.ls2(block.mlp(block.norm2(xc)))
        if out is None:  # x is this function's own tensor: update it in place where autograd allows
            in_place = y.dtype == x.dtype and not torch.is_grad_enabled()
            out = x if in_place else x.new_empty(x.shape, dtype=y.dtype)
        out[:, n0:n0 + chunk] = y
    return out


def _block_attention(block, x, pos, norm1=None):
    """block.attn(norm1(x), pos=pos) (``norm1``: block.norm1 unless given); when the attention is ours
    and nothing observes the call (no hooks, no token merging), norm1 runs inside its token chunks
    instead of on the whole sequence."""
    attn = block.attn
    norm1 = norm1 or block.norm1
    state = state_of(attn)
    # (is_patched: a forward wrapped after patching, e.g. by another library's hooks, must run)
    if (state is None or not is_patched(attn) or not isinstance(adapter_of(state), VGGTAttentionAdapter)
            or hooked(attn, global_hooks=False) or merge_call(attn) is not None):
        return attn(norm1(x), pos=pos)
    kind = attention_kind(type(attn))
    if kind.fork or unsupported(attn, kind, x, pos, None, None) is not None:
        return attn(norm1(x), pos=pos)
    state.count_call()
    y = elsa_attention(attn, state, x, pos, kind, prenorm=norm1)
    return y if y is not None else state.delegate(norm1(x), pos=pos, reason="q, k, v of different dtypes "
                                                  "outside autocast")


class _PatchEmbedOnce:
    """Lean mode's stand-in for ``agg.patch_embed`` during one aggregator call: the real module's
    result, with the normalized images it was given and the patch tokens it returned remembered so
    that ``release`` can free them. The aggregator keeps both in local variables until it returns but
    reads neither once the token sequence is built (1.6 + 0.9 GiB at 400 frames, 392×518)."""

    def __init__(self, module, user_images: torch.Tensor):
        self.module, self.user, self.dead = module, user_images, []

    def __call__(self, images, *args, **kwargs):
        out = self.module(images, *args, **kwargs)
        # nothing is freed that a hook (anywhere in the patch embedding) or autograd may hold
        if not torch.is_grad_enabled() and not _watched(self.module):
            tokens = out["x_norm_patchtokens"] if isinstance(out, dict) else out
            self.dead = [t for t in (images, tokens) if isinstance(t, torch.Tensor)]
        return out

    def release(self):
        """Free the remembered storages (never the caller's own images)."""
        user = self.user.untyped_storage().data_ptr()
        for t in self.dead:
            st = t.untyped_storage()
            if st.data_ptr() != user:
                st.resize_(0)
        self.dead = []


def _lean_process(agg, kind: str, keep: frozenset, chunk: int, host: Optional[dict] = None,
                  embed: Optional[_PatchEmbedOnce] = None):
    """Replacement for Aggregator._process_{frame,global}_attention (same signature and results) that
    drops the intermediates of layers not in ``keep`` and runs blocks with bounded memory.

    ``host`` (lean_offload): a dict shared by the frame and the global replacement. For the kept
    layers other than the last, the half that runs first (by aa_order) waits in it (as a GPU tensor)
    until the other exists; the pair then goes to host memory (see _to_host) and its intermediates
    are zero-width.
    ``embed``: released when the first frame block starts (the token sequence exists by then)."""
    blocks = agg.frame_blocks if kind == "frame" else agg.global_blocks
    served = block_classes()
    last = agg.depth - 1

    def run(tokens, B, S, P, C, idx, pos=None):
        if embed is not None:
            embed.release()
        shape = (B * S, P) if kind == "frame" else (B, S * P)
        if tokens.shape != (*shape, C):
            tokens = tokens.view(B, S, P, C).view(*shape, C)
        if pos is not None and pos.shape != (*shape, 2):
            pos = pos.view(B, S, P, 2).view(*shape, 2)
        intermediates = []
        for _ in range(agg.aa_block_size):
            tokens = _run_block(blocks[idx], tokens, pos, kind == "frame", chunk, served)
            out = tokens.view(B, S, P, C)
            offload = host is not None and idx in keep and idx != last
            if offload:  # the first half (frame or global, by aa_order) waits for the other one
                other = host.get(idx)
                if other is None:
                    host[idx] = out
                else:
                    pair = (out, other) if kind == "frame" else (other, out)
                    host[idx] = _to_host(*pair, max(1, chunk // max(P, 1)))
            # a zero-width tensor keeps the aggregator's concatenation working at no memory cost
            intermediates.append(out if idx in keep and not offload else tokens.new_empty((B, S, P, 0)))
            idx += 1
        return tokens, idx, intermediates

    return run


# Pinned buffers come from torch's caching host allocator, which rounds a request up to a power of
# two and keeps freed blocks: three 17 GB layers (3000 frames) would pin over 100 GB and fail. Larger
# layers use pageable memory (the copies then run synchronously) instead.
_PIN_LIMIT = 1 << 30


def _host_buffer(shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An empty host tensor, pinned when ``pin`` and at most _PIN_LIMIT bytes and the pinned
    allocation succeeds; pageable otherwise."""
    if pin and math.prod(shape) * dtype.itemsize <= _PIN_LIMIT:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as e:  # page-locked memory exhausted (ulimit -l, cgroup): pageable works
            if "out of memory" not in str(e).lower():
                raise
    return torch.empty(shape, dtype=dtype)


def _to_host(frame: torch.Tensor, glob: torch.Tensor, step: int) -> torch.Tensor:
    """cat([frame, glob], -1) [B, S, P, 2C] in host memory (see _host_buffer), formed on the device
    ``step`` frames at a time so that the full-size concatenation never exists on the device. Copies to
    pinned memory are asynchronous on the current stream (the aggregator synchronizes before returning)."""
    B, S, P, C = glob.shape
    out = _host_buffer((B, S, P, 2 * C), glob.dtype, glob.is_cuda)
    for b in range(B):
        for s0 in range(0, S, step):
            out[b, s0:s0 + step].copy_(torch.cat([frame[b, s0:s0 + step], glob[b, s0:s0 + step]], -1),
                                       non_blocking=True)
    return out


class VGGTAggregatorAdapter(VGGTAdapter):
    """Lean memory, the token-merging context and frame sharding (``process_group``, see
    sharded.py) for vggt's ``Aggregator``."""

    name = "vggt-aggregator"
    targets = AGGREGATOR_TARGETS
    options = frozenset({"lean_memory", "lean_chunk", "lean_offload", "process_group"})
    anchors = frozenset({"process_group", "token_merging", "lean_memory"})

    extra = "aggregator"

    def skip_reason(self, module, options):
        tm, lean, group = options.get("token_merging"), lean_option(options), options.get("process_group")
        if lean is None and tm is None and group is None:
            return "nothing to change (lean_memory, token_merging and process_group not requested)"
        if is_fork_aggregator(type(module)):
            if tm is not None:
                raise ValueError("token_merging=TokenMerging(...) is for upstream VGGT; the FastVGGT fork merges "
                                 "tokens itself (its `merging` setting): patch it without token_merging")
            if group is not None:
                raise ValueError("process_group is for upstream VGGT's aggregator; the FastVGGT fork's merging "
                                 "runs within one process: patch it without process_group")
            return "FastVGGT fork aggregator: already keeps only the layers its heads read"
        if lean is not None:
            _kept_layers(module.depth, lean)  # validate now
        if group is not None:
            mark_spanning(module.global_blocks)
        return None

    def forward(self, agg, state: PatchState, images, *args, **kwargs):
        opts = state.options
        cfg, lean, group = opts.get("token_merging"), lean_option(opts), opts.get("process_group")
        if not isinstance(images, torch.Tensor) or images.dim() != 5:
            if group is not None:
                raise ValueError(f"a VGGT aggregator patched with process_group takes this rank's frames as images "
                                 f"[B, S, 3, H, W], got {getattr(images, 'shape', type(images).__name__)}")
            return state.delegate(images, *args, reason="images not [B, S, 3, H, W]", **kwargs)
        if images.shape[1] == 0 and group is None:  # (under a group: raised on every rank, below)
            raise ValueError(f"the VGGT aggregator got images {tuple(images.shape)}: no frame (S = 0); pass at "
                             "least one frame")
        if agg.training:
            if group is None:
                return state.delegate(images, *args, reason="training mode (lean memory and token merging are "
                                      "inference-only)", **kwargs)
            cfg = lean = None  # sharding holds in training; lean memory and merging are inference-only
        scopes = []  # entered around the original forward
        shadowed = {}  # instance attributes shadowing the class's methods / parameters for this call only
        counts = None
        if group is not None:
            counts = check_spanning(agg.global_blocks, VGGTAttentionAdapter, group, "aggregator global_blocks",
                                    images.shape[1], images.device)
            if rank_of(group) > 0:
                shadowed.update(first_frame_tokens_elsewhere(agg))
            if min(counts) == 0:  # (raised on every rank alike: all of them know the counts now)
                raise ValueError(f"a VGGT aggregator patched with process_group got frames per rank {counts}: "
                                 f"rank {counts.index(0)} holds no frame; give every rank at least one")
            scopes.append(spanning_call(counts))
        if cfg is not None:
            grid = (images.shape[-2] // agg.patch_size, images.shape[-1] // agg.patch_size)
            layers = {id(b.attn): i for i, b in enumerate(agg.global_blocks) if hasattr(b, "attn")}
            # the pattern goes to the device before any block is queued: a host-to-device copy
            # later would wait for the GPU to drain its queue
            frames, shard = images.shape[1], None
            if group is not None:  # the destination pattern is the whole sequence's (see sharded_merge_plan)
                shard = Shard(group, tuple(counts), rank_of(group))
                frames = sum(counts)
            pattern = tuple(t.to(images.device) for t in pattern_on(frames, grid, agg.patch_start_idx, cfg))
            scopes.append(merging(AggregatorCall(cfg, frames, grid, agg.patch_start_idx, layers, pattern, shard=shard,
                                                 backend=opts.get("backend", "auto"))))
        keep = _kept_layers(agg.depth, lean) if lean is not None else None
        host = {} if keep is not None and opts.get("lean_offload") else None
        if keep is not None:
            chunk = opts.get("lean_chunk", LEAN_CHUNK)
            embed = shadowed["patch_embed"] = _PatchEmbedOnce(agg.patch_embed, images)
            shadowed["_process_frame_attention"] = _lean_process(agg, "frame", keep, chunk, host, embed)
            shadowed["_process_global_attention"] = _lean_process(agg, "global", keep, chunk, host)
        agg.__dict__.update(shadowed)
        try:
            with contextlib.ExitStack() as stack:
                for scope in scopes:
                    stack.enter_context(scope)
                outputs, patch_start_idx = state.original(images, *args, **kwargs)
        finally:
            for name in shadowed:
                agg.__dict__.pop(name, None)
        if keep is not None:
            if host:
                if images.is_cuda:
                    torch.cuda.current_stream(images.device).synchronize()  # the host copies are complete
                outputs = [host.get(i, t) for i, t in enumerate(outputs)]
            outputs = LeanLayerList(outputs, keep, offloaded=bool(host))
        return outputs, patch_start_idx


def _frames_on(tokens_list: "LeanLayerList", f0: int, f1: int, device) -> "LeanLayerList":
    """Frames f0:f1 of every kept layer of an offloaded aggregator output list, on ``device``."""
    items = [t if t is None or t.shape[-1] == 0 else t[:, f0:f1].to(device, non_blocking=True)
             for t in list.__iter__(tokens_list)]
    return LeanLayerList(items, tokens_list.kept)


class VGGTDPTHeadAdapter(VGGTAdapter):
    """Lean mode for vggt's ``DPTHead``: the same frame chunks, written into preallocated outputs
    instead of concatenated at the end (one copy of the full-resolution outputs, not two)."""

    name = "vggt-dpt-head"
    targets = DPT_HEAD_TARGETS
    options = frozenset({"lean_memory", "head_chunk"})
    anchors = frozenset({"lean_memory"})

    extra = "dpt_head"

    def skip_reason(self, module, options):
        return None if lean_option(options) is not None else "only used with lean_memory"

    def forward(self, head, state: PatchState, *args, **kwargs):
        try:  # the head's own defaults (vggt: frames_chunk_size=8)
            a = inspect.signature(type(head).forward).bind(head, *args, **kwargs)
        except TypeError:
            return state.delegate(*args, reason="arguments the original forward does not take", **kwargs)
        a.apply_defaults()
        a = a.arguments
        aggregated_tokens_list, images, patch_start_idx = a["aggregated_tokens_list"], a["images"], a["patch_start_idx"]
        chunk = state.options.get("head_chunk") or a.get("frames_chunk_size")
        S = images.shape[1]
        dev = images.device
        on_host = getattr(aggregated_tokens_list, "offloaded", False)
        if not on_host and (chunk is None or chunk >= S):
            return state.original(aggregated_tokens_list, images, patch_start_idx, frames_chunk_size=chunk)
        chunk = min(chunk or S, S)
        outs = None
        for f0 in range(0, S, chunk):
            f1 = min(S, f0 + chunk)
            if on_host:  # lean_offload: this chunk's frames of every layer, on the device, then as a whole
                part = head._forward_impl(_frames_on(aggregated_tokens_list, f0, f1, dev), images[:, f0:f1],
                                          patch_start_idx)
            else:
                part = head._forward_impl(aggregated_tokens_list, images, patch_start_idx, f0, f1)
            part = part if isinstance(part, tuple) else (part,)
            if outs is None:
                outs = tuple(t.new_empty((t.shape[0], S, *t.shape[2:])) for t in part)
            for o, t in zip(outs, part):
                o[:, f0:f0 + t.shape[1]] = t
            del part
        return outs if len(outs) > 1 else outs[0]

