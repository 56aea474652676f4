"""The op ledger: which implementation a runtime installed at each (op, site), and which ran."""

from __future__ import annotations

import collections
from typing import Any

import attrs

from skyrl_core.plugins.records import OpImplSpec

# An ``OpLedger`` in its JSON form (``OpLedger.as_dict()``). Runtimes run in other processes (ranks,
# engine workers), so this form is what an execution contract carries and what the
# ``skyrl_execution_contract`` hook receives.
OpLedgerView = dict[str, Any]


@attrs.define
class OpLedger:
    """Declared implementations per (op, site) and counts of calls observed per (op, site, impl).

    ``declared`` feeds the execution contract; ``observed`` feeds the fingerprint check that what
    ran is what was declared. ``meta`` describes the model the ops were installed into (filled by
    ``skyrl_core.ops.hf.patch_hf_model``: architecture, dtype, op_modules, unpatched).
    """

    role: str
    declared: dict[tuple[str, str], OpImplSpec] = attrs.field(factory=dict)
    observed: collections.Counter = attrs.field(factory=collections.Counter)
    meta: dict[str, Any] = attrs.field(factory=dict)
    ran_modules: set[tuple[str, str]] = attrs.field(factory=set)

    def declare(self, op: str, site: str, impl: OpImplSpec) -> None:
        self.declared[(op, site)] = impl

    def impl(self, op: str, site: str) -> OpImplSpec | None:
        return self.declared.get((op, site))

    def observe(self, op: str, site: str, impl_name: str, module: str | None = None) -> None:
        """Count a call; ``module`` (a patched module's name) records that it dispatched at ``site``."""
        self.observed[(op, site, impl_name)] += 1
        if module is not None:
            self.ran_modules.add((site, module))

    def as_dict(self) -> dict[str, Any]:
        """JSON-able view, sorted: ``{"op@site": {"impl", "version", "constants", "calls"}, "model": meta}``.

        ``calls`` counts the calls observed per implementation name at that (op, site); ``model``
        is ``meta`` plus ``unscoped_calls`` (per op: calls made outside the runtime's sites) and
        ``unrun_modules`` (per site that has run: patched modules that never dispatched there).
        """
        calls: dict[tuple[str, str], dict[str, int]] = {}
        unscoped: dict[str, int] = {}
        for (op, site, impl_name), count in sorted(self.observed.items()):
            if (op, site) in self.declared:
                calls.setdefault((op, site), {})[impl_name] = count
            else:
                unscoped[op] = unscoped.get(op, 0) + count
        out: dict[str, Any] = {}
        for (op, site), impl in sorted(self.declared.items()):
            out[f"{op}@{site}"] = {
                "impl": impl.name,
                "version": impl.version,
                "constants": {k: v for k, v in impl.constants},
                "calls": calls.get((op, site), {}),
            }
        sites_run = {site for (_, site, _) in self.observed} & {site for (_, site) in self.declared}
        patched = self.meta.get("patched_modules", [])
        unrun = {site: [m for m in patched if (site, m) not in self.ran_modules] for site in sorted(sites_run)}
        out["model"] = {**self.meta, "unscoped_calls": unscoped, "unrun_modules": {k: v for k, v in unrun.items() if v}}
        return out
