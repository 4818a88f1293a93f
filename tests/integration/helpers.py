"""Helpers shared by the integration tests (fixtures are in conftest.py next to this file).

Plain functions and classes, imported by the test modules (and by the processes some of them spawn): nothing
here starts anything at import time, and torch is imported only by the helpers that use it, so the
lighthouse's tests stay free of it.
"""

from __future__ import annotations

import hashlib

from lighthouse.client import LighthouseClient
from lighthouse.server import LighthouseServer
from tests.conftest import WAIT


def client_for(server: LighthouseServer) -> LighthouseClient:
    """A gRPC client of ``server`` (in this process, on 127.0.0.1) that waits up to WAIT to connect."""
    return LighthouseClient(f"127.0.0.1:{server.grpc_port}", connect_timeout=WAIT)


# ---------------------------------------------------------------- checkpoints: what was sent, what arrived


def digest(step: int, state) -> str:
    """Of the whole encoding of ``state`` as ``step``: every tensor's bytes, dtype and shape, and every
    non-tensor leaf."""
    from torchft_lite.checkpointing import _encode

    return hashlib.sha256(_encode.encode_to_bytes(step, state)).hexdigest()


def same_encoding(received, sent, step: int = 5) -> bool:
    """Whether ``received`` and ``sent`` encode to the same bytes as ``step``."""
    from torchft_lite.checkpointing import _encode

    return _encode.encode_to_bytes(step, received) == _encode.encode_to_bytes(step, sent)


def tensor_digest(tensor) -> str:
    """Of one tensor's bytes (a DTensor: pass its local shard, or ``full_tensor()``), 16 hex digits."""
    from torchft_lite.checkpointing._format import byte_view

    return hashlib.sha256(byte_view(tensor.detach().contiguous())).hexdigest()[:16]


def shard_digests(state: dict) -> dict[str, str]:
    """This rank's local tensors of ``state`` (a DTensor's shard) by path, each hashed by ``tensor_digest``."""
    from torchft_lite.checkpointing._encode import flatten
    from torchft_lite.checkpointing._format import format_path

    flat = flatten(state)
    return {format_path(path): tensor_digest(tensor) for path, tensor in zip(flat.paths, flat.tensors)}
