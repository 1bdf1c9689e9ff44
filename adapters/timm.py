"""timm adapters: ViT-family self-attention and Swin v1 / v2 window attention on ELSA.

Each adapter re-states its timm module's forward (timm >= 1.0.20, checked against 1.0.31) with the
softmax-attention core replaced by :func:`elsa_vision.attention` (or
:func:`elsa_vision.window_attention` for Swin); everything around the core — projections, q/k norms,
RoPE, gates, output norms, dropouts — runs the module's own submodules and parameters, so outputs
and gradients match the original and state_dict keys do not change.

=============================================  ==============================================
module class (matched exactly)                 forward
=============================================  ==============================================
``timm.layers.attention.Attention``            ``(x, attn_mask=None, is_causal=False)``
``timm.layers.attention.AttentionRope``        ``(x, rope=None, attn_mask=None, is_causal=False)``
``timm.models.eva.EvaAttention``               ``(x, rope=None, attn_mask=None, is_causal=False)``
``timm.models.swin_transformer.WindowAttention``     ``(x, mask=None)``
``timm.models.swin_transformer_v2.WindowAttention``  ``(x, mask=None)``
``timm.models.swin_transformer.SwinTransformerBlock``     ``_attn(x)`` (not ``forward``)
``timm.models.swin_transformer_v2.SwinTransformerV2Block``  ``_attn(x)`` (not ``forward``)
=============================================  ==============================================

The Swin blocks' ``_attn`` (cyclic shift, window partition, window attention, window merge, reverse
shift) runs as one :func:`elsa_vision.shifted_window_attention` call between the attention
module's own ``qkv`` and ``proj``: the kernels read each window's tokens where they lie in the
[B, H, W, C] feature map, so the four copies of the tokens timm makes per block (two rolls, the
partition and the merge), and their gradients' copies, are never made. It serves a block whose
``attn`` is itself patched (so ``include`` / ``exclude`` on the attention modules holds) and falls
back to the block's own ``_attn`` — which then calls the patched ``attn`` — for hooks on ``attn``,
an active ``proj_drop`` (its random mask follows timm's window order) or any reason ``attn`` itself
would delegate. A feature map that the window does not tile is padded before the projection, as
timm pads it after the roll (zeros at the bottom and right, whose q, k, v are the projection's
bias), and the kernels roll the image's rows and columns (``image_size``; the equal pad tokens move
among pad positions only): the same windows, the pad and the crop the only copies. Patch option ``fuse_windows=False`` leaves the blocks alone.

Calls that are delegated to the original forward (and counted in ``module._elsa.delegated``):

* attention dropout that would be active (``attn_drop.p > 0`` and the module, or ``attn_drop``
  itself — MC dropout at eval — in training mode): ELSA never forms the attention matrix, so it
  cannot drop its entries; the original forward does it;
* forward hooks on ``attn_drop`` or ``softmax`` (e.g. attention-map extraction), which ELSA's
  forward never calls;
* ``attn_mask`` together with ``is_causal=True`` (SDPA refuses it, timm's unfused path ignores
  the mask — the original decides), and an ``attn_mask`` of integer dtype (timm's unfused path
  adds it as numbers, SDPA refuses it);
* a Swin ``mask`` that is not ``[nW, N, N]`` with ``nW`` dividing the window batch.

Swin's position bias is gathered by the kernels of ``kernels/position_bias.py`` (v1: the table
gathered in one launch, its gradient summed in one; v2: its MLP, sigmoid and gather in one launch),
which derive the index from the window size: a module whose ``relative_position_index`` is not
timm's formula is not patched (reported), unless the model is patched with
``fuse_position_bias=False`` or a named backend. The module's own gather runs instead — v2's
``cpb_mlp`` too — where a backend is named, the table or parameters are not float32 / bfloat16 /
float16 or on a device the Triton kernels do not serve, the index is not [N, N], with
``fuse_position_bias=False`` (then v2's bias is timm's to the bit: its MLP in the autocast dtype;
v1's is the table's values either way), and for v2 where its MLP has hooks or is not timm's
Linear → ReLU → Linear.

Rows that see no key at all (a boolean ``attn_mask`` row of all False) return 0, as SDPA does;
timm's unfused path (``fused_attn=False``, and Swin) returns NaN there. A Swin ``mask`` of bool or
integer dtype is added as numbers (True = +1), as timm does.

Patch options read here: ``precision`` (see :func:`elsa_vision.attention`), ``backend``
(``"auto"`` by default; naming one, e.g. ``backend="reference"``, routes every call — Swin
included — through ``elsa_vision.attention`` on that backend, or the Swin blocks through
``shifted_window_attention`` on it), ``fuse_windows`` (default True: the Swin blocks above) and
``fuse_position_bias`` (default True: Swin's position bias by the fused kernels, see above).
"""
from __future__ import annotations

