"""Attention over tokens sharded across processes (torch.distributed): every rank's queries attend to
the keys of all ranks (causal: of the ranks up to its own), exactly as one process would.

Each rank holds a contiguous shard of the sequence — rank 0 the first tokens, rank r the r-th
slice; shards may differ in length. Causal attention needs no mask of its own: a rank's queries
are the last rows of the keys it sees, and ELSA's bottom-right causal alignment (query i sees key
j ≤ i + Nk − Nq) is then exactly the global causal rule.

The key/value shards travel around a ring, one step per shard, in the token-major layout
[B, n, H, D] that attention modules produce. Heads attend independently: the ring goes round once
per group of ``RING_HEADS`` heads, so that what is in flight and the steps' outputs hold one group's
heads. With ``overlap`` shard s+1 is already on its
way while shard s is attended (batched isend/irecv, which NCCL runs beside the compute); without
it each step's transfer completes before its kernel starts, which leaves every SM to the kernel
(NCCL's kernel holds SMs while it runs, and a persistent attention kernel, one program per SM,
then waits for the slowest). Each step's ELSA call returns its rows' output and log-sum-exp, and
the steps merge with the monoid's combine, (o₁, l₁) ∘ (o₂, l₂) = (o₁·e^{l₁−l} + o₂·e^{l₂−l}, l)
with l = log(e^{l₁} + e^{l₂}), in float32; the last combine writes the output in the inputs' dtype
directly, a few heads at a time (two ranks hold no float32 copy of their rows at all). A rank
holds its own shard and one group of heads of the shard being attended and of the one arriving:
O(N / ranks) keys. In half
precision each step's output is rounded to the inputs' dtype once before the float32 merge.

The backward goes around the same ring: each shard travels with float32 accumulators of its key
and value gradients; every rank adds its rows' terms for the shard it holds (the backend's backward
from the merged output and log-sum-exp, so P = exp(s − lse) over the whole row), and after the
last step the accumulators are one hop from their owners, which receive them. dQ stays on its rank
(float32 across the steps). In half precision each step's terms are rounded to the inputs' dtype
once before the float32 sums.

float64 (whose merge would pass through a float32 log-sum-exp) and backends without a backward
entry point all-gather the shards in one collective instead (O(N) keys per rank), whose backward
returns every rank's key/value gradients in one all-reduce.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .api import attention as _attention
from .api import resolve_precision
from .checks import FLOATS, autocast, check_scale
from .dispatch import NotSupportedError, Problem, select


def _dist():
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("elsa_vision.distributed.attention needs an initialised default process group "
                           "(torch.distributed.init_process_group), or a group passed as group=")
    return dist


def gather_ints(values, group, device) -> list[list[int]]:
    """Every rank's ``values`` (a list of ints, as many on every rank), in rank order: one all-gather
    (of a tensor on ``device`` when it is a GPU, NCCL's requirement; on the CPU otherwise)."""
    import torch.distributed as dist
    t = torch.tensor(list(values), dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return [p.tolist() for p in parts]


def agree(values, why: Optional[str], group, device, refused: str, error: Optional[BaseException] = None,
          exc: type = ValueError) -> list[list[int]]:
    """Every rank's ``values`` (ints, as many on every rank), in rank order, in one all-gather that
    also carries each rank's verdict: ``why`` (this rank cannot go on; None: it can). Raises on every
    rank when one refused — this rank's ``error`` (or ``exc(why)``), the others ``exc(refused)``
    with ``{ranks}`` filled in — so that no rank waits in a later collective for one that left."""
    gathered = gather_ints([*values, why is not None], group, device)
    if why is not None:
        raise error if error is not None else exc(why)
    ranks = [r for r, g in enumerate(gathered) if g[-1]]
    if ranks:
        raise exc(refused.format(ranks=ranks))
    return [g[:-1] for g in gathered]


class _Gather(torch.autograd.Function):
    """All-gather of equal-shaped shards [*] → [world, *]; the backward sums every rank's gradient
    of the gathered tensor (one all-reduce) and returns this rank's slice: one collective each way."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group, world: int, rank: int):
        import torch.distributed as dist
        shard = shard.contiguous()
        out = shard.new_empty((world, *shard.shape))
        dist.all_gather(list(out.unbind(0)), shard, group=group)
        ctx.group, ctx.rank = group, rank
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


class _AllReduce(torch.autograd.Function):
    """Sum of every rank's ``t`` (a new tensor); the backward sums every rank's gradient of it the same
    way (each rank's sum reaches every rank's result): one collective each way."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group):
        import torch.distributed as dist
        out = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``t`` summed: in place where no gradient is wanted, else as a new tensor whose
    gradient is summed across the ranks too (``torch.distributed.all_reduce`` has no backward)."""
    if torch.is_grad_enabled() and t.requires_grad:
        return _AllReduce.apply(t, group)
    import torch.distributed as dist
    dist.all_reduce(t, group=group)
    return t


# What ``overlap=None`` means. Off: on 4 H200s (VGGT's aggregator, 400 frames) the transfers beside
# the kernels took the sharded aggregator from 2.09× to 1.84× one GPU on 2 ranks and from 4.09× to
# 3.16× on 4 (benchmarks/distributed.py --overlap on,off); a transfer is milliseconds, a step's
# kernel seconds.
OVERLAP = False


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, scale: Optional[float] = None,
              causal: bool = False, precision: str = "auto", backend: str = "auto",
              lengths: Optional[Sequence[int]] = None, overlap: Optional[bool] = None) -> torch.Tensor:
    """This rank's rows of attention over the whole sharded sequence.

    Args:
        q: [B, H, n_q, D], this rank's queries; k, v: [B, H, n_k, D], its keys and values. With
            ``causal`` the shards hold the same tokens (n_q == n_k on every rank). B, H, D, dtype
            and device agree across ranks.
        group: the process group (None: the default one); shards are in its rank order.
        scale, causal, precision, backend: as :func:`elsa_vision.attention` (no bias).
        lengths: every rank's number of keys, in rank order, when the caller knows them (the VGGT
            adapter does, once per aggregator call): skips the all-gather of the shards' shapes
            (a collective and a wait for its result on the host) of every call. The caller vouches
            that the ranks agree on B, H, D and dtype; this rank's entry is checked.
        overlap: run each ring step's transfer beside the previous step's kernel (None:
            :data:`OVERLAP`, off).

    Returns:
        [B, H, n_q, D]. Differentiable in q, k and v; every rank of the group must run the
        backward (the ring's exchanges are collectives), as with DistributedDataParallel.
    """
    dist = _dist()
    bad, error = _shard_problem(q, k, v, causal), None
    if bad is None:
        try:
            q, k, v, _ = autocast(q, k, v, None)  # (as the single-process call casts; the ring's steps then agree)
            if not (q.dtype == k.dtype == v.dtype) or q.device != k.device or k.device != v.device:
                bad = (f"distributed.attention: q, k, v must share one dtype and device, got {q.dtype}, {k.dtype}, "
                       f"{v.dtype} on {q.device}, {k.device}, {v.device}")
            else:
                _check_ring_backend(q, scale, precision, backend)
        except (ValueError, TypeError) as e:  # (NotSupportedError is a ValueError): raised after the gather
            bad, error = str(e), e
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    grads = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    if lengths is None:
        # every shard's length, and a check that the ranks agree on the rest of the shape, on the
        # dtype (ranks of different dtypes would take different paths, or send shards of other
        # sizes) and on wanting gradients (the backward's exchanges are collectives); a rank whose
        # own shards are wrong says so here, so that every rank raises instead of its peers waiting
        # in the ring for it
        B, H, n, D = k.shape if bad is None else (0, 0, 0, 0)
        device = k.device if isinstance(k, torch.Tensor) else torch.device("cpu")
        metas = agree([n, B, H, D, _dtype_code(k.dtype) if bad is None else 0, grads], bad, group, device,
                      "distributed.attention: rank(s) {ranks} of the group refused their shards (their error says "
                      "why); this rank stops with them", error)
        if any(m[1:5] != metas[0][1:5] for m in metas):
            seen = [(*m[1:4], str(FLOATS[m[4]]) if m[4] < len(FLOATS) else "other") for m in metas]
            raise ValueError(f"distributed.attention: the ranks' k/v shards differ in [B, H, ·, D] or dtype: {seen}; "
                             "give every rank's shards the same batch, heads, head dim and dtype")
        if any(m[5] != metas[0][5] for m in metas):
            raise ValueError(f"distributed.attention: gradients are wanted on ranks "
                             f"{[r for r, m in enumerate(metas) if m[5]]} only; every rank must run the same "
                             "(forward and backward are collectives): all with gradients, or all without")
        lengths = [m[0] for m in metas]
    else:  # (the caller vouches that the ranks agree: no collective here to tell the others)
        if bad is not None:
            raise error if error is not None else ValueError(bad)
        lengths = [int(n) for n in lengths]
        if len(lengths) != world or lengths[rank] != k.shape[2] or min(lengths) < 0:
            raise ValueError(f"distributed.attention: lengths must give every rank's key count ({world} ranks), this "
                             f"rank's ({rank}) being k.shape[2] = {k.shape[2]}; got {lengths}")
    overlap = OVERLAP if overlap is None else bool(overlap)
    longest = max(lengths)
    kw = dict(scale=scale, precision=precision, backend=backend)
    ring = q.dtype != torch.float64
    if ring and not grads:
        return _ring(q, k, v, group, world, rank, lengths, causal, kw, overlap)[0]
    bwd = _backward_entry(q, scale, causal, precision, backend) if ring else None
    if bwd is not None:
        return _Ring.apply(q, k, v, group, world, rank, lengths, causal, kw, bwd, overlap)

    # k and v travel in one collective: two would each add a collective to the backward, and the
    # autograd engine may run independent branches in another order on another rank (gloo would
    # then pair one rank's dK with another's dV)
    kv = torch.stack((k, v))
    if kv.shape[3] < longest:
        kv = torch.nn.functional.pad(kv, (0, 0, 0, longest - kv.shape[3]))
    parts = _Gather.apply(kv, group, world, rank)
    seen = range(rank + 1) if causal else range(world)
    keys = torch.cat([parts[i][:, :, :, :lengths[i]] for i in seen], dim=3)
    return _attention(q, keys[0], keys[1], causal=causal, **kw)


def _shard_problem(q, k, v, causal: bool) -> Optional[str]:
    """What is wrong with the shapes of this rank's own q, k, v shards (None: nothing)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return f"distributed.attention: q, k, v must be tensors, got {[type(t).__name__ for t in (q, k, v)]}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return (f"distributed.attention: q, k, v must be [B, H, N, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        return (f"distributed.attention: q [B, H, n_q, D] and k, v [B, H, n_k, D] must agree, got {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[2] != k.shape[2]:
        return (f"distributed.attention: causal attention needs each rank's query and key shards to be the same "
                f"tokens (n_q == n_k), got {q.shape[2]} and {k.shape[2]}")
    return None


def _dtype_code(dtype: torch.dtype) -> int:
    """dtype's index in FLOATS (what the ranks compare), len(FLOATS) for any other dtype (which the
    attention call then refuses with its own message)."""
    return FLOATS.index(dtype) if dtype in FLOATS else len(FLOATS)


def _problem(q, scale, precision: str, causal: bool, same_lengths: bool) -> tuple[Problem, float, str]:
    """(the dispatch Problem of one step of the sharded call, the checked scale, the precision)."""
    D = q.shape[-1]
    sc = check_scale(scale, D, "distributed.attention")
    prec = resolve_precision(precision, q.dtype)
    return (Problem(op="attention", device=q.device.type, dtype=q.dtype, head_dim=D, causal=causal, has_bias=False,
                    precision=prec, positive_scale=sc > 0, same_lengths=same_lengths, keys=0), sc, prec)


def _check_ring_backend(q, scale, precision: str, backend: str) -> None:
    """A named backend must run what the sharded call runs besides the causal diagonal: this rank's
    queries against another rank's keys (not causal, n_q ≠ n_k). Raised alike on every rank (the
    ranks agree on dtype, D and the options), before any collective."""
    if backend == "auto" or q.dtype not in FLOATS:
        return
    try:
        select(_problem(q, scale, precision, causal=False, same_lengths=False)[0], backend)
    except NotSupportedError as e:
        raise NotSupportedError(f"distributed.attention: backend={backend!r} cannot run the sharded call's steps "
                                f"(a rank's queries against another rank's keys: not causal, n_q ≠ n_k): {e}; "
                                "use backend='auto'") from None


def _backward_entry(q, scale, causal: bool, precision: str, backend: str):
    """(q, k, v, out, lse, do) → (dq, dk, dv) of the backend the forward's steps run on, or None when
    it has no backward entry point (the all-gather path then)."""
    p, sc, prec = _problem(q, scale, precision, causal, same_lengths=True)
    run = select(p, backend).run.get("attention_backward")
    if run is None:
        return None
    return lambda q, k, v, out, lse, do, causal: run(q, k, v, out, lse, do, sc, causal, prec)


class _Ring(torch.autograd.Function):
    """The ring forward (see _ring) with the ring backward: the shards travel again, each with the
    float32 sums of its key/value gradients, which end at their owners."""

    @staticmethod
    def forward(ctx, q, k, v, group, world: int, rank: int, lengths: list, causal: bool, kw: dict, bwd, overlap):
        out, lse = _ring(q, k, v, group, world, rank, lengths, causal, kw, overlap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, world, rank, lengths, causal, bwd)
        return out

    @staticmethod
    def backward(ctx, do):
        import torch.distributed as dist
        q, k, v, out, lse = ctx.saved_tensors
        group, world, rank, lengths, causal, bwd = ctx.args
        do = do.contiguous()
        longest = max(lengths)
        kv = _padded(torch.stack((k, v)), longest)
        acc = torch.zeros((2, *kv.shape[1:]), dtype=torch.float32, device=kv.device)  # dK, dV of kv's shard
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        nxt, prev = _peers(group, world, rank)
        pending = None  # the accumulators' exchange of the previous step, waited before adding to them
        for step in range(world):
            src = (rank - step) % world
            reqs = None
            if step < world - 1:  # the next shard's keys and values travel during this step's kernels
                incoming = torch.empty_like(kv)
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt, group),
                                               dist.P2POp(dist.irecv, incoming, prev, group)])
            n = lengths[src]
            terms = None
            if n and (not causal or src <= rank):
                terms = bwd(q, kv[0, :, :, :n], kv[1, :, :, :n], out, lse, do, causal and src == rank)
                dq += terms[0]
            if pending is not None:
                _wait(pending[0])
                acc = pending[1]
            if terms is not None:
                acc[0, :, :, :n] += terms[1]
                acc[1, :, :, :n] += terms[2]
            if world == 1:
                break
            # the accumulators follow their shard one hop; after the last step they reach the owner
            arriving = torch.empty_like(acc)
            pending = (dist.batch_isend_irecv([dist.P2POp(dist.isend, acc, nxt, group),
                                               dist.P2POp(dist.irecv, arriving, prev, group)]), arriving)
            if reqs is not None:
                _wait(reqs)
                kv = incoming
        if pending is not None:
            _wait(pending[0])
            acc = pending[1]
        own = acc[:, :, :, :lengths[rank]]
        return (dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)) + (None,) * 8


