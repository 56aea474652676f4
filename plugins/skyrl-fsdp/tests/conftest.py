import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The contract suite lives outside the test tree: let pytest explain its failing asserts.
pytest.register_assert_rewrite("skyrl_core.testing.backend_contract")
