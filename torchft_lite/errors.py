"""Exceptions raised by torchft_lite (why each branch also derives from a builtin: :class:`TorchFTError`).

::

    TorchFTError
    ├── ConfigError (also ValueError)        a setting is missing or invalid
    ├── QuorumError (also RuntimeError)      the group could not get a quorum
    │   ├── QuorumTimeout (also TimeoutError)
    │   └── StateDivergedError               groups at the same step hold different states, no majority
    ├── CollectiveError (also RuntimeError)  a collective on the replica process group failed
    │   ├── CollectiveTimeout (also TimeoutError)
    │   ├── ProcessGroupClosed (also OSError)  used after shutdown(), before the next configure()
    │   └── NonFiniteError                    gradients were NaN/Inf (a step's average, or one group's
    │                                         K steps in a row: it must leave)
    ├── CheckpointError (also RuntimeError)  a live checkpoint could not be served or loaded
    │   ├── DurableCheckpointError            a checkpoint on disk could not be written, read or applied
    │   │   └── CheckpointMismatchError       it is intact but holds another model's state
    │   └── CheckpointTransferError          the transfer itself failed (network, checksum, step)
    │       ├── CheckpointTimeout (also TimeoutError)
    │       │   └── CheckpointURLTimeout     (also CheckpointURLError) an HTTP receive timed out
    │       └── CheckpointURLError (also urllib.error.URLError)   an HTTP receive failed
    │           └── CheckpointHTTPError (also urllib.error.HTTPError)  the server answered an error status
    ├── ManagerError (also RuntimeError)     the ManagerServer refused or failed a call
    │   └── ManagerTimeout (also TimeoutError)
    └── LeavingError (also RuntimeError)     recorded, not raised: the group is leaving on a preemption signal
                                             and votes no on the step under way

    ExceptionWithTraceback                   not raised: what ``Manager.errored()`` returns (torchft's),
                                             the step's first error and where it came from
"""

from __future__ import annotations

import io
import traceback
import urllib.error

__all__ = [
    "TorchFTError",
    "ConfigError",
    "NonFiniteError",
    "QuorumError",
    "QuorumTimeout",
    "CollectiveError",
    "CollectiveTimeout",
    "ProcessGroupClosed",
    "CheckpointError",
    "CheckpointTransferError",
    "DurableCheckpointError",
    "CheckpointMismatchError",
    "CheckpointTimeout",
    "CheckpointURLError",
    "CheckpointURLTimeout",
    "CheckpointHTTPError",
    "ManagerError",
    "ManagerTimeout",
    "LeavingError",
    "ExceptionWithTraceback",
]


class TorchFTError(Exception):
    """Base class of every error torchft_lite raises on purpose.

    Each branch also derives from what torchft raises in the same situation, so a script written for torchft
    catches ours: ``RuntimeError`` for failures, ``TimeoutError`` for timeouts, ``ValueError`` for bad
    settings, and for an HTTP checkpoint receive urllib's ``URLError`` (``HTTPError`` when the server answered
    an error status), as torchft's ``urlopen`` raises.

    Lower layers raise these; only the Manager turns one into "skip this step" (it records the first error,
    logs it once and votes not to commit).
    """


class ConfigError(TorchFTError, ValueError):
    """A setting is missing or invalid; the message names it."""


class QuorumError(TorchFTError, RuntimeError):
    """No quorum could be formed for this step."""


class QuorumTimeout(QuorumError, TimeoutError):
    """The quorum did not arrive within its timeout."""


class StateDivergedError(QuorumError):
    """Replica groups at the same step hold different states and no majority agrees (fingerprints, see
    :mod:`torchft_lite.health.fingerprint`): nothing commits, and every group exits with ``EXIT_CODE_DIVERGED`` (70)."""

    MARK = "replica states diverged:"
    """Starts the message, which is all a rank reached over gRPC gets: it turns the error back into this type."""


class CollectiveError(TorchFTError, RuntimeError):
    """A collective on the cross-replica process group failed."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not finish within its timeout."""


class NonFiniteError(CollectiveError):
    """Non-finite (NaN/Inf) gradients: every participant's, or the average (the step does not commit);
    raised from ``should_commit`` when this group's own were non-finite too many steps in a row."""


class ProcessGroupClosed(CollectiveError, OSError):
    """A collective on a group that was shut down and not configured since.

    Also an :class:`OSError`, like an operation on a closed handle (torchft
    raises one there).
    """


class CheckpointError(TorchFTError, RuntimeError):
    """A live checkpoint could not be served, encoded or decoded."""


class DurableCheckpointError(CheckpointError):
    """A durable checkpoint (on disk) could not be written, was torn or corrupt, or does not fit the model."""


class CheckpointMismatchError(DurableCheckpointError):
    """A durable checkpoint is intact but does not fit the model (other tensor names, shapes or dtypes)."""


class CheckpointTransferError(CheckpointError):
    """Moving a checkpoint between replicas failed (network, checksum, wrong step)."""


class CheckpointTimeout(CheckpointTransferError, TimeoutError):
    """A checkpoint transfer did not finish within its timeout."""


class CheckpointURLError(CheckpointTransferError, urllib.error.URLError):
    """Receiving a checkpoint over HTTP failed (refused, reset, truncated, timed out, an error status).

    Also a ``urllib.error.URLError`` whose ``reason`` is the message (its
    ``str`` reads ``<urlopen error ...>``), as torchft's receive raises.
    """

    def __init__(self, message: str) -> None:
        urllib.error.URLError.__init__(self, message)
        self.args = (message,)


class CheckpointURLTimeout(CheckpointTimeout, CheckpointURLError):
    """Receiving a checkpoint over HTTP did not finish within its timeout."""


class CheckpointHTTPError(CheckpointURLError, urllib.error.HTTPError):
    """The checkpoint server answered an error status; ``code`` is the status, ``read()`` its body.

    Also a ``urllib.error.HTTPError`` (``str``: ``HTTP Error <code>: <message>``).
    """

    def __init__(self, url: str, code: int, message: str, body: bytes = b"") -> None:
        urllib.error.HTTPError.__init__(self, url, code, message, None, io.BytesIO(body))  # type: ignore[arg-type]
        self.args = (url, code, message, body)

    def __reduce__(self):  # the body stream does not pickle; the arguments do
        return type(self), self.args


class ManagerError(TorchFTError, RuntimeError):
    """A call to the group's ManagerServer failed."""


class ManagerTimeout(ManagerError, TimeoutError):
    """A call to the group's ManagerServer did not finish within its timeout."""


class LeavingError(TorchFTError, RuntimeError):
    """The group is leaving on a preemption signal: it votes no on the step under way (the step's error, which
    ``Manager.errored()`` returns), so that it leaves at a step its peers hold as well."""


class ExceptionWithTraceback(Exception):
    """A recorded error as ``Manager.errored()`` hands it out (torchft's): the error itself in
    ``original_exception`` and its formatted traceback in ``stack_trace``. Its message is the error's, then the
    traceback, so ``"..." in str(manager.errored())`` finds the error's words."""

    def __init__(self, e: BaseException) -> None:
        self.original_exception = e
        self.stack_trace = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        super().__init__(f"{e}\n{self.stack_trace}")
