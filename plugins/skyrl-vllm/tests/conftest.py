import os
import sys

import pytest

# Tests run with --import-mode=importlib: make this directory's helper module importable.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The contract suite lives outside the test tree: let pytest explain its failing asserts.
pytest.register_assert_rewrite("skyrl_core.testing.engine_contract")
