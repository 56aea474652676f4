import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server import write_tied_tiny_model, write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tied_tiny_model(tmp_path_factory) -> str:
    return write_tied_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-tied"))
