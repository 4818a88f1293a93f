"""The layer the lighthouse and the trainers both sit on: the RPC kit, the wire protocol, the lighthouse client.

The lighthouse (``lighthouse.server``) and torchft_lite's ManagerServer serve
and call gRPC with the same parts; they live here, below both, and import
nothing of either (no quorum rules, no lighthouse config, no torch; importing
``torchft_lite`` itself loads nothing, its names resolve lazily):

* ``protocol``: the code generated from ``proto/torchft.proto`` (torchft's messages and services).
* ``lighthouse_client``: ``LighthouseClient``, the client of the LighthouseService.

* ``h2grpc``: the small h2c gRPC server (``GrpcServer``), ``RpcAbort`` and
  ``RpcContext``, and the HTTP/2 framing under them.
* ``engines``: a service as plain handler functions, served by ``h2grpc`` or
  by grpc.aio.
* ``limits``: ``ServerLimits``, the flood limits both engines hold peers to.
* ``channel``: ``UnaryChannel``, the client side's lazily opened channel.
* ``tls``: ``TlsSettings``, the optional TLS of every server and client of a job.
* ``broadcast``: ``Broadcast``, items fanned out to every open server stream.
* ``addresses``: ``HOST:PORT`` parsing, gRPC targets, dual-stack listening sockets.
* ``sites``: an aiohttp site on a ``HOST:PORT``.
* ``loop``: ``new_event_loop``, the uvloop loop every control-plane thread runs, and a trainer's
  ``ControlPlane`` thread.

Import the submodules: this package imports none of them, so a trainer that
needs only the event loop does not load the server engine.
"""
