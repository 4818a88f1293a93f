"""Run a lighthouse and replica groups as local processes (demo, tests, chaos runs).

:class:`LighthouseProcess` runs ``python -m lighthouse``; :class:`ReplicaGroup`
runs one replica group of a training script, either under ``torchrun`` (as a
job would) or directly, one process per rank, with the group's TCPStore hosted
by this process (leaner: no agent process per group). Each group runs in its
own process group/session, so :meth:`ReplicaGroup.kill` takes down every rank
at once, like a machine dying.

:meth:`ReplicaGroup.start_standby` keeps a warm standby per rank
(:mod:`torchft_lite.cluster.standby`: interpreter, torch and the library already
imported); the next :meth:`ReplicaGroup.start` runs the script in it instead of
a fresh process, which is what a launcher can do about a restart's fixed cost.

Jobs started here are secured as a real one should be: the lighthouse and
every group get one job token (see :func:`job_token_env`) through their
environment, never a command line (which ``ps`` shows to every user) or a log.
"""

from __future__ import annotations

import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Sequence

from torchft_lite.rpc.access import TOKEN_ENV, TOKEN_FILE_ENV, Access

__all__ = ["LighthouseProcess", "ReplicaGroup", "free_port", "job_access", "job_token_env", "stop_tree"]

_LISTENING = re.compile(r"Lighthouse listening on: ([^\s,]+)")
_DASHBOARD = re.compile(r"dashboard at \S+:(\d+)/")
_generated_token: str | None = None


def job_token_env() -> dict[str, str]:
    """What the processes started here add to their environment for the job token: nothing when this
    process has ``TORCHFT_LITE_TOKEN`` or ``TORCHFT_LITE_TOKEN_FILE`` (they inherit it), else a random
    token made once per process, so a lighthouse and groups started here (and restarted) share it."""
    global _generated_token
    if TOKEN_ENV in os.environ or TOKEN_FILE_ENV in os.environ:
        return {}
    if _generated_token is None:
        _generated_token = secrets.token_urlsafe(32)
    return {TOKEN_ENV: _generated_token}


def job_access() -> Access:
    """The access of the jobs started here, for a client in this process (a test, a benchmark) that
    calls their lighthouse or ManagerServers."""
    return Access.from_env({**os.environ, **job_token_env()})


def free_port() -> int:
    """A port that was free a moment ago (for torchrun's --master_port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(proc: subprocess.Popen, timeout: float) -> int | None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout)
    return proc.returncode


def stop_tree(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """Stop ``proc`` (started with ``start_new_session``) and everything it started, even in sessions of their
    own (torchrun's workers, a torchx scheduler's roles): SIGTERM to its process group, SIGKILL after
    ``timeout``, then SIGKILL to every descendant it had when this was called. Returns its exit code."""
    leftovers = _descendants(proc.pid) if proc.poll() is None else []
    code = _stop(proc, timeout)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code


def _state(pid: int) -> str:
    """The one-letter state of ``pid`` (Linux /proc: 'T' stopped, 'R' running, ...), '' when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc), deepest first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(children.get(child, []))
    return found[::-1]


