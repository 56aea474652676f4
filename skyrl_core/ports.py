"""Loopback ports for rendezvous and servers, and the race that comes with choosing one.

``free_port`` asks the kernel for a port nobody holds *now*; the process that binds it does so
later (a rank's store, a server's socket), and in between any other process on the machine may take
the same port (two test workers, two runs). ``on_a_free_port`` closes that window the only way a
chooser can: when the binding side reports the address in use, it starts again on a new port.
"""

from __future__ import annotations

import socket
from typing import Callable, TypeVar

T = TypeVar("T")

ATTEMPTS = 3


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket holds at this moment."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def address_in_use(error: BaseException) -> bool:
    """Whether ``error`` (or its message, as Ray and subprocess logs pass it on) says that a port was
    already bound: ``EADDRINUSE`` from torch's TCPStore, "Address already in use" from a socket."""
    if isinstance(error, OSError) and error.errno == 98:
        return True
    text = str(error)
    return "EADDRINUSE" in text or "ddress already in use" in text


def on_a_free_port(start: Callable[[int], T], *, attempts: int = ATTEMPTS) -> T:
    """``start(port)`` on a ``free_port``; on an address-in-use failure (another process took the
    port first), again on another port, ``attempts`` times in all. ``start`` must clean up what it
    began before raising (kill its ranks, stop its server). Any other error is raised at once."""
    for attempt in range(1, attempts + 1):
        try:
            return start(free_port())
        except Exception as exc:
            if attempt == attempts or not address_in_use(exc):
                raise
    raise AssertionError("unreachable")
