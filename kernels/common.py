"""Shared ``@triton.jit`` building blocks of the kernel families, and the constants they share.

Precision codes. Every kernel takes its float32 matmul mode as the constexpr ``PREC``:

  IEEE    strict float32 (FMA products)
  (2)     the tensor core's tf32 product (operands rounded to nearest first), the code no kernel
          tests for (every other branch falls to it); also the code of half-precision inputs,
          which always take their own tensor-core product
  TF32X3  3xTF32: each operand split into tf32 hi + lo parts, three products (an operand reused
          across a loop is split once per program, not once per dot)
  FP16X3  each operand scaled by a power of two, then split into float16 hi + lo parts: the same
          22 significant bits as a tf32 pair, on MMAs of twice tf32's rate, with operands of half
          the size (the scales come from the kernel family's own scale pass)

Interpreter. Under ``TRITON_INTERPRET=1`` the same kernels run on the CPU with NumPy; the flags
below make the interpreter compute what the GPU computes (see each one's comment).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .launch import INTERPRET

PRECISION_CODES = {"ieee": 0, "tf32": 2, "native": 2, "tf32x3": 3, "fp16x3": 4}
IEEE = tl.constexpr(0)
TF32X3 = tl.constexpr(3)
FP16X3 = tl.constexpr(4)

LOG2E = 1.4426950408889634   # host side: log2(e), folded into the scale of exp2-based softmaxes
LN2 = 0.6931471805599453
C_LOG2E = tl.constexpr(LOG2E)  # the same inside kernels (a kernel reads globals only as constexprs)
C_LN2 = tl.constexpr(LN2)

# Triton's CPU interpreter multiplies bfloat16 operands as raw bits; there, half operands are widened
# to float32 first, which computes the same exact products with float32 accumulation.
WIDEN_HALF = tl.constexpr(INTERPRET)
# Triton's CPU interpreter truncates float32 → bfloat16; the GPU rounds to nearest even. cast rounds
# explicitly there, so that CPU tests see the GPU's arithmetic.
_RNE_BF16 = tl.constexpr(INTERPRET)
# The pre-split 3xTF32 path only means something on tensor cores (exact products of tf32 parts).
# The interpreter's dots are plain float32 already; emulating the split there adds two extra float32
# roundings the GPU does not have, so it runs the plain float32 dot instead.
SPLIT3 = tl.constexpr(not INTERPRET)


@triton.jit
def cast(x, dt: tl.constexpr):
    """x.to(dt), rounding to nearest even (see _RNE_BF16)."""
    if _RNE_BF16 and dt == tl.bfloat16:
        b = x.to(tl.float32).to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        x = b.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def fma(a, b, c):
    """a·b + c rounded once, b and c broadcast to a's shape. Logits with a bias, q·k·scale + b, are
    formed with it: written as a product and a sum, the compiler contracts them into one FMA or
    not, per kernel: in float32 the dK/dV kernel's P then differed from the forward's by an ulp of
    the logit (7.6e-6 relative at Swin v2's ±100), no longer matched the saved statistics, and dV's
    error reached 4.6× PyTorch's."""
    return tl.fma(a, tl.broadcast_to(b, a.shape), tl.broadcast_to(c, a.shape))


@triton.jit
def dot(a, b, PREC: tl.constexpr):
    # Half-precision operands take the tensor-core path whatever PREC says; PREC picks the float32 mode.
    if WIDEN_HALF:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if PREC == IEEE:
        return tl.dot(a, b, input_precision="ieee")
    elif PREC >= TF32X3:
        return tl.dot(a, b, input_precision="tf32x3")
    elif a.dtype == tl.float32:
        # the tensor core truncates to tf32; rounding to nearest first halves the error (as cuBLAS does)
        return tl.dot(round_tf32(a), round_tf32(b))
    else:
        return tl.dot(a, b)


@triton.jit
def round_tf32(x):
    """float32 → nearest tf32 value (10 mantissa bits), ties away from zero, still stored as float32."""
    return ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def split_tf32(x):
    """x = hi + lo exactly, hi the nearest tf32 value (what a tf32 tensor-core op reads exactly)."""
    hi = round_tf32(x)
    return hi, x - hi


@triton.jit
def split_f16(x):
    """x = hi + lo, both float16, hi the nearest float16 value. For |x| ≥ 2⁻² the pair holds x to
    2⁻²² relative (as a tf32 pair does); below, lo is subnormal and the pair holds x to 2⁻²⁵
    absolute. x is pre-scaled so that its tensor's largest magnitude lies in [2^13, 2^14): every
    element within 2⁻¹⁵ of it keeps float32-class precision, the rest an absolute error 2⁻³⁸ of it."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def dot3(a_hi, a_lo, b_hi, b_lo):
    """3-pass product of pre-split operands (tf32 or float16 parts); the small cross terms first,
    a_lo·b_lo dropped (≈2⁻²²)."""
    if WIDEN_HALF and a_hi.dtype == tl.float16:
        a_hi, a_lo, b_hi, b_lo = a_hi.to(tl.float32), a_lo.to(tl.float32), b_hi.to(tl.float32), b_lo.to(tl.float32)
    return tl.dot(a_hi, b_hi, tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo)))


@triton.jit
def store_stats(Stats, bh, offs_m, row_ok, Nq, m, s, nonempty):
    """Row statistics (m, S) into Stats [BH, 2, Nq]; (+inf, 1) for a row that sees no key."""
    st = Stats + bh.to(tl.int64) * 2 * Nq + offs_m
    tl.store(st, tl.where(nonempty, m, float("inf")), mask=row_ok)
    tl.store(st + Nq, tl.where(nonempty, s, 1.0), mask=row_ok)


@triton.jit
def load_stats(Stats, bh, offs_m, row_ok, Nq, NATURAL: tl.constexpr, EXACT: tl.constexpr):
    """Per-row (m, 1/S) when EXACT (float32); else, in natural units (NATURAL: the logits carry a
    bias or mask), (m, ln S) apart, and in log2 units (lse, unused) with lse = m + log2 S folded.
    Apart, because a biased row's m can be huge: a row that a −1e9 fill masks everywhere has
    m ≈ −1e9, where float32's spacing is 64 and m + ln S rounds back to m (each key's P would come
    out 1, not 1/S). Unbiased logits stay folded (one subtraction less per element): they would
    need |q·k|·scale past 2^15 to lose half precision's resolution. Rows past Nq read (+inf, 1): P = 0
    there."""
    st = Stats + bh.to(tl.int64) * 2 * Nq + offs_m
    m = tl.load(st, mask=row_ok, other=float("inf"))
    s = tl.load(st + Nq, mask=row_ok, other=1.0)
    if EXACT:
        return m, 1.0 / s
    elif NATURAL:
        return m, tl.math.log2(s) * C_LN2
    else:
        return m + tl.math.log2(s), s


@triton.jit
def row_mean(delta, l):
    """delta / l per row (see _bwd_delta_kernel); delta (= 0) as is where a row sees no key."""
    return delta / tl.where(l > 0, l, 1.0)


@triton.jit
def finite_abs(x):
    """|x| where x is finite, else 0: what the fp16x3 scales are taken over. An inf or NaN element
    would otherwise set its head's (or column's) scale to the lowest power of two, and the float16
    parts of every other element of that head would underflow to zero (rows that do not see it
    would be silently wrong); with it left out, the rows that see it get inf or NaN, as in SDPA."""
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)  # (NaN < inf is false)


@triton.jit
def pow2_of(e):
    """2^e as float32 for integer e in [−126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exp_of(x):
    """floor(log2 |x|) of a normal float32 x, from its exponent bits."""
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def ds_units(r, D_PAD: tl.constexpr):
    """fp16x3: the power of two f_i that carries row i of dS (in units of c_dO·c_v) into float16
    range. P_ij·2^(−floor(log2 r_i)) < 2 (r_i = 1/S_i), and |dP − delta| ≤ 2·D·2^28 in those units,
    so dS·f_i ≤ 2^14 with f_i = 2^(−floor(log2 r_i) − 16) / D_PAD. Scaling by S_i, not a constant,
    matters: a row spread over N keys has P ≈ 1/N, which would leave its dS entries below float16's
    22-bit range of the split at N in the thousands."""
    return pow2_of(-exp_of(r) - 16) / D_PAD


@triton.jit
def dk_units(r, D_PAD: tl.constexpr):
    """fp16x3, dK = dSᵀ·q: (u, w) per query i (r_i = 1/S_i). dSᵀ's column i enters the split scaled
    by u_i = t_i·2⁻¹⁶/D_PAD, t_i = 2^min(−floor(log2 r_i), 10) ≈ S_i (as ds_units), and q's row i
    (its float16 parts, exact down to float16's subnormals) by w_i = 1/t_i: t_i cancels in dK. The
    cap keeps q's rows within 2⁻¹⁰ of their scaled range."""
    t = pow2_of(tl.minimum(-exp_of(r), 10))
    return t * (1.0 / 65536.0) / D_PAD, (1.0 / t).to(tl.float16)


@triton.jit
def pv(p, v, v_lo, PREC: tl.constexpr):
    """P·v [BM, D_PAD]; fp16x3: in units of 2^14·c_v (v's parts given), P split as P·2^14."""
    if PREC == FP16X3:
        p_hi, p_lo = split_f16(p * 16384.0)
        return dot3(p_hi, p_lo, v, v_lo)
    else:
        return dot(cast(p, v.dtype), v, PREC)


@triton.jit
def dot_nt(a, a_lo, b, b_lo, PREC: tl.constexpr):
    """a·bᵀ — dP = dO·vᵀ [BM, BN], or dPᵀ = v·dOᵀ — fp16x3: from the (hi, lo) parts, in units of
    c_a·c_b."""
    if PREC == FP16X3:
        return dot3(a, a_lo, tl.trans(b), tl.trans(b_lo))
    else:
        return dot(a, tl.trans(b), PREC)


@triton.jit
def ds_k(ds, f, k, k_lo, PREC: tl.constexpr):
    """dS·k [BM, D_PAD] (fp16x3: dS's rows scaled by f [BM] into float16 range, see
    ds_units; the result in units of f·c_k)."""
    if PREC == FP16X3:
        ds_hi, ds_lo = split_f16(ds * f[:, None])
        return dot3(ds_hi, ds_lo, k, k_lo)
    else:
        return dot(cast(ds, k.dtype), k, PREC)