import math
import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..api import attention, attention_packed, shifted_window_attention, window_attention, window_attention_packed
from ..dispatch import named_backend_refusal, triton_serves
from ..kernels.limits import HEAD_DIMS, POSITION_BIAS_DTYPES
from .blocks import PreNormBlock
from .registry import (Adapter, PatchState, adapter_of, bypass_reason, check_flag, hooked, hooked_any, is_patched,
                       module_attr, register, state_of)

MIN_TIMM = (1, 0, 20)


def _timm_version() -> Optional[tuple[int, ...]]:
    try:
        import timm
    except ImportError:
        return None
    # leading digits of each field: "1.0.20rc1" → (1, 0, 20)
    return tuple(int(re.match(r"\d*", p).group() or 0) for p in timm.__version__.split(".")[:3])


def _backend(state: PatchState) -> str:
    return state.options.get("backend", "auto")


def _old_timm() -> Optional[str]:
    """Why the installed timm is too old for these adapters (None if it is not)."""
    ver = _timm_version()
    if ver is not None and ver < MIN_TIMM:
        return f"timm {'.'.join(map(str, ver))} is older than 1.0.20; upgrade timm (pip install -U timm)"
    return None


def _check_common(head_dim: int, options: dict, has_bias: bool = False) -> Optional[str]:
    """Shared skip reasons (None if the module can be patched): an old timm, a head dim past the
    kernels', a named backend that can never run the module's attention calls (non-causal; Swin's
    with its position bias)."""
    why = _old_timm()
    if why:
        return why
    backend = options.get("backend", "auto")
    if head_dim > HEAD_DIMS[1] and backend == "auto":  # (auto would run them on the slow reference backend)
        return f"head dim {head_dim} > {HEAD_DIMS[1]}, the Triton kernels' limit (backend='reference' serves it)"
    return named_backend_refusal(backend, "attention", head_dim, has_bias=has_bias)


def _bypass_reason(module: torch.nn.Module) -> Optional[str]:
    # softmax and attn_drop: the children of timm's attention modules ELSA's forward never calls
    return bypass_reason(module, ("attn_drop", "softmax"))


