"""A trainer loads no lighthouse server code: only the RPC kit, the lighthouse client and the wire protocol.

The probe runs in a fresh interpreter (what a training script is) against a
lighthouse in this process: it builds the public API a torchft script uses,
takes one step, and reports which ``lighthouse`` and ``torchft_lite.rpc``
modules got imported.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from lighthouse.thread import BackgroundLighthouse
from tests.conftest import lighthouse_config

pytestmark = pytest.mark.integration

# What a trainer may load of the lighthouse package (beside the package itself): nothing since the RPC kit,
# the lighthouse client and the protocol moved to torchft_lite.rpc; lighthouse.server, .quorum, .http, .status,
# .metrics, .config and the rest are the server's.
TRAINER_SIDE: tuple[str, ...] = ()

PROBE = """
import sys
from datetime import timedelta

import torch
from torch.distributed import TCPStore

import torchft_lite
from torchft_lite import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo, coordination
from torchft_lite.checkpointing import HTTPTransport

lighthouse = sys.argv[1]
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
model = torch.nn.Linear(4, 2)
inner = torch.optim.SGD(model.parameters(), lr=0.1)
manager = Manager(
    pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=1,
    load_state_dict=model.load_state_dict, state_dict=model.state_dict,
    rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
    replica_id="probe", hostname="127.0.0.1", timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=30),
    checkpoint_transport=HTTPTransport(timeout=timedelta(seconds=30), num_chunks=0, hostname="127.0.0.1"),
)
try:
    ddp, optimizer = DistributedDataParallel(manager, model), Optimizer(manager, inner)
    optimizer.zero_grad()
    ddp(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    assert manager.current_step() == 1, "the step did not commit"
    client = coordination.LighthouseClient(lighthouse, connect_timeout=timedelta(seconds=30))
    client.heartbeat("probe-client")
    client.close()
finally:
    manager.shutdown()
print(" ".join(sorted(m for m in sys.modules if m == "lighthouse" or m.startswith(("lighthouse.", "torchft_lite.rpc")))))
print(" ".join(sorted(m for m in ("prometheus_client", "torchft_lite.metrics.registry") if m in sys.modules)))
print("hpack" in sys.modules)
"""


def server_modules(loaded: list[str]) -> list[str]:
    return [m for m in loaded if m.startswith("lighthouse.") and m.split(".")[1] not in TRAINER_SIDE]


def test_a_training_step_loads_no_lighthouse_server_code():
    with BackgroundLighthouse(lighthouse_config(http_bind=None)) as lh:
        done = subprocess.run([sys.executable, "-c", PROBE, lh.address()], capture_output=True, text=True,
                              timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    loaded = lines[-3].split()
    assert lines[-2] == "", f"a trainer that exports no metrics imported {lines[-2]}: imports a restart waits for"
    # Its HPACK decoder (60-80 ms to import) is for peers' calls, and no peer called a one-rank group's server.
    assert lines[-1] == "False", "a ManagerServer nobody connected to imported hpack"
    assert "torchft_lite.rpc.lighthouse_client" in loaded and "torchft_lite.rpc.h2grpc" in loaded  # the probe did run a ManagerServer
    assert server_modules(loaded) == [], loaded


def test_the_check_sees_server_modules():
    loaded = ["lighthouse", "torchft_lite.rpc.lighthouse_client", "torchft_lite.rpc.h2grpc.wire", "lighthouse.server", "lighthouse.view"]
    assert server_modules(loaded) == ["lighthouse.server", "lighthouse.view"]