class LighthouseProcess:
    """``python -m lighthouse`` on 127.0.0.1; ``address`` is what managers dial."""

    def __init__(self, *, min_replicas: int = 1, join_timeout: float = 2.0, heartbeat_timeout: float = 5.0,
                 quorum_tick: float = 0.05, port: int = 0, http: bool = False, log_path: Path | None = None,
                 start_timeout: float = 60.0, startup_grace: float | None = None, host: str = "127.0.0.1",
                 state_dir: Path | None = None, prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        """``host``: the address it binds, gRPC and HTTP; ``prefix``: a command prefix (such as ``ip netns exec
        NAME``, to run it on a simulated host); ``env``: added to its environment (TLS settings)."""
        self.host = host
        self.prefix = list(prefix)
        self.extra_env = dict(env or {})
        self.args = ["--bind", f"{host}:{port}", "--min_replicas", str(min_replicas),
                     "--join_timeout_ms", str(int(join_timeout * 1000)),
                     "--heartbeat_timeout_ms", str(int(heartbeat_timeout * 1000)),
                     "--quorum_tick_ms", str(max(1, int(quorum_tick * 1000))),
                     "--http-bind", f"{host}:0" if http else "off"]
        if startup_grace is not None:  # None: the lighthouse's default (its heartbeat timeout)
            self.args += ["--startup_grace_ms", str(int(startup_grace * 1000))]
        if state_dir is not None:
            self.args += ["--state-dir", str(state_dir)]
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.address: str | None = None
        self.port = port
        self.http_port: int | None = None
        """The HTTP side's port (with ``http``), once started."""
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LighthouseProcess":
        if self.port and self.address:  # a restart binds the same port again
            self.args[1] = f"{self.host}:{self.port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1", **job_token_env(), **self.extra_env)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        # stdout carries the "listening on" line; logs go to stderr.
        self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", "lighthouse", *self.args],
                                     stdout=subprocess.PIPE,
                                     stderr=log, env=env, start_new_session=True,
                                     bufsize=0)  # unbuffered, so select() sees every byte not yet read
        deadline = time.monotonic() + self.start_timeout
        assert self.proc.stdout is not None
        while True:
            # Bounded: a lighthouse that hangs before printing must not hang us.
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline().decode() if ready else ""
            match = _LISTENING.search(line)
            if match:
                self.address = match.group(1)
                self.port = int(self.address.rsplit(":", 1)[1])
                dashboard = _DASHBOARD.search(line)
                self.http_port = int(dashboard.group(1)) if dashboard else None
                return self
            if not line or time.monotonic() > deadline:
                code = _stop(self.proc, 10)
                raise RuntimeError(f"lighthouse did not start (exit code {code}); see {self.log_path or 'its stderr'}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            _stop(self.proc, timeout)
            if self.proc.stdout:
                self.proc.stdout.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class ReplicaGroup:
    """One replica group of ``script`` with ``world_size`` ranks."""

    def __init__(self, group_id: int, num_groups: int, lighthouse: str, script: str | Path,
                 script_args: Sequence[str] = (), *, world_size: int = 1, use_torchrun: bool = False,
                 env: dict[str, str] | None = None, log_dir: Path | None = None,
                 store_host: str = "127.0.0.1", advertise: str | None = "127.0.0.1",
                 prefix: Sequence[str] = ()) -> None:
        """``store_host``: where ranks reach this group's TCPStore (torchrun's ``--master_addr``);
        ``advertise``: the host its ranks advertise to peers (None: leave ``TORCHFT_LITE_HOSTNAME``
        unset, so they advertise their hostname); ``prefix``: a command prefix for every rank, or for
        torchrun (such as ``ip netns exec NAME``, to run the group in a network namespace)."""
        self.group_id = group_id
        self.num_groups = num_groups
        self.lighthouse = lighthouse
        self.script = str(script)
        self.script_args = list(script_args)
        self.world_size = world_size
        self.use_torchrun = use_torchrun
        self.extra_env = env or {}
        self.log_dir = log_dir
        self.store_host = store_host
        self.advertise = advertise
        self.prefix = list(prefix)
        self.procs: list[subprocess.Popen] = []
        self.standbys: list[subprocess.Popen] = []
        """Warm standbys (one per rank) for the next :meth:`start`, from :meth:`start_standby`."""
        self._standby_ready: list[bool] = []
        self.incarnation = 0
        self._store = None

    def _env(self) -> dict[str, str]:
        # A token the caller set for this group (a test of a wrong one) replaces the job's.
        own_token = TOKEN_ENV in self.extra_env or TOKEN_FILE_ENV in self.extra_env
        env = dict(os.environ, **({} if own_token else job_token_env()))
        env.update(REPLICA_GROUP_ID=str(self.group_id), NUM_REPLICA_GROUPS=str(self.num_groups),
                   TORCHFT_LIGHTHOUSE=self.lighthouse, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        if self.advertise is None:
            env.pop("TORCHFT_LITE_HOSTNAME", None)
        else:
            env["TORCHFT_LITE_HOSTNAME"] = self.advertise
        env.update(self.extra_env)
        return env

    def _log(self, rank: int | str, incarnation: int | None = None):
        if self.log_dir is None:
            return subprocess.DEVNULL
        incarnation = self.incarnation if incarnation is None else incarnation
        return open(self.log_dir / f"group{self.group_id}.{incarnation}.{rank}.log", "ab")

    def start_standby(self, preload: Sequence[str] | None = None) -> "ReplicaGroup":
        """Start one standby per rank for the next :meth:`start` (direct mode only); see
        :mod:`torchft_lite.cluster.standby`. Not killed by :meth:`kill`: it stands for a spare on another host.
        ``preload``: the modules it imports while it waits (default: its ``DEFAULT_PRELOAD``)."""
        if self.use_torchrun:
            raise ValueError("standbys need the direct mode: torchrun starts its own workers")
        if self.standbys:
            raise RuntimeError(f"group {self.group_id} already has standbys")
        command = [*self.prefix, sys.executable, "-m", "torchft_lite.cluster.standby"]
        if preload is not None:
            command += ["--preload", ",".join(preload)]
        for rank in range(self.world_size):  # each logs as the incarnation it will become
            self.standbys.append(subprocess.Popen(
                [*command, self.script, *self.script_args], env=self._env(), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=self._log(rank, self.incarnation + 1), start_new_session=True,
                bufsize=0))
        self._standby_ready = [False] * self.world_size
        return self

    def wait_standby(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until every standby is warm; False if not by then.
        Raises ``RuntimeError`` when one exited (its log says why) or there are none."""
        if not self.standbys:
            raise RuntimeError(f"group {self.group_id} has no standbys: call start_standby() first")
        deadline = time.monotonic() + timeout
        for rank, proc in enumerate(self.standbys):
            assert proc.stdout is not None
            while not self._standby_ready[rank]:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                ready, _, _ = select.select([proc.stdout], [], [], left)
                line = proc.stdout.readline() if ready else b"-"
                if line == b"ready\n":
                    self._standby_ready[rank] = True
                elif not line:
                    raise RuntimeError(f"group {self.group_id}: the standby of rank {rank} exited (code "
                                       f"{proc.wait(10)}) before it was ready; see its log")
        return True

    def start(self) -> "ReplicaGroup":
        """Start every rank: in the warm standbys if every rank has one, else in fresh processes."""
        if self.standbys and all(self._standby_ready):
            return self._start_standbys()
        self.incarnation += 1
        env = self._env()
        if self.use_torchrun:
            command = [*self.prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                       f"--nproc_per_node={self.world_size}", f"--master_port={free_port()}",
                       f"--master_addr={self.store_host}", "--max_restarts=0", self.script, *self.script_args]
            log = self._log("torchrun")
            self.procs = [subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)]
            return self
        from torch.distributed import TCPStore  # only the direct mode needs torch here

        # A fresh store per incarnation, as a restarted torchrun job would have.
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=60))
        env.update(MASTER_ADDR=self.store_host, MASTER_PORT=str(self._store.port), WORLD_SIZE=str(self.world_size))
        self.procs = []
        for rank in range(self.world_size):
            log = self._log(rank)
            self.procs.append(subprocess.Popen(
                [*self.prefix, sys.executable, self.script, *self.script_args],
                env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            ))
        return self

    def _start_standbys(self) -> "ReplicaGroup":
        from torch.distributed import TCPStore

        from torchft_lite.cluster.standby import go_line

        self.incarnation += 1
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=60))
        self.procs, self.standbys, self._standby_ready = self.standbys, [], []
        for rank, proc in enumerate(self.procs):
            assert proc.stdin is not None and proc.stdout is not None
            env = {"MASTER_ADDR": self.store_host, "MASTER_PORT": str(self._store.port),
                   "WORLD_SIZE": str(self.world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}
            try:
                proc.stdin.write(go_line(env))
            except BrokenPipeError:
                pass  # it died while waiting: alive() and the caller's checks see that
            finally:
                proc.stdin.close()
                proc.stdout.close()
        return self

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def stopped(self) -> bool:
        """Whether every rank process is stopped (SIGSTOP; /proc state T) and none has exited."""
        return bool(self.procs) and all(p.poll() is None and _state(p.pid) in ("T", "t") for p in self.procs)

    def signal_ranks(self, sig: int) -> None:
        """Send ``sig`` to the rank processes only (not their children, such as a child-process group's)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process of the group, torchrun's workers included.

        (torchrun starts each worker in a session of its own, so signalling the
        agent's process group would miss them; the process tree is walked instead.)
        """
        for proc in self.procs:
            if proc.poll() is None:
                for pid in [*_descendants(proc.pid), proc.pid]:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
        if sig == signal.SIGKILL:
            for proc in self.procs:
                proc.wait(30)

    def wait(self, timeout: float) -> list[int | None]:
        """Wait for every rank to exit; return codes (None for one still running at the deadline)."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every rank and standby (SIGTERM, then SIGKILL after ``timeout``)."""
        for proc in self.standbys:
            _stop(proc, timeout)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        self.standbys, self._standby_ready = [], []
        for proc in self.procs:
            stop_tree(proc, timeout)  # torchrun workers live in sessions of their own
        self._store = None
