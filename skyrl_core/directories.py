"""Replacing a directory so that a crash at any moment leaves one whole copy on disk.

The new copy is written elsewhere first (a temporary directory beside the target). An old copy is
renamed aside (``NAME.replaced``) before the new one is renamed into place, and deleted only then.
A crash between the two renames leaves the old copy aside and no ``NAME``: ``recover_replaced``
puts it back (called where state is read again: a run's pre-flight, the Tinker server's start).

It also survives a power cut: every file and directory of the new copy is synced to disk before
its rename, and the parent directory (the renames) after, so a record written once
``publish_directory`` returns (the Tinker server's checkpoint row, synced by SQLite) never points
at a copy whose files the disk had not yet written.
"""

from __future__ import annotations

import os
import shutil

REPLACED = ".replaced"


def publish_directory(tmp: str, directory: str) -> None:
    """Make the finished directory ``tmp`` be ``directory``, replacing any old copy."""
    aside = directory + REPLACED
    sync_tree(tmp)
    shutil.rmtree(aside, ignore_errors=True)
    if os.path.exists(directory):
        os.replace(directory, aside)
    os.replace(tmp, directory)
    _fsync(os.path.dirname(os.path.abspath(directory)), directory=True)
    shutil.rmtree(aside, ignore_errors=True)


def sync_tree(top: str) -> None:
    """fsync every file under ``top`` and then every directory (its entries), deepest first."""
    for root, _, files in os.walk(top, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                _fsync(path)
        _fsync(root, directory=True)


def _fsync(path: str, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover_replaced(directory: str, aside: str | None = None) -> str | None:
    """Undo what a crash inside ``publish_directory`` left at ``aside`` (default ``directory +
    REPLACED``): the old copy put back when ``directory`` is missing ("restored"), deleted when the
    new one is in place ("removed"); None when there is nothing aside."""
    aside = aside if aside is not None else directory + REPLACED
    if not os.path.isdir(aside) or os.path.islink(aside):
        return None
    if os.path.exists(directory):
        shutil.rmtree(aside, ignore_errors=True)
        return "removed"
    os.replace(aside, directory)
    return "restored"
