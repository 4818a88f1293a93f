"""The layer the lighthouse and the trainers both sit on: the RPC kit, the wire protocol, the lighthouse client.

The lighthouse (``lighthouse.server``) and the ManagerServer serve and call gRPC with the same parts, so they
live here, below both, importing nothing of either (no quorum rules, no lighthouse config, no torch):
``protocol`` (generated from ``proto/torchft.proto``), ``lighthouse_client``, the small h2c gRPC server
``h2grpc`` that ``engines`` serves a service on (or grpc.aio) within ``limits``, the guards ``access``,
``refusals`` and ``tls``, and the plumbing ``channel``, ``broadcast``, ``addresses``, ``sites`` and ``loop``
(the uvloop control plane). Import the submodules: this package imports none of them, so a trainer that
needs only the event loop does not load the server engine.
"""
