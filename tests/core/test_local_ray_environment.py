"""Rank actors adopt the driver's SKYRL_* switches, not those of the process that started Ray."""

from __future__ import annotations

import os

from skyrl_core.local_ray import adopt_skyrl_environment, skyrl_environment


def test_adopt_makes_the_skyrl_variables_exactly_the_drivers(monkeypatch):
    monkeypatch.setenv("SKYRL_ISOEXEC", "1")  # what the Ray session started with
    monkeypatch.setenv("SKYRL_STALE", "x")
    monkeypatch.setenv("OTHER_VARIABLE", "kept")
    monkeypatch.setenv("SKYRL_PLUGINS", "")  # so that monkeypatch restores it (adopt sets it below)
    driver = {"SKYRL_PLUGINS": "skyrl-torch"}
    adopt_skyrl_environment(driver)
    assert skyrl_environment() == driver
    assert "SKYRL_ISOEXEC" not in os.environ and os.environ["OTHER_VARIABLE"] == "kept"
