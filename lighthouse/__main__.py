"""``python -m lighthouse`` / ``torchft-lite-lighthouse``: run a lighthouse until SIGTERM or SIGINT."""

from __future__ import annotations

import os

# The lighthouse process never forks; gRPC's fork support costs ~20% CPU per
# call (measured with benchmarks/lighthouse_bench.py). Must be set before gRPC
# is imported; an explicit setting in the environment wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import asyncio  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from lighthouse.config import LighthouseConfig  # noqa: E402
from lighthouse.idle_exit import IdleExit  # noqa: E402
from lighthouse.server import LighthouseServer  # noqa: E402
from torchft_lite.rpc.loop import new_event_loop  # noqa: E402

logger = logging.getLogger("lighthouse")
_IDLE_CHECK_S = 1.0


async def _stop_when_idle(server: LighthouseServer, rule: IdleExit) -> None:
    """Ask ``server`` to stop once ``rule`` says its job has been idle long enough."""
    loop = asyncio.get_running_loop()
    while not rule.observe(server.statistics(), loop.time()):
        await asyncio.sleep(_IDLE_CHECK_S)
    logger.info("no replica group for %.0fs after the job's quorums: the job is over, shutting down", rule.idle_for)
    server.request_stop()


async def _run(config: LighthouseConfig, idle: IdleExit | None = None) -> None:
    server = LighthouseServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (logger.info("received %s, shutting down", s.name), server.request_stop()))

    def ready() -> None:
        http = (f", dashboard at {config.tls.scheme}://localhost:{server.http_port}/"
                if server.http_port is not None else "")
        # The first line scripts look for (torchft prints a similar one).
        print(f"Lighthouse listening on: {server.address()}{http}", flush=True)

    if idle is None:
        await server.serve(ready)
        return
    # Owned here: a watcher that fails stops the server, and its error is raised once serving ended.
    watcher = asyncio.create_task(_stop_when_idle(server, idle), name="lighthouse-idle-exit")
    watcher.add_done_callback(lambda task: task.cancelled() or task.exception() is None or server.request_stop())
    try:
        await server.serve(ready)
    finally:
        watcher.cancel()
        (outcome,) = await asyncio.gather(watcher, return_exceptions=True)
    if isinstance(outcome, Exception):
        raise outcome


def main(argv: list[str] | None = None) -> int:
    parser = LighthouseConfig.arg_parser()
    parser.add_argument(
        "--exit-when-idle", "--exit_when_idle", type=float, default=None, metavar="SECONDS",
        help="end the lighthouse (exit code 0) once, after its first quorum, no replica group has held a lease or "
        "heartbeated for this many seconds: for a lighthouse run as one role of its job (torchx, a Slurm step), "
        "which the scheduler counts finished only when the lighthouse exits. Longer than a group's restart; "
        "default: serve until SIGTERM",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = LighthouseConfig.from_args(args)
        idle = None if args.exit_when_idle is None else IdleExit(args.exit_when_idle)
    except ValueError as exc:
        parser.error(str(exc))
    loop = new_event_loop()
    try:
        loop.run_until_complete(_run(config, idle))
    except OSError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
