import pytest

# The contract suite lives outside the test tree: let pytest explain its failing asserts.
pytest.register_assert_rewrite("skyrl_core.testing.engine_contract")
