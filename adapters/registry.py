"""Adapter registry and the patching machinery behind ``elsa_vision.patch`` / ``unpatch``.

An :class:`Adapter` serves the module classes it names (matched by class object, exactly — a
subclass with its own forward is not assumed to share the parent's semantics unless the adapter
lists it). ``patch`` walks ``model.modules()``, binds a new ``forward`` (or the adapter's
``method``) on each matching instance (instance attribute, so the class and every other instance
are untouched), and keeps the original bound method for ``unpatch``. Parameters and buffers are the module's own: nothing is copied and
state_dict keys do not change.

A patched forward that meets an input the adapter cannot serve exactly calls the original forward
for that call and counts it (``module._elsa.delegated``); it never returns a different answer.

A module whose forward is already replaced on the instance (another library's wrapper) is skipped,
with that reason. ``torch.nn.DataParallel`` is not supported: its replicas copy the instance
attributes, so their forward would keep serving the source module (DistributedDataParallel, one
process per GPU, has no replicas and works).
"""
from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import types
import warnings
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch


class Adapter:
    """Base class. Subclasses set ``name`` and ``targets`` and implement ``forward``.

    ``targets`` are "module.path:ClassName" strings, imported lazily so that a missing optional
    package (timm, vggt) only makes the adapter unavailable.
    """

    name: str = "adapter"
    targets: tuple[str, ...] = ()
    # the method replaced on each instance: "forward", or one the module's own forward calls (the
    # Swin blocks' "_attn"), so that the rest of that forward stays the library's
    method: str = "forward"
    # keyword options of ``patch`` this adapter reads, besides ``precision``, ``backend`` and
    # ``token_merging`` (patch refuses a keyword that no registered adapter reads: a typo never
    # silently does nothing)
    options: frozenset = frozenset()
    # options that take effect through modules of the adapters that list them only: ``patch`` raises
    # when one is given (not None or False) and no module of those adapters gets patched (it would
    # silently do nothing)
    anchors: frozenset = frozenset()

    def classes(self) -> tuple[type, ...]:
        found = []
        for t in self.targets:
            mod, _, cls = t.partition(":")
            try:
                found.append(getattr(importlib.import_module(mod), cls))
            except (ImportError, AttributeError):
                continue
        return tuple(found)

    def check_options(self, options: dict) -> None:
        """Raise TypeError / ValueError, saying what is wrong and how to fix it, for a value of one of
        the options this adapter reads that it cannot take (type or range). ``patch`` calls it for
        every registered adapter before it looks at any module."""

    def skip_reason(self, module: torch.nn.Module, options: dict) -> Optional[str]:
        """None if ``module`` can be patched, else a short reason (reported, module left alone). May
        raise for an option value that does not fit this module (``patch`` asks every module before
        it patches any, so the model is then left untouched)."""
        return None

    def initial_memo(self, module: torch.nn.Module, options: dict) -> dict:
        """What :attr:`PatchState.memo` starts with when ``module`` is patched. (A key a compiled
        graph reads must be there from the start: dynamo guards on a missing key's absence, and an
        eager call that adds it would recompile the graph.)"""
        return {}

    def forward(self, module: torch.nn.Module, state: "PatchState", *args, **kwargs):
        """The ELSA forward for one call. Call ``state.delegate(*args, **kwargs)`` for inputs this
        adapter cannot serve exactly."""
        raise NotImplementedError


# Every adapter a module was bound to, by the key its PatchState holds. A patched forward finds its
# adapter here rather than through an attribute of the module's state: see PatchState.
_BOUND: list[Adapter] = []


def _key_of(adapter: Adapter) -> int:
    for i, a in enumerate(_BOUND):
        if a is adapter or (type(a) is type(adapter) and a.__dict__ == adapter.__dict__):
            return i
    _BOUND.append(adapter)
    return len(_BOUND) - 1


