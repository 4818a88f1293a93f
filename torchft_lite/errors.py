"""Exceptions raised by torchft_lite.

::

    TorchFTError
    ├── ConfigError (also ValueError)        a setting is missing or invalid
    ├── QuorumError                          the group could not get a quorum
    │   └── QuorumTimeout (also TimeoutError)
    ├── CollectiveError                      a collective on the replica process group failed
    │   └── CollectiveTimeout (also TimeoutError)
    ├── CheckpointError                      a live checkpoint could not be served or loaded
    │   └── CheckpointTransferError          the transfer itself failed (network, checksum, step)
    │       └── CheckpointTimeout (also TimeoutError)
    └── ManagerError                         the ManagerServer refused or failed a call
        └── ManagerTimeout (also TimeoutError)

Lower layers raise these; only the Manager turns one into "skip this step"
(it records the first error, logs it once and votes not to commit).
"""

from __future__ import annotations

__all__ = [
    "TorchFTError",
    "ConfigError",
    "QuorumError",
    "QuorumTimeout",
    "CollectiveError",
    "CollectiveTimeout",
    "CheckpointError",
    "CheckpointTransferError",
    "CheckpointTimeout",
    "ManagerError",
    "ManagerTimeout",
]


class TorchFTError(Exception):
    """Base class of every error torchft_lite raises on purpose."""


class ConfigError(TorchFTError, ValueError):
    """A setting is missing or invalid; the message names it."""


class QuorumError(TorchFTError):
    """No quorum could be formed for this step."""


class QuorumTimeout(QuorumError, TimeoutError):
    """The quorum did not arrive within its timeout."""


class CollectiveError(TorchFTError):
    """A collective on the cross-replica process group failed."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not finish within its timeout."""


class CheckpointError(TorchFTError):
    """A live checkpoint could not be served, encoded or decoded."""


class CheckpointTransferError(CheckpointError):
    """Moving a checkpoint between replicas failed (network, checksum, wrong step)."""


class CheckpointTimeout(CheckpointTransferError, TimeoutError):
    """A checkpoint transfer did not finish within its timeout."""


class ManagerError(TorchFTError):
    """A call to the group's ManagerServer failed."""


class ManagerTimeout(ManagerError, TimeoutError):
    """A call to the group's ManagerServer did not finish within its timeout."""
