"""Jobs started by torchft_lite.cluster.local (make demo, the chaos run, tests) carry one job token."""

from __future__ import annotations

import pytest

from torchft_lite.cluster import local as local_cluster
from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup, job_access, job_token_env
from torchft_lite.rpc.access import TOKEN_ENV, TOKEN_FILE_ENV


@pytest.fixture
def fresh(monkeypatch):
    """No token in this process's environment, and none generated yet."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    monkeypatch.setattr(local_cluster, "_generated_token", None)


def test_without_a_token_one_random_token_is_made_per_process(fresh):
    first = job_token_env()
    token = first[TOKEN_ENV]
    assert len(token) >= 32 and job_token_env() == first  # the same for every lighthouse and group
    assert job_access().token == token
    local_cluster._generated_token = None
    assert job_token_env()[TOKEN_ENV] != token  # random, not a constant


def test_a_token_set_by_the_caller_is_inherited_as_it_is(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv(TOKEN_ENV, "the-callers-token")
    assert job_token_env() == {}
    assert job_access().token == "the-callers-token"
    monkeypatch.delenv(TOKEN_ENV)
    (tmp_path / "token").write_text("from-a-file\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "token"))
    assert job_token_env() == {}
    assert job_access().token == "from-a-file"


def test_groups_get_the_token_by_environment_and_a_groups_own_token_wins(fresh):
    token = job_token_env()[TOKEN_ENV]
    group = ReplicaGroup(0, 1, "http://127.0.0.1:1", "train.py", ["--steps", "1"])
    assert group._env()[TOKEN_ENV] == token
    wrong = ReplicaGroup(1, 2, "http://127.0.0.1:1", "train.py", env={TOKEN_ENV: "wrong"})
    assert wrong._env()[TOKEN_ENV] == "wrong"
    from_file = ReplicaGroup(1, 2, "http://127.0.0.1:1", "train.py", env={TOKEN_FILE_ENV: "/run/token"})
    assert TOKEN_ENV not in from_file._env()  # not both: the process would refuse to start


def test_the_token_is_never_on_a_command_line(fresh):
    token = job_token_env()[TOKEN_ENV]
    lighthouse = LighthouseProcess(http=True)
    assert all(token not in arg for arg in lighthouse.args)
