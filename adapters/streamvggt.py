"""StreamVGGT on ELSA (https://github.com/wzzheng/StreamVGGT): VGGT with causal attention over frames
and a key/value cache of past frames, for online reconstruction.

    import elsa_vision
    from streamvggt.models.streamvggt import StreamVGGT

    model = StreamVGGT().cuda().eval()
    elsa_vision.patch(model)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        out = model.inference(frames)        # streaming: one frame at a time against the cache
        out = model(frames)                  # batch: every frame at once, causal over frames
    elsa_vision.unpatch(model)               # bitwise back to the original

What gets patched (matched by class object):

* ``streamvggt.layers.attention.Attention``, whose forward is vggt's plus
  ``(attn_mask=None, past_key_values=None, use_cache=False)``:

  - without a cache or mask: vggt's ELSA forward (adapters/vggt/attention.py);
  - ``attn_mask`` :class:`FrameCausal` (what the patched aggregator passes in batch mode): the
    tokens of frame f attend to the keys of frames 0..f, one ELSA call per frame against a prefix
    of the keys (views: nothing N×N is formed, and the total work is the causal triangle's);
  - ``attn_mask`` a tensor (the camera head's frame mask in batch mode): an additive / keep-mask
    bias, exactly as SDPA reads it;
  - ``use_cache=True``: the streaming step. The new frame's q, k, v are formed (q/k norm and RoPE
    fused, as in vggt's forward), k and v are appended to a :class:`KVCache`, and the frame's
    queries attend to the whole cache in one ELSA call (the split path: few queries, many keys).
    The original keeps the *pre-norm* keys and concatenates the whole cache every frame, then
    normalises and rotates all of it again; the cache here holds the keys after q/k norm and RoPE
    in the dtype attention runs in (what SDPA reads), grown in place. RoPE positions are the same
    for every frame, so the cached keys are the values the original recomputes.

* ``streamvggt.layers.attention.MemEffAttention`` (the DINOv2 patch embed): as vggt's.
* ``streamvggt.models.aggregator.Aggregator._process_global_attention``: in batch mode the original
  builds an [S·P, S·P] additive mask (40 GB at 100 frames of 1041 tokens, float32); the patched
  method passes :class:`FrameCausal` instead. Streaming calls run the original method.

Patch options: ``precision`` and ``backend`` (as for VGGT); ``kv_reserve`` (entries each new cache
allocates up front, default 32 — an entry is one call's tokens: a frame in the aggregator, one
camera token per refinement iteration in the camera head). A cache grows by an eighth of its size
(at least 8 entries) when full, one layer at a time, so the cache holds at most an eighth more than
its entries and each entry is copied O(1) times on average.

A streaming call with gradients enabled runs the original forward (its cache is the original's
tuple, which autograd can follow); a :class:`KVCache` given to a call with gradients raises, as does
one given to a call the original forward would have to serve (hooks on ``attn_drop``, attention
dropout in training, a mask with the cache): the original cannot read it.
``lean_memory``, ``token_merging`` and ``process_group`` are VGGT options: patching a StreamVGGT
module with them raises.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..api import attention
from ..dispatch import autocast_dtype
from .registry import Adapter, PatchState, adapter_of, check_count, is_patched, register, register_extra, state_of
from .vggt.attention import VGGTAttentionAdapter, elsa_attention, project_out, project_qkv, unsupported
from .vggt.common import Kind, attention_kind


ATTENTION_TARGETS = ("streamvggt.layers.attention:Attention", "streamvggt.layers.attention:MemEffAttention")


AGGREGATOR_TARGETS = ("streamvggt.models.aggregator:Aggregator",)


EXTRA: dict[str, list[type]] = {"attention": [], "aggregator": []}


def register_classes(*, attention: Sequence[type] = (), aggregator: Sequence[type] = ()) -> Callable[[], None]:
    """Serve classes that carry StreamVGGT's code outside the ``streamvggt`` package (a vendored
    copy, a test stand-in) as if they were its own. Returns a function that removes them again.

    attention: classes with StreamVGGT's ``Attention`` forward ``(x, pos=None, attn_mask=None,
        past_key_values=None, use_cache=False)`` and vggt's attribute names, or vggt's
        ``MemEffAttention`` forward ``(x, attn_bias=None, pos=None)``.
    aggregator: classes with StreamVGGT's ``Aggregator._process_global_attention(tokens, B, S, P, C,
        global_idx, pos=None, past_key_values_block=None, use_cache=False, past_frame_idx=0)`` and its
        ``global_blocks`` / ``aa_block_size``.
    """
    def validate(key, cls):
        if key == "attention":
            attention_kind(cls)  # validates the forward signature now

    return register_extra(EXTRA, (("attention", attention), ("aggregator", aggregator)), validate)


@dataclass(frozen=True)
class FrameCausal:
    """The attention mask of StreamVGGT's global blocks in batch mode, by its structure: tokens come
    in frames of ``frame_len``, and a token of frame f sees the keys of frames 0..f."""
    frame_len: int


def frame_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame_len: int, **kw) -> torch.Tensor:
    """softmax(q kᵀ·scale + M) v for q, k, v [B, H, N, D] with M the frame-causal mask (0 where the
    key's frame ≤ the query's, −inf elsewhere): one ``elsa_vision.attention`` call per frame, its
    queries against the prefix of keys it sees (views). ``kw`` goes to each call."""
    N = q.shape[2]
    if k.shape[2] != N:
        raise ValueError(f"frame-causal attention: queries and keys must be the same tokens, got {N} and {k.shape[2]}")
    outs = [attention(q[:, :, f0:f0 + frame_len], k[:, :, :f0 + frame_len], v[:, :, :f0 + frame_len], **kw)
            for f0 in range(0, N, frame_len)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class KVCache:
    """The keys and values one attention module has seen, grown in place: [B, H, capacity, D]
    buffers of which the first ``tokens`` are filled, in entries of ``entry_len`` tokens (one call's
    tokens). Keys are stored after q/k norm and RoPE, in the dtype attention runs in.

    Indexing gives the original's cache layout as views: ``cache[0]`` the keys and ``cache[1]`` the
    values as [B, H, entries, entry_len, D] (what StreamVGGT's aggregator reads to count frames);
    ``k, v = cache`` unpacks them. They are not the original's pre-norm keys: hand a KVCache only
    to patched modules."""

    def __init__(self, reserve: int = 32):
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 1:
            raise ValueError(f"KVCache: reserve must be a positive int (entries), got {reserve!r}")
        self.reserve = reserve
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.entry_len = 0
        self.tokens = 0

    @property
    def entries(self) -> int:
        return self.tokens // self.entry_len if self.entry_len else 0

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold before they grow."""
        return 0 if self.k is None else self.k.shape[2]

    def keys(self) -> torch.Tensor:
        """[B, H, tokens, D] (a view)."""
        return self.k[:, :, :self.tokens]

    def values(self) -> torch.Tensor:
        return self.v[:, :, :self.tokens]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one entry: k, v [B, H, n, D] (converted to the cache's dtype: the first entry's)."""
        B, H, n, D = k.shape
        if v.shape != k.shape:
            raise ValueError(f"KVCache.append: keys {tuple(k.shape)} and values {tuple(v.shape)} differ")
        if self.k is None:
            self.entry_len = n
            self.k = k.new_empty((B, H, self.reserve * n, D))
            self.v = v.new_empty((B, H, self.reserve * n, D), dtype=k.dtype)
        else:
            have = (self.k.shape[0], self.k.shape[1], self.entry_len, self.k.shape[3])
            if (B, H, n, D) != have:
                raise ValueError(f"KVCache.append: an entry of [B, H, tokens, D] = {[B, H, n, D]} into a cache of "
                                 f"{list(have)} (each call must bring the same batch, heads and tokens; start a new "
                                 "cache for a new stream)")
            if k.device != self.k.device:
                raise ValueError(f"KVCache.append: this cache is on {self.k.device} and this call's keys on "
                                 f"{k.device}: stream on one device (or start a new cache)")
            if k.dtype != self.k.dtype:
                raise ValueError(f"KVCache.append: this cache holds {self.k.dtype} keys from earlier calls and this "
                                 f"call's attention runs in {k.dtype}: stream every frame under the same autocast "
                                 "setting (or start a new cache)")
        if self.tokens + n > self.capacity:
            entries = self.capacity // n
            self._grow(max(entries + 1, entries + max(entries // 8, 8)) * n)
        self.k[:, :, self.tokens:self.tokens + n] = k
        self.v[:, :, self.tokens:self.tokens + n] = v
        self.tokens += n

    def _grow(self, capacity: int) -> None:
        # one buffer at a time: the transient is one old buffer beside its copy
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], capacity, old.shape[3]))
            new[:, :, :self.tokens] = old[:, :, :self.tokens]
            setattr(self, name, new)
            del old

    def _entries_view(self, t: torch.Tensor) -> torch.Tensor:
        B, H, _, D = t.shape
        return t[:, :, :self.tokens].view(B, H, self.entries, self.entry_len, D)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in (0, 1, -1, -2):
            raise IndexError(f"KVCache index {i}: 0 (keys) or 1 (values)")
        if self.k is None:
            raise IndexError("KVCache: empty (no entry appended yet): it has no keys or values to index")
        return self._entries_view(self.k if i in (0, -2) else self.v)

    def __len__(self) -> int:
        return 2

    def __iter__(self):
        return iter((self[0], self[1]))

    def __repr__(self) -> str:
        shape = None if self.k is None else (*self.k.shape[:2], self.tokens, self.k.shape[3])
        return f"KVCache(entries={self.entries}, entry_len={self.entry_len}, [B, H, tokens, D]={shape}, " \
               f"capacity={self.capacity}, dtype={None if self.k is None else self.k.dtype})"


class _StreamAdapter(Adapter):
    """What the StreamVGGT adapters share: their classes are StreamVGGT's (``targets``) and those
    registered under ``extra`` with :func:`register_classes`; the options they read."""

    options = frozenset({"kv_reserve"})
    anchors = frozenset({"kv_reserve"})  # (on a model without StreamVGGT's modules it would do nothing)
    extra: str = ""

    def classes(self) -> tuple[type, ...]:
        return tuple(dict.fromkeys([*Adapter.classes(self), *EXTRA[self.extra]]))

    def check_options(self, options: dict) -> None:
        check_count(options, "kv_reserve", "entries")

    def skip_reason(self, module, options):
        for name in ("lean_memory", "token_merging", "process_group"):
            if options.get(name) not in (None, False):
                raise ValueError(f"{name} is a VGGT option; patch StreamVGGT without it (its streaming path keeps "
                                 "only the key/value cache; frames across ranks are not built for it)")
        return super().skip_reason(module, options)  # (the attention adapter's: a backend that cannot run it)


_SIGNATURES: dict[type, inspect.Signature] = {}


def _stream_signature(cls: type) -> Optional[inspect.Signature]:
    """StreamVGGT's attention forward signature when ``cls`` has it (None for MemEffAttention's)."""
    if cls not in _SIGNATURES:
        sig = inspect.signature(cls.forward)
        _SIGNATURES[cls] = sig if "use_cache" in sig.parameters else None
    return _SIGNATURES[cls]


def _needs_grad(module, x) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))


def _scale(module) -> Optional[float]:
    # SDPA's default scale is 1/sqrt(head_dim); the unfused path multiplies by module.scale
    return None if module.fused_attn else float(module.scale)


class StreamAttentionAdapter(_StreamAdapter, VGGTAttentionAdapter):
    """ELSA forward for StreamVGGT's ``Attention`` (batch, frame-causal and streaming calls) and
    ``MemEffAttention`` (as vggt's)."""

    name = "streamvggt"
    targets = ATTENTION_TARGETS
    extra = "attention"

    def forward(self, module, state: PatchState, *args, **kwargs):
        sig = _stream_signature(type(module))
        if sig is None:  # MemEffAttention: vggt's forward
            return super().forward(module, state, *args, **kwargs)
        try:
            bound = sig.bind(module, *args, **kwargs)
        except TypeError:
            if any(isinstance(t, KVCache) for t in (*args, *kwargs.values())):
                raise TypeError(f"StreamVGGT attention: arguments its forward{sig} does not take, with a KVCache "
                                "(which only the patched forward reads)") from None
            return state.delegate(*args, reason="arguments the original forward does not take", **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        x, pos, mask, past, use_cache = a["x"], a["pos"], a["attn_mask"], a["past_key_values"], a["use_cache"]
        why = unsupported(module, Kind(sig, memeff=False, fork=False), x, pos, None, None)
        if why is None and use_cache:
            if past is not None and not isinstance(past, KVCache):
                why = "a cache of the original forward's (past_key_values tuple)"
            elif mask is not None:
                why = "attn_mask with a cache"
            elif _needs_grad(module, x):
                if past is not None:
                    raise RuntimeError("StreamVGGT attention: a KVCache reached a call with gradients enabled; the "
                                       "patched streaming path runs without them: wrap the stream in torch.no_grad() "
                                       "(training runs the batch path)")
                why = "streaming with gradients enabled"
        if why is None:
            if use_cache:
                return self._stream(module, state, x, pos, past)
            if mask is None:
                y = elsa_attention(module, state, x, pos, attention_kind(type(module)))
            else:
                y = self._masked(module, state, x, pos, mask)
            if y is not None:
                return y
            why = "q, k, v of different dtypes outside autocast"
        if isinstance(past, KVCache):
            # the original would read the cache's normed, rotated keys as raw ones and normalise them again
            raise RuntimeError(f"StreamVGGT attention: this call needs the original forward ({why}), which cannot "
                               "read a KVCache; start a new stream for it (past_key_values None)")
        if isinstance(mask, FrameCausal):  # (the original forward needs the mask itself)
            L = x.shape[1]
            frame = torch.arange(L, device=x.device) // mask.frame_len
            a["attn_mask"] = (frame[:, None] < frame[None, :]).to(x.dtype) * torch.finfo(x.dtype).min
            args, kwargs = (), {k: a[k] for k in list(sig.parameters)[1:]}
        return state.delegate(*args, reason=why, **kwargs)

    @staticmethod
    def _masked(module, state: PatchState, x, pos, mask) -> Optional[torch.Tensor]:
        opts = state.options
        q, k, v = project_qkv(module, x, pos, None, backend=opts.get("backend", "auto"))
        if autocast_dtype(x.device.type) is None and not (q.dtype == k.dtype == v.dtype):
            return None
        kw = dict(scale=_scale(module), precision=opts.get("precision", "auto"), backend=opts.get("backend", "auto"))
        if isinstance(mask, FrameCausal):
            out = frame_causal_attention(q, k, v, mask.frame_len, **kw)
        else:
            if not module.fused_attn and not mask.is_floating_point():
                mask = mask.float()  # (the unfused path adds a bool or integer mask as numbers: True = +1)
            out = attention(q, k, v, bias=mask, **kw)
        return module.proj_drop(project_out(module, out, None))

    @staticmethod
    def _stream(module, state: PatchState, x, pos, past: Optional[KVCache]):
        opts = state.options
        q, k, v = project_qkv(module, x, pos, None, backend=opts.get("backend", "auto"))
        dtype = autocast_dtype(x.device.type) or q.dtype  # what attention runs in (SDPA casts to it)
        if past is None:
            past = KVCache(opts.get("kv_reserve", 32))
        past.append(k.to(dtype), v.to(dtype))
        out = attention(q.to(dtype), past.keys(), past.values(), scale=_scale(module),
                        precision=opts.get("precision", "auto"), backend=opts.get("backend", "auto"))
        return module.proj_drop(project_out(module, out, None)), past


def _served(block) -> bool:
    attn = getattr(block, "attn", None)
    return attn is not None and is_patched(attn) and isinstance(adapter_of(state_of(attn)), StreamAttentionAdapter)


class StreamAggregatorAdapter(_StreamAdapter):
    """StreamVGGT's ``Aggregator._process_global_attention`` in batch mode: the global blocks get
    :class:`FrameCausal` instead of a dense [S·P, S·P] mask."""

    name = "streamvggt-aggregator"
    targets = AGGREGATOR_TARGETS
    method = "_process_global_attention"
    extra = "aggregator"

    def forward(self, agg, state: PatchState, tokens, B, S, P, C, global_idx, pos=None, past_key_values_block=None,
                use_cache=False, past_frame_idx=0):
        blocks = [agg.global_blocks[global_idx + i] for i in range(agg.aa_block_size)]
        if use_cache:  # the attention modules serve streaming calls themselves
            return state.original(tokens, B, S, P, C, global_idx, pos=pos, past_key_values_block=past_key_values_block,
                                  use_cache=True, past_frame_idx=past_frame_idx)
        if not all(_served(b) for b in blocks):
            return state.delegate(tokens, B, S, P, C, global_idx, pos=pos, reason="global attention not patched")
        # the original's batch-mode body with the mask given by its structure
        if tokens.shape != (B, S * P, C):
            tokens = tokens.reshape(B, S, P, C).reshape(B, S * P, C)
        if pos is not None and pos.shape != (B, S * P, 2):
            pos = pos.reshape(B, S, P, 2).reshape(B, S * P, 2)
        intermediates = []
        for block in blocks:
            tokens = block(tokens, pos=pos, attn_mask=FrameCausal(P))
            global_idx += 1
            intermediates.append(tokens.reshape(B, S, P, C))
        return tokens, global_idx, intermediates


for _adapter in (StreamAttentionAdapter(), StreamAggregatorAdapter()):
    register(_adapter)
