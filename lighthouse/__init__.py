"""torchft_lite's lighthouse: a standalone, torch-free quorum service.

Wire-compatible with torchft's ``LighthouseService``. Run it with
``python -m lighthouse --min_replicas N`` or ``torchft-lite-lighthouse``.
"""

from lighthouse.client import LighthouseClient, LighthouseError, LighthouseTimeout
from lighthouse.config import LighthouseConfig
from lighthouse.quorum import Decision, IssuedQuorum, Member, QuorumConfig, QuorumState, Status
from lighthouse.server import LighthouseServer, LighthouseStatistics
from lighthouse.thread import BackgroundLighthouse

__all__ = [
    "BackgroundLighthouse",
    "Decision",
    "IssuedQuorum",
    "LighthouseClient",
    "LighthouseConfig",
    "LighthouseError",
    "LighthouseServer",
    "LighthouseStatistics",
    "LighthouseTimeout",
    "Member",
    "QuorumConfig",
    "QuorumState",
    "Status",
]
