"""``skyrl tinker serve``: start the Tinker API server. Heavy imports happen inside the command."""

from __future__ import annotations

import os

import click

ENGINES = ("torch", "vllm")


def read_api_keys(path: str) -> set[str]:
    """One key per line (blank lines and ``#`` comments skipped). The SDK only sends keys that
    start with ``tml-``, so any other line is refused here rather than never matching."""
    keys = set()
    with open(path) as f:
        for number, line in enumerate(f, 1):
            key = line.split("#", 1)[0].strip()
            if not key:
                continue
            if not key.startswith("tml-"):
                raise click.BadParameter(f"{path}:{number}: API keys must start with 'tml-' (the tinker SDK refuses others)", param_hint="--api-keys")
            keys.add(key)
    if not keys:
        raise click.BadParameter(f"{path} holds no API key", param_hint="--api-keys")
    return keys


def parse_engine_options(engine: str, pairs: tuple[str, ...]) -> dict:
    """``KEY=VALUE`` pairs as the engine's options, checked by its options class before anything loads."""
    import yaml

    from skyrl_tinker.sampler import engine_options

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r}: expected KEY=VALUE", param_hint="--engine-option")
        options[key.strip()] = yaml.safe_load(value)
    try:
        engine_options(engine, options)
    except Exception as error:  # noqa: BLE001 - the options class names the key and what it allows
        raise click.BadParameter(str(error), param_hint="--engine-option") from None
    return options


def check_backend(name: str, cpu_gemm: str = "auto") -> None:
    """Refuse, before anything loads, a backend Tinker runs cannot train on, and a ``--cpu-gemm``
    choice it would not follow."""
    from skyrl_tinker.backend_trainer import BACKENDS, takes_cpu_gemm

    if name not in BACKENDS:
        raise click.BadParameter(f"{name!r}: allowed: {', '.join(BACKENDS)} (or omit --backend)", param_hint="--backend")
    from skyrl_core.plugins.manager import get_plugin_manager

    try:
        get_plugin_manager().spec("training_backend", name)
    except Exception as error:  # noqa: BLE001 - the plugin is missing or broken: say which
        raise click.BadParameter(f"{name!r}: {error}", param_hint="--backend") from None
    if cpu_gemm != "auto" and not takes_cpu_gemm(name):
        raise click.BadParameter(f"{cpu_gemm!r}: the {name} backend computes with its own layers' products and has no "
                                 "cpu_gemm option; leave --cpu-gemm at auto", param_hint="--cpu-gemm")


@click.group("tinker")
def tinker_group() -> None:
    """The Tinker API: train LoRA adapters and sample from them with the official tinker SDK."""


@tinker_group.command("serve")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False), help="local Hugging Face model directory (the base model)")
@click.option("--model-name", default=None, help="the base_model name clients use (default: the directory's name)")
@click.option("--tokenizer-id", default=None, help="what the SDK's TrainingClient.get_tokenizer() loads with AutoTokenizer.from_pretrained: a hub id or a path on the client's machine (default: the model directory, when it holds a tokenizer)")
@click.option("--engine", type=click.Choice(ENGINES), default="torch", show_default=True, help="inference engine for sampling")
@click.option("--engine-option", "engine_option", multiple=True, metavar="KEY=VALUE", help="an option of the engine (repeatable; VALUE read as YAML), e.g. kv_cache_memory_bytes=67108864")
@click.option("--backend", default=None, metavar="NAME", help="train each run on this TrainingBackend (fsdp or megatron) instead of in this process (see docs/tinker.md)")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--db", "db_url", default=None, help="SQLAlchemy URL of the state database (default: sqlite:///CHECKPOINTS/tinker.db)")
@click.option("--checkpoints", "checkpoint_dir", default="tinker-checkpoints", show_default=True, type=click.Path(file_okay=False), help="directory for saved weights")
@click.option("--api-keys", "api_keys_file", default=None, type=click.Path(exists=True, dir_okay=False), help="file of accepted API keys, one a line; without it any key is accepted")
@click.option("--lora-alpha", type=click.FloatRange(min=0, min_open=True), default=32.0, show_default=True, help="LoRA alpha (scale alpha / rank)")
@click.option("--dtype", type=click.Choice(("float32", "bfloat16")), default="float32", show_default=True, help="the base model's dtype in the trainer and the sampler: bfloat16 computes in bf16 (half the memory; bf16 products where the CPU has them), the adapters and their optimizer state stay fp32, logprobs and losses are fp32")
@click.option("--cpu-gemm", default="auto", show_default=True, help="the trainer's fp32 matrix products on CPU: auto (the faster of the two on this machine, measured once), onednn (oneDNN) or torch (F.linear, PyTorch's BLAS); see benchmarks/cpu_gemm.py; IsoExec overrides all three")
@click.option("--heap-mmap-mib", type=click.IntRange(min=0), default=0, show_default=True, help="tensors of at least this many MiB get their own memory map, returned when freed (0: every freed tensor stays in the heap for reuse, which fragments it and keeps the resident size at its high-water mark)")
@click.option("--max-request-bytes", type=click.IntRange(min=1024), default=64 * 1024 * 1024, show_default=True, help="larger request bodies get 413")
def serve(
    model_dir: str, model_name: str | None, tokenizer_id: str | None, engine: str, engine_option: tuple[str, ...], backend: str | None, host: str, port: int, db_url: str | None,
    checkpoint_dir: str, api_keys_file: str | None, lora_alpha: float, dtype: str, cpu_gemm: str, heap_mmap_mib: int, max_request_bytes: int,
) -> None:
    """Serve the Tinker API for one base model on HOST:PORT."""
    from skyrl_core.ops.gemm_choice import CPU_GEMMS

    if cpu_gemm not in CPU_GEMMS:
        raise click.BadParameter(f"{cpu_gemm!r}: allowed: {', '.join(CPU_GEMMS)}", param_hint="--cpu-gemm")
    if backend is not None:
        check_backend(backend, cpu_gemm)
    engine_options = parse_engine_options(engine, engine_option)
    api_keys = read_api_keys(api_keys_file) if api_keys_file else None
    os.makedirs(checkpoint_dir, exist_ok=True)
    if db_url is None:
        db_url = f"sqlite:///{os.path.abspath(os.path.join(checkpoint_dir, 'tinker.db'))}"
    if not db_url.startswith("sqlite:"):
        raise click.BadParameter(f"{db_url!r}: only sqlite:/// URLs are supported", param_hint="--db")

    import faulthandler
    import signal

    import uvicorn

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack to stderr
    if heap_mmap_mib:  # before anything allocates (skyrl_core.heap, trainer.heap_mmap_threshold_mib)
        from skyrl_core.heap import set_mmap_threshold

        set_mmap_threshold(heap_mmap_mib)

    from skyrl_tinker.app import create_app
    from skyrl_tinker.service import TinkerService

    service = TinkerService(model_dir, db_url=db_url, checkpoint_dir=checkpoint_dir, engine=engine,
                            engine_options=engine_options, backend=backend,
                            base_model=model_name, lora_alpha=lora_alpha, cpu_gemm=cpu_gemm, dtype=dtype,
                            tokenizer_id=tokenizer_id)
    app = create_app(service, api_keys=api_keys, max_body_bytes=max_request_bytes)
    click.echo(f"skyrl tinker: serving {service.base_model!r} on http://{host}:{port}", err=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        service.close()
