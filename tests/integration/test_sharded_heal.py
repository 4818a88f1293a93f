"""Heals of FSDP2-sharded state, end to end over both transports: 2 replica groups x 2 ranks, 4 processes.

Each group is a gloo world of its own with a 1-D CPU mesh and an FSDP2
(``fully_shard``) model whose rows split unevenly over its two ranks. Group 1
(stale: other weights, other optimizer moments) heals from group 0: group rank
``r`` receives from group rank ``r`` of the source, over a process group of
those two ranks (PGTransport) or from that rank's checkpoint server
(HTTPTransport). What must hold:

* rank ``r`` gets exactly rank ``r``'s shards, and only them: the bytes on the
  wire are the local shards' (plus a header), never the full tensors;
* they land in the receiver's own DTensors (the very objects its state dict
  holds, on its own mesh), so the model trains on them without a reload;
* afterwards the two groups hold the same parameters (gathered inside each
  group, as the check, not as part of the heal) and step identically.
"""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.conftest import WAIT
from tests.integration.helpers import shard_digests, tensor_digest
from tests.integration.spawned import put_outcome, run_spawned

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG = timedelta(seconds=WAIT)
STEP = 5
IN, HIDDEN, OUT = 64, 301, 63  # 301 and 63 rows over 2 ranks: uneven shards (151/150, 32/31)
HEADER_ALLOWANCE = 32 << 10  # prefix, JSON header, checksums and PGTransport's meta message


class CountingPairGroup:
    """A process group of two ranks that counts the bytes it receives (what PGTransport needs of one)."""

    def __init__(self, inner: dist.ProcessGroup) -> None:
        self.inner, self.received = inner, 0

    def send(self, tensors, dst_rank, tag):
        return self.inner.send(tensors, dst_rank, tag)

    def recv(self, tensors, src_rank, tag):
        self.received += sum(t.numel() * t.element_size() for t in tensors)
        return self.inner.recv(tensors, src_rank, tag)


def build(group: int):
    """This group's FSDP2 model and AdamW, trained on this group's own data (identical on its two ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    torch.manual_seed(group)  # the same initial weights on both ranks of a group, other ones in the other group
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2 - group):  # the source is a step ahead
        train_step(model, optimizer, seed=100 * group + step)
    return mesh, model, optimizer


def train_step(model, optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(8, IN, generator=generator)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def worker(group: int, rank: int, port: int, kind: str, results: "mp.Queue") -> None:
    put_outcome(results, f"group {group} rank {rank}", lambda: (group, rank, heal(group, rank, port, kind)))


def heal(group: int, rank: int, port: int, kind: str) -> dict:
    from torch.distributed.tensor import DTensor

    from torchft_lite.checkpointing import HTTPTransport
    from torchft_lite.checkpointing.pg_transport import PGTransport
    from torchft_lite.serialization.encode import flatten

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=LONG)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"group{group}/", store), rank=rank, world_size=2,
                            timeout=LONG)
    try:
        mesh, model, optimizer = build(group)
        own = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        flat = flatten(own)
        report: dict = {"before": shard_digests(own), "shard_bytes": sum(t.nbytes for t in flat.tensors),
                        "full_bytes": sum(leaf.numel() * leaf.element_size() for leaf in flat.leaves)}
        pair = dist.ProcessGroupGloo(dist.PrefixStore(f"pair{rank}/", store), group, 2, LONG) \
            if kind == "pg" else None
        if group == 0:  # the source: serve this rank's shards to the same rank of group 1
            if kind == "pg":
                PGTransport(pair, LONG).send_checkpoint([1], STEP, own, LONG)
            else:
                transport = HTTPTransport(LONG, hostname="127.0.0.1", bind_host="127.0.0.1")
                try:
                    transport.send_checkpoint([1], STEP, own, LONG)
                    store.set(f"metadata{rank}", transport.metadata())
                    store.get(f"received{rank}")  # waits (bounded by the store's timeout) for the receiver
                    report["wire_bytes"] = transport.statistics().bytes_served
                    transport.disallow_checkpoint()
                finally:
                    transport.shutdown()
        else:  # the healing group: receive into its own state dict's tensors
            if kind == "pg":
                counting = CountingPairGroup(pair)
                got = PGTransport(counting, LONG, state_dict=lambda: own).recv_checkpoint(0, "<n/a>", STEP, LONG)
                report["wire_bytes"] = counting.received
            else:
                transport = HTTPTransport(LONG, hostname="127.0.0.1", bind_host="127.0.0.1", state_dict=lambda: own)
                try:
                    got = transport.recv_checkpoint(0, store.get(f"metadata{rank}").decode(), STEP, LONG)
                finally:
                    store.set(f"received{rank}", "1")
                    transport.shutdown()
            got_flat = flatten(got)
            report["in_place"] = all(mine is theirs for mine, theirs in zip(flat.leaves, got_flat.leaves))
            report["own_mesh"] = all(leaf.device_mesh is mesh for leaf in got_flat.leaves if isinstance(leaf, DTensor))
            report["dtensors"] = sum(isinstance(leaf, DTensor) for leaf in got_flat.leaves)
            model.load_state_dict(got["model"])  # as a Manager's load_state_dict fn does
            optimizer.load_state_dict(got["optim"])
        report["after"] = shard_digests({"model": model.state_dict(), "optim": optimizer.state_dict()})
        # The checks (not part of the heal): gather inside the group, then one identical step in both groups.
        report["full"] = {name: tensor_digest(p.full_tensor()) for name, p in model.named_parameters()}
        train_step(model, optimizer, seed=999)
        report["stepped"] = {name: tensor_digest(p.full_tensor()) for name, p in model.named_parameters()}
        return report
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["pg", "http"])
def test_each_rank_heals_its_own_shards_from_the_same_rank_of_its_source(kind):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=LONG)
    arg_lists = [(group, rank, store.port, kind) for group in (0, 1) for rank in (0, 1)]
    values = run_spawned(worker, arg_lists, "the heal's four processes", 4 * WAIT)
    reports = {(group, rank): report for group, rank, report in values}

    for rank in (0, 1):
        source, healed = reports[0, rank], reports[1, rank]
        assert healed["before"] != source["before"]  # it was stale
        assert healed["after"] == source["after"] == source["before"]  # exactly this rank's shards of the source
        assert healed["in_place"] and healed["own_mesh"] and healed["dtensors"] == 12  # 4 params, 2 x 4 moments
        # Only the local shards travelled: the data on the wire is this rank's shard bytes (plus a header),
        # about half of the full tensors'.
        assert healed["shard_bytes"] == source["shard_bytes"] < 0.51 * healed["full_bytes"]
        wire = healed["wire_bytes"] if kind == "pg" else source["wire_bytes"]
        assert healed["shard_bytes"] <= wire <= healed["shard_bytes"] + HEADER_ALLOWANCE
    assert reports[1, 0]["after"] != reports[1, 1]["after"]  # the two ranks hold different shards
    assert reports[0, 0]["shard_bytes"] > reports[0, 1]["shard_bytes"]  # uneven: 151 rows vs 150
    # Both groups now hold the same model and optimizer: the gathered parameters agree, before and after a step.
    for key in ("full", "stepped"):
        assert reports[0, 0][key] == reports[0, 1][key] == reports[1, 0][key] == reports[1, 1][key]
