"""The attention adapter: vggt's ``Attention`` / ``MemEffAttention`` (and the FastVGGT fork's) with
SDPA replaced by ``elsa_vision.attention``; q/k norm and RoPE fused in inference (kernels/rope.py)."""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

from ...api import attention
from ...dispatch import autocast_dtype, fused_kernels, named_backend_refusal
from ...kernels.limits import HEAD_DIMS, ROPE_MIN_HEAD_DIM
from ..registry import PatchState, bypass_reason, hooked
from .common import ATTENTION_TARGETS, LEAN_CHUNK, Kind, VGGTAdapter, attention_kind, lean_option
from .merging import FORK_BLOCKS, AggregatorCall, fork_merge, merge_mean, merging_now, unmerge
from .sharded import key_lengths, sharded_group


def _fused_qk(module, x: torch.Tensor, pos, backend: str) -> Optional[Callable[[int, int], tuple]]:
    """When q/k norm and RoPE can run as one kernel (kernels/rope.py): a function of a token range
    (n0, n1) → (rows, (cos, sin)), the kernel's position operand [B, n1 − n0, 2] for those tokens
    and the RoPE tables [P, D/2] float32 whose rows it indexes ((None, None) without RoPE); None
    when they go through the modules themselves — with gradients, hooks on them, or modules other
    than LayerNorm / Identity and vggt's RoPE, or a named backend other than "triton".

    Eagerly the tables are the module's own (row p: position p; rows = the positions). Under
    torch.compile their size would be a value read from the positions, which dynamo cannot trace
    (see _rope): there the range's tokens each have their own two rows, formed in the graph (see
    _token_tables), one range at a time (lean mode's chunks: no tables of the whole sequence)."""
    if torch.is_grad_enabled() or x.dtype == torch.float64 or not fused_kernels(backend, x.device.type):
        return None  # (the kernel computes in float32)
    D = module.head_dim
    qn, kn, rope = module.q_norm, module.k_norm, module.rope
    norms = [type(m) for m in (qn, kn)]
    if not (norms == [torch.nn.Identity] * 2 or (norms == [torch.nn.LayerNorm] * 2
                                                 and qn.normalized_shape == kn.normalized_shape == (D,)
                                                 and (qn.weight is None) == (kn.weight is None)
                                                 and (qn.bias is None) == (kn.bias is None)
                                                 and all(t is None or t.stride(-1) == 1
                                                         for t in (qn.weight, qn.bias, kn.weight, kn.bias)))):
        return None  # (one launch forms q and k: their norms take the same affine parameters, read densely)
    if D < ROPE_MIN_HEAD_DIM or D & (D - 1) or any(hooked(m) for m in (qn, kn, rope)):
        return None
    if rope is None:  # norms only (nothing to fuse without them: q and k stay views of qkv)
        return None if norms[0] is torch.nn.Identity else (lambda n0, n1: (None, None))
    if (not _vggt_rope(rope) or not isinstance(pos, torch.Tensor) or pos.dim() != 3 or pos.shape[-1] != 2
            or pos.shape[:2] != x.shape[:2] or pos.is_floating_point() or pos.device != x.device):
        return None
    if torch.compiler.is_compiling():
        return lambda n0, n1: _token_tables(rope, pos[:, n0:n1], D)
    lo, hi = torch.stack(torch.aminmax(pos)).tolist()  # one device sync, as the module's own max
    if lo < 0:  # the module's embedding lookup raises on these; the kernel would read out of bounds
        return None
    tables = rope._compute_frequency_components(D // 2, hi + 1, x.device, torch.float32)
    return lambda n0, n1: (pos[:, n0:n1], tables)


def _token_tables(rope, pos: torch.Tensor, D: int) -> tuple:
    """(rows, (cos, sin)) for the fused kernel in a compiled graph: row 2·t + j of the tables
    [B·N·2, D/2] float32 holds the cos and sin of token t's position pos[t, j] (j = 0: y, 1: x),
    formed as the module forms its table's row of that position (p · inv_freq in float32, the angles
    twice), and rows [B, N, 2] indexes them. The same values as the table the module would look up,
    their cos and sin inductor's (as for _rope). The tables are 8·D bytes a token, written once and
    read once, against the 8·H·D bytes of half-precision q and k that the kernel reads and writes.
    (Positions are not checked for being ≥ 0 here, as in _rope.)"""
    angles = _angles(rope, pos, D // 2).reshape(-1, D // 2)
    rows = torch.arange(angles.shape[0], device=pos.device).view(pos.shape)
    return rows, (angles.cos(), angles.sin())


def _angles(rope, p: torch.Tensor, half: int) -> torch.Tensor:
    """The float32 angles [..., half] of integer positions p [...] for ``half`` features of one
    direction: the row of each p in the module's table before its cos and sin (p · inv_freq, twice)."""
    inv_freq = 1.0 / (rope.base_frequency ** (torch.arange(0, half, 2, device=p.device).float() / half))
    angles = p.to(inv_freq.dtype)[..., None] * inv_freq
    return torch.cat((angles, angles), dim=-1)


def _vggt_rope(rope) -> bool:
    """Whether ``rope`` is vggt's RotaryPositionEmbedding2D (or a copy of it: the FastVGGT fork's),
    without hooks: what _fused_qk and _rope may compute in its place."""
    return (type(rope).__name__ == "RotaryPositionEmbedding2D" and hasattr(rope, "_compute_frequency_components")
            and hasattr(rope, "base_frequency") and not hooked(rope))


def _rope(module, t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``module.rope(t, pos)`` for t [B, H, N, D]. Under torch.compile, for vggt's 2-D RoPE, the same
    rotation with each token's angles formed from its own position (p · inv_freq, in float32, then
    the module's casts) instead of looked up in a table of positions.max() + 1 rows: that size is a
    value read from the tensor (``.item()``), which dynamo cannot trace, so every block's graph
    would break there (vggt's aggregator then compiles block by block). The same products; their
    cos and sin are inductor's, and inductor (as for the module compiled itself) may keep the
    angles in float32 where the module rounds them to a half-precision t's dtype
    (``emulate_precision_casts``): vggt's blocks hand RoPE the float32 output of their q/k norms.
    (Positions are not checked for being ≥ 0 there: that needs a device sync; the module's table
    lookup raises on them eagerly. Float positions go to the module.)"""
    rope = module.rope
    if not torch.compiler.is_compiling() or not _vggt_rope(rope) or pos.is_floating_point():
        return rope(t, pos)
    half = t.shape[-1] // 2  # features per direction (vertical, horizontal)

    def rotate(x, p):  # x [B, H, N, half], p [B, N]: _apply_1d_rope with the table row of each p
        angles = _angles(rope, p, half).to(t.dtype)
        cos, sin = angles.cos().to(t.dtype)[:, None], angles.sin().to(t.dtype)[:, None]
        x1, x2 = x[..., :half // 2], x[..., half // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    vertical, horizontal = t.chunk(2, dim=-1)
    return torch.cat((rotate(vertical, pos[..., 0]), rotate(horizontal, pos[..., 1])), dim=-1)


def project_qkv(module, x: torch.Tensor, pos, chunk: Optional[int], prenorm=None, backend: str = "auto"):
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
    cast = autocast_dtype(x.device.type)
    fuse = _fused_qk(module, x, pos, backend)
    norms = (module.q_norm, module.k_norm) if type(module.q_norm) is torch.nn.LayerNorm else (None, None)

    def fused(part, n0, n1, bufs):  # q, k of tokens n0:n1 into bufs[0], bufs[1] ([B, N, H, D])
        from ...kernels.rope import qk_norm_rope
        qk_norm_rope(part, H, (bufs[0][:, n0:n1], bufs[1][:, n0:n1]), norms, *fuse(n0, n1))

    if chunk is None or B * N <= chunk:
        if prenorm is not None:
            x = prenorm(x)
        y = module.qkv(x)
        if fuse is not None:
            qk = [y.new_empty((B, N, H, D), dtype=cast or y.dtype) for _ in range(2)]
            fused(y, 0, N, qk)
            v = y.view(B, N, 3, H, D)[:, :, 2].transpose(1, 2)
            return qk[0].transpose(1, 2), qk[1].transpose(1, 2), v
        qkv = y.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = module.q_norm(q), module.k_norm(k)
        if module.rope is not None:
            q, k = _rope(module, q, pos), _rope(module, k, pos)
        return q, k, v
    step = max(1, chunk // B)
    bufs = None
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        xc = x[:, n0:n1] if prenorm is None else prenorm(x[:, n0:n1])
        part = module.qkv(xc)
        if bufs is None:
            bufs = [x.new_empty((B, N, H, D), dtype=cast or part.dtype) for _ in range(3)]
        if fuse is not None:
            fused(part, n0, n1, bufs)
            bufs[2][:, n0:n1] = part.view(B, n1 - n0, 3, H, D)[:, :, 2]
            continue
        part = part.reshape(B, n1 - n0, 3, H, D)
        q, k, v = part[:, :, 0], part[:, :, 1], part[:, :, 2]
        q, k = module.q_norm(q).transpose(1, 2), module.k_norm(k).transpose(1, 2)  # [B, H, n, D]
        if module.rope is not None:
            p = pos[:, n0:n1]
            q, k = _rope(module, q, p), _rope(module, k, p)
        bufs[0][:, n0:n1] = q.transpose(1, 2)
        bufs[1][:, n0:n1] = k.transpose(1, 2)
        bufs[2][:, n0:n1] = v
    return tuple(b.transpose(1, 2) for b in bufs)


def project_out(module, out: torch.Tensor, chunk: Optional[int]) -> torch.Tensor:
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


def unsupported(module, kind: "Kind", x, pos, attn_bias, merging) -> Optional[str]:
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
    if module.head_dim > HEAD_DIMS[1]:  # (the reference backend would take it, slower than SDPA)
        return f"head dim {module.head_dim} > {HEAD_DIMS[1]}, the Triton kernels' largest"
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "input is not [B, N, C]"
    if kind.fork and merging is not None and getattr(sys.modules.get(type(module).__module__), "vis_attn_map", False):
        return "FastVGGT attention-map visualisation"
    return None


def merge_call(module) -> Optional[AggregatorCall]:
    """The running aggregator call if it merges tokens in this module's block."""
    call = merging_now()
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


def elsa_attention(module, state: PatchState, x, pos, kind: "Kind", merging=None, prenorm=None):
    """The ELSA forward of one attention call (inputs already checked by ``unsupported``).

    Returns None when q, k, v come out in different dtypes outside autocast (the caller hands the
    call to the original forward, which raises as SDPA does)."""
    opts = state.options
    B, N, C = x.shape
    chunk = opts.get("lean_chunk", LEAN_CHUNK) if lean_option(opts) is not None else None
    call = None if kind.fork else merge_call(module)
    plan = unmerge_fn = side = None
    if call is not None:
        metric = x if prenorm is None else prenorm(x)
        if x.is_cuda:
            # the similarity search (a compute-bound kernel) runs on a side stream while the main
            # stream forms q, k, v (bandwidth-bound): the same operations, overlapped
            main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                plan = call.plan(metric, call.layers[id(module)])
        else:
            plan = call.plan(metric, call.layers[id(module)])
    q, k, v = project_qkv(module, x, pos, chunk, prenorm, opts.get("backend", "auto"))
    if side is not None:
        main.wait_stream(side)
        for t in plan.tensors():
            t.record_stream(main)  # made on the side stream, used (and freed) on the main one
    group = sharded_group(module, opts)
    if autocast_dtype(x.device.type) is None and not (q.dtype == k.dtype == v.dtype):
        if group is not None:
            raise RuntimeError(f"q, k, v of different dtypes ({q.dtype}, {k.dtype}, {v.dtype}) outside autocast in "
                               "attention that spans the ranks of a process group: run the model in one dtype")
        return None
    if kind.fork:
        if merging is not None and merging in FORK_BLOCKS:
            q, k, v, unmerge_fn = fork_merge(module, x, q, k, v)
    elif plan is not None:
        q, k, v = (merge_mean(t.transpose(1, 2), plan).transpose(1, 2) for t in (q, k, v))
        if plan.rows is not None:  # sharded: every rank holds the whole merged set; its tokens read these rows
            q, group = q[:, :, plan.rows], None
    # SDPA's default scale is 1/sqrt(head_dim); the unfused path multiplies by module.scale
    scale = None if kind.fork or module.fused_attn else float(module.scale)
    kw = dict(scale=scale, precision=opts.get("precision", "auto"), backend=opts.get("backend", "auto"))
    if group is not None:  # a global block or camera trunk of a sharded call: every rank's keys
        from ...distributed import attention as sharded_attention
        out = sharded_attention(q, k, v, group=group, lengths=key_lengths(group, k.shape[2]), **kw)
    else:
        out = attention(q, k, v, **kw)
    del q, k, v
    y = module.proj_drop(project_out(module, out, chunk))
    if plan is not None:
        y = unmerge(y, plan)
    elif unmerge_fn is not None:
        y = unmerge_fn(y)
    return y


class VGGTAttentionAdapter(VGGTAdapter):
    """ELSA forward for vggt's ``Attention`` / ``MemEffAttention`` (and the FastVGGT fork's)."""

    name = "vggt"
    targets = ATTENTION_TARGETS
    options = frozenset({"lean_memory", "lean_chunk"})

    extra = "attention"

    def skip_reason(self, module, options):
        tm = options.get("token_merging")
        if tm is not None and attention_kind(type(module)).fork:
            raise ValueError("token_merging=TokenMerging(...) is for upstream VGGT; the FastVGGT fork merges tokens "
                             "itself (its `merging` setting) and its merged attention is patched without it")
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int):
            return None
        return named_backend_refusal(options.get("backend", "auto"), "attention", head_dim)

    def forward(self, module, state: PatchState, *args, **kwargs):
        kind = attention_kind(type(module))
        try:
            bound = kind.signature.bind(module, *args, **kwargs)
        except TypeError:
            return state.delegate(*args, reason="arguments the original forward does not take", **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        x, pos, merging = a["x"], a.get("pos"), a.get("global_merging")
        why = unsupported(module, kind, x, pos, a.get("attn_bias"), merging)
        if why is None:
            y = elsa_attention(module, state, x, pos, kind, merging)
            if y is not None:
                return y
            why = "q, k, v of different dtypes outside autocast"
        if sharded_group(module, state.options) is not None:
            raise RuntimeError(f"this attention spans the ranks of a process group, which the original forward "
                               f"cannot: {why}")
        return state.delegate(*args, reason=why, **kwargs)