def _biased_qkv(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The fused qkv projection [B, N, 3·C] of modules that keep q/k/v biases as separate tensors
    (EVA, Swin v2: ``q_bias``, zero ``k_bias`` buffer, ``v_bias``) or none at all."""
    if module_attr(module, "q_bias") is None:
        return module.qkv(x)
    bias = torch.cat((module.q_bias, module.k_bias, module.v_bias))
    if module.qkv_bias_separate:  # (EVA and Swin v2, the modules with q_bias, have it)
        qkv = module.qkv(x)
        qkv += bias
        return qkv
    return F.linear(x, weight=module.qkv.weight, bias=bias)


def _split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, N, 3·H·D] → q, k, v as strided [B, H, N, D] views (no copy: the kernels take strides)."""
    B, N, _ = qkv.shape
    return qkv.reshape(B, N, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


def _mask_reason(attn_mask, is_causal, x: torch.Tensor, heads: int) -> Optional[str]:
    """Why a ViT attention call's mask goes to the original forward (None: ELSA serves it). A mask
    that does not broadcast to [B, H, N, N] goes there too: the module's own forward then reports
    it in the module's terms (ELSA's checks would name their bias argument)."""
    if attn_mask is None:
        return None
    if is_causal:
        return "attn_mask with is_causal"
    if isinstance(attn_mask, torch.Tensor):
        if not (attn_mask.is_floating_point() or attn_mask.dtype == torch.bool):
            return "attn_mask of integer dtype"
        want = (x.shape[0], heads, x.shape[1], x.shape[1])  # (x [B, N, C])
        shape = attn_mask.shape
        if len(shape) > 4 or any(s not in (1, w) for s, w in zip(reversed(shape), reversed(want))):
            return f"attn_mask of shape {tuple(shape)}, which does not broadcast to [B, H, N, N] = {list(want)}"
    return None


def _self_attention(module, state: PatchState, q, k, v, attn_mask, is_causal, qkv=None) -> torch.Tensor:
    """The ELSA core of the ViT-family modules: q/k/v [B, H, N, D] → [B, H, N, D]; or, with q, k, v
    None, the packed projection ``qkv`` [B, N, 3, H, D] (its gradient then comes out of the kernels
    in one piece: see elsa_vision.attention_packed).

    Scale as the original: SDPA's default 1/√D on the fused path, ``module.scale`` on the
    unfused one (they differ only if someone changed ``module.scale``)."""
    scale = None if module.fused_attn else float(module.scale)
    how = dict(bias=attn_mask, scale=scale, causal=bool(is_causal), precision=state.options.get("precision", "auto"),
               backend=_backend(state))
    if qkv is not None:
        return attention_packed(qkv, **how)
    return attention(q, k, v, **how)


def _through(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """m(x). An nn.Identity, or an nn.Dropout that passes its input through (eval mode, or p = 0),
    returns x itself: where no hook (forward or backward) would see the call, that is done without nn.Module's call
    machinery (a few microseconds of host time per call, on every ViT attention call)."""
    t = type(m)
    if (t is nn.Identity or (t is nn.Dropout and (not m.training or m.p == 0))) and not hooked(m, backward=True):
        return x
    return m(x)


def _finish(module, x: torch.Tensor, gate: Optional[torch.Tensor], width: int) -> torch.Tensor:
    """[B, H, N, D] attention output → merged heads → norm → gate → proj → proj_drop: [B, N, dim_out]."""
    B, _, N, _ = x.shape
    mods = module._modules
    x = _through(mods["norm"], x.transpose(1, 2).reshape(B, N, width))
    if gate is not None:
        x = x * gate
    return _through(mods["proj_drop"], mods["proj"](x))


def _gate(module, x: torch.Tensor) -> Optional[torch.Tensor]:
    # (the module_attr defaults in this file are for attributes later timm versions added: gate, attn_dim,
    # num_kv_heads / num_kv_groups; and q_bias, which only EVA and Swin v2 have)
    g = module_attr(module, "gate")
    return g(x).sigmoid() if g is not None else None


class TimmAttention(Adapter):
    """``timm.layers.attention.Attention`` (ViT, DeiT, DINOv2, ...): qkv → q/k norm → attention
    (attn_mask: additive float or boolean keep-mask broadcastable to [B, H, N, N]; is_causal) →
    scale norm → gate → proj. Attention dropout in training delegates to the original forward."""

    name = "timm.Attention"
    targets = ("timm.layers.attention:Attention",)

    def skip_reason(self, module, options):
        return _check_common(module.head_dim, options)

    def forward(self, module, state, x, attn_mask=None, is_causal=False):
        why = _bypass_reason(module)
        if why:
            return state.delegate(x, attn_mask=attn_mask, is_causal=is_causal, reason=why)
        why = _mask_reason(attn_mask, is_causal, x, module.num_heads)
        if why:
            return state.delegate(x, attn_mask=attn_mask, is_causal=is_causal, reason=why)
        B, N, C = x.shape
        gate = _gate(module, x)
        mods = module._modules  # (not nn.Module's attribute lookup: host time on every call)
        qkv = mods["qkv"](x)
        q_norm, k_norm = mods["q_norm"], mods["k_norm"]
        if isinstance(q_norm, nn.Identity) and isinstance(k_norm, nn.Identity) and not hooked_any(
                (q_norm, k_norm), backward=True):  # (hooks see the calls)
            o = _self_attention(module, state, None, None, None, attn_mask, is_causal,
                                qkv=qkv.reshape(B, N, 3, module.num_heads, -1))
        else:
            q, k, v = _split_heads(qkv, module.num_heads)
            q, k = q_norm(q), k_norm(k)
            o = _self_attention(module, state, q, k, v, attn_mask, is_causal)
        return _finish(module, o, gate, module_attr(module, "attn_dim", module.num_heads * module.head_dim))


class TimmRopeAttention(Adapter):
    """``timm.layers.attention.AttentionRope`` and ``timm.models.eva.EvaAttention`` (EVA-02,
    DINOv3, ...): fused or separate q/k/v projections (EVA: q/v bias, zero k bias, optionally added
    after the matmul) → q/k norm → RoPE on the tokens after ``num_prefix_tokens`` (interleaved or
    half layout) → grouped-query k/v repeat (AttentionRope) → attention → scale norm → gate → proj.
    Attention dropout in training delegates to the original forward."""

    name = "timm.AttentionRope"
    targets = ("timm.layers.attention:AttentionRope", "timm.models.eva:EvaAttention")

    def skip_reason(self, module, options):
        return _check_common(module.head_dim, options)

    def forward(self, module, state, x, rope=None, attn_mask=None, is_causal=False):
        why = _bypass_reason(module)
        if why:
            return state.delegate(x, rope=rope, attn_mask=attn_mask, is_causal=is_causal, reason=why)
        why = _mask_reason(attn_mask, is_causal, x, module.num_heads)
        if why:
            return state.delegate(x, rope=rope, attn_mask=attn_mask, is_causal=is_causal, reason=why)
        B, N, C = x.shape
        H = module.num_heads
        gate = _gate(module, x)
        if module.qkv is not None:
            q, k, v = _split_heads(_biased_qkv(module, x), H)
        else:
            kv_heads = module_attr(module, "num_kv_heads", H)
            q = module.q_proj(x).reshape(B, N, H, -1).transpose(1, 2)
            k = module.k_proj(x).reshape(B, N, kv_heads, -1).transpose(1, 2)
            v = module.v_proj(x).reshape(B, N, kv_heads, -1).transpose(1, 2)
        q, k = module.q_norm(q), module.k_norm(k)
        if rope is not None:
            from timm.layers.pos_embed_sincos import apply_rot_embed_cat
            npt = module.num_prefix_tokens
            half = module.rotate_half
            q = torch.cat([q[:, :, :npt, :], apply_rot_embed_cat(q[:, :, npt:, :], rope, half=half)], dim=2).type_as(v)
            k = torch.cat([k[:, :, :npt, :], apply_rot_embed_cat(k[:, :, npt:, :], rope, half=half)], dim=2).type_as(v)
        groups = module_attr(module, "num_kv_groups", 1)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        o = _self_attention(module, state, q, k, v, attn_mask, is_causal)
        # EvaAttention merges heads back to the input width C, AttentionRope to attn_dim
        return _finish(module, o, gate, module_attr(module, "attn_dim", C))


# --------------------------------------------------------------------------------------------
# Swin


def window_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                mask: Optional[torch.Tensor], scale: Optional[float], precision: str = "auto",
                backend: str = "auto") -> torch.Tensor:
    """Attention inside Swin windows, exact: q/k/v [B·nW, H, N, D] → [B·nW, H, N, D].

    bias [H, N, N] is shared by every window; mask [nW, N, N] (0 / −100, or None) applies to window
    row r as mask[r mod nW] — timm orders windows image-major, r = b·nW + w.

    Uses :func:`elsa_vision.window_attention` (a kernel that reads the bias once per head and the
    mask by window id) when no backend was named. Otherwise it runs
    :func:`elsa_vision.attention` on the windows viewed as [B, nW·H, N, D] with the bias
    (mask[:, None] + bias[None]) as [1, nW·H, N, N], broadcast over the batch — never expanded per
    image. (q/k/v are strided views of the qkv projection, so that regrouping copies them; the
    unshifted blocks, mask None, need no regrouping.)
    """
    if backend == "auto":
        return window_attention(q, k, v, bias=bias, mask=mask, scale=scale, precision=precision)
    if mask is None:
        return attention(q, k, v, bias=bias, scale=scale, precision=precision, backend=backend)
    Bw, H, N, D = q.shape
    nW = mask.shape[0]
    B = Bw // nW
    both = (mask[:, None] + bias[None]).reshape(1, nW * H, N, N)
    out = attention(q.reshape(B, nW * H, N, D), k.reshape(B, nW * H, N, D), v.reshape(B, nW * H, N, D),
                       bias=both, scale=scale, precision=precision, backend=backend)
    return out.reshape(Bw, H, N, D)  # the kernels return token-major outputs


def _gather_heads(table: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Swin's relative-position bias, table [(2w−1)², H] gathered by index [N, N] → [H, N, N] row-major.

    Without a gradient, the head-major gather of table.t() makes the row-major bias without a copy.
    Its gradient, though, comes out transposed: for a parameter (v1's table) autograd then copies it
    into the parameter's layout once per call (new_empty_strided + copy_, outside a compiled graph:
    twelve host-side ops more a compiled Swin-T step), and eagerly its index_put writes the
    transposed layout. So where a gradient is wanted, the rows are gathered and transposed into a
    copy, whose gradient is an index_put into the table's own layout — except for a computed table
    (v2's, from its MLP) in a compiled graph, where inductor takes the transposed gradient into
    the MLP's backward without a copy and the head-major gather measured faster."""
    idx = index.view(-1)
    if torch.is_grad_enabled() and table.requires_grad and (table.is_leaf or not torch.compiler.is_compiling()):
        return table[idx].t().contiguous().view(-1, n, n)
    return table.t()[:, idx].view(-1, n, n)


def _unit_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x's rows (last dim) L2-normalized and times ``scale`` in one pass, x · (scale / max(‖x‖, eps)),
    with F.normalize's eps (Swin v2's normalize(q)·τ)."""
    return x * (scale / x.norm(dim=-1, keepdim=True).clamp_min(1e-12))


def _canonical_index(module) -> bool:
    """Whether a Swin module's relative_position_index (v1 and v2) is the one timm builds from its window size,
    t(i, j) = (yi − yj + wh − 1)(2·ww − 1) + (xi − xj + ww − 1) for row-major tokens (a buffer on the
    meta device is not filled yet: timm fills it by this formula)."""
    index = module_attr(module, "relative_position_index")
    if not isinstance(index, torch.Tensor):
        return False
    if index.device.type == "meta":
        return True
    wh, ww = module.window_size
    y, x = (c.flatten() for c in torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij"))
    want = (y[:, None] - y[None, :] + wh - 1) * (2 * ww - 1) + (x[:, None] - x[None, :] + ww - 1)
    return tuple(index.shape) == tuple(want.shape) and bool(torch.equal(index.cpu().long(), want))


def _index_seen(module) -> tuple:
    """What identifies relative_position_index's contents without reading them: the tensor and its
    version counter (which in-place writes bump; an inference tensor has none, and cannot be written
    outside inference mode: the tensor alone)."""
    index = module_attr(module, "relative_position_index")
    if not isinstance(index, torch.Tensor):
        return (index, None)
    return (index, None if index.is_inference() else index._version)


def _index_memo(module) -> dict:
    """The Swin adapters' initial PatchState.memo: the index as patch() found it, and whether it is
    timm's formula."""
    return {"index": _index_seen(module), "index_ok": _canonical_index(module)}


def _index_still_canonical(module, state) -> bool:
    """Whether relative_position_index is still timm's formula (:func:`_canonical_index`, which
    patch() checked): checked again on the first eager call after it became another tensor or was
    written in place (:func:`_index_seen`), so that an edited index takes the module's own gather
    instead of the kernels' derived one. A compiled graph keeps what the last eager check found."""
    memo = state.memo
    if torch.compiler.is_compiling():
        return memo["index_ok"]
    seen = _index_seen(module)
    was = memo["index"]
    if was[0] is not seen[0] or was[1] != seen[1]:
        memo["index"], memo["index_ok"] = seen, _canonical_index(module)
    return memo["index_ok"]


def _swin_head_dim(attn) -> int:
    """A Swin WindowAttention's head dim (its qkv projection's width over 3 · heads)."""
    return attn.qkv.out_features // 3 // attn.num_heads


def _mask_ok(mask: Optional[torch.Tensor], Bw: int, N: int) -> bool:
    return mask is None or (mask.dim() == 3 and tuple(mask.shape[1:]) == (N, N) and mask.shape[0] > 0
                            and Bw % mask.shape[0] == 0)


class _SwinBase(Adapter):
    """Shared Swin forward: qkv → (q, k, scale, bias [H, N, N]) per version → window_core → proj.

    The bias is gathered by a kernel of :mod:`elsa_vision.kernels.position_bias` where the patch
    option ``fuse_position_bias`` is True (its default) and the backend is "auto"; those kernels
    derive the index from the window size, so a module whose ``relative_position_index`` is not
    timm's formula is not patched then (reported)."""

    options = frozenset({"fuse_position_bias"})

    def check_options(self, options):
        check_flag(options, "fuse_position_bias", True)

    def initial_memo(self, module, options):
        return _index_memo(module)

    def skip_reason(self, module, options):
        why = _check_common(_swin_head_dim(module), options, has_bias=True)
        if (why is None and options.get("fuse_position_bias", True) and options.get("backend", "auto") == "auto"
                and not _canonical_index(module)):
            # the position-bias kernels derive each token pair's table row from the window size (checked
            # here, once: what keeps a later call on the module's own gather may change)
            why = ("relative_position_index is missing or not the one timm builds from window_size; the fused "
                   "position-bias kernels derive it from the window size (rebuild it as timm does with "
                   "module.init_non_persistent_buffers(), or patch with fuse_position_bias=False to keep the "
                   "module's own index)")
        return why

    @staticmethod
    def _fuses_bias(module, state, table: torch.Tensor) -> bool:
        """Whether the position-bias kernels may serve this call: the option and the backend, the
        table's device and dtype, the index's shape and formula (v2 checks its MLP beside)."""
        n = module.window_size[0] * module.window_size[1]
        return (_backend(state) == "auto" and state.options.get("fuse_position_bias", True)
                and triton_serves(table.device.type) and table.dtype in POSITION_BIAS_DTYPES
                and tuple(module.relative_position_index.shape) == (n, n) and _index_still_canonical(module, state))

    def _qkv(self, module, x):
        raise NotImplementedError

    def _prepare(self, module, state, q, k):
        """→ (q, k, scale or None, bias [H, N, N]); q, k [B·nW, H, N, D]."""
        raise NotImplementedError

    def _attend(self, module, state, qkv, mask):
        """qkv [B·nW, N, 3·H·D] → [B·nW, H, N, D] with q, k, v as views: on a named backend, and Swin
        v2's under torch.compile (the subclasses' packed forms serve the other calls)."""
        q, k, v = _split_heads(qkv, module.num_heads)
        q, k, scale, bias = self._prepare(module, state, q, k)
        return window_core(q, k, v, bias, mask, scale, precision=state.options.get("precision", "auto"),
                           backend=_backend(state))

    def _attend_image(self, module, state, qkv, window, shift, mask, image):
        """The Swin block's path: qkv [B, H, W, 3·heads·D] of the feature map (not partitioned;
        padded to the window's multiple, ``image`` = the map's own (rows, columns)) →
        [B, H, W, heads, D] by :func:`elsa_vision.shifted_window_attention` on the packed qkv."""
        raise NotImplementedError

    def forward(self, module, state, x, mask=None):
        Bw, N, C = x.shape
        why = _bypass_reason(module)
        if why:
            return state.delegate(x, mask=mask, reason=why)
        if not _mask_ok(mask, Bw, N):
            return state.delegate(x, mask=mask, reason="mask is not [nW, N, N] with nW dividing the window batch")
        o = self._attend(module, state, self._qkv(module, x), _float_mask(mask))
        x = o.transpose(1, 2).reshape(Bw, N, -1)
        x = module.proj(x)
        return module.proj_drop(x)


def _float_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # timm adds a bool / integer mask as numbers (True = +1), not as a keep-mask
    return mask.float() if mask is not None and not mask.is_floating_point() else mask


class SwinWindowAttention(_SwinBase):
    """Swin v1 ``timm.models.swin_transformer.WindowAttention``: softmax(q kᵀ·scale + B + mask) v with
    B = relative_position_bias_table[relative_position_index] → [H, N, N] and the shift mask
    [nW, N, N]. Attention dropout in training delegates to the original forward."""

    name = "timm.SwinWindowAttention"
    targets = ("timm.models.swin_transformer:WindowAttention",)

    def _qkv(self, module, x):
        return module.qkv(x)

    def _prepare(self, module, state, q, k):
        scale = None if module.fused_attn else float(module.scale)
        return q, k, scale, self._bias(module, state)

    def _bias(self, module, state) -> torch.Tensor:
        """timm's _get_rel_pos_bias as the row-major [H, N, N] table the kernels read, without its
        permute (the same values): by the gather kernel (one launch, float32; its gradient one
        launch, deterministic) where it serves (:meth:`_fuses_bias`), else by the module's index
        (:func:`_gather_heads` says which gather, by the gradient's layout)."""
        table = module.relative_position_bias_table
        if self._fuses_bias(module, state, table):
            from ..kernels.position_bias import relative_position_bias
            return relative_position_bias(table, module.window_size)
        return _gather_heads(table, module.relative_position_index, module.window_area)

    def _attend(self, module, state, qkv, mask):
        # q, k, v are the projection's own slices here: the packed call gets qkv's gradient written in
        # one piece (see elsa_vision.window_attention_packed)
        if _backend(state) != "auto":
            return super()._attend(module, state, qkv, mask)
        Bw, N, _ = qkv.shape
        _, _, scale, bias = self._prepare(module, state, None, None)
        return window_attention_packed(qkv.reshape(Bw, N, 3, module.num_heads, -1), bias=bias, mask=mask,
                                          scale=scale, precision=state.options.get("precision", "auto"))

    def _attend_image(self, module, state, qkv, window, shift, mask, image):
        # the packed form: qkv's gradient comes out of the kernels in one piece
        B, IH, IW, _ = qkv.shape
        _, _, scale, bias = self._prepare(module, state, None, None)
        return shifted_window_attention(qkv.reshape(B, IH, IW, 3, module.num_heads, -1), window_size=window,
                                        shift_size=shift, bias=bias, mask=mask, scale=scale,
                                        precision=state.options.get("precision", "auto"),
                                        backend=_backend(state), image_size=image)


class SwinV2WindowAttention(_SwinBase):
    """Swin v2 ``timm.models.swin_transformer_v2.WindowAttention``: cosine attention,
    softmax(normalize(q)·τ · normalize(k)ᵀ + 16·sigmoid(cpb_mlp(coords))[index] + mask) v with
    τ = exp(clamp(logit_scale, max=log 100)) per head and logit scale 1. τ is folded into q.
    The bias (the MLP over the coordinates table, the sigmoid and the gather by index) is one
    launch of the fused kernel, its gradient two (:meth:`_bias`), where cpb_mlp is timm's and has no
    hooks (and as :class:`_SwinBase` says). Attention dropout in training delegates to the original
    forward."""

    name = "timm.SwinV2WindowAttention"
    targets = ("timm.models.swin_transformer_v2:WindowAttention",)

    def _qkv(self, module, x):
        return _biased_qkv(module, x)

    def _prepare(self, module, state, q, k):
        q, k = self._normalized(module, q, k, heads_at=-3)
        return q, k, 1.0, self._bias(module, state)

    @staticmethod
    def _normalized(module, q: torch.Tensor, k: torch.Tensor, heads_at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """normalize(q)·τ and normalize(k), each its own tensor; ``heads_at``: the heads' dim of q
        (−3 for [B·nW, H, N, D], −2 for image rows [B, height, width, H, D])."""
        tau = SwinV2WindowAttention._tau(module).view(-1, *(1,) * (-heads_at - 1))
        return _unit_rows(q, tau), F.normalize(k, dim=-1)

    @staticmethod
    def _tau(module) -> torch.Tensor:
        """τ = exp(clamp(logit_scale, max=log 100)), [H, 1, 1]."""
        return torch.clamp(module.logit_scale, max=math.log(1.0 / 0.01)).exp()

    @staticmethod
    def _cpb_layers(module) -> Optional[tuple[nn.Linear, nn.Linear]]:
        """cpb_mlp's two linear layers where it is timm's Linear(2, C) → ReLU → Linear(C, H, no bias),
        without hooks (the fused kernel never calls them); else None."""
        mlp = module_attr(module, "cpb_mlp")
        if type(mlp) is not nn.Sequential or len(mlp) != 3:
            return None
        l1, act, l2 = (module_attr(mlp, k) for k in ("0", "1", "2"))
        if not (type(l1) is nn.Linear and type(act) is nn.ReLU and type(l2) is nn.Linear and l1.in_features == 2
                and l1.bias is not None and l2.bias is None and l2.out_features == module.num_heads):
            return None
        if any(hooked(m, global_hooks=i == 0) for i, m in enumerate((mlp, l1, act, l2))):
            return None
        return l1, l2

    @classmethod
    def _bias(cls, module, state) -> torch.Tensor:
        """16·sigmoid(cpb_mlp(coords)) gathered into the [H, N, N] table the kernels read: by the fused
        kernel (:func:`elsa_vision.kernels.position_bias.continuous_position_bias`, one launch, float32) where it
        serves, else by the module's own MLP."""
        wh, ww = module.window_size
        n = wh * ww
        coords = module.relative_coords_table
        layers = cls._cpb_layers(module) if cls._fuses_bias(module, state, coords) else None
        if layers is not None and all(p.dtype in POSITION_BIAS_DTYPES for p in (layers[0].weight, layers[0].bias,
                                                                               layers[1].weight)):
            from ..kernels.position_bias import continuous_position_bias
            l1, l2 = layers
            # (reshape: a channels-last model's coordinates buffer has no [-1, 2] view)
            return continuous_position_bias(coords.reshape(-1, 2), l1.weight, l1.bias, l2.weight, (wh, ww))
        # 16·sigmoid on the [(2w−1)², H] table before the gather (elementwise, so the same values)
        table = 16 * torch.sigmoid(module.cpb_mlp(coords).view(-1, module.num_heads))
        return _gather_heads(table, module.relative_position_index, n)

    @staticmethod
    def _cosine(module, qkv: torch.Tensor) -> torch.Tensor:
        """Eagerly, in training: the packed projection [..., 3, H, D] → the same with q and k L2-normalized per row
        and q times τ, as one new tensor whose gradient the kernels write in one piece. q and k
        normalized apart (:meth:`_prepare`) beside v's view get three gradients that autograd
        stacks into qkv's after two normalization backwards: about fifteen launches more a block in
        a training step. Under torch.compile the apart form is kept: inductor fuses each
        normalization, its backward and the stack itself, and measured faster there than with this
        tensor."""
        tau = SwinV2WindowAttention._tau(module).view(1, -1, 1)  # [1, H, 1]
        both = torch.cat((tau, torch.ones_like(tau)))  # [2, H, 1]: q's τ, k's 1
        qk = _unit_rows(qkv[..., :2, :, :], both)
        return torch.cat((qk.to(qkv.dtype), qkv[..., 2:, :, :]), dim=-3)

    @staticmethod
    def _packs(qkv: torch.Tensor) -> bool:
        """Whether :meth:`_cosine`'s packed form serves the call: eagerly, where qkv takes a gradient
        (what it saves is the gradients' stack; without one it would only copy v)."""
        return qkv.requires_grad and not torch.compiler.is_compiling()

    def _attend(self, module, state, qkv, mask):
        if _backend(state) != "auto" or not self._packs(qkv):
            return super()._attend(module, state, qkv, mask)
        Bw, N, _ = qkv.shape
        packed = self._cosine(module, qkv.reshape(Bw, N, 3, module.num_heads, -1))
        return window_attention_packed(packed, bias=self._bias(module, state), mask=mask, scale=1.0,
                                          precision=state.options.get("precision", "auto"))

    def _attend_image(self, module, state, qkv, window, shift, mask, image):
        B, IH, IW, _ = qkv.shape
        how = dict(window_size=window, shift_size=shift, bias=self._bias(module, state), mask=mask, scale=1.0,
                   precision=state.options.get("precision", "auto"), backend=_backend(state), image_size=image)
        qkv = qkv.reshape(B, IH, IW, 3, module.num_heads, -1)
        if self._packs(qkv):
            return shifted_window_attention(self._cosine(module, qkv), **how)
        q, k, v = qkv.unbind(3)
        q, k = self._normalized(module, q, k, heads_at=-2)
        return shifted_window_attention(q, k, v, **how)


class SwinBlock(Adapter):
    """Swin v1 ``SwinTransformerBlock`` / v2 ``SwinTransformerV2Block``: their ``_attn(x)`` — x
    [B, H, W, C] → roll by −shift → window partition → ``attn`` → window merge → roll by +shift —
    as ``attn.qkv`` → :func:`elsa_vision.shifted_window_attention` → ``attn.proj`` →
    ``attn.proj_drop`` on the feature map itself (see the module docstring); a map the window does
    not tile padded before ``attn.qkv`` and its image rolled alone (``image_size``), the output
    cropped before ``attn.proj``. The block's
    ``forward`` (norms, residuals, MLP, drop-path) stays timm's."""

    name = "timm.SwinBlock"
    targets = ("timm.models.swin_transformer:SwinTransformerBlock",
               "timm.models.swin_transformer_v2:SwinTransformerV2Block")
    method = "_attn"
    options = frozenset({"fuse_windows"})

    def check_options(self, options):
        check_flag(options, "fuse_windows", True)

    def skip_reason(self, module, options):
        if not options.get("fuse_windows", True):
            return "fuse_windows=False: timm's shift and window partition run around the patched attention"
        why = _old_timm()
        attn = module_attr(module, "attn")
        if why or attn is None or not isinstance(module_attr(attn, "qkv"), nn.Linear) \
                or not isinstance(module_attr(attn, "num_heads"), int):
            return why  # (an attention module of another kind: the call delegates, see _why_not)
        return named_backend_refusal(options.get("backend", "auto"), "shifted_window_attention",
                                     _swin_head_dim(attn), has_bias=True)

    @staticmethod
    def _why_not(block, x) -> Optional[str]:
        """Why this call must run timm's own _attn (None: the fused path serves it)."""
        attn = block.attn
        if not is_patched(attn) or not isinstance(adapter_of(state_of(attn)), _SwinBase):
            return "its attention module is not patched by ELSA"
        why = _bypass_reason(attn)
        if why:
            return why
        if hooked(attn, backward=True):
            return "hooks on its attention module, which the fused block does not call"
        mods = attn._modules  # (the global hooks: looked at just above)
        if hooked_any((mods["qkv"], mods["proj"], mods["proj_drop"]), global_hooks=False, backward=True):
            # (the fused block calls them on the [B, H, W, C] map, not on timm's window rows)
            return "hooks on its attention's qkv, proj or proj_drop, which see window rows in timm"
        if attn.proj_drop.p > 0 and attn.proj_drop.training:
            return "output-projection dropout in training (its random mask follows timm's window order)"
        if x.dim() != 4:
            return "input is not a [B, H, W, C] feature map"
        return None

    def forward(self, block, state, x):
        why = self._why_not(block, x)
        if why:
            return state.delegate(x, reason=why)
        attn = block.attn
        astate = state_of(attn)
        B, H, W, _ = x.shape
        (wh, ww), N = block.window_size, block.window_size[0] * block.window_size[1]
        # a map the window does not tile is padded as timm pads it — at the bottom and right, with
        # zeros (the projection makes them its bias) — but before the projection and unrolled: the
        # kernels roll the image's rows and columns (image_size; the pad tokens, all equal, move among
        # pad positions only), so timm's roll-then-pad is index arithmetic
        ph, pw = -H % wh, -W % ww
        xp = F.pad(x, (0, 0, 0, pw, 0, ph)) if ph or pw else x
        IH, IW = H + ph, W + pw
        mask = block.get_attn_mask(xp) if block.dynamic_mask else block.attn_mask
        if mask is not None and tuple(mask.shape) != ((IH // wh) * (IW // ww), N, N):
            return state.delegate(x, reason="attn_mask is not [nW, N, N] for this feature map")
        astate.count_call()  # the attention module's call, served here
        served = adapter_of(astate)
        o = served._attend_image(attn, astate, served._qkv(attn, xp), block.window_size,
                                 block.shift_size, _float_mask(mask), (H, W) if ph or pw else None)
        o = o.reshape(B, IH, IW, -1)
        if ph or pw:
            o = o[:, :H, :W]  # (timm crops the padding's outputs too)
        return attn.proj_drop(attn.proj(o))


class TimmBlock(PreNormBlock):
    """``timm.models.vision_transformer.Block`` (ViT, DeiT, DINOv2, ...): its residual stream in
    fused passes in inference (see adapters/blocks.py); its ``attn`` is called with the block's
    own arguments."""

    name = "timm.Block"
    targets = ("timm.models.vision_transformer:Block",)

    def attend(self, block, h, *args, **kwargs):
        return block.attn(h, *args, **kwargs)


def unzero_residual_norms(model: torch.nn.Module) -> int:
    """Deprecated: use ``elsa_vision.verify.unzero_residual_norms`` (a verification tool, not an adapter)."""
    import warnings
    from ..verify import unzero_residual_norms as moved
    warnings.warn("elsa_vision.adapters.timm.unzero_residual_norms moved to elsa_vision.verify.unzero_residual_norms",
                  DeprecationWarning, stacklevel=2)
    return moved(model)


for _adapter in (TimmAttention(), TimmRopeAttention(), SwinWindowAttention(), SwinV2WindowAttention(), SwinBlock(),
                 TimmBlock()):
    register(_adapter)
