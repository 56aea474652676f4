"""model.dtype chooses the vLLM engine's dtype too: a contradicting engine.options.dtype is refused before a run."""

import pytest

from skyrl_core.config.loader import structure_config
from skyrl_vllm.preflight import problems


@pytest.mark.parametrize(
    ("model_dtype", "engine_dtype", "refused"),
    [("float32", None, False), ("bfloat16", "bfloat16", False), ("float32", "bfloat16", True), ("bfloat16", "float16", True)],
)
def test_engine_dtype_follows_model_dtype(model_dtype, engine_dtype, refused):
    options = {} if engine_dtype is None else {"dtype": engine_dtype}
    cfg = structure_config({
        "model": {"config": {"model_type": "qwen3"}, "dtype": model_dtype},
        "engine": {"name": "vllm", "options": options},
        "data": {"train": "unused.jsonl"},
    })
    found = problems(cfg, cfg.engine.options)
    if not refused:
        assert found == []
    else:
        assert found == [f"engine.options.dtype: {engine_dtype!r} contradicts model.dtype: {model_dtype!r}; leave "
                         f"engine.options.dtype out (it follows model.dtype), or set model.dtype: {engine_dtype!r} for "
                         "both engine and trainer"]
