"""Whether the trainer of this process is computing right now.

In the async modes a colocated engine generates in threads beside the trainer, on the same cores.
A fixed split wastes them either way: generation at all the cores beside a training step makes two
thread teams time-slice the cores (each waits at every barrier for a thread that is not running);
generation at one thread leaves a core idle whenever the trainer waits (for groups, for the
generation a weight sync has to wait for). So the RL loop says when it computes, and an engine
that sizes its thread team per step (skyrl-torch's ``threads_beside_training``) asks before each.
Only this process's trainer counts: an engine in its own process never sees it.
"""

from __future__ import annotations

import threading

_computing = threading.Event()


def set_trainer_computing(computing: bool) -> None:
    """The RL loop: on from a batch's arrival to its weight sync, off otherwise (and at the end)."""
    if computing:
        _computing.set()
    else:
        _computing.clear()


def trainer_computing() -> bool:
    return _computing.is_set()
