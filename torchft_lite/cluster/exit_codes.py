"""What a training process's exit code tells its scheduler, in one place.

Each ``EXIT_CODE_*`` below says what it means and what the scheduler should do;
:data:`EXIT_CODE_RESCHEDULE` (75) and :data:`EXIT_CODE_PREEMPTED` (143) come from
:mod:`torchft_lite.health.watchdog`. The table is in docs/durable.md ("Exit codes").
:func:`exit_code_for` maps an exception escaping the training loop to its code;
``examples/train_ddp.py`` shows the pattern (``raise SystemExit(run(main))``).
"""

from __future__ import annotations

import logging
from typing import Callable

from torchft_lite.errors import CheckpointMismatchError, ConfigError, NonFiniteError, StateDivergedError
from torchft_lite.health.watchdog import EXIT_CODE_PREEMPTED, EXIT_CODE_RESCHEDULE

__all__ = ["EXIT_CODE_BAD_REPLICA", "EXIT_CODE_DIVERGED", "EXIT_CODE_DONE", "EXIT_CODE_FAILED", "EXIT_CODE_FATAL", "EXIT_CODE_PREEMPTED", "EXIT_CODE_RESCHEDULE",
           "exit_code_for", "run"]

logger = logging.getLogger(__name__)

EXIT_CODE_DONE = 0
"""Finished: don't restart."""
EXIT_CODE_FAILED = 1
"""An unexpected error, or killed through the lighthouse (torchft's code): restart it (it heals from a peer or
resumes from disk)."""
EXIT_CODE_BAD_REPLICA = 65
"""This group's gradients were non-finite too many steps in a row (``EX_DATAERR``; :mod:`torchft_lite.health.nonfinite`):
replace it, on another host if its accelerator is suspect."""
EXIT_CODE_DIVERGED = 70
"""Replica groups at the same step hold different states and no majority agrees (``EX_SOFTWARE``;
:mod:`torchft_lite.health.fingerprint`): every group stops, nothing commits; resume the whole job from its last
durable checkpoint (a person may want to find the bad host first)."""
EXIT_CODE_FATAL = 78
"""A setting or the checkpoint directory is wrong (``EX_CONFIG``; a ``ConfigError``, or a durable checkpoint of
another model): don't retry, a person must look."""


def exit_code_for(exc: BaseException) -> int:
    """The code a process should exit with when ``exc`` ends its training loop."""
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else EXIT_CODE_FAILED
    if isinstance(exc, (ConfigError, CheckpointMismatchError)):
        return EXIT_CODE_FATAL
    if isinstance(exc, NonFiniteError):
        return EXIT_CODE_BAD_REPLICA
    if isinstance(exc, StateDivergedError):
        return EXIT_CODE_DIVERGED
    return EXIT_CODE_FAILED


def run(main: Callable[[], object]) -> int:
    """Call ``main()``; return the exit code its outcome means (logging an exception that ended it)."""
    try:
        main()
    except BaseException as exc:  # every way out gets its documented code
        code = exit_code_for(exc)
        if not isinstance(exc, SystemExit):
            logger.critical("training ended by %s: %s (exit code %d)", type(exc).__name__, exc, code,
                            exc_info=(type(exc), exc, exc.__traceback__))
        return code
    return EXIT_CODE_DONE
