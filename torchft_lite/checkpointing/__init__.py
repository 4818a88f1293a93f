"""Live checkpoint transfer between replica groups (torchft's ``checkpointing`` package)."""

from torchft_lite.checkpointing.http_transport import HTTPTransport
from torchft_lite.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport"]
