"""How many streams a receive with num_chunks unset takes: from the data's size and the source's advertisement."""

import os

import pytest

from torchft_lite.checkpointing import _streams

MiB = 1 << 20


@pytest.mark.parametrize("data_bytes, advertised, expected", [
    (0, 4, 1),                   # nothing to fetch still takes one stream
    (100 * MiB, 4, 1),           # below one stream's worth
    (255 * MiB, 4, 1),
    (300 * MiB, 4, 2),
    (1024 * MiB, 4, 4),          # a 1 GiB heal from a source with few CPUs: the four it serves
    (1024 * MiB, 8, 8),          # ... from one with 16: eight
    (8 << 30, 4, 4),             # never past what the source serves
    (8 << 30, 1, 1),             # a source that advertises nothing usable
    (8 << 30, 64, _streams.MAX_STREAMS),
])
def test_streams_come_from_the_size_up_to_what_the_source_serves(data_bytes, advertised, expected):
    assert _streams.streams_for(data_bytes, advertised, cpus=64) == expected


@pytest.mark.parametrize("cpus, expected", [(1, 1), (2, 1), (3, 1), (4, 2), (6, 3), (8, 4), (64, 4)])
def test_a_receive_opens_at_most_one_stream_per_two_cpus(cpus, expected):
    assert _streams.streams_for(1024 * MiB, 4, cpus=cpus) == expected  # 1 GiB from our server (4 advertised)


def test_the_default_cpu_count_is_this_processs(monkeypatch):
    monkeypatch.setattr(_streams, "usable_cpus", lambda: 2)
    assert _streams.streams_for(1024 * MiB, 4) == 1
    monkeypatch.setattr(_streams, "usable_cpus", lambda: 16)
    assert _streams.streams_for(1024 * MiB, 4) == 4


def test_usable_cpus_counts_at_least_one():
    assert 1 <= _streams.usable_cpus() <= (os.cpu_count() or 1)


@pytest.mark.parametrize("headers, expected", [
    ({}, 1),                                   # an older sender says nothing: one stream
    ({"x-checkpoint-streams": "4"}, 4),
    ({"x-checkpoint-streams": " 2 "}, 2),
    ({"x-checkpoint-streams": "0"}, 1),
    ({"x-checkpoint-streams": "-3"}, 1),
    ({"x-checkpoint-streams": "many"}, 1),
    ({"x-checkpoint-streams": "1000000"}, _streams.MAX_STREAMS),
])
def test_the_advertisement_is_read_defensively(headers, expected):
    assert _streams.advertised(headers) == expected


def test_our_server_advertises_more_than_one_stream():
    assert 1 < _streams.SERVED_STREAMS <= _streams.MAX_STREAMS


@pytest.mark.parametrize("cpus, expected", [(1, True), (2, True), (3, True), (4, False), (16, False)])
def test_one_stream_here_when_the_cpus_allow_no_second(cpus, expected):
    assert _streams.one_stream_here(cpus) is expected
    assert (_streams.streams_for(1 << 40, _streams.MAX_STREAMS, cpus) == 1) is expected


@pytest.mark.parametrize("cpus, expected", [(1, 4), (2, 4), (8, 4), (16, 8), (64, _streams.MAX_STREAMS)])
def test_a_source_serves_four_streams_or_one_per_two_cpus(cpus, expected):
    assert _streams.served_streams(cpus) == expected


@pytest.mark.parametrize("cpus, expected", [(2, False), (3, False), (4, True), (16, True)])
def test_ranges_go_on_threads_from_four_cpus(cpus, expected):
    assert _streams.on_threads(cpus) is expected
