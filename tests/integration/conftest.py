"""Fixtures shared by the checkpoint transport tests."""

from __future__ import annotations

import concurrent.futures
from datetime import timedelta

import pytest

from tests.conftest import WAIT
from torchft_lite.checkpointing import HTTPTransport


@pytest.fixture
def make_transport():
    """``make(**kwargs)``: an HTTPTransport on 127.0.0.1 (timeout WAIT unless given), shut down after the test."""
    transports = []

    def make(**kwargs) -> HTTPTransport:
        kwargs.setdefault("timeout", timedelta(seconds=WAIT))
        transport = HTTPTransport(hostname="127.0.0.1", bind_host="127.0.0.1", **kwargs)
        transports.append(transport)
        return transport

    try:
        yield make
    finally:
        for transport in transports:
            transport.shutdown()


@pytest.fixture
def threads():
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        yield pool
