"""Address parsing shared by the lighthouse and the trainers' servers.

Its own module so that a trainer (the ManagerServer) can parse a bind address
without loading the lighthouse's configuration and quorum rules.
"""

from __future__ import annotations


def split_host_port(address: str) -> tuple[str, int]:
    """'[::]:29510' -> ('::', 29510); 'localhost:0' -> ('localhost', 0)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port_number = int(port)
    except ValueError:
        raise ValueError(f"port must be a number in {address!r}") from None
    if not 0 <= port_number <= 65535:
        raise ValueError(f"port out of range in {address!r}")
    return host, port_number
