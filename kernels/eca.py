"""Exact Causal Attention (ECA): causal attention whose matrix products take 29/64 of L²·d
multiply-adds each instead of 1/2 (4/9 with recursion), from Strassen-style identities for
products with a triangular operand or output (Rybin et al., "Exact Causal Attention with 10% Fewer
Operations"). Pure PyTorch, Triton-free: a CPU backend for compute-bound causal calls.

Notation (the paper's). X ∈ R^{L×d} is cut into 4 × 4 blocks of (L/4) × (d/4), numbered row-major:
X₁…X₁₆, X_{4r+c+1} = rows r, columns c. A lower-triangular L × L matrix (S = Mask(QKᵀ), P) has ten
non-zero blocks, numbered row by row: S₁ = (0,0); S₂, S₃ = (1,0), (1,1); S₄…S₆ = (2,0…2);
S₇…S₁₀ = (3,0…3). The diagonal blocks S₁, S₃, S₆, S₁₀ are themselves lower-triangular.

  Stage I  (Algorithm 1)  S = Mask(QKᵀ) from 24 products of (L/4)×(d/4) by (d/4)×(L/4) linear
           combinations of blocks (m₁…m₂₄) and 10 "half" products whose output is only needed on
           and below the diagonal (h₁…h₁₀): Mask(AᵀB)-type problems of a quarter of the size.
  Stage II (Algorithm 2)  O = P·V for lower-triangular P: 24 products m and 10 half products h,
           each h a lower-triangular block times a full one.

A half product is the same problem a quarter the size, so it recurses (``depth``); at depth 0 it
is computed row block by row block (``base``): rows [i·t, (i+1)·t) against columns < (i+1)·t, i.e.
n(n+t)/2·k multiply-adds for an n×n output of inner size k. One level on a call of L, d: 24·n²k +
10·n(n+t)/2·k with n = L/4, k = d/4 — 29/64·L²d + 5·t·L·d/16; depth → ∞: 4/9·L²d.

The backward uses the same two stages: dV = Pᵀ·dO and dK = dSᵀ·Q are upper-triangular by full
(Stage II on the order-reversed problem: Uᵀ… = J·(J U J)·(J X) with J the reversal), dP =
Mask(dO·Vᵀ) is Stage I, dQ = dS·K Stage II. L and d not divisible by 4^(depth+1) are padded with
zeros at the end: padded keys come after every real one, so causal masking hides them from every
real query; padded feature columns add 0 to q·k and are dropped from the output.

Memory: S and P are materialised (L × L per batch·head, float32 or float64): an O(L²) backend for
compute-bound calls, unlike the O(L) scan of the other backends.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

# (row, column) of the lower-triangular blocks S₁…S₁₀
TRI = ((0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2), (3, 3))

# Algorithm 1: (left combination of Q blocks, right combination of K blocks) per product, 1-based
# block numbers with signs; h products are half (only on and below the diagonal is needed).
STAGE1_M = (
    ((8, 11), (-2, 3, -4, 8)), ((15, 5), (1, -5, -6, 7)), ((-10, 16, 12), (-2, 12)), ((13, 9, -14), (9, -6)),
    ((-6, 15, -7), (2, 11)), ((6, 7, -11), (6, 11)), ((6, 7), (11,)), ((-14, -10, 6, -15, 7, 16, 12), (2,)),
    ((13, 9, -14, -10, 6, 7, -11), (6,)), ((11,), (2, -3, 7, 11, 4, -8)), ((5,), (5, 6, -7)), ((8,), (2, -3, 4)),
    ((15,), (-1, 5, 6, 3, -7, 11)), ((13, 9, 15), (-1, 5, 6)), ((11, 16, 12), (2, 4, -8)), ((9, -16), (1, -8)),
    ((10, -12), (12,)), ((13, -14), (9,)), ((-15, 7, 8), (-2, 3)), ((9,), (5, 9, -8)), ((9, -8, 12), (8,)),
    ((13, -5, 16), (1,)), ((16,), (-1, 4, 12)), ((14,), (9, 2, 10)),
)
STAGE1_H = (
    ((1,), (1,)), ((2,), (2,)), ((3,), (3,)), ((4,), (4,)), ((13,), (13,)), ((14,), (14,)), ((15,), (15,)),
    ((16,), (16,)), ((5, 7, -11), (-6, 7)), ((10,), (6, 10, 12)),
)
# S_j = Σ ± m_i (+ ± h_i): (m terms, h terms), 1-based, signed
STAGE1_OUT = (
    ((), (1, 2, 3, 4)), ((2, -5, -7, 11, 12, 13, 19), ()), ((1, 6, -7, 10, 11, 12), (9,)),
    ((1, 3, 12, 15, 16, 17, 21, -23), ()), ((1, -4, 6, -7, -9, 10, 12, 18, 20, 21), ()),
    ((4, -6, 7, 9, -17, -18), (10,)), ((2, -3, -5, -7, -8, 11, 13, -17, 22, 23), ()),
    ((2, 4, 11, 14, 16, -18, -20, 22), ()), ((3, 5, 7, 8, 17, 18, 24), ()), ((), (5, 6, 7, 8)),
)

# Algorithm 2: (combination of P blocks, combination of V blocks) per product; h: P is one
# diagonal block (triangular), so the product is half.
STAGE2_M = (
    ((3, 4, 5), (-2, 3, -4, 8)), ((2, 7, 8), (1, -5, -6, 7)), ((4, -7, 9), (-2, 12)), ((-5, 6, 8), (9, -6)),
    ((-2, -7, 9), (2, 11)), ((3, 5, -6), (6, 11)), ((-2, -3, -5, 6, -7, 9), (11,)), ((-7, 9), (2,)),
    ((-5, 6), (6,)), ((3, 5), (2, -3, 7, 11, 4, -8)), ((2, 3, 7, 8), (5, 6, -7)), ((2, 3, 4, 5), (2, -3, 4)),
    ((2, 7), (-1, 5, 6, 3, -7, 11)), ((8,), (-1, 5, 6)), ((4,), (2, 4, -8)), ((4, 8), (1, -8)),
    ((4, -6, -7, 9), (12,)), ((5, -6, -8, 9), (9,)), ((2,), (-2, 3)), ((5, -8), (5, 9, -8)), ((4, 5), (8,)),
    ((7, 8), (1,)), ((-4, 7), (-1, 4, 12)), ((9,), (9, 2, 10)),
)
STAGE2_H = (
    ((3,), (-6, 7)), ((6,), (6, 10, 12)), ((1,), (1,)), ((1,), (2,)), ((1,), (3,)), ((1,), (4,)),
    ((10,), (13,)), ((10,), (14,)), ((10,), (15,)), ((10,), (16,)),
)
STAGE2_OUT = (
    ((), (3,)), ((), (4,)), ((), (5,)), ((), (6,)), ((2, 11, -22), (1,)), ((-5, 6, 7, 8, 9), ()),
    ((-5, 6, 7, 8, 9, 19), (1,)), ((1, 12, 19, -21), ()), ((4, 9, 14, 16, 20, 21), ()),
    ((-3, -8, -9, 17), (2,)), ((1, -6, -9, 10, 15), (-1,)), ((3, 8, 15, -17, 21), ()),
    ((4, 9, 14, 18, 22), (7,)), ((-4, -8, -9, -18, 24), (8,)), ((2, 5, -8, 13, 14, -19), (9,)),
    ((3, 8, 15, -16, 22, 23), (10,)),
)


class _Counter:
    """Multiply-adds of every matrix product made while counting (:func:`count_multiply_adds`)."""
    macs: Optional[int] = None


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (batched), counted when counting is on."""
    if _Counter.macs is not None:
        batch = math.prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        _Counter.macs += batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
    return a @ b


