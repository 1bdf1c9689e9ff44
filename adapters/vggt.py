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
* ``vggt.models.aggregator.Aggregator``, only when ``lean_memory`` or ``token_merging`` is given,
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
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import math
import operator
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..api import attention
from ..kernels import nearest as _nearest_kernel
from ..kernels import rope as _rope_kernel
from .registry import Adapter, PatchState, bypass_reason, register

# --------------------------------------------------------------------------------------------
# Token merging configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenMerging:
    """FastVGGT's token merging for the global attention of upstream VGGT, at any resolution and batch.

    In each global block from ``start_layer`` on (after q/k norm and RoPE), per sequence of S frames:

    * destinations: every token of frame 0, the special (camera + register) tokens of every frame,
      one token per ``cell`` (rows × cols) patch cell of the other frames (a random one; partial
      cells at odd grid edges get one too), plus ``protect`` · N further tokens chosen at random;
    * every other token is a source: it merges into its most cosine-similar destination (similarity
      of the block's normalized input, computed in ``similarity_dtype``). At most ``ratio`` · N
      sources merge — the most similar first; the rest stay as tokens of their own;
    * q, k and v of each destination become the mean over the destination and its sources;
      attention runs on the merged set with ELSA, and every merged source reads its destination's
      output.

    All random choices come from a generator seeded with ``seed`` (on the CPU, so they are the same
    on every device); the same destinations serve every block and batch element. Inference only: in
    training mode the global blocks run exact attention.

    Differences from the FastVGGT fork's code: it fixes the grid (37×28) and batch 1, picks the
    protected tokens on a fixed stride, lets protected tokens take part twice (as destination and
    as a copy), and leaves the last column of an odd-width grid without destinations.
    """

    ratio: float = 0.9
    start_layer: int = 0
    seed: int = 0
    protect: float = 0.1
    cell: tuple[int, int] = (2, 2)
    similarity_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if isinstance(self.ratio, bool) or not (isinstance(self.ratio, (int, float)) and 0.0 <= self.ratio <= 1.0):
            raise ValueError(f"TokenMerging.ratio must be in [0, 1], got {self.ratio!r}")
        if not (isinstance(self.protect, (int, float)) and 0.0 <= self.protect <= 1.0):
            raise ValueError(f"TokenMerging.protect must be in [0, 1], got {self.protect!r}")
        if not isinstance(self.start_layer, int) or self.start_layer < 0:
            raise ValueError(f"TokenMerging.start_layer must be an int >= 0, got {self.start_layer!r}")
        if not isinstance(self.seed, int):
            raise TypeError(f"TokenMerging.seed must be an int, got {self.seed!r}")
        cell = tuple(self.cell)
        if len(cell) != 2 or not all(isinstance(c, int) and c >= 1 for c in cell):
            raise ValueError(f"TokenMerging.cell must be (rows, cols) of positive ints, got {self.cell!r}")
        object.__setattr__(self, "cell", cell)
        if self.similarity_dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise ValueError(f"TokenMerging.similarity_dtype must be a floating dtype, got {self.similarity_dtype!r}")


# --------------------------------------------------------------------------------------------
# Classes served (by class object) and which forward signature each has
# --------------------------------------------------------------------------------------------

ATTENTION_TARGETS = ("vggt.layers.attention:Attention", "vggt.layers.attention:MemEffAttention")
AGGREGATOR_TARGETS = ("vggt.models.aggregator:Aggregator",)
BLOCK_TARGETS = ("vggt.layers.block:Block",)
DPT_HEAD_TARGETS = ("vggt.heads.dpt_head:DPTHead",)

_EXTRA: dict[str, list[type]] = {"attention": [], "aggregator": [], "block": [], "dpt_head": []}


