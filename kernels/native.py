"""Eager calls replayed from C++: a kernel family's host work recorded once per call signature
and replayed by ``native.cpp`` (a PyTorch C++ extension built on first use).

An eager call of a short attention problem (ViT's 197 tokens) is paced by the host: the entry
point's Python, the host body that allocates the outputs and binds the planned launches, and the
round trip of a Python ``autograd.Function``, several times the kernels' own GPU time. For a call
signature seen before, the host body's decisions are fixed (launch.Launch already keeps them); what
is left is binding addresses. So the first eager call of a signature runs the Python body as
usual while its launches (``launch.recording``) and allocations (a dispatch mode) are recorded, and
becomes a *recipe*: buffers to allocate, kernels to launch with their grids and arguments (each
pointer an input or buffer plus a byte offset; scalars as bits), outputs as views of buffers.
Later calls of the signature go to the extension: a C++ autograd function whose forward and
backward replay the recipes (cuLaunchKernel on the call's stream) — no Python between the entry
point and the launches, and no Python autograd round trip. A backward whose output-gradient layout
has no recipe yet runs the Python body once (called back from C++) and records it.

What a recipe may hold is checked when it is recorded, and a signature whose body does anything else
is left to the Python path for good (kept as refused): any aten operator other than an allocation or
a view (a fill, a reduction, a copy), an unplanned launch (the Gluon kernels' TMA launches are
planned: their tensor maps are encoded by the replay at each call's addresses), a kernel that needs
scratch memory, a cluster or a cooperative launch, a pointer argument that is not a fixed offset
from one input or buffer, an output that is not a view of a buffer in its dtype, a saved tensor that
is neither an input nor an output. The signature (``_key``) holds everything the host body decides
from: every tensor's shape, strides, dtype, device and address alignment (Triton specialises
pointers on it), which inputs share an address, the non-tensor arguments, the current device and
the per-call switches (see ``_key``). Replays are the recorded launches with the same compiled
kernels, so their results are bitwise the Python path's. Calls made while launches are traced or
skipped (``launch.tracing()``: torch.compile, the memory rehearsal) take the Python path.

Served: :class:`kernels.ops.KernelOp` families whose forward returns (out, statistics) (attention,
packed or not), on CUDA, where launch.FAST_LAUNCH holds (a checked Triton version) and no
profiler hook asks for Triton's own launches. The kernels are the ones the Python path chooses
(Gluon or portable). The environment variable ``ELSA_NATIVE=0`` turns it off. The extension is
compiled at the first eligible call (a C++ compiler and ninja are needed; about half a minute, once
per machine: torch's extension cache keeps the build, and later processes load it); if the build
fails, a warning says why and eager calls keep the Python path.
"""
from __future__ import annotations

import contextlib
import os
import re
import struct
import threading
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from triton import knobs as _knobs

from . import launch as _launch

_SOURCE = Path(__file__).with_name("native.cpp")

_ext = None            # the loaded extension
_state = "idle"        # idle → ready | failed | off
_why = ""              # why it is off or failed
_lock = threading.Lock()


def requested() -> bool:
    """Whether the environment leaves the native path on (ELSA_NATIVE unset or not "0")."""
    return os.environ.get("ELSA_NATIVE", "1").strip() != "0"


def status() -> tuple[str, str]:
    """(state, reason): state one of idle (not loaded yet), ready, failed, off."""
    return _state, _why


@contextlib.contextmanager
def python_path():
    """Inside, eager calls take the Python host path, with the kernels the replay would launch
    (benchmarks' A/B of the host paths, tests' reference results)."""
    global _python_only
    before, _python_only = _python_only, True
    try:
        yield
    finally:
        _python_only = before


_python_only = False


def _build():
    from torch.utils.cpp_extension import load as load_extension
    return load_extension(name="elsa_vision_native", sources=[str(_SOURCE)], extra_cflags=["-O2"], verbose=False)


