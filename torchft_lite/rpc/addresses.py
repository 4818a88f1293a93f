"""Addresses, as both servers and their clients spell them.

Its own module so that a trainer (the ManagerServer) can parse a bind address
without loading the lighthouse's configuration and quorum rules.
"""

from __future__ import annotations

import socket


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


def grpc_target(address: str) -> str:
    """'http://host:port' (torchft's form) or 'host:port' -> a gRPC target."""
    for scheme in ("http://", "https://", "grpc://"):
        if address.startswith(scheme):
            return address[len(scheme):].rstrip("/")
    return address


def dual_stack_socket(port: int) -> socket.socket:
    """A listening-ready TCP socket on every interface: IPv6 with IPv4 mapped, else IPv4 only."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this host
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address: tuple = ("0.0.0.0", port)
    else:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address = ("::", port)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"could not bind [::]:{port}: {exc.strerror or exc}") from exc
    sock.setblocking(False)
    return sock
