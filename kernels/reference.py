"""Reference backend: the ELSA monoid scan in plain torch, over key chunks.

Runs on any device and dtype and is differentiable by autograd. Each key chunk is folded into a
summary (m, S, W) and the summaries are merged with the monoid operator, so extra memory is
O(Nq · chunk) per step instead of O(Nq · Nk). Under autograd each chunk is checkpointed, so the
backward also stays O(Nq · chunk) per step (it recomputes the chunk's scores).

Half-precision inputs are computed in float32 (the accumulation dtype of the Triton kernels);
float32 and float64 inputs are computed in their own dtype.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch.utils.checkpoint import checkpoint

# Rows whose every key is masked have m = -inf; subtracting it would give NaN. Any finite stand-in
# works because every exp in such a row is exp(-inf) = 0.
def _safe_max(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def causal_mask(nq: int, nk: int, k0: int, k1: int, device) -> torch.Tensor:
    """Boolean [nq, k1-k0]: True where query i may see key j, bottom-right aligned (j ≤ i + nk − nq)."""
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(k0, k1, device=device)[None, :]
    return j <= i + (nk - nq)


def _chunk_summary(q, k, v, bias, scale: float, causal: bool, nk_total: int, k0: int):
    """Summary (m, S, W) of one key chunk. q [B,H,Nq,D], k/v [B,H,n,D], bias broadcastable [.., Nq, n]."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    if causal:
        keep = causal_mask(q.shape[-2], nk_total, k0, k0 + k.shape[-2], q.device)
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1)
    p = torch.exp(s - _safe_max(m)[..., None])
    return m, p.sum(dim=-1), torch.matmul(p, v)