def _padded(kv, longest: int):
    """[2, B, H, n, D] padded with zero rows to ``longest``: every shard travels in one buffer shape."""
    return kv if kv.shape[3] == longest else torch.nn.functional.pad(kv, (0, 0, 0, longest - kv.shape[3]))


def _peers(group, world: int, rank: int):
    """Global ranks of the next and the previous rank of ``group``'s ring."""
    import torch.distributed as dist
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return peer((rank + 1) % world), peer((rank - 1) % world)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """[B, H, n, D] → the contiguous token-major [B, n, H, D] form it travels in (itself, no copy,
    when ``t`` is a transposed view of such a buffer): sender and receiver agree on the layout
    whatever their tensors' strides."""
    w = t.transpose(1, 2)
    return w if w.is_contiguous() else w.contiguous()


# Heads per pass of the ring: heads attend independently, so the ring goes round once per group of
# this many heads, and the shard arriving, the steps' outputs and their merge hold that group's
# heads only (VGGT's 16 heads: a quarter of a shard's keys and values in flight, not all of them).
RING_HEADS = 4


def _ring(q, k, v, group, world: int, rank: int, lengths: list, causal: bool, kw: dict, overlap: bool = False):
    """This rank's rows and their natural-log lse (float32; −inf for a row that sees no key), the
    key/value shards passed around the ring, one pass per RING_HEADS heads (see the module docstring)."""
    B, H, Nq, D = q.shape
    if H <= RING_HEADS or world == 1:  # (one rank: nothing in flight to bound)
        return _ring_pass(q, k, v, group, world, rank, lengths, causal, kw, overlap)
    out = torch.empty((B, Nq, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)  # as attention's
    lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    for h in range(0, H, RING_HEADS):
        hs = slice(h, h + RING_HEADS)
        out[:, hs], lse[:, hs] = _ring_pass(q[:, hs], k[:, hs], v[:, hs], group, world, rank, lengths, causal, kw,
                                            overlap)
    return out, lse


def _ring_pass(q, k, v, group, world: int, rank: int, lengths: list, causal: bool, kw: dict, overlap: bool):
    """One pass of the ring for the heads of q, k, v [B, h, n, D]: (rows, lse)."""
    import torch.distributed as dist
    nxt, prev = _peers(group, world, rank)
    order = [(rank - step) % world for step in range(world)]  # whose shard each step attends
    attended = [s for s in order if lengths[s] and (not causal or s <= rank)]
    B, H, _, D = k.shape
    acc = lse = None
    cur = (k, v)
    for step in range(world):
        src = order[step]  # whose shard ``cur`` is
        reqs = incoming = None
        if step < world - 1:
            n_in = lengths[(src - 1) % world]  # the previous rank sends the shard it holds now
            incoming = tuple(k.new_empty((B, n_in, H, D)) for _ in range(2))
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, _wire(cur[0]), nxt, group),
                                           dist.P2POp(dist.isend, _wire(cur[1]), nxt, group),
                                           dist.P2POp(dist.irecv, incoming[0], prev, group),
                                           dist.P2POp(dist.irecv, incoming[1], prev, group)])
            if not overlap:
                _wait(reqs)
                reqs = ()  # (done: a second wait on a gloo request does not return)
        if src in attended:
            o, l = _attention(q, cur[0], cur[1], causal=causal and src == rank, return_lse=True, **kw)
            l = torch.where(l == float("inf"), float("-inf"), l)  # a row that sees no key carries no mass
            acc, lse = _combine(acc, lse, o, l, last=src == attended[-1])
            del o
        if reqs is not None:
            _wait(reqs)
            cur = tuple(t.transpose(1, 2) for t in incoming)
    if acc is None:  # no key seen by any row (causal, all earlier shards empty); the shards were relayed
        return torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), device=q.device)
    return acc, lse


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


