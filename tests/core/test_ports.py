"""A port chosen free can be taken before it is bound: ``on_a_free_port`` starts again on another
one, and only for that failure."""

from __future__ import annotations

import errno
import socket

import pytest

from skyrl_core.ports import address_in_use, free_port, on_a_free_port


def test_a_taken_port_is_retried_on_another_and_other_errors_are_not():
    tried: list[int] = []
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]

    def bind(port: int) -> int:
        tried.append(port)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", taken if len(tried) == 1 else port))  # the first one: someone got it first
            return sock.getsockname()[1]

    try:
        got = on_a_free_port(bind)
    finally:
        holder.close()
    assert len(tried) == 2 and got == tried[1] != taken

    calls = []

    def broken(port: int) -> None:
        calls.append(port)
        raise ValueError("not a port problem")

    with pytest.raises(ValueError, match="not a port problem"):
        on_a_free_port(broken)
    assert len(calls) == 1  # no retry for other errors


def test_it_gives_up_after_the_attempts_with_the_last_error():
    calls = []

    def always_taken(port: int) -> None:
        calls.append(port)
        raise RuntimeError(f"rank 0: DistNetworkError: port: {port}, code: -98, name: EADDRINUSE")

    with pytest.raises(RuntimeError, match="EADDRINUSE"):
        on_a_free_port(always_taken, attempts=3)
    assert len(calls) == 3


def test_address_in_use_reads_the_errno_and_the_messages_ray_and_logs_pass_on():
    assert address_in_use(OSError(errno.EADDRINUSE, "Address already in use"))
    assert address_in_use(RuntimeError("uvicorn: [Errno 98] error while attempting to bind: address already in use"))
    assert address_in_use(RuntimeError("The server socket has failed to listen ... name: EADDRINUSE"))
    assert not address_in_use(OSError(errno.ECONNREFUSED, "Connection refused"))
    assert not address_in_use(TimeoutError("ranks did not answer"))
    assert 0 < free_port() < 65536
