"""Heal bandwidth: move one state dict between two processes on loopback, several ways.

Each case starts a *server* and a *receiver* process; this parent drives both
over their stdin/stdout, one line of JSON per command, so every transport runs
the same schedule: ``step k`` to both (the server publishes or sends, the
receiver fetches and times its own receive), then ``release`` to the server
(``disallow_checkpoint``). After the last step both report their peak extra
memory: the RSS high-water mark minus the RSS at the start of the transfers
(the peak is reset with ``/proc/self/clear_refs``), as a multiple of the state
dict's tensor bytes.

Cases: a raw loopback TCP stream of the same bytes (the ceiling for HTTP); the
same bytes over N parallel streams, a thread per stream on each side (``tcp-N``;
``tcp-all`` asks for every N from 2 to the usable cores: on a machine with many
cores one stream is no ceiling, and the best ``tcp-N`` is the multi-stream
ceiling ``ours-default`` is judged against); the
same stream with our block checksum computed on both sides (what a checked
transfer can reach on this machine); our HTTPTransport over one stream and over
several byte-range chunks, receiving into fresh tensors or in place; torchft's
HTTPTransport when ``torchft`` imports; our PGTransport over gloo; and a plain
gloo send/recv of the same tensors (the ceiling for PG). Prints a table, then
one JSON line last.

``--tls`` runs each of our HTTP cases a second time with TLS on, as
``<case>+tls``, in the same run (both processes get a throwaway CA and
certificate made with the openssl CLI, through ``TORCHFT_LITE_TLS_*``, as a
job would); ``tls_vs_plain`` is each one's ``vs tcp`` over its plain twin's.

``--device cuda`` puts the state dict on the GPU on both sides, as a GPU
job's heal is: the server sends its GPU tensors (``send_s`` is how long
``send_checkpoint`` held the caller, the training thread in a job), and a
receiver's step ends once the bytes are in its own model's GPU tensors: in
place (the ``-inplace`` cases, which land there through the staging ring), or
received into fresh CPU tensors and then copied in, as a torchft user does.
The raw TCP ceiling stays host to host.

``--receiver`` picks the HTTP client our receiving side heals through: ``lean``
(the package's own, whose sockets read straight into tensor memory) or
``aiohttp`` (aiohttp's client, its chunks copied into the same tensors; see
``benchmarks/_aiohttp_heal_client.py``). Everything else about the receive is
the same code, so running both compares the two clients alone.

The raw TCP pair stays up for the whole run and moves the bytes once right
after every step of every other case. Each case's ``vs tcp`` is the median of
its steps' speed relative to that neighbouring ceiling step, and the targets
are judged on those paired ratios: this shared 2-core VM drifts by ±30% and
more within a minute, so GB/s medians taken minutes apart compare the
machine's moods as much as the transports. The GB/s medians are printed too.
The table's CPU column is the CPU time (all threads) each side spent per GiB
(the serving side's counted from the step's start to its release).

Every view is given three times: over all steps (medians), for the first
transfer alone, into a receiver process that has never received (what a
restarted replica's heal is), and over the steps after it ("rep vs tcp"):
from the second step on, an allocating receiver may reuse memory it freed;
the first pays for the first touch of every page. ``ours-default`` is
torchft's API as a user calls it (``HTTPTransport(timeout)``, then
``recv_checkpoint`` into fresh tensors) with our defaults; its line compares
it, in each view, with the best of torchft's cases (``torchft-N``: N chunks)
in that view (``_heal_report``).

    python -m benchmarks.heal_bench                 # 1 GiB, 5 steps per case
    python -m benchmarks.heal_bench --size-mb 64 --steps 2 --cases ours-0,tcp
    python -m benchmarks.heal_bench --steps 3 --cases ours-default,ours-0-inplace,ours-4-inplace,torchft-0,torchft-2,torchft-4,torchft-8
    python -m benchmarks.heal_bench --steps 3 --cases tcp-all,ours-default,torchft-4,torchft-8   # many cores
    python -m benchmarks.heal_bench --receiver aiohttp --cases ours-0-inplace,ours-4-inplace
    python -m benchmarks.heal_bench --tls --cases ours-0-inplace,ours-4-inplace   # what TLS costs a heal
    python -m benchmarks.heal_bench --device cuda --steps 3 --cases ours-default,ours-default-inplace,torchft-0,torchft-4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks._heal_report import TLS_SUFFIX, print_report, summary

ROOT = Path(__file__).resolve().parents[1]
ALL_CASES = ("tcp", "tcp-sum64", "ours-default", "ours-0", "ours-4", "ours-default-inplace", "ours-0-inplace",
             "ours-4-inplace", "torchft-0", "torchft-2", "torchft-4", "torchft-8", "pg-ours", "pg-ours-inplace", "pg-gloo")
MULTI_STREAM = re.compile(r"tcp-(\d+)")
"""``tcp-N``: the raw bytes over N parallel TCP streams (any N >= 2)."""
OUR_CHUNKS = re.compile(r"ours-(\d+)(-inplace)?")
"""``ours-N``/``ours-N-inplace``: our HTTPTransport with ``num_chunks=N`` (any N, beside the listed 0 and 4)."""
RECEIVERS = ("lean", "aiohttp")
TIMEOUT = timedelta(seconds=300)


# ---------------------------------------------------------------- the state dict and memory


def tensor_sizes(size_mb: int, tensor_mb: int) -> list[int]:
    total, per = size_mb << 20, max(4, (tensor_mb << 20) // 4 * 4)
    return [per] * (total // per) + ([total % per] if total % per else [])


def build_state_dict(size_mb: int, tensor_mb: int, device: str = "cpu") -> dict:
    """``size_mb`` MiB of float32 tensors of about ``tensor_mb`` MiB each (on ``device``), plus optimizer-like
    plain state."""
    import torch

    sizes = tensor_sizes(size_mb, tensor_mb)
    model = {f"layers.{i}.weight": torch.arange(nbytes // 4, dtype=torch.float32, device=device).mul_(1e-3 * (i + 1))
             for i, nbytes in enumerate(sizes)}
    optim = {"state": {i: {"step": i * 10, "lr_scale": 0.5 ** i, "betas": [0.9, 0.999], "history": [1, 2.5, "x"]}
                       for i in range(len(sizes))},
             "param_groups": [{"lr": 1e-3, "params": list(range(len(sizes))), "nested": {"a": {"b": [None, True]}}}]}
    return {"user": {"model": model, "optim": optim}, "torchft": {"step": 0, "batches_committed": 0}}


def tensors_of(state: Any) -> list:
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in tensors_of(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in tensors_of(value)]
    return []


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE).group(1)) * 1024


def reset_peak() -> int:
    """Reset the RSS high-water mark; the current RSS, in bytes."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return _status("VmRSS")


