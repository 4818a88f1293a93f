"""A real single-node Slurm for a test: a private munged, slurmctld and slurmd, started as root.

Everything is private to the test: munged listens on a socket in the test's
directory with a key made for it, the daemons use ports that were free a
moment ago and state directories under the test's directory, and every client
command finds them through ``SLURM_CONF``. Nothing touches the machine's own
Slurm or munge, if it has any. :meth:`SingleNodeSlurm.stop` cancels every job
and stops the three daemons, whatever happened before.

The node claims more CPUs than the machine has (``config_overrides``), so a
lighthouse job and two group jobs run at once on two cores.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from torchft_lite.cluster.local import free_port, stop_tree

__all__ = ["SingleNodeSlurm"]

_DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")


class SingleNodeSlurm:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.socket = root / "munge" / "munge.socket"
        self.procs: list[subprocess.Popen] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why a single-node Slurm can't run here, or None."""
        if os.geteuid() != 0:
            return "starting slurmctld and slurmd needs root"
        missing = [name for name in _DAEMONS if shutil.which(name) is None]
        if missing:
            return (f"{', '.join(missing)} not installed (Debian's slurm-wlm and munge: make slurm installs them "
                    f"where it runs as root with apt)")
        return None

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _config(self) -> str:
        node = socket.gethostname().split(".")[0]
        root = self.root
        return "\n".join([
            "ClusterName=tftltest",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire is also how long a requeued job waits before it may start again (120 s by default)
            f"AuthInfo=socket={self.socket},cred_expire=10",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "SchedulerParameters=sched_interval=2",
            "ReturnToService=2",
            "MinJobAge=600",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 State=UNKNOWN",
            f"PartitionName=main Nodes={node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def start(self, timeout: float = 60.0) -> "SingleNodeSlurm":
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        self.conf.write_text(self._config())
        log = open(self.root / "log" / "daemons.out", "ab")
        # --force: munged refuses root otherwise; -F/-D: in the foreground, so they are our children.
        self._spawn(["munged", "-F", "--force", f"--socket={self.socket}", f"--key-file={key}",
                     f"--log-file={self.root / 'log' / 'munged.log'}",
                     f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                     f"--seed-file={self.root / 'munge' / 'munged.seed'}"], log)
        self._wait(lambda: self.socket.exists(), "munged's socket", timeout)
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], log)
        self._wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, "slurmctld", timeout)
        self._spawn(["slurmd", "-D", "-f", str(self.conf)], log)
        self._wait(lambda: "idle" in self.run(["sinfo", "-h", "-o", "%T"], check=False).stdout, "the node idle",
                   timeout)
        return self

    def _spawn(self, command: list[str], log) -> None:
        self.procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                           env={**os.environ, **self.env}))

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"single-node Slurm: no {what} after {timeout:.0f}s"
                                   + (f" ({', '.join(dead)} exited)" if dead else "")
                                   + f"; see {self.root / 'log'}")
            time.sleep(0.2)

    def run(self, command: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        env = {**os.environ, **self.env, **kwargs.pop("env", {})}
        return subprocess.run(command, capture_output=True, text=True, check=check, timeout=60, env=env, **kwargs)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` of one job (an array task: ``ARRAYID_TASK``) as a dict."""
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def stop(self) -> None:
        if self.procs and self.procs[-1].poll() is None:
            self.run(["scancel", "--full", "--user=root"], check=False)
            deadline = time.monotonic() + 30
            while self.run(["squeue", "-h"], check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for proc in reversed(self.procs):  # slurmd, slurmctld, munged
            stop_tree(proc, 10)
        self.procs = []
        for pid in self._leftovers():  # slurmstepd and job processes whose parent already left
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _leftovers(self) -> list[int]:
        """Processes that carry this cluster's SLURM_CONF: every job's (sbatch passes it on) and the daemons'."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                found.append(int(entry))
        return found