def register_classes(*, attention: Sequence[type] = (), aggregator: Sequence[type] = (),
                     block: Sequence[type] = (), dpt_head: Sequence[type] = ()) -> Callable[[], None]:
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
    """
    added: list[tuple[str, type]] = []
    for key, classes in (("attention", attention), ("aggregator", aggregator), ("block", block),
                         ("dpt_head", dpt_head)):
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
                raise TypeError(f"register_classes: {key} entries must be nn.Module classes, got {cls!r}")
            if key == "attention":
                _attention_kind(cls)  # validates the forward signature now, not at the first call
            if cls not in _EXTRA[key]:
                _EXTRA[key].append(cls)
                added.append((key, cls))

    def remove() -> None:
        for key, cls in added:
            if cls in _EXTRA[key]:
                _EXTRA[key].remove(cls)

    return remove


@dataclass(frozen=True)
class _Kind:
    signature: inspect.Signature
    memeff: bool  # forward(x, attn_bias=None, pos=None, ...)
    fork: bool    # FastVGGT fork: forward(..., global_merging=None)


_KINDS: dict[type, _Kind] = {}


def _attention_kind(cls: type) -> _Kind:
    """Which of vggt's attention forwards ``cls`` has (from its own forward's signature)."""
    kind = _KINDS.get(cls)
    if kind is None:
        sig = inspect.signature(cls.forward)
        params = sig.parameters
        if "x" not in params or "pos" not in params:
            raise TypeError(f"{cls.__module__}.{cls.__qualname__}.forward{sig} is not vggt's attention forward "
                            "(x, pos=None) / (x, attn_bias=None, pos=None)")
        kind = _KINDS[cls] = _Kind(sig, memeff="attn_bias" in params, fork="global_merging" in params)
    return kind


def _is_fork_aggregator(cls: type) -> bool:
    fn = getattr(cls, "_process_global_attention", None)
    return fn is not None and "global_merging" in inspect.signature(fn).parameters


_BLOCKS = Adapter()  # only its lazy import of the target classes is used
_BLOCKS.targets = BLOCK_TARGETS


def _block_classes() -> tuple[type, ...]:
    return (*_BLOCKS.classes(), *_EXTRA["block"])


# --------------------------------------------------------------------------------------------
# Token merging: destinations, plan, merge and unmerge
# --------------------------------------------------------------------------------------------


def destination_pattern(frames: int, grid: tuple[int, int], special: int, cfg: TokenMerging):
    """Token indices (CPU, int64, ascending) of the destinations [Nd] and of the sources [Ns] of a
    global sequence of ``frames`` frames, each ``special`` tokens then an h×w patch grid (row-major)."""
    h, w = grid
    P = special + h * w
    N = frames * P
    gen = torch.Generator().manual_seed(cfg.seed)
    keep = torch.zeros(frames, P, dtype=torch.bool)
    keep[0] = True
    keep[:, :special] = True
    if frames > 1 and h * w > 0:
        sy, sx = cfg.cell
        ny, nx = -(-h // sy), -(-w // sx)
        rows = (h - torch.arange(ny) * sy).clamp(max=sy)            # rows of each cell row (edge cells are partial)
        cols = (w - torch.arange(nx) * sx).clamp(max=sx)
        size = rows[:, None] * cols[None, :]                         # [ny, nx] tokens per cell
        pick = (torch.rand(frames - 1, ny, nx, generator=gen) * size).long()
        pick = torch.minimum(pick, size - 1)
        y = torch.arange(ny)[:, None] * sy + torch.div(pick, cols, rounding_mode="floor")
        x = torch.arange(nx)[None, :] * sx + pick % cols
        keep[1:].scatter_(1, (special + y * w + x).reshape(frames - 1, -1), True)
    keep = keep.flatten()
    sources = (~keep).nonzero().squeeze(1)
    n_protect = min(sources.numel(), int(round(cfg.protect * N)))
    if n_protect:
        keep[sources[torch.randperm(sources.numel(), generator=gen)[:n_protect]]] = True
    return keep.nonzero().squeeze(1), (~keep).nonzero().squeeze(1)


@functools.lru_cache(maxsize=8)
def _pattern(frames: int, grid: tuple[int, int], special: int, cfg: TokenMerging):
    """destination_pattern, remembered for the last few shapes (a pure function of its arguments)."""
    return destination_pattern(frames, grid, special, cfg)


@dataclass
class MergePlan:
    """Where every token goes: ``slot`` [B, N] (int64) is the merged-set row each token is averaged
    into and reads its output from; ``counts`` [B, M] (float32) the tokens averaged into each row."""
    slot: torch.Tensor
    counts: torch.Tensor
    num_tokens: int   # N
    num_merged: int   # M = N − (merged sources)
    destinations: torch.Tensor  # [Nd] token indices


def _nearest(metric: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, dtype: torch.dtype,
             budget: int = 1 << 28):
    """Per batch element, each source's most cosine-similar destination: (similarity [B, Ns] float32,
    destination row [B, Ns] int64). The unit vectors are rounded to ``dtype`` and their products
    accumulated in float32 (float64 for float64); ties go to the first destination. bf16/fp16 on a
    GPU: the fused kernel (kernels/nearest.py); otherwise scores are formed in chunks of ≤ ``budget``."""
    B = metric.shape[0]
    ns, nd = src.numel(), dst.numel()
    sim = torch.empty(B, ns, dtype=torch.float32, device=metric.device)
    best = torch.empty(B, ns, dtype=torch.int64, device=metric.device)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    rows = max(1, budget // max(nd, 1))

    def unit(idx):  # [n, C] unit rows in the similarity dtype, normalized in float32
        return F.normalize(metric[b].index_select(0, idx).float(), dim=-1).to(dtype)

    with torch.autocast(metric.device.type, enabled=False):
        for b in range(B):
            d = unit(dst)
            fused = nd > 0 and _nearest_kernel.supported(d, d) is None
            if fused:  # sources in blocks of ≤ budget elements, normalized ≤ budget / 8 at a time
                C = max(d.shape[1], 1)
                step, sub = max(rows, budget // C), max(1, budget // (8 * C))
                s = torch.empty(min(step, ns), d.shape[1], dtype=dtype, device=metric.device)
                for i in range(0, ns, step):
                    n = min(step, ns - i)
                    for j in range(0, n, sub):
                        s[j:min(j + sub, n)] = unit(src[i + j:i + min(j + sub, n)])
                    sim[b, i:i + n], best[b, i:i + n] = _nearest_kernel.nearest(s[:n], d)
                continue
            d = d.to(acc)
            for i in range(0, ns, rows):
                scores = unit(src[i:i + rows]).to(acc) @ d.T
                # first maximal index (torch's max leaves the choice among ties open)
                top = scores.amax(dim=1, keepdim=True)
                first = (scores == top).to(torch.uint8).argmax(dim=1)
                sim[b, i:i + rows] = top.squeeze(1).float()
                best[b, i:i + rows] = first
    return sim, best


def merge_plan(metric: torch.Tensor, frames: int, grid: tuple[int, int], special: int, cfg: TokenMerging,
               pattern: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> MergePlan:
    """The merge plan of one global block. metric: [B, N, C], the block's normalized input."""
    B, N, _ = metric.shape
    h, w = grid
    if N != frames * (special + h * w):
        raise ValueError(f"token merging: the sequence has {N} tokens but {frames} frames of {special} special + "
                         f"{h}x{w} patch tokens make {frames * (special + h * w)}")
    dst, src = pattern if pattern is not None else destination_pattern(frames, grid, special, cfg)
    dev = metric.device
    dst, src = dst.to(dev), src.to(dev)
    nd, ns = dst.numel(), src.numel()
    r = min(int(cfg.ratio * N), ns)  # sources that merge
    M = N - r
    slot = torch.empty(B, N, dtype=torch.int64, device=dev)
    slot[:, dst] = torch.arange(nd, device=dev)
    if ns:
        sim, best = _nearest(metric, dst, src, cfg.similarity_dtype)
        if r == ns:
            slot[:, src] = best
        else:
            order = torch.argsort(sim, dim=1, descending=True, stable=True)
            top, rest = order[:, :r], order[:, r:].sort(dim=1).values
            slot.scatter_(1, src[top], best.gather(1, top))
            slot.scatter_(1, src[rest], nd + torch.arange(ns - r, device=dev).expand(B, -1))
    # integer counts are exact in float32 whatever the order of the additions
    counts = torch.zeros(B, M, dtype=torch.float32, device=dev).scatter_add_(
        1, slot, torch.ones(1, 1, dtype=torch.float32, device=dev).expand(B, N))
    return MergePlan(slot, counts, N, M, dst)


