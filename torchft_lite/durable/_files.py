"""One state dict in one file, in the heal format, written atomically and read back verified.

A file holds exactly one encoding of ``torchft_lite.serialization.spec``
(prefix, JSON header, raw tensor bytes, one sum64 per block), so a durable
checkpoint is checked the way a heal is: the header's crc32 before anything
is allocated, then every block's sum. The manifest (``_layout``) also keeps
each file's size and a digest of its header and block sums, which ties the
manifest to the very bytes that were written.

Writes go to ``NAME.tmp``, are fsynced, then renamed over ``NAME``: a reader
sees the whole file or none of it. Reads land straight in the destination
tensors (``readinto``), nothing is unpickled.
"""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping

import torch

from torchft_lite.errors import CheckpointError, DurableCheckpointError
from torchft_lite.serialization.decode import TensorWriter
from torchft_lite.serialization.encode import FlatStateDict, encode
from torchft_lite.serialization.spec import PREFIX_SIZE, parse_header, unpack_prefix

__all__ = ["FileRecord", "fsync_directory", "read_state_file", "write_bytes_atomically", "write_state_file"]

_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileRecord:
    """What the manifest says of one file."""

    name: str
    bytes: int
    digest: str
    """blake2b of the file's prefix, header and block sums: every data byte is covered by its block's sum."""

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "digest": self.digest}

    @classmethod
    def from_json(cls, name: str, raw: Any) -> "FileRecord":
        if not isinstance(raw, dict) or type(raw.get("bytes")) is not int or not isinstance(raw.get("digest"), str):
            raise DurableCheckpointError(f"manifest entry for {name!r} is malformed: {str(raw)[:80]}")
        return cls(name, raw["bytes"], raw["digest"])


def _digest(header: bytes, trailer: bytes) -> str:
    return hashlib.blake2b(header + trailer, digest_size=16).hexdigest()


def describe_os_error(exc: OSError, what: str) -> str:
    """A sentence for the log, naming a full disk plainly."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{what}: the disk is full ({exc.strerror})"
    return f"{what}: {exc}"


def write_state_file(path: Path, step: int, flat: FlatStateDict) -> FileRecord:
    """Write ``flat`` (CPU tensors the caller leaves alone meanwhile) as ``path``, atomically."""
    encoded = encode(step, flat)
    trailer = b""

    def write(file: BinaryIO) -> None:
        nonlocal trailer
        file.write(encoded.header)
        pieces, _ = encoded.body()
        for piece in pieces:
            if isinstance(piece, bytes):  # the block sums come last, as bytes
                trailer = piece
            file.write(piece)

    try:
        _write_atomically(path, write)
    finally:
        encoded.release()
    return FileRecord(path.name, len(encoded.header) + encoded.data_bytes + len(trailer),
                      _digest(encoded.header, trailer))


def read_state_file(path: Path, expected: FileRecord | None = None,
                    meshes_from: Mapping[Any, torch.Tensor] | None = None) -> tuple[int, Any]:
    """``(step, state dict)`` from ``path``, every byte checked; ``DurableCheckpointError`` names what is wrong.

    The tensors are fresh (the live state is untouched until the caller loads it); a DTensor is rebuilt on the
    mesh of a DTensor of ``meshes_from`` (the live state's tensors by path) with the same layout, when one has it.
    """
    try:
        size = path.stat().st_size
        if expected is not None and size != expected.bytes:
            raise DurableCheckpointError(f"{path} is {size} bytes, the manifest says {expected.bytes} (truncated?)")
        with open(path, "rb") as file:
            prefix = file.read(PREFIX_SIZE)
            length, crc = unpack_prefix(prefix)
            header_json = file.read(length)
            if len(header_json) != length:
                raise DurableCheckpointError(f"{path} is truncated inside its {length}-byte header")
            header = parse_header(header_json, crc, following=size - PREFIX_SIZE - length)
            writer = TensorWriter(header)
            position = 0
            while position < header.data_bytes:
                view = writer.buffer_at(position, min(header.data_bytes, position + _READ_CHUNK))
                count = file.readinto(view)
                if not count:
                    raise DurableCheckpointError(f"{path} is truncated at data byte {position}")
                writer.filled(position, count)
                position += count
            trailer = file.read(header.trailer_bytes)
            writer.expect(0, header.data_bytes, trailer)
            state = writer.finish(meshes_from)
    except DurableCheckpointError:
        raise
    except OSError as exc:
        raise DurableCheckpointError(f"reading {path}: {exc}") from exc
    except CheckpointError as exc:  # the format's own checks: bad header, checksum mismatch, truncation
        raise DurableCheckpointError(f"{path}: {exc}") from exc
    if expected is not None and _digest(prefix + header_json, trailer) != expected.digest:
        raise DurableCheckpointError(f"{path} does not match its manifest (digest differs): replaced or corrupt")
    return header.step, state


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """``data`` as ``path``: temp name, fsync, rename. Raises ``DurableCheckpointError``."""
    _write_atomically(path, lambda file: file.write(data))


def _write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(file)`` into ``NAME.tmp``, fsync, rename over ``path``; an OSError (a full disk) is named."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        _remove_quietly(tmp)
        raise DurableCheckpointError(describe_os_error(exc, f"writing {path}")) from exc


def fsync_directory(path: Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError:
        pass  # a leftover .tmp is cleaned up by the next prune
