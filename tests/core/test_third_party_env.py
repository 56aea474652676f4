"""A third-party package maps a name to an environment class in one pyproject line (stevedore)."""

from __future__ import annotations

import json

import skyrl_core
from skyrl_core.plugins.manager import new_plugin_manager, set_plugin_manager
from tests.conftest import run_skyrl


def test_installed_third_party_env_is_listed_and_buildable(third_party_env_packages):
    result = run_skyrl("plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    good = rows["countdown-word"]
    assert (good["distribution"], good["version"], good["kind"], good["status"]) == (
        "skyrl-example-env", "1.2.3", "environments", "ok")
    assert good["provides"] == ["environment:countdown-word"]
    broken = rows["broken-env"]
    assert broken["status"] == "failed" and "needs a library that is not installed" in broken["error"]
    # the failure broke nothing else
    assert all(row["status"] == "ok" for name, row in rows.items() if row["kind"] == "plugin")

    previous = set_plugin_manager(new_plugin_manager())
    try:
        env = skyrl_core.make_env("countdown-word")
        assert env.reset({"word": "abc"}) == [{"role": "user", "content": "Spell 'abc' backwards."}]
        obs, reward, done, info = env.step("cba")
        assert (obs, reward, done) == ([], 1.0, True)
        assert env.step("abc").reward == 0.0
        # an entry-point environment's options are its constructor's typed keyword parameters,
        # validated like any other options
        from skyrl_core.config.errors import ConfigError

        assert skyrl_core.make_env("countdown-word", word="xyz").word == "xyz"
        for bad, message in ((dict(wrd="abc"), "environment:countdown-word.wrd: unknown key"),
                             (dict(word=3), "environment:countdown-word.word: 3 is invalid: expected a string")):
            try:
                skyrl_core.make_env("countdown-word", **bad)
            except ConfigError as error:
                assert message in str(error), str(error)
            else:
                raise AssertionError(f"{bad} was accepted")
    finally:
        set_plugin_manager(previous)