class PatchState(torch.nn.Module):
    """Stored on a patched module as ``module._elsa`` (in its ``__dict__``, not as a submodule: it
    holds no parameters, and ``modules()`` / ``state_dict()`` do not see it). The counters count
    eager calls: inside a ``torch.compile``d graph a counter would be a guarded constant, and the
    graph would be recompiled at every call (until dynamo's recompile limit sends the model back to
    eager).

    Why an ``nn.Module`` holding the adapter's key, not a plain object holding the adapter: a
    compiled graph checks its guards before every call, and dynamo skips the guards of a whole
    module subtree whose dicts are unchanged since the last call only where every object a trace
    reads under it is a module, a dict, a function, a type or an immutable value. A plain object
    on the module (the state, the adapter, the patched forward) made each patched block's guards
    run in full at every call. So what a trace reads here is ``key`` (an int; :func:`adapter_of`
    finds the adapter in a module-level table, whose guards run once a call, not once a block),
    ``method``, ``options`` and ``memo`` (dicts of plain values)."""

    def __init__(self, adapter: Adapter, module: torch.nn.Module, options: dict, memo: Optional[dict] = None):
        super().__init__()
        original = getattr(module, adapter.method)  # the module's bound forward before patching
        bound = isinstance(original, types.MethodType) and original.__self__ is module
        # (the instance dict directly: nn.Module.__setattr__ is Python on every write; the original as
        # its function and the module, not as a bound method: a trace that reads a bound method reads
        # its __self__, which no dict tag covers)
        self.__dict__.update(adapter=adapter, key=_key_of(adapter), method=adapter.method,
                             function=original.__func__ if bound else original, owner=module if bound else None,
                             options=options, calls=0, delegated=0, delegate_reasons={},
                             memo={} if memo is None else memo)  # what the adapter keeps between calls

    @property
    def original(self) -> Callable:
        """The module's forward (or adapter ``method``) as it was before patching."""
        return self.function if self.owner is None else types.MethodType(self.function, self.owner)

    def __setstate__(self, state: dict) -> None:
        # a copy (copy.deepcopy, torch.load) holds a copy of the adapter: its key is the registered
        # one it equals, if any (so that copies do not add entries), else a new one
        super().__setstate__(state)
        self.__dict__["key"] = _key_of(self.adapter)

    def count_call(self) -> None:
        if not torch.compiler.is_compiling():
            self.__dict__["calls"] += 1

    def delegate(self, *args, reason: str = "unsupported input", **kwargs):
        if not torch.compiler.is_compiling():
            self.__dict__["delegated"] += 1
            self.delegate_reasons[reason] = self.delegate_reasons.get(reason, 0) + 1
        if self.owner is None:
            return self.function(*args, **kwargs)
        return self.function(self.owner, *args, **kwargs)


def adapter_of(state: PatchState) -> Adapter:
    """The adapter ``state``'s module was patched with (read through the key: see PatchState)."""
    return _BOUND[state.key]


@dataclass
class PatchReport:
    """What ``patch`` did: per adapter, the patched module names and the skipped ones with reasons."""
    patched: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    already: list[str] = field(default_factory=list)

    @property
    def num_patched(self) -> int:
        return sum(len(v) for v in self.patched.values())

    def __str__(self) -> str:
        lines = [f"elsa_vision.patch: {self.num_patched} module(s) patched"]
        for name, mods in self.patched.items():
            lines.append(f"  {name}: {len(mods)} patched")
        for name, items in self.skipped.items():
            for mod, why in items:
                lines.append(f"  {name}: skipped {mod or '<root>'}: {why}")
        if self.already:
            lines.append(f"  {len(self.already)} already patched (left as is)")
        return "\n".join(lines)


ADAPTERS: list[Adapter] = []


def register(adapter: Adapter) -> Adapter:
    """Add an adapter (instance) to the registry; later registrations win for the same class."""
    ADAPTERS.insert(0, adapter)
    return adapter


def _load_builtin() -> None:
    # Importing an adapter file registers its adapters; a missing optional package is fine.
    for mod in ("timm", "vggt", "streamvggt"):
        name = f"{__package__}.{mod}"
        if importlib.util.find_spec(name) is None:  # adapter file not shipped in this build
            continue
        try:
            importlib.import_module(name)
        except ImportError as e:  # the model package itself is missing: its adapters are unavailable
            if (e.name or "").startswith(__package__ or "elsa_vision"):
                raise


def _class_table() -> dict[type, Adapter]:
    _load_builtin()
    table: dict[type, Adapter] = {}
    for a in reversed(ADAPTERS):  # earlier-registered first, later ones override
        for cls in a.classes():
            table[cls] = a
    return table


def _registered_base(cls: type, table: dict) -> Optional[type]:
    """The nearest registered base class of ``cls`` (None if it has none)."""
    for base in cls.__mro__[1:]:
        if base in table:
            return base
    return None


def _selected(name: str, include, exclude) -> bool:
    if include is not None and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    if exclude is not None and any(fnmatch.fnmatchcase(name, p) for p in exclude):
        return False
    return True


