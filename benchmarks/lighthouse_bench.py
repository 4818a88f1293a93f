"""Lighthouse scaling benchmark: N simulated replica groups in lockstep.

Each simulated group has its own connection, heartbeats every second and
calls Quorum once per round (step) with every other group; a round ends when
all N have their quorum. The groups run in this process on the lean h2c client
(benchmarks/_h2_client.py) or, with ``--client grpcio``, on grpc.aio, which
spends about twice the client CPU: on 2 cores that made the round time at
N=300 measure the load generator more than the server. The lighthouse runs in its own process: ours
(``python -m lighthouse``) and, when ``torchft`` is installed, torchft's Rust
``torchft_lighthouse`` in the same run as the reference.

``--tls`` runs each of our lighthouses a second time with TLS on, as
``<impl>+tls``, right after its plain twin (a throwaway CA and certificate made
with the openssl CLI; the lighthouse gets ``--tls-cert/--tls-key``, every
simulated group a TLS connection that checks it): ``tls_vs_plain_*`` in the
JSON line are its rounds/s and server CPU per round over the plain twin's.

Prints a table and one JSON line (the last line of output). Figures on a
2-core shared machine are noisy; compare the ratio within one run.

    python benchmarks/lighthouse_bench.py --sizes 10,100,300,1000 --rounds 10
    python benchmarks/lighthouse_bench.py --sizes 300 --impls ours --tls   # what TLS costs a round
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import queue
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# The client never forks; gRPC's fork support only adds per-call cost to the
# client, which is shared by every server measured.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import grpc  # noqa: E402

from benchmarks import torchft_ref  # noqa: E402
from benchmarks._h2_client import H2CallError, H2Channel  # noqa: E402
from benchmarks._throwaway_pki import Pki  # noqa: E402
from torchft_lite.rpc.protocol import torchft_pb2 as pb  # noqa: E402
from torchft_lite.rpc.tls import TlsSettings  # noqa: E402

TLS_SUFFIX = "+tls"
TLS_ENV = ("TORCHFT_LITE_TLS_CERT", "TORCHFT_LITE_TLS_KEY", "TORCHFT_LITE_TLS_CA")

LISTEN_RE = re.compile(r"Lighthouse listening on: \S+?:(\d+)\s*$")


@dataclass
class Result:
    impl: str
    n: int
    rounds: int
    first_round_s: float
    p50_s: float
    p90_s: float
    max_s: float
    rounds_per_s: float
    server_cpu_ms_per_round: float
    client_cpu_ms_per_round: float


def torchft_cli_available() -> bool:
    """torchft's own ``torchft_lighthouse`` CLI runs only when its package imports
    (it needs torch and OpenTelemetry; ``make bench`` installs the latter)."""
    probe = subprocess.run([sys.executable, "-c", "import torchft._torchft"], capture_output=True, timeout=120)
    return probe.returncode == 0 and shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))


def server_cmd(impl: str, flags: list[str]) -> list[str]:
    if impl == "ours":
        return [sys.executable, "-m", "lighthouse", *flags, "--http-bind", "off"]
    if impl == "ours-grpcio":
        return [sys.executable, "-m", "lighthouse", *flags, "--http-bind", "off", "--grpc-engine", "grpcio"]
    if impl == "torchft":
        # As users run it: torchft's CLI with its default (INFO) logging.
        return [str(Path(sys.executable).parent / "torchft_lighthouse"), *flags]
    if impl == "torchft-nolog":
        # torchft's Rust server started in-process without its CLI: no logger is set up.
        return [sys.executable, str(REPO / "benchmarks" / "torchft_ref.py"), *flags]
    raise ValueError(f"unknown implementation {impl!r}")


def start_server(impl: str, n: int, startup_timeout: float = 60.0,
                 pki: Pki | None = None) -> tuple[subprocess.Popen, int]:
    flags = ["--bind", "127.0.0.1:0", "--min_replicas", str(n), "--join_timeout_ms", "60000",
             "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", "5000"]
    cmd = server_cmd(impl.removesuffix(TLS_SUFFIX), flags)
    if impl.endswith(TLS_SUFFIX):
        if pki is None:
            raise ValueError(f"{impl} needs a certificate (run with --tls)")
        cmd += ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in TLS_ENV:
        env.pop(name, None)  # TLS only where the impl asks for it
    env.pop("GRPC_ENABLE_FORK_SUPPORT", None)  # each server runs with its own defaults
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    # A reader thread drains the output for the whole run (a full pipe would block
    # the server) and keeps its tail for error reports; here we only wait for the
    # "listening" line, with a deadline.
    lines: queue.Queue[str] = queue.Queue()
    proc.output_tail = collections.deque(maxlen=40)

    def drain() -> None:
        for line in proc.stdout:
            proc.output_tail.append(line)
            lines.put(line)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        match = LISTEN_RE.search(line)
        if match:
            return proc, int(match.group(1))
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{impl} lighthouse did not start within {startup_timeout}s:\n{''.join(proc.output_tail)}")


QUORUM_PATH = "/torchft.LighthouseService/Quorum"
HEARTBEAT_PATH = "/torchft.LighthouseService/Heartbeat"


def quorum_request(replica_id: str, step: int) -> pb.LighthouseQuorumRequest:
    member = pb.QuorumMember(
        replica_id=replica_id, address=f"http://host-{replica_id}:29512",
        store_address=f"host-{replica_id}:29500", step=step, world_size=8,
    )
    return pb.LighthouseQuorumRequest(requester=member)


class Group:
    """One simulated replica group on grpc.aio: its own channel, heartbeat loop and quorum calls."""

    def __init__(self, host: str, port: int, replica_id: str, tls: TlsSettings | None = None) -> None:
        self.replica_id = replica_id
        target = f"{host}:{port}"
        # A local subchannel pool gives every group its own TCP connection, as
        # separate processes would have; otherwise grpc shares one connection
        # between all channels to the same target.
        options = [("grpc.use_local_subchannel_pool", 1)]
        self.channel = grpc.aio.insecure_channel(target, options=options) if tls is None else \
            grpc.aio.secure_channel(target, tls.grpc_channel_credentials(), options=options)
        # Responses stay bytes: one group per round parses its quorum fully and
        # the others are checked against it by size, so the client measures the
        # lighthouse rather than a million protobuf objects per round at N=1000.
        self.quorum_call = self.channel.unary_unary(
            "/torchft.LighthouseService/Quorum",
            request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
        )
        self.heartbeat_call = self.channel.unary_unary(
            "/torchft.LighthouseService/Heartbeat",
            request_serializer=pb.LighthouseHeartbeatRequest.SerializeToString,
            response_deserializer=pb.LighthouseHeartbeatResponse.FromString,
        )
        self.heartbeat_errors = 0

    async def heartbeat_forever(self, interval: float) -> None:
        await asyncio.sleep(random.random() * interval)
        request = pb.LighthouseHeartbeatRequest(replica_id=self.replica_id)
        while True:
            try:
                await self.heartbeat_call(request, timeout=5.0)
            except grpc.aio.AioRpcError:
                self.heartbeat_errors += 1
            await asyncio.sleep(interval)

    async def quorum(self, step: int, timeout: float) -> bytes:
        return await self.quorum_call(quorum_request(self.replica_id, step), timeout=timeout, wait_for_ready=True)

    async def close(self) -> None:
        await self.channel.close()


class LeanGroup:
    """The same simulated replica group on benchmarks/_h2_client.py (about half grpc.aio's client CPU)."""

    def __init__(self, host: str, port: int, replica_id: str, tls: TlsSettings | None = None) -> None:
        self.replica_id = replica_id
        self.channel = H2Channel(host, port, tls=None if tls is None else tls.client_context("h2"))
        self.heartbeat_errors = 0

    async def heartbeat_forever(self, interval: float) -> None:
        await asyncio.sleep(random.random() * interval)
        request = pb.LighthouseHeartbeatRequest(replica_id=self.replica_id).SerializeToString()
        while True:
            try:
                await self.channel.unary(HEARTBEAT_PATH, request, timeout=5.0)
            except H2CallError:
                self.heartbeat_errors += 1
            await asyncio.sleep(interval)

    async def quorum(self, step: int, timeout: float) -> bytes:
        return await self.channel.unary(QUORUM_PATH, quorum_request(self.replica_id, step).SerializeToString(),
                                        timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()


CLIENTS = {"lean": LeanGroup, "grpcio": Group}


async def run_rounds(port: int, n: int, rounds: int, round_timeout: float, client: str,
                     tls: TlsSettings | None = None) -> list[float]:
    groups = [CLIENTS[client]("127.0.0.1", port, f"replica-{i:05d}", tls) for i in range(n)]
    heartbeats = [asyncio.create_task(g.heartbeat_forever(1.0)) for g in groups]
    times = []
    try:
        for step in range(rounds + 1):  # round 0 forms the first quorum (connections, joins)
            start = time.perf_counter()
            # Each call is bounded by round_timeout; the first failure ends the round
            # (a lost connection would otherwise wait out everyone's timeout).
            calls = [asyncio.ensure_future(g.quorum(step, round_timeout)) for g in groups]
            _, pending = await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
            times.append(time.perf_counter() - start)
            if pending:
                for call in pending:
                    call.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                failed = [(g.replica_id, c.exception()) for g, c in zip(groups, calls)
                          if not c.cancelled() and c.exception() is not None]
                shown = "; ".join(f"{rid}: {type(exc).__name__}: {exc}" for rid, exc in failed[:3])
                raise RuntimeError(f"round {step}: {len(failed)} of {n} quorum calls failed, {len(pending)} "
                                   f"still waiting ({shown})") from failed[0][1]
            responses = [c.result() for c in calls]
            quorum = pb.LighthouseQuorumResponse.FromString(responses[step % n]).quorum
            members = {m.replica_id for m in quorum.participants}
            if members != {g.replica_id for g in groups} or any(m.step != step for m in quorum.participants):
                raise RuntimeError(f"round {step}: quorum had {len(members)} members, expected all {n} at step {step}")
            # Every member must get the same quorum; the timestamp's encoding may vary by a byte or two.
            sizes = {len(r) for r in responses}
            if max(sizes) - min(sizes) > 8:
                raise RuntimeError(f"round {step}: responses differ in size: {sorted(sizes)[:3]}...")
    finally:
        for task in heartbeats:
            task.cancel()
        await asyncio.gather(*heartbeats, return_exceptions=True)
        await asyncio.wait_for(asyncio.gather(*(g.close() for g in groups)), round_timeout)
    return times


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(impl: str, n: int, rounds: int, round_timeout: float, client: str, pki: Pki | None = None) -> Result:
    proc, port = start_server(impl, n, pki=pki)
    tls = TlsSettings(ca=pki.ca) if impl.endswith(TLS_SUFFIX) and pki is not None else None
    server_cpu0 = process_cpu_seconds(proc.pid)
    client_cpu0 = time.process_time()
    try:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            loop_factory = None
        try:
            with asyncio.Runner(loop_factory=loop_factory) as runner:  # also makes it the current loop
                times = runner.run(run_rounds(port, n, rounds, round_timeout, client, tls))
        except BaseException:
            print(f"{impl} lighthouse (exit code {proc.poll()}) last output:\n{''.join(proc.output_tail)}",
                  file=sys.stderr)
            raise
        server_cpu = process_cpu_seconds(proc.pid) - server_cpu0
        client_cpu = time.process_time() - client_cpu0
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    steady = times[1:]
    qs = statistics.quantiles(steady, n=10) if len(steady) >= 2 else [steady[0]] * 9
    p50 = statistics.median(steady)
    per_round = 1000 / len(times)  # CPU includes the warm-up round and heartbeats
    return Result(impl, n, len(steady), times[0], p50, qs[8], max(steady), 1.0 / p50,
                  server_cpu * per_round, client_cpu * per_round)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,300,1000", help="comma-separated N (replica groups)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per size (after one warm-up); fewer is noisy")
    parser.add_argument(
        "--impls", default="ours,torchft,torchft-nolog",
        help="comma-separated: ours (native gRPC engine); ours-grpcio (the same lighthouse on grpc.aio); torchft (its torchft_lighthouse CLI with default logging, as users run it); "
        "torchft-nolog (its Rust server in-process, no logger). torchft ones are skipped when not installed",
    )
    parser.add_argument("--round-timeout", type=float, default=120.0, help="seconds a round may take")
    parser.add_argument(
        "--client", choices=sorted(CLIENTS), default="lean",
        help="load generator: lean (benchmarks/_h2_client.py, raw h2c, about half the client CPU) or grpcio "
        "(grpc.aio); the same client drives every server in a run (default: lean)",
    )
    parser.add_argument(
        "--tls", action="store_true",
        help="also run each of our lighthouses (ours, ours-grpcio) with TLS on, as <impl>+tls, right after its "
        "plain twin; needs the openssl CLI (a throwaway CA and certificate)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    impls = [i for i in args.impls.split(",") if i]
    if "torchft-nolog" in impls and torchft_ref.find_extension() is None:
        print("torchft not installed: skipping torchft-nolog (pip install --no-deps torchft-nightly)")
        impls.remove("torchft-nolog")
    if "torchft" in impls and not torchft_cli_available():
        print("torchft's CLI cannot start (needs torchft-nightly, torch and opentelemetry-sdk; `make bench` "
              "installs them): skipping torchft")
        impls.remove("torchft")

    pki, tls_dir = None, None
    if args.tls:
        from benchmarks._throwaway_pki import make_pki, openssl_missing

        if openssl_missing():
            parser.error(f"--tls: {openssl_missing()}")
        tls_dir = tempfile.TemporaryDirectory(prefix="lighthouse_bench_tls_")
        pki = make_pki(Path(tls_dir.name))
        impls = [i for impl in impls for i in ([impl, impl + TLS_SUFFIX] if impl.startswith("ours") else [impl])]

    results: list[Result] = []
    for n in sizes:
        for impl in impls:
            result = bench(impl, n, args.rounds, args.round_timeout, args.client, pki)
            results.append(result)
            print(f"  {impl:13s} N={n:5d}: p50 {result.p50_s * 1000:8.1f} ms  first {result.first_round_s:.2f} s  "
                  f"CPU/round: server {result.server_cpu_ms_per_round:.0f} ms, "
                  f"client {result.client_cpu_ms_per_round:.0f} ms", flush=True)

    if tls_dir is not None:
        tls_dir.cleanup()
    print()
    print(f"{'N':>6} {'impl':>13} {'p50 ms':>9} {'p90 ms':>9} {'max ms':>9} {'rounds/s':>9} {'srv CPU ms':>10} "
          f"{'cli CPU ms':>10} {'vs torchft/nolog':>17}")
    by_key = {(r.impl, r.n): r for r in results}
    summary = {}
    for r in results:
        ref = by_key.get(("torchft", r.n))
        nolog = by_key.get(("torchft-nolog", r.n))
        ratio = r.rounds_per_s / ref.rounds_per_s if ref and r.impl == "ours" else None
        ratio_nolog = r.rounds_per_s / nolog.rounds_per_s if nolog and r.impl == "ours" else None
        if ratio is not None:
            summary[f"speedup_vs_torchft_n{r.n}"] = round(ratio, 2)
        if ratio_nolog is not None:
            summary[f"speedup_vs_torchft_nolog_n{r.n}"] = round(ratio_nolog, 2)
        plain = by_key.get((r.impl.removesuffix(TLS_SUFFIX), r.n)) if r.impl.endswith(TLS_SUFFIX) else None
        if plain is not None:
            base = plain.impl.replace("-", "_")
            summary[f"tls_vs_plain_rounds_per_s_{base}_n{r.n}"] = round(r.rounds_per_s / plain.rounds_per_s, 2)
            summary[f"tls_vs_plain_server_cpu_{base}_n{r.n}"] = round(
                r.server_cpu_ms_per_round / plain.server_cpu_ms_per_round, 2) if plain.server_cpu_ms_per_round else None
        shown = " / ".join(f"{x:.2f}x" for x in (ratio, ratio_nolog) if x is not None)
        print(f"{r.n:6d} {r.impl:>13} {r.p50_s * 1000:9.1f} {r.p90_s * 1000:9.1f} {r.max_s * 1000:9.1f} "
              f"{r.rounds_per_s:9.2f} {r.server_cpu_ms_per_round:10.0f} {r.client_cpu_ms_per_round:10.0f} {shown:>17}")
    targets = {}
    if ("ours", 1000) in by_key:
        targets["n1000_p50_le_500ms"] = by_key[("ours", 1000)].p50_s <= 0.5
    if "speedup_vs_torchft_n300" in summary:
        targets["n300_ge_2x_torchft"] = summary["speedup_vs_torchft_n300"] >= 2.0
    print(json.dumps({"benchmark": "lighthouse", "cpus": os.cpu_count(), "client": args.client, "results": [asdict(r) for r in results],
                      **summary, "targets_met": targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
