"""A minimal gRPC-over-HTTP/2 (h2c) server for the lighthouse; see server.py for why."""

from lighthouse.h2grpc.server import GrpcServer, RpcAbort, RpcContext

__all__ = ["GrpcServer", "RpcAbort", "RpcContext"]
