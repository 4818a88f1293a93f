"""A heal striped over several replicas yields the primary's snapshot, byte for byte, whatever the others send.

The first source is the primary; the others (secondaries) only make the heal
faster. State that legitimately differs between replica groups (BatchNorm
running statistics, a data loader's position) must never stop a heal: a
secondary's header that differs is logged, its blocks that differ from the
primary's sums are fetched again from the primary, and a secondary that fails
or never answers leaves its ranges to the primary.
"""

import copy
import itertools
import logging
import re
import socket
from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from tests.conftest import WAIT, read_header
from tests.integration.helpers import bearer, digest, fetch
from torchft_lite.checkpointing import HTTPTransport, _http_receive, _streams
from torchft_lite.serialization import checksum, encode, spec

pytestmark = pytest.mark.integration

LONG = timedelta(seconds=WAIT)
HOUR = timedelta(hours=1)  # a send timeout no test waits out: a prompt release proves the receiver reported
LOGGER = "torchft_lite.checkpointing.http_transport"


@pytest.fixture(autouse=True, params=[2, 8], ids=["2cpus-loop", "8cpus-threads"])
def cpus(request, monkeypatch):
    """Every test twice: ranges read and sent on the event loop (as on this machine), and on a thread each (as
    where there are cores to spare, ``_streams.THREADS_FROM_CPUS``)."""
    monkeypatch.setattr(_streams, "usable_cpus", lambda: request.param)
    return request.param


