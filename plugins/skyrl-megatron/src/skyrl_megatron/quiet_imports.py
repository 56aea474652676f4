"""megatron-core's notes that it falls back from CUDA-only libraries, silenced on CPU.

Importing megatron-core without Transformer Engine or Apex warns six times that it falls back to
its local implementations (``multi_tensor_applier``/``multi_tensor_scale``, torch optimizers,
torch norms). Both libraries are CUDA-only: on CPU the fallbacks are the only implementations
there are, and the ones this backend is tested with, so the notes say nothing a CPU user can act
on. On GPU they stay (there, a missing Transformer Engine is worth knowing). The filters match
those messages only.
"""

from __future__ import annotations

import warnings

FALLBACK_NOTES = (
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    r"Apex is not installed\. Falling back to Torch Norm",
)


def silence_cpu_fallback_notes() -> None:
    """Ignore megatron-core's fallback notes (call before megatron-core is imported, on CPU)."""
    for pattern in FALLBACK_NOTES:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
