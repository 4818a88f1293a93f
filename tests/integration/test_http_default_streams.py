"""HTTPTransport(timeout) as torchft's API is called: streams picked from the size and the source's word.

Our checkpoint server advertises ``X-Checkpoint-Streams`` on every answer; a
receive with ``num_chunks`` unset asks for the header alone, then fetches
the data over as many ranges as ``_streams.streams_for`` picks. Sources that
serve no ranges (no header route, everything for any request, or no
advertisement) still heal.
"""

import threading
import time
from datetime import timedelta

import pytest
import torch

from tests.conftest import WAIT
from tests.integration.helpers import response
from torchft_lite.checkpointing import _streams
from torchft_lite.checkpointing._body_sinks import DataSink
from torchft_lite.serialization import encode, prefault

pytestmark = pytest.mark.integration

LONG = timedelta(seconds=WAIT)
MiB = 1 << 20


def big_state(step: int = 5, tensors: int = 8, mib: int = 1) -> dict:
    """``tensors`` float32 tensors of ``mib`` MiB each, plus an odd-sized bfloat16 one and plain values."""
    generator = torch.Generator().manual_seed(step)
    model = {f"w{i}": torch.randn(mib * MiB // 4, generator=generator) for i in range(tensors)}
    model["odd"] = torch.randn(12_345, generator=generator).to(torch.bfloat16)
    return {"model": model, "meta": {"step": step, "note": ("x", None)}}


def assert_same(got: dict, sent: dict) -> None:
    assert got["meta"] == sent["meta"]
    assert set(got["model"]) == set(sent["model"])
    for name, tensor in sent["model"].items():
        assert got["model"][name] is not tensor
        assert got["model"][name].dtype == tensor.dtype and torch.equal(got["model"][name], tensor), name


def record_requests(transport) -> list[tuple[str, str | None, str | None]]:
    """``(part, start, end)`` of every answer ``transport``'s checkpoint server starts to send."""
    asked: list[tuple[str, str | None, str | None]] = []
    serve_pieces = transport._server._pieces

    def pieces(request, encoded, part, sums):
        asked.append((part, request.query.get("start"), request.query.get("end")))
        return serve_pieces(request, encoded, part, sums)

    transport._server._pieces = pieces  # an instance attribute: this server only
    return asked


def data_ranges(asked) -> list[tuple[int, int]]:
    return sorted((int(start), int(end)) for part, start, end in asked if part == "data")


@pytest.fixture(autouse=True)
def eight_cpus(monkeypatch):
    """As on a host with CPUs to spare: the streams then come from the size and the source (on this 2-CPU
    machine the CPU cap alone would keep every receive to one stream)."""
    monkeypatch.setattr(_streams, "usable_cpus", lambda: 8)


def test_a_large_state_dict_comes_over_several_streams_by_default(make_transport, monkeypatch):
    monkeypatch.setattr(_streams, "BYTES_PER_STREAM", 2 * MiB)  # 8 MiB of data then asks for 4 streams
    sent = big_state()
    server, client = make_transport(), make_transport()
    asked = record_requests(server)
    server.send_checkpoint([1], 5, sent, LONG)
    got = client.recv_checkpoint(0, server.metadata(), 5, LONG)
    server.disallow_checkpoint()
    assert_same(got, sent)
    assert [part for part, _, _ in asked].count("header") == 1 and "all" not in [part for part, _, _ in asked]
    ranges = data_ranges(asked)
    assert len(ranges) == 4  # 8 MiB / 2 MiB, within the 4 the server advertises
    data_bytes = sum(t.numel() * t.element_size() for t in sent["model"].values())
    assert ranges[0][0] == 0 and ranges[-1][1] == data_bytes
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # they tile the data


def test_where_the_cpus_allow_one_stream_the_whole_encoding_comes_in_one_get(make_transport, monkeypatch):
    """Asking for the header first would only cost a round trip: the data would come in one range anyway."""
    monkeypatch.setattr(_streams, "usable_cpus", lambda: 3)
    monkeypatch.setattr(_streams, "BYTES_PER_STREAM", MiB)  # the size alone would ask for 8
    sent = big_state()
    server, client = make_transport(), make_transport()
    asked = record_requests(server)
    server.send_checkpoint([1], 5, sent, LONG)
    assert_same(client.recv_checkpoint(0, server.metadata(), 5, LONG), sent)
    server.disallow_checkpoint()
    assert [part for part, _, _ in asked] == ["all"]


@pytest.mark.parametrize("cpus, threaded", [(8, True), (3, False)])
def test_ranges_are_read_and_sent_on_threads_only_where_cores_are_to_spare(make_transport, monkeypatch, cpus,
                                                                          threaded):
    monkeypatch.setattr(_streams, "usable_cpus", lambda: cpus)
    where: dict[str, set[tuple[str, int]]] = {"read": set(), "sent": set()}  # (thread name, thread id)
    filled, summed = DataSink.filled, encode.EncodedStateDict.checksum

    def reading(self, count):
        where["read"].add((threading.current_thread().name, threading.get_ident()))
        return filled(self, count)

    def summing(self, index):  # the sending side sums each block as it produces it for the send
        where["sent"].add((threading.current_thread().name, threading.get_ident()))
        return summed(self, index)

    monkeypatch.setattr(DataSink, "filled", reading)
    monkeypatch.setattr(encode.EncodedStateDict, "checksum", summing)
    sent = big_state()
    server, client = make_transport(), make_transport(num_chunks=4)
    server.send_checkpoint([1], 5, sent, LONG)
    assert_same(client.recv_checkpoint(0, server.metadata(), 5, LONG), sent)
    server.disallow_checkpoint()
    for side, prefix in (("read", "torchft-heal-read"), ("sent", "torchft-heal-send")):
        on_threads = {(name, ident) for name, ident in where[side] if name == prefix}
        if threaded:
            assert on_threads == where[side] and len(on_threads) > 1, where  # several streams, several threads
        else:
            assert not on_threads and where[side], where


def test_the_sources_advertisement_caps_the_streams(make_transport, monkeypatch):
    monkeypatch.setattr(_streams, "BYTES_PER_STREAM", MiB)  # the size alone would ask for 8
    sent = big_state()
    server, client = make_transport(), make_transport()
    server._server._streams = 2  # what this server says it serves one receiver at once
    asked = record_requests(server)
    server.send_checkpoint([1], 5, sent, LONG)
    assert_same(client.recv_checkpoint(0, server.metadata(), 5, LONG), sent)
    server.disallow_checkpoint()
    assert len(data_ranges(asked)) == 2


def test_a_small_state_dict_keeps_one_stream(make_transport):
    sent = big_state(tensors=2)  # 2 MiB: far below a stream's worth
    server, client = make_transport(), make_transport()
    asked = record_requests(server)
    server.send_checkpoint([1], 5, sent, LONG)
    assert_same(client.recv_checkpoint(0, server.metadata(), 5, LONG), sent)
    server.disallow_checkpoint()
    assert [part for part, _, _ in asked] == ["header", "data"]


@pytest.mark.parametrize("num_chunks, expected", [(0, ["all"]), (1, ["all"]), (3, ["header"] + ["data"] * 3)])
def test_an_explicit_num_chunks_wins(make_transport, monkeypatch, num_chunks, expected):
    monkeypatch.setattr(_streams, "BYTES_PER_STREAM", MiB)  # the default would take 4 streams here
    sent = big_state()
    server, client = make_transport(), make_transport(num_chunks=num_chunks)
    asked = record_requests(server)
    server.send_checkpoint([1], 5, sent, LONG)
    assert_same(client.recv_checkpoint(0, server.metadata(), 5, LONG), sent)
    server.disallow_checkpoint()
    assert sorted(part for part, _, _ in asked) == sorted(expected)


def test_fresh_tensors_are_populated_before_the_socket_writes_and_in_place_ones_are_not(make_transport,
                                                                                        monkeypatch):
    monkeypatch.setattr(_streams, "BYTES_PER_STREAM", 2 * MiB)
    populated: list[tuple[int, int]] = []
    real_populate = prefault.populate

    def counting(address: int, length: int) -> bool:
        populated.append((address, length))
        return real_populate(address, length)

    monkeypatch.setattr(prefault, "populate", counting)
    sent = big_state()
    mine = big_state(step=1)  # the receiver's own state, of the same layout
    server = make_transport()
    fresh, in_place = make_transport(), make_transport(state_dict=lambda: mine)
    server.send_checkpoint([1, 2], 5, sent, LONG)
    got = fresh.recv_checkpoint(0, server.metadata(), 5, LONG)
    deadline = time.monotonic() + 30  # a populating thread may still be inside the call it claimed a block for
    while prefault.supported() and len(populated) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    blocks_populated = len(populated)
    mine_got = in_place.recv_checkpoint(0, server.metadata(), 5, LONG)
    server.disallow_checkpoint()
    assert_same(got, sent)
    assert mine_got["model"]["w0"] is mine["model"]["w0"] and torch.equal(mine["model"]["w0"], sent["model"]["w0"])
    if not prefault.supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE: the receive above is checked, nothing populated")
    # every 1 MiB checksum block of the eight fresh 1 MiB tensors (the 24 KiB one is left to fault), once each,
    # by the populating threads or the writes, whichever got there first
    assert blocks_populated == 8 and len(set(populated)) == 8
    assert len(populated) == blocks_populated  # the in-place receive wrote into memory it had


def test_a_source_that_serves_no_header_alone_is_read_whole(make_transport, scripted):
    sent = big_state()
    blob = encode.encode_to_bytes(5, sent)
    source = scripted(lambda path, query: response(200, blob) if path == "/checkpoint/5"
                      else response(404, b"Not Found"))  # the whole encoding, and no other route
    assert_same(make_transport().recv_checkpoint(0, source.url, 5, LONG), sent)
    assert source.paths[:2] == ["GET /checkpoint/5/header", "GET /checkpoint/5"]


def test_a_source_that_answers_everything_to_the_header_request_is_read_from_that_answer(make_transport, scripted):
    sent = big_state()
    blob = encode.encode_to_bytes(5, sent)
    source = scripted(lambda path, query: response(200, blob))  # whatever was asked
    assert_same(make_transport().recv_checkpoint(0, source.url, 5, LONG), sent)
    assert [path for path in source.paths if path.startswith("GET")] == ["GET /checkpoint/5/header"]


def test_a_source_that_advertises_no_streams_gets_one(make_transport, scripted, monkeypatch):
    monkeypatch.setattr(_streams, "BYTES_PER_STREAM", MiB)
    sent = big_state()
    encoded = encode.encode(5, encode.flatten(sent))

    def answer(path: str, query: dict) -> bytes:
        if path == "/checkpoint/5/header":
            return response(200, encoded.header)  # no X-Checkpoint-Streams: an older sender
        if path == "/checkpoint/5/data":
            pieces, _ = encoded.body(int(query["start"]), int(query["end"]))
            return response(200, b"".join(bytes(piece) for piece in pieces))
        return response(404, b"Not Found")

    source = scripted(answer)
    assert_same(make_transport().recv_checkpoint(0, source.url, 5, LONG), sent)
    assert [path for path in source.paths if path.startswith("GET")] == ["GET /checkpoint/5/header",
                                                                          "GET /checkpoint/5/data"]
