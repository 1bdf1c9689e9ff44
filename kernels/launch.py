"""Launch machinery shared by every kernel family: a launch cache keyed by call signature, launches
planned once per call signature, and the registry of the kernel layer's caches.

Triton's own launch, ``fn[grid](*args, **meta)``, re-derives the compile options, checks the
kernel's global values, builds launch metadata and specialises every argument (its binder) on
every call. A Swin training step makes dozens of launches of kernels with ~45 arguments, and at its
later stages that host work, not the GPU, sets the pace. :func:`launch` and :class:`Launch` reuse
what a first launch of the same signature compiled and bound, and call the compiled kernel's
launcher directly.

That reaches into Triton internals: ``JITFunction.device_caches[device][4]`` (the binder, for
the values of the parameters after the positional ones), ``CompiledKernel.run`` (the C
launcher) and, for kernels that take TMA descriptors (:class:`_TmaCall`), the launcher beneath
``CudaLauncher.launch``'s descriptor wrapper and its descriptor encoding. They are only used where
:data:`FAST_LAUNCH` holds: a Triton version this module was checked against
(:data:`CHECKED_TRITON`), and the environment variable ``ELSA_TRITON_LAUNCH`` not set to
``"triton"``. Otherwise — and under the interpreter, or while a profiler's launch hooks are
set — every launch is Triton's own.

Caches. Every cache of the kernel layer (compiled launches, planned launches, tile plans) registers
its clearing function here with :func:`register_cache`; :func:`clear_caches` (behind
``elsa_vision.clear_caches()``) empties them all, e.g. after a tuning switch changes.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Callable

import torch
import triton
from triton import knobs as _knobs
from triton.runtime import driver as _driver

from .limits import MAX_GRID_YZ

INTERPRET = bool(_knobs.runtime.interpret)

# Triton versions whose binder layout and launcher call this module's fast path was checked against
CHECKED_TRITON = ((3, 6),)


def _version(v: str) -> tuple[int, int]:
    parts = (v.split("+")[0].split(".") + ["0", "0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)


# whether the installed Triton is one of them (Gluon kernels, experimental API, run only then)
CHECKED = _version(triton.__version__) in CHECKED_TRITON


def hopper_requested() -> bool:
    """Whether the environment leaves the Hopper kernels on (ELSA_HOPPER unset or not "0")."""
    return os.environ.get("ELSA_HOPPER", "1").strip() != "0"


def _fast_launch_reason() -> str:
    """Why launches take Triton's own path ("" when the fast path is used)."""
    if os.environ.get("ELSA_TRITON_LAUNCH", "").strip().lower() == "triton":
        return "ELSA_TRITON_LAUNCH=triton"
    if not CHECKED:
        return f"triton {triton.__version__} is not one of the checked versions {CHECKED_TRITON}"
    return ""


FAST_LAUNCH_OFF = _fast_launch_reason()
FAST_LAUNCH = not FAST_LAUNCH_OFF

_CLEARERS: list[Callable[[], None]] = []


def register_cache(clear: Callable[[], None]) -> Callable[[], None]:
    """Add a cache's clearing function to :func:`clear_caches`; returns it (usable as a decorator)."""
    _CLEARERS.append(clear)
    return clear


def clear_caches() -> None:
    """Empty every registered cache of the kernel layer."""
    for clear in _CLEARERS:
        clear()


