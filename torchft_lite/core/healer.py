"""Live heals: serve this replica's state to peers behind it, or receive and apply a peer's.

The Manager decides *when* (a quorum says this replica is behind, or that
peers heal from it); the :class:`Healer` does the rest for one step:

* **receive** (control-plane loop): ask each assigned source for its
  checkpoint metadata, then receive the state dict of the max step from the
  sources that answered, striped across them when the transport can,
  single-source (as torchft) otherwise;
* **apply** (training thread, in ``should_commit`` or a synchronous
  ``start_quorum``): load every registered piece and the Manager's own state;
* **publish** (training thread, at the first collective or ``should_commit``):
  hand the transport a snapshot of this step for the peers healing from us.

What a heal carries is a :class:`RegisteredState`: the registered state-dict
functions and whether the live state is torn (a receive or load that failed
part-way left it mixing two steps). It exists before the transport, which
receives in place into its tensors.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Awaitable, Callable, Sequence

import torch

from torchft_lite.core.capabilities import ServesStatistics
from torchft_lite.core.step import Step
from torchft_lite.errors import CheckpointError

__all__ = ["HealResult", "Healer", "PeerMetadata", "RegisteredState", "alias_tensors", "stripes"]

PeerMetadata = Callable[[str, int, float], Awaitable[str]]
"""``(manager address, group rank, timeout) -> checkpoint metadata`` of a peer's rank."""
Log = Callable[..., None]


@dataclass(frozen=True)
class HealResult:
    """A received (not yet applied) state dict and how it came."""

    state: Any
    seconds: float
    tensor_bytes: int
    sources: list[int]
    """The replica ranks it was received from."""


class RegisteredState:
    """What a heal carries and a durable checkpoint saves: the registered pieces of user state, and the Manager's."""

    def __init__(self, own_state: Callable[[], dict[str, int]], load_own_state: Callable[[dict[str, int]], None],
                 log: Log) -> None:
        self.load_fns: dict[str, Callable[[Any], None]] = {}
        self.state_fns: dict[str, Callable[[], Any]] = {}
        self.torn = False
        """The registered state may mix two steps; cleared only by a whole state loaded in full."""
        self.own_state, self.load_own_state = own_state, load_own_state
        self._log = log

    def register(self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]) -> None:
        if key in self.state_fns:
            raise ValueError(f"state dict fn {key!r} is already registered")
        self.load_fns[key] = load_state_dict
        self.state_fns[key] = state_dict

    def state_dict(self) -> dict[str, Any]:
        """What a heal carries: every registered piece, and the Manager's own state."""
        return {"user": self.user_state(), "torchft": self.own_state()}

    def user_state(self) -> dict[str, Any]:
        """Every registered piece of user state (what a heal carries, without the Manager's own)."""
        return {key: fn() for key, fn in self.state_fns.items()}

    def load_state_dict(self, state: Any) -> None:
        """Load a whole state (what :meth:`state_dict` returns): every registered piece, then the Manager's.

        :attr:`torn` stays set if a piece fails to load.
        """
        user = state["user"]
        missing = set(self.load_fns) - set(user)
        if missing:
            raise CheckpointError(f"the checkpoint lacks registered state {sorted(missing)}")
        self.torn = True  # until every piece is loaded
        for key, load in self.load_fns.items():
            load(user[key])
        self.load_own_state(state["torchft"])
        self.torn = False

    def in_place_targets(self) -> Any:
        """Where a heal may land: ``.data`` aliases of the live tensors, same paths.

        The default ``HTTPTransport`` calls this on the heal thread when a
        receive starts and writes each received tensor whose path, dtype and
        shape match straight into the live one. Safe, because only a replica
        behind the max step heals; the training thread only reads its
        parameters until ``should_commit`` (which waits for the heal) and its
        gradients are zeroed before the allreduce (it does not participate).
        The aliases don't share autograd's version counter, so a ``copy_``
        can't fail the backward pass already recorded. A receive that fails
        part-way marks the state torn (see :attr:`torn`). Not covered: state
        the forward pass writes (BatchNorm statistics), which can race the
        receive; ``heal_in_place=False`` receives into fresh tensors.

        The user's ``state_dict`` functions run on the heal thread here, as
        they do on torchft's quorum thread; if they fail, this heal allocates.
        """
        try:
            return alias_tensors(self.state_dict())
        except Exception as exc:
            self._log(logging.WARNING, "receiving this heal into fresh tensors: the state dict functions failed: "
                      "%s: %s", type(exc).__name__, exc)
            return {}


