"""On-policy distillation: the advantage is teacher minus student logprob (plus the mixed reward),
the teacher takes the reference's place in a run, and a teacher that cannot teach is refused first."""

from __future__ import annotations

import pytest
import torch

from skyrl_core.algorithms.distillation import distillation_advantages
from skyrl_core.config.errors import ConfigError
from skyrl_core.config.loader import load_config
from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.trainer.rl import train
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TINY_QWEN3, TestEnvironments


def test_advantage_is_teacher_minus_student_plus_mixed_reward():
    teacher = torch.tensor([[-1.0, -2.0, 0.0]])
    student = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    reward_adv = torch.tensor([[0.5, 0.5, 0.5]])
    adv, metrics = distillation_advantages(reward_adv, teacher, student, mask, coef=2.0, reward_coef=0.1)
    assert torch.allclose(adv, torch.tensor([[2 * 0.5 + 0.05, 2 * -1.0 + 0.05, 0.0]]))
    assert metrics["distill/reverse_kl"] == pytest.approx((-0.5 + 1.0) / 2)


def _teacher(directory, vocab: int = 512):
    # another initialisation, 8x sharper: about 1.5 nats a token from the near-uniform student
    teacher = load_causal_lm(ModelConfig(config={**TINY_QWEN3, "vocab_size": vocab}), seed=1)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(8.0)
    teacher.save_pretrained(directory)
    return teacher


def test_the_teacher_replaces_the_reference_in_a_training_run(tmp_path, fresh_plugin_manager):
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    _teacher(tmp_path / "teacher")
    config = write_tiny_config(tmp_path, steps=2, mini_batches=1)
    cfg = load_config(str(config), [f"algorithm.distillation.teacher={tmp_path / 'teacher'}", "data.eval=null",
                                    "algorithm.distillation.reward_coef=0"], plugin_manager=fresh_plugin_manager)
    history = train(cfg, plugin_manager=fresh_plugin_manager).history
    # the sharp teacher is about 1.5 nats a token from the student; a reference that were the
    # student's own initial weights would give 0 at step 1
    assert [r["step"] for r in history] == [1, 2]
    assert 1.0 < history[0]["distill/reverse_kl"] < 3.0, history[0]
    assert all(abs(r["loss"]) < 100 and r["grad_norm"] > 0 for r in history)


def test_a_teacher_with_another_vocabulary_is_refused_before_training(tmp_path, fresh_plugin_manager):
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    _teacher(tmp_path / "teacher", vocab=640)
    config = write_tiny_config(tmp_path)
    for teacher, message in ((tmp_path / "teacher", "vocabulary of 640 tokens, the student 512"),
                             (tmp_path / "nowhere", "is not a Hugging Face model directory")):
        cfg = load_config(str(config), [f"algorithm.distillation.teacher={teacher}"], plugin_manager=fresh_plugin_manager)
        with pytest.raises(ConfigError, match=message):
            train(cfg, plugin_manager=fresh_plugin_manager)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