@contextlib.contextmanager
def count_multiply_adds():
    """Inside, every product of this module adds its multiply-adds to the yielded list's only item
    (batch included): the count the tests hold against 29/64·L²d."""
    before, _Counter.macs = _Counter.macs, 0
    box = [0]
    try:
        yield box
    finally:
        box[0] = _Counter.macs
        _Counter.macs = before


def _blocks(x: torch.Tensor) -> list[torch.Tensor]:
    """X₁…X₁₆ of [..., L, d] (views), row-major."""
    n, k = x.shape[-2] // 4, x.shape[-1] // 4
    return [x[..., r * n:(r + 1) * n, c * k:(c + 1) * k] for r in range(4) for c in range(4)]


def _tri_blocks(x: torch.Tensor) -> list[torch.Tensor]:
    """The ten lower-triangular blocks of [..., L, L] (views), numbered as TRI."""
    n = x.shape[-1] // 4
    return [x[..., r * n:(r + 1) * n, c * n:(c + 1) * n] for r, c in TRI]


def _combine(blocks: list[torch.Tensor], terms) -> torch.Tensor:
    """Σ ± blocks[|t| − 1] over the signed 1-based terms (a view when there is one + term)."""
    out = None
    for t in terms:
        b = blocks[abs(t) - 1]
        if out is None:
            out = b.clone() if t < 0 or len(terms) > 1 else b
            if t < 0:
                out.neg_()
        elif t > 0:
            out.add_(b)
        else:
            out.sub_(b)
    return out


