"""The ``make compat`` harness: its torchft alias package and its list of excluded tests."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest

from tests.compat.cases import EXCLUDED, wheel_test_files
from tests.compat.pytest_process import ALIAS_DIR, REPO
from tests.compat.run import find_wheel_dir
from tests.conftest import needs_torchft

pytestmark = pytest.mark.integration

WHEEL = find_wheel_dir()
requires_torchft = needs_torchft(WHEEL is not None,
                                 "torchft is not installed: make compat runs the test files of its wheel")


def run_with_alias(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ALIAS_DIR), str(REPO)])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_alias_imports_torchft_lite_under_the_torchft_name() -> None:
    result = run_with_alias("""
        import torchft, torchft.manager, torchft_lite, torchft_lite.manager
        from torchft.manager import Manager
        assert torchft is torchft_lite
        assert Manager is torchft_lite.manager.Manager
        assert torchft_lite.manager.__spec__.name == "torchft_lite.manager"
        # torchft's Rust extension stands for torchft_lite.coordination, whether or not that exists yet.
        try:
            import torchft._torchft as rust
        except ModuleNotFoundError as exc:
            assert exc.name == "torchft_lite.coordination", exc.name
        else:
            assert rust.__name__ == "torchft_lite.coordination", rust.__name__
        # A module torchft_lite lacks is missing, exactly as for a user.
        try:
            import torchft.no_such_module
        except ModuleNotFoundError as exc:
            assert exc.name == "torchft_lite.no_such_module", exc.name
        else:
            raise AssertionError("the alias made up a module")
    """)
    assert result.returncode == 0, result.stderr


@requires_torchft
def test_alias_loads_test_code_from_the_wheel() -> None:
    result = run_with_alias(f"""
        import torchft.data_test, torchft_lite.data
        assert torchft.data_test.__file__ == {str(WHEEL / "data_test.py")!r}, torchft.data_test.__file__
        assert torchft.data_test.DistributedSampler is torchft_lite.data.DistributedSampler
    """)
    assert result.returncode == 0, result.stderr


@requires_torchft
def test_the_run_covers_every_test_file_of_the_wheel() -> None:
    files = wheel_test_files(WHEEL)
    assert {"manager_test.py", "coordination_test.py", "checkpointing/http_transport_test.py",
            "_test/managed_work_test.py"} <= set(files)
    assert files == sorted(set(files)) and all(file.endswith("_test.py") and (WHEEL / file).is_file() for file in files)
    assert len(files) == sum(1 for path in WHEEL.rglob("*_test.py") if "__pycache__" not in path.parts)


def _test_methods(tree: ast.Module, class_name: str) -> set[str]:
    """Methods of ``class_name`` and of its bases defined in the same file."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    methods, pending = set(), [class_name]
    while pending:
        node = classes.get(pending.pop())
        if node is None:
            continue
        methods |= {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
        pending += [base.id for base in node.bases if isinstance(base, ast.Name)]
    return methods


@requires_torchft
def test_excluded_tests_exist_in_the_wheel() -> None:
    missing = []
    for test_id, reason in EXCLUDED.items():
        file, *scope, name = test_id.split("::")
        path = WHEEL / file
        if not reason or not path.is_file():
            missing.append(test_id)
            continue
        tree = ast.parse(path.read_text())
        names = (_test_methods(tree, scope[0]) if scope else
                 {node.name for node in tree.body if isinstance(node, ast.FunctionDef)})
        if name not in names:
            missing.append(test_id)
    assert missing == [], "EXCLUDED names tests the wheel does not have (or gives no reason)"


def test_project_test_run_collects_nothing_from_the_harness() -> None:
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/compat"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 5, result.stdout + result.stderr  # 5: no tests collected


def test_the_report_names_what_torchft_passes_and_torchft_lite_does_not() -> None:
    from tests.compat.pytest_process import Outcome
    from tests.compat.run import FileReport, SideRun, gaps, run_errors

    ids = ["f::a", "f::b", "f::c"]
    torchft = SideRun(collected=ids, outcomes={i: Outcome("passed") for i in ids[:2]} | {"f::c": Outcome("failed")})
    lite = SideRun(collected=ids, outcomes={"f::a": Outcome("passed"), "f::b": Outcome("error", "ImportError: x"),
                                            "f::c": Outcome("failed")})
    report = FileReport("f", ids, [], {"torchft": torchft, "torchft_lite": lite})
    assert gaps([report], ("torchft", "torchft_lite")) == [("f::b", "error: ImportError: x")]
    assert run_errors([report], None) == []
    # A file that collects nothing (helpers only) is fine; a run where no file collected anything is not.
    empty = FileReport("g", [], [], {"torchft": SideRun(collected=[]), "torchft_lite": SideRun(collected=[])})
    assert run_errors([report, empty], None) == []
    assert run_errors([empty], None) == ["no test file collected a single test on torchft's side"]