def merge(a, b):
    """The ELSA monoid operator on summaries (m, S, W); identity is (-inf, 0, 0)."""
    ma, sa, wa = a
    mb, sb, wb = b
    m = torch.maximum(ma, mb)
    ms = _safe_max(m)
    ea, eb = torch.exp(ma - ms), torch.exp(mb - ms)
    return m, sa * ea + sb * eb, wa * ea[..., None] + wb * eb[..., None]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = False,
    chunk: int = 1024,
    return_lse: bool = False,
):
    """Exact attention by a chunked monoid scan.

    q [B,H,Nq,D], k/v [B,H,Nk,D], bias broadcastable to [B,H,Nq,Nk]. Returns out [B,H,Nq,D] in q's
    dtype and, with ``return_lse``, the natural-log log-sum-exp [B,H,Nq] in float32 (+inf for rows
    with no visible key, so that exp(s − lse) = 0 there).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    cdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    bc = None if bias is None else bias.to(cdt)
    nk = k.shape[-2]
    shape = q.shape[:-1]
    state = (
        torch.full(shape, float("-inf"), dtype=cdt, device=q.device),
        torch.zeros(shape, dtype=cdt, device=q.device),
        torch.zeros((*shape, v.shape[-1]), dtype=cdt, device=q.device),
    )
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, bias)
    )
    for k0 in range(0, nk, chunk):
        k1 = min(k0 + chunk, nk)
        b = None if bc is None else bc[..., k0:k1]
        args = (qc, kc[..., k0:k1, :], vc[..., k0:k1, :], b, scale, causal, nk, k0)
        part = checkpoint(_chunk_summary, *args, use_reentrant=False) if grad else _chunk_summary(*args)
        state = merge(state, part)
    m, s, w = state
    nonempty = s != 0  # a NaN row (NaN inputs, overflowing logits) stays NaN, as in the Triton kernels
    out = torch.where(nonempty[..., None], w / torch.where(nonempty, s, 1)[..., None], 0)
    out = out.to(q.dtype)
    if not return_lse:
        return out
    lse = torch.where(nonempty, _safe_max(m) + torch.log(torch.where(nonempty, s, 1)), float("inf"))
    return out, lse.float()


def attention_backward(q, k, v, out, lse, do, scale: float, causal: bool = False, chunk: int = 1024):
    """(dq, dk, dv) of attention over these keys from the rows' output and log-sum-exp, which may
    cover more keys than these (a key shard of a longer sequence: the gradients are then this
    shard's terms, P = exp(s − lse) over the whole row). q/out/do [B,H,Nq,D], k/v [B,H,Nk,D], lse
    [B,H,Nq] natural-log (a non-finite lse: the row sees no key). Chunked over the keys; computed in
    float32 (float64 inputs: float64), returned in the inputs' dtypes."""
    cdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qc, kc, vc, oc, dc = (t.to(cdt) for t in (q, k, v, out, do))
    seen = torch.isfinite(lse)
    lc = torch.where(seen, lse, 0).to(cdt)[..., None]
    delta = (dc * oc).sum(-1, keepdim=True)
    nk = k.shape[-2]
    dq = torch.zeros_like(qc)
    dk, dv = torch.empty_like(kc), torch.empty_like(vc)
    for k0 in range(0, nk, chunk):
        k1 = min(k0 + chunk, nk)
        s = torch.matmul(qc, kc[..., k0:k1, :].transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~causal_mask(q.shape[-2], nk, k0, k1, q.device), float("-inf"))
        pr = torch.where(seen[..., None], torch.exp(s - lc), 0)
        dv[..., k0:k1, :] = torch.matmul(pr.transpose(-1, -2), dc)
        ds = pr * (torch.matmul(dc, vc[..., k0:k1, :].transpose(-1, -2)) - delta)
        dq += torch.matmul(ds, kc[..., k0:k1, :]) * scale
        dk[..., k0:k1, :] = torch.matmul(ds.transpose(-1, -2), qc) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _window_chunk(q, k, v, bias, mask, scale: float, r0: int):
    """Windows r0 .. r0+len(q) of a window_attention call: (out [c,H,N,D], lse [c,H,N])."""
    cdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    s = torch.matmul(q.to(cdt), k.to(cdt).transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(cdt)
    if mask is not None:
        ids = torch.arange(r0, r0 + q.shape[0], device=q.device) % mask.shape[0]
        s = s + mask.to(cdt)[ids][:, None]
    m = s.amax(dim=-1)
    p = torch.exp(s - _safe_max(m)[..., None])
    z = p.sum(dim=-1)
    nonempty = z != 0  # NaN stays NaN (see attention)
    zs = torch.where(nonempty, z, 1)
    out = torch.where(nonempty[..., None], torch.matmul(p, v.to(cdt)) / zs[..., None], 0).to(q.dtype)
    lse = torch.where(nonempty, _safe_max(m) + torch.log(zs), float("inf"))
    return out, lse.float()


def qkv_views(qkv: torch.Tensor, geo: Optional["Geometry"] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [BW, N, 3, H, D] (the qkv projection's output of a window batch, reshaped) → q, k, v as
    [BW, H, N, D] views; with ``geo``, image rows qkv [T, 3, H, D] → q, k, v [T, H, D] views."""
    if geo is not None:
        return qkv.unbind(1)
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (two view ops, not four: host time on every call)


class Geometry(NamedTuple):
    """Swin's shifted windows over a batch of token images: windows of wh × ww tokens tiling a grid
    of height × width tokens after the image in its top-left rows × cols corner is rolled by
    (−sh, −sw), as ``torch.roll`` followed by ``F.pad`` and ``window_partition`` builds them in timm.
    The grid's other tokens (rows ≥ ``rows`` or columns ≥ ``cols``: the padding, there when the
    image is not a multiple of the window) are never rolled. Window w of image b is row
    r = b·nW + w of the window batch, w = (row of the window grid)·nwx + (column), its tokens
    row-major::

        image (height × width), shift (sh, sw) = (1, 1), windows 2 × 2:

          rolled image            window 0    window 1    window 2    window 3
          a b c d                 a b         c d         i j         k l
          e f g h         →       e f         g h         m n         o p
          i j k l
          m n o p             token (y, x) of the rolled image is token ((y + sh) mod rows,
                              (x + sw) mod cols) of the image (y < rows, x < cols)

    ``rows`` = height and ``cols`` = width where there is no padding."""
    batch: int
    height: int
    width: int
    wh: int
    ww: int
    sh: int
    sw: int
    rows: int
    cols: int

    @property
    def nwx(self) -> int:
        return self.width // self.ww

    @property
    def nW(self) -> int:
        """Windows per image."""
        return (self.height // self.wh) * self.nwx

    @property
    def windows(self) -> int:
        return self.batch * self.nW

    @property
    def tokens(self) -> int:
        """Tokens per window (N)."""
        return self.wh * self.ww

    @property
    def args(self) -> tuple[int, ...]:
        """What the window kernels take to find a window's tokens in image rows (kernels/window.py
        _tok; the shifts reduced mod the image's extent: a roll by rows is none)."""
        return (self.nwx, self.wh, self.ww, self.height, self.width, self.rows, self.cols, self.sh % self.rows,
                self.sw % self.cols)


def _regrid(x: torch.Tensor, geo: Geometry, inverse: bool) -> torch.Tensor:
    """x [B, height, width, *rest] stored → rolled (``inverse``: back): the image's rows [0, rows)
    rolled by −sh (+sh), the padding's after them kept; columns likewise. Slices and concatenations
    (torch.roll where there is no padding): nothing kept for the backward."""
    for dim, extent, shift in ((1, geo.rows, geo.sh), (2, geo.cols, geo.sw)):
        shift %= extent
        if not shift:
            continue
        if extent == x.shape[dim]:
            x = torch.roll(x, shifts=shift if inverse else -shift, dims=dim)
        else:
            cut = extent - shift if inverse else shift
            x = torch.cat((x.narrow(dim, cut, extent - cut), x.narrow(dim, 0, cut),
                           x.narrow(dim, extent, x.shape[dim] - extent)), dim=dim)
    return x


def to_windows(x: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Image rows x [B·height·width, *rest] → the window batch [B·nW, N, *rest] (roll, then partition)."""
    b, ih, iw, wh, ww = geo[:5]
    rest = x.shape[1:]
    x = _regrid(x.reshape(b, ih, iw, *rest), geo, inverse=False)
    x = x.reshape(b, ih // wh, wh, iw // ww, ww, *rest).transpose(2, 3)
    return x.reshape(geo.windows, wh * ww, *rest)


def from_windows(xw: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """The inverse of :func:`to_windows`: [B·nW, N, *rest] → image rows [B·height·width, *rest]."""
    b, ih, iw, wh, ww = geo[:5]
    rest = xw.shape[2:]
    x = xw.reshape(b, ih // wh, iw // ww, wh, ww, *rest).transpose(2, 3).reshape(b, ih, iw, *rest)
    return _regrid(x, geo, inverse=True).reshape(b * ih * iw, *rest)


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    chunk_elems: int = 1 << 22,
    return_lse: bool = False,
):
    """Exact windowed attention, chunked over windows.

    q/k/v [BW,H,N,D] with windows batch-major (row r is window r mod nW); bias [H,N,N] (shared by all
    windows) or None; mask [nW,N,N] additive float or None. Each chunk of windows builds its own
    [c,H,N,N] scores (c·H·N² ≤ ``chunk_elems``) and is checkpointed under autograd, so neither the
    forward nor the backward ever holds the [BW,H,N,N] tensor. The mask takes no gradient.
    Returns out [BW,H,N,D] (and lse [BW,H,N] float32, +inf for rows with no visible key).
    """
    BW, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if mask is not None:
        mask = mask.detach()
    c = max(1, chunk_elems // max(1, H * N * N))
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))
    outs, lses = [], []
    for r0 in range(0, BW, c):
        r1 = min(BW, r0 + c)
        args = (q[r0:r1], k[r0:r1], v[r0:r1], bias, mask, scale, r0)
        o, l = checkpoint(_window_chunk, *args, use_reentrant=False) if grad else _window_chunk(*args)
        outs.append(o)
        lses.append(l)
    if not outs:
        out = q.new_zeros(q.shape)
        lse = torch.full((BW, H, N), float("inf"), device=q.device)
    else:
        out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))
    return (out, lse) if return_lse else out
