"""``skyrl isoexec ...``: contract inspection, end-to-end verification, digest traces.

Heavy imports happen inside the commands, so that ``skyrl --help`` stays fast.
"""

from __future__ import annotations

import functools
import json
import sys

import click

from skyrl_isoexec.presets import PRESETS


@click.group("isoexec")
def isoexec_group() -> None:
    """IsoExec: bitwise-identical logprobs between trainer and engine."""


@isoexec_group.group("contract")
def contract_group() -> None:
    """Execution contracts."""


@contract_group.command("show")
@click.argument("config_path", metavar="CONFIG")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def contract_show(config_path: str, overrides: tuple[str, ...]) -> None:
    """Print the trainer's and engine's IsoExec contracts for CONFIG (JSON) and their hashes."""
    from skyrl_core.cli.main import load_config_or_exit
    from skyrl_isoexec import state
    from skyrl_isoexec.contract import compare, declared_contract

    cfg = load_config_or_exit(config_path, list(overrides))
    with state.adopted(cfg.plugins.get("isoexec")):
        contracts = {role: declared_contract(cfg, role) for role in ("trainer", "engine")}
        enabled = state.enabled()
    click.echo(json.dumps(contracts, indent=2, sort_keys=True))
    for role, contract in contracts.items():
        click.echo(f"{role} hash: {contract['hash']}")
    problems = compare(contracts["trainer"], contracts["engine"])
    for problem in problems:
        click.echo(f"mismatch: {problem}")
    if not enabled:
        click.echo("isoexec is off for this config (isoexec.enabled: true or SKYRL_ISOEXEC=1 turns it on)")
    sys.exit(1 if problems else 0)


DTYPES = ("float32", "bfloat16")


class PresetCase(click.ParamType):
    """``NAME`` or ``NAME:DTYPE``: a preset, optionally with the one dtype it is verified in."""

    name = "NAME[:DTYPE]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        name, colon, dtype = str(value).partition(":")
        if name not in PRESETS:
            self.fail(f"{name!r} is not a preset; choose from {', '.join(sorted(PRESETS))}"
                      f" (optionally with :DTYPE, one of {', '.join(DTYPES)})", param, ctx)
        if colon and dtype not in DTYPES:
            self.fail(f"{value!r}: dtype {dtype!r} is not one of {', '.join(DTYPES)}", param, ctx)
        return name, dtype or None


@isoexec_group.command("verify")
@click.option("--preset", "presets", multiple=True, type=PresetCase(),
              help="A tiny random model of this family; repeatable (each preset and --dtype is one case). "
                   "NAME:DTYPE verifies this preset in that dtype only (--dtype is for the presets without one), "
                   "e.g. --preset qwen3:float32 --preset llama:bfloat16 is two cases.")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), help="A local Hugging Face model directory.")
@click.option("--engine", "engine_names", multiple=True, metavar="NAME[,NAME...]",
              help="Registered inference engine(s) to generate with (default: torch); several (comma-separated or "
                   "repeated, e.g. --engine torch,vllm) are each compared against one trainer, built once.")
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(DTYPES),
              help="The model's dtype (default: float32); repeatable; for every --preset given without :DTYPE.")
@click.option("--seed", type=int, default=0, show_default=True, help="Model, prompt and sampling seed.")
@click.option("--batches", type=click.IntRange(min=1), default=3, show_default=True, help="Generation batches.")
@click.option("--off", is_flag=True, help="Run with IsoExec off, to show the native mismatch.")
@click.option("--backend", type=click.Choice(["fsdp", "megatron"]), default="fsdp", show_default=True,
              help="Training backend that scores the tokens (megatron: skyrl-megatron's GPTModel on CPU/gloo).")
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Megatron only: tensor-parallel degree (2 or more runs Ray actors); the bits must not change with it.")
@click.option("--expert-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Megatron only, MoE models: experts split over this many data-parallel replicas (Ray actors).")
@click.option("--engine-option", "engine_option", multiple=True, metavar="[ENGINE:]KEY=VALUE",
              help="An option of the engine (as under engine.options in a config; YAML value), repeatable, "
                   "e.g. --engine-option multiprocess=false; with several engines, name the engine: "
                   "--engine-option vllm:multiprocess=false.")
