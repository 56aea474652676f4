"""skyrl-isoexec's hook implementations. Light: importing this module imports no torch."""

from __future__ import annotations

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import ConfigSectionSpec


@hookimpl
def skyrl_register_ops(register):
    from skyrl_isoexec.specs import CANONICAL

    for spec in CANONICAL.values():
        register(spec)


@hookimpl
def skyrl_register_config_sections(register):
    register(
        ConfigSectionSpec(
            name="isoexec",
            factory="skyrl_isoexec.state:configure",
            options="skyrl_isoexec.config:IsoExecConfig",
            description="IsoExec: bitwise-identical logprobs between trainer and engine",
        )
    )


@hookimpl(wrapper=True)
def skyrl_install_op(op, site, impl):
    """When IsoExec is on, every op at every site gets its canonical implementation."""
    default = yield
    from skyrl_isoexec import state
    from skyrl_isoexec.specs import CANONICAL

    if state.enabled() and op in CANONICAL:
        return CANONICAL[op]
    return default


@hookimpl
def skyrl_execution_contract(role, ledger):
    from skyrl_isoexec import state
    from skyrl_isoexec.contract import build_contract

    return build_contract(role, ledger, enabled=state.enabled())


@hookimpl
def skyrl_verify_handshake(trainer_contract, engine_contract):
    """Mismatches between the contracts; with IsoExec on at both sides and none found, the engine's
    logprobs are the trainer's bits (and the old-logprob pass may be skipped, as configured)."""
    from skyrl_core.types import HandshakeVerdict
    from skyrl_isoexec import state
    from skyrl_isoexec.contract import both_enabled, compare

    problems = compare(trainer_contract, engine_contract)
    identical = not problems and both_enabled(trainer_contract, engine_contract)
    return HandshakeVerdict(mismatches=problems, identical_logprobs=identical,
                            reuse_rollout_logprobs=identical and state.current().skip_old_logprob_pass)


@hookimpl
def skyrl_on_run_start(config, run_dir):
    """Adopt the run's ``isoexec:`` section (exported to processes started afterwards)."""
    from skyrl_isoexec import state

    state.adopt((getattr(config, "plugins", None) or {}).get("isoexec"), run_dir)


@hookimpl
def skyrl_on_run_exit(run_dir):
    """The run is over: IsoExec's switch and ``SKYRL_ISOEXEC`` go back to what they were before it."""
    from skyrl_isoexec import state

    state.release(run_dir)


@hookimpl
def skyrl_add_cli_commands(cli):
    from skyrl_isoexec.cli import isoexec_group

    cli.add_command(isoexec_group)


@hookimpl
def skyrl_worker_init(role, engine):
    """Inside a vLLM engine process: install the canonical ops there (inert while IsoExec is off).
    IsoExec has no implementation inside other engines' processes."""
    if role != "engine" or engine != "vllm":
        return
    from skyrl_isoexec.vllm import worker_init

    worker_init(role)


@hookimpl
def skyrl_engine_model_loading(engine, engine_config):
    """Inside vLLM with IsoExec on: refuse a configuration the canonical ops cannot run under."""
    if engine == "vllm":
        from skyrl_isoexec.vllm.install import model_loading

        model_loading(engine_config)


@hookimpl
def skyrl_engine_model_loaded(engine, model):
    """Inside vLLM with IsoExec on: refuse a model with a layer off the canonical ops; complete its ledger."""
    if engine == "vllm":
        from skyrl_isoexec.vllm.install import model_loaded

        model_loaded(model)
