"""An asyncio client for ``LighthouseService`` (ours or torchft's).

Torch-free, so the demo, the benchmark and the ManagerServer share it. Every
call takes a timeout; gRPC errors are translated at this boundary. The channel
under it is the RPC kit's (:mod:`torchft_lite.rpc.channel`).
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import grpc

from torchft_lite.rpc.access import Access
from torchft_lite.rpc.channel import UnaryChannel
from torchft_lite.rpc.protocol import torchft_pb2 as pb
from torchft_lite.rpc.tls import TlsSettings


class LighthouseError(Exception):
    """A lighthouse call failed; the message says which call and why."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class LighthouseTimeout(LighthouseError, TimeoutError):
    """A lighthouse call did not finish within its timeout."""


class LighthouseClient(UnaryChannel):
    """One channel to one lighthouse. Create and use it on a single event loop."""

    service = "torchft.LighthouseService"

    def __init__(self, address: str, *, connect_timeout: float = 60.0, access: Access | None = None,
                 tls: TlsSettings | None = None) -> None:
        """``access``: the job token every call carries; None reads it from the environment (see UnaryChannel);
        ``tls``: whether the channel uses TLS, None: from the environment (the same)."""
        if not address:
            raise ValueError("lighthouse address is empty (set TORCHFT_LIGHTHOUSE or pass lighthouse_addr)")
        super().__init__(address, access=access, tls=tls)
        self.connect_timeout = connect_timeout

    async def connect(self, *, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until the channel is connected, so a wrong
        address fails here rather than as a timeout of the first call."""
        try:
            await asyncio.wait_for(self._open().channel_ready(), timeout)
        except TimeoutError:
            raise LighthouseTimeout(
                f"lighthouse {self.address}: not connected within {timeout:.1f}s "
                "(is it running, and is the address right?)"
            ) from None

    async def _invoke(self, method: str, request, response_cls, timeout: float, what: str):
        call = self._call(method, type(request), response_cls)
        try:
            # wait_for_ready: a lighthouse that is briefly down (restarting) is
            # waited for until the timeout instead of failing at once.
            return await call(request, timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            text = f"lighthouse {self.address}: {what} failed: {code.name if code else 'UNKNOWN'}: {exc.details()}"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise LighthouseTimeout(
                    f"lighthouse {self.address}: {what} got no answer within {timeout:.1f}s", code
                ) from exc
            raise LighthouseError(text, code) from exc

    async def quorum(
        self,
        replica_id: str,
        *,
        timeout: float,
        address: str = "",
        store_address: str = "",
        step: int = 0,
        world_size: int = 0,
        shrink_only: bool = False,
        data: str = "",
        commit_failures: int = 0,
        reconfigure_handles: Sequence[str] = (),
    ) -> pb.Quorum:
        """Join the next quorum and wait (up to ``timeout`` s) until one including us is issued.

        ``reconfigure_handles``: the group's process-group handles, by group rank (every member gets them)."""
        member = pb.QuorumMember(
            replica_id=replica_id, address=address, store_address=store_address, step=step,
            world_size=world_size, shrink_only=shrink_only, data=data, commit_failures=commit_failures,
            reconfigure_handles=reconfigure_handles,
        )
        response = await self._invoke(
            "Quorum", pb.LighthouseQuorumRequest(requester=member), pb.LighthouseQuorumResponse,
            timeout, f"Quorum for {replica_id} at step {step}",
        )
        return response.quorum

    async def heartbeat(self, replica_id: str, *, timeout: float) -> float | None:
        """Keep ``replica_id`` healthy; returns the lighthouse's heartbeat timeout in seconds when it states
        one (ours does; torchft's does not)."""
        response = await self._invoke(
            "Heartbeat", pb.LighthouseHeartbeatRequest(replica_id=replica_id), pb.LighthouseHeartbeatResponse,
            timeout, f"Heartbeat for {replica_id}",
        )
        return response.heartbeat_timeout_ms / 1000 if response.heartbeat_timeout_ms > 0 else None

    def lease(self, replica_id: str) -> grpc.aio.UnaryStreamCall:
        """Open the lease stream (torchft_lite lighthouses only): iterate it for ``LeaseEvent``s.

        The first event is ``GRANTED``. The lease lasts while the stream is
        open; cancel the call (or close the client) to give it up. gRPC errors
        surface as ``grpc.aio.AioRpcError`` while iterating (``UNIMPLEMENTED``
        from a lighthouse without leases, such as torchft's).
        """
        call = self._stream_call("Lease", pb.LeaseRequest, pb.LeaseEvent)
        return call(pb.LeaseRequest(replica_id=replica_id), wait_for_ready=True)

    async def get_config(self, *, timeout: float) -> dict[str, str]:
        response = await self._invoke(
            "GetConfig", pb.LighthouseConfigRequest(), pb.LighthouseConfigResponse, timeout, "GetConfig"
        )
        return dict(response.config_data)

    async def __aenter__(self) -> "LighthouseClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
