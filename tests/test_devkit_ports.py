"""``devkit.processes.quiet_port``: a port a slow child binds later, which no outgoing connection
can take meanwhile (the e2e suite's vLLM ports)."""

from __future__ import annotations

import socket
from pathlib import Path

from devkit.processes import quiet_port


def test_quiet_ports_are_free_distinct_and_outside_the_ephemeral_range() -> None:
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [quiet_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert all(port < ephemeral_low for port in ports)
    for port in ports:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))