def patch(model: torch.nn.Module, *, precision: str = "auto", token_merging=None,
          include: Optional[Sequence[str]] = None, exclude: Optional[Sequence[str]] = None,
          **options: Any) -> PatchReport:
    """Patch every module of ``model`` whose class has an adapter.

    include / exclude: glob patterns on module names (``model.named_modules()``), e.g.
    ``exclude=["blocks.0.*"]``. Other keyword options are passed to the adapters (see each adapter's
    docs). Patching an already-patched module is a no-op (listed in ``report.already``; a warning
    says so where this call's options differ from the ones it was patched with).
    """
    from ..api import PRECISIONS
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"patch expects a torch.nn.Module, got {type(model).__name__}")
    table = _class_table()
    known = {"backend"}.union(*(a.options for a in ADAPTERS))
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"patch() got unknown option(s) {unknown}; the options adapters read are "
                        f"precision, token_merging, include, exclude and {sorted(known)}")
    from ..dispatch import check_backend_name
    check_backend_name(options.get("backend", "auto"))
    check_patterns(include, "include")
    check_patterns(exclude, "exclude")
    opts = dict(options, precision=precision, token_merging=token_merging)
    for adapter in ADAPTERS:  # every option checked before any module is touched
        adapter.check_options(opts)
    report = PatchReport()
    chosen = []  # (name, module, adapter): bound only once every module has been asked
    differ = []  # already patched, with other options, and selected by this call
    kept = []  # the adapters of the modules already patched
    for name, mod in model.named_modules():
        adapter = table.get(type(mod))
        if adapter is None:
            base = _registered_base(type(mod), table)
            if base is not None:
                # a subclass may override forward or change attributes: report it, never guess
                report.skipped.setdefault(table[base].name, []).append(
                    (name, f"{type(mod).__module__}.{type(mod).__qualname__} subclasses {base.__qualname__} "
                           "but is not registered itself (its forward may differ); register an adapter for it"))
            continue
        state = state_of(mod)
        if state is not None:
            report.already.append(name)
            kept.append(state.adapter)
            if state.options != opts and _selected(name, include, exclude):
                differ.append(name)
            continue
        if not _selected(name, include, exclude):
            report.skipped.setdefault(adapter.name, []).append((name, "excluded by include/exclude"))
            continue
        why = adapter.skip_reason(mod, opts)
        if not why and adapter.method in mod.__dict__:
            why = (f"its {adapter.method} is replaced on the instance (a wrapper from other code), which patching "
                   f"would bypass; remove it (del module.{adapter.method}) or patch before wrapping")
        if why:
            report.skipped.setdefault(adapter.name, []).append((name, why))
            continue
        chosen.append((name, mod, adapter))
    owners: dict = {}
    for adapter in ADAPTERS:
        for opt in adapter.anchors:
            owners.setdefault(opt, []).append(adapter)
    served = [a for _, _, a in chosen] + kept
    for opt, adapters in owners.items():
        value = opts.get(opt)
        if value is not None and value is not False and not any(a is b for a in served for b in adapters):
            raise ValueError(f"patch(): {opt} works through {' / '.join(a.name for a in adapters)} modules, and "
                             f"this model has none that would be patched ({type(model).__name__}); leave {opt} out")
    if differ:  # (before binding: where warnings are errors, the model is then left as it was)
        warnings.warn(f"patch(): {len(differ)} module(s) already patched with other options keep those "
                      f"(e.g. {differ[0] or '<root>'}); unpatch() first to patch with these", UserWarning, stacklevel=3)
    bound = []
    try:
        for name, mod, adapter in chosen:
            _bind(mod, adapter, opts)
            bound.append(mod)
            report.patched.setdefault(adapter.name, []).append(name)
    except BaseException:  # (an adapter's initial memo raised: no module stays half the call's)
        for mod in bound:
            _unbind(mod)
        raise
    return report


def register_extra(table: dict, groups: Iterable[tuple[str, Sequence[type]]],
                   validate: Optional[Callable[[str, type], None]] = None) -> Callable[[], None]:
    """Add classes to an adapter family's ``table`` of extra served classes (key → list), after
    ``validate(key, cls)``; every entry must be an nn.Module class. Returns the function that
    removes what this call added (the body of the families' ``register_classes``)."""
    added: list[tuple[str, type]] = []
    for key, classes in groups:
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
                raise TypeError(f"register_classes: {key} entries must be nn.Module classes, got {cls!r}")
            if validate is not None:
                validate(key, cls)
            if cls not in table[key]:
                table[key].append(cls)
                added.append((key, cls))

    def remove() -> None:
        for key, cls in added:
            if cls in table[key]:
                table[key].remove(cls)

    return remove


def check_flag(options: dict, name: str, default: bool) -> bool:
    """The bool option ``name`` (``default`` when absent); TypeError for anything but True / False."""
    value = options.get(name, default)
    if not isinstance(value, bool):
        raise TypeError(f"patch(): {name} must be True or False, got {value!r}")
    return value


