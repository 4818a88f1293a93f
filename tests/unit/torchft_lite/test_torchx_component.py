"""``torchft_lite.torchx.hsdp``: the roles it builds, and the job token kept off every command line."""

from __future__ import annotations

import pytest

torchx_specs = pytest.importorskip("torchx.specs", reason="skipped: torchx is not installed (the dev extra has it)")

from torchft_lite.torchx import hsdp  # noqa: E402


def test_a_lighthouse_role_and_one_torchrun_role_per_group(monkeypatch):
    monkeypatch.delenv("TORCHFT_LITE_TOKEN_FILE", raising=False)
    app = hsdp("--steps", "7", replicas=3, workers_per_replica=2, max_restarts=4, lighthouse_port=1234,
               min_replicas=2)
    assert [role.name for role in app.roles] == ["lighthouse", "replica_0", "replica_1", "replica_2"]
    lighthouse = app.roles[0]
    assert lighthouse.args[:2] == ["-m", "lighthouse"]
    assert "[::]:1234" in lighthouse.args and "--exit-when-idle" in lighthouse.args
    group = app.roles[2]
    assert group.args[:2] == ["-m", "torchft_lite.launch"]
    assert "--nproc_per_node=2" in group.args and "--max_restarts=4" in group.args
    assert group.args[-3:] == ["examples/train_ddp.py", "--steps", "7"]
    assert group.env["REPLICA_GROUP_ID"] == "1" and group.env["NUM_REPLICA_GROUPS"] == "3"
    assert group.env["TORCHFT_LIGHTHOUSE"] == "http://localhost:1234"


def test_an_external_lighthouse_means_no_lighthouse_role():
    app = hsdp(lighthouse="https://lh.example:29510", replicas=2)
    assert [role.name for role in app.roles] == ["replica_0", "replica_1"]
    assert all(role.env["TORCHFT_LIGHTHOUSE"] == "https://lh.example:29510" for role in app.roles)


def test_the_token_travels_as_the_path_of_its_file_to_every_role(monkeypatch):
    monkeypatch.setenv("TORCHFT_LITE_TOKEN_FILE", "/secrets/job-token")
    app = hsdp(replicas=2)
    for role in app.roles:
        assert role.env["TORCHFT_LITE_TOKEN_FILE"] == "/secrets/job-token"
        assert "TORCHFT_LITE_TOKEN" not in role.env
        assert not any("job-token" in arg for arg in [role.entrypoint, *role.args])
    assert hsdp(token_file="/other/token").roles[1].env["TORCHFT_LITE_TOKEN_FILE"] == "/other/token"


def test_a_token_in_env_is_refused_and_a_relative_token_file_too():
    with pytest.raises(ValueError, match="token_file"):
        hsdp(env={"TORCHFT_LITE_TOKEN": "s3cret"})
    with pytest.raises(ValueError, match="absolute"):
        hsdp(token_file="job-token")


@pytest.mark.parametrize("bad", [dict(replicas=0), dict(workers_per_replica=0), dict(max_restarts=-1)])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        hsdp(**bad)
