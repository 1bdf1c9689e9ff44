"""Attention over tokens sharded across processes (torch.distributed): every rank's queries attend to
the keys of all ranks (causal: of the ranks up to its own), exactly as one process would.

Each rank holds a contiguous shard of the sequence — rank 0 the first tokens, rank r the r-th
slice; shards may differ in length. The key/value shards are all-gathered in one collective, and
in the backward every rank's key/value gradients are summed (one all-reduce) and each rank keeps
its own shard's; each
rank runs one ELSA call of its queries against the keys it sees. Causal attention needs no mask
of its own: a rank's queries are the last rows of the keys it sees, and ELSA's bottom-right
causal alignment (query i sees key j ≤ i + Nk − Nq) is then exactly the global causal rule.

Two schedules, the same result:

* without gradients (inference), float32 and half precision: a ring. The key/value shards travel around the ranks, one step
  per shard; while shard s is attended, shard s+1 is already on its way (batched isend/irecv, which
  NCCL runs beside the compute). Each step's ELSA call returns its rows' output and log-sum-exp,
  and the steps merge with the monoid's combine, (o₁, l₁) ∘ (o₂, l₂) = (o₁·e^{l₁−l} + o₂·e^{l₂−l}, l)
  with l = log(e^{l₁} + e^{l₂}), in float32. A rank holds its own shard, the one being attended and
  the one arriving: O(N / ranks) keys. In half precision each step's output is rounded to the
  inputs' dtype once before the float32 merge.
* with gradients (or float64): one all-gather of every shard (O(N) keys per rank) and one ELSA call, whose
  backward returns every rank's key/value gradients in one all-reduce.
"""
from __future__ import annotations

from typing import Optional

import torch

from .api import attention as _attention


def _dist():
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("elsa_vision.distributed.attention needs an initialised default process group "
                           "(torch.distributed.init_process_group), or a group passed as group=")
    return dist


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, scale: Optional[float] = None,
              causal: bool = False, precision: str = "auto", backend: str = "auto") -> torch.Tensor:
    """This rank's rows of attention over the whole sharded sequence.

    Args:
        q: [B, H, n_q, D], this rank's queries; k, v: [B, H, n_k, D], its keys and values. With
            ``causal`` the shards hold the same tokens (n_q == n_k on every rank). B, H, D, dtype
            and device agree across ranks.
        group: the process group (None: the default one); shards are in its rank order.
        scale, causal, precision, backend: as :func:`elsa_vision.attention` (no bias).

    Returns:
        [B, H, n_q, D]. Differentiable in q, k and v; every rank of the group must run the
        backward (its all-gathers' gradients are collectives), as with DistributedDataParallel.
    """
    dist = _dist()
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"distributed.attention: q, k, v must be [B, H, N, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"distributed.attention: causal attention needs each rank's query and key shards to be the "
                         f"same tokens (n_q == n_k), got {q.shape[2]} and {k.shape[2]}")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    # every shard's length, and a check that the ranks agree on the rest of the shape
    meta = torch.tensor([k.shape[2], k.shape[0], k.shape[1], k.shape[3]], dtype=torch.int64,
                        device=k.device if k.is_cuda else "cpu")
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)
    metas = [m.tolist() for m in metas]
    if any(m[1:] != metas[0][1:] for m in metas):
        raise ValueError(f"distributed.attention: the ranks' k/v shards differ in [B, H, ·, D]: "
                         f"{[(m[1], m[2], m[3]) for m in metas]}")
    lengths = [m[0] for m in metas]
    longest = max(lengths)
    kw = dict(scale=scale, precision=precision, backend=backend)
    # (float64 keeps the all-gather: the log-sum-exp the ring merges by is float32)
    if q.dtype != torch.float64 and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return _ring(q, k, v, group, world, rank, lengths, causal, kw)

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


def _ring(q, k, v, group, world: int, rank: int, lengths: list, causal: bool, kw: dict) -> torch.Tensor:
    """This rank's rows, the key/value shards passed around the ring (see the module docstring)."""
    import torch.distributed as dist
    kv = torch.stack((k, v))
    if kv.shape[3] < max(lengths):  # every shard travels in the same buffer shape
        kv = torch.nn.functional.pad(kv, (0, 0, 0, max(lengths) - kv.shape[3]))
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    nxt, prev = peer((rank + 1) % world), peer((rank - 1) % world)
    acc = lse = None
    cur = kv
    for step in range(world):
        src = (rank - step) % world  # whose shard ``cur`` is
        reqs = None
        if step < world - 1:
            incoming = torch.empty_like(kv)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, cur, nxt, group),
                                           dist.P2POp(dist.irecv, incoming, prev, group)])
        n = lengths[src]
        if n and (not causal or src <= rank):
            o, l = _attention(q, cur[0, :, :, :n], cur[1, :, :, :n], causal=causal and src == rank,
                              return_lse=True, **kw)
            l = torch.where(l == float("inf"), float("-inf"), l)  # a row that sees no key carries no mass
            acc, lse = _combine(acc, lse, o, l)
        if reqs is not None:
            for r in reqs:
                r.wait()
            cur = incoming
    if acc is None:  # no key seen by any row (causal, all earlier shards empty)
        return torch.zeros_like(q)
    return acc.to(q.dtype)


def _combine(acc, lse, o, l):
    """The monoid's combine of two normalised partial results (acc, lse) ∘ (o, l); None is the identity.
    ``acc`` is float32 and updated in place (``o`` may be half precision): a sharded call's rows are
    the whole output, and out-of-place products would hold four float32 copies of it at once."""
    if acc is None:
        return o.float(), l
    new = torch.logaddexp(lse, l)
    seen = torch.isfinite(new)
    w_acc = torch.where(seen, torch.exp(lse - new), 0.0)
    w_o = torch.where(seen, torch.exp(l - new), 0.0)
    return acc.mul_(w_acc[..., None]).addcmul_(o, w_o[..., None]), new
