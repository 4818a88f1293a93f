"""A simulated replica group: heartbeats and joins a quorum every step, no torch.

Stands in for a training job's manager so the lighthouse can be exercised on
its own (``examples/demo.py``, benchmarks). Each step it joins the quorum,
"heals" by jumping to the quorum's max step when behind (a real group would
fetch the state dict from a peer), then "trains" for ``--step-time``.
Prints one JSON object per event on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lighthouse.client import LighthouseClient, LighthouseError  # noqa: E402


def emit(**event) -> None:
    print(json.dumps({"t": time.time(), **event}), flush=True)


async def heartbeat_forever(client: LighthouseClient, replica_id: str, interval: float) -> None:
    while True:
        try:
            await client.heartbeat(replica_id, timeout=max(interval * 5, 1.0))
        except LighthouseError as exc:
            emit(event="heartbeat_failed", error=str(exc))
        await asyncio.sleep(interval)


async def run(args: argparse.Namespace) -> None:
    # A unique id per incarnation, as real managers do: a restarted group is a new member.
    replica_id = f"{args.replica_id}:{uuid.uuid4().hex[:8]}"
    async with LighthouseClient(args.lighthouse, connect_timeout=30) as client:
        beats = asyncio.create_task(heartbeat_forever(client, replica_id, args.heartbeat_interval))
        try:
            step = 0
            emit(event="started", replica_id=replica_id)
            while step < args.steps:
                start = time.monotonic()
                quorum = await client.quorum(replica_id, timeout=args.quorum_timeout, step=step,
                                             address=f"http://{args.replica_id}.invalid:0", world_size=1)
                members = [m.replica_id for m in quorum.participants]
                max_step = max(m.step for m in quorum.participants)
                healed_from = None
                if step < max_step:
                    healed_from = next(m.replica_id for m in quorum.participants if m.step == max_step)
                    step = max_step
                emit(event="quorum", step=step, quorum_id=quorum.quorum_id, members=members,
                     healed_from=healed_from, quorum_s=time.monotonic() - start)
                await asyncio.sleep(args.step_time)
                step += 1
            emit(event="finished", step=step)
        finally:
            beats.cancel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lighthouse", required=True, help="lighthouse address, e.g. http://localhost:29510")
    parser.add_argument("--replica-id", required=True, help="replica group name (an incarnation suffix is added)")
    parser.add_argument("--steps", type=int, default=1000, help="steps to run")
    parser.add_argument("--step-time", type=float, default=0.1, help="simulated seconds of training per step")
    parser.add_argument("--heartbeat-interval", type=float, default=0.1, help="seconds between heartbeats")
    parser.add_argument("--quorum-timeout", type=float, default=60.0, help="seconds a Quorum call may wait")
    args = parser.parse_args()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