def load() -> bool:
    """Build (or load torch's cached build of) the extension, once per process; whether it is ready.
    Called by the first eligible eager call; the environment switch and an unchecked Triton version
    turn it off, and a failed build leaves it off with a warning."""
    global _ext, _state, _why
    with _lock:
        if _state != "idle":
            return _state == "ready"
        if not requested():
            _state, _why = "off", "ELSA_NATIVE=0"
            return False
        if not _launch.FAST_LAUNCH or _launch.INTERPRET:
            _state, _why = "off", _launch.FAST_LAUNCH_OFF or "the Triton interpreter"
            return False
        try:
            _ext = _build()
            _ext.set_recorder(_record_backward)
            _state = "ready"
        except Exception as e:  # (no compiler, no ninja, headers missing: the Python path stays)
            _state, _why = "failed", f"{type(e).__name__}: {e}".strip()
            warnings.warn(f"elsa_vision: the native replay of eager calls could not be built "
                          f"({_why.splitlines()[0][:300]}); eager calls keep the Python host path. Set "
                          "ELSA_NATIVE=0 to skip the build.", RuntimeWarning, stacklevel=3)
        return _state == "ready"


# --- plans: per call signature, the extension's plan id, or False where the body is not replayable

_PLANS: dict = {}
_PLANS_MAX = 1024
# plan id → (op, the backward's non-tensor arguments, its tail arguments): kept after the plan is
# released, for the backwards of graphs built from it
_INFO: dict = {}
# the ids of the plans in _PLANS (not released): only those record backward recipes
_LIVE: set = set()


@_launch.register_cache
def clear_plans() -> None:
    """Forget the plans (calls record afresh; a released plan lives on in the autograd graphs built
    from it until they are freed)."""
    if _ext is not None:
        for plan in _PLANS.values():
            if plan is not False:
                _ext.release(plan)
    _PLANS.clear()
    _LIVE.clear()
    _PYTHON_BACKWARDS.clear()


def _key(op, args: tuple) -> "tuple | None":
    """The call signature of ``op``'s forward on ``args`` (None: not served): each tensor's shape,
    strides, dtype, device, address alignment and which earlier argument it is the same address as
    (a recipe maps a pointer to the first input at its address), the other arguments; the current
    device, Triton's debug switch (other compiled kernels) and the families' per-call switches."""
    key = [op, None, _knobs.runtime.debug, _launch.switches()]
    addresses: list = []
    for a in args:
        if isinstance(a, torch.Tensor):
            device = a.device
            if device.type != "cuda":
                return None
            p = a.data_ptr()
            key.append((a.shape, a.stride(), a.dtype, device.index, p & 15,
                        addresses.index(p) if p in addresses else -1))
            addresses.append(p)
        else:
            key.append((type(a), a))
    if not addresses:
        return None
    # (CUDA is initialised: the call has CUDA tensors; torch.cuda.current_device() would check that
    # again, a microsecond per call)
    key[1] = torch._C._cuda_getDevice()
    return tuple(key)


def eager(op, args: tuple, autograd: bool):
    """``op``'s eager call on ``args`` (the forward op's arguments): (out, statistics), through its
    autograd Function when ``autograd`` — replayed by the extension where this signature has a plan,
    recorded into one where it has none yet."""
    if _state in ("off", "failed") or _python_only or _launch.tracing() or _launch.tritons_own_path():
        return _python(op, args, autograd)
    key = _key(op, args)
    if key is None or (_state == "idle" and not load()):
        return _python(op, args, autograd)
    plan = _PLANS.get(key)
    if plan is None:
        return _record_call(op, key, args, autograd)
    if plan is False:
        return _python(op, args, autograd)
    n = op.bias_input + 1
    stream = torch._C._cuda_getCurrentRawStream(key[1])
    return (_ext.call if autograd else _ext.call_forward)(plan, stream, *args[:n])


_WARNED: set = set()


