"""On-policy distillation: the advantage is teacher minus student logprob (plus the mixed reward),
the teacher takes the reference's place in a run, a student distilled from an SFT'd teacher moves
toward it on held-out prompts, and a teacher that cannot teach is refused first."""

from __future__ import annotations

import os

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


def _held_out_reverse_kl(student, teacher, prompts: list[list[int]]) -> float:
    """Exact ``KL(student || teacher)`` over the whole vocabulary, averaged over the positions of
    4-token replies the student samples (fixed seed) to ``prompts``: its divergence from the
    teacher where it actually goes, on prompts it never trained on."""
    total, positions = 0.0, 0
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for ids in prompts:
            sequence = list(ids)
            for _ in range(4):
                probs = torch.softmax(student(torch.tensor([sequence])).logits[0, -1].double(), -1)
                sequence.append(int(torch.multinomial(probs, 1, generator=generator)))
            window = slice(len(ids) - 1, len(sequence) - 1)
            mine = torch.log_softmax(student(torch.tensor([sequence])).logits[0, window].double(), -1)
            theirs = torch.log_softmax(teacher(torch.tensor([sequence])).logits[0, window].double(), -1)
            total += float((mine.exp() * (mine - theirs)).sum())
            positions += mine.shape[0]
    return total / positions


def test_a_student_distilled_from_an_sft_teacher_moves_toward_it_on_held_out_prompts(tmp_path, fresh_plugin_manager):
    from transformers import AutoModelForCausalLM

    from skyrl_core.byte_tokenizer import ByteTokenizer
    from skyrl_core.data import write_jsonl
    from skyrl_core.trainer.checkpoint import BACKEND_DIR
    from skyrl_envs.arithmetic import problem_row
    from tests.e2e.tiny_run import one_torch_thread, sft_tiny_arithmetic, tiny_arithmetic_rows

    # teacher and student: the same initial weights after 10 and 4 SFT steps on arithmetic answers
    # (a student that still samples nearly uniformly over 512 tokens would rarely draw the ones
    # the teacher likes: on-policy distillation needs a student that goes somewhere near)
    (tmp_path / "teacher").mkdir()
    (tmp_path / "student").mkdir()
    with one_torch_thread():
        teacher_dir = sft_tiny_arithmetic(tmp_path / "teacher", steps=10)
        student_dir = sft_tiny_arithmetic(tmp_path / "student", steps=4)
    write_jsonl(tiny_arithmetic_rows(), tmp_path / "arithmetic.jsonl")
    config = write_tiny_config(tmp_path, steps=6, mini_batches=1, checkpoint_every=0)
    cfg = load_config(str(config), [f"model.path={student_dir}", "model.config=null", "environment=arithmetic",
                                    f"data.train={tmp_path / 'arithmetic.jsonl'}", "data.eval=null",
                                    f"algorithm.distillation.teacher={teacher_dir}", "algorithm.distillation.reward_coef=0"],
                      plugin_manager=fresh_plugin_manager)
    with one_torch_thread():
        result = train(cfg, plugin_manager=fresh_plugin_manager)

    tokenizer = ByteTokenizer()
    held_out = [problem_row(a, b, "+")["prompt"] for a, b in ((2, 3), (4, 1), (3, 3), (5, 2))]  # never trained on
    prompts = [tokenizer.apply_chat_template(p, add_generation_prompt=True) for p in held_out]
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    before = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    after = AutoModelForCausalLM.from_pretrained(os.path.join(result.run_dir, "checkpoints", "step_000006", BACKEND_DIR),
                                                 dtype=torch.float32).eval()
    kl_before, kl_after = _held_out_reverse_kl(before, teacher, prompts), _held_out_reverse_kl(after, teacher, prompts)
    # measured: 2.98 -> 0.19 nats a token (on-policy: 3.04 -> 0.41)
    assert kl_before > 1.0 and kl_after < 0.3 * kl_before, (kl_before, kl_after)
    # the run's own on-policy estimate falls as well
    kl = [r["distill/reverse_kl"] for r in result.history]
    assert kl[-1] < 0.3 * kl[0], kl