def merge_mean(t: torch.Tensor, plan: MergePlan) -> torch.Tensor:
    """[B, N, ...] (any strides) → [B, M, ...]: each merged row is the mean of its tokens, accumulated
    in float32 (float64 for float64) and returned in t's dtype. Deterministic on CPU and CUDA."""
    B, N = t.shape[:2]
    acc_dt = torch.float64 if t.dtype == torch.float64 else torch.float32
    acc = torch.zeros((B, plan.num_merged, *t.shape[2:]), dtype=acc_dt, device=t.device)
    for b in range(B):
        src = t[b].to(acc_dt)
        if t.is_cuda:  # the sort-based accumulate: no float atomics, so bitwise reproducible
            acc[b].index_put_((plan.slot[b],), src, accumulate=True)
        else:
            acc[b].index_add_(0, plan.slot[b], src)
    acc /= plan.counts.to(acc_dt).view(B, plan.num_merged, *([1] * (t.dim() - 2)))
    return acc.to(t.dtype)


def unmerge(y: torch.Tensor, plan: MergePlan) -> torch.Tensor:
    """[B, M, C] → [B, N, C]: every token reads the row it was merged into."""
    B, M, C = y.shape
    rows = (plan.slot + torch.arange(B, device=y.device)[:, None] * M).reshape(-1)
    return y.reshape(B * M, C).index_select(0, rows).view(B, plan.num_tokens, C)


