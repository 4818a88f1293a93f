"""An asyncio client for a group's ``ManagerService`` (the ManagerServer).

Used on the control-plane loop by every rank of a replica group (to reach its
own group's ManagerServer) and by healing replicas (to ask a peer's
ManagerServer for its checkpoint metadata). gRPC errors become
:class:`~torchft_lite.errors.ManagerError` here, with the call and the address.
"""

from __future__ import annotations

import grpc

from torchft_lite.errors import (
    ManagerError, ManagerTimeout, QuorumError, QuorumTimeout, StateDivergedError,
)
from torchft_lite.rpc.access import Access
from torchft_lite.rpc.channel import UnaryChannel
from torchft_lite.rpc.protocol import torchft_pb2 as pb
from torchft_lite.rpc.tls import TlsSettings

__all__ = ["ManagerStub"]

SERVICE = "torchft.ManagerService"


class ManagerStub(UnaryChannel):
    """One gRPC channel to one ManagerServer, with its calls as coroutines. Create and use it on a single event
    loop. (Training code uses ``manager_client.ManagerClient``, torchft's blocking client, built on this.)"""

    service = SERVICE

    def __init__(self, address: str, *, access: Access | None = None, tls: TlsSettings | None = None) -> None:
        """``access``: the job token every call carries; None reads it from the environment (see UnaryChannel);
        ``tls``: whether the channel uses TLS, None: from the environment (the same)."""
        if not address:
            raise ValueError("ManagerServer address is empty")
        super().__init__(address, access=access, tls=tls)

    async def _invoke(self, method: str, request, response_cls, timeout: float, what: str,
                      error=ManagerError, timeout_error=ManagerTimeout):
        call = self._call(method, type(request), response_cls)
        try:
            # wait_for_ready: a server that is starting (rank 0 comes up after
            # the others) is waited for until the deadline instead of failing.
            return await call(request, timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                # torchft's words too ("status: Cancelled, message: Timeout expired"): scripts match on them.
                raise timeout_error(f"ManagerServer {self.address}: {what} got no answer within {timeout:.2f}s "
                                    f"(status: Cancelled, message: Timeout expired)") from exc
            name = code.name if code else "UNKNOWN"
            if error is QuorumError and (exc.details() or "").startswith(StateDivergedError.MARK):
                raise StateDivergedError(exc.details()) from exc
            raise error(f"ManagerServer {self.address}: {what} failed: {name}: {exc.details()}") from exc

    async def quorum(
        self,
        *,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        init_sync: bool,
        commit_failures: int,
        timeout: float,
        state_fingerprint: str = "",
        reconfigure_handle: str = "",
    ) -> pb.ManagerQuorumResponse:
        request = pb.ManagerQuorumRequest(
            group_rank=group_rank, step=step, checkpoint_metadata=checkpoint_metadata,
            shrink_only=shrink_only, init_sync=init_sync, commit_failures=commit_failures,
            state_fingerprint=state_fingerprint, reconfigure_handle=reconfigure_handle,
        )
        return await self._invoke(
            "Quorum", request, pb.ManagerQuorumResponse, timeout,
            f"Quorum for group rank {group_rank} at step {step}", QuorumError, QuorumTimeout,
        )

    async def checkpoint_metadata(self, rank: int, *, timeout: float) -> str:
        response = await self._invoke(
            "CheckpointMetadata", pb.CheckpointMetadataRequest(rank=rank), pb.CheckpointMetadataResponse,
            timeout, f"CheckpointMetadata for group rank {rank}",
        )
        return response.checkpoint_metadata

    async def should_commit(self, *, group_rank: int, step: int, should_commit: bool, timeout: float) -> bool:
        request = pb.ShouldCommitRequest(group_rank=group_rank, step=step, should_commit=should_commit)
        response = await self._invoke(
            "ShouldCommit", request, pb.ShouldCommitResponse, timeout,
            f"ShouldCommit for group rank {group_rank} at step {step}",
        )
        return response.should_commit

    async def kill(self, msg: str, *, timeout: float) -> None:
        await self._invoke("Kill", pb.KillRequest(msg=msg), pb.KillResponse, timeout, "Kill")

    def events(self, group_rank: int) -> grpc.aio.UnaryStreamCall:
        """The group's stream of lighthouse events (torchft_lite ManagerServers only)."""
        call = self._stream_call("Events", pb.ManagerEventsRequest, pb.LeaseEvent)
        return call(pb.ManagerEventsRequest(group_rank=group_rank), wait_for_ready=True)