def verify_command(presets, model_dir, engine_names, dtypes, seed, batches, off, backend, tensor_parallel,
                   expert_parallel, engine_option) -> None:
    """Generate with each engine, score the same tokens in the trainer, compare bits; exit 1 if any differ.

    The trainer is skyrl-fsdp (default) or, with --backend megatron, skyrl-megatron at
    --tensor-parallel / --expert-parallel 1 or more; with IsoExec on it gives each engine's bits
    (0 differing tokens), --off shows how many differ natively. Several engines are checked in turn
    against the one trainer, each with its own result lines. With several --preset or --dtype
    values, every preset in every dtype is one case (a --preset NAME:DTYPE only in its own dtype),
    verified in turn in this one process (one start-up for all); each case's lines are prefixed
    "PRESET DTYPE: ", then one total line. Every case is checked before any is built.
    Exit 2: a case cannot run (e.g. bfloat16 with megatron, which trains in fp32 on CPU).
    """
    if bool(presets) == (model_dir is not None):
        raise click.UsageError("give exactly one of --preset and --model (--preset may be repeated)")
    if tensor_parallel != 1 and backend != "megatron":
        raise click.UsageError("--tensor-parallel needs --backend megatron")
    if expert_parallel != 1 and backend != "megatron":
        raise click.UsageError("--expert-parallel needs --backend megatron")
    from skyrl_core.config.errors import ConfigError
    from skyrl_core.plugins.manager import PluginError
    from skyrl_isoexec.verify import echo_prefixed, plan_verify, run_verify, total_line

    engines = _engine_names(engine_names)
    engine_options = _engine_options(engine_option, engines)
    cases = _verify_cases(presets, model_dir, dtypes)
    label = None
    try:
        plans = {}
        for label, source, dtype in cases:
            plans[label] = plan_verify(
                engines=engines, dtype=dtype, backend=backend, tensor_parallel=tensor_parallel,
                expert_parallel=expert_parallel, engine_options=engine_options, **source,
            )
        failed = False
        all_reports = []
        for label, plan in plans.items():
            say = click.echo if len(plans) == 1 else functools.partial(echo_prefixed, click.echo, f"{label}: ")
            reports = run_verify(plan, seed=seed, batches=batches, off=off, echo=say)
            refused = [name for name, report in reports.items() if report.contract_problems and not off]
            for name in refused:
                say(f"contract mismatch with engine {name}: the handshake would refuse this pair")
            failed = failed or bool(refused) or any(report.differing for report in reports.values())
            all_reports.extend(reports.values())
    except (NotImplementedError, ValueError, KeyError, PluginError, ConfigError) as exc:  # a pair that cannot run
        click.echo(f"error: {label}: {exc}" if len(cases) > 1 else f"error: {exc}", err=True)
        sys.exit(2)
    if len(plans) > 1:
        click.echo(total_line(all_reports, f"cases {', '.join(plans)}"))
    sys.exit(1 if failed else 0)


def _verify_cases(presets: tuple[tuple[str, str | None], ...], model_dir: str | None,
                  dtypes: tuple[str, ...]) -> list[tuple[str, dict, str]]:
    """``(label, model source, dtype)`` for every preset (or the one model) in every dtype, in the
    order given; a preset given as ``(name, dtype)`` only in its own dtype. A repeated value or
    case is refused (it would run twice), and so is a --dtype that no case would use."""
    given = [name if dtype is None else f"{name}:{dtype}" for name, dtype in presets]
    for flag, values in (("--preset", given), ("--dtype", list(dtypes))):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise click.BadParameter(f"{', '.join(repeated)} given more than once", param_hint=flag)
    if dtypes and presets and all(dtype is not None for _, dtype in presets):
        raise click.BadParameter(
            f"{', '.join(dtypes)} is for the presets given without :DTYPE, and every preset names its own"
            f" ({', '.join(given)})", param_hint="--dtype")
    sources = [(name, {"preset": name}, (dtype,) if dtype else None) for name, dtype in presets] \
        or [(model_dir, {"model_dir": model_dir}, None)]
    cases = [(f"{name} {dtype}", source, dtype)
             for name, source, own in sources for dtype in own or dtypes or ("float32",)]
    labels = [label for label, _, _ in cases]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise click.BadParameter(f"the case {', '.join(repeated)} given more than once", param_hint="--preset")
    return cases


