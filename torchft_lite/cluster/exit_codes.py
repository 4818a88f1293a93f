"""What a training process's exit code tells its scheduler, in one place.

=====  ==========================  ==============================================================
code   name                        for the scheduler
=====  ==========================  ==============================================================
0      EXIT_CODE_DONE              finished: don't restart
1      EXIT_CODE_FAILED            an unexpected error, or killed through the lighthouse (torchft's
                                   code): restart it (it heals from a peer or resumes from disk)
65     EXIT_CODE_BAD_REPLICA       this group's gradients were non-finite too many steps in a row
                                   (``EX_DATAERR``; torchft_lite.health.nonfinite): replace it, on another host
                                   if its accelerator is suspect
70     EXIT_CODE_DIVERGED          replica groups at the same step hold different states and no
                                   majority agrees (``EX_SOFTWARE``; torchft_lite.health.fingerprint): every
                                   group stops, nothing commits; resume the whole job from its last
                                   durable checkpoint (a person may want to find the bad host first)
75     EXIT_CODE_RESCHEDULE        a watchdog section timed out (``EX_TEMPFAIL``): restart it,
                                   elsewhere if the host is suspect
78     EXIT_CODE_FATAL             a setting or the checkpoint directory is wrong (``EX_CONFIG``;
                                   a ``ConfigError``, or a durable checkpoint of another model):
                                   don't retry, a person must look
143    EXIT_CODE_PREEMPTED         left gracefully on SIGTERM (128 + 15), after saving a durable
                                   checkpoint of its step (with a DurableCheckpointer): restart
                                   it when capacity returns
=====  ==========================  ==============================================================

:func:`exit_code_for` maps an exception escaping the training loop to its
code; ``examples/train_ddp.py`` shows the pattern (``sys.exit(run(main))``).
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
EXIT_CODE_FAILED = 1
EXIT_CODE_BAD_REPLICA = 65
EXIT_CODE_DIVERGED = 70
EXIT_CODE_FATAL = 78


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