@pytest.fixture
def warnings(caplog):
    """The transport's WARNING messages so far (a callable)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    return lambda: [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


@pytest.fixture
def patient(monkeypatch):
    """No range is taken from a slow secondary: tests that count bytes or warnings stay exact on a loaded machine."""
    monkeypatch.setattr(_http_receive, "_PATIENCE", WAIT)


@pytest.fixture
def checksum_passes(monkeypatch):
    """How many times a server summed its whole snapshot for ``/checksums``."""
    calls = []
    honest = encode.EncodedStateDict.packed_checksums

    def counting(self, *args, **kwargs):
        calls.append(self.step)
        return honest(self, *args, **kwargs)

    monkeypatch.setattr(encode.EncodedStateDict, "packed_checksums", counting)
    return calls


def state_dict() -> dict:
    """About 6 MB, so two sources share several 1 MiB checksum blocks; "big" holds nearly all of it."""
    torch.manual_seed(1)
    model = torch.nn.Linear(5, 3)
    optim = torch.optim.Adam(model.parameters(), lr=0.001)
    model(torch.randn(2, 5)).sum().backward()
    optim.step()
    return {"user": {"model": model.state_dict(), "optim": optim.state_dict(), "big": torch.randn(1_500_000),
                     "half": torch.randn(7, 3).to(torch.bfloat16)},
            "torchft": {"step": 5, "batches_committed": 10}}


def sources(*servers: HTTPTransport) -> list[tuple[int, str]]:
    return [(rank, server.metadata()) for rank, server in enumerate(servers)]


def publish(make_transport, *states) -> list[HTTPTransport]:
    """A server per state, each publishing it as step 5 for one receiver (with an hour's send timeout)."""
    servers = [make_transport() for _ in states]
    for server, state in zip(servers, states):
        server.send_checkpoint([1], 5, state, HOUR)
    return servers


def release_all(threads, *servers: HTTPTransport) -> None:
    """disallow_checkpoint on every server; with an hour's send timeout this only returns if receivers reported."""
    for released in [threads.submit(server.disallow_checkpoint) for server in servers]:
        released.result(WAIT)


def layout(state) -> tuple[int, spec.Blocks]:
    """``(bytes of the prefix and header, the checksum blocks)`` of ``state``'s encoding."""
    header, header_end = read_header(encode.encode_to_bytes(5, state))
    return header_end, header.blocks


def answer_bytes(blocks: spec.Blocks, ranges) -> int:
    """Bytes of the answers to data requests for ``ranges``: the data and one sum per block."""
    return sum(end - start + len(blocks.covering(start, end)) * checksum.SUM_BYTES for start, end in ranges)


def primary_ranges(blocks: spec.Blocks, sources: int) -> list[tuple[int, int]]:
    """The ranges the primary serves unless a secondary fails: range ``i`` goes to source ``i % sources``."""
    return blocks.split(sources)[::sources]


def span(blocks: spec.Blocks, block: int) -> tuple[int, int]:
    start, end, _ = blocks.spans[block]
    return start, end


def serve_data_through(monkeypatch, server: HTTPTransport, edit) -> None:
    """``server`` passes the pieces of every data answer through ``edit(pieces)`` (a generator of pieces)."""
    checkpoint_server = server._server  # its CheckpointServer, which answers the requests
    honest = checkpoint_server._pieces

    def pieces(request, encoded, part, sums):
        pieces, length, data_bytes = honest(request, encoded, part, sums)
        return (edit(pieces) if part == "data" else pieces), length, data_bytes

    monkeypatch.setattr(checkpoint_server, "_pieces", pieces)


# ---------------------------------------------------------------- agreeing sources


def test_two_agreeing_sources_stripe_an_exact_copy_and_only_the_primary_sums(make_transport, threads, patient,
                                                                            checksum_passes, warnings):
    sent = state_dict()
    first, second = publish(make_transport, sent, sent)
    received = make_transport().recv_checkpoint_striped(sources(first, second), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    assert torch.equal(received["user"]["big"], sent["user"]["big"])
    assert checksum_passes == [5]  # the primary vouched for the blocks the secondary served; nobody else summed
    assert warnings() == []
    served = [server.statistics().bytes_served for server in (first, second)]
    assert all(count > 2_000_000 for count in served), served  # both sent a share
    for server in (first, second):
        assert server.statistics().receivers_finished == 1
    release_all(threads, first, second)


@pytest.mark.parametrize("num_chunks", [0, 4])
def test_a_single_source_heal_asks_for_no_checksums(make_transport, checksum_passes, num_chunks):
    server = make_transport()
    sent = state_dict()
    server.send_checkpoint([1], 5, sent, LONG)
    received = make_transport(num_chunks=num_chunks).recv_checkpoint(0, server.metadata(), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    assert checksum_passes == []
    server.disallow_checkpoint()


# ---------------------------------------------------------------- secondaries whose state differs


def test_a_secondary_that_differs_in_a_block_it_served_is_replaced_by_the_primarys_block(make_transport, threads,
                                                                                        patient, warnings):
    sent = state_dict()
    diverged = copy.deepcopy(sent)
    diverged["user"]["big"][1_400_000] += 1.0  # in big's last block, bytes [5 MiB, 6 MB): the secondary's range
    first, second = publish(make_transport, sent, diverged)
    received = make_transport().recv_checkpoint_striped(sources(first, second), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    assert received["user"]["big"][1_400_000] == sent["user"]["big"][1_400_000]
    [warning] = warnings()
    assert re.search(r"step 5: data from replica 1 \(\S+\): 1 blocks \(757120 bytes\), first tensor user\.big bytes "
                     r"\[5242880, 6000000\) differs from the primary replica 0 .*fetching those 1 blocks \(757120 "
                     r"bytes\) again", warning), warning
    header, blocks = layout(sent)
    refetched = [(block_start, block_end) for block_start, block_end, _ in blocks.spans
                 if block_end - block_start == 757120]
    assert first.statistics().bytes_served == (header + answer_bytes(blocks, primary_ranges(blocks, 2))
                                               + len(blocks) * checksum.SUM_BYTES  # its /checksums
                                               + answer_bytes(blocks, refetched))
    release_all(threads, first, second)


def test_a_secondary_that_differs_only_where_the_primary_served_changes_nothing(make_transport, threads, patient,
                                                                                warnings):
    sent = state_dict()
    diverged = copy.deepcopy(sent)
    diverged["user"]["big"][10] += 1.0  # in big's first block: the primary's range
    first, second = publish(make_transport, sent, diverged)
    received = make_transport().recv_checkpoint_striped(sources(first, second), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    assert warnings() == []
    release_all(threads, first, second)


def batchnorm_state(data_seed: int) -> dict:
    """Equal weights everywhere; the BatchNorm running statistics depend on the data this group saw."""
    torch.manual_seed(0)
    big = torch.randn(1_500_000)
    model = torch.nn.Sequential(OrderedDict(linear=torch.nn.Linear(8, 16), bn=torch.nn.BatchNorm1d(16)))
    torch.manual_seed(data_seed)
    model(torch.randn(32, 8))  # train mode: updates running_mean and running_var, never averaged across groups
    return {"user": {"big": big, "model": model.state_dict()}, "torchft": {"step": 5}}


def test_a_secondary_whose_batchnorm_statistics_differ_yields_the_primarys(make_transport, threads, patient,
                                                                          warnings):
    mine, theirs = batchnorm_state(data_seed=1), batchnorm_state(data_seed=2)
    assert not torch.equal(mine["user"]["model"]["bn.running_mean"], theirs["user"]["model"]["bn.running_mean"])
    first, second = publish(make_transport, mine, theirs)
    received = make_transport().recv_checkpoint_striped(sources(first, second), 5, LONG)
    assert digest(5, received) == digest(5, mine)
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "linear.weight"):
        assert torch.equal(received["user"]["model"][name], mine["user"]["model"][name]), name
    [warning] = warnings()
    assert re.search(r"replica 1 \(\S+\): 2 blocks \(128 bytes\), first tensor user\.model\.bn\.running_mean "
                     r"bytes \[0, 64\)", warning), warning
    header, blocks = layout(mine)
    statistics = [i for i, (_, _, tensor) in enumerate(blocks.spans) if tensor in (5, 6)]  # running mean, var
    refetched = [(blocks.spans[statistics[0]][0], blocks.spans[statistics[-1]][1])]  # adjacent: one range
    assert first.statistics().bytes_served == (header + answer_bytes(blocks, primary_ranges(blocks, 2))
                                               + len(blocks) * checksum.SUM_BYTES + answer_bytes(blocks, refetched))
    release_all(threads, first, second)


def test_a_secondary_with_another_optimizer_lr_is_logged_and_the_primarys_header_used(make_transport, threads,
                                                                                     patient, warnings):
    sent = state_dict()
    diverged = copy.deepcopy(sent)
    diverged["user"]["optim"]["param_groups"][0]["lr"] = 0.002
    diverged["torchft"]["batches_committed"] = 11
    first, second = publish(make_transport, sent, diverged)
    received = make_transport().recv_checkpoint_striped(sources(first, second), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    assert received["user"]["optim"]["param_groups"][0]["lr"] == 0.001
    assert received["torchft"]["batches_committed"] == 10
    [warning] = warnings()  # the data agrees: nothing fetched again
    assert re.search(r"replica 0 \(\S+\) and replica 1 \(\S+\) disagree about step 5: value at "
                     r"user\.optim\.param_groups\.0\.lr: 0\.001 vs 0\.002; the heal takes the header of the primary "
                     r"replica 0", warning), warning
    release_all(threads, first, second)


def test_a_secondary_whose_shapes_differ_at_equal_sizes_yields_the_primarys_shapes(make_transport, threads,
                                                                                  patient, warnings):
    """Same bytes, so every data range lines up and agrees: only the header tells the layouts apart."""
    sent = state_dict()
    diverged = copy.deepcopy(sent)
    diverged["user"]["half"] = sent["user"]["half"].reshape(3, 7).clone()
    first, second = publish(make_transport, sent, diverged)
    received = make_transport().recv_checkpoint_striped(sources(first, second), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    assert received["user"]["half"].shape == (7, 3)
    [warning] = warnings()
    assert "disagree about step 5: structure: tensor user.half is bfloat16[7, 3] vs bfloat16[3, 7]" in warning
    release_all(threads, first, second)


def test_of_three_sources_the_diverged_one_is_named_and_its_blocks_fetched_again(make_transport, threads, patient,
                                                                                warnings, checksum_passes):
    sent = state_dict()
    diverged = copy.deepcopy(sent)
    diverged["user"]["big"][-1] = 7.0  # big's last block: in the third range
    servers = publish(make_transport, sent, sent, diverged)
    received = make_transport().recv_checkpoint_striped(sources(*servers), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    [warning] = warnings()
    assert re.search(r"data from replica 2 \(\S+\): 1 blocks \(757120 bytes\), first tensor user\.big bytes "
                     r"\[5242880, 6000000\) differs", warning), warning
    assert "replica 1" not in warning
    assert checksum_passes == [5]
    header, blocks = layout(sent)
    refetched = [(start, end) for start, end, _ in blocks.spans if end - start == 757120]
    assert servers[0].statistics().bytes_served == (header + answer_bytes(blocks, primary_ranges(blocks, 3))
                                                    + len(blocks) * checksum.SUM_BYTES
                                                    + answer_bytes(blocks, refetched))
    release_all(threads, *servers)


def test_a_receive_in_place_from_a_diverged_secondary_ends_with_the_primarys_bytes(make_transport, threads, patient,
                                                                                   warnings):
    sent = state_dict()
    diverged = copy.deepcopy(sent)
    diverged["user"]["big"].mul_(2)
    local = copy.deepcopy(sent)
    local["user"]["big"].zero_()
    big = local["user"]["big"]
    first, second = publish(make_transport, sent, diverged)
    client = make_transport(num_chunks=4, state_dict=lambda: local)
    received = client.recv_checkpoint_striped(sources(first, second), 5, LONG)
    assert received["user"]["big"] is big  # the secondary's bytes landed in it first, then the primary's
    assert torch.equal(big, sent["user"]["big"])
    assert digest(5, received) == digest(5, sent)
    assert any("data from replica 1" in warning and "user.big" in warning for warning in warnings())
    release_all(threads, first, second)


def test_after_a_heal_that_fetched_blocks_again_both_sources_are_released_and_the_next_heal_works(
        make_transport, threads, patient, warnings):
    sent = state_dict()
    diverged = copy.deepcopy(sent)
    diverged["user"]["big"][-1] = -1.0
    diverged["torchft"]["batches_committed"] = 11
    first, second = publish(make_transport, sent, diverged)
    client = make_transport()
    assert digest(5, client.recv_checkpoint_striped(sources(first, second), 5, LONG)) == digest(5, sent)
    assert len(warnings()) == 2  # the header, then the data
    for server in (first, second):
        assert server.statistics().receivers_finished == 1  # the receiver said it had finished
    release_all(threads, first, second)  # without that report, an hour's wait
    sent["torchft"]["step"] = 6
    for server in (first, second):
        server.send_checkpoint([1], 6, sent, HOUR)
    received = client.recv_checkpoint_striped(sources(first, second), 6, LONG)
    assert digest(6, received) == digest(6, sent)
    release_all(threads, first, second)


# ---------------------------------------------------------------- secondaries that fail


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


@pytest.mark.parametrize("how", ["refused", "silent", "unpublished", "another-step"])
def test_a_secondary_that_cannot_serve_leaves_its_ranges_to_the_primary(make_transport, threads, warnings,
                                                                        checksum_passes, how):
    """Refused, a socket that never answers, a step not (yet) published, a newer step (HTTP 400)."""
    primary = make_transport()
    sent = state_dict()
    primary.send_checkpoint([1], 5, sent, HOUR)
    silent = socket.create_server(("127.0.0.1", 0))  # listens; never accepts, never answers
    try:
        if how == "refused":
            secondary = f"http://127.0.0.1:{closed_port()}/checkpoint"
        elif how == "silent":
            secondary = f"http://127.0.0.1:{silent.getsockname()[1]}/checkpoint"
        else:
            server = make_transport()
            if how == "another-step":
                server.send_checkpoint([1], 6, sent, timedelta(seconds=1))  # its receiver never comes
            secondary = server.metadata()
        received = make_transport().recv_checkpoint_striped([(0, primary.metadata()), (1, secondary)], 5, LONG)
    finally:
        silent.close()
    assert digest(5, received) == digest(5, sent)
    assert any(re.search(r"step 5: replica 1 \(\S+\) (failed|has sent nothing).*; fetching data bytes \[\d+, \d+\) "
                         r"from the primary replica 0", warning) for warning in warnings()), warnings()
    header, blocks = layout(sent)
    assert primary.statistics().bytes_served == header + answer_bytes(blocks, [(0, blocks.data_bytes)])
    assert checksum_passes == []  # the primary served every block: nothing to compare
    release_all(threads, primary)


def test_a_secondary_that_cuts_its_range_short_is_replaced_whole_by_the_primary(make_transport, monkeypatch,
                                                                               threads, warnings):
    """The first block of its range arrives whole, the second never: both must be taken again, not "twice"."""
    first, second = make_transport(), make_transport()
    sent = state_dict()
    serve_data_through(monkeypatch, second, lambda pieces: itertools.islice(pieces, 1))
    for server in (first, second):
        server.send_checkpoint([1], 5, sent, HOUR)
    received = make_transport().recv_checkpoint_striped(sources(first, second), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    assert any("replica 1" in warning and "failed" in warning for warning in warnings()), warnings()
    header, blocks = layout(sent)
    assert first.statistics().bytes_served == header + answer_bytes(blocks, [(0, blocks.data_bytes)])
    release_all(threads, first, second)


def test_a_secondary_shut_down_mid_heal_leaves_the_heal_to_the_primary(make_transport, monkeypatch, threads,
                                                                      warnings):
    first, second = make_transport(), make_transport()
    sent = state_dict()

    def shut_down_after_one(pieces):
        yield next(pieces)
        second.shutdown(wait=False)
        raise ConnectionResetError("the replica went away")

    serve_data_through(monkeypatch, second, shut_down_after_one)
    for server in (first, second):
        server.send_checkpoint([1], 5, sent, HOUR)
    received = make_transport().recv_checkpoint_striped(sources(first, second), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    assert any("replica 1" in warning and "failed" in warning for warning in warnings()), warnings()
    release_all(threads, first)


def test_a_secondary_whose_bytes_fail_its_own_checksums_is_replaced_by_the_primary(make_transport, monkeypatch,
                                                                                  threads, patient, warnings):
    first, second = make_transport(), make_transport()
    sent = state_dict()

    def damaged(pieces):
        for i, piece in enumerate(pieces):  # each block is summed before it is yielded: its sum stays honest
            piece = bytearray(piece)
            if i == 0:
                piece[100] ^= 0xFF
            yield piece

    serve_data_through(monkeypatch, second, damaged)
    for server in (first, second):
        server.send_checkpoint([1], 5, sent, HOUR)
    received = make_transport().recv_checkpoint_striped(sources(first, second), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    header, blocks = layout(sent)
    first_damaged = blocks.covering(*blocks.split(2)[1])[0]
    start, end = span(blocks, first_damaged)
    [warning] = warnings()
    assert re.search(rf"replica 1 \(\S+\): 1 blocks \({end - start} bytes\), first tensor user\.big", warning), warning
    assert first.statistics().bytes_served == (header + answer_bytes(blocks, primary_ranges(blocks, 2))
                                               + len(blocks) * checksum.SUM_BYTES
                                               + answer_bytes(blocks, [(start, end)]))
    release_all(threads, first, second)


def test_a_secondary_with_another_layout_leaves_its_ranges_to_the_primary(make_transport, threads, warnings):
    """An extra tensor moves every offset: the primary's ranges fall off the secondary's blocks (HTTP 400)."""
    first, second = make_transport(), make_transport()
    sent = state_dict()
    shifted = {"user": {"extra": torch.ones(3), **sent["user"]}, "torchft": sent["torchft"]}
    first.send_checkpoint([1], 5, sent, HOUR)
    second.send_checkpoint([1], 5, shifted, HOUR)
    received = make_transport().recv_checkpoint_striped(sources(first, second), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    assert "extra" not in received["user"]
    assert any("replica 1" in warning and "failed (HTTP 400" in warning for warning in warnings()), warnings()
    release_all(threads, first, second)


# ---------------------------------------------------------------- the /checksums route


def test_checksums_are_every_blocks_sum_and_leave_the_session_open(make_transport, threads):
    server = make_transport(token="s3cret")
    sent = state_dict()
    server.send_checkpoint([1], 5, sent, HOUR)
    base = f"{server.metadata()}/5"
    status, body, _ = fetch(f"{base}/checksums?session=s1", headers=bearer("s3cret"))
    assert status == 200
    blob = encode.encode_to_bytes(5, sent)
    header_length, _ = spec.unpack_prefix(blob[:spec.PREFIX_SIZE])
    data_end = spec.PREFIX_SIZE + header_length + sum(t.numel() * t.element_size()
                                                      for t in encode.flatten(sent).tensors)
    assert body == blob[data_end:]  # the trailer a whole-stream receiver gets
    assert len(checksum.unpack(body)) == 6 + len(encode.flatten(sent).tensors) - 1  # big spans six blocks
    assert server.statistics().receivers_finished == 0  # asking for sums finishes nothing
    assert fetch(f"{base}/done?session=s1&ok=1", "POST", bearer("s3cret"))[0] == 200
    assert server.statistics().receivers_finished == 1
    threads.submit(server.disallow_checkpoint).result(WAIT)  # the report released it: no hour-long wait


@pytest.mark.parametrize("path, token, status", [
    ("/4/checksums?session=s1", "s3cret", 400),  # an older step than the one served (torchft's 400)
    ("/5/checksums?session=s1", None, 401),
    ("/5/checksums?session=s1", "guess", 401),
    ("/5/checksums", "s3cret", 400),  # no session
    ("/5/checksums?session=bad%20id!", "s3cret", 400),
    ("/five/checksums?session=s1", "s3cret", 400),
    ("/5/checksums?session=s1&timeout=abc", "s3cret", 400),
    ("/5/checksums?session=s1&timeout=nan&start=x&end=%zz", "s3cret", 200),  # what it doesn't use, it ignores
])
def test_checksum_requests_with_bad_arguments_are_answered_clearly(make_transport, threads, path, token, status):
    server = make_transport(token="s3cret")
    server.send_checkpoint([1], 5, state_dict(), HOUR)
    answer, body, _ = fetch(server.metadata() + path, headers=bearer(token))
    assert answer == status, body
    # a done counts only from a session that asked
    fetch(server.metadata() + "/5/header?session=s1", headers=bearer("s3cret"))
    fetch(server.metadata() + "/5/done?session=s1&ok=0", "POST", bearer("s3cret"))
    threads.submit(server.disallow_checkpoint).result(WAIT)


def test_checksums_of_a_released_step_are_refused(make_transport):
    server = make_transport()
    server.send_checkpoint([], 5, state_dict(), LONG)
    server.disallow_checkpoint()
    status, body, _ = fetch(f"{server.metadata()}/4/checksums?session=s1")
    assert status == 400 and b"released" in body
    status, body, _ = fetch(f"{server.metadata()}/5/checksums?session=s1&timeout=0.2")  # may be retried: held
    assert status == 504 and b"not published within" in body


# ---------------------------------------------------------------- describing a header difference


def header_of(step: int, state: dict) -> spec.Header:
    return read_header(encode.encode_to_bytes(step, state))[0]


@pytest.mark.parametrize("other, expected", [
    ((6, {"a": torch.ones(2), "b": [1, 2.5]}), "step 5 vs step 6"),
    ((5, {"a": torch.ones(3), "b": [1, 2.5]}), "structure: tensor a is float32[2] vs float32[3]"),
    ((5, {"a": torch.ones(2, dtype=torch.float64), "b": [1, 2.5]}), "tensor a is float32[2] vs float64[2]"),
    ((5, {"z": torch.ones(2), "b": [1, 2.5]}), "structure: tensor 0 is a vs z"),
    ((5, {"a": torch.ones(2), "b": [1, 2.5], "c": torch.ones(1)}), "1 vs 2 tensors (tensor c is only in one)"),
    ((5, {"a": torch.ones(2), "b": [1, 2.5, 3]}), "structure: 2 vs 3 items at b"),
    ((5, {"a": torch.ones(2), "b": [1, 3.5]}), "value at b.1: 2.5 vs 3.5"),
    ((5, {"a": torch.ones(2), "c": [1, 2.5]}), "structure: the keys at <root> differ"),
])
def test_a_header_difference_is_named(other, expected):
    mine = header_of(5, {"a": torch.ones(2), "b": [1, 2.5]})
    assert expected in _http_receive.header_difference(mine, header_of(*other))