def _targets(out_terms, n_m: int) -> tuple[list, list]:
    """Invert (m terms, h terms) per output block into, per product, its (block index, sign) list."""
    m_to = [[] for _ in range(n_m)]
    h_to = [[] for _ in range(10)]
    for j, (mt, ht) in enumerate(out_terms):
        for t in mt:
            m_to[abs(t) - 1].append((j, 1 if t > 0 else -1))
        for t in ht:
            h_to[abs(t) - 1].append((j, 1 if t > 0 else -1))
    return m_to, h_to


_S1_M_TO, _S1_H_TO = _targets(STAGE1_OUT, len(STAGE1_M))
_S2_M_TO, _S2_H_TO = _targets(STAGE2_OUT, len(STAGE2_M))


def _scatter(blocks: list[torch.Tensor], prod: torch.Tensor, targets) -> None:
    """Add ±prod into each target block (the product is freed by the caller right after: one
    product of (L/4)² lives at a time, the output placeholder holds the sums)."""
    for j, sign in targets:
        blocks[j].add_(prod, alpha=sign)


def _products(left, right, out, m_spec, m_to, h_spec, h_to, full, half) -> None:
    """One level of either algorithm: each product of block combinations (full, then half: the
    same problem a quarter the size) added into the output blocks it feeds, then freed."""
    for (lt, rt), to in zip(m_spec, m_to):
        _scatter(out, full(_combine(left, lt), _combine(right, rt)), to)
    for (lt, rt), to in zip(h_spec, h_to):
        _scatter(out, half(_combine(left, lt), _combine(right, rt)), to)


def _fits(length: int, dim: int) -> bool:
    return length % 4 == 0 and dim % 4 == 0 and length >= 4 and dim >= 4


def masked_product(a: torch.Tensor, b: torch.Tensor, depth: int = 1, base: int = 64) -> torch.Tensor:
    """Mask(a·bᵀ) — [..., L, L], zero above the diagonal — for a, b [..., L, d]: Algorithm 1 at
    ``depth`` levels (L and d divisible by 4^depth), row blocks of ``base`` at the bottom."""
    L, d = a.shape[-2], a.shape[-1]
    if depth == 0 or not _fits(L, d):
        return _masked_rows(a, b, base)
    out = a.new_zeros((*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), L, L))
    _products(_blocks(a), _blocks(b), _tri_blocks(out), STAGE1_M, _S1_M_TO, STAGE1_H, _S1_H_TO,
              lambda x, y: _mm(x, y.transpose(-1, -2)), lambda x, y: masked_product(x, y, depth - 1, base))
    return out.tril_()  # the diagonal blocks' upper parts hold sums of full products


