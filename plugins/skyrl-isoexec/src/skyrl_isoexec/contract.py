"""The execution contract: what each (op, site) computes with, canonically serialised and hashed,
the handshake that compares a trainer's and an engine's, and the fingerprint check of what ran.

Input is a runtime's ledger as JSON (``OpLedger.as_dict()``, what runtimes put under ``"ledger"``
in ``execution_contract()``): ``{"op@site": {"impl", "version", "constants", "calls"}, "model": {...}}``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

from skyrl_core.ops.vocabulary import OPS, ROLE_SITES

CONTRACT_VERSION = "1"
# Ops every model computes; the others only where ``model.op_modules`` counts modules for them.
_ALWAYS = ("logprobs",)


class ContractMismatch(RuntimeError):
    """Trainer and engine contracts differ, or a runtime ran what it did not declare."""

    def __init__(self, mismatches: list[str]) -> None:
        self.mismatches = mismatches
        super().__init__("IsoExec refuses: " + "; ".join(mismatches))


# --- canonical JSON ---------------------------------------------------------------------------


def _canonical(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):  # no raw floats: their text form is not canonical
        return "f64:" + struct.pack(">d", value).hex()
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    raise TypeError(f"cannot put {type(value).__name__} {value!r} into an execution contract")


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, floats as their IEEE-754 bit patterns (``"f64:<hex>"``)."""
    return json.dumps(_canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


# --- the environment that changes results -------------------------------------------------------


def environment(dtype: str | None) -> dict[str, Any]:
    """torch version, BLAS/oneDNN builds and CPU capability, the model dtype."""
    import torch

    config = torch.__config__.show()
    blas = {}
    for line in config.splitlines():
        line = line.strip()
        if "Math Kernel Library" in line or "MKL-DNN" in line or "OpenBLAS" in line:
            blas[line.split(" Version")[0].removeprefix("- ").strip()] = line
    info = dict(part.split("=", 1) for part in config.split(", ") if part.count("=") == 1 and " " not in part.split("=")[0])
    return {
        "torch": str(torch.__version__),  # TorchVersion does not survive vLLM's msgpack RPC
        "blas": info.get("BLAS_INFO", "unknown"),
        "blas_builds": blas,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "device": "cpu",
        "dtype": dtype,
    }


# --- building a contribution ---------------------------------------------------------------------


def _identity(entry: dict[str, Any]) -> dict[str, Any]:
    return {"impl": entry.get("impl"), "version": entry.get("version"), "constants": entry.get("constants", {})}


def build_contract(role: str, ledger: dict[str, Any] | None, *, enabled: bool) -> dict[str, Any]:
    """IsoExec's contribution to a runtime's contract.

    ``ops`` maps each op to the implementation identity installed at the role's sites (the sites
    must agree; if not, per-site entries ``op@site`` are kept and the handshake reports them);
    ``hash`` is SHA-256 over ``ops``, ``environment`` and, where a stock op's bits depend on it,
    ``threads``. ``fingerprint`` lists what ran against what was declared.
    """
    import torch

    ledger = ledger or {}
    model = ledger.get("model", {})
    ops: dict[str, Any] = {}
    for op in OPS:
        identities = {site: _identity(ledger.get(f"{op}@{site}", {})) for site in ROLE_SITES[role]}
        first = next(iter(identities.values()))
        if all(i == first for i in identities.values()):
            ops[op] = first
        else:
            ops.update({f"{op}@{site}": ident for site, ident in identities.items()})
    identity: dict[str, Any] = {
        "contract_version": CONTRACT_VERSION,
        "ops": ops,
        "environment": environment(model.get("dtype")),
    }
    if not all(str(v.get("impl", "")).startswith("isoexec.") for v in ops.values()):
        identity["threads"] = torch.get_num_threads()  # stock GEMMs change bits with the thread count
    problems: list[str] = []
    if enabled:
        from skyrl_isoexec.specs import CANONICAL

        problems = [
            f"{role}: IsoExec is on but {key} has {ident.get('impl')} installed "
            "(was the runtime built before IsoExec was enabled?)"
            for key, ident in sorted(ops.items())
            if ident.get("impl") != CANONICAL[key.split("@")[0]].name
        ]
        problems += fingerprint_violations(role, ledger)
    return {
        "enabled": enabled,
        "role": role,
        "identity": identity,
        "hash": sha256(identity),
        "fingerprint": problems,
    }


def fingerprint_violations(role: str, ledger: dict[str, Any]) -> list[str]:
    """What ran vs what was declared, from a ledger dict with call counts.

    A violation: an op computed by another implementation than the declared one; an op the model
    computes with a declared IsoExec implementation that never ran at a site that has run (its
    module was not patched); model modules with no op mapping; ops computed outside any site.
    """
    problems: list[str] = []
    model = ledger.get("model", {})
    for name in model.get("unpatched", []):
        problems.append(f"{role}: module {name} computes an op but has no IsoExec mapping")
    for site, modules in sorted(model.get("unrun_modules", {}).items()):
        shown = ", ".join(modules[:5]) + (f" and {len(modules) - 5} more" if len(modules) > 5 else "")
        problems.append(f"{site}: patched modules never dispatched there (bypassed?): {shown}")
    for op, calls in sorted(model.get("unscoped_calls", {}).items()):
        problems.append(f"{op} ran {calls} times outside any op site (no site_scope)")
    applicable = set(_ALWAYS) | {op for op, n in model.get("op_modules", {}).items() if n}
    sites_run = {
        key.split("@", 1)[1]
        for key, entry in ledger.items()
        if "@" in key and any(entry.get("calls", {}).values())
    }
    for key, entry in sorted(ledger.items()):
        if "@" not in key:
            continue
        op, site = key.split("@", 1)
        declared = entry.get("impl")
        calls = entry.get("calls", {})
        others = {impl: n for impl, n in calls.items() if impl != declared and n}
        if others:
            ran = ", ".join(f"{impl} x{n}" for impl, n in sorted(others.items()))
            problems.append(f"{op} @ {site}: declared {declared} but {ran} ran")
        if (
            site in sites_run
            and op in applicable
            and str(declared).startswith("isoexec.")
            and not calls.get(declared)
        ):
            problems.append(f"{op} @ {site}: declared {declared} but it never ran (module not patched?)")
    return problems


def declared_contract(config: Any, role: str) -> dict[str, Any]:
    """The contract ``role`` would declare for a run ``config`` (no model is built: what runs adds
    the fingerprint). The dtype is the config's ``model.dtype``."""
    from skyrl_core.ops import prepare_model
    from skyrl_isoexec import state

    ledger = prepare_model(None, role).as_dict()
    ledger["model"]["dtype"] = config.model.dtype
    return build_contract(role, ledger, enabled=state.enabled())


# --- the handshake ------------------------------------------------------------------------------


def _find(contract: dict[str, Any]) -> dict[str, Any] | None:
    """IsoExec's contribution inside a full runtime contract (or the contribution itself)."""
    if "identity" in contract and "hash" in contract:
        return contract
    for value in contract.values():
        if isinstance(value, dict) and "identity" in value and "hash" in value and "enabled" in value:
            return value
    return None


def _describe(ident: dict[str, Any] | None) -> str:
    if not ident:
        return "(nothing)"
    constants = canonical_json(ident.get("constants", {}))
    return f"{ident.get('impl')} v{ident.get('version')} {constants}"


def both_enabled(trainer_contract: dict[str, Any], engine_contract: dict[str, Any]) -> bool:
    """Whether both contracts declare IsoExec on."""
    trainer, engine = _find(trainer_contract), _find(engine_contract)
    return bool(trainer and engine and trainer["enabled"] and engine["enabled"])


def compare(trainer_contract: dict[str, Any], engine_contract: dict[str, Any]) -> list[str]:
    """Every reason the two contracts are not the same numerics; empty when they are.

    Inert (empty) when IsoExec is off on both sides.
    """
    trainer, engine = _find(trainer_contract), _find(engine_contract)
    if trainer is None and engine is None:
        return []
    if trainer is None or engine is None:
        missing = "trainer" if trainer is None else "engine"
        return [f"the {missing} contract has no IsoExec section (is skyrl-isoexec installed there?)"]
    if not trainer["enabled"] and not engine["enabled"]:
        return []
    problems: list[str] = []
    for side, c in (("trainer", trainer), ("engine", engine)):
        if not c["enabled"]:
            problems.append(f"IsoExec is enabled on one side but not in the {side}")
        if sha256(c["identity"]) != c["hash"]:
            problems.append(f"the {side} contract hash {c['hash'][:12]} does not match its content (tampered?)")
        problems.extend(f"{side} fingerprint: {p}" for p in c.get("fingerprint", []))
    t_id, e_id = trainer["identity"], engine["identity"]
    for field in sorted(set(t_id) | set(e_id)):
        if field == "ops" or t_id.get(field) == e_id.get(field):
            continue
        if field == "environment":
            for key in sorted(set(t_id[field]) | set(e_id[field])):
                if t_id[field].get(key) != e_id[field].get(key):
                    problems.append(f"environment {key}: trainer {t_id[field].get(key)!r} != engine {e_id[field].get(key)!r}")
        else:
            problems.append(f"{field}: trainer {t_id.get(field)!r} != engine {e_id.get(field)!r}")
    for op in OPS:
        for t_site in ROLE_SITES["trainer"]:
            for e_site in ROLE_SITES["engine"]:
                t = t_id["ops"].get(op) or t_id["ops"].get(f"{op}@{t_site}")
                e = e_id["ops"].get(op) or e_id["ops"].get(f"{op}@{e_site}")
                if t != e:
                    problems.append(f"{op} @ {t_site} vs {e_site}: {_describe(t)} != {_describe(e)}")
    return problems


def handshake(trainer_contract: dict[str, Any], engine_contract: dict[str, Any]) -> None:
    """Raise ``ContractMismatch`` listing every difference; return when the contracts agree."""
    problems = compare(trainer_contract, engine_contract)
    if problems:
        raise ContractMismatch(problems)
