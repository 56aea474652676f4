"""Registration, options validation and the LR schedule: no model needed."""

import subprocess
import sys

import pytest

from skyrl_core.config.schema import Selection
from skyrl_core.plugins.manager import get_plugin_manager
from skyrl_fsdp.options import FSDPOptions
from skyrl_core.lr_schedule import lr_factor


def test_registering_imports_neither_torch_nor_ray():
    code = (
        "import sys, skyrl_fsdp.plugin, skyrl_fsdp.options\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'transformers'))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_fsdp_is_registered_with_its_options_class():
    spec = get_plugin_manager().spec("training_backend", "fsdp")
    assert spec.load_options_class() is FSDPOptions
    assert spec.factory == "skyrl_fsdp.backend:FSDPBackend"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"world_size": 0}, "world_size must be an integer >= 1; got 0"),
        ({"mixed_precision": "fp16"}, "mixed_precision must be one of auto, fp32, bf16; got 'fp16'"),
        ({"device": "tpu"}, "device must be one of auto, cpu, cuda; got 'tpu'"),
        ({"threads_per_rank": 0}, "threads_per_rank must be a positive integer or null; got 0"),
    ],
)
def test_bad_options_name_the_field_and_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        FSDPOptions(**options)


def test_config_loader_structures_backend_options():
    from skyrl_core.config.loader import structure_options

    spec = get_plugin_manager().spec("training_backend", "fsdp")
    options = structure_options(spec, {"world_size": 2, "mixed_precision": "bf16"}, path="backend.options")
    assert options == FSDPOptions(world_size=2, mixed_precision="bf16")
    with pytest.raises(Exception, match="world_sise"):
        structure_options(spec, {"world_sise": 2}, path="backend.options")


def test_selection_builds_through_the_runtime_helper():
    from skyrl_core.config.schema import ModelConfig, TrainerConfig
    from skyrl_core.testing.backend_contract import TINY_QWEN3
    from skyrl_core.trainer.runtime import build_selected
    from skyrl_fsdp.backend import FSDPBackend

    backend = build_selected(
        get_plugin_manager(),
        "training_backend",
        Selection(name="fsdp", options={"world_size": 1, "device": "cpu"}),
        ModelConfig(config=dict(TINY_QWEN3)),
        seed=0,
        trainer=TrainerConfig(),
    )
    try:
        assert isinstance(backend, FSDPBackend)
    finally:
        backend.close()


def test_warmup_is_linear_and_reaches_the_peak_on_its_last_step():
    factors = [lr_factor(s, schedule="constant", warmup_steps=4, total_steps=10) for s in range(6)]
    assert factors == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_and_linear_decay_to_zero_at_the_last_step():
    cosine = [lr_factor(s, schedule="cosine", warmup_steps=2, total_steps=6) for s in range(7)]
    assert cosine[:3] == [0.5, 1.0, 1.0]
    assert cosine[4] == pytest.approx(0.5)
    assert cosine[6] == pytest.approx(0.0, abs=1e-12)
    assert all(b < a for a, b in zip(cosine[2:], cosine[3:]))
    linear = [lr_factor(s, schedule="linear", warmup_steps=0, total_steps=4) for s in range(6)]
    assert linear == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="lr_schedule must be one of constant, cosine, linear; got 'step'"):
        lr_factor(0, schedule="step", warmup_steps=0, total_steps=1)


def test_cpu_gemm_choices_are_the_cores():
    """The options module keeps its own copy of the choices (it imports no torch; gemm_choice does):
    the copy must not drift from what ``linear_defaults`` accepts."""
    from skyrl_core.ops.gemm_choice import CPU_GEMMS
    from skyrl_fsdp import options

    assert options.CPU_GEMMS == CPU_GEMMS