def on_device(fn: Callable) -> Callable:
    """``fn`` (a kernel family's entry point) run with its first tensor argument's CUDA device as the
    current device: every launch (Triton's, the planned ones, the C++ replay) takes the current
    device's compiled kernels and stream, where PyTorch's ops follow their tensors — a model moved
    to cuda:1 without ``torch.cuda.set_device`` would otherwise launch on cuda:0's stream, unordered
    with the work that made its inputs. The first tensor among the positional, then the keyword
    arguments decides (a packed call passes qkv by keyword). Nothing to do where that device is
    current, off CUDA, and under torch.compile (inductor's code sets the device itself)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, torch.Tensor):
                if a.is_cuda and not torch.compiler.is_compiling():
                    idx = a.get_device()
                    if idx != torch._C._cuda_getDevice():
                        with torch.cuda.device(idx):
                            return fn(*args, **kwargs)
                break
        return fn(*args, **kwargs)
    return call


def host_cache(maxsize: "int | None" = 1024):
    """``functools.lru_cache`` for a host-side planner (a model repeats a few shapes, and planning is
    host time on every call), registered with :func:`clear_caches` and stepping aside while
    launches are traced or skipped (see :func:`tracing`)."""
    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return fn(*args, **kwargs) if _MODE.mode is not None else cached(*args, **kwargs)
        call.cache_clear = cached.cache_clear
        register_cache(cached.cache_clear)
        return call
    return wrap


def cdiv(a: int, b: int) -> int:
    # host arithmetic in plain Python: triton.cdiv / next_power_of_2 are constexpr functions since
    # Triton 3.5, a few microseconds a call on the launch path
    return -(-a // b)


def pow2(d: int) -> int:
    """The padded width of a head dim: the next power of two, at least 16."""
    return 1 << max(4, (int(d) - 1).bit_length())


# Kernels launched before: (kernel, device, _signature of the positional arguments, keyword
# arguments, debug flag) → (the compiled kernel, the values of the parameters after the positional
# ones, in signature order). Cleared when it grows past _LAUNCHED_MAX (varying shapes).
_LAUNCHED: dict = {}
_LAUNCHED_MAX = 4096
register_cache(_LAUNCHED.clear)


# How launches run: normally (mode None), traced through torch.library.wrap_triton ("traced":
# traceable()), or not at all ("none": allocations_only()). Set by those two context managers only,
# per thread: a fake or a rehearsal in one thread must not skip or trace another thread's eager
# launches (and interleaved exits must not leave the mode set for good).
class _Mode(threading.local):
    mode: "str | None" = None  # (a class default: every thread starts at None)


_MODE = _Mode()


@contextlib.contextmanager
def _launch_mode(mode: str):
    before, _MODE.mode = _MODE.mode, mode
    try:
        yield
    finally:
        _MODE.mode = before


def traceable():
    """Inside, every launch is ``torch.library.wrap_triton(fn)[grid](...)``: what the body of a
    ``torch.library.triton_op`` must call so that torch.compile sees the kernel (and inductor
    launches it itself), and what runs on fake tensors while a graph is traced."""
    return _launch_mode("traced")


def allocations_only():
    """Inside, no kernel is launched: a kernel family's host code allocates exactly what it would —
    outputs, statistics, partial sums — and leaves them uninitialised. That is a custom op's fake
    (meta) implementation on fake tensors, and on real ones a call's peak memory without its
    arithmetic (benchmarks/frames.py --memory-rehearsal sizes thousands of frames this way). For the
    calling thread only: a backward that autograd runs on its device thread launches."""
    return _launch_mode("none")


def tracing() -> bool:
    """Whether this thread's launches are traced or skipped (see :func:`traceable`,
    :func:`allocations_only`): host-side caches keyed by sizes step aside, the sizes may be symbolic."""
    return _MODE.mode is not None


# Recordings of the launches host bodies make (kernels/native.py): per thread, the list being filled
# — entries ("plain", grid, compiled kernel, arguments after the tensors, tensors) or ("tma", grid,
# its _TmaCall, tensors), or None for a launch a recipe cannot replay (Triton's own path, an
# unplanned launch) —; _RECORD counts the threads recording (the launch paths' cheap test).
_RECORD = 0
_RECORDS = threading.local()
_RECORD_LOCK = threading.Lock()


@contextlib.contextmanager
def recording():
    """Inside, the launches this thread makes are listed (the list is yielded) as well as made."""
    global _RECORD
    before, _RECORDS.list = getattr(_RECORDS, "list", None), []
    with _RECORD_LOCK:
        _RECORD += 1
    try:
        yield _RECORDS.list
    finally:
        _RECORDS.list = before
        with _RECORD_LOCK:
            _RECORD -= 1


def _recorded(entry) -> None:
    """``entry`` into this thread's recording, if it is recording."""
    listed = getattr(_RECORDS, "list", None)
    if listed is not None:
        listed.append(entry)


# Functions returning the module-level switches that change what a host body does for a call
# signature (hopper.py's), read into kernels/native.py's call signatures.
_SWITCHES: list = []


def register_switches(read: Callable[[], tuple]) -> Callable[[], tuple]:
    """Add a reader of switches a family's host code consults per call (usable as a decorator)."""
    _SWITCHES.append(read)
    return read


def switches() -> tuple:
    """The registered switches' current values."""
    return tuple([read() for read in _SWITCHES])  # (per eager call: a list, not a generator)