def check_count(options: dict, name: str, what: str, none_ok: bool = False) -> None:
    """The option ``name``, when given, is a positive int (``what`` it counts), or None if ``none_ok``:
    TypeError for another type, ValueError for an int below 1."""
    value = options.get(name)
    if value is None and (none_ok or name not in options):
        return
    wanted = f"a positive int ({what}){' or None' if none_ok else ''}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"patch(): {name} must be {wanted}, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"patch(): {name} must be {wanted}, got {value!r}")


def check_patterns(value, name: str) -> None:
    """include / exclude: None or a list of glob patterns (a bare string would be read as one pattern
    per character, and its "*" would match every module)."""
    if value is None:
        return
    if isinstance(value, (str, bytes)):
        raise TypeError(f"patch(): {name} must be a list of glob patterns, got the string {value!r}; "
                        f"write {name}=[{value!r}]")
    if not isinstance(value, Iterable) or isinstance(value, Iterator) or not all(isinstance(p, str) for p in value):
        raise TypeError(f"patch(): {name} must be a list of glob patterns (str), got {value!r}")


def hooked(module: Optional[torch.nn.Module], *, global_hooks: bool = True, backward: bool = False) -> bool:
    """Whether calling ``module`` would run hooks: its own forward (pre-)hooks — and, with
    ``backward``, its backward hooks — and with ``global_hooks`` the global module hooks of the same
    kinds. ``module`` None: the global hooks alone."""
    glob = torch.nn.modules.module
    if module is not None and (module._forward_hooks or module._forward_pre_hooks or (
            backward and (module._backward_hooks or module._backward_pre_hooks))):
        return True
    return global_hooks and bool(glob._global_forward_hooks or glob._global_forward_pre_hooks or (
        backward and (glob._global_backward_hooks or glob._global_backward_pre_hooks)))


def hooked_any(modules: Sequence[torch.nn.Module], *, global_hooks: bool = True, backward: bool = False) -> bool:
    """:func:`hooked` of any of ``modules``, the global hooks looked at once (a plain loop: these
    checks run on every patched call)."""
    for m in modules:
        if hooked(m, global_hooks=False, backward=backward):
            return True
    return global_hooks and hooked(None, backward=backward)


