"""Swin's relative-position biases: v2's continuous bias (the table, its MLP and the gather in one
launch, the gradient in two) and v1's learned table (the gather in one launch, its gradient in one).

Both index a table of the (2·wh − 1)(2·ww − 1) relative offsets of two tokens of a wh × ww window,

    bias[h, i, j] = table[t(i, j), h]
    t(i, j) = (yi − yj + wh − 1) · (2·ww − 1) + (xi − xj + ww − 1)

for tokens i = (yi, xi), j = (yj, xj) numbered row-major (T = (2·wh − 1)(2·ww − 1) entries; t(i, j) is
timm's ``relative_position_index``, which timm always builds by this formula from the window size:
the kernels derive it, they never read the index). Every block gathers its bias in every forward.

Swin v1 (timm's ``swin_transformer.WindowAttention``) learns the table [T, H] itself. With torch ops
the gather is a launch or two, and its gradient a scatter-add into a zeroed table: eagerly
``index_put_`` sorts the indices first (several launches), in a compiled graph a zeroing kernel and
an atomic scatter whose order of additions varies between runs.

- :func:`relative_position_bias`: :func:`_table_gather_kernel` (grid H × wh) forms the bias rows of a
  window's token row from the table, float32; the gradient is :func:`_dz_kernel`'s fixed-order sum
  of the bias gradient over the token pairs that read each entry, in float32 in the table's layout
  — one launch, no zeroing, no atomics (and a cast for a table of another dtype).

Swin v2 (timm's ``swin_transformer_v2.WindowAttention``) makes its table with a two-layer MLP of the
relative coordinates,

    z = relu(coords · W1ᵀ + b1) · W2ᵀ               coords [T, 2], W1 [C, 2], b1 [C], W2 [H, C]
    table = 16 · sigmoid(z)

With torch ops that is four launches (two GEMMs, the bias and ReLU, the sigmoid and the gather) and
in the backward about eight (the gather's scatter-add into a zeroed table, the sigmoid's and ReLU's
backward, three GEMMs, the bias's sum), each a few microseconds of GPU work: in a training step
paced by the host's launches, a tenth of the launches.

- :func:`continuous_position_bias`, forward (:func:`_cpb_fwd_kernel`, grid H × wh): a program per
  head and token row of the window forms 16·sigmoid(z) for the table entries that row's bias reads
  (a contiguous run of wh·(2·ww − 1) of them), with the hidden layer in C-wide chunks in registers,
  writes its share of s = 16·sigmoid(z) [H, T] (kept for the backward) and gathers its bias rows
  (N = wh·ww).
- backward: :func:`_dz_kernel` sums each table entry's bias gradient over the token pairs that read
  it, dz[h, t] = s(1 − s/16) · Σ_i dbias[h, i, i − offset(t)], in a fixed order;
  :func:`_cpb_dparams_kernel` (grid C / 16) recomputes a chunk of the hidden layer and forms
  dW2 = dzᵀ·relu(·), the hidden gradient dz·W2 masked by the ReLU, dW1 and db1 from it.

Arithmetic: float32 throughout, whatever the parameters' dtype (timm's v2 module under autocast runs
its MLP in the autocast dtype; this is the same function, rounded less); products as float32 fused
multiply-adds (the backward's by ``tl.dot`` in IEEE float32). The sums run in other orders than
PyTorch's, so results agree to float32 rounding. No atomics: the backward is deterministic.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, cdiv, launch, on_device
from .limits import POSITION_BIAS_DTYPES as DTYPES
from .ops import AUTOGRAD, COMPILED, check_first_order, double_backward_error, register, route

# tile shapes (the kernels are latency-bound: many short programs, few steps each)
FWD_BLOCK_U, FWD_BLOCK_C = 128, 32      # table entries × hidden units per step of the forward
FWD_WARPS = 8                           # (the fastest of 64/128 entries × 16/32/64 units × 2/4/8 warps; swinv2_cpb_fwd_sweep.txt)
DZ_BLOCK_T, DZ_BLOCK_I = 32, 64         # table entries per program × token rows per step (dz)
DP_BLOCK_T, DP_BLOCK_C = 64, 16         # table entries per step × hidden units per program (dparams)
BLOCK_E = 1024                          # bias entries per step of the forward's gather
NUM_WARPS = 4
if INTERPRET:  # (the interpreter's cost is per step: fewer, larger ones)
    FWD_BLOCK_U, FWD_BLOCK_C, BLOCK_E = 256, 512, 4096
    DZ_BLOCK_T, DZ_BLOCK_I, DP_BLOCK_T, DP_BLOCK_C = 256, 256, 256, 128


@triton.jit
def _coords(Coords, offs_t, t_ok):
    """The (y, x) columns of the table entries offs_t, float32 (0 outside T)."""
    c0 = tl.load(Coords + offs_t * 2, mask=t_ok, other=0.0).to(tl.float32)
    c1 = tl.load(Coords + offs_t * 2 + 1, mask=t_ok, other=0.0).to(tl.float32)
    return c0, c1


@triton.jit
def _pre(c0, c1, W1, B1, t_ok, offs_c, c_ok):
    """The hidden layer's input, coords · W1ᵀ + b1, [BLOCK_T, BLOCK_C] float32 (0 outside T × C), for
    the entries whose coordinates are c0, c1 (:func:`_coords`)."""
    w0 = tl.load(W1 + offs_c * 2, mask=c_ok, other=0.0).to(tl.float32)
    w1 = tl.load(W1 + offs_c * 2 + 1, mask=c_ok, other=0.0).to(tl.float32)
    b = tl.load(B1 + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    pre = c0[:, None] * w0[None, :] + c1[:, None] * w1[None, :] + b[None, :]
    return tl.where(t_ok[:, None] & c_ok[None, :], pre, 0.0)


@triton.jit
def _relu(x):
    # PyTorch's: NaN stays NaN (the GPU's max.f32 would return the other operand, 0)
    return tl.where(x < 0.0, 0.0, x)


@triton.jit
def _entry(yi, xi, j, WH, WW):
    """t(i, j) for token i = (yi, xi) and token index j of a WH × WW window (module docstring)."""
    return (yi - j // WW + WH - 1) * (2 * WW - 1) + (xi - j % WW + WW - 1)


@triton.jit
def _row_entries(e, WH, WW):
    """For entry e of the bias rows of a token row y ([WW, N] row-major: i = y·WW + e // N, j = e mod N),
    t(i, j) − y·(2·WW − 1): the entries a token row reads are a contiguous run from y·(2·WW − 1)."""
    N = WH * WW
    return _entry(0, e // N, e % N, WH, WW)


@triton.jit
def _table_gather_kernel(Table, Bias, H, WH, WW, BLOCK_E: tl.constexpr):
    """Grid (H, WH): program (h, y) writes head h's bias rows of the window's token row y,
    Bias[h, y·WW + a, j] = Table[t, h] (t = t(i, j)), float32. Table [T, H] contiguous (any float
    dtype), Bias [H, N, N] contiguous."""
    h = tl.program_id(0)
    y = tl.program_id(1)
    N = WH * WW
    t0 = y * (2 * WW - 1)
    out = Bias + (h * N + y * WW).to(tl.int64) * N
    for e0 in range(0, WW * N, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        ok = e < WW * N
        t = t0 + _row_entries(e, WH, WW)
        tl.store(out + e, tl.load(Table + t * H + h, mask=ok, other=0.0).to(tl.float32), mask=ok)


@triton.jit
def _cpb_fwd_kernel(Coords, W1, B1, W2, Bias, S, Z, T, C, WH, WW,
                    BLOCK_U: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    """Grid (H, WH): program (h, y) makes head h's bias rows of the window's token row y, i = y·WW + a
    (a < WW). Coords [T, 2], W1 [C, 2], B1 [C], W2 [H, C] contiguous (any float dtype) → Bias [H, N, N]
    (N = WH·WW) and S [H, T] = 16·sigmoid(z) float32, contiguous; Z [H, WH, U] float32 scratch.

    The rows of token row y read the table entries t in [y·W2D, y·W2D + U), U = WH·W2D, W2D = 2·WW − 1
    (yi − yj + WH − 1 runs over y … y + WH − 1): the program computes 16·sigmoid(z) for those into its
    own Z row, writes S for t in [y·W2D, (y + 1)·W2D) (the last row: up to T; so every entry once),
    and gathers its rows from its Z row."""
    h = tl.program_id(0)
    y = tl.program_id(1)
    W2D = 2 * WW - 1
    U = WH * W2D
    t0 = y * W2D
    zrow = Z + (h * WH + y).to(tl.int64) * U
    for u0 in range(0, U, BLOCK_U):
        offs_u = u0 + tl.arange(0, BLOCK_U)
        u_ok = offs_u < U
        offs_t = t0 + offs_u
        cy, cx = _coords(Coords, offs_t, u_ok)
        z = tl.zeros([BLOCK_U], tl.float32)
        for k0 in range(0, C, BLOCK_C):
            offs_c = k0 + tl.arange(0, BLOCK_C)
            c_ok = offs_c < C
            hid = _relu(_pre(cy, cx, W1, B1, u_ok, offs_c, c_ok))
            w2 = tl.load(W2 + h * C + offs_c, mask=c_ok, other=0.0).to(tl.float32)
            z += tl.sum(hid * w2[None, :], axis=1)
        s = 16.0 * tl.sigmoid(z)
        tl.store(zrow + offs_u, s, mask=u_ok)
        tl.store(S + h * T + offs_t, s, mask=u_ok & ((offs_u < W2D) | (y == WH - 1)))
    # the gather reads entries other threads of this program wrote: the barrier orders those stores
    # before these loads (a CTA-wide barrier makes its threads' global writes visible to each other)
    tl.debug_barrier()
    N = WH * WW
    out = Bias + (h * N + y * WW).to(tl.int64) * N
    for e0 in range(0, WW * N, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        ok = e < WW * N
        tl.store(out + e, tl.load(zrow + _row_entries(e, WH, WW), mask=ok, other=0.0), mask=ok)


@triton.jit
def _dz_kernel(DBias, S, DZ, T, WH, WW, sd_h, sd_i, sd_j, so_h, so_t, SIGMOID: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    """Grid (H, cdiv(T, BLOCK_T)). DBias [H, N, N] (strides sd_*) → DZ[h, t] (strides so_h, so_t, stored
    in DZ's dtype): for each table entry t, the bias gradient of the token pairs (i, j) that read it
    (j = i − offset(t), one per row i that has it) summed in a fixed order (BLOCK_I rows at a time);
    with SIGMOID, times 16·σ' from S [H, T] = 16·sigmoid(z) (v2's dz; v1's is the table's gradient)."""
    h = tl.program_id(0).to(tl.int64)
    N = WH * WW
    W2D = 2 * WW - 1
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    dy = offs_t // W2D - (WH - 1)   # yi − yj of the pairs entry t serves
    dx = offs_t % W2D - (WW - 1)    # xi − xj
    acc = tl.zeros([BLOCK_T], tl.float32)
    for i0 in range(0, N, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        yj = (i // WW)[None, :] - dy[:, None]
        xj = (i % WW)[None, :] - dx[:, None]
        ok = t_ok[:, None] & (i < N)[None, :] & (yj >= 0) & (yj < WH) & (xj >= 0) & (xj < WW)
        j = yj * WW + xj
        vals = tl.load(DBias + h * sd_h + i[None, :].to(tl.int64) * sd_i + j * sd_j, mask=ok, other=0.0)
        acc += tl.sum(vals.to(tl.float32), axis=1)
    if SIGMOID:
        s = tl.load(S + h * T + offs_t, mask=t_ok, other=0.0)
        acc = acc * s * (1.0 - s * 0.0625)
    tl.store(DZ + h * so_h + offs_t * so_t, acc.to(DZ.dtype.element_ty), mask=t_ok)


@triton.jit
def _cpb_dparams_kernel(Coords, W1, B1, W2, DZ, DW1, DB1, DW2, T, C, H,
                        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (cdiv(C, BLOCK_C),): the parameters' gradients for hidden units [pid·BLOCK_C, +BLOCK_C) from
    DZ [H, T]: DW2 [H, C] = dzᵀ·relu(pre), DW1 [C, 2] and DB1 [C] from dh = dz·W2 masked by pre > 0,
    summed over the T table entries (stored in the dtypes of DW1, DB1, DW2)."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    hc_ok = h_ok[:, None] & c_ok[None, :]
    w2 = tl.load(W2 + offs_h[:, None] * C + offs_c[None, :], mask=hc_ok, other=0.0).to(tl.float32)
    dw2 = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    dw1_y = tl.zeros([BLOCK_C], tl.float32)
    dw1_x = tl.zeros([BLOCK_C], tl.float32)
    db1 = tl.zeros([BLOCK_C], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        cy, cx = _coords(Coords, offs_t, t_ok)
        pre = _pre(cy, cx, W1, B1, t_ok, offs_c, c_ok)
        dz = tl.load(DZ + offs_h[:, None] * T + offs_t[None, :], mask=h_ok[:, None] & t_ok[None, :], other=0.0)
        dw2 += tl.dot(dz, _relu(pre), input_precision="ieee")
        dh = tl.dot(tl.trans(dz), w2, input_precision="ieee")
        dh = tl.where(pre <= 0.0, 0.0, dh)  # (ReLU's gradient as PyTorch's: 0 where pre ≤ 0; NaN passes)
        dw1_y += tl.sum(dh * cy[:, None], axis=0)
        dw1_x += tl.sum(dh * cx[:, None], axis=0)
        db1 += tl.sum(dh, axis=0)
    tl.store(DW2 + offs_h[:, None] * C + offs_c[None, :], dw2.to(DW2.dtype.element_ty), mask=hc_ok)
    tl.store(DW1 + offs_c * 2, dw1_y.to(DW1.dtype.element_ty), mask=c_ok)
    tl.store(DW1 + offs_c * 2 + 1, dw1_x.to(DW1.dtype.element_ty), mask=c_ok)
    tl.store(DB1 + offs_c, db1.to(DB1.dtype.element_ty), mask=c_ok)


def _forward(coords: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, wh: int,
             ww: int) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (bias [H, N, N], s [H, T]) float32 (arguments checked by :func:`continuous_position_bias`)."""
    H, C = w2.shape
    T, N = coords.shape[0], wh * ww
    bias = torch.empty(H, N, N, dtype=torch.float32, device=w2.device)
    s = torch.empty(H, T, dtype=torch.float32, device=w2.device)
    z = torch.empty(H, wh, wh * (2 * ww - 1), dtype=torch.float32, device=w2.device)
    launch(_cpb_fwd_kernel, (H, wh), coords, w1, b1, w2, bias, s, z, T, C, wh, ww,
           BLOCK_U=FWD_BLOCK_U, BLOCK_C=FWD_BLOCK_C, BLOCK_E=BLOCK_E, num_warps=FWD_WARPS)
    return bias, s


def _backward(dbias: torch.Tensor, s: torch.Tensor, coords: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
              w2: torch.Tensor, wh: int, ww: int) -> list[torch.Tensor]:
    """dbias [H, N, N] (any strides) → [dW1, db1, dW2] in the parameters' dtypes."""
    H, C = w2.shape
    T = coords.shape[0]
    dz = torch.empty(H, T, dtype=torch.float32, device=w2.device)
    launch(_dz_kernel, (H, cdiv(T, DZ_BLOCK_T)), dbias, s, dz, T, wh, ww, *dbias.stride(), T, 1,
           SIGMOID=True, BLOCK_T=DZ_BLOCK_T, BLOCK_I=DZ_BLOCK_I, num_warps=NUM_WARPS)
    dw1, db1, dw2 = (torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in (w1, b1, w2))
    launch(_cpb_dparams_kernel, (cdiv(C, DP_BLOCK_C),), coords, w1, b1, w2, dz, dw1, db1, dw2, T, C, H,
           BLOCK_T=DP_BLOCK_T, BLOCK_C=DP_BLOCK_C, BLOCK_H=max(16, triton.next_power_of_2(H)),
           num_warps=NUM_WARPS)
    return [dw1, db1, dw2]


def _table_forward(table: torch.Tensor, wh: int, ww: int) -> torch.Tensor:
    """table [T, H] contiguous → bias [H, N, N] float32 (arguments checked by :func:`relative_position_bias`)."""
    H = table.shape[1]
    N = wh * ww
    bias = torch.empty(H, N, N, dtype=torch.float32, device=table.device)
    launch(_table_gather_kernel, (H, wh), table, bias, H, wh, ww, BLOCK_E=BLOCK_E, num_warps=NUM_WARPS)
    return bias


def _table_backward(dbias: torch.Tensor, T: int, H: int, wh: int, ww: int) -> torch.Tensor:
    """dbias [H, N, N] (any strides) → the table's gradient [T, H] float32 (the callers cast it to the
    table's dtype: the table itself is not kept for the backward, so that an in-place update of it
    before the backward is no error, as with timm's gather)."""
    dtable = torch.empty(T, H, dtype=torch.float32, device=dbias.device)
    launch(_dz_kernel, (H, cdiv(T, DZ_BLOCK_T)), dbias, dbias, dtable, T, wh, ww, *dbias.stride(), 1, H,
           SIGMOID=False, BLOCK_T=DZ_BLOCK_T, BLOCK_I=DZ_BLOCK_I, num_warps=NUM_WARPS)
    return dtable


# torch.compile's path: inductor launches the kernels itself (see ops.py), autograd on the ops
FWD = register("elsa_vision::swin_cpb_fwd", _forward)
BWD = register("elsa_vision::swin_cpb_bwd", _backward)
TABLE_FWD = register("elsa_vision::swin_table_bias_fwd", _table_forward)
TABLE_BWD = register("elsa_vision::swin_table_bias_bwd", _table_backward)


def _setup(ctx, inputs, output) -> None:
    coords, w1, b1, w2, wh, ww = inputs
    ctx.save_for_backward(output[1], coords, w1, b1, w2)
    ctx.window = (wh, ww)


def _op_backward(ctx, dbias, _ds):
    dw1, db1, dw2 = BWD(dbias, *ctx.saved_tensors, *ctx.window)
    return None, dw1, db1, dw2, None, None


def _table_setup(ctx, inputs, output) -> None:
    table, wh, ww = inputs
    ctx.table = (*table.shape, wh, ww)
    ctx.dtype = table.dtype


def _table_op_backward(ctx, dbias):
    return TABLE_BWD(dbias, *ctx.table).to(ctx.dtype), None, None


def _refuse_double_backward(what: str):
    def backward(ctx, *grads):
        raise double_backward_error(what)
    return backward


FWD.register_autograd(_op_backward, setup_context=_setup)
BWD.register_autograd(_refuse_double_backward("continuous_position_bias"),
                      setup_context=lambda ctx, inputs, output: None)
TABLE_FWD.register_autograd(_table_op_backward, setup_context=_table_setup)
TABLE_BWD.register_autograd(_refuse_double_backward("relative_position_bias"),
                            setup_context=lambda ctx, inputs, output: None)


class _Function(torch.autograd.Function):
    """The eager path: the same launches without the custom op's dispatch."""

    @staticmethod
    def forward(ctx, coords, w1, b1, w2, wh, ww):
        bias, s = _forward(coords, w1, b1, w2, wh, ww)
        _setup(ctx, (coords, w1, b1, w2, wh, ww), (bias, s))
        return bias

    @staticmethod
    def backward(ctx, dbias):
        check_first_order("continuous_position_bias")
        dw1, db1, dw2 = _backward(dbias, *ctx.saved_tensors, *ctx.window)
        return None, dw1, db1, dw2, None, None


class _TableFunction(torch.autograd.Function):
    """The eager path of :func:`relative_position_bias`."""

    @staticmethod
    def forward(ctx, table, wh, ww):
        bias = _table_forward(table, wh, ww)
        _table_setup(ctx, (table, wh, ww), bias)
        return bias

    @staticmethod
    def backward(ctx, dbias):
        check_first_order("relative_position_bias")
        return _table_backward(dbias, *ctx.table).to(ctx.dtype), None, None


def _window(what: str, window, table: torch.Tensor, name: str, cols: Optional[int]) -> tuple[int, int]:
    """(wh, ww) of ``window``, checked against the rows of ``table`` (and its columns, ``cols`` if given)."""
    if len(window) != 2 or not all(hasattr(type(w), "__index__") and not isinstance(w, bool) for w in window):
        raise ValueError(f"{what}: window must be two ints (wh, ww), got {tuple(window)!r}")
    wh, ww = (int(w) for w in window)
    T = (2 * wh - 1) * (2 * ww - 1)
    if wh < 1 or ww < 1 or table.dim() != 2 or table.shape[0] != T or (cols is not None and table.shape[1] != cols):
        raise ValueError(f"{what}: {name} must be [(2·wh − 1)(2·ww − 1), {cols or 'heads'}] = "
                         f"[{T}, {cols or 'heads'}] for the window {(wh, ww)}, got {tuple(table.shape)}")
    return wh, ww


def _check_tensors(what: str, tensors: tuple) -> None:
    if any(t.dtype not in DTYPES for t in tensors) or len({t.device for t in tensors}) != 1:
        raise ValueError(f"{what}: tables and parameters must be float32, bfloat16 or float16 on one device, got "
                         f"{[(t.dtype, str(t.device)) for t in tensors]}")
    if not (tensors[0].is_cuda or INTERPRET):
        raise ValueError(f"{what} runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1)")


@on_device
def continuous_position_bias(coords: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                             window: tuple[int, int]) -> torch.Tensor:
    """Swin v2's relative-position bias of a window (wh, ww) = ``window``: coords [T, 2] (its
    ``relative_coords_table`` viewed as rows, T = (2·wh − 1)(2·ww − 1), no gradient), the MLP's
    W1 [C, 2], b1 [C], W2 [H, C] (``cpb_mlp[0].weight``, ``cpb_mlp[0].bias``, ``cpb_mlp[2].weight``)
    → bias [H, N, N] float32, N = wh·ww: 16·sigmoid(MLP(coords))[t(i, j)] with timm's relative
    position index t (module docstring). Differentiable in W1, b1 and W2 (first order)."""
    wh, ww = _window("continuous_position_bias", window, coords, "coords", 2)
    C = w1.shape[0]
    if w1.shape != (C, 2) or b1.shape != (C,) or w2.dim() != 2 or w2.shape[1] != C:
        raise ValueError(f"continuous_position_bias: W1 [C, 2], b1 [C], W2 [H, C] expected, got "
                         f"{tuple(w1.shape)}, {tuple(b1.shape)}, {tuple(w2.shape)}")
    _check_tensors("continuous_position_bias", (coords, w1, b1, w2))
    coords, w1, b1, w2 = (t.contiguous() for t in (coords, w1, b1, w2))
    how = route("continuous_position_bias", (w1, b1, w2))
    if how is COMPILED:
        return FWD(coords, w1, b1, w2, wh, ww)[0]
    if how is AUTOGRAD:
        return _Function.apply(coords, w1, b1, w2, wh, ww)
    return _forward(coords, w1, b1, w2, wh, ww)[0]


@on_device
def relative_position_bias(table: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """Swin v1's relative-position bias of a window (wh, ww) = ``window``: table [T, H] (its
    ``relative_position_bias_table``, T = (2·wh − 1)(2·ww − 1)) → bias [H, N, N] float32, N = wh·ww,
    bias[h, i, j] = table[t(i, j), h] with timm's relative position index t (module docstring): the
    table's values, exactly. Differentiable in the table (first order): its gradient is summed over
    the token pairs of each entry in float32, in a fixed order, and returned in the table's dtype."""
    wh, ww = _window("relative_position_bias", window, table, "the table", None)
    _check_tensors("relative_position_bias", (table,))
    table = table.contiguous()
    how = route("relative_position_bias", (table,))
    if how is COMPILED:
        return TABLE_FWD(table, wh, ww)
    if how is AUTOGRAD:
        return _TableFunction.apply(table, wh, ww)
    return _table_forward(table, wh, ww)
