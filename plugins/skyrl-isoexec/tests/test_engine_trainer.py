"""End to end with the real runtimes: the skyrl-torch engine generates, the skyrl-fsdp trainer scores
the same tokens under other batch compositions and paddings; logprobs compared on their bits."""

from __future__ import annotations

import pytest

from skyrl_isoexec.verify import verify

# Every preset family; Qwen3-Next is hybrid (GatedDeltaNet linear attention + attention): the
# engine carries each sample's conv and recurrent state from its prefill through decode.
ENGINE_FAMILIES = ("qwen3", "llama", "qwen3-moe", "qwen3-next")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_and_trainer_logprobs_are_bitwise_identical(family, dtype):
    on = verify(preset=family, dtype=dtype, batches=2, echo=lambda s: None)
    assert on.tokens > 0
    assert (on.differing, on.max_abs_diff, on.contract_problems) == (0, 0.0, ())
    assert on.trainer_hash == on.engine_hash
    off = verify(preset=family, dtype=dtype, batches=2, off=True, echo=lambda s: None)
    assert off.differing > 0  # negative control


@pytest.mark.slow
def test_fsdp_world_size_2():
    """Two FSDP ranks (Ray actors, gloo) score their halves of the batch: still bit-identical."""
    on = verify(preset="qwen3", batches=2, world_size=2, echo=lambda s: None)
    assert (on.differing, on.contract_problems) == (0, ())
    off = verify(preset="qwen3", batches=2, world_size=2, off=True, echo=lambda s: None)
    assert off.differing > 0