def _warn_once(what: str) -> None:
    """A RuntimeWarning about a call signature the replay leaves to Python, once per message."""
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"elsa_vision native replay: {what}; this call signature keeps the Python host path",
                      RuntimeWarning, stacklevel=4)


def _python(op, args: tuple, autograd: bool):
    """The Python host path: ``op``'s autograd Function, or its forward alone; → (out, statistics)."""
    if autograd:
        return op.function.apply(*args)
    return tuple(op.forward(*args)[:2])


# --- recording


class _Allocations(TorchDispatchMode):
    """The tensors a host body allocates, and whether it ran any aten operator a recipe cannot
    replay (anything but allocations and views)."""

    def __init__(self):
        super().__init__()
        self.allocated: list = []
        self.other: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if packet in _ALLOCATE:
            self.allocated.append(out)
        elif packet not in _VIEWS:
            self.other.append(str(func))
        return out


_aten = torch.ops.aten
_ALLOCATE = {_aten.empty, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided}
_VIEWS = {_aten.view, _aten._unsafe_view, _aten.as_strided, _aten.transpose, _aten.permute, _aten.select,
          _aten.slice, _aten.unbind, _aten.alias, _aten.detach, _aten.t, _aten.expand, _aten.unsqueeze,
          _aten.squeeze, _aten.split, _aten.chunk, _aten.narrow}


class _Refused(Exception):
    """A body a recipe cannot replay (the message says why)."""


def _recorded_body(body, inputs: list, what: str):
    """``body()`` run with its launches and allocations recorded → (its result, the recipe's pieces
    or the reason it has none). The body's own errors propagate; an error in making the recipe is a
    reason (with a warning: a defect of the recording, not of the call)."""
    mode = _Allocations()
    with _launch.recording() as launches, mode:
        result = body()
    try:
        return result, _recipe(inputs, list(result), launches, mode)
    except _Refused as why:
        return result, str(why)
    except Exception as e:
        _warn_once(f"recording {what} failed ({type(e).__name__}: {e})")
        return result, f"{type(e).__name__}: {e}"


