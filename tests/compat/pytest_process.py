"""One pytest subprocess on one test file of torchft's wheel, followed until it ends.

Outcomes arrive from the plugin in ``plugin/`` as JSON lines while pytest runs; a
test still running past its limit, a file past its deadline, or a pytest that
finished but does not exit gets its whole process group killed, along with any
process that escaped the group but still carries the run's token.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ALIAS_DIR = HERE / "alias"
PLUGIN_DIR = HERE / "plugin"
TOKEN_VAR = "TORCHFT_COMPAT_TOKEN"
EXIT_GRACE_S = 15.0  # pytest finished its session but has not exited (threads left running)
HANG_GRACE_S = 30.0  # beyond --test-timeout, for a test pytest-timeout could not interrupt


@dataclasses.dataclass
class Outcome:
    outcome: str
    message: str = ""


@dataclasses.dataclass
class Attempt:
    """One pytest subprocess: what it reported, and why it was killed if it was."""

    rc: int | None = None
    collected: list[str] | None = None
    removed: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    results: dict[str, Outcome] = dataclasses.field(default_factory=dict)
    collect_error: str | None = None
    running: str | None = None  # a test that started and never reported
    finished: bool = False
    killed: str | None = None
    log_tail: str = ""


@dataclasses.dataclass
class Settings:
    wheel_dir: Path
    workdir: Path
    keyword: str | None
    test_timeout: float
    file_timeout: float
    run_deadline: float  # time.monotonic() by which every file must be done
    isolate_network: bool = False


def _stop(proc: subprocess.Popen, token: str) -> None:
    """Kill the pytest process group, then any process still carrying its token."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    # A test may start processes in a new session; they still inherit the environment.
    needle = f"{TOKEN_VAR}={token}".encode()
    for _ in range(5):
        found = False
        for entry in Path("/proc").glob("[0-9]*"):
            pid = int(entry.name)
            if pid == os.getpid():
                continue
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
                    found = True
            except (OSError, ValueError):
                continue
        if not found:
            return
        time.sleep(0.2)


def _read_events(path: Path, offset: int) -> tuple[list[dict], int]:
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()], offset + len(complete)


def run_pytest(side: str, file: str, skip: dict[str, list[str]], settings: Settings, deadline: float,
               collect_only: bool = False) -> Attempt:
    """Run one pytest subprocess on ``file`` and follow it until it ends or must be killed."""
    tag = uuid.uuid4().hex[:12]
    results, skip_file, log = (settings.workdir / f"{tag}.{suffix}" for suffix in ("jsonl", "skip.json", "log"))
    skip_file.write_text(json.dumps(skip))
    ini = settings.workdir / "pytest.ini"
    ini.write_text(f"[pytest]\ntimeout = {settings.test_timeout:g}\ntimeout_method = signal\n")
    command = [sys.executable, "-m", "pytest", str(settings.wheel_dir / file), "-c", str(ini),
               "--rootdir", str(settings.wheel_dir.parent), "--confcutdir", str(settings.wheel_dir),
               "--import-mode=append", "-p", "pytest_timeout", "-p", "torchft_compat_results",
               "-p", "no:cacheprovider", "-q"]
    if settings.keyword:
        command += ["-k", settings.keyword]
    if collect_only:
        command.append("--collect-only")
    if settings.isolate_network:
        # A network namespace of its own with only loopback up: torchft's tests bind
        # fixed ports (19530 and up), which collide with any other run on the machine.
        unshare = ["unshare", "--net"] + (["--map-root-user"] if os.geteuid() != 0 else [])
        command = [*unshare, "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]
    path = [str(PLUGIN_DIR)]
    if side == "torchft_lite":
        path = [str(ALIAS_DIR), str(PLUGIN_DIR), str(REPO)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [env.get("PYTHONPATH")] if p])
    # PYTHONHASHSEED: some files parameterize over a set, and test ids must be the
    # same in every process (both sides, and a file resumed after a hang).
    env.update({"TORCHFT_COMPAT_RESULTS": str(results), "TORCHFT_COMPAT_SKIP": str(skip_file),
                TOKEN_VAR: tag, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})

    attempt, offset, started_at, finished_at = Attempt(), 0, 0.0, 0.0
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=settings.workdir, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                rc = proc.poll()
                events, offset = _read_events(results, offset)
                for event in events:
                    kind = event["event"]
                    if kind == "collected":
                        attempt.collected, attempt.removed = event["ids"], event["removed"]
                    elif kind == "collect_error":
                        attempt.collect_error = attempt.collect_error or event["message"] or "collection failed"
                    elif kind == "start":
                        attempt.running, started_at = event["id"], time.monotonic()
                    elif kind == "result":
                        attempt.results[event["id"]] = Outcome(event["outcome"], event["message"])
                        attempt.running = None
                    elif kind == "finished":
                        attempt.finished, finished_at = True, time.monotonic()
                if rc is not None:
                    attempt.rc = rc
                    break
                now = time.monotonic()
                if now > deadline:
                    attempt.killed = "killed at the time limit (--file-timeout or --total-timeout)"
                elif attempt.running and now - started_at > settings.test_timeout + HANG_GRACE_S:
                    attempt.killed = f"killed: still running {now - started_at:.0f}s after it started"
                elif attempt.finished and now - finished_at > EXIT_GRACE_S:
                    attempt.killed = "pytest did not exit after its session finished (threads or processes left running)"
                if attempt.killed:
                    break
                time.sleep(0.25)
        finally:
            _stop(proc, tag)
    attempt.log_tail = log.read_bytes()[-3000:].decode(errors="replace")
    return attempt