def _row_scales(x: torch.Tensor) -> torch.Tensor:
    """[..., L, 1]: per row of x the power of two that brings its largest |x| into [1/2, 1) (1 for a
    zero row; between 2⁻⁶⁰ and 2⁶⁰)."""
    top = x.abs().amax(-1, keepdim=True)
    e = torch.frexp(top).exponent.clamp_(-60, 60)
    return torch.where(top > 0, torch.ldexp(torch.ones_like(top), -e), torch.ones_like(top))


def scaled_masked_product(a: torch.Tensor, b: torch.Tensor, depth: int = 1, base: int = 64) -> torch.Tensor:
    """masked_product with each row of a and of b scaled by a power of two first (_row_scales) and
    the product's entries unscaled after (exact). Algorithm 1 adds rows of different blocks into one
    operand, so a product's rounding error follows the largest rows it combines: one token far
    larger than the rest would set the error of rows that never see it. With the rows brought to
    one range, each entry's error is the plain product's bound times the identities' small constant."""
    ra, rb = _row_scales(a), _row_scales(b)
    return masked_product(a * ra, b * rb, depth, base).div_(ra).div_(rb.transpose(-1, -2))


def _masked_rows(a: torch.Tensor, b: torch.Tensor, t: int) -> torch.Tensor:
    """Mask(a·bᵀ) by row blocks of t: rows [i·t, (i+1)·t) against keys < (i+1)·t."""
    L = a.shape[-2]
    out = a.new_zeros((*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), L, L))
    for r0 in range(0, L, t):
        r1 = min(r0 + t, L)
        out[..., r0:r1, :r1] = _mm(a[..., r0:r1, :], b[..., :r1, :].transpose(-1, -2))
    return out.tril_()


def tri_product(p: torch.Tensor, v: torch.Tensor, depth: int = 1, base: int = 64) -> torch.Tensor:
    """p·v for lower-triangular p [..., L, L] (zeros above the diagonal) and v [..., L, d]:
    Algorithm 2 at ``depth`` levels, row blocks of ``base`` at the bottom."""
    L, d = v.shape[-2], v.shape[-1]
    if depth == 0 or not _fits(L, d):
        return _tri_rows(p, v, base)
    out = v.new_zeros((*torch.broadcast_shapes(p.shape[:-2], v.shape[:-2]), L, d))
    _products(_tri_blocks(p), _blocks(v), _blocks(out), STAGE2_M, _S2_M_TO, STAGE2_H, _S2_H_TO, _mm,
              lambda x, y: tri_product(x, y, depth - 1, base))
    return out


def _tri_rows(p: torch.Tensor, v: torch.Tensor, t: int) -> torch.Tensor:
    """p·v by row blocks of t, each against the columns < its end (the rest of the rows is zero)."""
    L = v.shape[-2]
    rows = []
    for r0 in range(0, L, t):
        r1 = min(r0 + t, L)
        rows.append(_mm(p[..., r0:r1, :r1], v[..., :r1, :]))
    return torch.cat(rows, dim=-2)


def upper_product(p: torch.Tensor, x: torch.Tensor, depth: int = 1, base: int = 64) -> torch.Tensor:
    """pᵀ·x for lower-triangular p [..., L, L] (zeros above the diagonal), x [..., L, d]: pᵀ is
    upper-triangular, and J·pᵀ·J (J the order reversal) lower-triangular, so pᵀx = J·((J pᵀ J)(J x))."""
    flipped = p.transpose(-1, -2).flip(-1, -2)
    return tri_product(flipped, x.flip(-2), depth, base).flip(-2)


