"""model.dtype chooses megatron's compute dtype too: bf16 on CPU and contradictions are refused before a run."""

import pytest

from skyrl_megatron.options import MegatronOptions
from skyrl_megatron.preflight import precision_problem


@pytest.mark.parametrize(
    ("dtype", "options", "expected"),
    [
        ("float32", MegatronOptions(device="cpu"), None),
        ("bfloat16", MegatronOptions(device="cuda", mixed_precision="bf16"), None),
        ("bfloat16", MegatronOptions(device="cpu", mixed_precision="bf16"), "model.dtype: 'bfloat16' needs megatron's bf16"),
        ("bfloat16", MegatronOptions(device="cuda"), "backend.options.mixed_precision: 'fp32' contradicts model.dtype: 'bfloat16'"),
        ("float32", MegatronOptions(device="cuda", mixed_precision="bf16"), "mixed_precision: 'bf16' contradicts model.dtype: 'float32'"),
    ],
)
def test_precision_follows_model_dtype(dtype, options, expected):
    problem = precision_problem(dtype, options)
    assert problem == expected if expected is None else expected in problem