# ---------------------------------------------------------------- the two roles (child processes)


class Role:
    """One side of one case. ``setup`` returns what the other side needs; ``step`` moves one state dict."""

    def __init__(self, case: str, side: str, args: argparse.Namespace) -> None:
        self.case, self.side, self.args = case, side, args
        case = case.removesuffix(TLS_SUFFIX)  # TLS is the environment's (TORCHFT_LITE_TLS_*): the same code
        self.kind, _, variant = case.partition("-")
        # ours-default: HTTPTransport(timeout) as torchft's API is called, num_chunks left to our defaults
        self.chunks = int(variant.split("-")[0]) if variant[:1].isdigit() else None if variant.startswith("default") \
            else 0
        self.in_place = case.endswith("-inplace")  # the receiver already holds a state dict of the same shapes
        parallel = MULTI_STREAM.fullmatch(case)
        self.streams = int(parallel.group(1)) if parallel else 1  # raw TCP streams, one thread each
        self.cuda = args.device == "cuda" and self.kind in ("ours", "torchft")
        # On a GPU every receiver holds its model: in place, or the tensors it copies a fresh receive into.
        holds = side == "server" or self.in_place or self.cuda
        self.state = build_state_dict(args.size_mb, args.tensor_mb, args.device if self.cuda else "cpu") \
            if holds else None
        self.received: Any = None
        self.send_seconds = 0.0

    # -- setup

    def setup(self, peer: dict) -> dict:
        if self.kind == "tcp":
            if self.side == "server":
                self.listener = socket.create_server(("127.0.0.1", 0))
                return {"port": self.listener.getsockname()[1]}
            self.socks = [socket.create_connection(("127.0.0.1", peer["port"])) for _ in range(self.streams)]
            self.buffer = memoryview(bytearray(b"\1") * (self.args.size_mb << 20))  # touched, as a model is
            return {}
        if self.kind in ("ours", "torchft"):
            self.transport = self._http_transport()
            return {"url": self.transport.metadata()}
        import torch.distributed as dist

        if self.side == "server":
            self.store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
            peer = {"port": self.store.port}
        else:
            self.store = dist.TCPStore("127.0.0.1", peer["port"], 2, is_master=False, timeout=TIMEOUT)
        return peer

    def connect(self, peer: dict) -> None:
        """Second half of setup, once both sides are listening."""
        if self.kind == "tcp" and self.side == "server":
            self.socks = [self.listener.accept()[0] for _ in range(self.streams)]
            if self.streams > 1:  # the streams' slices of one flat buffer, touched as a model is
                self.buffer = memoryview(bytearray(b"\1") * (self.args.size_mb << 20))
        if self.kind == "pg":
            import torch.distributed as dist

            rank = 0 if self.side == "server" else 1
            self.pg = dist.ProcessGroupGloo(self.store, rank, 2, TIMEOUT)
            if self.case.startswith("pg-ours"):
                from torchft_lite.checkpointing.pg_transport import PGTransport

                local = (lambda: self.state) if self.in_place and self.side == "receiver" else None
                self.transport = PGTransport(self.pg, TIMEOUT, state_dict=local)
        self.peer_url = peer.get("url", "<n/a>")

    def _http_transport(self):
        if self.kind == "ours":
            from torchft_lite.checkpointing import HTTPTransport

            if self.side == "receiver" and self.args.receiver == "aiohttp":
                from benchmarks._aiohttp_heal_client import use_aiohttp_for_heals

                use_aiohttp_for_heals()
            local = (lambda: self.state) if self.in_place and self.side == "receiver" else None
            chunks = {} if self.chunks is None else {"num_chunks": self.chunks}
            return HTTPTransport(TIMEOUT, hostname="127.0.0.1", bind_host="127.0.0.1", state_dict=local, **chunks)
        from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTPTransport

        return TorchftHTTPTransport(TIMEOUT, num_chunks=self.chunks)

    # -- one step

    def step(self, step: int) -> float:
        import torch

        self.received = None
        started = time.perf_counter()
        if self.kind == "tcp" and self.streams > 1:
            _in_parallel(self.socks, self.buffer, sending=self.side == "server")
        elif self.kind == "tcp":
            checked = self.case == "tcp-sum64"  # the same stream with our block checksum on both sides
            sock = self.socks[0]
            if self.side == "server":
                for tensor in tensors_of(self.state):
                    view = _bytes_of(tensor)
                    for start in range(0, len(view), 1 << 20) if checked else ():
                        _sum64(view[start:start + (1 << 20)])
                    sock.sendall(view)
            else:
                view, got = self.buffer, 0
                while got < len(view):
                    n = sock.recv_into(view[got:], min(len(view) - got, 8 << 20))
                    if n == 0:
                        raise ConnectionError("the raw TCP server closed early")
                    if checked:
                        _sum64(view[got:got + n])
                    got += n
        elif self.kind in ("ours", "torchft") or self.case.startswith("pg-ours"):
            if self.side == "server":
                self.state["torchft"]["step"] = step
                sending = time.perf_counter()
                self.transport.send_checkpoint([1], step, self.state, TIMEOUT)
                self.send_seconds = time.perf_counter() - sending
            else:
                self.received = self.transport.recv_checkpoint(0, self.peer_url, step, TIMEOUT)
                if self.received["torchft"]["step"] != step:
                    raise RuntimeError(f"received step {self.received['torchft']['step']}, expected {step}")
                if self.cuda:
                    _into_model(self.received, self.state)
        else:  # plain gloo: one send/recv per tensor, into tensors allocated for the step
            if self.side == "server":
                works = [self.pg.send([t], 1, i) for i, t in enumerate(tensors_of(self.state))]
            else:
                self.received = [torch.empty(shape) for shape in self._gloo_shapes()]
                works = [self.pg.recv([t], 0, i) for i, t in enumerate(self.received)]
            for work in works:
                work.wait()
        return time.perf_counter() - started

    def _gloo_shapes(self) -> list[tuple[int]]:
        return [(nbytes // 4,) for nbytes in tensor_sizes(self.args.size_mb, self.args.tensor_mb)]

    def release(self) -> None:
        if self.side == "server" and self.kind in ("ours", "torchft"):
            self.transport.disallow_checkpoint()

    def close(self) -> None:
        self.received = None
        if self.kind in ("ours", "torchft"):
            self.transport.shutdown()
        if self.kind == "tcp":
            for sock in self.socks:
                sock.close()


def _in_parallel(socks: list[socket.socket], buffer: memoryview, *, sending: bool) -> None:
    """Move ``buffer`` over ``socks``, slice ``i`` on stream ``i``, each stream on a thread of its own."""
    edges = [len(buffer) * i // len(socks) for i in range(len(socks) + 1)]
    errors: list[BaseException] = []

    def move(sock: socket.socket, view: memoryview) -> None:
        try:
            if sending:
                sock.sendall(view)
                return
            got = 0
            while got < len(view):
                n = sock.recv_into(view[got:], min(len(view) - got, 8 << 20))
                if n == 0:
                    raise ConnectionError("a raw TCP stream closed early")
                got += n
        except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=move, args=(sock, buffer[edges[i]:edges[i + 1]]))
               for i, sock in enumerate(socks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _into_model(received: dict, model: dict) -> None:
    """Copy a received state dict's tensors into the model's GPU tensors (nothing to copy for those received in
    place), and wait until they are there."""
    import torch

    for ours, theirs in zip(tensors_of(model), tensors_of(received)):
        if ours is not theirs:
            ours.copy_(theirs)
    torch.cuda.synchronize()


def _bytes_of(tensor) -> memoryview:
    from torchft_lite.serialization.spec import byte_view

    return byte_view(tensor)


def _sum64(view: memoryview) -> int:
    from torchft_lite.serialization.checksum import sum64

    return sum64(view)


def child_main(case: str, side: str, args: argparse.Namespace) -> None:
    """Answer the parent's commands, one JSON line each, until ``exit``."""
    role = Role(case, side, args)
    def reply(**fields: Any) -> None:
        # CPU seconds of all threads so far (the parent takes differences), to the nanosecond: os.times() counts
        # 10 ms ticks, which a small transfer can fit between.
        print(json.dumps(dict(fields, cpu=time.process_time())), flush=True)

    for line in sys.stdin:
        command = json.loads(line)
        action = command["action"]
        if action == "setup":
            reply(**role.setup(command.get("peer", {})))
        elif action == "connect":
            role.connect(command.get("peer", {}))
            role.baseline = reset_peak()
            reply(ok=True)
        elif action == "step":
            reply(seconds=role.step(command["step"]), send_seconds=role.send_seconds)
        elif action == "release":
            role.release()
            reply(ok=True)
        elif action == "exit":
            peak = _status("VmHWM") - role.baseline
            role.close()
            reply(peak_extra_bytes=peak)
            return


# ---------------------------------------------------------------- the parent


class Child:
    def __init__(self, case: str, side: str, args: argparse.Namespace, tls_env: dict[str, str] | None = None) -> None:
        command = [sys.executable, "-W", "ignore", "-m", "benchmarks.heal_bench", "--role", f"{case}:{side}",
                   "--size-mb", str(args.size_mb), "--tensor-mb", str(args.tensor_mb),
                   "--receiver", args.receiver, "--device", args.device]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for name in ("TORCHFT_LITE_TLS_CERT", "TORCHFT_LITE_TLS_KEY", "TORCHFT_LITE_TLS_CA"):
            env.pop(name, None)  # TLS only where a case asks for it
        if case.endswith(TLS_SUFFIX):
            env.update(tls_env or {})
        self.name = f"{case}:{side}"
        self.log = tempfile.TemporaryFile()  # stderr (torchft's server logs every request there)
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True, env=env, cwd=ROOT, start_new_session=True)

    def send(self, **command: Any) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def answer(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            code = self.process.poll()
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{self.name} gave no answer within {timeout:.0f}s (exit code {code}); stderr:\n{tail}")
        return json.loads(line)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()


class Pair:
    """The two processes of one case, set up and connected; one :meth:`step` moves the state dict once."""

    def __init__(self, case: str, args: argparse.Namespace) -> None:
        self.case, self.size = case, args.size_mb << 20
        self.wait = args.timeout
        self.server = Child(case, "server", args, getattr(args, "tls_env", None))
        self.receiver = Child(case, "receiver", args, getattr(args, "tls_env", None))
        self.seconds: list[float] = []
        self.send_seconds: list[float] = []
        self.cpu: dict[str, list[float]] = {"server": [], "receiver": []}
        try:
            self.server.send(action="setup")
            peer = self.server.answer(self.wait)
            self.receiver.send(action="setup", peer=peer)
            self.receiver.answer(self.wait)
            for child in (self.server, self.receiver):
                child.send(action="connect", peer=peer)
            self._last = {"server": self.server.answer(self.wait)["cpu"],
                          "receiver": self.receiver.answer(self.wait)["cpu"]}
        except BaseException:
            self.kill()
            raise

    def _used(self, side: str, answer: dict) -> dict:
        self.cpu[side].append(answer["cpu"] - self._last[side])
        self._last[side] = answer["cpu"]
        return answer

    def step(self) -> float:
        """Seconds the receiver took for one transfer."""
        step = len(self.seconds)
        for child in (self.server, self.receiver):
            child.send(action="step", step=step)
        # published (HTTP) or sent (PG); the serving side's CPU counts to its release
        self.send_seconds.append(self.server.answer(self.wait).get("send_seconds", 0.0))
        self.seconds.append(self._used("receiver", self.receiver.answer(self.wait))["seconds"])
        self.server.send(action="release")
        self._used("server", self.server.answer(self.wait))
        return self.seconds[-1]

    def finish(self) -> dict:
        peaks = {}
        for name, child in (("server", self.server), ("receiver", self.receiver)):
            child.send(action="exit")
            peaks[name] = child.answer(self.wait)["peak_extra_bytes"]
        gib = self.size / (1 << 30)
        return {"case": self.case, "gbps": round(self.size / statistics.median(self.seconds) / 1e9, 3),
                "seconds": [round(s, 3) for s in self.seconds],
                "send_s": [round(s, 4) for s in self.send_seconds],
                "cpu_s_per_gib": {side: round(statistics.median(c) / gib, 3) for side, c in self.cpu.items()},
                "server_peak_extra_x": round(peaks["server"] / self.size, 3),
                "receiver_peak_extra_x": round(peaks["receiver"] / self.size, 3)}

    def kill(self) -> None:
        for child in (self.server, self.receiver):
            child.kill()


def touch_and_free(nbytes: int) -> None:
    """Write ``nbytes`` of fresh memory once, then free it, before the first case.

    On this VM the first case of a run paid about 0.5 s more on its first
    transfer than later ones, whichever library it was (ours-0 1.75 s as the
    first case, 1.0-1.4 s later; torchft-2 1.44 s first, 1.03 s later): the
    guest's free memory that no process had touched for a while costs more to
    fault in than memory freed a moment ago. Touching some first gives every
    case the same start, so the run order does not pick the winner.
    """
    buffer = bytearray(nbytes)  # zero-filled, so every page is written
    del buffer


def run_case(case: str, args: argparse.Namespace, ceiling: Pair | None) -> dict:
    """``args.steps`` transfers of ``case``, each followed by one raw TCP transfer on ``ceiling``.

    ``vs_tcp`` is the median over steps of (that TCP transfer's seconds / this
    step's seconds): each step is compared with the ceiling measured a moment
    later, so the machine's drift in speed (±30% and more over a minute on a
    shared VM) cancels out.
    """
    pair = Pair(case, args)
    try:
        ratios = []
        for _ in range(args.steps):
            seconds = pair.step()
            if ceiling is not None:
                ratios.append(ceiling.step() / seconds)
        result = pair.finish()
    finally:
        pair.kill()
    result["vs_tcp"] = round(statistics.median(ratios), 3) if ratios else None
    # The first transfer is into a receiver process that has never received: what a restarted replica's heal is.
    result["first_vs_tcp"] = round(ratios[0], 3) if ratios else None
    # The transfers after it: an allocating receiver may reuse memory it freed (torchft's allocator does).
    result["repeated_vs_tcp"] = round(statistics.median(ratios[1:]), 3) if len(ratios) > 1 else None
    return result


def torchft_available() -> bool:
    try:
        import torchft.checkpointing.http_transport  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024, help="MiB of float32 tensors in the state dict")
    parser.add_argument("--tensor-mb", type=int, default=4, help="MiB per tensor (the last one takes the rest)")
    parser.add_argument("--steps", type=int, default=5, help="transfers per case; the median is reported")
    parser.add_argument("--cases", default=",".join(ALL_CASES),
                        help="comma-separated subset of " + ",".join(ALL_CASES) + " (tcp, the ceiling, always runs), and "
                        "tcp-N (N >= 2 parallel raw streams), tcp-all (N = 2 .. the usable cores), ours-N[-inplace] (any N)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one answer")
    parser.add_argument("--receiver", choices=RECEIVERS, default="lean",
                        help="the HTTP client our cases heal through: the package's lean one, or aiohttp's")
    parser.add_argument("--tls", action="store_true",
                        help="also run each of our HTTP cases (ours-*) with TLS on, as <case>+tls, in the same run; "
                        "needs the openssl CLI (a throwaway CA and certificate)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where both sides hold the state dict (cuda: see the module docstring)")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        case, side = args.role.split(":")
        child_main(case, side, args)
        return 0
    cases = [case for case in args.cases.split(",") if case]
    if "tcp-all" in cases:  # every stream count the cores could use (tcp itself is one stream)
        at = cases.index("tcp-all")
        cases[at:at + 1] = [f"tcp-{n}" for n in range(2, max(2, len(os.sched_getaffinity(0))) + 1)]
    unknown = sorted(case for case in set(cases) - set(ALL_CASES)
                     if not (MULTI_STREAM.fullmatch(case) and int(case[4:]) >= 2) and not OUR_CHUNKS.fullmatch(case))
    if unknown:
        parser.error(f"unknown cases {unknown}")
    skipped = []
    if not torchft_available():
        skipped = [case for case in cases if case.startswith("torchft")]
        cases = [case for case in cases if case not in skipped]
    tls_dir = None
    if args.tls:
        from benchmarks._throwaway_pki import make_pki, openssl_missing

        if openssl_missing():
            parser.error(f"--tls: {openssl_missing()}")
        tls_dir = tempfile.TemporaryDirectory(prefix="heal_bench_tls_")
        args.tls_env = make_pki(Path(tls_dir.name)).env()
        cases = [c for case in cases for c in ([case, case + TLS_SUFFIX] if case.startswith("ours") else [case])]
    ceiling = Pair("tcp", args)  # kept up for the whole run: one step of it after every step of every case
    try:
        touch_and_free(3 * (args.size_mb << 20))
        results = {case: run_case(case, args, ceiling) for case in cases if case != "tcp"}
        results = {"tcp": dict(ceiling.finish(), vs_tcp=1.0, first_vs_tcp=1.0, repeated_vs_tcp=1.0), **results}
    finally:
        ceiling.kill()
        if tls_dir is not None:
            tls_dir.cleanup()
    print_report(results, summary(results, args, skipped), args.receiver)
    return 0


if __name__ == "__main__":
    sys.exit(main())
