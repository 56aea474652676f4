"""The plugin manager: isolation of failures, duplicates, hook typos, autoload switches."""

from __future__ import annotations

import pytest

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.building import build_component
from skyrl_core.plugins.manager import UnknownComponentError, new_plugin_manager
from skyrl_core.plugins.records import EnvironmentSpec, InferenceEngineSpec, PolicyLossSpec


class EnginePlugin:
    def __init__(self, name: str) -> None:
        self.engine_name = name

    @hookimpl
    def skyrl_register_inference_engines(self, register):
        register(InferenceEngineSpec(name=self.engine_name, factory="tests_fake:Engine", description="test"))


def test_builtins_register_first_and_listing_names_them(builtin_plugin_manager):
    pm = builtin_plugin_manager
    names = [info.name for info in pm.listing()]
    assert names[:2] == ["core", "core.algorithms"]
    core = pm.infos["core"]
    assert core.kind == "builtin" and core.status == "ok"
    assert "op_impl:torch.linear" in core.provides


def test_duplicate_name_fails_the_second_plugin_only_and_names_both_distributions(builtin_plugin_manager):
    pm = builtin_plugin_manager
    pm.register_plugin(EnginePlugin("dup"), "first", distribution="dist-one")
    pm.register_plugin(EnginePlugin("dup"), "second", distribution="dist-two")
    assert pm.registry.names("inference_engine") == ["dup"]
    assert pm.registry.owner("inference_engine", "dup").name == "first"
    assert pm.infos["first"].status == "ok" and pm.infos["second"].status == "failed"
    message = pm.infos["second"].error
    assert "'dup'" in message and "dist-one" in message and "dist-two" in message


def test_failing_registration_is_recorded_and_others_still_register(builtin_plugin_manager):
    class Broken:
        @hookimpl
        def skyrl_register_inference_engines(self, register):
            raise RuntimeError("boom in registration")

    pm = builtin_plugin_manager
    pm.register_plugin(Broken(), "broken")
    pm.register_plugin(EnginePlugin("healthy"), "healthy")
    assert pm.registry.names("inference_engine") == ["healthy"]
    assert pm.infos["broken"].status == "failed"
    assert "boom in registration" in pm.infos["broken"].error
    assert pm.infos["healthy"].status == "ok"


def test_misspelled_hook_fails_loading_that_plugin_only(builtin_plugin_manager):
    class Typo:
        @hookimpl
        def skyrl_register_inference_engine(self, register):  # missing "s"
            pass

    pm = builtin_plugin_manager
    pm.register_plugin(Typo(), "typo")
    info = pm.infos["typo"]
    assert info.status == "failed"
    assert "skyrl_register_inference_engine" in info.error
    assert not pm.has_plugin("typo")


def test_wrong_record_kind_is_rejected(builtin_plugin_manager):
    class WrongKind:
        @hookimpl
        def skyrl_register_inference_engines(self, register):
            register(EnvironmentSpec(name="x", factory="a:b"))

    pm = builtin_plugin_manager
    pm.register_plugin(WrongKind(), "wrong")
    pm.registry
    assert pm.infos["wrong"].status == "failed"
    assert "expected a record of kind ['inference_engine']" in pm.infos["wrong"].error


def test_unknown_component_suggests_close_name(builtin_plugin_manager):
    pm = builtin_plugin_manager
    pm.register_plugin(EnginePlugin("vllm"), "v")
    with pytest.raises(UnknownComponentError) as info:
        pm.spec("inference_engine", "vlm")
    assert info.value.allowed == ["vllm"]
    assert "Did you mean 'vllm'?" in str(info.value)


def test_records_reject_bad_factory_paths():
    with pytest.raises(ValueError, match="'module:attr'"):
        PolicyLossSpec(name="x", factory="no_colon")
    with pytest.raises(ValueError, match="non-empty word"):
        PolicyLossSpec(name="two words", factory="a:b")


def test_autoload_switch_and_allowlist(monkeypatch):
    monkeypatch.setenv("SKYRL_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = new_plugin_manager()
    assert {i.kind for i in pm.listing()} == {"builtin"}

    monkeypatch.delenv("SKYRL_DISABLE_PLUGIN_AUTOLOAD")
    monkeypatch.setenv("SKYRL_PLUGINS", "torch")
    pm = new_plugin_manager()
    plugin_rows = {i.name: i for i in pm.listing() if i.kind == "plugin"}
    assert "torch" in plugin_rows and plugin_rows["torch"].status != "disabled"
    disabled = {name for name, row in plugin_rows.items() if row.status == "disabled"}
    assert disabled == set(plugin_rows) - {"torch"}
    assert all(plugin_rows[n].error == "not in SKYRL_PLUGINS" for n in disabled)


def test_build_validates_options_before_calling_the_factory(builtin_plugin_manager, tmp_path, monkeypatch):
    module = tmp_path / "tmp_component.py"
    module.write_text(
        "import attrs\n"
        "@attrs.frozen(kw_only=True)\n"
        "class Opts:\n"
        "    scale: float = 1.0\n"
        "calls = []\n"
        "def make(opts):\n"
        "    calls.append(opts)\n"
        "    return lambda x: x * opts.scale\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    class LossPlugin:
        @hookimpl
        def skyrl_register_algorithms(self, register):
            register(PolicyLossSpec(name="scaled", factory="tmp_component:make", options="tmp_component:Opts"))

    pm = builtin_plugin_manager
    pm.register_plugin(LossPlugin(), "loss")
    fn = build_component(pm, "policy_loss", "scaled", {"scale": 3})
    assert fn(2) == 6.0
    import tmp_component
    from skyrl_core.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        build_component(pm, "policy_loss", "scaled", {"scael": 3})
    assert "policy_loss:scaled.scael: unknown key" in str(info.value)
    assert "did you mean 'scale'?" in str(info.value)
    assert len(tmp_component.calls) == 1  # the bad call never reached the factory