@dataclass
class _AggregatorCall:
    """Set (in a context variable) while a patched aggregator with token merging runs."""
    cfg: TokenMerging
    frames: int
    grid: tuple[int, int]
    special: int
    layers: dict  # id(global attention module) → global layer index
    pattern: tuple  # (destinations, sources) on the device, shared by the call's global blocks

    def plan(self, x: torch.Tensor) -> MergePlan:
        return merge_plan(x, self.frames, self.grid, self.special, self.cfg, self.pattern)


_MERGING: contextvars.ContextVar[Optional[_AggregatorCall]] = contextvars.ContextVar("elsa_vggt_merging",
                                                                                       default=None)

# The FastVGGT fork's merged attention (vggt/layers/attention.py of the fork): these constants are
# written in its Attention.forward.
_FORK_MERGE_RATIO = 0.9
_FORK_SEED = 33
_FORK_BLOCKS = range(24)

# --------------------------------------------------------------------------------------------
# The attention adapter
# --------------------------------------------------------------------------------------------


def _autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    dev = device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def _observed(module) -> bool:
    """Whether forward hooks (the module's own, when given, or global ones) would see a call."""
    from torch.nn.modules import module as _m
    own = module is not None and bool(module._forward_hooks or module._forward_pre_hooks)
    return own or bool(_m._global_forward_hooks or _m._global_forward_pre_hooks)