# heads per step of the last combine, which writes the output dtype: its float32 temporaries are
# this many heads of the rows, not all of them
_COMBINE_HEADS = 2


def _combine(acc, lse, o, l, last: bool = False):
    """The monoid's combine of two normalised partial results (acc, lse) ∘ (o, l); None is the identity.

    The first term is kept as the kernel returned it. A middle combine accumulates in float32, in
    place (out-of-place products would hold four float32 copies of a sharded call's rows at once);
    the ``last`` one writes the result in ``o``'s dtype, ``_COMBINE_HEADS`` heads at a time."""
    if acc is None:
        return o, l
    new = torch.logaddexp(lse, l)
    seen = torch.isfinite(new)
    w_acc = torch.where(seen, torch.exp(lse - new), 0.0)[..., None]
    w_o = torch.where(seen, torch.exp(l - new), 0.0)[..., None]
    if not last:
        acc = acc if acc.dtype == torch.float32 else acc.float()
        return acc.mul_(w_acc).addcmul_(o, w_o), new
    out = torch.empty_like(o)
    for h in range(0, o.shape[1], _COMBINE_HEADS):
        hs = slice(h, h + _COMBINE_HEADS)
        part = acc[:, hs].float().mul_(w_acc[:, hs])
        out[:, hs] = part.addcmul_(o[:, hs], w_o[:, hs])
    return out, new
