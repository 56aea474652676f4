"""The package of docs/writing_envs.md, built from the doc's own code blocks and installed for real."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, run_skyrl

DOC = REPO / "docs" / "writing_envs.md"


def doc_files() -> dict[str, str]:
    """``{relative path: content}`` of every ``**`skyrl-guess-number/...`**`` block in the doc."""
    pattern = r"\*\*`skyrl-guess-number/([^`]+)`\*\*\n\n```\w+\n(.*?)```"
    return dict(re.findall(pattern, DOC.read_text(), flags=re.S))


@pytest.fixture(scope="module")
def installed_doc_package(tmp_path_factory):
    root = tmp_path_factory.mktemp("doc-package") / "skyrl-guess-number"
    files = doc_files()
    assert sorted(files) == ["pyproject.toml", "skyrl_guess_number/__init__.py"]
    for relative, content in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(content)
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", str(root)], check=True,
                   capture_output=True, timeout=300)
    try:
        yield
    finally:
        subprocess.run([*pip, "uninstall", "-y", "skyrl-guess-number"], capture_output=True, timeout=300)


def test_the_doc_package_is_listed(installed_doc_package):
    rows = {r["name"]: r for r in json.loads(run_skyrl("plugins", "list", "--json").stdout)}
    row = rows["guess-number"]
    assert (row["distribution"], row["version"], row["kind"], row["status"]) == (
        "skyrl-guess-number", "0.1.0", "environments", "ok")


def test_the_doc_package_plays_through_make_env(installed_doc_package):
    code = textwrap.dedent("""
        import json, skyrl_core
        env = skyrl_core.make_env("guess-number")
        prompt = env.reset({"reward_spec": {"ground_truth": "37"}})
        steps = [env.step(t) for t in ("<guess>50</guess>", "<guess>20</guess>", "no idea", "<guess>37</guess>")]
        print(json.dumps({"prompt": prompt, "steps": [list(s) for s in steps]}))
        env.reset({"reward_spec": {"ground_truth": "5"}})
        print(json.dumps([list(env.step(f"<guess>{g}</guess>")) for g in (1, 2, 3, 4, 9, 8)]))
        env = skyrl_core.make_env("guess-number", max_turns=2, low=1, high=10)
        prompt = env.reset({"reward_spec": {"ground_truth": "5"}})
        print(json.dumps([prompt[0]["content"], [list(env.step("<guess>1</guess>")) for _ in range(2)]]))
        try:
            skyrl_core.make_env("guess-number", max_turn=2)
        except Exception as error:
            print(json.dumps(str(error)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    played, ran_out, configured, refused = (json.loads(line) for line in out.stdout.splitlines())
    assert "<guess>number</guess>" in played["prompt"][0]["content"]
    observations = [s[0][0]["content"] if s[0] else None for s in played["steps"]]
    assert observations == ["Lower.", "Higher.", "Write your guess as <guess>number</guess>.", None]
    assert [s[1:3] for s in played["steps"]] == [[0.0, False], [0.0, False], [0.0, False], [1.0, True]]
    assert [s[1:3] for s in ran_out] == [[0.0, False]] * 5 + [[0.0, True]]  # six turns by default
    assert ran_out[-1][3]["correct"] is False
    # constructor options from the config: two turns, numbers from 1 to 10
    assert "from 1 to 10" in configured[0]
    assert [s[1:3] for s in configured[1]] == [[0.0, False], [0.0, True]]
    assert "environment:guess-number.max_turn: unknown key" in refused and "did you mean 'max_turns'" in refused


def test_the_doc_package_takes_options_from_a_config(installed_doc_package, tmp_path):
    config = tmp_path / "guess.yaml"
    row = {"prompt": [{"role": "user", "content": "guess"}], "env_class": "guess-number", "reward_spec": {"ground_truth": "7"}}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    config.write_text("model: {config: {model_type: qwen3}}\ndata: {train: train.jsonl}\n"
                      "environment: {name: guess-number, options: {max_turns: 3, high: 10}}\n")
    shown = run_skyrl("config", "show", str(config), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["environment"]["options"] == {"max_turns": 3, "low": 1, "high": 10}
    bad = run_skyrl("config", "show", str(config), "environment.options.high=ten")
    assert bad.returncode == 2 and "environment.options.high: 'ten' is invalid: expected an integer" in bad.stderr
