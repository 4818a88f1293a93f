"""HTTPTransport with what torchft users send and run: DTensors in the state dict, and the transport bench."""

import json
from datetime import timedelta

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from tests.conftest import WAIT, cpu_mesh, dtensor
from torchft_lite.checkpointing import http_transport_bench
from torchft_lite.serialization import encode

pytestmark = pytest.mark.integration

LONG = timedelta(seconds=WAIT)


def fsdp_state(mesh: DeviceMesh, seed: int) -> dict:
    """Rank 0's shards of an FSDP-style model: parameters and optimizer moments as DTensors."""
    torch.manual_seed(seed)
    return {"model": {"w": dtensor(torch.randn(300_000, 2), mesh, [Shard(0)], (1_200_000, 2)),
                      "b": dtensor(torch.randn(2), mesh, [Replicate()], (2,))},
            "optim": {"state": {0: {"exp_avg": dtensor(torch.randn(300_000, 2), mesh, [Shard(0)],
                                                       (1_200_000, 2)),
                                    "step": torch.tensor(3.0)}}},
            "step": seed}


def own_mesh() -> DeviceMesh:
    """A mesh of four ranks (as rank 0), one of its own for each state dict."""
    return cpu_mesh([0, 1, 2, 3], ("fsdp",))


@pytest.mark.parametrize("num_chunks", [0, 3])
def test_dtensors_heal_as_local_shards_onto_the_receivers_own_tensors(make_transport, num_chunks):
    sent = fsdp_state(own_mesh(), seed=5)
    mine = fsdp_state(own_mesh(), seed=1)  # the healing replica's own (stale) state, on its own mesh
    server = make_transport()
    client = make_transport(num_chunks=num_chunks, state_dict=lambda: mine)
    server.send_checkpoint([1], 5, sent, LONG)
    got = client.recv_checkpoint(0, server.metadata(), 5, LONG)
    server.disallow_checkpoint()
    assert got["model"]["w"] is mine["model"]["w"]  # received in place, into the local shard
    for path in (("model", "w"), ("model", "b"), ("optim", "state", 0, "exp_avg")):
        sent_value, got_value = sent, got
        for key in path:
            sent_value, got_value = sent_value[key], got_value[key]
        assert got_value._spec == sent_value._spec
        assert torch.equal(got_value._local_tensor, sent_value._local_tensor)
    # Only the local shards travelled: the served bytes are about their size, not the global tensors'.
    shard_bytes = sum(t.numel() * t.element_size() for t in encode.flatten(sent).tensors)
    assert shard_bytes <= server.statistics().bytes_served < 1.1 * shard_bytes


def test_a_receiver_without_a_state_dict_gets_dtensors_on_a_rebuilt_mesh(make_transport):
    sent = fsdp_state(own_mesh(), seed=5)
    server, client = make_transport(), make_transport()
    server.send_checkpoint([1], 5, sent, LONG)
    got = client.recv_checkpoint(0, server.metadata(), 5, LONG)
    server.disallow_checkpoint()
    assert got["model"]["w"].device_mesh == sent["model"]["w"].device_mesh
    assert got["model"]["w"]._spec == sent["model"]["w"]._spec
    assert torch.equal(got["model"]["w"]._local_tensor, sent["model"]["w"]._local_tensor)


def test_the_bench_runs_with_torchfts_flags_and_prints_one_json_line(capsys):
    results = http_transport_bench.main(["--chunk-size=40", "--num-chunks=2", "--total-size=400", "--device=cpu"])
    first_line = capsys.readouterr().out.splitlines()[0]
    assert json.loads(first_line) == results
    assert results["bytes"] == 400 and results["tensors"] == 10 and results["num_chunks"] == 2
    assert results["fetch_s"] > 0


def test_the_bench_refuses_nonsense_sizes(capsys):
    with pytest.raises(SystemExit):
        http_transport_bench.main(["--chunk-size=2"])
    assert "--chunk-size must be >= 4" in capsys.readouterr().err
