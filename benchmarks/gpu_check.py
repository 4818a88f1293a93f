"""``make gpu-check``: what the GPU work claims, on one GPU, in one summary table (issue 26).

Runs from a plain checkout (``PYTHONPATH=.``) on the machine's own torch, in
three phases, each of an existing test or benchmark:

* ``tests``: ``pytest tests/gpu`` (every CUDA path's test);
* ``training``: ``benchmarks/recovery_bench.py``'s run of 3 replica groups of
  ``examples/train_ddp.py --device cuda`` sharing the GPU (DDP, a
  ~30M-parameter MLP, gloo across groups), the last group SIGKILLed (its
  whole process tree) after 10 steps and restarted, trained on for
  ``--steps-after`` steps past its rejoin. Parameter checksums are compared
  at every step more than one group committed (0 divergent is the goal):
  ours with fingerprints off, ours with them on (they must not be what saves
  the run), and torchft's; the step time and the rejoin come from the same
  runs;
* ``heal``: ``benchmarks/heal_bench.py --device cuda``, a 1 GiB GPU state dict
  between two processes, ours (in place, and into fresh tensors then copied
  to the GPU) beside torchft's, with how long ``send_checkpoint`` held the
  sender; and the pinned host-to-device copy of the same bytes, the ceiling.

What it needs beyond the machine's torch: ``hpack`` and ``protobuf>=7.35.1``
(ours), and ``torchft-nightly`` with its OpenTelemetry imports (the
comparisons; without them torchft's columns say "-"). ``make gpu-wheels``
downloads them into ``.whl/`` on a machine with a network; ``make gpu-check``
installs them from there into ``GPU_SITE`` first. The table names what is
missing. Exit status 1 when a test failed, a step diverged or a phase broke;
goals missed are shown, not failed.

``--device cpu`` runs the same phases on the CPU, small (the CUDA tests
skip): it checks that the script starts and prints its table without a GPU.

    make gpu-check                                  # on the GPU machine
    python -m benchmarks.gpu_check --device cpu     # the dry run, anywhere
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import recovery_bench  # noqa: E402

PHASES = ("tests", "training", "heal")
NEEDED = (  # (import name, distribution, minimum version or None, what it is for)
    ("hpack", "hpack", None, "ours: the lighthouse's gRPC server"),
    ("google.protobuf", "protobuf", "7.35.1", "ours: the generated gRPC code checks this floor"),
    ("torchft", "torchft-nightly", None, "the torchft comparisons"),
    ("opentelemetry.sdk", "opentelemetry-sdk", None, "torchft's imports"),
    ("opentelemetry.exporter.otlp.proto.http", "opentelemetry-exporter-otlp-proto-http", None, "torchft's imports"),
)
HEAL_CASES = ("ours-default-inplace", "ours-default", "torchft-0", "torchft-4")
FINGERPRINTS_ON = "25"  # every 25 steps: several fingerprints in a run, so they could heal a divergence


# ---------------------------------------------------------------- what the machine has


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def missing_packages() -> list[str]:
    """``"<distribution> (<why>)"`` for each package this check needs and cannot import (or has too old)."""
    missing = []
    for module, distribution, minimum, why in NEEDED:
        try:
            importlib.import_module(module)
            if minimum is not None:
                found = importlib.metadata.version(distribution)
                if _version_tuple(found) < _version_tuple(minimum):
                    missing.append(f"{distribution}>={minimum} ({why}; found {found})")
        except Exception as exc:  # an ImportError, or a broken install that fails on import
            missing.append(f"{distribution} ({why}: {type(exc).__name__})")
    return missing


def machine(device: str) -> dict[str, Any]:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "device": device, "cpus": os.cpu_count()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


# ---------------------------------------------------------------- the phases


def run_tests(out: Path, timeout: float) -> dict[str, Any]:
    """``pytest tests/gpu``: counts, and the ids of the tests that failed."""
    junit = out / "gpu-tests.xml"
    log = out / "gpu-tests.log"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", f"--junitxml={junit}",
               "-o", "junit_family=xunit2"]
    with open(log, "w") as sink:
        try:
            code = subprocess.run(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return {"error": f"pytest tests/gpu did not finish within {timeout:.0f}s (see gpu-tests.log)"}
    if not junit.exists():
        return {"error": f"pytest exited {code} without a report (see gpu-tests.log)"}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed, skip_reasons = [], set()
    for case in ElementTree.parse(junit).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            skip_reasons.add(case.find("skipped").get("message", ""))
        else:
            counts["passed"] += 1
    return {**counts, "failed_tests": failed, "skip_reasons": sorted(skip_reasons), "exit_code": code}


def run_training(out: Path, device: str, hidden: int, steps_after: int, torchft: bool) -> dict[str, Any]:
    """Three recovery_bench runs (3 groups, one killed and restarted): ours without and with fingerprints, torchft."""
    recovery_bench.compile_bytecode()  # restarted processes load bytecode, as an installed library would
    runs: list[tuple[str, str, dict[str, str]]] = [
        ("ours", "torchft_lite", {"TORCHFT_LITE_FINGERPRINT_EVERY": "0"}),
        ("ours_fingerprints", "torchft_lite", {"TORCHFT_LITE_FINGERPRINT_EVERY": FINGERPRINTS_ON}),
    ]
    if torchft:
        runs.append(("torchft", "torchft", {}))
    visible = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]} \
        if device == "cuda" else {}
    results = {}
    for label, impl, env in runs:
        started = time.monotonic()
        try:
            result = recovery_bench.run(impl, 3, 1, out / f"training-{label}", "survive", hidden=hidden,
                                        train_args=("--device", device), env={**env, **visible}, step_sleep=0.0,
                                        steps_after=steps_after)
        except (SystemExit, Exception) as exc:  # a run that broke is a row of the table, not the end of the check
            results[label] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        result.pop("breakdowns", None)
        medians = {f"{key}_p50_s": statistics.median(result[f"{key}_s"]) for key in ("stall", "rejoin")
                   if result.get(f"{key}_s")}
        results[label] = {**result, **medians, "wall_s": round(time.monotonic() - started, 1)}
    return results


def run_heal(out: Path, device: str, size_mb: int, steps: int, torchft: bool, timeout: float) -> dict[str, Any]:
    cases = [case for case in HEAL_CASES if torchft or not case.startswith("torchft")]
    command = [sys.executable, "-m", "benchmarks.heal_bench", "--device", device, "--size-mb", str(size_mb),
               "--steps", str(steps), "--cases", ",".join(cases)]
    log = out / "heal-bench.log"
    with open(log, "w") as sink:
        try:
            subprocess.run(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"heal_bench did not finish within {timeout:.0f}s (see heal-bench.log)"}
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("{")]
    if not lines:
        return {"error": "heal_bench printed no result (see heal-bench.log)"}
    result = json.loads(lines[-1])
    result["h2d_gbps"] = pinned_copy_gbps(size_mb) if device == "cuda" else None
    return result


def pinned_copy_gbps(size_mb: int) -> float:
    """GB/s of one pinned host-to-device copy of ``size_mb`` MiB (the median of three): a heal's ceiling on the GPU."""
    import torch

    host = torch.empty(size_mb << 20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    seconds = []
    for _ in range(3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    return round((size_mb << 20) / statistics.median(seconds) / 1e9, 1)


# ---------------------------------------------------------------- the table


def _fmt(value: Any, unit: str = "", digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def _met(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _first(seconds: dict, case: str) -> float | None:
    values = seconds.get(case) or []
    return values[0] if values else None


def _repeated(seconds: dict, case: str) -> float | None:
    values = (seconds.get(case) or [])[1:]
    return statistics.median(values) if values else None


def _best(seconds: dict, pick: Callable[[dict, str], float | None], prefix: str) -> float | None:
    values = [pick(seconds, case) for case in seconds if case.startswith(prefix)]
    values = [v for v in values if v is not None]
    return min(values) if values else None


def rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(what, ours, torchft, goal, met) for every line of the summary."""
    table: list[tuple[str, str, str, str, str]] = []
    tests = results.get("tests")
    if tests is not None:
        if "error" in tests:
            table.append(("tests/gpu", tests["error"], "", "all pass", "NO"))
        else:
            shown = f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped"
            table.append(("tests/gpu", shown, "", "none fails", _met(tests["failed"] == 0)))
    training = results.get("training")
    if training is not None and "error" in training:
        table.append(("3 groups, kill+restart", training["error"][:60], "", "0 divergent", "NO"))
    elif training is not None:
        ours, prints, theirs = (training.get(k) or {} for k in ("ours", "ours_fingerprints", "torchft"))

        def diverged(run: dict) -> str:
            if "error" in run:
                return f"broke: {run['error'][:60]}"
            return f"{run['divergent_steps']} of {run['compared_steps']}" if run else "-"

        table.append(("3 groups, kill+restart: divergent steps (fingerprints off)", diverged(ours), diverged(theirs),
                      "0", _met(ours.get("divergent_steps") == 0 if "divergent_steps" in ours else None)))
        table.append(("  the same, fingerprints every 25 steps", diverged(prints), "", "0",
                      _met(prints.get("divergent_steps") == 0 if "divergent_steps" in prints else None)))
        step, step_theirs = ours.get("step_p50_s"), theirs.get("step_p50_s")
        table.append(("step time, median", _fmt(step and step * 1e3, " ms", 1),
                      _fmt(step_theirs and step_theirs * 1e3, " ms", 1), "<= torchft's",
                      _met(None if step is None or step_theirs is None else step <= step_theirs)))
        rejoin, rejoin_theirs = ours.get("rejoin_p50_s"), theirs.get("rejoin_p50_s")
        table.append(("restarted group: restart to first commit", _fmt(rejoin, " s"), _fmt(rejoin_theirs, " s"),
                      "<= torchft's", _met(None if rejoin is None or rejoin_theirs is None else rejoin <= rejoin_theirs)))
        table.append(("survivors' stall after the kill", _fmt(ours.get("stall_p50_s"), " s"),
                      _fmt(theirs.get("stall_p50_s"), " s"), "", ""))
    heal = results.get("heal")
    if heal is not None:
        if "error" in heal:
            table.append(("heal", heal["error"], "", "", "NO"))
        else:
            seconds, sends = heal.get("seconds", {}), heal.get("send_s", {})
            size = f"{heal.get('size_mb')} MiB"
            first_ours = _first(seconds, "ours-default-inplace")
            first_theirs = _best(seconds, _first, "torchft")
            speedup = _ratio(first_theirs, first_ours)
            table.append((f"first heal of {size} into a fresh process, in place", _fmt(first_ours, " s"),
                          _fmt(first_theirs, " s"), ">= 1.5x faster",
                          _met(None if speedup is None else speedup >= 1.5)))
            table.append(("  the same into fresh tensors, then copied to the model", _fmt(
                _first(seconds, "ours-default"), " s"), "", "", ""))
            rep_ours = _repeated(seconds, "ours-default-inplace")
            rep_theirs = _best(seconds, _repeated, "torchft")
            table.append(("repeated heals, median", _fmt(rep_ours, " s"), _fmt(rep_theirs, " s"), ">= 1x",
                          _met(None if rep_ours is None or rep_theirs is None else rep_ours <= rep_theirs)))
            send_ours = max(sends.get("ours-default-inplace") or [0.0])
            theirs_sends = [max(v) for c, v in sends.items() if c.startswith("torchft") and v]
            table.append(("send_checkpoint holds the training thread, at most", _fmt(send_ours * 1e3, " ms", 1),
                          _fmt(max(theirs_sends) * 1e3 if theirs_sends else None, " ms", 1), "<= 10 ms",
                          _met(send_ours <= 0.010)))
            table.append(("pinned host-to-device copy (the ceiling)", _fmt(heal.get("h2d_gbps"), " GB/s", 1), "",
                          "", ""))
    return table


def format_table(results: dict[str, Any]) -> str:
    lines = [f"{'what':<58}{'torchft_lite':>32}{'torchft':>14}{'goal':>16}{'met':>5}", "-" * 125]
    for what, ours, theirs, goal, met in rows(results):
        lines.append(f"{what:<58}{ours:>32}{theirs:>14}{goal:>16}{met:>5}")
    info = results["machine"]
    lines.append(f"machine: {info}; missing: {', '.join(results['missing']) or 'nothing'}")
    lines.append("this table is the only GPU evidence: a line is done when a run of this check shows it")
    return "\n".join(lines)


def failed(results: dict[str, Any]) -> bool:
    """A test failed, a step diverged, or a phase broke (a missed speed goal is not a failure)."""
    tests = results.get("tests") or {}
    if "error" in tests or tests.get("failed"):
        return True
    training = results.get("training") or {}
    if "error" in training:
        return True
    for run in training.values():
        if "error" in run or run.get("divergent_steps"):
            return True
    return "error" in (results.get("heal") or {})


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: the check; cpu: a small dry run of the same phases (the CUDA tests skip)")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ",".join(PHASES))
    parser.add_argument("--hidden", type=int, help="train_ddp.py's --hidden (default: 5440 on cuda, ~30M "
                                                   "parameters; 64 on cpu)")
    parser.add_argument("--steps-after", type=int, help="steps the restarted group trains past its rejoin "
                                                        "(default: 150 on cuda, 10 on cpu)")
    parser.add_argument("--heal-mb", type=int, help="MiB of the healed state dict (default: 1024 on cuda, 16 on cpu)")
    parser.add_argument("--heal-steps", type=int, default=3, help="transfers per heal case (the first is a fresh "
                                                                   "receiver's)")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for all phases: a phase that would start with less than a minute left is "
                             "skipped and says so (the GPU machine's command limit is 600 s)")
    parser.add_argument("--out", help="write summary.json, summary.txt and logs.tar.gz here (default: a new "
                                      "temporary directory)")
    args = parser.parse_args(argv)
    phases = [phase for phase in args.phases.split(",") if phase]
    if not set(phases) <= set(PHASES):
        parser.error(f"--phases: unknown {sorted(set(phases) - set(PHASES))}")
    cuda = args.device == "cuda"
    hidden = args.hidden or (5440 if cuda else 64)
    steps_after = args.steps_after if args.steps_after is not None else (100 if cuda else 10)
    heal_mb = args.heal_mb or (1024 if cuda else 16)
    import torch

    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible to torch here (use --device cpu for the dry run)")
    # Every process started here imports this checkout (a relative PYTHONPATH=. would follow their cwd).
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(
        os.pathsep))])
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-work-"))
    missing = missing_packages()
    torchft = not any(name.startswith(("torchft", "opentelemetry")) for name in missing)
    results: dict[str, Any] = {"machine": machine(args.device), "missing": missing, "hidden": hidden,
                               "steps_after": steps_after}
    print(f"gpu-check on {results['machine']}; missing: {missing or 'nothing'}; logs in {work}", flush=True)
    if any(name.startswith(("hpack", "protobuf")) for name in missing):
        print("cannot run: ours needs hpack and protobuf>=7.35.1 (make gpu-wheels, then carry .whl)", flush=True)
        return 1
    started = time.monotonic()

    def left() -> float:
        return args.budget - (time.monotonic() - started)

    for phase in phases:
        if left() < 60:
            results[phase] = {"error": f"skipped: {args.budget - left():.0f} s of the {args.budget:.0f} s budget "
                                       f"were spent before it"}
        elif phase == "tests":
            results["tests"] = run_tests(work, timeout=min(300.0, left()))
        elif phase == "training":
            results["training"] = run_training(work, args.device, hidden, steps_after,
                                               torchft and recovery_bench.torchft_available())
        else:
            results["heal"] = run_heal(work, args.device, heal_mb, args.heal_steps, torchft, timeout=left())
        print(f"{phase} ({time.monotonic() - started:.0f} s in): {json.dumps(results[phase])}", flush=True)
    results["wall_s"] = round(time.monotonic() - started, 1)
    text = format_table(results) + f"\nwall time {results['wall_s']} s"
    print(text, flush=True)
    (out / "summary.txt").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as archive:
        archive.add(work, arcname="gpu-check")
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"gpu_check": {"failed": failed(results), "out": str(out)}}))
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
