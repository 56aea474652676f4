"""The CPU redirections of megatron-core's CUDA-only calls."""

import torch

from skyrl_megatron.cpu_compat import CpuMemoryBuffer, CpuRNGStatesTracker, _rotary_emb_on_cpu


def test_rng_fork_runs_on_its_own_stream_and_restores_the_default_one():
    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    expected_outside = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(3)
    outside = torch.rand(3)
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3)
    assert torch.equal(outside, expected_outside)  # the default stream did not move
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(1234)))
    assert not torch.equal(first, second)  # the forked stream advanced
    # get/set_states round-trips the stream (checkpoints rely on it).
    saved = tracker.get_states()
    with tracker.fork("model-parallel-rng"):
        third = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("model-parallel-rng"):
        assert torch.equal(torch.rand(3), third)


def test_memory_buffer_reuses_cpu_storage():
    buffer = CpuMemoryBuffer()
    a = buffer.get_tensor((2, 3), torch.float32, "mpu")
    assert a.device.type == "cpu" and a.shape == (2, 3)
    b = buffer.get_tensor((3,), torch.float32, "mpu")
    assert b.data_ptr() == a.data_ptr()  # smaller request: same storage
    c = buffer.get_tensor((4, 4), torch.float32, "mpu")
    assert c.shape == (4, 4)


def test_rotary_embedding_matches_megatrons_own_formula_on_cpu():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    emb = _rotary_emb_on_cpu(rope, 5)
    assert emb.shape == (5, 1, 1, 8)
    freqs = torch.outer(torch.arange(5, dtype=torch.float32), rope.inv_freq)
    assert torch.equal(emb[:, 0, 0], torch.cat([freqs, freqs], dim=-1))
    assert emb.device.type == "cpu"
