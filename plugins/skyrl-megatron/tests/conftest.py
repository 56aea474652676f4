import os
import warnings

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# megatron-core warns at import that Apex / Transformer Engine are absent: expected on CPU.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def pytest_configure(config):
    # megatron-core 0.16 deprecation chatter about arguments skyrl does not pass explicitly.
    for pattern in (
        r"ignore::DeprecationWarning:megatron\..*",
        r"ignore:.*(Apex|Transformer Engine|full scope is deprecated).*:UserWarning",
    ):
        config.addinivalue_line("filterwarnings", pattern)


# The contract suite lives outside the test tree: let pytest explain its failing asserts.
pytest.register_assert_rewrite("skyrl_core.testing.backend_contract")

# Shared test helpers (megatron_test_models.py) are imported by name; importlib mode does not put
# the test directory on sys.path by itself.
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
