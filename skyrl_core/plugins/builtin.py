"""The core's built-in plugin: stock op implementations and the default op installation."""

from __future__ import annotations

from skyrl_core.plugins import hookimpl


@hookimpl
def skyrl_register_ops(register):
    from skyrl_core.ops.install import DEFAULT_IMPLS

    for impl in DEFAULT_IMPLS.values():
        register(impl)


@hookimpl(trylast=True)
def skyrl_install_op(op, site, impl):
    """Without any plugin opinion, the runtime's default implementation is installed."""
    return impl