def _recipe(inputs: list, outputs: list, launches: list, mode: _Allocations) -> tuple:
    """(buffers, launches, outputs) as native.cpp's recipe_from takes them."""
    if mode.other:
        raise _Refused(f"the body runs {mode.other[0]}")
    if any(entry is None for entry in launches):
        raise _Refused("a launch a recipe cannot replay")
    slots = len(inputs)
    buffers: list = []
    by_address: dict = {}
    for t in mode.allocated:  # (each as allocated: its storage whole, at offset 0)
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in by_address:
            if t.storage_offset() or t.data_ptr() != st.data_ptr():
                raise _Refused("an allocation that is not its storage's start")
            by_address[st.data_ptr()] = (slots + len(buffers), t.dtype)
            buffers.append((list(t.shape), list(t.stride()), t.dtype))

    def locate(t: torch.Tensor) -> tuple[int, int]:
        """(slot, byte offset) of a pointer argument."""
        base = t.untyped_storage().data_ptr()
        hit = by_address.get(base)
        if hit is not None:
            return hit[0], t.data_ptr() - base
        sharing = [i for i, x in enumerate(inputs) if x is not None and x.untyped_storage().data_ptr() == base]
        exact = [i for i in sharing if inputs[i].data_ptr() == t.data_ptr()]
        if exact:
            return exact[0], 0
        if len(sharing) == 1:
            return sharing[0], t.data_ptr() - inputs[sharing[0]].data_ptr()
        raise _Refused("a pointer argument that is no fixed offset from one input or buffer")

    planned = []
    for entry in launches:
        if entry[0] == "plain":
            _, grid, kernel, rest, tensors = entry
            values = (*tensors, *rest)
            types, maps, pointers = _types(kernel, expand=False), {}, {}
        else:
            _, grid, call, tensors = entry
            kernel = call.kernel
            values = list(call.template)
            types = _types(kernel, expand=True)
            pointers = dict(call.pointers)  # (position → the tensor whose address goes there)
            maps = {at: (i, encode) for at, i, _, encode in call.maps}
        run = kernel.run
        if (run.global_scratch_size or run.profile_scratch_size or getattr(kernel.metadata, "num_ctas", 1) != 1
                or run.launch_cooperative_grid or run.launch_pdl):
            raise _Refused(f"kernel {kernel.name} needs scratch memory, a cluster or a special launch")
        if len(types) != len(values):
            raise _Refused(f"kernel {kernel.name}: {len(values)} arguments for {len(types)} parameters")
        args: list[int] = []
        tma: list[list[int]] = []
        for at, (ty, value) in enumerate(zip(types, values)):
            if ty == "constexpr":
                continue
            if at in maps:
                i, encode = maps[at]
                args += (*locate(tensors[i]), len(tma))
                tma.append(_tensor_map(encode))
            elif at in pointers:
                args += (*locate(tensors[pointers[at]]), -1)
            elif ty.startswith("*"):
                if not isinstance(value, torch.Tensor):
                    raise _Refused(f"kernel {kernel.name}: a pointer argument that is not a tensor")
                args += (*locate(value), -1)
            else:
                args += (-1, _bits(ty, value), -1)
        args += (-1, 0, -1, -1, 0, -1)  # (the global and profile scratch pointers: none)
        num_warps, _, shared = kernel.packed_metadata
        planned.append((kernel.function, [*grid, 32 * num_warps, shared], args, tma))
        _KERNELS[kernel.function] = kernel  # (a recipe holds its function handle: the kernel stays alive)

    views = []
    for o in outputs:
        if o is None:
            views.append((-1, [], [], 0))
            continue
        if not isinstance(o, torch.Tensor):
            raise _Refused("an output that is not a tensor")
        hit = by_address.get(o.untyped_storage().data_ptr()) if o.untyped_storage().nbytes() else None
        if hit is None:
            if o.numel() or o.untyped_storage().nbytes():
                raise _Refused("an output that is not a view of a buffer the body allocated")
            hit = (slots + len(buffers), o.dtype)  # (an empty output: its own empty buffer)
            buffers.append((list(o.shape), list(o.stride()), o.dtype))
        if hit[1] != o.dtype:
            raise _Refused("an output viewed in another dtype than its buffer's")
        views.append((hit[0], list(o.shape), list(o.stride()), o.storage_offset()))
    return [(sizes, strides, _SCALAR_TYPES[d]) for sizes, strides, d in buffers], planned, views


def _types(kernel, expand: bool) -> list:
    """The kernel's parameter types in the order its C launcher takes its arguments; ``expand``: a
    TMA descriptor as the launcher expands it (Triton 3.6, descriptors with TMA metadata: the map,
    then its shape as i32 and strides as i64)."""
    out = []
    for ty in kernel.src.signature.values():
        if not isinstance(ty, str):
            raise _Refused(f"kernel {kernel.name}: a tuple parameter")
        if ty.startswith("tensordesc"):
            if not expand:
                raise _Refused(f"kernel {kernel.name}: a tensor descriptor outside a planned TMA launch")
            match = re.match(r"tensordesc<([^[>]*)\[([^]]*)\]", ty)
            rank = match.group(2).count(",") + 1
            out += ["nvTmaDesc", *["i32"] * rank, *["i64"] * rank]
        else:
            out.append(ty)
    return out


