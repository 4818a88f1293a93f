"""Helpers shared by the unit tests: plain functions and classes, imported by the test modules (their shared
fixtures, should they have any, go in a conftest.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lighthouse.quorum import Decision, QuorumConfig, QuorumState
from tests.conftest import all_in_threads, read_header
from torchft_lite.health.fingerprint import Fingerprinter
from torchft_lite.manager import Manager
from torchft_lite.serialization import decode, encode, spec
from torchft_lite.testing import InMemoryLighthouse, InMemoryProcessGroup
from torchft_lite.work import DoneWork, ManagedWork, completed_future


class FailingWork(dist.Work):
    """A collective that failed: wait() raises ``error``, and its future (one per work, as c10d's) carries it."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_exception(error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise self.error

    def get_future(self) -> torch.futures.Future:
        return self.future


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(filename: str, module_name: str) -> types.ModuleType:
    """A file of examples/ (not a package), run as a module named ``module_name``; what it imports from
    beside it must then be importable (examples/ on sys.path)."""
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- stand-ins for a Manager


class CountingManager:
    """What DDP uses of a Manager, for one replica: every allreduce is done at once (no peer) and recorded."""

    def __init__(self) -> None:
        self.allreduced: list[torch.Tensor] = []

    def allreduce(self, tensor: torch.Tensor) -> ManagedWork:
        self.allreduced.append(tensor)
        return ManagedWork(completed_future(tensor))


class SoloManager:
    """What LocalSGD and DiLoCo use of a Manager, for one replica group alone: an allreduce averages over one
    (``reduce`` leaves the tensor as is; a subclass may do otherwise), and a step commits unless ``commit`` is
    False. Records the calls (``events``), the tensors allreduced and the state-dict functions registered."""

    _use_async_quorum = False

    def __init__(self, commit: bool = True) -> None:
        self.commit = commit
        self.step = 0
        self.events: list[str] = []
        self.allreduced: list[torch.Tensor] = []
        self.state_fns: dict[str, tuple] = {}

    def start_quorum(self) -> None:
        self.events.append("start_quorum")

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> DoneWork:
        self.allreduced.append(tensor)
        return DoneWork(self.reduce(tensor))

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def should_commit(self) -> bool:
        self.events.append("should_commit")
        if self.commit:
            self.step += 1
        return self.commit

    def current_step(self) -> int:
        return self.step

    def register_state_dict_fn(self, key, load, save) -> None:
        assert key not in self.state_fns
        self.state_fns[key] = (load, save)


# ---------------------------------------------------------------- replica groups of real Managers, in memory


class Replica:
    """One replica group of one rank: a weight vector (``size`` values of ``value``), its Manager on the
    in-memory ``lighthouse`` and its process group (an InMemoryProcessGroup unless ``pg`` is given).
    ``kwargs`` go to the Manager, but ``min_replica_size`` (1 unless given) and ``timeout_s`` (10)."""

    def __init__(self, lighthouse: InMemoryLighthouse, name: str, value: float = 0.0, *, size: int = 3,
                 pg: Any = None, **kwargs: Any) -> None:
        self.weights = torch.full((size,), value)
        self.pg = InMemoryProcessGroup() if pg is None else pg
        self.manager: Manager = lighthouse.manager(
            name, self.pg, load_state_dict=self.load, state_dict=lambda: {"w": self.weights},
            min_replica_size=kwargs.pop("min_replica_size", 1),
            timeout=timedelta(seconds=kwargs.pop("timeout_s", 10.0)), **kwargs,
        )
        self.loads = 0

    def load(self, state: dict) -> None:
        self.loads += 1
        self.weights = state["w"].clone()

    def step(self, grad: float | torch.Tensor = 1.0, **allreduce_kwargs: Any) -> tuple[bool, torch.Tensor]:
        """One training step: the gradient (``grad`` for every weight, or a copy of the tensor ``grad``) is
        averaged over the participants; SGD with lr 1 on commit. Whether it committed, and the gradient."""
        self.manager.start_quorum()
        g = grad.clone() if isinstance(grad, torch.Tensor) else torch.full_like(self.weights, grad)
        self.manager.allreduce(g, **allreduce_kwargs).wait()
        committed = self.manager.should_commit()
        if committed:
            self.weights = self.weights - g
        return committed, g


def train(replicas: dict[str, Replica], steps: int, grads: dict[str, float] | None = None) -> dict[str, list[bool]]:
    """Each replica runs ``steps`` steps on a thread of its own; returns the commit decisions."""
    def run(name: str) -> list[bool]:
        return [replicas[name].step((grads or {}).get(name, 1.0))[0] for _ in range(steps)]

    return all_in_threads(replicas, run, 60, "a training thread hung")


@pytest.fixture
def replicas():
    """``replicas(lighthouse, name, value, **kwargs)``: a Replica, whose Manager is shut down after the test."""
    made: list[Replica] = []

    def make(lighthouse: InMemoryLighthouse, name: str, value: float, **kwargs: Any) -> Replica:
        made.append(Replica(lighthouse, name, value, **kwargs))
        return made[-1]

    yield make
    for replica in made:
        replica.manager.shutdown()


# ---------------------------------------------------------------- the heal format, piece by piece

SMALL_BLOCK = 4096
MIXED_STATE = {"a": torch.arange(5000, dtype=torch.float32), "empty": torch.empty(0),
               "b": torch.arange(7, dtype=torch.int64), "c": torch.arange(3, dtype=torch.bfloat16)}


def encoded(state: dict = MIXED_STATE) -> tuple[spec.Header, bytes, bytes]:
    """``(header, data, trailer)`` of ``state`` with small blocks (SMALL_BLOCK), so tensors span several."""
    blob = encode.encode_to_bytes(3, state, block_bytes=SMALL_BLOCK)
    header, data_start = read_header(blob)
    return header, blob[data_start:data_start + header.data_bytes], blob[data_start + header.data_bytes:]


def fill_in_place(writer: decode.TensorWriter, data: bytes, start: int, end: int, piece: int) -> None:
    """What the HTTP client does: ask for a view of the destination, let "the kernel" write, report."""
    position = start
    while position < end:
        view = writer.buffer_at(position, end)[:piece]
        view[:] = data[position:position + len(view)]
        writer.filled(position, len(view))
        position += len(view)


# ---------------------------------------------------------------- fingerprints


def flip_bit(tensor: torch.Tensor, index: int = 1, bit: int = 3) -> None:
    """Flip one bit of one element, in place (as a cosmic ray or bad DRAM would)."""
    tensor.view(torch.int32).view(-1)[index] ^= 1 << bit


def rank_fingerprint(step: int, st: dict) -> str:
    """The fingerprint one rank holding ``st`` sends for ``step``."""
    printer = Fingerprinter(step, lambda: st, lambda *a, **k: None)
    printer.step_starting(step)
    return printer.for_step(step)


# ---------------------------------------------------------------- the lighthouse's quorum rules

_CONFIG_FIELDS = frozenset(field.name for field in dataclasses.fields(QuorumConfig))


def quorum_state(min_replicas: int = 1, join_timeout: float = 10.0, **settings) -> QuorumState:
    """A QuorumState; ``settings`` are QuorumConfig's (heartbeat_timeout, holder_timeout, startup_grace: its
    defaults unless given) or QuorumState's own (last_quorum_id, started_at, max_step, restart_evidence)."""
    config = QuorumConfig(min_replicas, join_timeout, **{k: v for k, v in settings.items() if k in _CONFIG_FIELDS})
    return QuorumState(config, **{k: v for k, v in settings.items() if k not in _CONFIG_FIELDS})


def issue(s: QuorumState, now: float) -> Decision:
    """The decision at ``now``, which must issue a quorum (the test fails with its reason if not)."""
    decision, _ = s.decide(now)
    assert decision.quorum is not None, decision.reason
    return decision
