"""Free TCP ports for a rendezvous, one home for every caller: the single-process start
(e2v/runtime/distributed.py), the message for a port in use, the launcher commands of the harness
and the tests (e2v/runtime/launch.py), bench/, and the Makefile's MASTER_PORT."""

from __future__ import annotations

import socket

_given: set[int] = set()


def free_port() -> int:
    """A port free on every interface now, never one handed out before in this process. Every
    interface (""), not 127.0.0.1 alone: the rendezvous store listens on all of them, and a port
    free on loopback can be held on another address. Never twice: launches started side by side
    bind theirs only seconds later."""
    while True:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port
