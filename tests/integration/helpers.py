"""Helpers shared by the integration tests (fixtures are in conftest.py next to this file).

Plain functions and classes, imported by the test modules (and by the processes some of them spawn): nothing
here starts anything at import time.
"""

from __future__ import annotations

from lighthouse.client import LighthouseClient
from lighthouse.server import LighthouseServer
from tests.conftest import WAIT


def client_for(server: LighthouseServer) -> LighthouseClient:
    """A gRPC client of ``server`` (in this process, on 127.0.0.1) that waits up to WAIT to connect."""
    return LighthouseClient(f"127.0.0.1:{server.grpc_port}", connect_timeout=WAIT)
