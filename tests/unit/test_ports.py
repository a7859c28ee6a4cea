"""The one free-port helper (e2v/runtime/ports.py) that the single-process start, the port-in-use
message, the launch commands, bench/ and the Makefile share: a port free on every interface, never
handed out twice in a process."""

from __future__ import annotations

import os
import socket

from e2v.runtime.ports import free_port


def test_ports_are_free_on_every_interface_and_never_repeat():
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    for port in ports[:5]:  # free now: a listener can take it on all interfaces, loopback included
        with socket.socket() as s:
            s.bind(("", port))
            s.listen()


def test_single_process_start_takes_a_free_port_unless_one_is_given(monkeypatch):
    from e2v.runtime.distributed import single_process_env

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so the test's own settings are undone after it
        monkeypatch.delenv(k)
    assert single_process_env()
    port = int(os.environ["MASTER_PORT"])
    with socket.socket() as s:
        s.bind(("", port))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("MASTER_PORT", "29777")
    assert single_process_env() and os.environ["MASTER_PORT"] == "29777"

