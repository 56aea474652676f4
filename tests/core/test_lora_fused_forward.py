"""``skyrl_core.lora.fused_forward``: peft's LoRA forward and backward in fewer output-wide passes."""

import torch

from skyrl_core import lora
from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.testing.backend_contract import TINY_QWEN3


def _loss_and_grads(model, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = (logits.log_softmax(-1)[..., :7] * torch.linspace(-1, 1, 7)).sum()
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fused_forward_computes_peft_lora_within_fp32_rounding_and_restores_peft():
    model = load_causal_lm(ModelConfig(config=dict(TINY_QWEN3)))
    model.requires_grad_(False)
    # (the unembedding too: its adapter takes the in-place, rank-rows-first path, _low_rank_add)
    modules = lora.target_modules(model, ("attn", "mlp", "unembed"), unties_unembedding=True)
    lora.add_adapter(model, "a", rank=4, alpha=32.0, modules=modules, seed=0)
    lora.add_adapter(model, "b", rank=2, alpha=8.0, modules=lora.target_modules(model, ("attn",)), seed=1)
    with torch.no_grad():  # non-zero B (peft starts at 0), so that the adapter's path counts
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ids = torch.randint(0, 200, (3, 9), generator=torch.Generator().manual_seed(0))
    lora.select(model, "a")
    peft_logits, peft_grads = _loss_and_grads(model, "a", ids)
    layers = [layer for _, layer in lora.lora_layers(model)]
    with lora.fused_forward(model, "a"):
        assert all("forward" in layer.__dict__ for layer in layers)  # every layer of "a" runs fused
        fused_logits, fused_grads = _loss_and_grads(model, "a", ids)
    assert not any("forward" in layer.__dict__ for layer in layers)  # peft's own forward is back
    base = load_causal_lm(ModelConfig(config=dict(TINY_QWEN3)))(input_ids=ids).logits
    assert (peft_logits - base).abs().max() > 1e-2  # (the adapter changes the output: it is computed)
    torch.testing.assert_close(fused_logits, peft_logits, rtol=0, atol=1e-5)
    assert set(fused_grads) == set(peft_grads) and all(".lora_" in n and ".a." in n for n in fused_grads)
    assert {"lm_head.lora_A.a.weight", "lm_head.lora_B.a.weight"} <= set(fused_grads)
    for n in peft_grads:  # (summed in another order: within fp32 rounding of the tensor's scale)
        assert (fused_grads[n] - peft_grads[n]).abs().max() <= 1e-5 * peft_grads[n].abs().max(), n
