"""Store addresses (``host:port/prefix``) and the TCPStore client a configure() rendezvouses on."""

from __future__ import annotations

import concurrent.futures
import ipaddress
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, TypeVar

import torch.distributed as dist

from torchft_lite.errors import ConfigError

from .tracked_work import translate_error

__all__ = ["StoreAddress", "connect_store", "parse_store_addr"]

T = TypeVar("T")


@dataclass(frozen=True)
class StoreAddress:
    """Where a process group rendezvouses: a TCPStore and a key prefix on it."""

    host: str
    """Hostname, IPv4 address or IPv6 address (without brackets)."""
    port: int
    """The TCPStore's port."""
    prefix: str
    """Key prefix unique to one configuration, e.g. ``torchft/<quorum_id>/0``."""

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}/{self.prefix}"


def parse_store_addr(store_addr: str) -> StoreAddress:
    """Parse ``host:port/prefix``; raise :class:`ConfigError` naming what is wrong.

    The host may be a hostname, an IPv4 address, or an IPv6 address -- in
    brackets (``[::1]:1234/p``) or bare, in which case the port is what follows
    the last colon (``::1:1234/p``, as torchft reads it). The prefix is
    everything after the first ``/`` and must not be empty: a group that
    rendezvoused without one would share keys with every other quorum.
    """
    if not isinstance(store_addr, str):
        raise ConfigError(f"store address must be a str 'host:port/prefix', got {type(store_addr).__name__}")
    if any(c.isspace() for c in store_addr):
        raise ConfigError(f"store address {store_addr!r} contains whitespace")
    location, slash, prefix = store_addr.partition("/")
    if not slash or not prefix.strip("/"):
        raise ConfigError(f"store address {store_addr!r} has no prefix: expected 'host:port/prefix'")
    if location.startswith("["):
        host, bracket, rest = location[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise ConfigError(f"store address {store_addr!r}: expected '[ipv6]:port/prefix'")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise ConfigError(f"store address {store_addr!r}: {host!r} is not an IPv6 address") from exc
    else:
        host, colon, port_text = location.rpartition(":")
        if not colon:
            raise ConfigError(f"store address {store_addr!r} has no port: expected 'host:port/prefix'")
        if "[" in host or "]" in host:
            raise ConfigError(f"store address {store_addr!r}: unbalanced brackets around the host")
    if not host:
        raise ConfigError(f"store address {store_addr!r} has no host")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"store address {store_addr!r}: port must be an integer in 1..65535, got {port_text!r}")
    return StoreAddress(host=host, port=int(port_text), prefix=prefix)


def connect_store(address: StoreAddress, timeout: timedelta) -> dist.Store:
    """Connect a client to the TCPStore at ``address``, scoped to its prefix.

    The store must already exist (the Manager of replica rank 0 hosts it);
    connecting is bounded by ``timeout``. c10d's client alone is not: it retries
    a refused connection until its deadline, then, after a random backoff,
    tries again with the whole timeout afresh (a store whose host died cost a
    10 s rendezvous 26 s in the chaos run, longer than the group's commit vote
    waits for that rank). So the connection is made on a helper thread and
    waited for at most ``timeout``; one that comes later is dropped.
    """
    what = f"connecting to the store at {address.host}:{address.port}"
    try:
        store = _within(timeout.total_seconds(), lambda: dist.TCPStore(
            address.host, address.port, is_master=False, wait_for_workers=False, timeout=timeout))
    except concurrent.futures.TimeoutError as exc:
        raise translate_error(TimeoutError(f"no connection within {timeout.total_seconds():g}s"), what,
                              timeout) from exc
    except Exception as exc:
        raise translate_error(exc, what, timeout) from exc
    return dist.PrefixStore(address.prefix, store)


def _within(seconds: float, make: Callable[[], T]) -> T:
    """``make()``, run on a daemon thread; raises ``TimeoutError`` if it takes longer than ``seconds`` (the
    thread then finishes on its own, and what it made is dropped)."""
    result: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            result.set_result(make())
        except BaseException as exc:  # noqa: BLE001 (handed to the waiting thread)
            result.set_exception(exc)

    threading.Thread(target=run, name="torchft-store-connect", daemon=True).start()
    return result.result(timeout=seconds)
