"""What two replicas' headers for the same step declare differently, in a few words.

Striping receivers log it when a secondary's header differs from the
primary's (``_http_receive``).
"""

from __future__ import annotations

from typing import Any

from torchft_lite.serialization.spec import (
    PREFIX_SIZE, Header, Path, decode_key, decode_tree, format_path, parse_header, unpack_prefix,
)
from torchft_lite.errors import CheckpointTransferError

__all__ = ["encoded_header_difference", "header_difference"]


def encoded_header_difference(header: Header, header_bytes: bytes, raw: bytes) -> str | None:
    """None when ``raw`` (another source's prefix and header) equals ``header_bytes``; else what differs, in words.

    ``header`` is ``header_bytes`` validated: the primary's, which a striped heal takes.
    """
    if raw == header_bytes:
        return None
    try:
        length, crc = unpack_prefix(raw[:PREFIX_SIZE])
        if len(raw) != PREFIX_SIZE + length:
            raise CheckpointTransferError(f"a {length}-byte header declared, {len(raw) - PREFIX_SIZE} sent")
        return header_difference(header, parse_header(raw[PREFIX_SIZE:], crc))
    except CheckpointTransferError as exc:
        return f"the second sent an unusable header: {exc}"


def header_difference(first: Header, other: Header) -> str:
    """What ``other`` declares differently from ``first``, in a few words for an error message.

    Two replicas that serve the same step should send byte-identical headers;
    when they do not, this says where they part: the step, the block size, the
    first tensor whose path, dtype or shape differs, or the first non-tensor
    value that differs (an optimizer's ``lr``, say).
    """
    if first.step != other.step:
        return f"step {first.step} vs step {other.step}"
    if first.blocks.block_bytes != other.blocks.block_bytes:
        return f"checksum blocks of {first.blocks.block_bytes} vs {other.blocks.block_bytes} bytes"
    for index in range(max(len(first.entries), len(other.entries))):
        if index >= len(first.entries) or index >= len(other.entries):
            extra = first if index < len(first.entries) else other
            return (f"structure: {len(first.entries)} vs {len(other.entries)} tensors (tensor "
                    f"{format_path(extra.paths[index])} is only in one)")
        mine, theirs = first.entries[index], other.entries[index]
        if first.paths[index] != other.paths[index]:
            return f"structure: tensor {index} is {format_path(first.paths[index])} vs " \
                   f"{format_path(other.paths[index])}"
        if (mine.dtype, mine.shape) != (theirs.dtype, theirs.shape):
            return f"structure: tensor {format_path(first.paths[index])} is {mine.dtype}{list(mine.shape)} vs " \
                   f"{theirs.dtype}{list(theirs.shape)}"
    return _node_difference(first.tree, other.tree, ()) or "the header bytes (same contents, encoded differently)"


def _node_difference(mine: Any, theirs: Any, path: Path) -> str | None:
    """The first place two validated trees differ, or None (raw JSON nodes: a NaN equals itself here)."""
    if mine == theirs:
        return None
    (tag, value), (their_tag, their_value) = mine, theirs
    if tag == their_tag == "dict":
        keys = [decode_key(key, path) for key, _ in value]
        if keys != [decode_key(key, path) for key, _ in their_value]:
            return f"structure: the keys at {format_path(path)} differ"
        pairs = zip(keys, value, their_value)
        children = ((path + (key,), a, b) for key, (_, a), (_, b) in pairs)
    elif tag == their_tag and tag in ("list", "tuple"):
        if len(value) != len(their_value):
            return f"structure: {len(value)} vs {len(their_value)} items at {format_path(path)}"
        children = ((path + (i,), a, b) for i, (a, b) in enumerate(zip(value, their_value)))
    else:
        return f"value at {format_path(path)}: {_shown(mine, path)} vs {_shown(theirs, path)}"
    for child_path, a, b in children:
        found = _node_difference(a, b, child_path)
        if found is not None:
            return found
    return None


def _shown(node: Any, path: Path) -> str:
    def leaf(index: int, _: Path, layout: Any = None) -> str:
        if layout is None:
            return f"<tensor {index}>"
        placements = ",".join(":".join(str(part) for part in placement) for placement in layout.placements)
        return f"<DTensor {list(layout.shape)} ({placements}) on {layout.mesh.device_type} mesh " \
               f"{list(layout.mesh.shape)}>"

    text = repr(decode_tree(node, path, leaf))
    return text if len(text) <= 90 else text[:87] + "..."
