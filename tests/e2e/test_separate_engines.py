"""``engine.placement: separate`` for real (Ray on loopback, tiny model): a router over two engine
processes keeps every replica's weights hash-equal to the trainer's by checkpoint and by broadcast,
routes episodes to their replica, restarts a killed process with the last weights; a fully_async
run whose engine process is killed stops naming it, its checkpoints load, and the resumed run (with
restart_on_failure) survives another kill; on a two-node Ray cluster the trainer ranks land on the
node with the trainer's custom resource and the engines on the other, and training runs."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from skyrl_core.config.loader import load_config
from skyrl_core.config.schema import EngineConfig, ModelConfig
from skyrl_core.engine_actor import EngineProcessError, RemoteEngine
from skyrl_core.engine_router import EngineRouter
from skyrl_core.models import load_causal_lm
from skyrl_core.plugins import hookimpl
from skyrl_core.testing.engine_contract import TINY_QWEN3, request
from skyrl_core.trainer.metrics import read_metrics
from skyrl_core.trainer.rl import train
from skyrl_core.weight_sync import weights_digest
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TestEnvironments

pytestmark = pytest.mark.slow
# The single-node tests share the module's Ray session (skyrl_core.testing's ray_session: one Ray
# start, seconds on 2 cores, instead of one per test); each leaves no actor behind (the router and
# the trainer close their engine processes). The two-node test starts its own cluster.


@pytest.fixture
def pm(fresh_plugin_manager):
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    return fresh_plugin_manager


def _tied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    moved = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in state.items()}
    for name, t in state.items():  # the tiny model ties its unembedding: a tied pair moves together
        if name != "model.embed_tokens.weight" and t.data_ptr() == state["model.embed_tokens.weight"].data_ptr():
            moved[name] = moved["model.embed_tokens.weight"]
    return moved


def test_router_syncs_every_replica_routes_episodes_and_restarts_a_killed_one(ray_session, tmp_path):
    model = ModelConfig(config=dict(TINY_QWEN3))
    engine = EngineConfig(name="torch", options={"max_num_seqs": 8})
    replicas = [RemoteEngine(engine, model, seed=0, name=f"engine-{i}", restart_on_failure=True,
                             checkpoint_dir=str(tmp_path)) for i in range(2)]
    trainer = load_causal_lm(model, seed=1).state_dict()
    for method in ("checkpoint", "broadcast"):
        router = EngineRouter(replicas, method=method, checkpoint_dir=str(tmp_path))
        weights = trainer if method == "checkpoint" else _tied(trainer)
        assert all(r.weights_digest() != weights_digest(weights.items()) for r in replicas)  # negative control
        router.update_weights(weights.items(), version=1 if method == "checkpoint" else 2)
        assert [r.weights_digest() for r in replicas] == [weights_digest(weights.items())] * 2, method
    assert os.listdir(tmp_path) == ["weights_v000001.safetensors"]  # one file, no partial left
    try:
        # two groups go to the two replicas; an episode's later turn follows its group
        first = router.generate([request((1, 2, 3), "s:0", max_tokens=4, seed=0, n=2),
                                 request((4, 5, 6), "s:1", max_tokens=4, seed=1, n=2)])
        assert [s.token_versions[0] for g in first for s in g] == [2, 2, 2, 2]
        assert router.route([request((1,), "s:1/0"), request((1,), "s:0/1")]) == [1, 0]

        os.kill(replicas[1].pid, signal.SIGKILL)
        old_pid, started = replicas[1].pid, time.monotonic()
        with pytest.warns(UserWarning, match=rf"engine process 'engine-1' \(pid {old_pid}\) died during generate"):
            again = router.generate([request((4, 5, 6), "s:1", max_tokens=4, seed=1, n=2)])
        assert time.monotonic() - started < 60 and replicas[1].pid != old_pid and router.restarts == 1
        assert replicas[1].weights_digest() == weights_digest(_tied(trainer).items())  # the last weights
        assert [s.token_ids for s in again[0]] == [s.token_ids for s in first[1]]  # same weights, same seed
    finally:
        router.close()


class _KillEngineAtStep:
    """At the end of step ``step``, SIGKILL the process of one engine replica."""

    def __init__(self, step: int) -> None:
        self.step, self.killed = step, []

    @hookimpl
    def skyrl_on_step_end(self, step: int, metrics: dict) -> None:
        if step == self.step:
            import ray

            (name,) = [a for a in ray.util.list_named_actors() if a.startswith("skyrl-engine-1-")]
            pid = ray.get(ray.get_actor(name).pid.remote())
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)


def test_fully_async_with_separate_engines_survives_a_killed_engine_and_resumes(ray_session, tmp_path, pm):
    from skyrl_core.trainer.checkpoint import resolve_checkpoint

    config = write_tiny_config(tmp_path, steps=4, mini_batches=1, checkpoint_every=1)
    common = ["trainer.mode=fully_async", "trainer.fully_async.max_inflight=16", "generation.max_new_tokens=16",
              "data.eval=null", "engine.placement=separate", "engine.replicas=2", "engine.weight_sync=checkpoint"]
    killer = _KillEngineAtStep(2)
    pm.register_plugin(killer, "killer")
    started = time.monotonic()
    with pytest.raises(Exception, match=r"engine process 'engine-1' \(pid \d+\) died") as failed:
        train(load_config(str(config), common, plugin_manager=pm), plugin_manager=pm)
    assert killer.killed and time.monotonic() - started < 300, failed.value
    run = tmp_path / "run"
    assert resolve_checkpoint(str(run)).endswith("step_000002")  # complete, and the newest

    pm.unregister(killer)
    pm.register_plugin(_KillEngineAtStep(3), "killer-2")
    result = train(load_config(str(config), [*common, "engine.restart_on_failure=true", f"trainer.resume={run}"],
                               plugin_manager=pm), plugin_manager=pm)
    records = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # no completed step lost, none twice
    assert records[-1]["engine/restarts"] == 1.0 and records[1].get("engine/restarts") == 0.0
    assert all(r["async/staleness_max"] <= 1 for r in records)


def test_two_node_cluster_puts_trainer_ranks_and_engines_on_their_own_nodes(tmp_path, pm, monkeypatch):
    import ray
    from ray.cluster_utils import Cluster

    from skyrl_core import engine_router
    from skyrl_core.local_ray import RAY_ENV_VARS
    from skyrl_fsdp import ray_ranks

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"trainer_node": 1}})
    engine_node = cluster.add_node(num_cpus=2, resources={"engine_node": 1})
    trainer_node = cluster.head_node
    seen: dict[str, list[str]] = {"trainer": [], "engine": []}
    start_ranks, start_engines = ray_ranks.start_ranks, engine_router.start_separate_engines

    def ranks(*args, **kwargs):
        hosts = start_ranks(*args, **kwargs)
        seen["trainer"] += ray.get([h.node_id.remote() for h in hosts])
        return hosts

    def engines(*args, **kwargs):
        router = start_engines(*args, **kwargs)
        seen["engine"] += [r.node_id for r in router.replicas]
        return router

    monkeypatch.setattr(ray_ranks, "start_ranks", ranks)
    monkeypatch.setattr(engine_router, "start_separate_engines", engines)
    try:
        ray.init(address=cluster.address, runtime_env={"env_vars": dict(RAY_ENV_VARS)})
        config = write_tiny_config(tmp_path, steps=2, mini_batches=1)
        cfg = load_config(str(config), [
            "data.eval=null", "engine.placement=separate", "engine.ray_placement=disaggregate",
            "engine.trainer_bundle={trainer_node: 0.5}", "engine.engine_bundle={engine_node: 0.5}",
            "backend.options.world_size=2", "backend.options.reuse_workers=false"], plugin_manager=pm)
        records = [r for r in read_metrics(train(cfg, plugin_manager=pm).run_dir) if r["step"] > 0]
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert seen["trainer"] == [trainer_node.node_id] * 2, seen
    assert seen["engine"] == [engine_node.node_id], seen
    assert trainer_node.node_id != engine_node.node_id
    assert [r["step"] for r in records] == [1, 2] and all(r["grad_norm"] > 0 for r in records)