class Healer:
    """Send, receive and apply the :class:`RegisteredState` of one rank's Manager."""

    def __init__(self, state: RegisteredState, transport: Any, peer_metadata: PeerMetadata, *, in_place: bool,
                 timeout: timedelta, log: Log, record: Callable[[Step, BaseException], None], watchdog: Any,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``record(step, error)`` keeps an error of applying or publishing for the step (it won't commit);
        a heal is ``watchdog``'s "heal" section, from the receive to the end of the apply."""
        self.state = state
        self.transport = transport
        self.in_place = in_place
        self._peer_metadata = peer_metadata
        self._timeout = timeout
        self._log, self._record, self._watchdog, self._clock = log, record, watchdog, clock
        self._released_steps = 0  # the transport's warm_up (a deferred HTTP server) comes at the second

    # ------------------------------------------------------------ receiving (control-plane loop)

    async def receive(self, step: Step, sources: Sequence[tuple[int, str]], max_step: int, group_rank: int) -> None:
        """Receive the state dict of ``max_step`` from ``sources`` into ``step.received`` (not applied)."""
        self._watchdog.begin("heal", f"the state dict of step {max_step} from "
                                     f"{', '.join(address for _, address in sources)}")
        self._log(logging.INFO, "healing from %s to step %d", describe(sources), max_step)
        answered = await self._metadata_of(sources, group_rank)
        if self.in_place:
            self.state.torn = True  # bytes may land in the live tensors from here on
        timeout = self._timeout
        striped = getattr(self.transport, "recv_checkpoint_striped", None)  # torchft's transports have none
        if striped is None:
            answered = answered[:1]
        started = self._clock()
        if len(answered) > 1:
            state = await asyncio.to_thread(striped, sources=[(rank, metadata) for rank, _, metadata in answered],
                                            step=max_step, timeout=timeout)
        else:
            rank, _, metadata = answered[0]
            state = await asyncio.to_thread(self.transport.recv_checkpoint, src_rank=rank, metadata=metadata,
                                            step=max_step, timeout=timeout)
        if not isinstance(state, dict) or not isinstance(state.get("torchft"), dict):
            raise CheckpointError(f"healing expected a Manager state dict of step {max_step}, got "
                                  f"{type(state).__name__} without a 'torchft' part")
        got = state["torchft"].get("step")
        if got != max_step:
            # The transport served it as step max_step (ours checks that); the sender's Manager said otherwise.
            # As torchft does, this replica is at max_step once it applies the state.
            self._log(logging.WARNING, "healing to step %d: the state received says step %s; taking %d",
                      max_step, got, max_step)
            state["torchft"] = {**state["torchft"], "step": max_step}
        step.received = HealResult(state, self._clock() - started, tensor_bytes(state),
                                   [rank for rank, _, _ in answered])

    async def _metadata_of(self, sources: Sequence[tuple[int, str]], group_rank: int) -> list[tuple[int, str, str]]:
        """``(rank, address, metadata)`` of the sources that answered, asked at once.

        The first source (the primary, torchft's single source) is required: its
        failure raises. A secondary that fails is left out with a warning, and
        the heal stripes over the others.
        """
        answers = await asyncio.gather(*(self._peer_metadata(address, group_rank, self._timeout.total_seconds())
                                         for _, address in sources), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer  # cancelled: the step is being abandoned
        if isinstance(answers[0], Exception):
            raise answers[0]
        answered = []
        for (rank, address), answer in zip(sources, answers):
            if isinstance(answer, Exception):
                self._log(logging.WARNING, "healing without replica %d (%s): no checkpoint metadata: %s",
                          rank, address, answer)
            else:
                answered.append((rank, address, answer))
        return answered

    # ------------------------------------------------------------ applying (training thread)

    def apply(self, step: Step) -> bool:
        """Load ``step.received``; True when every piece loaded (a failure is recorded for the step)."""
        result, step.received = step.received, None
        if result is None:
            return False  # the receive failed; its error is recorded
        step.pre_heal_state = self.state.own_state()
        try:
            self.state.load_state_dict(result.state)
        except Exception as exc:
            self._record(step, exc)
            return False
        step.healed = replace(result, state=None)
        self._watchdog.end("heal")
        self._log(logging.INFO, "healed: %.3f MB in %.2fs (%.1f MB/s) from replica(s) %s", result.tensor_bytes / 1e6,
                  result.seconds, result.tensor_bytes / 1e6 / result.seconds if result.seconds > 0 else 0.0,
                  ", ".join(map(str, result.sources)))
        return True

    def undo(self, step: Step) -> None:
        """The group's step failed: go back to the step before the heal (the loaded weights stay)."""
        if step.pre_heal_state is not None:
            self.state.load_own_state(step.pre_heal_state)

    # ------------------------------------------------------------ serving (training thread)

    def publish(self, step: Step, current_step: int) -> None:
        """Serve this replica's state to the peers healing from it this step (once, from the training thread)."""
        if (step.send_step is None or step.published or step.released or not step.open
                or threading.get_ident() != step.training_thread):
            return  # nothing to serve, served already, the step is over, or not the training thread
        step.published = True
        step.served_before = bytes_served(self.transport)
        try:
            if step.send_step != current_step:
                raise CheckpointError(f"asked to serve step {step.send_step} but this replica is at step "
                                      f"{current_step}")
            self.transport.send_checkpoint(step.send_to, step.send_step, self.state.state_dict(), self._timeout)
        except Exception as exc:
            self._record(step, exc)

    def stop_serving(self, step: Step) -> None:
        """No more serving of the step's state (waits, bounded, for its receivers); log what was served.

        At the step's vote, or earlier when the caller is about to change the
        state (``Manager.disallow_state_dict_read``). Once a step.
        """
        if step.released:
            return
        step.released = True
        self._released_steps += 1
        if self._released_steps == 2:
            # Start a deferred server now, off the join path: its import (aiohttp's, ~0.1 s of CPU) holds the
            # GIL from the training thread for a while, and at the first vote it delayed a restarted
            # replica's first optimizer step (its first commit) by 20-30 ms. A peer that must heal from us
            # sooner starts it at its send.
            warm_up = getattr(self.transport, "warm_up", None)
            if callable(warm_up):
                warm_up()
        self.transport.disallow_checkpoint()
        if step.published and step.send_step is not None:
            served = bytes_served(self.transport)
            if served is not None and step.served_before is not None:
                self._log(logging.INFO, "served step %d to replica(s) %s: %.3f MB", step.send_step,
                          ", ".join(map(str, step.send_to)), (served - step.served_before) / 1e6)


def stripes(transport: Any) -> bool:
    """Whether ``transport`` has a ``recv_checkpoint_striped`` of its own (the base one takes one source)."""
    from torchft_lite.checkpointing.transport import CheckpointTransport

    method = getattr(type(transport), "recv_checkpoint_striped", None)
    return method is not None and method is not CheckpointTransport.recv_checkpoint_striped


def bytes_served(transport: Any) -> int | None:
    """The transport's ``statistics().bytes_served`` (HTTPTransport's), else None."""
    return getattr(transport.statistics(), "bytes_served", None) if isinstance(transport, ServesStatistics) else None


def alias_tensors(obj: Any) -> Any:
    """``obj``'s containers with each tensor as a ``.data`` alias (own version counter) and other leaves None."""
    if isinstance(obj, torch.Tensor):
        return obj.data
    if isinstance(obj, dict):
        return {key: alias_tensors(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [alias_tensors(value) for value in obj]
    return None


def describe(sources: Sequence[tuple[int, str]]) -> str:
    return ", ".join(f"replica {rank} ({address})" for rank, address in sources)


def tensor_bytes(obj: Any) -> int:
    """The bytes a heal of ``obj`` carries: a DTensor counts its local shard, the part that travels."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") and hasattr(obj, "placements") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
