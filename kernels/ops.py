"""The one op-registration path of the kernel families: custom ops with fake implementations and
autograd registered on the op, the eager autograd path beside them, and the chooser between the two.

A kernel family hands :class:`KernelOp` its host-side ``forward`` and ``backward`` (plain Python
functions that launch its kernels):

    forward(q, k, v, bias, *rest)  → (out, stats, *kept)      stats: float32 row statistics, no gradient;
                                                              kept: tensors made for the backward only
                                                              (no gradient), which ``save`` may keep
    backward(do, *saved, *args, bias_grad, *tail) → [dq, dk, dv, dbias]   dbias an empty tensor unless bias_grad

or, for a packed family (``bias_input=1``), forward(qkv, bias, *rest) and a backward returning
[dqkv, dbias]: the projection's gradient written by the kernels in one piece, where three gradients
of q, k, v views would be stacked by autograd (a copy the size of qkv).

``save(inputs, outputs)`` says which tensors the backward reads (``saved``) and which non-tensor
arguments it takes (``args``; optionally a third element, ``tail``: arguments after ``bias_grad``,
where a family adds a defaulted argument to its backward op — a graph compiled and cached by an
earlier version calls the op without it, and must still bind). From these, :class:`KernelOp` registers

- ``elsa_vision::<name>_fwd`` and ``elsa_vision::<name>_bwd`` as ``torch.library.triton_op``s:
  torch.compile traces their bodies, with every launch made through ``wrap_triton``
  (``launch.traceable``), so inductor sees the Triton kernels and launches them itself from its
  generated code — none of this package's Python runs per call in a compiled graph (the host ops
  below excepted). The same body run on fake tensors is the ops' fake (meta) implementation: it
  allocates exactly what the real call does, strides included. (Under the CPU interpreter, whose kernels wrap_triton cannot trace,
  the ops are opaque custom ops with the same body, launching nothing, as their fake.);
- autograd on the forward op (its backward calls the backward op), and a clear error on the
  backward op's own backward (no double backward);
- :attr:`KernelOp.function`: an ``autograd.Function`` running the same ``forward`` / ``backward``
  directly. The custom op's dispatch costs tens of microseconds a call, as much as the kernels of a
  ViT-sized problem; eager calls need none of it;
- with ``host_ops=True``, ``elsa_vision::<name>_host_fwd`` / ``_host_bwd``: the same functions as
  opaque custom ops (fake: the body on fake tensors, launching nothing; autograd as above) that a
  compiled graph calls as they are, so that the host code runs per call and picks its kernels
  then. For calls whose fastest kernels inductor cannot launch (Gluon's: inductor re-emits a
  traced kernel as a plain Triton one) and that are long enough for the host's microseconds not
  to matter; the family decides which op a traced call takes.

:func:`route` is the chooser every family's entry point uses: the custom op while torch.compile
traces, the bare kernels when no gradient is wanted (:meth:`KernelOp.run`), the autograd Function
otherwise (:meth:`KernelOp.apply`). Those two eager calls go through kernels/native.py, which
replays a call signature's recorded host work from C++ after its first call.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
from torch.autograd import forward_ad as _forward_ad

from . import native
from .launch import INTERPRET, allocations_only, traceable

COMPILED, INFERENCE, AUTOGRAD = "compiled", "inference", "autograd"


def route(what: str, leaves: Sequence[Optional[torch.Tensor]]) -> str:
    """How an entry point runs a call whose differentiable inputs are ``leaves``: :data:`COMPILED`
    (torch.compile is tracing: the custom op), :data:`INFERENCE` (no gradient wanted: the kernels
    alone, no graph to record) or :data:`AUTOGRAD` (the eager autograd Function). Raises for
    forward-mode AD (see :func:`no_tangents`); ``what`` names the public function."""
    if torch.compiler.is_compiling():
        return COMPILED
    no_tangents(what, leaves)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves):
        return AUTOGRAD
    return INFERENCE


def forward_ad_on() -> bool:
    """Whether a forward-mode AD level is open (``torch.autograd.forward_ad.dual_level``): the cheap
    test before looking for tangents (unpacking costs about a microsecond a tensor). True where
    torch no longer has the private level counter: then every call looks."""
    return getattr(_forward_ad, "_current_level", 0) >= 0


def has_tangent(tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether forward-mode AD is on and one of ``tensors`` carries a tangent."""
    return forward_ad_on() and any(t is not None and _forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def no_tangents(what: str, tensors: Sequence[Optional[torch.Tensor]]) -> None:
    """Raise if forward-mode AD is on (``torch.autograd.forward_ad``) and one of ``tensors`` carries
    a tangent: the kernels compute no Jacobian-vector product, and their output would come back
    without a tangent — a silent zero (forward AD runs under ``torch.no_grad`` too)."""
    if has_tangent(tensors):
        raise NotImplementedError(
            f"elsa_vision.{what}: forward-mode AD (dual tensors of torch.autograd.forward_ad) is not supported "
            "by the Triton kernels. Use backend='reference' for this call, or elsa_vision.unpatch(model) for a "
            "patched model.")


def _within(mode: Callable, fn: Callable) -> Callable:
    """``fn`` run inside the launch mode ``mode`` (``launch.traceable`` / ``allocations_only``)."""
    @functools.wraps(fn)
    def body(*args):
        with mode():
            return fn(*args)
    return body


def register(name: str, fn: Callable, mutates: Sequence[str] = (), opaque: bool = False):
    """``fn`` (a host launcher with type annotations) as the custom op ``name``: a triton_op whose
    launches torch.compile traces; with ``opaque``, or under the CPU interpreter (whose kernels
    wrap_triton cannot trace), an opaque custom op, with ``fn`` on fake tensors, launching nothing,
    as its fake. ``mutates``: the arguments ``fn`` writes into."""
    if INTERPRET or opaque:
        op = torch.library.custom_op(name, fn, mutates_args=tuple(mutates))
        op.register_fake(_within(allocations_only, fn))
        return op
    return torch.library.triton_op(name, _within(traceable, fn), mutates_args=tuple(mutates))


def double_backward_error(what: str) -> RuntimeError:
    return RuntimeError(f"elsa_vision.{what} does not support double backward (gradients of gradients). "
                        "Use backend='reference' for higher-order derivatives.")


def check_first_order(what: str) -> None:
    """Raise if a backward is being differentiated (create_graph=True)."""
    if torch.is_grad_enabled():
        raise double_backward_error(what)


class KernelOp:
    """One kernel family's forward/backward pair registered as custom ops (see the module docstring).

    ``what``: the public function's name, for error messages. ``bias_input``: the position of the
    bias among the forward's inputs (its gradient is computed only when it requires one); the
    inputs before it (q, k, v, or a packed qkv) are those whose gradients the backward always
    returns, in order, before the bias's."""

    def __init__(self, name: str, what: str, *, forward: Callable, backward: Callable,
                 save: Callable[[tuple, tuple], tuple], bias_input: int = 3, host_ops: bool = False):
        self.what, self.bias_input = what, bias_input
        self.forward, self.backward, self.save = forward, backward, save
        self.fwd, self.bwd = self._pair(name, self._op_backward, opaque=False)
        self.host_fwd, self.host_bwd = self._pair(name + "_host", self._host_op_backward, opaque=True) if host_ops \
            else (None, None)
        self.function = self._eager_function()

    def _pair(self, name: str, op_backward: Callable, opaque: bool) -> tuple:
        """The forward and backward ops ``elsa_vision::<name>_fwd`` / ``_bwd``, autograd registered."""
        fwd, bwd = (register(f"elsa_vision::{name}_{part}", fn, opaque=opaque)
                    for part, fn in (("fwd", self.forward), ("bwd", self.backward)))
        fwd.register_autograd(op_backward, setup_context=self._setup)
        bwd.register_autograd(self._op_double_backward, setup_context=lambda ctx, inputs, output: None)
        return fwd, bwd

    # -- the custom ops' autograd

    def _setup(self, ctx, inputs, output) -> None:
        """What the backward needs, from ``save``, onto ``ctx`` (both paths)."""
        saved, args, *tail = self.save(inputs, output)
        ctx.save_for_backward(*saved)
        ctx.args, ctx.tail = args, tuple(tail[0]) if tail else ()
        ctx.n_inputs = len(inputs)

    def _backward(self, backward: Callable, ctx, dout) -> tuple:
        """The gradients of the forward's inputs by ``backward(ctx, dout, saved, bias_grad)`` (the
        backward op, or the host function on the eager path) from what ``_setup`` stored."""
        saved = ctx.saved_tensors
        bias_grad = self._bias_grad(ctx, saved)
        *grads, dbias = backward(ctx, dout, saved, bias_grad)
        return (*grads, dbias if bias_grad else None) + (None,) * (ctx.n_inputs - self.bias_input - 1)

    def _bias_grad(self, ctx, saved) -> bool:
        return bool(saved[self.bias_input] is not None and ctx.needs_input_grad[self.bias_input])

    @staticmethod
    def _through(op: Callable) -> Callable:
        return lambda ctx, dout, saved, bias_grad: op(dout, *saved, *ctx.args, bias_grad, *ctx.tail)

    def _op_backward(self, ctx, dout, *_none):  # (the statistics and kept tensors take no gradient)
        return self._backward(self._through(self.bwd), ctx, dout)

    def _host_op_backward(self, ctx, dout, *_none):
        return self._backward(self._through(self.host_bwd), ctx, dout)

    def _op_double_backward(self, ctx, *grads):
        raise double_backward_error(self.what)

    # -- the eager path

    def apply(self, *args):
        """The eager call with autograd: (out, stats) by :attr:`function`, or replayed from C++ where
        this call signature has a recorded plan (kernels/native.py)."""
        return native.eager(self, args, autograd=True)

    def run(self, *args):
        """The eager call without autograd: (out, stats) by ``forward``, or replayed (as ``apply``)."""
        return native.eager(self, args, autograd=False)

    def _eager_function(self) -> type:
        op = self

        def host_backward(ctx, dout, saved, bias_grad):
            return native.backward_body(op, ctx, dout, saved, bias_grad)

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                outputs = native.forward_body(op, ctx, inputs)
                op._setup(ctx, inputs, outputs)
                ctx.mark_non_differentiable(outputs[1])
                # (autograd would otherwise fill a zero tensor the statistics' size for their
                # gradient at every backward: an allocation and a launch, where nothing reads it)
                ctx.set_materialize_grads(False)
                return outputs[0], outputs[1]

            @staticmethod
            def backward(ctx, dout, _dstats):
                check_first_order(op.what)
                if dout is None:  # (no gradient reached the output: none for the inputs)
                    return (None,) * ctx.n_inputs
                return op._backward(host_backward, ctx, dout)

        Function.__name__ = Function.__qualname__ = f"{op.what}_function"
        return Function
