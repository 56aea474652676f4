"""Replacing a directory so that a crash at any moment leaves one whole copy on disk.

The new copy is written elsewhere first (a temporary directory beside the target). An old copy is
renamed aside (``NAME.replaced``) before the new one is renamed into place, and deleted only then.
A crash between the two renames leaves the old copy aside and no ``NAME``: ``recover_replaced``
puts it back (called where state is read again: a run's pre-flight, the Tinker server's start).
"""

from __future__ import annotations

import os
import shutil

REPLACED = ".replaced"


def publish_directory(tmp: str, directory: str) -> None:
    """Make the finished directory ``tmp`` be ``directory``, replacing any old copy."""
    aside = directory + REPLACED
    shutil.rmtree(aside, ignore_errors=True)
    if os.path.exists(directory):
        os.replace(directory, aside)
    os.replace(tmp, directory)
    shutil.rmtree(aside, ignore_errors=True)


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
