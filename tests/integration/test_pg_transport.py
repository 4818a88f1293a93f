"""PGTransport between this process and a spawned peer over a real gloo process group.

One peer process serves the module; each test rendezvouses a fresh gloo group
on its own store prefix, so a test that leaves a receive pending (the timeout
test) cannot disturb the next.
"""

import itertools
import queue
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import WAIT, cpu_mesh, dtensor
from tests.integration.helpers import digest
from torchft_lite.checkpointing.pg_transport import PGTransport
from torchft_lite.errors import CheckpointTimeout, CheckpointTransferError

pytestmark = pytest.mark.integration

LONG = timedelta(seconds=WAIT)
LATE = 1.0  # seconds a "late-send" peer waits before sending


def state_dict(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    optim.step()
    return {"user": {"model": model.state_dict(), "optim": optim.state_dict(), "bf16": torch.randn(5).bfloat16()},
            "torchft": {"step": seed, "note": ("x", None, b"\x02")}}


def sharded_state(seed: int) -> dict:
    """A DTensor (a rank's shard of an 8x3 weight over a 4-rank mesh) beside plain values."""
    from torch.distributed.tensor import Shard

    torch.manual_seed(seed)
    weight = dtensor(torch.randn(2, 3), cpu_mesh([0, 1, 2, 3], ("fsdp",)), [Shard(0)], (8, 3))
    return {"weight": weight, "step": seed}


def gloo_group(store: dist.Store, prefix: str, rank: int) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, timedelta(seconds=WAIT))


def peer_main(port: int, commands: "mp.Queue", results: "mp.Queue") -> None:
    """Rank 1: run commands from the test until told to stop (or the test goes quiet)."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=WAIT))
    while True:
        try:
            command = commands.get(timeout=5 * WAIT)
        except queue.Empty:
            return
        if command[0] == "stop":
            return
        action, prefix, step, seed = command
        try:
            transport = PGTransport(gloo_group(store, prefix, 1), LONG, bucket_bytes=1000)
            if action == "idle":
                continue  # joined the group; sends nothing (the group lives until the next command)
            if action in ("send", "late-send", "send-dtensor"):
                if action == "late-send":
                    time.sleep(LATE)
                sent = sharded_state(seed) if action == "send-dtensor" else state_dict(seed)
                transport.send_checkpoint([0], step, sent)  # the constructor's timeout
                results.put(("ok", None))
            else:
                results.put(("ok", digest(step, transport.recv_checkpoint(0, "<n/a>", step, LONG))))
        except Exception as exc:  # reported to the test, which fails with it
            results.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


@pytest.fixture(scope="module")
def peer():
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=WAIT))
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=peer_main, args=(store.port, commands, results), daemon=True)
    process.start()
    prefixes = (f"test{i}" for i in itertools.count())
    try:
        def ask(action: str, step: int, seed: int = 0) -> dist.ProcessGroup:
            prefix = next(prefixes)
            commands.put((action, prefix, step, seed))
            return gloo_group(store, prefix, 0)

        def answer():
            status, value = results.get(timeout=WAIT)
            assert status == "ok", value
            return value

        yield ask, answer
    finally:
        commands.put(("stop",))
        process.join(WAIT)
        if process.is_alive():
            process.kill()
            process.join()


def test_send_and_receive_a_state_dict(peer):
    ask, answer = peer
    sent = state_dict(seed=3)
    transport = PGTransport(ask("recv", step=3), LONG, bucket_bytes=1000)  # many buckets, split mid-tensor
    transport.send_checkpoint([1], 3, sent, LONG)
    assert answer() == digest(3, sent)


def test_receive_in_place_keeps_tensor_identity(peer):
    ask, answer = peer
    local = state_dict(seed=1)
    transport = PGTransport(ask("send", step=4, seed=4), LONG, state_dict=lambda: local)
    received = transport.recv_checkpoint(1, "<n/a>", 4, LONG)
    answer()
    assert digest(4, received) == digest(4, state_dict(seed=4))
    assert received["user"]["model"]["0.weight"] is local["user"]["model"]["0.weight"]
    assert received["user"]["optim"]["state"][0]["exp_avg"] is local["user"]["optim"]["state"][0]["exp_avg"]
    assert torch.equal(local["user"]["bf16"], state_dict(seed=4)["user"]["bf16"])


def test_a_wrong_step_is_refused_and_the_pair_stays_usable(peer):
    ask, answer = peer
    transport = PGTransport(ask("send", step=4, seed=4), LONG)
    with pytest.raises(CheckpointTransferError, match="sent step 4, expected step 5"):
        transport.recv_checkpoint(1, "<n/a>", 5, LONG)
    answer()  # the sender finished: its buckets were drained


def test_a_receive_with_nothing_sent_times_out(peer):
    ask, _ = peer
    transport = PGTransport(ask("idle", step=0), LONG)
    with pytest.raises(CheckpointTimeout, match="announcement from rank 1"):
        transport.recv_checkpoint(1, "<n/a>", 5, timedelta(seconds=1))


def test_the_timeout_defaults_to_the_constructors(peer):
    ask, answer = peer
    transport = PGTransport(ask("send", step=4, seed=4), LONG)
    received = transport.recv_checkpoint(1, "<n/a>", 4)  # and the peer sent without one too
    answer()
    assert digest(4, received) == digest(4, state_dict(seed=4))


@pytest.mark.parametrize("per_call", [None, "omitted"])
def test_without_a_timeout_of_its_own_a_receive_keeps_the_constructors(peer, per_call):
    ask, _ = peer
    transport = PGTransport(ask("idle", step=0), timedelta(milliseconds=200))
    kwargs = {} if per_call == "omitted" else {"timeout": None}
    with pytest.raises(RuntimeError, match="timed out waiting for the checkpoint announcement from rank 1") as caught:
        transport.recv_checkpoint(1, "<n/a>", 5, **kwargs)
    assert isinstance(caught.value, CheckpointTimeout) and isinstance(caught.value, TimeoutError)


def test_a_zero_timeout_leaves_the_deadline_to_the_process_group(peer):
    ask, answer = peer
    # The transport's own default (50 ms) is far shorter than the peer's delay; the group's (WAIT) is not.
    transport = PGTransport(ask("late-send", step=6, seed=6), timedelta(milliseconds=50))
    received = transport.recv_checkpoint(1, "<n/a>", 6, timedelta(0))
    answer()
    assert digest(6, received) == digest(6, state_dict(seed=6))


def test_a_dtensor_travels_as_its_local_shard_and_layout(peer):
    ask, answer = peer
    transport = PGTransport(ask("send-dtensor", step=2, seed=2), LONG)
    received = transport.recv_checkpoint(1, "<n/a>", 2, LONG)
    answer()
    sent = sharded_state(seed=2)
    assert received["weight"]._spec == sent["weight"]._spec and received["step"] == 2
    assert torch.equal(received["weight"]._local_tensor, sent["weight"]._local_tensor)
