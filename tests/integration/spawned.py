"""Run one function in several spawned processes and collect what each reports, stopping them all on failure."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from typing import Any, Callable, Sequence

import pytest


def run_spawned(target: Callable[..., None], arg_lists: Sequence[tuple], what: str, timeout: float) -> list[Any]:
    """``target(*args, results)`` in a spawned process per ``args``; the values they put as ``("ok", value)``.

    ``target`` puts ``("error", text)`` when it fails (``put_outcome`` puts either): the test fails with that
    text. Each report is waited for at most ``timeout`` seconds; after a failure the other processes (which
    may wait on their peers) are killed at once, else each is joined for ``timeout``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [ctx.Process(target=target, args=(*args, results), daemon=True) for args in arg_lists]
    for process in processes:
        process.start()
    values, failed = [], True
    try:
        for _ in processes:
            try:
                status, value = results.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} "
                            f"(exit codes so far: {[p.exitcode for p in processes]})")
            assert status == "ok", value
            values.append(value)
        failed = False
    finally:
        for process in processes:
            process.join(0 if failed else timeout)
            if process.is_alive():
                process.kill()
                process.join()
    return values


def put_outcome(results: "mp.Queue", who: str, compute: Callable[[], Any]) -> None:
    """In a spawned process: put ``("ok", compute())`` for ``run_spawned``, or ``("error", text)`` naming
    ``who`` and the failure (with its traceback) if ``compute`` raised."""
    try:
        results.put(("ok", compute()))
    except BaseException as exc:  # reported to the test, which fails naming it
        results.put(("error", f"{who}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
