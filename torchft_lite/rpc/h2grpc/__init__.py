"""A minimal gRPC-over-HTTP/2 (h2c) server, the RPC kit's engine; see server.py for why."""

from torchft_lite.rpc.h2grpc.server import GrpcServer, RpcAbort, RpcContext

__all__ = ["GrpcServer", "RpcAbort", "RpcContext"]