def _other_launch(fn, grid: tuple, args: tuple, meta: dict):
    """A launch while this thread's launch mode is set: traced, or skipped."""
    if _MODE.mode == "traced":
        from torch.library import wrap_triton
        wrap_triton(fn)[grid](*args, **meta)


def tritons_own_path() -> bool:
    """Launch through Triton itself: fast path off, the interpreter, or a profiler's launch hooks set."""
    return (not FAST_LAUNCH or INTERPRET or _hooked(_knobs.runtime.launch_enter_hook)
            or _hooked(_knobs.runtime.launch_exit_hook))


def _hooked(hook) -> bool:
    # Triton ≥ 3.6 keeps a (possibly empty) HookChain here, older versions None or a callable
    return hook is not None and bool(getattr(hook, "calls", True))


def _signature(args: tuple) -> tuple:
    """What of a launch's positional arguments can change the compiled kernel, at least as finely as
    Triton's specialisation: an int by its value (Triton: equal to 1, a multiple of 16, 32 or 64
    bits), a tensor by its dtype and whether its address is 16-byte aligned, a float by its type
    alone (Triton does not specialise floats), a tensor descriptor as _descriptor_signature says,
    anything else by type and value."""
    return tuple(a if type(a) is int else (a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
                 else float if type(a) is float else _descriptor_signature(a) if hasattr(a, "block_shape")
                 else (type(a), a) for a in args)


def _descriptor_signature(d) -> tuple:
    """A TMA tensor descriptor specialises the kernel by its dtype, block shape and shared-memory
    layout; its address, shape and strides go into the tensor map (encoded at every launch by
    Triton's own path, once per address by a planned one: _TmaCall)."""
    return type(d), d.base.dtype, tuple(d.block_shape), d.layout


def check_grid(fn, grid: tuple) -> None:
    """A clear error for a CUDA grid past its limits instead of the driver's "invalid argument"
    (the interpreter has none)."""
    if any(g > MAX_GRID_YZ for g in grid[1:3]):
        raise ValueError(
            f"{getattr(fn, '__name__', fn)}: launch grid {tuple(grid)} has more than {MAX_GRID_YZ} programs on its "
            f"2nd or 3rd axis, CUDA's limit there (where the kernels put batch × heads, or heads): split "
            f"the call into smaller batches (elsa_vision.attention does this by itself when its batch has more "
            f"than one element)")


def launch(fn, grid: tuple, *args, **meta):
    """``fn[grid](*args, **meta)`` with Triton's per-call host work cut to what a compiled kernel
    needs: a launch whose arguments have the :func:`_signature` of one seen before reuses that
    launch's compiled kernel directly (the signature is at least as fine as Triton's
    specialisation, so a kernel compiled for other dtypes, alignments or integer values is never
    reused). The first launch of each signature takes Triton's path, and so does every launch
    where :func:`tritons_own_path` holds."""
    if _MODE.mode is not None:
        return _other_launch(fn, grid, args, meta)
    if _RECORD:
        _recorded(None)
    if len(grid) > 1 and not INTERPRET:
        check_grid(fn, grid)
    if tritons_own_path():
        return fn[grid](*args, **meta)
    dev = torch.cuda.current_device()
    key = (fn, dev, _signature(args), tuple(meta.items()), _knobs.runtime.debug)
    hit = _LAUNCHED.get(key)
    if hit is None:
        return _first_launch(key, fn, grid, args, meta)[0]
    kernel, tail = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    kernel.run(grid[0], g1, g2, _driver.active.get_current_stream(dev), kernel.function, kernel.packed_metadata,
               None, None, None, *args, *tail)
    return kernel


def _first_launch(key, fn, grid, args, meta) -> tuple:
    """Triton's own launch (compiling if need be); → (compiled kernel, values of the parameters after
    the positional ones), kept in _LAUNCHED under ``key``."""
    dev = key[1]
    caches = fn.device_caches.get(dev)
    params = caches[4](*args, **meta)[0] if caches is not None else None
    kernel = fn[grid](*args, **meta)
    kernel = kernel.result() if hasattr(kernel, "result") else kernel
    if params is None:  # (the binder exists once the kernel has been compiled on this device)
        params = fn.device_caches[dev][4](*args, **meta)[0]
    values = tuple(params.values())
    if len(_LAUNCHED) >= _LAUNCHED_MAX:
        _LAUNCHED.clear()
    _LAUNCHED[key] = hit = (kernel, values[len(args):])
    return hit


class Launch:
    """One kernel launch planned once, ``fn[grid](*tensors, *scalars, **meta)`` with the tensors given
    at each call: what a kernel family's host code decides from a call's shapes, strides and flags
    (grid, strides, sizes, tile constants) is kept, and a repeat only binds addresses. The compiled
    kernel is kept per device and per pattern of the tensors' dtypes and 16-byte-aligned addresses
    (what Triton specialises a pointer argument on; the scalars are fixed, so their specialisation
    is too), and a repeat passes it the addresses as integers: no :func:`_signature` of 40-odd
    arguments, no per-tensor ``data_ptr`` call and driver pointer query inside Triton's C launcher. The first call
    of each pattern, and every call where :func:`tritons_own_path` holds, take :func:`launch`'s path.

    ``leading`` (kernels that take TMA tensor descriptors, kernels/hopper.py): the arguments before
    the scalars, each an int ``i`` (the call's i-th tensor) or a pair ``(i, describe)`` (the
    descriptor ``describe(tensors[i])``, whose shape and strides the plan fixes: only its address
    changes between calls). Triton's launcher encodes every descriptor's tensor map (a driver call)
    at every launch; a repeat here reuses the map encoded for the same address and calls the
    launcher beneath that step (_TmaCall)."""

    __slots__ = ("fn", "grid", "scalars", "meta", "leading", "_bound")

    def __init__(self, fn, grid: tuple, scalars: tuple, meta: dict, leading: "tuple | None" = None):
        self.fn, self.scalars, self.meta, self.leading = fn, tuple(scalars), meta, leading
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self._bound: dict = {}
        if not INTERPRET and not tracing():
            check_grid(fn, self.grid)

    def _args(self, tensors: tuple) -> tuple:
        """The kernel's positional arguments for these tensors (descriptors made afresh)."""
        if self.leading is None:
            return (*tensors, *self.scalars)
        return (*(tensors[a] if type(a) is int else a[1](tensors[a[0]]) for a in self.leading), *self.scalars)

    def __call__(self, *tensors: torch.Tensor) -> None:
        if _MODE.mode is not None:
            _other_launch(self.fn, self.grid, self._args(tensors), self.meta)
            return
        if tritons_own_path():
            if _RECORD:
                _recorded(None)
            self.fn[self.grid](*self._args(tensors), **self.meta)
            return
        ptrs = [t.data_ptr() for t in tensors]
        dev = torch.cuda.current_device()
        # (the dtypes too: a plan's key need not fix them — a bias table read in place comes in the
        # caller's dtype — and Triton compiles a pointer argument per element type)
        key = (dev, _knobs.runtime.debug, *[p & 15 == 0 for p in ptrs], *[t.dtype for t in tensors])
        hit = self._bound.get(key)
        if hit is None:
            args = self._args(tensors)
            lkey = (self.fn, dev, _signature(args), tuple(self.meta.items()), key[1])
            found = _LAUNCHED.get(lkey)
            kernel, tail = found or _first_launch(lkey, self.fn, self.grid, args, self.meta)
            if self.leading is None:
                hit = (kernel, (*self.scalars, *tail))
            else:
                hit = _TmaCall.plan(kernel, self.leading, args, tail)
            self._bound[key] = hit
            if found is None:
                if _RECORD:
                    self._record(hit, tensors)
                return  # (_first_launch launched it)
        if _RECORD:
            self._record(hit, tensors)
        stream = _driver.active.get_current_stream(dev)
        if self.leading is None:
            kernel, rest = hit
            kernel.run(*self.grid, stream, kernel.function, kernel.packed_metadata, None, None, None, *ptrs, *rest)
        elif hit is _TRITONS_OWN:  # (a launcher this module does not know how to call beneath)
            self.fn[self.grid](*self._args(tensors), **self.meta)
        else:
            hit(self.grid, stream, ptrs)

    def _record(self, hit, tensors: tuple) -> None:
        """This launch into the recording (see :func:`recording`)."""
        if self.leading is None:
            _recorded(("plain", self.grid, *hit, tensors))
        else:
            _recorded(None if hit is _TRITONS_OWN else ("tma", self.grid, hit, tensors))


_TRITONS_OWN = object()


def _encode(fill, rest: tuple, address: int):
    return fill(address, *rest)


class _TmaCall:
    """A planned launch of a kernel with TMA descriptor arguments, through Triton 3.6's C launcher
    beneath its Python wrapper (``CudaLauncher.launch``, wrap_handle_tensordesc), which expands each
    descriptor into (tensor map, shape, strides) and encodes the map on every launch. Here the
    expanded argument list is kept, and per call only the tensors' addresses and the maps change;
    each descriptor's maps are kept per address (the shape, strides, block and swizzle are the
    plan's: a map is a function of the address alone)."""

    __slots__ = ("launcher", "head", "template", "pointers", "maps", "kernel")

    # tensor maps kept per descriptor (a model's buffers take a few addresses; more are re-encoded)
    MAPS = 64

    def __init__(self, launcher, head: tuple, template: list, pointers: list, maps: list, kernel=None):
        self.launcher, self.head, self.template, self.pointers, self.maps = launcher, head, template, pointers, maps
        self.kernel = kernel  # (the compiled kernel: its signature, for kernels/native.py's recipes)

    @classmethod
    def plan(cls, kernel, leading: tuple, args: tuple, tail: tuple):
        """The call for ``kernel`` compiled for ``args`` (leading arguments made, then scalars) and
        ``tail`` (the parameters after them), or _TRITONS_OWN where the launcher is not the one this
        was written against (then every call takes Triton's own launch)."""
        run = kernel.run
        metas = getattr(kernel.metadata, "tensordesc_meta", None)
        wrapped = getattr(run, "launch", None)
        names = getattr(getattr(wrapped, "__code__", None), "co_freevars", ())
        if not metas or "launcher" not in names or run.global_scratch_size or run.profile_scratch_size:
            return _TRITONS_OWN
        cells = dict(zip(names, (c.cell_contents for c in wrapped.__closure__)))
        full = (*args, *tail)
        at = [i for i, a in enumerate(full) if hasattr(a, "block_shape")]
        if sorted(cells.get("tensordesc_indices", ())) != at or len(at) != len(metas):
            return _TRITONS_OWN
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST as host_dtype
        utils = _driver.active.utils
        template, pointers, maps = [], [], []
        for i, a in enumerate(full):
            if i < len(leading) and type(leading[i]) is int:
                pointers.append((len(template), leading[i]))
                template.append(None)
            elif hasattr(a, "block_shape"):
                meta = metas[len(maps)]
                shape, strides = list(a.shape), list(a.strides)
                if meta["fp4_padded"]:
                    shape[-1] *= 2
                rest = (meta["swizzle"], meta["elem_size"], host_dtype[meta["elem_type"]], meta["block_size"], shape,
                        strides, 1 if a.padding == "nan" else 0)  # (make_tensordesc_arg's encoding)
                encode = functools.partial(_encode, utils.fill_tma_descriptor, rest)
                maps.append((len(template), leading[i][0], {}, encode))
                template.extend([None, *shape, *strides])
            else:
                template.append(a)
        head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata,
                None, None, None)
        return cls(cells["launcher"], head, template, pointers, maps, kernel)

    def __call__(self, grid: tuple, stream: int, ptrs: list) -> None:
        args = self.template.copy()
        for at, i in self.pointers:
            args[at] = ptrs[i]
        for at, i, kept, encode in self.maps:
            p = ptrs[i]
            m = kept.get(p)
            if m is None:
                if len(kept) >= self.MAPS:
                    kept.clear()
                m = kept[p] = encode(p)
            args[at] = m
        self.launcher(*grid, stream, *self.head, *args)


# Launches planned per call signature (dtype, device, shape, strides, flags; the caller's key): see
# Launch. A repeat call only allocates its outputs and binds their addresses. Cleared when it grows
# past _PREPARED_MAX (varying shapes) and by clear_caches() (a tuning switch changed).
_PREPARED: dict = {}
_PREPARED_MAX = 1024
register_cache(_PREPARED.clear)


def prepared(key: tuple, make: Callable, *args):
    """``make(*args)`` (a Launch or a tuple of them) kept under ``key``; planned afresh and not kept
    while launches are traced (the sizes may be symbolic)."""
    if tracing():
        return make(*args)
    hit = _PREPARED.get(key)
    if hit is None:
        if len(_PREPARED) >= _PREPARED_MAX:
            _PREPARED.clear()
        hit = _PREPARED[key] = make(*args)
    return hit


def sm_count(index: int) -> int:
    """Multiprocessors of CUDA device ``index`` (memoised: host time on every planned call)."""
    n = _SMS.get(index)
    if n is None:
        n = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


_SMS: dict = {}