def _tensor_map(encode) -> list[int]:
    """The fixed part of a tensor map as native.cpp's Tma takes it, from launch._TmaCall's encoder
    (Triton 3.6's fill_tma_descriptor arguments after the address: swizzle, element size, element
    type, block shape, shape, strides in elements, padding), as fill_tma_descriptor hands them to
    cuTensorMapEncodeTiled: innermost first, strides in bytes."""
    swizzle, size, dtype, block, shape, strides, padding = encode.args[1]
    rank = len(block)
    if not 1 <= rank <= 5 or len(shape) != rank or len(strides) != rank:
        raise _Refused("a tensor map of unexpected rank")
    dims = [int(shape[rank - 1 - i]) for i in range(rank)]
    box = [int(block[rank - 1 - i]) for i in range(rank)]
    steps = [size * int(strides[rank - 2 - i]) for i in range(rank - 1)]
    pad = lambda xs: xs + [0] * (5 - len(xs))  # noqa: E731
    return [int(dtype), rank, int(swizzle), 1 if padding == 1 else 0, *pad(dims), *pad(steps), *pad(box)]


def _bits(ty: str, value) -> int:
    """A scalar argument as the int64 whose low bytes are its C value (little-endian)."""
    if ty in ("fp32", "f32"):
        return struct.unpack("<i", struct.pack("<f", value))[0]
    if ty == "fp64":
        return struct.unpack("<q", struct.pack("<d", value))[0]
    if ty == "fp16":
        return struct.unpack("<h", struct.pack("<e", value))[0]
    if ty == "bf16":
        return struct.unpack("<i", struct.pack("<f", value))[0] >> 16
    width = _INT_BITS.get(ty)
    if width is None:
        raise _Refused(f"a parameter of type {ty}")
    v = int(value) & ((1 << width) - 1)
    return v - (1 << 64) if v >= 1 << 63 else v


# the compiled kernels recipes launch, by function handle (kept for the process's life, as Triton keeps them)
_KERNELS: dict = {}

_INT_BITS = {"i1": 8, "i8": 8, "i16": 16, "i32": 32, "i64": 64, "u1": 8, "u8": 8, "u16": 16, "u32": 32, "u64": 64}
_SCALAR_TYPES = {d: i for i, d in enumerate(
    (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64))}
_SCALAR_TYPES.update({torch.bool: 11, torch.bfloat16: 15})  # (c10::ScalarType's numbering)


def _saved_indices(op, args: tuple, outputs: tuple) -> "tuple[list[int], tuple, tuple]":
    """The backward's tensors as indices into (tensor inputs..., outputs...), with its non-tensor
    arguments. ``args``: the forward's arguments (the tensor inputs first: ``op.bias_input + 1``)."""
    saved, bargs, *tail = op.save(args, outputs)
    every = (*args[:op.bias_input + 1], *outputs)
    at = []
    for t in saved:
        if t is None:
            at.append(-1)
            continue
        i = next((j for j, x in enumerate(every) if x is t), None)
        if i is None:
            raise _Refused("a saved tensor that is neither an input nor an output")
        at.append(i)
    return at, tuple(bargs), tuple(tail[0]) if tail else ()


def _record_call(op, key, args: tuple, autograd: bool):
    """The Python path of a call whose signature has no plan yet, recording its forward into one.
    The call's own errors propagate (and its signature stays unplanned)."""
    n = op.bias_input + 1
    if len(args) < n or any(isinstance(a, torch.Tensor) for a in args[n:]):  # (tensors past the bias: not served)
        _PLANS[key] = False
        return _python(op, args, autograd)
    state: dict = {}
    if autograd:
        with _Recording(op, state):
            result = op.function.apply(*args)
        outputs, recipe = state.pop("outputs", None), state.pop("recipe", "the forward body was not recorded")
    else:
        outputs, recipe = _recorded_body(lambda: op.forward(*args), list(args[:n]), op.what)
        result = tuple(outputs[:2])
    plan = False
    if not isinstance(recipe, str) and len(outputs) == 2:
        try:
            saved, bargs, tail = _saved_indices(op, tuple(args), tuple(outputs))
            plan = _ext.new_plan(op.what, n, *recipe, saved, op.bias_input, op.bias_input)
            _INFO[plan] = (op, bargs, tail)
        except _Refused:
            plan = False
        except Exception as e:  # (a defect of the recording: the call's result stands, its signature on Python)
            _warn_once(f"recording {op.what}'s call failed ({type(e).__name__}: {e})")
            plan = False
    if autograd and plan is not False:
        state["plan"] = plan  # (the backward of this call records its recipe for the plan)
    if len(_PLANS) >= _PLANS_MAX:
        clear_plans()
    _PLANS[key] = plan
    if plan is not False:
        _LIVE.add(plan)
    return result


