"""``skyrl config import-upstream``: an upstream SkyRL (skyrl-train) YAML translated into this
project's config, every key without an equivalent named, the result validated by our loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from skyrl_core.config.loader import load_config, load_yaml
from skyrl_core.config.upstream import UpstreamConfigError, flatten, translate_upstream
from tests.conftest import run_skyrl

FIXTURE = Path(__file__).parent / "upstream" / "skyrl_train_dapo.yaml"
ENV = {"SKYRL_TEST_DATA_DIR": "/data"}

# the fixture's keys that are carried over (everything else must be named in a note)
CARRIED = {
    "data.train_data", "data.val_data", "trainer.strategy", "trainer.policy.model.path", "trainer.ref.model.path",
    "trainer.policy.optimizer_config.lr", "trainer.policy.optimizer_config.weight_decay",
    "trainer.policy.optimizer_config.max_grad_norm", "trainer.policy.optimizer_config.num_warmup_steps",
    "trainer.policy.optimizer_config.scheduler", "trainer.seed", "trainer.ckpt_interval", "trainer.eval_interval",
    "trainer.update_epochs_per_batch", "trainer.train_batch_size", "trainer.policy_mini_batch_size",
    "trainer.micro_train_batch_size_per_gpu", "trainer.max_prompt_length", "generator.model_name",
    "generator.backend", "generator.n_samples_per_prompt", "generator.max_turns",
    "generator.sampling_params.max_generate_length", "generator.sampling_params.temperature",
    "generator.sampling_params.top_p", "generator.sampling_params.top_k", "generator.sampling_params.stop",
    "generator.sampling_params.repetition_penalty", "generator.sampling_params.min_p",
    "generator.sampling_params.logprobs", "generator.eval_sampling_params.max_generate_length",
    "generator.eval_sampling_params.temperature", "generator.eval_n_samples_per_prompt", "environment.env_class",
    "trainer.algorithm.advantage_estimator", "trainer.algorithm.grpo_norm_by_std",
    "trainer.algorithm.advantage_batch_normalize", "trainer.algorithm.policy_loss_type",
    "trainer.algorithm.loss_reduction", "trainer.algorithm.eps_clip_low", "trainer.algorithm.eps_clip_high",
    "trainer.algorithm.use_kl_loss", "trainer.algorithm.use_kl_in_reward", "trainer.algorithm.use_entropy_loss",
    "trainer.algorithm.zero_variance_filter", "trainer.algorithm.value_clip",
    "trainer.algorithm.dynamic_sampling.type", "trainer.algorithm.dynamic_sampling.max_sample_batches",
    *(f"trainer.algorithm.off_policy_correction.{k}" for k in (
        "tis_ratio_type", "token_tis_ratio_clip_high", "sequence_tis_ratio_clip_high", "sequence_mask_metric",
        "geo_mask_high", "geo_mask_low", "outlier_token_is_threshold_low", "outlier_token_is_threshold_high",
        "token_mask_is_threshold_low", "token_mask_is_threshold_high")),
}


def translate(data):
    config, notes = translate_upstream(data)
    return config, {n.key: n for n in notes}


def test_fixture_translates_key_by_key(monkeypatch):
    monkeypatch.setenv("SKYRL_TEST_DATA_DIR", "/data")
    config, notes = translate(load_yaml(str(FIXTURE)))
    assert config["model"] == {"path": "Qwen/Qwen2.5-1.5B-Instruct"}
    assert config["data"] == {"train": "/data/gsm8k/train.parquet", "eval": "/data/gsm8k/validation.parquet",
                              "prompts_per_step": 512}
    trainer = config["trainer"]
    assert (trainer["lr"], trainer["weight_decay"], trainer["grad_clip"], trainer["warmup_steps"]) == (1e-6, 0.01, 1.0, 5)
    assert (trainer["mini_batches"], trainer["micro_batch_size"], trainer["seed"]) == (4, 4, 42)  # 512 / 128
    assert (trainer["lr_schedule"], trainer["eval_every"], trainer["checkpoint_every"]) == ("constant", 5, 10)
    assert config["generation"] == {"n_samples": 16, "max_new_tokens": 1024, "temperature": 1.0, "top_p": 1.0,
                                    "eval_temperature": 0.0, "eval_n_samples": 1, "top_k": 0}
    assert (config["backend"], config["engine"], config["environment"]) == ("fsdp", "vllm", "gsm8k")
    algorithm = config["algorithm"]
    assert algorithm["policy_loss"] == {"name": "ppo", "options": {"eps_low": 0.2, "eps_high": 0.28}}
    assert algorithm["advantage"] == {"name": "grpo", "options": {"norm_by_std": True}}
    assert algorithm["loss_reduction"] == "token_mean" and algorithm["kl"] == {"use_as": "none"}
    off = algorithm["off_policy"]
    assert (off["tis"], off["token_tis_cap"], off["sequence_mask"]) == ("token", 2.0, "geometric")
    assert (off["geo_mask_low"], off["geo_mask_high"], off["outlier_token_low"], off["outlier_token_high"]) == (
        0.98, 1.02, 1e-4, 100)
    assert algorithm["dynamic_sampling"] == {"mode": "resample", "max_sample_batches": 10, "zero_variance_tol": 0.0}
    # nothing is dropped silently: every key is either carried over or named
    every_key = set(flatten(yaml.safe_load(FIXTURE.read_text())))
    assert set(notes) == every_key - CARRIED
    assert "no equivalent" in notes["trainer.policy.optimizer_config.adam_betas"].reason
    assert "only used by cispo" in notes["trainer.algorithm.cispo.cispo_eps_clip_low"].reason
    assert "trainer.steps" in notes["trainer.epochs"].reason


def test_cli_writes_a_config_that_our_loader_and_config_show_accept(tmp_path):
    out = tmp_path / "imported.yaml"
    result = run_skyrl("config", "import-upstream", str(FIXTURE), "-o", str(out), env=ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert "not carried over: trainer.policy.optimizer_config.adam_betas = [0.9, 0.999]" in result.stderr
    text = out.read_text()
    assert "#   generator.apply_overlong_filtering = True: no equivalent in skyrl" in text
    cfg = load_config(str(out))
    assert cfg.algorithm.policy_loss.options.eps_high == 0.28 and cfg.data.prompts_per_step == 512
    assert cfg.algorithm.dynamic_sampling.max_sample_batches == 10
    shown = run_skyrl("config", "show", str(out), "--skip-checks", "--json")
    assert shown.returncode == 0, shown.stderr
    assert '"token_tis_cap": 2.0' in shown.stdout


def test_cli_prints_to_stdout_without_output():
    result = run_skyrl("config", "import-upstream", str(FIXTURE), env=ENV)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["model"]["path"] == "Qwen/Qwen2.5-1.5B-Instruct"


@pytest.mark.parametrize("content, message", [
    (None, "the file does not exist"),
    ("trainer: [unclosed\n", "not valid YAML"),
    ("model: {path: /m}\nalgorithm: {policy_loss: ppo}\n", "not an upstream SkyRL config"),
])
def test_unreadable_input_exits_2_with_a_clear_message(tmp_path, content, message):
    path = tmp_path / "upstream.yaml"
    if content is not None:
        path.write_text(content)
    result = run_skyrl("config", "import-upstream", str(path))
    assert result.returncode == 2
    assert message in result.stderr and result.stdout == ""


def test_a_translation_that_does_not_validate_exits_2_and_says_why(tmp_path):
    path = tmp_path / "upstream.yaml"
    path.write_text("trainer:\n  policy: {model: {path: /m}}\n  algorithm: {policy_loss_type: regular, eps_clip_low: 1.5}\n")
    out = tmp_path / "out.yaml"
    result = run_skyrl("config", "import-upstream", str(path), "-o", str(out))
    assert result.returncode == 2
    assert "algorithm.policy_loss.options.eps_low: 1.5 is invalid" in result.stderr
    assert out.exists()  # written anyway, to be fixed by hand


def test_keys_left_out_take_upstream_defaults():
    config, notes = translate({"trainer": {"policy": {"model": {"path": "/m"}}}})
    algorithm = config["algorithm"]
    # upstream adds a k3 KL loss of 0.001 and clips PPO at 0.2 unless told otherwise
    assert algorithm["kl"] == {"use_as": "loss", "coef": 0.001, "estimator": "k3"}
    assert algorithm["policy_loss"] == {"name": "ppo", "options": {"eps_low": 0.2, "eps_high": 0.2}}
    assert algorithm["off_policy"] == {"tis": "none", "sequence_mask": "none", "token_tis_cap": 2.0,
                                       "sequence_tis_cap": 5.0, "geo_mask_low": 0.99, "geo_mask_high": 1.01,
                                       "product_mask_low": 0.5, "product_mask_high": 2.0}
    assert notes == {}
    # GSPO takes upstream's algorithm-level clip, not this project's GSPO default
    config, _ = translate({"trainer": {"algorithm": {"policy_loss_type": "gspo"}}})
    assert config["algorithm"]["policy_loss"]["options"] == {"eps_low": 0.2, "eps_high": 0.2}


@pytest.mark.parametrize("algorithm, expected", [
    ({"advantage_estimator": "gae", "gamma": 0.0, "lambd": 0.0}, {"advantage": {"name": "gae", "options": {"gamma": 0.0, "lam": 0.0}}}),
    ({"policy_loss_type": "cispo", "cispo": {"cispo_anchor": "rollout"}},
     {"policy_loss": {"name": "cispo", "options": {"eps_low": 1.0, "eps_high": 4.0, "anchor": "rollout"}}}),
    ({"policy_loss_type": "dppo", "dppo": {"dppo_type": "binary_kl", "delta_low": 0.05}},
     {"policy_loss": {"name": "dppo", "options": {"divergence": "binary_kl", "delta_low": 0.05, "delta_high": 0.2}}}),
    ({"loss_reduction": "seq_mean_token_sum_norm", "max_seq_len": 4096},
     {"loss_reduction": "seq_mean_token_sum_norm", "policy_loss": {"name": "ppo", "options": {"eps_low": 0.2, "eps_high": 0.2, "norm_len": 4096}}}),
    ({"zero_variance_filter": True, "zero_variance_filter_tol": 1e-6},
     {"dynamic_sampling": {"mode": "drop", "zero_variance_tol": 1e-6}}),
    ({"use_tis": True, "tis_imp_ratio_cap": 3.0}, {"off_policy": {"tis": "token", "token_tis_cap": 3.0}}),
    ({"use_kl_loss": False, "use_kl_in_reward": True, "kl_ctrl": {"type": "adaptive", "kl_target": 0.2}},
     {"kl": {"use_as": "reward", "coef": 0.001, "estimator": "k3", "adaptive_target": 0.2, "adaptive_horizon": 10000}}),
])
def test_algorithm_translations(algorithm, expected):
    config, _ = translate({"trainer": {"policy": {"model": {"path": "/m"}}, "algorithm": algorithm}})
    for key, value in expected.items():
        got = config["algorithm"][key]
        assert (got if not isinstance(value, dict) else {k: got[k] for k in value}) == value, key
    from skyrl_core.config.loader import structure_config
    structure_config(config)  # and it validates


def test_what_has_no_equivalent_is_named():
    _, notes = translate({"trainer": {"policy": {"model": {"path": "/m"}}, "bf16": True, "algorithm": {
        "dynamic_sampling": {"type": "replace"}, "off_policy_correction": {"token_mask_is_threshold_low": 0.5}},
        "ckpt_path": "${oc.env:SKYRL_SURELY_UNSET_VARIABLE}/ckpts"}})
    assert "'replace' (POLARIS) is not built" in notes["trainer.algorithm.dynamic_sampling.type"].reason
    assert "without the other" in notes["trainer.algorithm.off_policy_correction.token_mask_is_threshold_low"].reason
    assert notes["trainer.bf16"].reason == "no equivalent in skyrl"
    assert "cannot be resolved" in notes["trainer.ckpt_path"].reason


def test_not_an_upstream_layout_is_refused():
    with pytest.raises(UpstreamConfigError, match="expected top-level 'trainer'"):
        translate_upstream({"model": {"path": "/m"}})
