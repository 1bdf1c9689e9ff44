"""Token merging for upstream VGGT (FastVGGT's method, any resolution and batch): which tokens are
destinations, the assignment of every other token to its most similar destination, the merge
(mean of q, k, v) and the unmerge; and the FastVGGT fork's own merge, run with attention on ELSA."""
from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ...dispatch import fused_kernels
from .common import CallScope

# TokenMerging.fast(): random directions of the similarity, merged blocks per plan, and the share of
# protected tokens (half of FastVGGT's 0.1: a sixth fewer destinations, so about 26% less work in
# the merged attention, which is quadratic in them)
FAST_SIMILARITY_DIM = 64
FAST_REUSE = 2
FAST_PROTECT = 0.05


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

    Cheaper assignments (the search is every source against every destination in C dimensions, at
    every merged block):

    * ``similarity_dim`` k: the similarity is taken between the rows' projections onto k fixed
      random Gaussian directions (seeded by ``seed``; Johnson–Lindenstrauss: cosines are kept to
      about 1/√k), so the search costs k/C of the full one. None (or k ≥ C): the full dimension.
    * ``reuse`` r: a plan is made at blocks start_layer, start_layer + r, … and the r − 1 merged
      blocks after each reuse it (the tokens' similarities change slowly from block to block).

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
    similarity_dim: Optional[int] = None
    reuse: int = 1

    def __post_init__(self):
        def number(v, kind):  # (a bool is an int to Python, never a fraction or a count here)
            return isinstance(v, kind) and not isinstance(v, bool)

        if not (number(self.ratio, (int, float)) and 0.0 <= self.ratio <= 1.0):
            raise ValueError(f"TokenMerging.ratio must be in [0, 1], got {self.ratio!r}")
        if not (number(self.protect, (int, float)) and 0.0 <= self.protect <= 1.0):
            raise ValueError(f"TokenMerging.protect must be in [0, 1], got {self.protect!r}")
        if not number(self.start_layer, int) or self.start_layer < 0:
            raise ValueError(f"TokenMerging.start_layer must be an int >= 0, got {self.start_layer!r}")
        if not number(self.seed, int):
            raise TypeError(f"TokenMerging.seed must be an int, got {self.seed!r}")
        cell = tuple(self.cell)
        if len(cell) != 2 or not all(number(c, int) and c >= 1 for c in cell):
            raise ValueError(f"TokenMerging.cell must be (rows, cols) of positive ints, got {self.cell!r}")
        object.__setattr__(self, "cell", cell)
        if self.similarity_dim is not None and not number(self.similarity_dim, int):
            raise TypeError(f"TokenMerging.similarity_dim must be an int or None, got {self.similarity_dim!r}")
        if self.similarity_dim is not None and self.similarity_dim < 1:
            raise ValueError(f"TokenMerging.similarity_dim must be >= 1, got {self.similarity_dim!r}")
        if not number(self.reuse, int):
            raise TypeError(f"TokenMerging.reuse must be an int, got {self.reuse!r}")
        if self.reuse < 1:
            raise ValueError(f"TokenMerging.reuse must be >= 1, got {self.reuse!r}")
        if self.similarity_dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise ValueError(f"TokenMerging.similarity_dtype must be a floating dtype, got {self.similarity_dtype!r}")

    @classmethod
    def fast(cls, **overrides) -> "TokenMerging":
        """The fast preset: the similarity in FAST_SIMILARITY_DIM random directions, each plan reused
        for FAST_REUSE merged blocks, and FAST_PROTECT of the tokens protected (see the class
        docstring; docs/vggt.md has their measured time and accuracy). ``overrides`` set any other
        field (ratio, seed, …)."""
        return cls(**{"similarity_dim": FAST_SIMILARITY_DIM, "reuse": FAST_REUSE, "protect": FAST_PROTECT,
                      **overrides})


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
def pattern_on(frames: int, grid: tuple[int, int], special: int, cfg: TokenMerging):
    """destination_pattern, remembered for the last few shapes (a pure function of its arguments)."""
    return destination_pattern(frames, grid, special, cfg)


@dataclass
class MergePlan:
    """Where every token goes: ``slot`` [B, N] (int64) is the merged-set row each token is averaged
    into and reads its output from; ``counts`` [B, M] (float32) the tokens averaged into each row.

    Sharded across ranks (see :func:`sharded_merge_plan`): N is this rank's tokens, M the whole
    merged set's rows, ``group`` the process group whose ranks' sums make the means, ``rows`` [R]
    the merged rows this rank's tokens read (ascending) and ``read`` [B, N] each token's position
    in ``rows``; single-process plans have None there.

    ``segments``: (order [B, N], offsets [B, M + 1]) of kernels/segment_mean.py — the tokens sorted
    by merged row — on plans whose merge runs that kernel (single-process, on CUDA), else None."""
    slot: torch.Tensor
    counts: torch.Tensor
    num_tokens: int   # N
    num_merged: int   # M = N − (merged sources)
    destinations: torch.Tensor  # [Nd] token indices
    group: Optional[object] = None
    rows: Optional[torch.Tensor] = None
    read: Optional[torch.Tensor] = None
    segments: Optional[tuple] = None

    def tensors(self) -> tuple:
        """The plan's tensors (for record_stream when it was made on another stream)."""
        return tuple(t for t in (self.slot, self.counts, self.destinations, self.rows, self.read,
                                 *(self.segments or ())) if t is not None)


def _nearest(metric: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, dtype: torch.dtype,
             budget: int = 1 << 28, backend: str = "auto"):
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

    nearest = _fused_nearest(metric, backend)
    with torch.autocast(metric.device.type, enabled=False):
        for b in range(B):
            d = unit(dst)
            fused = nd > 0 and nearest is not None and nearest.supported(d, d) is None
            if fused:  # sources in blocks of ≤ budget elements, normalized ≤ budget / 8 at a time
                C = max(d.shape[1], 1)
                step, sub = max(rows, budget // C), max(1, budget // (8 * C))
                s = torch.empty(min(step, ns), d.shape[1], dtype=dtype, device=metric.device)
                for i in range(0, ns, step):
                    n = min(step, ns - i)
                    for j in range(0, n, sub):
                        s[j:min(j + sub, n)] = unit(src[i + j:i + min(j + sub, n)])
                    sim[b, i:i + n], best[b, i:i + n] = nearest.nearest(s[:n], d)
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


def _fused_nearest(metric: torch.Tensor, backend: str):
    """kernels/nearest.py when the Triton kernels serve ``metric``'s device here, else None (the
    kernel module, and Triton with it, is imported only then)."""
    if not fused_kernels(backend, metric.device.type):
        return None
    from ...kernels import nearest
    return nearest


@functools.lru_cache(maxsize=8)
def _projection_cpu(channels: int, dim: int, seed: int) -> torch.Tensor:
    """[channels, dim] Gaussian directions of similarity_dim, from the CPU generator of ``seed``."""
    gen = torch.Generator().manual_seed(seed + 0x5EED)
    return torch.randn(channels, dim, generator=gen) / math.sqrt(dim)


def similarity_rows(metric: torch.Tensor, cfg: TokenMerging) -> torch.Tensor:
    """The rows the assignment compares: ``metric`` [B, N, C], or its projection [B, N, k] onto
    cfg.similarity_dim random directions (float32) when k < C."""
    C = metric.shape[-1]
    if cfg.similarity_dim is None or cfg.similarity_dim >= C:
        return metric
    proj = _projection_cpu(C, cfg.similarity_dim, cfg.seed).to(metric.device)
    with torch.autocast(metric.device.type, enabled=False):
        return metric.float() @ proj


def merge_plan(metric: torch.Tensor, frames: int, grid: tuple[int, int], special: int, cfg: TokenMerging,
               pattern: Optional[tuple[torch.Tensor, torch.Tensor]] = None, backend: str = "auto") -> MergePlan:
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
        sim, best = _nearest(similarity_rows(metric, cfg), dst, src, cfg.similarity_dtype, backend=backend)
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
    return MergePlan(slot, counts, N, M, dst, segments=_segments(slot, counts, backend))


def _segment_kernel(device: torch.device, backend: str):
    """kernels/segment_mean.py where it serves the merge: on CUDA with the Triton kernels available
    (on the CPU the merge stays index_add_; the CPU tests run the kernel under the interpreter
    directly)."""
    if device.type != "cuda" or not fused_kernels(backend, "cuda") or torch.compiler.is_compiling():
        return None  # (under torch.compile the torch ops, which inductor fuses, as for kernels/rope.py)
    from ...kernels import segment_mean
    return segment_mean


def _segments(slot: torch.Tensor, counts: torch.Tensor, backend: str) -> Optional[tuple]:
    kernel = _segment_kernel(slot.device, backend)
    return None if kernel is None else kernel.segments(slot, counts)


def merge_mean(t: torch.Tensor, plan: MergePlan) -> torch.Tensor:
    """[B, N, ...] (any strides) → [B, M, ...]: each merged row is the mean of its tokens, accumulated
    in float32 (float64 for float64) and returned in t's dtype. Deterministic on CPU and CUDA. With
    the plan's segments ([B, N, H, D] rows), one pass of kernels/segment_mean.py (which has no
    derivative: a t that wants a gradient or carries a forward-AD tangent takes PyTorch's ops)."""
    if plan.segments is not None and plan.group is None and t.dim() == 4 and not (
            torch.is_grad_enabled() and t.requires_grad):
        from ...kernels.ops import has_tangent
        if not has_tangent((t,)):
            from ...kernels.segment_mean import segment_mean
            return segment_mean(t, *plan.segments)
    B, N = t.shape[:2]
    acc_dt = torch.float64 if t.dtype == torch.float64 else torch.float32
    acc = torch.zeros((B, plan.num_merged, *t.shape[2:]), dtype=acc_dt, device=t.device)
    for b in range(B):
        src = t[b].to(acc_dt)
        if t.is_cuda:  # the sort-based accumulate: no float atomics, so bitwise reproducible
            acc[b].index_put_((plan.slot[b],), src, accumulate=True)
        else:
            acc[b].index_add_(0, plan.slot[b], src)
    if plan.group is not None:  # every rank's tokens' sums: the whole merged set on every rank
        from ...distributed import all_reduce_sum  # (differentiable: eval-mode gradients reach every rank)
        acc = all_reduce_sum(acc, plan.group)
    acc /= plan.counts.to(acc_dt).view(B, plan.num_merged, *([1] * (t.dim() - 2)))
    return acc.to(t.dtype)


def unmerge(y: torch.Tensor, plan: MergePlan) -> torch.Tensor:
    """[B, M, C] → [B, N, C]: every token reads the row it was merged into (sharded plans: y holds
    the rows ``plan.rows`` only, [B, R, C])."""
    B, M, C = y.shape
    slot = plan.slot if plan.read is None else plan.read
    rows = (slot + torch.arange(B, device=y.device)[:, None] * M).reshape(-1)
    return y.reshape(B * M, C).index_select(0, rows).view(B, plan.num_tokens, C)


@dataclass(frozen=True)
class Shard:
    """This rank's share of a sharded aggregator call: every rank's frame count (``counts``, rank
    order) and this rank's place; its frames are first_frame … first_frame + frames − 1 of the whole
    sequence."""
    group: object
    counts: tuple
    rank: int

    @property
    def first_frame(self) -> int:
        return sum(self.counts[:self.rank])

    @property
    def frames(self) -> int:
        return self.counts[self.rank]


def _gather_rows(t: torch.Tensor, counts: list, group) -> torch.Tensor:
    """[B, n_r, …] of every rank (n_r = counts[r], in rank order) → [B, Σ n_r, …]: one all-gather of
    padded shards."""
    import torch.distributed as dist
    longest = max(counts)
    pad = t.new_zeros((t.shape[0], longest, *t.shape[2:]))
    pad[:, :t.shape[1]] = t
    parts = [torch.empty_like(pad) for _ in counts]
    dist.all_gather(parts, pad.contiguous(), group=group)
    return torch.cat([p[:, :n] for p, n in zip(parts, counts)], dim=1)


def sharded_merge_plan(metric: torch.Tensor, call: "AggregatorCall") -> MergePlan:
    """The merge plan of one global block whose frames are sharded across ranks: the same merged set
    as one process's :func:`merge_plan` over all the frames (the destination pattern of the whole
    sequence; each source's most similar destination among every rank's; the global top-``ratio``
    choice), with this rank's tokens as N. Collective: every rank of the group calls it.

    The destinations' similarity rows are all-gathered (and, when not every source merges, the
    sources' similarities), each rank assigns its own sources, the counts are all-reduced, and
    :func:`merge_mean` all-reduces the sums: every rank holds the whole merged set, of which it
    computes the rows its tokens read (``rows``)."""
    import torch.distributed as dist

    sh, cfg = call.shard, call.cfg
    B, n, _ = metric.shape
    P = call.special + call.grid[0] * call.grid[1]
    if n != sh.frames * P:
        raise ValueError(f"token merging: this rank's sequence has {n} tokens but its {sh.frames} frames of "
                         f"{call.special} special + {call.grid[0]}x{call.grid[1]} patch tokens make {sh.frames * P}")
    lo = sh.first_frame * P
    dst, src = call.pattern
    dev = metric.device
    N, nd, ns = call.frames * P, dst.numel(), src.numel()
    r = min(int(cfg.ratio * N), ns)
    M = N - r
    (d0, d1, s0, s1), nd_r, ns_r = call.shard_geometry()
    rows_sim = similarity_rows(metric, cfg)
    slot = torch.empty(B, n, dtype=torch.int64, device=dev)
    slot[:, dst[d0:d1] - lo] = torch.arange(d0, d1, device=dev)
    if ns:
        # every destination's row, then this rank's sources: the single-process search on them
        d_all = _gather_rows(rows_sim[:, dst[d0:d1] - lo], nd_r, sh.group)
        both = torch.cat([d_all, rows_sim[:, src[s0:s1] - lo]], dim=1)
        sim, best = _nearest(both, torch.arange(nd, device=dev), torch.arange(nd, nd + s1 - s0, device=dev),
                             cfg.similarity_dtype, backend=call.backend)
        local = src[s0:s1] - lo
        if r == ns:
            slot[:, local] = best
        else:
            sim_all = _gather_rows(sim, ns_r, sh.group)  # [B, ns] in the whole sequence's source order
            order = torch.argsort(sim_all, dim=1, descending=True, stable=True)
            merges = torch.zeros(B, ns, dtype=torch.bool, device=dev).scatter_(1, order[:, :r], True)
            # the unmerged sources keep rows nd, nd + 1, … in source order, as in merge_plan
            kept_row = nd + torch.cumsum(~merges, dim=1) - 1
            mine = merges[:, s0:s1]
            slot[:, local] = torch.where(mine, best, kept_row[:, s0:s1])
    counts_m = torch.zeros(B, M, dtype=torch.float32, device=dev).scatter_add_(
        1, slot, torch.ones(1, 1, dtype=torch.float32, device=dev).expand(B, n))
    dist.all_reduce(counts_m, group=sh.group)
    rows = torch.unique(slot)  # sorted: the merged rows this rank's tokens read
    return MergePlan(slot, counts_m, n, M, dst, group=sh.group, rows=rows, read=torch.searchsorted(rows, slot))


@dataclass
class AggregatorCall:
    """Set (in a context variable) while a patched aggregator with token merging runs."""
    cfg: TokenMerging
    frames: int
    grid: tuple[int, int]
    special: int
    layers: dict  # id(global attention module) → global layer index
    pattern: tuple  # (destinations, sources) on the device, shared by the call's global blocks
    plans: dict = field(default_factory=dict)  # global layer → its plan (cfg.reuse > 1)
    shard: Optional[Shard] = None  # frames sharded across ranks: ``frames`` is then the whole sequence's
    backend: str = "auto"  # the patch's backend option: its fused kernels only under "auto" / "triton"
    _geometry: Optional[tuple] = None

    def shard_geometry(self) -> tuple:
        """((d0, d1, s0, s1), destinations per rank, sources per rank) of a sharded call: this rank's
        destinations are pattern[0][d0:d1], its sources pattern[1][s0:s1]. The same for every
        global block of the call, so found once (from every rank's frame count: one host read, no
        collective)."""
        if self._geometry is None:
            sh, (dst, src) = self.shard, self.pattern
            P = self.special + self.grid[0] * self.grid[1]
            ends = [0]
            for c in sh.counts:
                ends.append(ends[-1] + c * P)
            bounds = torch.tensor(ends, device=dst.device)
            d, s = torch.stack((torch.searchsorted(dst, bounds), torch.searchsorted(src, bounds))).tolist()
            r = sh.rank
            nd_r = tuple(b - a for a, b in zip(d, d[1:]))
            ns_r = tuple(b - a for a, b in zip(s, s[1:]))
            self._geometry = ((d[r], d[r + 1], s[r], s[r + 1]), nd_r, ns_r)
        return self._geometry

    def _make(self, x: torch.Tensor) -> MergePlan:
        if self.shard is not None:
            return sharded_merge_plan(x, self)
        return merge_plan(x, self.frames, self.grid, self.special, self.cfg, self.pattern, self.backend)

    def plan(self, x: torch.Tensor, layer: int) -> MergePlan:
        """The plan of global layer ``layer`` (x: its metric [B, N, C]): made at the layers
        start_layer + i·reuse, reused by the layers after each (made here if a block ran out of
        order and its base layer's plan is missing)."""
        cfg = self.cfg
        if cfg.reuse == 1:
            return self._make(x)
        base = cfg.start_layer + (layer - cfg.start_layer) // cfg.reuse * cfg.reuse
        plan = self.plans.get(base)
        if plan is None or plan.slot.shape[0] != x.shape[0] or plan.num_tokens != x.shape[1]:
            plan = self.plans[base] = self._make(x)
        return plan


# The aggregator call merging tokens (read only while one runs: see CallScope).
MERGING = CallScope("elsa_vggt_merging")


def merging_now() -> Optional[AggregatorCall]:
    """The aggregator call merging tokens in this context, if any."""
    return MERGING.get()


def merging(call: AggregatorCall):
    """Run the block of a ``with`` as an aggregator call that merges tokens (see :func:`merging_now`)."""
    return MERGING.holding(call)


# The FastVGGT fork's merged attention (vggt/layers/attention.py of the fork): these constants are
# written in its Attention.forward.
_FORK_MERGE_RATIO = 0.9


_FORK_SEED = 33


FORK_BLOCKS = range(24)


def fork_merge(module, x, q, k, v):
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
