"""The Manager's StepReport (torchft_lite.core.report): every step tells its listeners what it did and where
its time went, and group rank 0 advertises its compute time to the lighthouse."""

from __future__ import annotations

import math
import time

import torch

from tests.unit.helpers import Replica, replicas, train  # noqa: F401  (the fixture)
from torchft_lite.core.report import StepReport
from torchft_lite.testing import InMemoryLighthouse


class Reports:
    def __init__(self) -> None:
        self.seen: list[StepReport] = []

    def step_finished(self, report: StepReport) -> None:  # the only event it implements: the others are optional
        self.seen.append(report)


def test_each_step_reports_its_outcome_and_spans_that_add_up(replicas):
    lighthouse = InMemoryLighthouse(min_replicas=2)
    a, b = replicas(lighthouse, "a", 1.0), replicas(lighthouse, "b", 5.0)
    reports = {"a": Reports(), "b": Reports()}
    a.manager.add_step_listener(reports["a"])
    b.manager.add_step_listener(reports["b"])
    assert train({"a": a, "b": b}, 2) == {"a": [True, True], "b": [True, True]}
    first_b, second_b = reports["b"].seen
    assert (first_b.step, first_b.committed, first_b.error) == (0, True, None)
    assert first_b.healed_from == (0,) and first_b.healed_bytes == 3 * 4 and first_b.participants == 2
    assert second_b.healed_bytes == 0 and second_b.participating and second_b.quorum_id == first_b.quorum_id
    for report in reports["a"].seen + reports["b"].seen:
        spans = report.quorum_s + report.compute_s + report.allreduce_s + report.commit_s
        assert min(report.quorum_s, report.compute_s, report.allreduce_s, report.commit_s) >= 0
        assert math.isclose(spans, report.total_s, rel_tol=1e-6, abs_tol=1e-6), report


def test_the_work_between_start_quorum_and_the_first_allreduce_is_compute_and_is_advertised(replicas):
    lighthouse = InMemoryLighthouse(min_replicas=1)
    a = replicas(lighthouse, "a", 1.0)
    reports = Reports()
    a.manager.add_step_listener(reports)
    a.manager.start_quorum()
    time.sleep(0.2)  # the forward and backward pass
    a.manager.allreduce(torch.ones(3)).wait()
    assert a.manager.should_commit()
    (report,) = reports.seen
    assert report.compute_s >= 0.2 and report.committed
    advertised = a.manager._client.advertised
    assert advertised["compute_step"] == 0 and advertised["compute_ms"] >= 200.0


def test_a_step_that_fails_reports_why(replicas):
    lighthouse = InMemoryLighthouse(min_replicas=1)
    a = replicas(lighthouse, "a", 1.0)
    reports = Reports()
    a.manager.add_step_listener(reports)
    a.manager.start_quorum()
    a.manager.report_error(RuntimeError("the loss was garbage"))
    assert not a.manager.should_commit()
    (report,) = reports.seen
    assert not report.committed and report.error == "RuntimeError: the loss was garbage"
