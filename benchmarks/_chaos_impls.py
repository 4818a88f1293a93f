"""The implementations a chaos run can compare, and what each can't be put through.

``torchft_lite`` runs our lighthouse (with its ``--state-dir``) and
``examples/train_ddp.py``; ``torchft`` runs torchft's own lighthouse CLI
(``torchft_lighthouse``, from torchft-nightly in the same environment) and the
same script with ``--impl torchft``. Both lighthouses get the same settings
(min_replicas, join and heartbeat timeouts, quorum tick), so the difference a
run measures is the libraries'.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from torchft_lite.cluster.local import LighthouseProcess, free_port

__all__ = ["IMPLS", "TorchftLighthouse", "make_lighthouse", "torchft_missing", "unsupported_kinds"]

IMPLS = ("torchft_lite", "torchft")

# Kinds a library can't be put through, and why (the run names them).
_UNSUPPORTED = {
    "torchft": {
        "kill-all": "torchft has no durable checkpoints: a job that lost every copy of its state starts over",
    },
}


def unsupported_kinds(impl: str) -> dict[str, str]:
    return dict(_UNSUPPORTED.get(impl, {}))


def _torchft_cli() -> str | None:
    return shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))


def torchft_missing(probe_import: bool = True) -> str | None:
    """Why torchft can't run here, or None when it can (its lighthouse CLI and package are installed;
    ``probe_import``: and ``import torchft`` works, tried in a subprocess: seconds, so not at test collection)."""
    if _torchft_cli() is None:
        return "torchft_lighthouse is not installed next to this Python (make installs torchft-nightly)"
    if importlib.util.find_spec("torchft") is None:
        return "the torchft package is not installed (make installs torchft-nightly)"
    if not probe_import:
        return None
    probe = subprocess.run([sys.executable, "-c", "import torchft"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"`import torchft` fails ({last}); make installs torchft-nightly"
    return None


class TorchftLighthouse:
    """torchft's lighthouse CLI on one port for its whole life, so a restart comes back where the groups dial."""

    def __init__(self, *, min_replicas: int, join_timeout: float, heartbeat_timeout: float, quorum_tick: float,
                 log_path: Path, host: str = "127.0.0.1", start_timeout: float = 60.0) -> None:
        self.port = free_port()
        self.host = host
        self.address = f"http://127.0.0.1:{self.port}"
        self.args = ["--bind", f"{host}:{self.port}", "--min_replicas", str(min_replicas),
                     "--join_timeout_ms", str(int(join_timeout * 1000)),
                     "--heartbeat_timeout_ms", str(int(heartbeat_timeout * 1000)),
                     "--quorum_tick_ms", str(max(1, int(quorum_tick * 1000)))]
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> "TorchftLighthouse":
        cli = _torchft_cli()
        if cli is None:
            raise SystemExit("torchft_lighthouse is not installed next to this Python (make installs torchft-nightly)")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([cli, *self.args], stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"torchft_lighthouse did not listen on port {self.port} within "
                                     f"{self.start_timeout:.0f}s (exit code {self.proc.poll()}); see {self.log_path}")
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def make_lighthouse(impl: str, *, groups: int, workdir: Path, host: str):
    """The impl's lighthouse as a production job would run it: min_replicas a majority of the groups (with
    fewer, a lone fresh group could train on while the groups holding the latest state hang: a fork), a
    1 s join timeout and a 2 s heartbeat timeout; ours also keeps the highest committed step in a state dir."""
    settings = dict(min_replicas=groups // 2 + 1, join_timeout=1.0, heartbeat_timeout=2.0, quorum_tick=0.05,
                    log_path=workdir / "lighthouse.log", host=host)
    if impl == "torchft":
        return TorchftLighthouse(**settings)
    return LighthouseProcess(**settings, state_dir=workdir / "lighthouse-state")
