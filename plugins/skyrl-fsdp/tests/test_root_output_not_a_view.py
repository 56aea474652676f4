"""The root module's logits are not a view, so FSDP2 does not warn, and its gradients are the plain
module's, bit for bit.

FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip the pre-backward
all-gather). The view was the ``lm_head`` output of the oneDNN linear, reshaped from its 2-D GEMM
result. No code of ours modified it in place, so the warning was harmless: with the old reshape
patched back in, the gradients are still the plain module's bits. The fix returns a fresh tensor
(``skyrl_core.ops.shapes.reshape_fresh``) and the warning is gone.
"""

import warnings

import pytest
import torch

from skyrl_core.backends.rank_setup import use_memory_efficient_attention
from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.ops import onednn, prepare_model, site_scope
from skyrl_core.testing.backend_contract import TINY_QWEN3
from skyrl_fsdp.backend import FSDPBackend
from skyrl_fsdp.options import FSDPOptions

MODEL = ModelConfig(config=dict(TINY_QWEN3))
VIEW_WARNING = "returned a view tensor"


def _grads(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with site_scope("trainer_forward"):  # where the trainer's forward runs its installed ops
        logits = model(input_ids=ids, use_cache=False).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-logprobs.mean()).backward()
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name.replace("_fsdp_wrapped_module.", "")] = grad.detach().clone()
    return out


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k].view(torch.int32), b[k].view(torch.int32))]


@pytest.fixture(scope="module")
def plain_and_sharded():
    plain = load_causal_lm(MODEL, seed=0)
    use_memory_efficient_attention(plain)  # the attention FSDPRank runs
    prepare_model(plain, "trainer", defaults={"linear": onednn.ONEDNN_LINEAR})
    with FSDPBackend(MODEL, FSDPOptions(device="cpu", cpu_gemm="onednn"), trainer=TrainerConfig(), seed=0) as backend:
        yield plain, backend._local.model


def _sharded_grads(sharded, ids):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        grads = _grads(sharded, ids)
    return grads, [str(w.message) for w in seen if VIEW_WARNING in str(w.message)]


def test_fsdp_gradients_equal_the_plain_modules_and_no_view_is_returned(plain_and_sharded):
    plain, sharded = plain_and_sharded
    ids = torch.randint(0, 512, (3, 11), generator=torch.Generator().manual_seed(1))
    expected = _grads(plain, ids)
    grads, view_warnings = _sharded_grads(sharded, ids)
    assert not view_warnings
    assert _bitwise_equal(grads, expected) == []
    with site_scope("trainer_forward"):
        assert sharded(input_ids=ids, use_cache=False).logits._base is None
    # negative control: another batch gives other gradient bits
    other = ids.clone()
    other[0, 5] = (other[0, 5] + 1) % 512
    assert _bitwise_equal(_grads(plain, other), expected)


def test_the_old_view_output_was_harmless(plain_and_sharded, monkeypatch):
    """The reshape that made the view, patched back: FSDP2 warns, the gradients are unchanged."""
    plain, sharded = plain_and_sharded
    calls = []
    monkeypatch.setattr(onednn, "reshape_fresh", lambda t, shape: calls.append(shape) or t.reshape(shape))
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(2))
    grads, view_warnings = _sharded_grads(sharded, ids)
    assert view_warnings, "the patched reshape no longer returns a view: this test proves nothing"
    assert (2, 9, 512) in calls  # the lm_head ran on oneDNN
    assert _bitwise_equal(grads, _grads(plain, ids)) == []