def _fused_qk(module, x: torch.Tensor, pos) -> Optional[tuple]:
    """When q/k norm and RoPE can run as one kernel (kernels/rope.py): the RoPE (cos, sin) tables
    [P, D/2] float32, () without RoPE; None when they go through the modules themselves — with
    gradients, hooks on them, or modules other than LayerNorm / Identity and vggt's RoPE."""
    if torch.is_grad_enabled() or not (x.is_cuda or _rope_kernel.INTERPRET) or x.dtype == torch.float64:
        return None  # (the kernel computes in float32)
    D = module.head_dim
    qn, kn, rope = module.q_norm, module.k_norm, module.rope
    norms = [type(m) for m in (qn, kn)]
    if not (norms == [torch.nn.Identity] * 2 or (norms == [torch.nn.LayerNorm] * 2
                                                 and qn.normalized_shape == kn.normalized_shape == (D,))):
        return None
    if D < 4 or D & (D - 1) or any(_observed(m) for m in (qn, kn, rope)):
        return None
    if rope is None:  # norms only (nothing to fuse without them: q and k stay views of qkv)
        return None if norms[0] is torch.nn.Identity else ()
    if (type(rope).__name__ != "RotaryPositionEmbedding2D" or not hasattr(rope, "_compute_frequency_components")
            or not isinstance(pos, torch.Tensor) or pos.dim() != 3 or pos.shape[-1] != 2
            or pos.shape[:2] != x.shape[:2] or pos.is_floating_point() or pos.device != x.device):
        return None
    lo, hi = torch.stack(torch.aminmax(pos)).tolist()  # one device sync, as the module's own max
    if lo < 0:  # the module's embedding lookup raises on these; the kernel would read out of bounds
        return None
    return rope._compute_frequency_components(D // 2, hi + 1, x.device, torch.float32)


def _project(module, x: torch.Tensor, pos, chunk: Optional[int], prenorm=None):
    """q, k, v [B, H, N, D] after q/k norm and RoPE, exactly as vggt's Attention forms them from
    ``prenorm(x)`` (``x`` itself when prenorm is None).

    In inference, q/k norm and RoPE run fused (see _fused_qk), q and k coming out in the dtype
    attention runs in (the autocast dtype under autocast, where SDPA would cast them to it).

    With ``chunk`` and B·N > chunk, tokens are processed ``chunk`` at a time into [B, N, H, D]
    buffers (the returned tensors are transposed views) held in the dtype attention will run in
    (the autocast dtype under autocast) — the per-token operations give the same values, and the
    float32 temporaries of the whole sequence (normalized input, q/k, RoPE) never exist at once."""
    B, N, C = x.shape
    H, D = module.num_heads, module.head_dim
    cast = _autocast_dtype(x.device)
    tables = _fused_qk(module, x, pos)
    norms = (module.q_norm, module.k_norm) if type(module.q_norm) is torch.nn.LayerNorm else (None, None)

    def fused(part, n0, n1, bufs):  # q, k of tokens n0:n1 into bufs[0], bufs[1] ([B, N, H, D])
        p = pos[:, n0:n1] if tables else None
        for j in range(2):
            _rope_kernel.qk_norm_rope(part[..., j * H * D:], H, bufs[j][:, n0:n1], norms[j], p, tables or None)

    if chunk is None or B * N <= chunk:
        if prenorm is not None:
            x = prenorm(x)
        y = module.qkv(x)
        if tables is not None:
            qk = [y.new_empty((B, N, H, D), dtype=cast or y.dtype) for _ in range(2)]
            fused(y, 0, N, qk)
            v = y.view(B, N, 3, H, D)[:, :, 2].transpose(1, 2)
            return qk[0].transpose(1, 2), qk[1].transpose(1, 2), v
        qkv = y.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = module.q_norm(q), module.k_norm(k)
        if module.rope is not None:
            q, k = module.rope(q, pos), module.rope(k, pos)
        return q, k, v
    step = max(1, chunk // B)
    bufs = None
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        xc = x[:, n0:n1] if prenorm is None else prenorm(x[:, n0:n1])
        part = module.qkv(xc)
        if bufs is None:
            bufs = [x.new_empty((B, N, H, D), dtype=cast or part.dtype) for _ in range(3)]
        if tables is not None:
            fused(part, n0, n1, bufs)
            bufs[2][:, n0:n1] = part.view(B, n1 - n0, 3, H, D)[:, :, 2]
            continue
        part = part.reshape(B, n1 - n0, 3, H, D)
        q, k, v = part[:, :, 0], part[:, :, 1], part[:, :, 2]
        q, k = module.q_norm(q).transpose(1, 2), module.k_norm(k).transpose(1, 2)  # [B, H, n, D]
        if module.rope is not None:
            p = pos[:, n0:n1]
            q, k = module.rope(q, p), module.rope(k, p)
        bufs[0][:, n0:n1] = q.transpose(1, 2)
        bufs[1][:, n0:n1] = k.transpose(1, 2)
        bufs[2][:, n0:n1] = v
    return tuple(b.transpose(1, 2) for b in bufs)


def _project_out(module, out: torch.Tensor, chunk: Optional[int]) -> torch.Tensor:
    """proj(out as [B, M, C]) for out [B, H, M, D]; with ``chunk``, a chunk of tokens at a time (no
    token-major copy of the whole output)."""
    B, H, M, D = out.shape
    if chunk is None or B * M <= chunk:
        return module.proj(out.transpose(1, 2).reshape(B, M, H * D))
    step = max(1, chunk // B)
    y = None
    for n0 in range(0, M, step):
        part = module.proj(out[:, :, n0:n0 + step].transpose(1, 2).reshape(B, -1, H * D))
        if y is None:
            y = part.new_empty((B, M, part.shape[-1]))
        y[:, n0:n0 + step] = part
    return y


def _unsupported(module, kind: "_Kind", x, pos, attn_bias, merging) -> Optional[str]:
    """Why the original forward must handle this call (None when ELSA serves it exactly)."""
    if kind.memeff and attn_bias is not None:
        return "attn_bias (xFormers nested tensors)"
    if kind.memeff and pos is not None and (not kind.fork or module.rope is None):
        return "MemEffAttention given pos"
    if module.rope is not None and pos is None:
        return "rope without positions"
    why = bypass_reason(module)
    if why:
        return why
    if module.head_dim > 256:
        return f"head dim {module.head_dim} > 256"
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "input is not [B, N, C]"
    if kind.fork and merging is not None and getattr(sys.modules.get(type(module).__module__), "vis_attn_map", False):
        return "FastVGGT attention-map visualisation"
    return None


def _merge_call(module) -> Optional[_AggregatorCall]:
    """The running aggregator call if it merges tokens in this module's block."""
    call = _MERGING.get()
    layer = call.layers.get(id(module)) if call is not None else None
    if layer is not None and layer >= call.cfg.start_layer and not module.training:
        return call
    return None


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


def _elsa_attention(module, state: PatchState, x, pos, kind: "_Kind", merging=None, prenorm=None):
    """The ELSA forward of one attention call (inputs already checked by ``_unsupported``).

    Returns None when q, k, v come out in different dtypes outside autocast (the caller hands the
    call to the original forward, which raises as SDPA does)."""
    opts = state.options
    B, N, C = x.shape
    chunk = int(opts.get("lean_chunk", 1 << 16)) if _lean(opts) is not None else None
    call = None if kind.fork else _merge_call(module)
    plan = unmerge_fn = side = None
    if call is not None:
        metric = x if prenorm is None else prenorm(x)
        if x.is_cuda:
            # the similarity search (a compute-bound kernel) runs on a side stream while the main
            # stream forms q, k, v (bandwidth-bound): the same operations, overlapped
            main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                plan = call.plan(metric)
        else:
            plan = call.plan(metric)
    q, k, v = _project(module, x, pos, chunk, prenorm)
    if side is not None:
        main.wait_stream(side)
        for t in (plan.slot, plan.counts, plan.destinations):
            t.record_stream(main)  # made on the side stream, used (and freed) on the main one
    if _autocast_dtype(x.device) is None and not (q.dtype == k.dtype == v.dtype):
        return None
    if kind.fork:
        if merging is not None and merging in _FORK_BLOCKS:
            q, k, v, unmerge_fn = _fork_merge(module, x, q, k, v)
    elif plan is not None:
        q, k, v = (merge_mean(t.transpose(1, 2), plan).transpose(1, 2) for t in (q, k, v))
    # SDPA's default scale is 1/sqrt(head_dim); the unfused path multiplies by module.scale
    scale = None if kind.fork or module.fused_attn else float(module.scale)
    out = attention(q, k, v, scale=scale, precision=opts.get("precision", "auto"), backend=opts.get("backend", "auto"))
    del q, k, v
    y = module.proj_drop(_project_out(module, out, chunk))
    if plan is not None:
        y = unmerge(y, plan)
    elif unmerge_fn is not None:
        y = unmerge_fn(y)
    return y


class VGGTAttentionAdapter(Adapter):
    """ELSA forward for vggt's ``Attention`` / ``MemEffAttention`` (and the FastVGGT fork's)."""

    name = "vggt"
    targets = ATTENTION_TARGETS
    options = frozenset({"lean_memory", "lean_chunk"})

    def classes(self) -> tuple[type, ...]:
        return tuple(dict.fromkeys([*super().classes(), *_EXTRA["attention"]]))

    def skip_reason(self, module, options):
        tm = options.get("token_merging")
        if tm is not None and not isinstance(tm, TokenMerging):
            raise TypeError(f"token_merging must be an elsa_vision.TokenMerging or None, got {type(tm).__name__}")
        if tm is not None and _attention_kind(type(module)).fork:
            raise ValueError("token_merging=TokenMerging(...) is for upstream VGGT; the FastVGGT fork merges tokens "
                             "itself (its `merging` setting) and its merged attention is patched without it")
        return None

    def forward(self, module, state: PatchState, *args, **kwargs):
        kind = _attention_kind(type(module))
        try:
            bound = kind.signature.bind(module, *args, **kwargs)
        except TypeError:
            return state.delegate(*args, reason="arguments the original forward does not take", **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        x, pos, merging = a["x"], a.get("pos"), a.get("global_merging")
        why = _unsupported(module, kind, x, pos, a.get("attn_bias"), merging)
        if why is None:
            y = _elsa_attention(module, state, x, pos, kind, merging)
            if y is not None:
                return y
            why = "q, k, v of different dtypes outside autocast"
        return state.delegate(*args, reason=why, **kwargs)


def _fork_merge(module, x, q, k, v):
    """The FastVGGT fork's merge of q/k/v (its own bipartite merge function and constants)."""
    fork = sys.modules[type(module).__module__]
    merge_fn = getattr(fork, "token_merge_bipartite2d", None)
    if merge_fn is None:
        raise RuntimeError(f"{type(module).__module__} has a FastVGGT-style forward but no token_merge_bipartite2d; "
                           "install the FastVGGT fork with its `merging` package")
    gen = torch.Generator(device=x.device)
    gen.manual_seed(_FORK_SEED)
    m, u = merge_fn(x, module.patch_width, module.patch_height, 2, 2, int(x.shape[1] * _FORK_MERGE_RATIO),
                    False, gen, enable_protection=True)
    B, H, N, D = q.shape

    def tokens(t):
        return t.permute(0, 2, 1, 3).reshape(B, N, H * D)

    qm, km, vm = m(tokens(q), mode="mean", extra_tensors=tokens(k), extra_tensors_2=tokens(v))
    Nm = qm.shape[1]
    return (*(t.reshape(B, Nm, H, D).permute(0, 2, 1, 3) for t in (qm, km, vm)), u)


# --------------------------------------------------------------------------------------------
# The aggregator adapter: lean memory and the token-merging context
# --------------------------------------------------------------------------------------------

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


def _lean(options: dict):
    """The lean_memory option when requested (True, or a sequence of layers — an empty one keeps
    only the last layer), else None."""
    lean = options.get("lean_memory")
    return None if lean is None or lean is False else lean


def _kept_layers(depth: int, lean) -> frozenset:
    if lean is True:
        wanted = [i for i in HEAD_LAYERS if i < depth]
    else:
        try:
            wanted = [operator.index(i) for i in lean]
        except TypeError:
            raise TypeError(f"lean_memory must be True/False or a sequence of layer indices, got {lean!r}") from None
        bad = [i for i in wanted if not -depth <= i < depth]
        if bad:
            raise ValueError(f"lean_memory layers {bad} are outside the aggregator's {depth} layers")
    return frozenset({i % depth for i in wanted} | {depth - 1})


def _watched(module) -> bool:
    """Whether anything could hold or see what ``module`` computes: hooks anywhere in its subtree
    or global ones, or a forward replaced on the instance (another library's wrapper)."""
    return "forward" in module.__dict__ or any(_observed(m) for m in module.modules())


def _run_block(block, x, pos, per_frame: bool, chunk: int, block_classes: tuple):
    """One aggregator block in eval mode with bounded transient memory (same values as block(x, pos=pos)).
    A block with hooks of its own or a wrapped forward runs whole (they expect one call of the block);
    hooks inside it (a progress bar on ls1, say) see one call per chunk, as lean mode documents."""
    if (type(block) not in block_classes or block.training or "forward" in block.__dict__
            or block._forward_hooks or block._forward_pre_hooks):
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


def _block_attention(block, x, pos):
    """block.attn(block.norm1(x), pos=pos); when the attention is ours and nothing observes the call
    (no hooks, no token merging), norm1 runs inside its token chunks instead of on the whole sequence."""
    attn = block.attn
    state = attn.__dict__.get("_elsa")
    if (not isinstance(state, PatchState) or not isinstance(state.adapter, VGGTAttentionAdapter)
            or attn._forward_hooks or attn._forward_pre_hooks or _merge_call(attn) is not None):
        return attn(block.norm1(x), pos=pos)
    kind = _attention_kind(type(attn))
    if kind.fork or _unsupported(attn, kind, x, pos, None, None) is not None:
        return attn(block.norm1(x), pos=pos)
    state.count_call()
    y = _elsa_attention(attn, state, x, pos, kind, prenorm=block.norm1)
    return y if y is not None else state.delegate(block.norm1(x), pos=pos, reason="q, k, v of different dtypes "
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
    block_classes = _block_classes()
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
            tokens = _run_block(blocks[idx], tokens, pos, kind == "frame", chunk, block_classes)
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


class VGGTAggregatorAdapter(Adapter):
    """Lean memory and the token-merging context for vggt's ``Aggregator``."""

    name = "vggt-aggregator"
    targets = AGGREGATOR_TARGETS
    options = frozenset({"lean_memory", "lean_chunk", "lean_offload"})

    def classes(self) -> tuple[type, ...]:
        return tuple(dict.fromkeys([*super().classes(), *_EXTRA["aggregator"]]))

    def skip_reason(self, module, options):
        tm, lean = options.get("token_merging"), _lean(options)
        offload = options.get("lean_offload", False)
        if not isinstance(offload, bool):
            raise TypeError(f"lean_offload must be True or False, got {offload!r}")
        if offload and lean is None:
            raise ValueError("lean_offload=True moves the layers lean_memory keeps to host memory: "
                             "pass lean_memory=True (or a list of layers) with it")
        if tm is not None and not isinstance(tm, TokenMerging):
            raise TypeError(f"token_merging must be an elsa_vision.TokenMerging or None, got {type(tm).__name__}")
        chunk = options.get("lean_chunk", 1 << 16)
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"lean_chunk must be a positive int (tokens), got {chunk!r}")
        if lean is None and tm is None:
            return "nothing to change (lean_memory and token_merging not requested)"
        if _is_fork_aggregator(type(module)):
            if tm is not None:
                raise ValueError("token_merging=TokenMerging(...) is for upstream VGGT; the FastVGGT fork merges "
                                 "tokens itself (its `merging` setting): patch it without token_merging")
            return "FastVGGT fork aggregator: already keeps only the layers its heads read"
        if lean is not None:
            _kept_layers(module.depth, lean)  # validate now
        return None

    def forward(self, agg, state: PatchState, images, *args, **kwargs):
        if agg.training:
            return state.delegate(images, *args, reason="training mode (lean memory and token merging are "
                                  "inference-only)", **kwargs)
        if not isinstance(images, torch.Tensor) or images.dim() != 5:
            return state.delegate(images, *args, reason="images not [B, S, 3, H, W]", **kwargs)
        opts = state.options
        cfg, lean = opts.get("token_merging"), _lean(opts)
        token = None
        if cfg is not None:
            grid = (images.shape[-2] // agg.patch_size, images.shape[-1] // agg.patch_size)
            layers = {id(b.attn): i for i, b in enumerate(agg.global_blocks) if hasattr(b, "attn")}
            # the pattern goes to the device before any block is queued: a host-to-device copy
            # later would wait for the GPU to drain its queue
            pattern = tuple(t.to(images.device) for t in _pattern(images.shape[1], grid, agg.patch_start_idx, cfg))
            token = _MERGING.set(_AggregatorCall(cfg, images.shape[1], grid, agg.patch_start_idx, layers, pattern))
        keep = _kept_layers(agg.depth, lean) if lean is not None else None
        host = {} if keep is not None and opts.get("lean_offload") else None
        if keep is not None:
            chunk = opts.get("lean_chunk", 1 << 16)
            # instance attributes shadow the class methods for this call only
            embed = agg.__dict__["patch_embed"] = _PatchEmbedOnce(agg.patch_embed, images)
            agg.__dict__["_process_frame_attention"] = _lean_process(agg, "frame", keep, chunk, host, embed)
            agg.__dict__["_process_global_attention"] = _lean_process(agg, "global", keep, chunk, host)
        try:
            outputs, patch_start_idx = state.original(images, *args, **kwargs)
        finally:
            if keep is not None:
                for name in ("patch_embed", "_process_frame_attention", "_process_global_attention"):
                    agg.__dict__.pop(name, None)
            if token is not None:
                _MERGING.reset(token)
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


class VGGTDPTHeadAdapter(Adapter):
    """Lean mode for vggt's ``DPTHead``: the same frame chunks, written into preallocated outputs
    instead of concatenated at the end (one copy of the full-resolution outputs, not two)."""

    name = "vggt-dpt-head"
    targets = DPT_HEAD_TARGETS
    options = frozenset({"lean_memory", "head_chunk"})

    def classes(self) -> tuple[type, ...]:
        return tuple(dict.fromkeys([*super().classes(), *_EXTRA["dpt_head"]]))

    def skip_reason(self, module, options):
        chunk = options.get("head_chunk")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"head_chunk must be a positive int (frames) or None, got {chunk!r}")
        return None if _lean(options) is not None else "only used with lean_memory"

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


register(VGGTAttentionAdapter())
register(VGGTAggregatorAdapter())
register(VGGTDPTHeadAdapter())
