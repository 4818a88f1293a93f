"""Live checkpoint transfer between replica groups (torchft's ``checkpointing`` package).

Where things live::

    transport.py           CheckpointTransport: the interface the Manager heals through
    http_transport.py      HTTPTransport: the training thread's API; serving and receiving run on the control plane
    _http_server.py        CheckpointServer: access, routes, held requests, receiver sessions, publish and release
    _http_snapshot.py      Snapshot (one published step, encoded on first request) and Session (one receiver)
    _http_socket.py        the checkpoint server's socket: where it listens, send buffers, flushing
    _http_receive.py       Receiver: one heal, from one source or striped over several (the first is the truth)
    _http_client.py        the heal's HTTP client: response bodies land straight in tensor memory
    _streams.py            how many streams a receive takes by default: the data's size, the source's advertisement
    _body_sinks.py         where those bodies go: a whole encoding, a data range, a small answer
    pg_transport.py        PGTransport: the same format over a process group's send/recv
    _format.py             the heal format: layout, limits, header validation (Header, Blocks)
    _encode.py             sending: flatten (validate, describe), encode (read to host), body (bytes + sums)
    _decode.py             receiving: TensorWriter (bytes into tensors, checked), decode_bytes, targets_of
    _prefault.py           fresh destination pages populated in bulk, on two threads ahead of the socket's writes
    _header_difference.py  what two replicas' headers for one step declare differently
    _checksum.py           sum64 block checksums
    _dtensor.py            DTensors: the local shard travels, its layout rides in the header
    _cuda.py               GPU tensors to and from host memory on the recovery stream
    _staging.py            a receive into GPU tensors: a small ring of pinned slots, copied out as the socket is read
    http_transport_bench.py  torchft's http_transport_bench, same flags, to run the two side by side
    _rwlock.py             RWLock: the Manager's state-dict lock (torchft's allow/disallow_state_dict_read)

A heal over HTTP: the healthy replica's ``send_checkpoint`` flattens its
state dict (``_encode.flatten``) and publishes it on its CheckpointServer;
the replica behind calls ``recv_checkpoint``, whose Receiver GETs the
encoding through ``_http_client``; the first bytes are the header, which
``_format.parse_header`` validates before anything is allocated; a
``_decode.TensorWriter`` then takes the data straight into the receiver's
tensors, checks every block's sum, and builds the state dict. The server
counts the receiver finished once every data byte is out (or on its ``done``
POST), and its ``disallow_checkpoint`` returns.
"""

from torchft_lite.checkpointing.http_transport import HTTPTransport
from torchft_lite.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport"]
