"""``BackendLoraTrainer``: Tinker training runs on a ``TrainingBackend`` (``--backend fsdp|megatron``).

Each training run (adapter) is one backend built by registered name with
``options.lora = {rank, alpha, targets}`` and trained only through the core's boundary:
``forward``, ``forward_backward(batch, loss_fn)``, ``optim_step(OptimizerHyperparams)``,
``save_checkpoint`` / ``load_checkpoint`` and ``export_adapter``. The base model loaded by
``LoraTrainer`` stays in this process for what is not training: request checks, the sampler's base
weights and prompt logprobs (computed with the exported adapter merged, like ``forward`` in the
in-process mode).

Tinker's datum (``model_input`` ``x``, per-position ``target_tokens`` ``y``, ``y[i]`` scored after
``x[..i]``) becomes a ``TrainingBatch`` row with a one-token prompt ``x[0]`` and the response
``y``: the backend scores ``y[i]`` after ``x[0], y[0..i-1]``, which is Tinker's when every target is
the next input token (``y[i] == x[i + 1]``), so that is required (checked before work is queued).
The loss inputs ride in the batch's per-token fields (``weights`` -> ``token_weights``, the
sampler's ``logprobs`` -> ``rollout_logprobs``, ``advantages``) and each row carries its datum's
index in ``group_ids``, so the loss closure, which the backend calls per micro-batch (rows packed
in its own order), computes Tinker's loss and records each datum's logprobs. Each backend holds its
own copy of the base model (memory grows with the number of runs), and the IsoExec bit-equality of
sampler and trainer is not claimed here (the backend trains through unmerged adapters).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.types import OptimizerHyperparams, TrainingBatch
from skyrl_tinker.losses import compute_loss
from skyrl_tinker.trainer import (ADAPTER_FILE, META_FILE, MICRO_BATCH_BYTES, AdamStep, Adapter, Example,
                                  LoraTrainer, read_meta)

BACKEND_DIR = "backend"  # the backend's own checkpoint inside a Tinker training checkpoint
# Tinker loss input -> the TrainingBatch field that carries it through the backend's micro-batches.
INPUT_FIELDS = {"weights": "token_weights", "logprobs": "rollout_logprobs", "advantages": "advantages"}
BACKENDS = ("fsdp", "megatron")


def takes_cpu_gemm(name: str) -> bool:
    """Whether backend ``name`` has a ``cpu_gemm`` option (fsdp does; megatron computes with its own
    layers' products, so ``--cpu-gemm`` other than auto is refused for it: ``cli.check_backend``)."""
    import attrs

    from skyrl_core.plugins.manager import get_plugin_manager

    options = get_plugin_manager().spec("training_backend", name).load_options_class()
    return options is not None and "cpu_gemm" in attrs.fields_dict(options)


def build_backend(name: str, model_dir: str, *, rank: int, alpha: float, groups: tuple[str, ...], seed: int,
                  micro_batch_tokens: int, cpu_gemm: str, dtype: str = "float32") -> Any:
    from skyrl_core.config.loader import structure_options
    from skyrl_core.plugins.manager import get_plugin_manager

    spec = get_plugin_manager().spec("training_backend", name)
    given: dict[str, Any] = {"lora": {"rank": rank, "alpha": alpha, "targets": list(groups)}}
    if takes_cpu_gemm(name):
        given["cpu_gemm"] = cpu_gemm
    options = structure_options(spec, given, path=f"backend:{name}")
    # Tinker's AdamParams come with every optim_step; the config's lr/clip are not used. Passes are
    # sized like the in-process trainer's (MICRO_BATCH_BYTES).
    trainer = TrainerConfig(micro_batch_size=1024, micro_batch_tokens=micro_batch_tokens)
    # (the backend follows model.dtype: bfloat16 computes in bf16 over fp32 master weights)
    return spec.load_factory()(ModelConfig(path=model_dir, dtype=dtype), options, seed=seed, trainer=trainer)


class BackendLoraTrainer(LoraTrainer):
    next_token_targets_only = True
    # The backend keeps every activation of a pass (it checkpoints only when built so, for every
    # pass): a datum longer than a plain pass holds is refused at submission (SmolLM2 on 24 GiB: 1683).
    checkpoints_long_passes = False
    # The backends' merged exports keep a tied unembedding tied (skyrl_core.lora.target_modules).
    unties_unembedding = False

    def __init__(self, model_dir: str, backend: str, *, cpu_gemm: str = "auto", dtype: str = "float32") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: Tinker training runs on {', '.join(BACKENDS)}")
        super().__init__(model_dir, cpu_gemm=cpu_gemm, dtype=dtype)
        self.cpu_gemm = cpu_gemm
        self.model_dir = model_dir
        self.backend_name = backend
        self.backends: dict[str, Any] = {}
        self.merged_training = False

    # --- adapters ---------------------------------------------------------------------------------

    def create(self, name: str, *, rank: int, alpha: float, groups: tuple[str, ...], seed: int) -> None:
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} exists")
        self.check_groups(groups)
        self.backends[name] = build_backend(self.backend_name, self.model_dir, rank=rank, alpha=alpha, groups=groups, seed=seed,
                                            micro_batch_tokens=max(1, MICRO_BATCH_BYTES // self.bytes_per_token),
                                            cpu_gemm=self.cpu_gemm, dtype=self.dtype)
        self.adapters[name] = Adapter(name, rank, alpha, groups, seed, optimizer=None)

    def adapter_bytes(self, rank: int, groups: tuple[str, ...]) -> int:
        """The adapter and its backend's own copy of the base model (fp32 weights as loaded and as
        shards, about 2.6 copies, measured for ``skyrl_core.trainer.memory_estimate``)."""
        parameters = sum(p.numel() for p in self.model.parameters())
        return super().adapter_bytes(rank, groups) + int(2.6 * 4 * parameters)

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)
        backend = self.backends.pop(name, None)
        if backend is not None:
            backend.close()

    def close(self) -> None:
        for name in list(self.backends):
            self.remove(name)

    def base_weights(self) -> dict[str, torch.Tensor]:
        """``<module>.weight`` -> base weight of every linear layer (any of them may carry an adapter)."""
        return {f"{m}.weight": module.weight for m, module in self.model.named_modules() if isinstance(module, torch.nn.Linear)}

    # --- computation ------------------------------------------------------------------------------

    def _batch(self, examples: Sequence[Example]) -> TrainingBatch:
        R = max(len(e.tokens) for e in examples)
        B = len(examples)
        input_ids = torch.zeros(B, 1 + R, dtype=torch.long)
        attention = torch.zeros(B, 1 + R, dtype=torch.long)
        mask = torch.zeros(B, R, dtype=torch.float32)
        fields = {INPUT_FIELDS[n]: torch.zeros(B, R) for n in set().union(*(e.inputs for e in examples)) if n in INPUT_FIELDS}
        for i, e in enumerate(examples):
            n = len(e.tokens)
            input_ids[i, 0] = int(e.tokens[0])
            input_ids[i, 1 : 1 + n] = torch.from_numpy(e.inputs["target_tokens"])
            attention[i, : 1 + n] = 1
            mask[i, :n] = 1.0
            for key, value in e.inputs.items():
                if key in INPUT_FIELDS:
                    fields[INPUT_FIELDS[key]][i, :n] = torch.from_numpy(value)
        return TrainingBatch(input_ids=input_ids, attention_mask=attention, loss_mask=mask, group_ids=range(B), **fields)

    @staticmethod
    def _inputs(batch: TrainingBatch) -> dict[str, torch.Tensor]:
        return {name: getattr(batch, field) for name, field in INPUT_FIELDS.items() if getattr(batch, field) is not None}

    def forward(self, name: str, examples: Sequence[Example], loss_fn: str, loss_config: dict[str, Any] | None) -> tuple[list[np.ndarray], dict[str, float]]:
        self._adapter(name)
        batch = self._batch(examples)
        logprobs = self.backends[name].forward(batch)
        loss, metrics = compute_loss(loss_fn, loss_config, logprobs, self._inputs(batch), batch.loss_mask)
        outputs = [logprobs[i, : len(e.tokens)].float().numpy().copy() for i, e in enumerate(examples)]
        return outputs, {**{f"{k}:mean": float(v) for k, v in metrics.items()}, "loss:sum": float(loss)}

    def forward_backward(self, name: str, examples: Sequence[Example], loss_fn: str, loss_config: dict[str, Any] | None) -> tuple[list[np.ndarray], dict[str, float]]:
        self._adapter(name)
        batch = self._batch(examples)
        scored: dict[int, torch.Tensor] = {}

        def tinker_loss(logprobs: torch.Tensor, micro: TrainingBatch) -> tuple[torch.Tensor, dict[str, Any]]:
            for row, datum in enumerate(micro.group_ids):
                scored[int(datum)] = logprobs[row].detach()
            return compute_loss(loss_fn, loss_config, logprobs, self._inputs(micro), micro.loss_mask)

        metrics = self.backends[name].forward_backward(batch, tinker_loss)
        outputs = [scored[i][: len(e.tokens)].float().numpy().copy() for i, e in enumerate(examples)]
        out = {f"{k}:mean": float(v) for k, v in metrics.items() if k != "loss"}
        out["loss:sum"] = float(metrics["loss"])
        return outputs, out

    def optim_step(self, name: str, step: AdamStep) -> dict[str, float]:
        adapter = self._adapter(name)
        hyperparams = OptimizerHyperparams(lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps,
                                           weight_decay=step.weight_decay, grad_clip=step.grad_clip_norm)
        result = self.backends[name].optim_step(hyperparams)
        adapter.steps += 1
        return {"grad_norm:mean": float(result["grad_norm"]), "learning_rate:mean": step.learning_rate}

    # --- state ------------------------------------------------------------------------------------

    def adapter_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The backend's adapter in this plugin's format (``skyrl_core.lora.adapter_tensors``'s names)."""
        adapter = self._adapter(name)
        out: dict[str, torch.Tensor] = {}
        for key, value in self.backends[name].export_adapter().items():
            module, part = key.rsplit(".lora_", 1)
            out[f"{module}.lora_{part.split('.', 1)[0]}"] = value.float().contiguous()
            out[f"{module}.lora_scale"] = torch.tensor(adapter.alpha / adapter.rank, dtype=torch.float32)
        return out

    def save(self, name: str, directory: str, *, optimizer: bool) -> dict[str, Any]:
        """What ``LoraTrainer.save`` writes (adapter tensors, description; it returns the tensors),
        and with ``optimizer`` the backend's own checkpoint (adapter, AdamW state, step) beside them."""
        import json

        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        tensors = self.adapter_tensors(name)
        save_file(tensors, os.path.join(directory, ADAPTER_FILE))
        if optimizer:
            self.backends[name].save_checkpoint(os.path.join(directory, BACKEND_DIR))
        with open(os.path.join(directory, META_FILE), "w") as f:
            json.dump(self.meta(name), f)
        return tensors

    def load(self, name: str, directory: str, *, optimizer: bool) -> None:
        adapter = self._adapter(name)
        backend_dir = os.path.join(directory, BACKEND_DIR)
        if not os.path.isdir(backend_dir):
            raise ValueError(f"{directory} was not saved by a --backend {self.backend_name} server (no {BACKEND_DIR}/); "
                             "its adapter cannot be loaded into this backend")
        self.backends[name].load_checkpoint(backend_dir, optimizer=optimizer)
        adapter.steps = int(read_meta(directory).get("steps", 0)) if optimizer else 0

