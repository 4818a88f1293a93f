"""How many concurrent streams a receive uses when the caller did not say: from the size, and the sender's word.

A receive whose ``num_chunks`` was left unset first asks the source for the
header alone. That answer carries the data's size and, in the
``X-Checkpoint-Streams`` response header, how many concurrent range
requests the source serves for one receiver. The data then comes as
:func:`streams_for` of them: one per ``BYTES_PER_STREAM`` of data, at least
one, at most what the source advertises. Small state dicts keep one stream
(another connection costs a round trip and its socket buffers, for nothing
the heal would notice); large ones are split, so that one TCP flow's window,
one NIC queue or one receiving core does not bound the whole heal on a real
network. A source that advertises nothing (an older one) gets one stream;
one that serves no header at all is read whole, in one request (``_http_receive``).
"""

from __future__ import annotations

import os
from typing import Mapping

__all__ = ["ADVERTISE_HEADER", "BYTES_PER_STREAM", "CPUS_PER_STREAM", "MAX_STREAMS", "SERVED_STREAMS", "advertised",
           "streams_for", "usable_cpus"]

ADVERTISE_HEADER = "X-Checkpoint-Streams"
SERVED_STREAMS = 4
"""What our checkpoint server advertises: a receiver's connections each hold a socket and kernel buffers
of several MiB on both sides, and past four on loopback they bought nothing measurable."""
BYTES_PER_STREAM = 256 << 20
MAX_STREAMS = 16
"""Whatever a source advertises, a receiver opens no more than this many connections to it."""
CPUS_PER_STREAM = 2
"""A receive opens at most one stream per this many usable CPUs (one stream below four)."""


def advertised(headers: Mapping[str, str]) -> int:
    """The streams a source's answer advertises (response headers with lower-case names); 1 when it says nothing usable."""
    value = headers.get(ADVERTISE_HEADER.lower(), "").strip()
    if not value.isdigit():
        return 1
    return max(1, min(int(value), MAX_STREAMS))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def streams_for(data_bytes: int, advertised_streams: int, cpus: int | None = None) -> int:
    """How many data ranges to fetch at once for ``data_bytes`` from a source that serves ``advertised_streams``,
    on ``cpus`` usable CPUs (default: :func:`usable_cpus`)."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, min(data_bytes // BYTES_PER_STREAM, advertised_streams, MAX_STREAMS, cpus // CPUS_PER_STREAM))
