"""Run the test files shipped in torchft's wheel against torchft and torchft_lite.

Every test file of the installed torchft package is read from it at run time,
never copied into this repository. Each file runs in its own pytest subprocess,
once as is (the torchft side) and once with ``tests/compat/alias`` first on
PYTHONPATH, where ``import torchft`` is torchft_lite (the torchft_lite side).
Prints a table, the tests torchft passes and torchft_lite does not, the tests
left out (tests/compat/cases.py) with their reasons, and one JSON line; writes
every test's outcome (with the first line of its error) to ``--report``.
``make compat`` runs this.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.machinery
import importlib.metadata
import json
import re
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a script: make `tests.compat` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.compat.cases import EXCLUDED, excluded_pattern, wheel_test_files
from tests.compat.pytest_process import HANG_GRACE_S, Outcome, Settings, run_pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SIDES = ("torchft", "torchft_lite")
OUTCOMES = ("passed", "failed", "skipped", "error", "timeout", "not_run")
MIN_ATTEMPT_S = 20.0  # do not resume a file with less time than this left

EPILOG = """\
exit status:
  0  the harness ran: every requested file ran on every requested side (to its
     end or to its time limits). Failing torchft_lite tests are expected for
     now and do not change the status; they are listed in the report. Also 0,
     with a note, when torchft is not installed and --require-torchft is not given.
  1  the harness broke: torchft is not installed but --require-torchft was
     given, a requested file is not in the wheel, the torchft side of a file
     could not run at all (collection error, nothing collected), or pytest
     itself failed (internal or usage error) on either side, or no file collected
     a single test on torchft's side.
  2  bad command line.

outcomes in the report: passed, failed, skipped, error (collection failed,
e.g. an ImportError), timeout (hung past the limit; the process was killed),
not_run (its file ran out of time first).
"""


@dataclasses.dataclass
class SideRun:
    collected: list[str] | None = None
    excluded: list[str] = dataclasses.field(default_factory=list)
    outcomes: dict[str, Outcome] = dataclasses.field(default_factory=dict)
    collect_error: str | None = None
    broken: str | None = None
    out_of_time: bool = False  # not started: the run's time budget was spent
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def find_wheel_dir() -> Path | None:
    """The installed torchft package directory, without importing it."""
    spec = importlib.machinery.PathFinder.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def torchft_version() -> str:
    names = importlib.metadata.packages_distributions().get("torchft", [])
    return ", ".join(f"{name} {importlib.metadata.version(name)}" for name in sorted(set(names))) or "unknown"


# --- one file on one side ----------------------------------------------------------


def run_side(side: str, file: str, settings: Settings, collect_only: bool = False) -> SideRun:
    """Run ``file`` on ``side``; after a hang, go on with the tests not yet run."""
    begin = time.monotonic()
    deadline = min(begin + settings.file_timeout, settings.run_deadline)
    excluded = [excluded_pattern("torchft/" + test_id) for test_id in EXCLUDED if test_id.startswith(file + "::")]
    run = SideRun()
    if deadline - begin < MIN_ATTEMPT_S:
        run.out_of_time = True
        run.notes.append(f"{file}: not run: the run's time budget (--total-timeout) was spent")
        return run
    while True:
        skip = {"excluded": excluded, "done": [re.escape(test_id) for test_id in run.outcomes]}
        attempt = run_pytest(side, file, skip, settings, deadline, collect_only)
        if run.collected is None and attempt.collected is not None:
            run.collected, run.excluded = attempt.collected, attempt.removed.get("excluded", [])
        run.outcomes.update(attempt.results)
        if "INTERNALERROR>" in attempt.log_tail or (attempt.rc == 4 and attempt.collected is None):
            run.broken = f"pytest failed (exit {attempt.rc}: internal or usage error):\n{attempt.log_tail}"
            break
        if attempt.collect_error is not None or (attempt.collected is None and attempt.killed is None):
            last_line = (attempt.log_tail.strip().splitlines() or [""])[-1]
            run.collect_error = attempt.collect_error or f"pytest ended (exit {attempt.rc}) before collecting: {last_line}"
            break
        if attempt.killed is None and attempt.finished:
            break
        reason = attempt.killed or f"the pytest process exited (status {attempt.rc}) during this test"
        run.notes.append(f"{attempt.running or file}: {reason}")
        if attempt.running is None:
            break
        run.outcomes[attempt.running] = Outcome("timeout" if attempt.killed else "error", reason)
        if deadline - time.monotonic() < MIN_ATTEMPT_S:
            break
    if run.collected is None and run.collect_error is None and run.broken is None:
        run.collect_error = "did not finish collecting: " + (run.notes[-1] if run.notes else "no report")
    for test_id in run.collected or []:
        if test_id not in run.outcomes and not collect_only:
            run.outcomes[test_id] = Outcome("not_run", "not run: out of time (--file-timeout or --total-timeout)")
    run.seconds = time.monotonic() - begin
    return run


@dataclasses.dataclass
class FileReport:
    file: str
    ids: list[str]
    excluded: list[str]
    sides: dict[str, SideRun]

    def counts(self, side: str) -> dict[str, int]:
        counts = dict.fromkeys(OUTCOMES, 0)
        for test_id in self.ids:
            counts[self.outcome(side, test_id).outcome] += 1
        return counts

    def outcome(self, side: str, test_id: str) -> Outcome:
        run = self.sides[side]
        if test_id in run.outcomes:
            return run.outcomes[test_id]
        if run.collect_error is not None:
            return Outcome("error", run.collect_error)
        return Outcome("not_run", "not run: the run's time budget (--total-timeout) was spent")


def run_file(file: str, sides: tuple[str, ...], settings: Settings) -> FileReport:
    runs = {side: run_side(side, file, settings) for side in sides}
    reference = runs.get("torchft")
    if reference is None:  # the test ids come from torchft's own collection
        reference = run_side("torchft", file, settings, collect_only=True)
    ids = list(reference.collected or [])
    for run in runs.values():
        ids += [test_id for test_id in run.collected or [] if test_id not in ids]
    excluded = sorted({test_id for run in (reference, *runs.values()) for test_id in run.excluded})
    if "torchft" not in runs:
        runs = {"torchft": dataclasses.replace(reference, outcomes={}), **runs}
    return FileReport(file, ids, excluded, runs)


def harness_errors(report: FileReport, keyword: str | None) -> list[str]:
    """What went wrong with the harness itself on this file. A file that collects no tests is not one: some
    test files of the wheel hold only helpers, or define their tests only where Triton imports."""
    errors = [f"{report.file} [{side}]: {run.broken}" for side, run in report.sides.items() if run.broken]
    torchft = report.sides["torchft"]
    if torchft.collect_error is not None and not torchft.out_of_time:
        errors.append(f"{report.file} [torchft]: collection failed: {torchft.collect_error}")
    return errors


def run_errors(reports: list[FileReport], keyword: str | None) -> list[str]:
    """The harness errors of every file, and of the run: torchft's side collected nothing at all."""
    errors = [error for report in reports for error in harness_errors(report, keyword)]
    ran = [report for report in reports if not report.sides["torchft"].out_of_time]
    if ran and not keyword and not any(report.sides["torchft"].collected for report in ran):
        errors.append("no test file collected a single test on torchft's side")
    return errors


