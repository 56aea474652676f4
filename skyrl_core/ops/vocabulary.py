"""The names of ops and sites, and the context variable that says which site is computing."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

OPS: tuple[str, ...] = (
    "embedding",
    "linear",
    "rms_norm",
    "rope",
    "attention",
    "silu_mul",
    "logprobs",
    "gdn_conv",
    "gdn_core",
    "moe_router",
    "moe_experts",
    "moe_combine",
)

SITES: tuple[str, ...] = ("trainer_forward", "trainer_score", "engine_prefill", "engine_decode")

ROLE_SITES: dict[str, tuple[str, ...]] = {
    "trainer": ("trainer_forward", "trainer_score"),
    "engine": ("engine_prefill", "engine_decode"),
}

_current_site: contextvars.ContextVar[str | None] = contextvars.ContextVar("skyrl_op_site", default=None)


def current_site() -> str | None:
    """The site the calling code is computing at, or None outside any ``site_scope``."""
    return _current_site.get()


@contextlib.contextmanager
def site_scope(site: str) -> Iterator[None]:
    """Run the body as ``site``: op dispatchers read it to pick the installed implementation."""
    if site not in SITES:
        raise ValueError(f"unknown op site {site!r}; sites are {', '.join(SITES)}")
    token = _current_site.set(site)
    try:
        yield
    finally:
        _current_site.reset(token)
