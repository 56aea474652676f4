"""``engine.placement`` and its keys: bad values and combinations that would not do what they say
are refused before any work, naming key, value and what is allowed; the router's choice of replica
(least samples in flight; an episode group stays on its replica)."""

from __future__ import annotations

import pytest

from skyrl_core.config.loader import ConfigError, structure_config
from skyrl_core.engine_router import EngineRouter
from skyrl_core.trainer.runtime import check_engine_placement
from skyrl_core.types import GenerationRequest, SamplingParams

TINY = {"model": {"config": {"model_type": "llama"}}}


def _cfg(engine: dict, **extra):
    return structure_config({**TINY, "engine": {"name": "torch", **engine}, **extra})


@pytest.mark.parametrize("key,value,allowed", [("placement", "remote", "colocated, separate"),
                                               ("weight_sync", "nccl", "auto, broadcast, checkpoint"),
                                               ("ray_placement", "spread", "colocate, disaggregate")])
def test_unknown_values_are_refused_with_the_allowed_ones(key, value, allowed):
    with pytest.raises(ConfigError, match=rf"(?s)engine\.{key}: '{value}' is invalid.*allowed: {allowed}"):
        _cfg({key: value})
    with pytest.raises(ConfigError, match=r"engine\.replicas: 0 is invalid: must be > 0"):
        _cfg({"replicas": 0})
    with pytest.raises(ConfigError, match=r"engine\.engine_bundle"):
        _cfg({"engine_bundle": {"gpu_node": -1}})


@pytest.mark.parametrize("key,value", [("replicas", 2), ("weight_sync", "broadcast"), ("weight_sync", "checkpoint"),
                                       ("restart_on_failure", True), ("ray_placement", "disaggregate"),
                                       ("trainer_bundle", {"trainer_node": 1})])
def test_separate_only_keys_are_refused_with_a_colocated_engine(key, value):
    cfg = _cfg({key: value})
    with pytest.raises(ConfigError, match=rf"engine\.{key}: .* needs engine.placement=separate"):
        check_engine_placement(cfg)
    check_engine_placement(_cfg({key: value, "placement": "separate", "ray_placement": "colocate"}))  # accepted there


def test_disaggregate_needs_trainer_rank_actors_and_separate_needs_an_engine_that_supports_it():
    with pytest.raises(ConfigError, match=r"engine\.ray_placement: 'disaggregate' .* world_size=1"):
        check_engine_placement(_cfg({"placement": "separate", "ray_placement": "disaggregate"}))
    check_engine_placement(_cfg({"placement": "separate", "ray_placement": "disaggregate"},
                                backend={"name": "fsdp", "options": {"world_size": 2}}))
    check_engine_placement(structure_config({**TINY, "engine": {"name": "vllm", "placement": "separate"}}))
    cfg = structure_config({**TINY, "engine": {"name": "openai", "options": {"launch": True}, "placement": "separate"}})
    with pytest.raises(ConfigError, match=r"engine\.placement: 'separate' .* supports_separate_process .* engine 'openai' "
                                          "runs colocated"):
        check_engine_placement(cfg)


class _Replica:  # the router's choice reads nothing of a replica but this
    supports_pause = True


def test_router_sends_new_groups_to_the_least_loaded_replica_and_keeps_episodes_on_theirs():
    router = EngineRouter([_Replica(), _Replica(), _Replica()], method="broadcast")

    def req(rid: str, n: int = 1) -> GenerationRequest:
        return GenerationRequest(request_id=rid, prompt_token_ids=(1,), sampling=SamplingParams(n=n))

    first = router.route([req("s1:0", 4), req("s1:1", 2), req("s1:2", 1), req("s1:3", 1)])
    assert first == [0, 1, 2, 2] and router.load == [4, 2, 2]
    # later turns of the episodes of group s1:0 stay on replica 0, although it is the busiest
    assert router.route([req("s1:0/0"), req("s1:0/3"), req("s1:1/1")]) == [0, 0, 1]
    assert router.load == [6, 3, 2]
    assert router.route([req("s2:0")]) == [2]  # a new group: the least loaded


def test_a_selection_key_alone_keeps_the_default_component():
    """``engine.placement=separate`` (or ``backend.options.world_size=2``) given without a name
    selects the default engine (backend) rather than failing for a missing name."""
    from skyrl_core.config.loader import apply_overrides

    cfg = structure_config(apply_overrides(TINY, ["engine.placement=separate", "backend.options.world_size=2"]))
    assert (cfg.engine.name, cfg.engine.placement) == ("torch", "separate")
    assert (cfg.backend.name, cfg.backend.options.world_size) == ("fsdp", 2)
