"""A real lighthouse in its own process, for the flood suite (test_grpc_floods.py).

    python -m tests.integration.flood_lighthouse --engine native --status FILE

Its own process so that the suite reads the memory of the lighthouse alone
(/proc/PID/status) and the attacker and the legitimate client are separate
programs, as they would be. It is ``python -m lighthouse`` but for one thing:
the lighthouse's configuration has no flags for the flood limits (yet), so the
gRPC service is started with the suite's :data:`LIMITS`: the defaults, except
deadlines of seconds instead of minutes, so that the idle and slowloris attacks
end within a test. Prints ``port N`` once serving; every 0.2 s it writes what
the native engine holds and counts to ``--status`` (JSON); stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import sys

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # as lighthouse/__main__.py: it never forks

import lighthouse.server as lighthouse_server  # noqa: E402
from lighthouse.config import LighthouseConfig  # noqa: E402
from torchft_lite.rpc import engines  # noqa: E402
from torchft_lite.rpc.h2grpc import GrpcServer  # noqa: E402
from torchft_lite.rpc.limits import ServerLimits  # noqa: E402
from torchft_lite.rpc.loop import new_event_loop  # noqa: E402

IDLE_TIMEOUT = 3.0
REQUEST_TIMEOUT = 3.0
LIMITS = ServerLimits(idle_timeout=IDLE_TIMEOUT, request_timeout=REQUEST_TIMEOUT)


def status_of(server: object) -> dict:
    if not isinstance(server, GrpcServer):  # grpcio: nothing of this is visible from Python
        return {"engine": "grpcio"}
    connections = list(server.connections)
    return {"engine": "native", "connections": len(connections),
            "streams": sum(len(c.open_streams()) for c in connections), "limits_hit": dict(server.limits_hit)}


async def run(engine: str, status_path: str) -> None:
    config = LighthouseConfig(min_replicas=2, bind="127.0.0.1:0", http_bind=None, join_timeout=30.0,
                              heartbeat_timeout=10.0, quorum_tick=0.05, startup_grace=0.0, grpc_engine=engine)
    server = lighthouse_server.LighthouseServer(config)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, server.request_stop)
    await server.start()
    print(f"port {server.grpc_port}", flush=True)
    try:
        while server._serve_task is not None and not server._serve_task.done():
            with open(status_path + ".tmp", "w") as out:
                json.dump(status_of(server._grpc), out)
            os.replace(status_path + ".tmp", status_path)
            await asyncio.sleep(0.2)
    finally:
        await server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("native", "grpcio"), required=True)
    parser.add_argument("--status", required=True, help="file to write the server's counts to (JSON)")
    args = parser.parse_args()
    lighthouse_server.start_service = functools.partial(engines.start_service, limits=LIMITS)
    loop = new_event_loop()
    try:
        loop.run_until_complete(run(args.engine, args.status))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
