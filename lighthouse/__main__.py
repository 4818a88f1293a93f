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
from lighthouse.server import LighthouseServer  # noqa: E402
from lighthouse.rpc.loop import new_event_loop  # noqa: E402

logger = logging.getLogger("lighthouse")


async def _run(config: LighthouseConfig) -> None:
    server = LighthouseServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (logger.info("received %s, shutting down", s.name), server.request_stop()))

    def ready() -> None:
        http = (f", dashboard at {config.tls.scheme}://localhost:{server.http_port}/"
                if server.http_port is not None else "")
        # The first line scripts look for (torchft prints a similar one).
        print(f"Lighthouse listening on: {server.address()}{http}", flush=True)

    await server.serve(ready)


def main(argv: list[str] | None = None) -> int:
    parser = LighthouseConfig.arg_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = LighthouseConfig.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    loop = new_event_loop()
    try:
        loop.run_until_complete(_run(config))
    except OSError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