def _engine_names(given: tuple[str, ...]) -> tuple[str, ...]:
    """``--engine`` values, comma-separated or repeated, in order; refused if empty or repeated."""
    names = tuple(part.strip() for value in given for part in value.split(","))
    if not names:
        return ("torch",)
    if "" in names:
        raise click.BadParameter(f"an empty engine name in {list(given)}", param_hint="--engine")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise click.BadParameter(f"{', '.join(repeated)} given more than once", param_hint="--engine")
    return names


def _engine_options(items: tuple[str, ...], engines: tuple[str, ...]) -> dict[str, dict]:
    """``[ENGINE:]KEY=VALUE`` strings as each engine's options; without ``ENGINE:`` (one engine only)
    the option is the one engine's."""
    flag = "--engine-option"
    given: dict[str, list[str]] = {name: [] for name in engines}
    for item in items:
        name, colon, _ = item.partition("=")[0].partition(":")
        if not colon:
            if len(engines) > 1:
                raise click.BadParameter(
                    f"{item!r} names no engine; with several engines ({', '.join(engines)}) write ENGINE:KEY=VALUE",
                    param_hint=flag,
                )
            name, item = engines[0], f"{engines[0]}:{item}"
        name = name.strip()
        if name not in given:
            raise click.BadParameter(f"{item!r} is for engine {name!r}, not among --engine {', '.join(engines)}", param_hint=flag)
        given[name].append(item.partition(":")[2])
    return {name: _key_values(tuple(values), flag=flag) for name, values in given.items()}


def _key_values(items: tuple[str, ...], *, flag: str) -> dict:
    """``KEY=VALUE`` strings as a dict, read as ``skyrl train``'s overrides are
    (``skyrl_core.config.loader.apply_overrides``: YAML values, ``false`` -> False, ``64`` -> 64;
    a dotted key nests, ``engine_kwargs.max_num_batched_tokens=512``)."""
    from skyrl_core.config.errors import ConfigError
    from skyrl_core.config.loader import apply_overrides

    try:
        return apply_overrides({}, list(items))
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=flag) from None


@isoexec_group.command("trace")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), required=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tokens", type=click.IntRange(min=2), default=12, show_default=True, help="Sequence length.")
@click.option("--mode", type=click.Choice(["full", "decode"]), required=True,
              help="full: one forward over the sequence (trainer_score); decode: token by token with a KV cache (engine_decode).")
@click.option("--off", is_flag=True, help="Trace with IsoExec off.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, writable=True), required=True)
def trace_command(preset, dtype, seed, tokens, mode, off, out_path) -> None:
    """Record per-token digests of every op's output (order-invariant: keyed by position) to OUT."""
    from skyrl_isoexec.digest import trace

    data = trace(preset=preset, dtype=dtype, seed=seed, tokens=tokens, mode=mode, off=off)
    with open(out_path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    click.echo(f"{len(data['records'])} op calls traced to {out_path} (digest {data['digest'][:16]})")


@isoexec_group.command("compare")
@click.argument("first", type=click.Path(exists=True, dir_okay=False))
@click.argument("second", type=click.Path(exists=True, dir_okay=False))
def compare_command(first, second) -> None:
    """Name the first op (in model order) whose per-token digests differ between two traces."""
    from skyrl_isoexec.digest import first_divergence

    with open(first) as f:
        a = json.load(f)
    with open(second) as f:
        b = json.load(f)
    found = first_divergence(a, b)
    if found is None:
        click.echo("no divergence: every op's output is bitwise identical at every position")
        sys.exit(0)
    click.echo(found)
    sys.exit(1)
