"""Optimizers over a Megatron model's tensor-parallel shards.

``ShardedAdamW`` (CPU): megatron-core's own optimizers allocate on CUDA, so on CPU a torch AdamW
steps this rank's shards. Gradients are summed across data-parallel replicas (expert parameters
across the replicas holding the same experts), and the gradient norm counts every tensor- and
expert-parallel shard once and every replicated parameter (norms) once.

``MegatronAdam`` (GPU): megatron-core's DDP wrapper (contiguous fp32 gradient buffers) and
``get_megatron_optimizer`` (fp32 main parameters under bf16, its own clipping and norm).

Both: ``step(lr) -> grad_norm`` (the norm before clipping; a non-finite norm skips the update),
``zero_grad()``, ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from skyrl_megatron.lora import PARTIAL_GRADIENT


def _decay_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    # Matrices decay; norms do not (as in skyrl-fsdp).
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


class ShardedAdamW:
    """Expert parameters (``...local_experts...``) are split across expert-parallel ranks: their
    gradients are summed over the expert-data-parallel group only, and their norm over the
    expert tensor-and-expert-parallel group.

    Some replicated weights see only part of the work on each tensor-parallel rank, so each rank
    holds part of their gradient, which is summed across the tensor-parallel group (as megatron's
    ``finalize_model_grads`` does): per-head q/k norms and GatedDeltaNet's output norm (each rank
    has its own heads), and under sequence parallelism every weight megatron marks
    ``sequence_parallel`` (norms, the MoE router, the shared expert's gate: each rank has its own
    share of the tokens), and a LoRA adapter's A on column-parallel linears (``skyrl_megatron.lora``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        weight_decay: float,
        grad_clip: float,
        tp_group,
        dp_group,
        expert_dp_group,
        expert_shard_group,
    ) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.expert_params = [p for n, p in named if ".local_experts." in n]
        self.dense_params = [p for n, p in named if ".local_experts." not in n]
        # Each listed once, even where both reasons apply (a q/k norm under sequence parallelism).
        self.tp_partial_params = [
            p
            for n, p in named
            if getattr(p, "sequence_parallel", False)
            or getattr(p, PARTIAL_GRADIENT, False)
            or n.endswith(("q_layernorm.weight", "k_layernorm.weight", "self_attention.out_norm.weight"))
        ]
        self.grad_clip, self.weight_decay = grad_clip, weight_decay
        self.tp_group, self.dp_group = tp_group, dp_group
        self.expert_dp_group, self.expert_shard_group = expert_dp_group, expert_shard_group
        self.reset()

    def reset(self) -> None:
        """A fresh AdamW (no moments, no step count) over the same parameters."""
        self.optimizer = torch.optim.AdamW(_decay_groups(self.params, self.weight_decay), lr=0.0)

    @staticmethod
    def _sum_grads(params: list[torch.nn.Parameter], group) -> None:
        if not params or dist.get_world_size(group) == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def grad_norm(self) -> float:
        """The L2 norm of the whole model's gradient (as if unsharded)."""
        zero = torch.zeros((), dtype=torch.float64)
        sharded, replicated, experts = zero.clone(), zero.clone(), zero.clone()
        expert_ids = {id(p) for p in self.expert_params}
        for p in self.params:
            if p.grad is None:
                continue
            sq = p.grad.double().pow(2).sum()
            if id(p) in expert_ids:
                experts += sq
            elif getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:  # identical on every tensor-parallel rank: count it once
                replicated += sq
        if dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        if self.expert_params and dist.get_world_size(self.expert_shard_group) > 1:
            dist.all_reduce(experts, group=self.expert_shard_group)
        return math.sqrt(float(sharded + replicated + experts))

    def step(self, lr: float, *, betas: tuple[float, float] | None = None, eps: float | None = None,
             weight_decay: float | None = None, grad_clip: float | None = None) -> float:
        """``betas``, ``eps`` and ``weight_decay`` (of the matrices; norms keep 0) given: set from
        this step on; ``grad_clip`` given: this step's clip instead of the construction's."""
        if betas is not None or eps is not None:
            for group in self.optimizer.param_groups:
                group["betas"] = betas if betas is not None else group["betas"]
                group["eps"] = eps if eps is not None else group["eps"]
        if weight_decay is not None:
            self.optimizer.param_groups[0]["weight_decay"] = weight_decay
        self._sum_grads(self.tp_partial_params, self.tp_group)
        self._sum_grads(self.dense_params, self.dp_group)
        self._sum_grads(self.expert_params, self.expert_dp_group)
        norm = self.grad_norm()
        if math.isfinite(norm):
            # torch.nn.utils.clip_grad_norm_'s rule, so the curve matches a single-process run.
            clip = self.grad_clip if grad_clip is None else grad_clip
            coef = min(1.0, clip / (norm + 1e-6))
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.zero_grad()
        return norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class MegatronAdam:  # pragma: no cover - needs CUDA; exercised by scripts/gpu_megatron_check.sh
    def __init__(self, ddp_model: Any, *, lr: float, weight_decay: float, grad_clip: float, bf16: bool) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.ddp_model = ddp_model
        config = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_eps=1e-8,
            clip_grad=grad_clip,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=False,
        )
        self.optimizer = get_megatron_optimizer(config, [ddp_model])

    def step(self, lr: float) -> float:
        from megatron.core.distributed import finalize_model_grads

        # Replica all-reduce, plus the tensor-parallel sum of q/k norm gradients.
        finalize_model_grads([self.ddp_model])
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        _, grad_norm, _ = self.optimizer.step()
        self.zero_grad()
        return float(grad_norm) if grad_norm is not None else float("nan")

    def zero_grad(self) -> None:
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def wrap_for_gpu_training(model: torch.nn.Module) -> Any:  # pragma: no cover - needs CUDA
    """megatron-core's DDP wrapper: gradients land in contiguous fp32 ``main_grad`` buffers that
    ``get_megatron_optimizer`` reads; with data parallelism it also sums them across replicas."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False, average_in_collective=False
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
