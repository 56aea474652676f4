from pathlib import Path

from skyrl_core.config.reference import config_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_config_reference_in_docs_is_current():
    assert config_reference() in DOC.read_text(), "docs/config.md is stale: run python scripts/gen_config_docs.py"


def test_reference_lists_every_leaf_key():
    text = config_reference()
    for key in ("`trainer.lr`", "`engine`", "`algorithm.kl.coef`", "`generation.max_new_tokens`", "`model.path`"):
        assert key in text
