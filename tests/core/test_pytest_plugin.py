"""skyrl-core's pytest plugin (loaded through ``pytest11`` wherever skyrl-core is installed) changes
nothing in another project's test run: no environment variables, no skipped ``gpu`` tests. A
project opts in with ``skyrl_test_environment = true``."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import os

import pytest


def test_environment():
    print("HF_HUB_OFFLINE=%s RAY_AUTH_MODE=%s" % (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("RAY_AUTH_MODE")))


@pytest.mark.gpu
def test_marked_gpu():
    pass


def test_fixtures_are_offered(builtin_plugin_manager):
    assert builtin_plugin_manager.infos["core"].status == "ok"
"""

VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "RAY_AUTH_MODE", "TOKENIZERS_PARALLELISM", "VLLM_CACHE_ROOT")


@pytest.fixture
def other_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    pytester.makepyfile(test_other=TESTS)
    return pytester


def test_another_project_runs_unchanged(other_project):
    other_project.makeini("[pytest]\nmarkers =\n    gpu: the other project's own marker\n")
    result = other_project.runpytest_subprocess("-s", "-p", "skyrl")
    result.assert_outcomes(passed=3)  # the gpu test ran
    result.stdout.fnmatch_lines(["*HF_HUB_OFFLINE=None RAY_AUTH_MODE=None*"])


def test_a_project_that_opts_in_gets_the_skyrl_environment(other_project):
    import torch

    other_project.makeini("[pytest]\nskyrl_test_environment = true\n")
    result = other_project.runpytest_subprocess("-s")
    if torch.cuda.is_available():
        result.assert_outcomes(passed=3)
    else:
        result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["*HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled*"])
