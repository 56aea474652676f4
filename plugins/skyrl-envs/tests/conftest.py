import pytest


@pytest.fixture(scope="session")
def index_dir(tmp_path_factory):
    """A private directory for search indexes (not the user's cache)."""
    return str(tmp_path_factory.mktemp("search-index"))
