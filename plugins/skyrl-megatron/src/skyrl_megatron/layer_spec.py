"""Which layer spec a Megatron rank builds: Transformer Engine's fused layers or megatron's local
(torch) modules.

The op sites (``skyrl_megatron.ops_sites``) map megatron's local layers only: Transformer Engine's
layers compute norms, linears and attention in their own fused kernels, which no installed op
implementation can reach. So Transformer Engine is chosen only when it can run (CUDA, installed, a
family whose spec megatron builds with it) and no plugin has installed an op implementation of its
own at a trainer site. When one has (IsoExec, or any op plugin), the rank builds the local spec in
the configured dtype (bf16 with ``mixed_precision: bf16``) so that every op runs the installed
implementation, instead of building TE layers that the IsoExec handshake would refuse by name.
"""

from __future__ import annotations

import logging
from typing import Sequence

import attrs

logger = logging.getLogger(__name__)

TRANSFORMER_ENGINE = "transformer_engine"
LOCAL = "local"


@attrs.frozen
class LayerSpecChoice:
    spec: str  # TRANSFORMER_ENGINE or LOCAL
    reason: str
    # Transformer Engine could run but is not used because of installed ops (logged: slower, deliberate).
    te_passed_over: bool = False

    @property
    def transformer_engine(self) -> bool:
        return self.spec == TRANSFORMER_ENGINE


def installed_trainer_ops() -> tuple[str, ...]:
    """``op@site (implementation)`` for each op a plugin installs at a trainer site in place of the stock one."""
    from skyrl_core.ops.install import install_op
    from skyrl_core.ops.stock import is_stock
    from skyrl_core.ops.vocabulary import OPS, ROLE_SITES

    found = []
    for site in ROLE_SITES["trainer"]:
        for op in OPS:
            impl = install_op(op, site)
            if not is_stock(impl):
                found.append(f"{op}@{site} ({impl.name})")
    return tuple(found)


def choose_layer_spec(*, device_type: str, te_available: bool, model_type: str, installed_ops: Sequence[str]) -> LayerSpecChoice:
    """The layer spec for a rank on ``device_type`` (``cpu``/``cuda``), given whether
    ``transformer_engine`` imports, the Hugging Face ``model_type`` and ``installed_trainer_ops()``."""
    if device_type != "cuda":
        return LayerSpecChoice(LOCAL, f"device {device_type}: Transformer Engine runs on CUDA only")
    if not te_available:
        return LayerSpecChoice(LOCAL, "transformer_engine is not installed")
    if model_type == "qwen3_next":
        # megatron's hybrid spec cannot scale norms by (1 + weight) as Qwen3-Next stores them.
        return LayerSpecChoice(LOCAL, "the Qwen3-Next hybrid is built from local modules (skyrl_megatron.hybrid)")
    if installed_ops:
        shown = ", ".join(installed_ops[:3]) + (f" and {len(installed_ops) - 3} more" if len(installed_ops) > 3 else "")
        return LayerSpecChoice(
            LOCAL,
            f"installed op implementations ({shown}) reach megatron's local layers only, not Transformer Engine's "
            "fused kernels: building the local layer spec instead of Transformer Engine's",
            te_passed_over=True,
        )
    return LayerSpecChoice(TRANSFORMER_ENGINE, "CUDA with transformer_engine installed")


def log_choice(choice: LayerSpecChoice, *, rank: int, dtype: str) -> None:
    """One line, on rank 0, when Transformer Engine is passed over for the installed ops."""
    if rank == 0 and choice.te_passed_over:
        logger.warning("megatron backend (%s): %s", dtype, choice.reason)