def gaps(reports: list[FileReport], sides: tuple[str, ...]) -> list[tuple[str, str]]:
    """(test id, torchft_lite's outcome and message) of every test torchft passes and torchft_lite does not."""
    if sides != SIDES:
        return []
    found = []
    for report in reports:
        for test_id in report.ids:
            theirs, ours = report.outcome("torchft", test_id), report.outcome("torchft_lite", test_id)
            if theirs.outcome == "passed" and ours.outcome != "passed":
                found.append((test_id, f"{ours.outcome}" + (f": {ours.message}" if ours.message else "")))
    return found


# --- output -----------------------------------------------------------------------


def print_table(reports: list[FileReport], sides: tuple[str, ...]) -> None:
    columns = ["file", "tests", "excluded"]
    for side in sides:
        columns += [f"{side} passed", "skipped"]
    columns.append("time_s")
    rows = []
    totals = [0] * (len(columns) - 2)
    for report in reports:
        values = [len(report.ids), len(report.excluded)]
        for side in sides:
            counts = report.counts(side)
            values += [counts["passed"], counts["skipped"]]
        totals = [a + b for a, b in zip(totals, values)]
        seconds = sum(run.seconds for run in report.sides.values())
        rows.append([report.file, *map(str, values), f"{seconds:.0f}"])
    rows.append(["total", *map(str, totals), ""])
    widths = [max(len(columns[i]), *(len(row[i]) for row in rows)) for i in range(len(columns))]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    print(line(columns))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        if row[0] == "total":
            print("  ".join("-" * w for w in widths))
        print(line(row))


def print_gaps_and_exclusions(reports: list[FileReport], sides: tuple[str, ...]) -> None:
    if sides == SIDES:
        missing = gaps(reports, sides)
        print(f"\ntorchft passes, torchft_lite does not: {len(missing) or 'none'}")
        for test_id, outcome in missing:
            print(f"  {test_id}  -- {outcome[:200]}")
    excluded = [(test_id, reason) for test_id, reason in EXCLUDED.items()
                if any(test_id.startswith(report.file + "::") for report in reports)]
    print(f"\nexcluded (tests/compat/cases.py): {len(excluded) or 'none'}")
    for test_id, reason in excluded:
        print(f"  {test_id}\n      {reason}")


