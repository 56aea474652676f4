"""What is installed: which package provides a known component, which requirements of a plugin are
missing. Read from package metadata only: nothing here imports the packages it asks about (a
missing or broken torch must not stop ``skyrl plugins list``).
"""

from __future__ import annotations

from importlib import metadata

# Components of the project's own plugins, so that a config naming one that is not installed says
# what to install. (kind, name) -> distribution.
KNOWN_PROVIDERS: dict[tuple[str, str], str] = {
    **{("inference_engine", n): "skyrl-torch" for n in ("torch",)},
    **{("inference_engine", n): "skyrl-vllm" for n in ("vllm", "openai")},
    ("inference_engine", "sglang"): "skyrl-sglang",
    ("training_backend", "fsdp"): "skyrl-fsdp",
    ("training_backend", "megatron"): "skyrl-megatron",
    **{("environment", n): "skyrl-envs" for n in ("arithmetic", "gsm8k", "math", "sql", "search", "code", "multi_tool")},
    ("config_section", "isoexec"): "skyrl-isoexec",
    **{("logger", n): "skyrl-loggers" for n in ("mlflow", "tensorboard", "wandb")},
}

# Extra words for packages whose install needs more than the name.
_INSTALL_HINTS = {
    "skyrl-vllm": "pip install 'skyrl-vllm[cpu]' (or [gpu])",
    "skyrl-sglang": "pip install 'skyrl-sglang[gpu]'",
}


def provider_hint(kind: str, name: str) -> str | None:
    """``"provided by skyrl-torch (pip install skyrl-torch)"`` for a known name that is not
    registered, else None."""
    dist = KNOWN_PROVIDERS.get((kind, str(name)))
    if dist is None:
        return None
    return f"provided by {dist} ({install_command(dist)})"


def install_command(dist: str) -> str:
    return _INSTALL_HINTS.get(dist, f"pip install {dist}")


def missing_requirements(dist: str) -> list[str]:
    """The runtime requirements of installed distribution ``dist`` (no extras; markers evaluated
    for this interpreter) that are not installed or not in the required version range, as
    requirement strings (``"torch>=2.4"``, ``"megatron-core (have 0.9.0)"``). [] if ``dist`` is not
    an installed distribution."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requires = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return []
    missing = []
    for text in requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(_without_marker(req))
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            missing.append(f"{_without_marker(req)} (have {have})")
    return missing


def _without_marker(req: object) -> str:
    return str(req).split(";", 1)[0].strip()
