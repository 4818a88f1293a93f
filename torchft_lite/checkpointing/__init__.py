"""Live checkpoint transfer between replica groups (torchft's ``checkpointing`` package).

:class:`CheckpointTransport` (``transport.py``) is the interface the Manager heals
through. :class:`HTTPTransport` (``http_transport.py``) serves a state dict from
its checkpoint server (``_http_server``, ``_http_snapshot``, ``_http_socket``) and receives one
with a ``_http_receive.Receiver`` (``_http_client``, ``_body_sinks``,
``_streams``); ``PGTransport`` (``pg_transport.py``) sends
the same bytes over a process group. ``_rwlock.RWLock`` is the Manager's state-dict
lock (torchft's ``allow``/``disallow_state_dict_read``). The format they carry, and how received
bytes reach tensors, is :mod:`torchft_lite.serialization`'s.
"""

from torchft_lite.checkpointing.http_transport import HTTPTransport
from torchft_lite.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport"]
