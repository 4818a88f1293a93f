"""``python -m torchft_lite.launch``: torchrun, but its exit code is the failed worker's.

torchrun exits with 1 whatever its workers exited with, so a scheduler that
decides from exit codes (Slurm's requeue, a Kubernetes ``podFailurePolicy``)
can't tell a bad setting (78: don't retry) from a watchdog timeout (75:
restart elsewhere) or a SIGTERM (143: restart when capacity returns); see
:mod:`torchft_lite.cluster.exit_codes`. This takes torchrun's arguments unchanged and
exits with the exit code of the first worker that failed (128 + N for one
killed by signal N, as a shell reports it), 128 + N when the launcher itself
was stopped by signal N (a scheduler's SIGTERM: torchrun passes it on to the
workers, which save and leave), or 0.

    python -m torchft_lite.launch --standalone --nproc_per_node=8 train.py --steps 1000
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

__all__ = ["exit_code_of", "main"]


def exit_code_of(worker_exitcode: int) -> int:
    """The shell-style exit code of a worker that ended with ``worker_exitcode`` (negative: killed by signal)."""
    if worker_exitcode < 0:
        return 128 + -worker_exitcode
    return worker_exitcode if 0 < worker_exitcode < 256 else 1


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        print(f"torchft_lite.launch: {exc.name} failed; exiting with its worker's code "
              f"{exit_code_of(failure.exitcode)}", file=sys.stderr, flush=True)
        return exit_code_of(failure.exitcode)
    except SignalException as exc:  # torchrun stopped its workers with the same signal first
        print(f"torchft_lite.launch: stopped by {exc.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
