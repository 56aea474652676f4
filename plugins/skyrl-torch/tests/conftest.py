import os
import sys

import pytest

# Tests run with --import-mode=importlib: make this directory's helper module importable.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The contract suite lives outside the test tree: let pytest explain its failing asserts.
pytest.register_assert_rewrite("skyrl_core.testing.engine_contract")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine each parallel region
    waits for a second core: one thread keeps these tests fast and their timing stable."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
