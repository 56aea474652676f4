"""Per-call op dispatch, shared by every model patcher (``skyrl_core.ops.hf`` for transformers
models; a runtime plugin may bring its own patcher for its own layer classes, e.g. skyrl-megatron).

A patcher walks a model once and, for each module that computes an op, replaces its ``forward`` so
that each call asks the model's ``OpDispatch`` for the implementation installed at
``current_site()``: the stock implementation is the module's own forward (``None`` from
``resolve``), any other is called with the op's calling convention (listed in
``skyrl_core.ops.hf``). ``PatchRecord`` collects what a patcher claimed, for ``ledger.meta``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from skyrl_core.ops.ledger import OpLedger
from skyrl_core.ops.stock import DEFAULT_IMPLS, UNSCOPED
from skyrl_core.ops.vocabulary import current_site


class OpDispatch:
    """Resolves, per call, the implementation of an op at the current site, and observes it.

    ``tap``, when set, is called as ``tap(op, module_name, output)`` after every op a patched module
    computes (debugging: per-op digests).
    """

    def __init__(self, ledger: OpLedger) -> None:
        self.ledger = ledger
        self.tap: Callable[[str, str, Any], None] | None = None
        self._loaded: dict[str, Callable[..., Any]] = {}

    def resolve(self, op: str, module: Any = None) -> Callable[..., Any] | None:
        """The installed implementation's callable, or None where the stock one (the module's own
        forward) is installed. ``module`` is the patched module asking (recorded as having run)."""
        site = current_site()
        impl = self.ledger.impl(op, site) if site is not None else None
        name = getattr(module, "_skyrl_name", None)
        if impl is None or impl.name == DEFAULT_IMPLS[op].name:
            self.ledger.observe(op, site if impl is not None else UNSCOPED, DEFAULT_IMPLS[op].name, name)
            return None
        self.ledger.observe(op, site, impl.name, name)
        return self.load(impl)

    def load(self, impl: Any) -> Callable[..., Any]:
        """``impl``'s callable (an ``OpImplSpec``), loaded once per dispatch."""
        fn = self._loaded.get(impl.name)
        if fn is None:
            fn = self._loaded[impl.name] = impl.load_factory()
        return fn

    def call(self, op: str, module: Any, stock: Callable[[], Any], installed: Callable[[Callable[..., Any]], Any]) -> Any:
        """``stock()`` where the stock implementation is installed, else ``installed(fn)``."""
        fn = self.resolve(op, module)
        out = stock() if fn is None else installed(fn)
        self.emit(op, module, out)
        return out

    def emit(self, op: str, module: Any, out: Any) -> None:
        if self.tap is not None:
            self.tap(op, getattr(module, "_skyrl_name", ""), out)


def patch_forward(module: Any, forward: Callable[..., Any]) -> None:
    """Route ``module``'s calls through ``forward(module, *args)``; the original stays callable as
    ``module._skyrl_stock_forward``."""
    module._skyrl_stock_forward = module.forward
    module.forward = functools.partial(forward, module)


def attach_dispatch(model: Any, ledger: OpLedger) -> OpDispatch | None:
    """A new ``OpDispatch`` attached to ``model``, or None when the model was already patched (its
    dispatch then reports to ``ledger``: patching is idempotent)."""
    existing = getattr(model, "_skyrl_dispatch", None)
    if existing is not None:
        existing.ledger = ledger
        return None
    dispatch = OpDispatch(ledger)
    model._skyrl_dispatch = dispatch
    return dispatch


class PatchRecord:
    """What a patcher did: modules claimed per op, and modules that look like op sites but have no
    mapping (``unpatched``: a plugin that needs every op under its control refuses them)."""

    def __init__(self, dispatch: OpDispatch) -> None:
        self.dispatch = dispatch
        self.counts: dict[str, int] = {}
        self.unpatched: list[str] = []
        self.named: list[str] = []

    def claim(self, module: Any, qualname: str, op: str, forward: Callable[..., Any] | None = None, *, also: tuple[str, ...] = ()) -> None:
        """``module`` computes ``op`` (and the ops in ``also``) through the dispatch; ``forward``
        replaces its forward (None: the module dispatches by other means)."""
        module._skyrl_dispatch = self.dispatch
        module._skyrl_name = qualname
        self.named.append(qualname)
        if forward is not None:
            patch_forward(module, forward)
        for name in (op, *also):
            self.counts[name] = self.counts.get(name, 0) + 1

    def refuse(self, qualname: str, class_name: str) -> None:
        self.unpatched.append(f"{qualname or '<model>'} ({class_name})")

    def finish(self, ledger: OpLedger, **meta: Any) -> None:
        """Record ``op_modules``, ``unpatched``, ``patched_modules`` (and ``meta``) in ``ledger.meta``."""
        ledger.meta.update(
            op_modules=dict(sorted(self.counts.items())), unpatched=self.unpatched, patched_modules=sorted(self.named), **meta
        )