def _padded(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """t [..., L, d] zero-padded at the end to [..., length, dim] (t itself when it fits)."""
    L, d = t.shape[-2], t.shape[-1]
    if (L, d) == (length, dim):
        return t
    return torch.nn.functional.pad(t, (0, dim - d, 0, length - L))


def _depth_allowed(length: int, dim: int, depth: int) -> int:
    """The depth the blocks allow: each level needs L and d divisible by 4, blocks of ≥ 4 rows."""
    while depth and (length < 4 ** depth or dim < 4 ** depth):
        depth -= 1
    return depth


class _ECA(torch.autograd.Function):
    """Causal attention on [..., L, d] through the two stages; saves P (L × L per batch·head)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, depth: int, base: int):
        L, d = q.shape[-2], q.shape[-1]
        step = 4 ** depth
        Lp, dp = -(-L // step) * step, -(-d // step) * step
        qp, kp, vp = (_padded(t, Lp, dp) for t in (q, k, v))
        s = scaled_masked_product(qp, kp, depth, base).mul_(scale)
        s.masked_fill_(_upper(Lp, s.device), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1)
        del s
        out = tri_product(p, vp, depth, base)[..., :L, :d]
        ctx.save_for_backward(qp, kp, vp, p)
        ctx.shape, ctx.scale, ctx.depth, ctx.base = (L, d), scale, depth, base
        return out, lse[..., :L]

    @staticmethod
    def backward(ctx, d_out, d_lse):
        qp, kp, vp, p = ctx.saved_tensors
        (L, d), scale, depth, base = ctx.shape, ctx.scale, ctx.depth, ctx.base
        Lp, dp = qp.shape[-2], qp.shape[-1]
        dop = _padded(d_out, Lp, dp)
        dv = upper_product(p, dop, depth, base)
        dp_ = scaled_masked_product(dop, vp, depth, base)
        # dS = P ⊙ (dP − rowsum(P ⊙ dP)); an lse gradient adds P ⊙ dlse (∂lse/∂s = P)
        ds = dp_.sub_((p * dp_).sum(-1, keepdim=True))
        if d_lse is not None:
            ds.add_(_padded(d_lse[..., None], Lp, 1))
        ds.mul_(p)
        dq = tri_product(ds, kp, depth, base).mul_(scale)
        dk = upper_product(ds, qp, depth, base).mul_(scale)
        return dq[..., :L, :d], dk[..., :L, :d], dv[..., :L, :d], None, None, None


_UPPER: dict = {}


def _upper(n: int, device) -> torch.Tensor:
    """Boolean [n, n], True strictly above the diagonal (cached per size and device)."""
    key = (n, str(device))
    m = _UPPER.get(key)
    if m is None:
        if len(_UPPER) > 8:
            _UPPER.clear()
        m = _UPPER[key] = torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)
    return m


# The smallest key count from which ECA measured faster than the reference backend's causal path
# on the CPU (benchmarks/eca.py); None: nowhere, and ``backend="auto"`` never takes ECA.
AUTO_MIN_KEYS: Optional[int] = None


def faster_than_reference(keys: int, head_dim: int) -> bool:
    """Whether ``backend="auto"`` takes ECA for a causal CPU call with this many keys."""
    return AUTO_MIN_KEYS is not None and keys >= AUTO_MIN_KEYS


DEPTH = 1   # levels of the identities (the half products recurse); measured in benchmarks/eca.py
BASE = 128  # rows per block of the bottom level's triangular products


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, depth: Optional[int] = None,
              base: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of q, k, v [..., L, d] (one length: query i sees keys ≤ i) →
    (out [..., L, d], lse [..., L] natural-log float). Half precision is computed in float32.
    Differentiable in q, k and v."""
    depth = DEPTH if depth is None else depth
    base = BASE if base is None else base
    dtype = q.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    depth = _depth_allowed(q.shape[-2], q.shape[-1], depth)
    if depth and not all(bool(torch.isfinite(t).all()) for t in (q, k, v)):
        # the identities add rows of different blocks into one operand: an inf or NaN would reach
        # rows that never see its token (their logits, before the mask). Row blocks do not mix rows.
        depth = 0
    out, lse = _ECA.apply(q.to(work), k.to(work), v.to(work), float(scale), depth, base)
    return out.to(dtype), lse.float()