class _Recording:
    """While set (on this thread), ``op``'s eager Function records its forward body into ``state``
    (its outputs and recipe), and the backward of that call records its recipe for the plan made
    from it."""

    local = threading.local()

    def __init__(self, op, state: dict):
        self.op, self.state = op, state

    def __enter__(self):
        self.before = getattr(self.local, "current", None)
        self.local.current = (self.op, self.state)

    def __exit__(self, *exc):
        self.local.current = self.before


def forward_body(op, ctx, inputs: tuple):
    """The eager Function's forward body: ``op.forward``, recorded when this call is being recorded
    (the Function then keeps, on ``ctx``, where its backward is to record)."""
    rec = getattr(_Recording.local, "current", None)
    if rec is None or rec[0] is not op:
        ctx.native = None
        return op.forward(*inputs)
    _Recording.local.current = None  # (once: only the call being recorded)
    state = rec[1]
    outputs, recipe = _recorded_body(lambda: op.forward(*inputs), list(inputs[:op.bias_input + 1]), op.what)
    state["outputs"], state["recipe"] = outputs, recipe  # (taken out again by _record_call)
    ctx.native = state
    return outputs


def backward_body(op, ctx, dout: torch.Tensor, saved: tuple, bias_grad: bool):
    """The eager Function's backward body: ``op.backward``, recorded for the plan made from its
    forward where that call was recorded."""
    state = getattr(ctx, "native", None)
    plan = state.get("plan") if state else None
    if plan is None:
        return op.backward(dout, *saved, *ctx.args, bias_grad, *ctx.tail)
    return _record_backward(plan, dout, list(saved), bias_grad)


def _record_backward(plan: int, dout: torch.Tensor, saved: list, bias_grad: bool) -> list:
    """The Python backward of ``plan``'s op on (dout, saved), recorded into a recipe for dout's
    layout (kept by the plan where the body is replayable); → its gradients."""
    op, args, tail = _INFO[plan]
    layout = (plan, bias_grad, dout.dtype, dout.stride(), dout.data_ptr() & 15)
    # (a dout sharing memory with a saved tensor would map its pointers to that tensor's slot, which
    # the layout's key does not see: not recorded from such a call, nor refused)
    shared = any(t is not None and t.untyped_storage().data_ptr() == dout.untyped_storage().data_ptr()
                 for t in saved)
    # (a released plan's graphs still call back: their gradients, nothing recorded for a plan gone)
    if layout in _PYTHON_BACKWARDS or shared or plan not in _LIVE:
        return list(op.backward(dout, *saved, *args, bias_grad, *tail))
    inputs = [dout, *saved]
    grads, recipe = _recorded_body(lambda: op.backward(dout, *saved, *args, bias_grad, *tail), inputs,
                                   f"{op.what}'s backward")
    if isinstance(recipe, str):
        _PYTHON_BACKWARDS.add(layout)
    else:
        try:
            _ext.add_backward(plan, bias_grad, dout, len(inputs), *recipe)
        except Exception as e:  # (a defect of the recording: these gradients stand, the layout stays on Python)
            _PYTHON_BACKWARDS.add(layout)
            _warn_once(f"recording {op.what}'s backward failed ({type(e).__name__}: {e})")
    return list(grads)


# backward layouts whose body a recipe cannot replay: (plan, bias_grad, dout's dtype, strides, alignment)
_PYTHON_BACKWARDS: set = set()