def summary(reports: list[FileReport], sides: tuple[str, ...], wall_s: float) -> dict:
    files = {}
    for report in reports:
        files[report.file] = {"tests": len(report.ids), "excluded": len(report.excluded),
                              **{side: report.counts(side) for side in sides}}
    total = {"tests": sum(f["tests"] for f in files.values()), "excluded": sum(f["excluded"] for f in files.values())}
    for side in sides:
        total[side] = {k: sum(f[side][k] for f in files.values()) for k in OUTCOMES}
    return {"compat": {"torchft": torchft_version(), "wall_s": round(wall_s, 1), "files": files, "total": total,
                       "gaps": [test_id for test_id, _ in gaps(reports, sides)]}}


def write_report(path: Path, reports: list[FileReport], sides: tuple[str, ...]) -> None:
    lines = [f"# make compat: {torchft_version()} test files, run on each side; outcome, test id, first error line"]
    for side in sides:
        lines += ["", f"== {side} =="]
        for report in reports:
            for test_id in report.ids:
                result = report.outcome(side, test_id)
                lines.append(f"{result.outcome.upper():8} {test_id}" + (f"  -- {result.message}" if result.message else ""))
            lines += [f"NOTE     {report.file}: {note}" for note in report.sides[side].notes]
    lines += ["", "== excluded (tests/compat/cases.py) =="]
    lines += [f"{test_id}  -- {reason}" for test_id, reason in EXCLUDED.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


# --- command line --------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.compat.run", description=__doc__, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", metavar="FILE",
                        help="test files to run, relative to the installed torchft package "
                             "(default: every *_test.py in it)")
    parser.add_argument("--side", choices=("both", *SIDES), default="both",
                        help="run only torchft's side or only torchft_lite's (default: both)")
    parser.add_argument("-k", dest="keyword", metavar="EXPR",
                        help="pytest -k expression selecting tests within the files (default: all)")
    parser.add_argument("--test-timeout", type=float, default=120.0, metavar="S",
                        help="per-test limit in seconds, enforced by pytest-timeout and, for a test it cannot "
                             f"interrupt, by killing the file's process group {HANG_GRACE_S:g}s later; "
                             "the file then goes on with its remaining tests (default: 120)")
    parser.add_argument("--file-timeout", type=float, default=300.0, metavar="S",
                        help="wall limit in seconds for one file on one side, over all its attempts; "
                             "tests not run by then are reported not_run (default: 300)")
    parser.add_argument("--total-timeout", type=float, default=900.0, metavar="S",
                        help="wall budget in seconds for the whole run; a file or side not started when it "
                             "is spent is reported not_run (default: 900, so make compat stays under 15 min)")
    parser.add_argument("--report", type=Path, default=REPO / "build" / "compat" / "report.txt", metavar="PATH",
                        help="where to write every test's outcome per side with the first line of its error "
                             "(default: build/compat/report.txt)")
    parser.add_argument("--isolate-network", action="store_true",
                        help="run each pytest in a network namespace of its own (Linux `unshare --net`, as root "
                             "or with user namespaces; needs `ip`, and the hostname must resolve to loopback): "
                             "torchft's manager_integ_test.py binds fixed ports 19530+, so two runs on one "
                             "machine collide without it (default: off)")
    parser.add_argument("--require-torchft", action="store_true",
                        help="exit 1 instead of 0 when torchft is not installed (make compat passes it "
                             "when torchft could be installed)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wheel_dir = find_wheel_dir()
    if wheel_dir is None:
        print("note: torchft is not installed; nothing to compare against", file=sys.stderr)
        return 1 if args.require_torchft else 0
    files = args.files or wheel_test_files(wheel_dir)
    missing = [file for file in files if not (wheel_dir / file).is_file()]
    if missing:
        print(f"error: not in the torchft wheel at {wheel_dir}: {', '.join(missing)}", file=sys.stderr)
        return 1
    sides = SIDES if args.side == "both" else (args.side,)
    begin = time.monotonic()
    reports = []
    with tempfile.TemporaryDirectory(prefix="torchft-compat-") as workdir:
        settings = Settings(wheel_dir, Path(workdir), args.keyword, args.test_timeout, args.file_timeout,
                            begin + args.total_timeout, args.isolate_network)
        print(f"compat: {torchft_version()} from {wheel_dir}; sides: {', '.join(sides)}", flush=True)
        for file in files:
            report = run_file(file, sides, settings)
            counts = ", ".join(f"{side} {report.counts(side)['passed']}" for side in sides)
            print(f"  {file}: {len(report.ids)} tests; passed: {counts}", flush=True)
            reports.append(report)
    wall_s = time.monotonic() - begin
    print()
    print_table(reports, sides)
    print_gaps_and_exclusions(reports, sides)
    print(json.dumps(summary(reports, sides, wall_s)))
    write_report(args.report, reports, sides)
    print(f"per-test results: {args.report}; wall time {wall_s:.0f}s")
    errors = run_errors(reports, args.keyword)
    for error in errors:
        print(f"harness error: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
