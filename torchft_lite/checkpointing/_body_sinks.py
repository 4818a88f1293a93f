"""Where the bodies of a heal's answers go: sinks the HTTP client (``_http_client``) reads straight into.

A sink hands out writable views (``buffer()``) and is told how many bytes
landed there (``filled(count)``); it may raise to refuse an answer, which
aborts its connection.

* :class:`EncodedSink`: a whole encoding (or, for a striped heal, the
  primary's prefix and header alone): it validates the header as soon as it
  is in, then hands the data to a ``TensorWriter`` (``serialization.decode``), which lands
  bytes meant for GPU tensors through a ring of pinned slots (``serialization.staging``);
* :class:`DataSink`: a block-aligned data range and its blocks' sums, into
  the ``TensorWriter`` a striped heal shares between its streams;
* :class:`BytesSink`: a small answer (another replica's header, the
  primary's checksums) collected whole.
"""

from __future__ import annotations

from typing import Any

from torchft_lite.errors import CheckpointTransferError
from torchft_lite.serialization.decode import TensorWriter
from torchft_lite.serialization.spec import PREFIX_SIZE, Path, parse_header, unpack_prefix
from torchft_lite.serialization.staging import Stager

__all__ = ["BytesSink", "DataSink", "EncodedSink"]


class BytesSink:
    """A small body (a header, a list of checksums) collected whole into memory."""

    def __init__(self, length: int) -> None:
        self.data = bytearray(length)
        self._count = 0

    def buffer(self) -> memoryview:
        return memoryview(self.data)[self._count:]

    def filled(self, count: int) -> None:
        self._count += count


class DataSink:
    """Data bytes ``[start, end)`` of a response body, straight into the writer's tensors, then their checksums."""

    def __init__(self, writer: TensorWriter, start: int, end: int) -> None:
        self._writer = writer
        self._start = start
        self._position = start
        self._end = end
        self._trailer = memoryview(bytearray(writer.expected_trailer_bytes(start, end)))
        self._got = 0

    @property
    def length(self) -> int:
        """The body's length: the data range and its blocks' checksums."""
        return self._end - self._start + len(self._trailer)

    @property
    def received(self) -> int:
        """Body bytes received so far (data, then checksums): how far a striping receiver's stream has got."""
        return self._position - self._start + self._got

    def buffer(self) -> memoryview:
        if self._position < self._end:
            return self._writer.buffer_at(self._position, self._end)
        return self._trailer[self._got:]

    def filled(self, count: int) -> None:
        if self._position < self._end:
            self._writer.filled(self._position, count)
            self._position += count
            return
        self._got += count
        if self._got == len(self._trailer):
            self._writer.expect(self._start, self._end, self._trailer)


class EncodedSink:
    """Prefix, header and (unless ``header_only``) data and checksums of one state dict, as a body of ``length``.

    ``stager``: where the bytes of the targets it takes land (``serialization.staging``: GPU targets, through pinned slots).

    ``header_only`` None: whichever the body holds, the header alone or the
    whole encoding (a source that serves no separate header sends it all);
    :attr:`whole` then says which it was.
    """

    def __init__(self, url: str, step: int, length: int, targets: dict[Path, Any], *,
                 header_only: bool | None, stager: Stager | None = None) -> None:
        if length < PREFIX_SIZE:
            raise CheckpointTransferError(f"checkpoint truncated: {url} sent a {length}-byte answer")
        self._url, self._step, self._length, self._header_only = url, step, length, header_only
        self._targets, self._stager = targets, stager
        self._pending = memoryview(bytearray(PREFIX_SIZE))
        self._got = 0
        self._prefix = b""
        self._crc: int | None = None
        self._data: DataSink | None = None
        self.writer: TensorWriter | None = None
        self.header_bytes = b""
        """The prefix and header as received: a striped heal compares its other sources' headers with them."""

    def buffer(self) -> memoryview:
        if self._data is not None:
            return self._data.buffer()
        return self._pending[self._got:]

    def filled(self, count: int) -> None:
        if self._data is not None:
            self._data.filled(count)
            return
        self._got += count
        if self._got < len(self._pending):
            return
        if self._crc is None:
            self._prefix = bytes(self._pending)
            length, self._crc = unpack_prefix(self._prefix)
            self._pending, self._got = memoryview(bytearray(length)), 0
            if length:
                return
        header_end = PREFIX_SIZE + len(self._pending)
        if self._header_only is None:
            self._header_only = self._length == header_end
        if self._header_only and self._length != header_end:
            raise CheckpointTransferError(f"{self._url} sent {self._length - header_end} bytes after the header")
        header_json = bytes(self._pending)
        header = parse_header(header_json, self._crc,
                                   following=None if self._header_only else self._length - header_end)
        if header.step != self._step:
            raise CheckpointTransferError(f"{self._url} sent step {header.step}, expected step {self._step}")
        self.header_bytes = self._prefix + header_json
        self.writer = TensorWriter(header, self._targets, self._stager)
        if header.data_bytes and not self._header_only:
            self._data = DataSink(self.writer, 0, header.data_bytes)

    @property
    def whole(self) -> bool:
        """Whether the body held the whole encoding (known once the header is in)."""
        return self._header_only is False

    def complete_writer(self) -> TensorWriter:
        """The tensor writer, once the body has ended; the header must have been whole."""
        if self.writer is None:
            raise CheckpointTransferError(f"checkpoint truncated: {self._url} ended inside the header")
        return self.writer
