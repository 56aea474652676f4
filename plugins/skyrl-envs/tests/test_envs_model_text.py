"""Model text never stops a run: hostile text in every tag of every environment is an observation
or a failed episode, never an exception out of ``step()`` (issue 17: a lone surrogate in code
raised ``SandboxUnavailable``)."""

from __future__ import annotations

import pytest

import skyrl_core
from skyrl_core.data import load_dataset
from skyrl_envs.search_index import SHIPPED_CORPUS
from skyrl_envs.sql_env import SHIPPED_DB_DIR

DATA = SHIPPED_CORPUS.parent.parent
MATH_ROW = {"prompt": [{"role": "user", "content": "What is 6 * 12?"}], "reward_spec": {"ground_truth": "72"}}
CODE_ROW = {"prompt": [{"role": "user", "content": "Print 1."}],
            "reward_spec": {"ground_truth": {"tests": [{"input": "", "output": "1\n"}]}}}
ROWS = {
    "arithmetic": {"extra_info": {"a": 1, "b": 2, "op": "+"}},
    "gsm8k": MATH_ROW,
    "math": MATH_ROW,
    "sql": load_dataset(SHIPPED_DB_DIR / "shop.jsonl")[0],
    "search": load_dataset(DATA / "search" / "questions.jsonl")[0],
    "code": CODE_ROW,
    "multi_tool": load_dataset(DATA / "multi_tool" / "questions.jsonl")[0],
}
# A correct program gets ample wall time (a loaded machine can take seconds to start Python: a
# 1 s limit failed a right answer once); a runaway one is stopped by its 1 s of CPU.
FAST = {"sandbox": {"wall_seconds": 20.0, "cpu_seconds": 1, "disk_bytes": 1024 * 1024}}
HOSTILE = ["\ud800", "\udfff\x00", "\x00" * 3, "'\"; --", "\u202e" * 5, "7" * 20_000]
TAGS = ["{}", "\\boxed{{{}}}", "#### {}", "<sql>{}</sql>", "<solution>{}</solution>", "<search>{}</search>",
        "<answer>{}</answer>", "<python>{}</python>", "```python\n{}\n```", "```python\nprint('{}')\n```"]


SANDBOXED = {"code", "multi_tool"}  # each run costs a sandbox: only the tags that reach it


@pytest.mark.parametrize("env_name", sorted(ROWS))
def test_hostile_text_in_every_tag_never_raises(env_name, index_dir):
    options = {"code": FAST, "multi_tool": {**FAST, "index_dir": index_dir}, "search": {"index_dir": index_dir}}
    tags = [t for t in TAGS if "python" in t] if env_name in SANDBOXED else TAGS
    texts = HOSTILE + ["x" * 2_000_000] if env_name in SANDBOXED else HOSTILE  # over disk_bytes
    for tag in tags:
        for text in texts:
            env = skyrl_core.make_env(env_name, **options.get(env_name, {}))
            env.reset(ROWS[env_name])
            result = env.step(tag.format(text))  # must not raise
            env.close()  # now, not whenever the garbage collector gets to it (the attack tests count fds)
            assert result.reward == 0.0, (env_name, tag, text[:10], result.reward)