@torch.compiler.assume_constant_result
def _tag_guards() -> bool:
    # (a constant of the trace, not a guard on dynamo's config: both branches that read it give the
    # same values, only the guards they leave differ)
    import torch._dynamo.config
    return bool(getattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", False))


def module_attr(module: torch.nn.Module, name: str, default=None):
    """``getattr(module, name, default)`` for a name a module may lack, depending on its version:
    looked up in the module's dicts (instance attributes, parameters, buffers, submodules), then on
    its class, not by ``nn.Module.__getattr__``. That raises AttributeError for a missing name,
    and a graph torch.compile traces guards on the miss by asking again before every call: an
    exception raised and caught in Python per name and module, more than all of timm's own guards
    together for a ViT (docs/RESULTS.md, "Guards of compiled patched models")."""
    traced = _traced_with_tags()
    if not traced and name in module.__dict__:
        return module.__dict__[name]
    for found in (module._parameters, module._buffers, module._modules):
        if name in found:
            return found[name]
    if traced:
        # (not from module.__dict__ by name: see state_of. A name the module lacks then leaves a
        # guard that asks nn.Module.__getattr__ at every call)
        return getattr(module, name, default)
    # (a class attribute or property: asked of the class, whose lookup of a missing name stays in C)
    return getattr(module, name) if hasattr(type(module), name) else default


def bypass_reason(module: torch.nn.Module, skipped: Sequence[str] = ("attn_drop",)) -> Optional[str]:
    """Why a call must run the original forward because of what an ELSA forward does not run (None
    if nothing): attention dropout that would be active — fused SDPA paths follow module.training,
    unfused ones the dropout module's own mode (kept in train for MC dropout) — or hooks on one of
    the ``skipped`` children (attention-map extraction hooks softmax or attn_drop)."""
    drop = module_attr(module, "attn_drop")
    if drop is not None and getattr(drop, "p", 0.0) > 0 and (module.training or drop.training):
        return "attention dropout in training"
    for name in skipped:
        child = module._modules.get(name)  # (a child module, or none: hooks are a module's)
        if child is not None and hooked(child, global_hooks=False, backward=True):
            return f"hooks on {name}, which ELSA's forward does not call"
    return None


class _PatchedForward(torch.nn.Module):
    """The forward (or adapter ``method``) a patched module carries as an instance attribute. The state is looked up on the
    module at each call (not captured), and copying or pickling rebuilds it around the copied
    module (``__reduce__``): copy.deepcopy of a patched model (EMA copies, model soups) gives a copy
    whose forward, delegation target and counters are its own, and torch.save / torch.load of a
    patched model loads patched."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.__dict__["module"] = module  # (not a submodule: the module holds this, not the reverse)

    def __call__(self, *args, **kwargs):  # (not nn.Module's __call__: no hooks of its own, no host time)
        module = self.module
        state = module._elsa
        state.count_call()
        return _BOUND[state.key].forward(module, state, *args, **kwargs)

    def __reduce__(self):
        return (_PatchedForward, (self.module,))


def _bind(mod: torch.nn.Module, adapter: Adapter, opts: dict) -> None:
    state = PatchState(adapter, mod, options=dict(opts), memo=adapter.initial_memo(mod, opts))
    # object.__setattr__: nn.Module.__setattr__ would try to register these as submodules/params
    object.__setattr__(mod, "_elsa", state)
    object.__setattr__(mod, adapter.method, _PatchedForward(mod))


def _unbind(mod: torch.nn.Module) -> None:
    """Undo _bind: the module's own forward again (patch skips modules with a method of their own)."""
    del mod.__dict__[mod.__dict__["_elsa"].method]
    del mod.__dict__["_elsa"]


def is_patched(mod: torch.nn.Module) -> bool:
    """Whether ``mod`` is patched and its patched method is still the one ``patch`` bound."""
    traced = _traced_with_tags()
    state = _instance_attr(mod, "_elsa", traced)
    # (a _PatchedForward is only ever an instance's, so the attribute is the instance's own)
    return isinstance(state, PatchState) and type(_instance_attr(mod, state.method, traced)) is _PatchedForward


def state_of(mod: torch.nn.Module) -> Optional[PatchState]:
    """``mod``'s PatchState, None if it is not patched.

    Inside a trace with dynamo's recursive dict tags on (``torch._dynamo.config.
    use_recursive_dict_tags_for_guards``), read as an attribute, not from ``mod.__dict__`` by name:
    a trace that reads a module's ``__dict__`` by name makes that module's guards run in full
    before every call, where otherwise a module subtree whose dicts are unchanged is skipped (see
    PatchState). (A module without the attribute then leaves a guard that asks
    ``nn.Module.__getattr__`` before every call: the adapters ask this of modules they patched.)"""
    state = _instance_attr(mod, "_elsa", _traced_with_tags())
    return state if isinstance(state, PatchState) else None


def _instance_attr(mod: torch.nn.Module, name: str, traced: bool):
    # an attribute only ever set on instances, by name (see state_of for why as an attribute when traced)
    return getattr(mod, name, None) if traced else mod.__dict__.get(name)


def replaced(module: torch.nn.Module, name: str = "forward") -> bool:
    """Whether ``module`` carries its own ``name`` method on the instance (another library's
    wrapper), not its class's. Traced with dict tags on: read as an attribute (see state_of)."""
    if _traced_with_tags():
        value = getattr(module, name, None)
        return not (isinstance(value, types.MethodType) and value.__self__ is module
                    and value.__func__ is getattr(type(module), name, None))
    return name in module.__dict__


def _traced_with_tags() -> bool:
    return torch.compiler.is_compiling() and _tag_guards()


def unpatch(model: torch.nn.Module, names: Optional[Collection[str]] = None) -> int:
    """Restore every patched module's original forward (with ``names``: only the patched modules of
    these names, as ``model.named_modules()`` gives them); returns the number restored. A module
    whose patched method was replaced or removed since (a wrapper set on it) is an error, raised
    before any module is restored: restoring would drop that wrapper, keeping it would call a
    forward that is no longer patched."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"unpatch expects a torch.nn.Module, got {type(model).__name__}")
    found = [(name, mod) for name, mod in model.named_modules()
             if state_of(mod) is not None and (names is None or name in names)]
    changed = [name or "<root>" for name, mod in found if not is_patched(mod)]
    if changed:
        raise RuntimeError(f"unpatch: the patched method of {', '.join(changed)} was replaced or removed after "
                           "patch() (e.g. a hook library's wrapper); remove that wrapper first, then unpatch. "
                           "No module was restored.")
    for _, mod in found:
        _unbind(mod)
    return len(found)


def patched_modules(model: torch.nn.Module) -> list[tuple[str, PatchState]]:
    """(name, state) of every patched module: call and delegation counters live in the state."""
    return [(n, s) for n, m in model.named_modules() if (s := state_of(m)) is not None]
