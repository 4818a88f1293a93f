"""``make demo``: a lighthouse and three simulated replica groups, one killed and restarted.

Until the Manager lands this exercises the lighthouse alone: each group is a
separate process that heartbeats and joins the quorum each step (see
simulated_replica_group.py). The demo SIGKILLs one group, shows the survivors
form a quorum without it once its heartbeat expires, restarts it as a new
incarnation that joins behind and catches up to the max step, and prints a
summary. The dashboard is live at the printed URL while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUP = HERE / "simulated_replica_group.py"


class Proc:
    """A child process whose JSON event lines are collected in the background."""

    def __init__(self, name: str, cmd: list[str]) -> None:
        self.name = name
        self.events: list[dict] = []
        self.lines: list[str] = []
        self.popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line)
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def wait_for(predicate, what: str, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise SystemExit(f"demo failed: timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="lighthouse heartbeat timeout")
    parser.add_argument("--run-seconds", type=float, default=3.0, help="seconds of training between events")
    args = parser.parse_args()

    lighthouse = Proc("lighthouse", [
        sys.executable, "-m", "lighthouse", "--min_replicas", "2", "--bind", "127.0.0.1:0",
        "--http-bind", "127.0.0.1:0", "--join_timeout_ms", "3000",
        "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms),
    ])
    groups: dict[str, Proc] = {}
    try:
        wait_for(lambda: any("listening on" in line for line in lighthouse.lines), "the lighthouse to start", 60)
        line = next(line for line in lighthouse.lines if "listening on" in line)
        grpc_port, http_port = re.search(r":(\d+), dashboard at http://localhost:(\d+)", line).groups()
        address = f"http://127.0.0.1:{grpc_port}"
        print(f"lighthouse at {address}; dashboard: http://127.0.0.1:{http_port}/")

        def start_group(name: str) -> Proc:
            proc = Proc(name, [sys.executable, str(GROUP), "--lighthouse", address, "--replica-id", name,
                               "--step-time", "0.1"])
            groups[name] = proc
            return proc

        def quorum_events(proc: Proc) -> list[dict]:
            return [e for e in proc.events if e["event"] == "quorum"]

        for name in ("group0", "group1", "group2"):
            start_group(name)
        wait_for(lambda: all(len(quorum_events(g)) >= 5 for g in groups.values()), "three groups training", 60)
        time.sleep(args.run_seconds)

        victim = groups.pop("group2")
        killed_at_step = quorum_events(victim)[-1]["step"]
        victim.stop(signal.SIGKILL)
        killed_at = time.time()
        print(f"SIGKILLed group2 at step {killed_at_step}")
        survivors = list(groups.values())

        def reformed() -> bool:
            return all(any(e["t"] > killed_at and len(e["members"]) == 2 for e in quorum_events(g)) for g in survivors)

        wait_for(reformed, "the survivors to re-form without group2", 60)
        stall = min(e["t"] for g in survivors for e in quorum_events(g)
                    if e["t"] > killed_at and len(e["members"]) == 2) - killed_at
        print(f"survivors formed a 2-member quorum {stall:.2f}s after the kill (heartbeat timeout "
              f"{args.heartbeat_timeout_ms} ms)")
        time.sleep(args.run_seconds)

        restarted = start_group("group2")
        restart_at = time.time()
        wait_for(lambda: any(e["healed_from"] for e in quorum_events(restarted)), "group2 to rejoin and catch up", 60)
        rejoin = next(e for e in quorum_events(restarted) if e["healed_from"])
        print(f"group2 restarted as a new member, joined quorum {rejoin['quorum_id']} "
              f"{rejoin['t'] - restart_at:.2f}s after start, caught up to step {rejoin['step']} "
              f"from {rejoin['healed_from']}")
        time.sleep(args.run_seconds)

        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/api/status", timeout=30) as response:
            status = json.load(response)
        final_steps = {name: quorum_events(g)[-1]["step"] for name, g in groups.items()}
        stats = status["statistics"]
        print("\n=== demo summary ===")
        print(f"quorums issued: {stats['quorums_issued']}, quorum id changes: {stats['quorum_id_changes']}, "
              f"replicas expired: {stats['expired_replicas']}")
        print(f"failures survived: 1 (SIGKILL of group2 at step {killed_at_step}); detection + re-form: {stall:.2f}s")
        print(f"last steps per group: {final_steps}")
        print(f"current quorum: {[m['replica_id'] for m in status['quorum']['members']]}")
        in_lockstep = max(final_steps.values()) - min(final_steps.values()) <= 1
        print(f"groups in lockstep after the restart: {'yes' if in_lockstep else 'NO'}")
        print("(simulated groups; real training with live heal arrives with the Manager)")
        return 0 if in_lockstep else 1
    finally:
        for proc in list(groups.values()):
            proc.stop()
        lighthouse.stop()


if __name__ == "__main__":
    sys.exit(main())
