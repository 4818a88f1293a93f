"""pytest plugin used by tests/compat/run.py in each pytest subprocess.

It appends one JSON object per line to the file named by $TORCHFT_COMPAT_RESULTS
as things happen (so a run that is killed still leaves what it did):
``collected`` (the ids that will run, and those removed), ``start`` and
``result`` per test, ``collect_error``, and ``finished``. It removes before the
run the ids that match a regex in $TORCHFT_COMPAT_SKIP (a JSON file: reason ->
list of regexes), e.g. tests excluded by the harness or already run.
"""

from __future__ import annotations

import json
import os
import re

import pytest

_outcomes: dict[str, tuple[str, str, str]] = {}


def _emit(**record) -> None:
    with open(os.environ["TORCHFT_COMPAT_RESULTS"], "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def _first_error_line(longrepr) -> str:
    """The line that says what went wrong: the exception, or the skip reason."""
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (path, lineno, reason)
        return str(longrepr[2]).splitlines()[0] if longrepr[2] else ""
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message.splitlines()[0]
    lines = [line for line in str(longrepr).splitlines() if line.strip()]
    # pytest's import-error report: the exception is the first "E   " line.
    for line in lines:
        if line.startswith("E   "):
            return line[4:].strip()
    return lines[0] if lines else ""


@pytest.hookimpl(trylast=True)  # after -k has deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = os.environ.get("TORCHFT_COMPAT_SKIP")
    rules = {}
    if path:
        with open(path, encoding="utf-8") as f:
            rules = {reason: [re.compile(p) for p in patterns] for reason, patterns in json.load(f).items()}
    kept, removed = [], {reason: [] for reason in rules}
    for item in items:
        reason = next((r for r, patterns in rules.items() if any(p.fullmatch(item.nodeid) for p in patterns)), None)
        if reason is None:
            kept.append(item)
        else:
            removed[reason].append(item.nodeid)
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    _emit(event="collected", ids=[item.nodeid for item in kept], removed=removed)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _emit(event="collect_error", id=report.nodeid, message=_first_error_line(report.longrepr))


def pytest_runtest_logstart(nodeid: str) -> None:
    _emit(event="start", id=nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # One outcome per test: the first failing phase wins, then a skip, then a pass.
    previous = _outcomes.get(report.nodeid)
    if report.failed and (previous is None or previous[0] != "failed"):
        _outcomes[report.nodeid] = ("failed", report.when, _first_error_line(report.longrepr))
    elif report.skipped and previous is None:
        _outcomes[report.nodeid] = ("skipped", report.when, _first_error_line(report.longrepr))
    elif report.passed and report.when == "call" and previous is None:
        _outcomes[report.nodeid] = ("passed", report.when, "")
    if report.when == "teardown":
        outcome, phase, message = _outcomes.pop(report.nodeid, ("passed", "call", ""))
        _emit(event="result", id=report.nodeid, outcome=outcome, phase=phase, message=message)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _emit(event="finished", exitstatus=int(exitstatus))
