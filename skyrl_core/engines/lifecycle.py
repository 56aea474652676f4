"""What engines share around their inference library's handle (vllm, openai, sglang): a temporary
work directory, environment variables set while the library starts its processes, and the check
that the handle is usable (not closed, not asleep) before each call.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from typing import Any, Iterator


def temporary_workdir(owner: object, prefix: str) -> tuple[str, weakref.finalize]:
    """A new temporary directory and its remover: call it in ``close()``; it also runs when ``owner``
    is garbage-collected or at interpreter exit if the engine is never closed (idempotent)."""
    workdir = tempfile.mkdtemp(prefix=prefix)
    return workdir, weakref.finalize(owner, shutil.rmtree, workdir, True)


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set environment variables for the body (processes the library spawns inherit them), then restore."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def running(handle: Any, *, asleep: bool, engine: str) -> Any:
    """``handle``, unless the engine named ``engine`` is closed (``handle`` is None) or asleep."""
    if handle is None:
        raise RuntimeError(f"this {engine} engine is closed")
    if asleep:
        raise RuntimeError(f"this {engine} engine is asleep; call wake() first")
    return handle
