"""torchft_lite's lighthouse: a standalone, torch-free quorum service.

Wire-compatible with torchft's ``LighthouseService``. Run it with
``python -m lighthouse --min_replicas N`` or ``torchft-lite-lighthouse``.

Names are imported lazily so that ``python -m lighthouse`` can configure gRPC
(environment variables read at import) before gRPC is first imported.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BackgroundLighthouse": "lighthouse.thread",
    "Decision": "lighthouse.quorum",
    "IssuedQuorum": "lighthouse.quorum",
    "LighthouseClient": "torchft_lite.rpc.lighthouse_client",
    "LighthouseConfig": "lighthouse.config",
    "LighthouseError": "torchft_lite.rpc.lighthouse_client",
    "LighthouseServer": "lighthouse.server",
    "LighthouseStatistics": "lighthouse.view",
    "LighthouseTimeout": "torchft_lite.rpc.lighthouse_client",
    "Member": "lighthouse.quorum",
    "QuorumConfig": "lighthouse.quorum",
    "QuorumState": "lighthouse.quorum",
    "Status": "lighthouse.quorum",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lighthouse' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
