"""A standby trainer: a process that has paid a restart's fixed costs (the interpreter, torch's imports) before it is needed.

    python -m torchft_lite.cluster.standby [--preload MODULE,...] SCRIPT [ARG...]

It imports the ``--preload`` modules and writes ``ready`` and a newline to stdout; then it reads one line from
stdin, a JSON object ``{"env": {...}}`` (the variables of the incarnation it becomes, set over its environment),
points stdout at stderr and stdin at ``/dev/null``, and runs SCRIPT as ``__main__`` as ``python SCRIPT ARG...``
would; its exit status is the script's. End of input before that line ends it with status 0, a malformed line
with 2. :class:`torchft_lite.cluster.local.ReplicaGroup` drives it (docs/training.md, "Rejoin").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys
import time

__all__ = ["DEFAULT_PRELOAD", "READY", "go_line", "main"]

DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",  # what the first torch.optim optimizer imports (its add_param_group disables dynamo)
    "torchft_lite.manager",
    "torchft_lite.ddp",
    "torchft_lite.optim",
    "torchft_lite.data",
    "torchft_lite.process_group",
    "torchft_lite.checkpointing",  # the default heal transport (aiohttp)
    "torchft_lite.group_server.server",  # group rank 0's server (the h2 gRPC kit)
)
"""What a torchft_lite trainer imports before its first step; ``--preload torch,torchft`` suits torchft's."""
READY = b"ready\n"


def go_line(env: dict[str, str]) -> bytes:
    """The line a launcher writes to a ready standby's stdin to make it run its script with ``env`` added."""
    return json.dumps({"env": env}).encode() + b"\n"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torchft_lite.cluster.standby", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preload", default=",".join(DEFAULT_PRELOAD),
                        help="comma-separated modules to import while waiting (default: torch, torch._dynamo and "
                             "torchft_lite's trainer modules)")
    parser.add_argument("script", help="the training script to run on go")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return parser.parse_args(argv)


def _read_go(stream) -> dict[str, str] | None:
    """The go line's environment; None at end of input. Raises ``ValueError`` for a malformed line."""
    line = stream.readline()
    if not line:
        return None
    message = json.loads(line)
    env = message.get("env") if isinstance(message, dict) else None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError('expected {"env": {"NAME": "value", ...}}')
    return env


def main(argv: list[str] | None = None) -> int:
    """Warm up, wait for the launcher's go line, run the script (the protocol is the module's docstring).

    A standby is an ordinary process of the job: it holds no lease and no port until it runs the script, and
    the environment it starts with (the job token among it) is what the group's ranks get. The launcher talks
    to it over pipes, so nothing of the go line shows on a command line.
    """
    args = _parse(sys.argv[1:] if argv is None else argv)
    script = os.path.abspath(args.script)
    if not os.path.isfile(script):
        print(f"standby: no such training script: {script}", file=sys.stderr)
        return 2
    began = time.monotonic()
    for name in filter(None, (m.strip() for m in args.preload.split(","))):
        importlib.import_module(name)  # an error here is the launcher's to see, before any go
    print(f"standby: warm after {time.monotonic() - began:.2f}s ({args.preload}); waiting for go", file=sys.stderr,
          flush=True)
    out = sys.stdout.buffer
    out.write(READY)
    out.flush()
    try:
        env = _read_go(sys.stdin)
    except ValueError as exc:  # json.JSONDecodeError is one
        print(f"standby: malformed go line from the launcher: {exc}", file=sys.stderr, flush=True)
        return 2
    if env is None:
        return 0  # the launcher went away: nothing to run
    os.environ.update(env)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the script's prints go to the launcher's log
    with open(os.devnull, "rb") as devnull:
        os.dup2(devnull.fileno(), sys.stdin.fileno())
    sys.argv = [script, *args.args]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` has it
    runpy.run_path(script, run_name="__main__")  # its SystemExit is our exit status
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
