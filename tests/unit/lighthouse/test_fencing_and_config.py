import logging

import pytest

from lighthouse import fencing
from lighthouse.config import LighthouseConfig
from lighthouse.fencing import QuorumIdStore, agreed_step
from tests.conftest import disk_full
from torchft_lite.rpc.addresses import split_host_port


class TestQuorumIdStore:
    def test_without_state_dir_seeds_from_wall_clock_millis(self):
        assert QuorumIdStore(None, wall_clock=lambda: 1000.5).initial() == 1_000_500

    def test_restart_with_state_dir_continues_after_last_id_even_if_clock_stepped_back(self, tmp_path):
        first = QuorumIdStore(tmp_path, wall_clock=lambda: 2000.0)
        assert first.initial() == 2_000_000
        first.save(2_000_007)
        restarted = QuorumIdStore(tmp_path, wall_clock=lambda: 1000.0)  # clock went back
        assert restarted.initial() == 2_000_007

    def test_wall_clock_wins_when_ahead_of_stored_id(self, tmp_path):
        QuorumIdStore(tmp_path, wall_clock=lambda: 1.0).save(5)
        assert QuorumIdStore(tmp_path, wall_clock=lambda: 3.0).initial() == 3000

    def test_only_a_stored_id_shows_an_earlier_incarnation(self, tmp_path):
        without_dir = QuorumIdStore(None)
        without_dir.initial()
        assert without_dir.earlier_quorum_id is None
        first = QuorumIdStore(tmp_path / "state")  # the directory does not exist yet
        first.initial()
        assert first.earlier_quorum_id is None
        first.save(42)
        restarted = QuorumIdStore(tmp_path / "state", wall_clock=lambda: 0.0)
        restarted.initial()
        assert restarted.earlier_quorum_id == 42

    def test_restart_evidence_names_the_stored_id(self, tmp_path):
        first = QuorumIdStore(tmp_path)
        first.initial()
        assert first.restart_evidence is None
        first.save(42)
        restarted = QuorumIdStore(tmp_path, wall_clock=lambda: 0.0)
        restarted.initial()
        assert restarted.restart_evidence == "its state dir holds quorum id 42"

    def test_max_step_is_kept_once_a_second_unless_forced(self, tmp_path):
        store = QuorumIdStore(tmp_path)
        assert store.initial_max_step() == 0
        store.quorum_reached([5], now=10.0)
        store.quorum_reached([7], now=10.5)  # within the second: not written
        assert QuorumIdStore(tmp_path).initial_max_step() == 5
        store.keep_max_step(now=10.5, force=True)
        assert QuorumIdStore(tmp_path).initial_max_step() == 7
        store.quorum_reached([6], now=20.0)  # not a new high
        assert QuorumIdStore(tmp_path).initial_max_step() == 7

    def test_a_new_epoch_lowers_the_kept_step_at_once(self, tmp_path):
        store = QuorumIdStore(tmp_path)
        store.quorum_reached([300], now=10.0)
        store.reset_max_step(0, now=10.2)  # within the second, and lower: written anyway
        assert QuorumIdStore(tmp_path).initial_max_step() == 0
        assert not (tmp_path / "max_step.tmp").exists()
        store.quorum_reached([5], now=11.5)  # a new high of the new epoch is kept again
        assert QuorumIdStore(tmp_path).initial_max_step() == 5

    def test_the_holders_of_the_kept_step_are_kept_with_it(self, tmp_path):
        store = QuorumIdStore(tmp_path)
        assert store.initial_holders() == frozenset()
        store.quorum_reached([5, 5, 3], now=10.0, replica_ids=["g0:a", "g1:b", "g2:c"])
        assert QuorumIdStore(tmp_path).initial_holders() == {"g0:a", "g1:b"}  # g2:c is behind the agreed step
        store.quorum_reached([2], now=20.0, replica_ids=["g2:c"])  # a fast quorum of a member behind: no holder
        assert QuorumIdStore(tmp_path).initial_holders() == {"g0:a", "g1:b"}
        store.quorum_reached([6, 6], now=30.0, replica_ids=["g0:a", "g2:c"])
        store.reset_max_step(4, now=30.1, holders=["g1:new"])  # an epoch: its participants hold the step
        restarted = QuorumIdStore(tmp_path)
        assert (restarted.initial_max_step(), restarted.initial_holders()) == (4, {"g1:new"})

    @pytest.mark.parametrize("text", ["{not json", '{"g0:a": 1}', '["g0:a", 7]', '"g0:a"'])
    def test_an_unreadable_holders_file_is_logged_and_counts_as_none_known(self, tmp_path, caplog, text):
        (tmp_path / "holders").write_text(text)
        with caplog.at_level(logging.WARNING, logger="lighthouse.fencing"):
            assert QuorumIdStore(tmp_path).initial_holders() == frozenset()
        assert "does not hold a JSON list of replica ids" in caplog.text

    @pytest.mark.parametrize("steps, agreed", [([5], 5), ([5, 2**53 - 1], 5), ([7, 9, 7], 7), ([9, 9, 7], 9),
                                               ([1, 2, 3, 4], 2), ([4, 4, 4, 2**53 - 1], 4), ([], 0)])
    def test_the_agreed_step_is_held_by_more_than_half_of_the_members(self, steps, agreed):
        assert agreed_step(steps) == agreed

    def test_one_forged_member_with_a_huge_step_does_not_move_the_kept_step(self, tmp_path):
        store = QuorumIdStore(tmp_path)
        store.quorum_reached([10, 10], now=1.0)
        store.quorum_reached([11, 2**53 - 1, 11], now=5.0)
        store.quorum_reached([2**53 - 1, 12], now=9.0)  # two members: the lower is what both reached
        store.keep_max_step(now=9.0, force=True)
        assert QuorumIdStore(tmp_path).initial_max_step() == 12

    def test_an_epoch_never_raises_the_kept_step_to_its_own(self, tmp_path):
        """The epoch's step is its participants' claim: the disk keeps the lower of it and the agreed step."""
        store = QuorumIdStore(tmp_path)
        store.quorum_reached([10, 10], now=1.0)
        store.reset_max_step(2**53 - 1, now=2.0)
        assert QuorumIdStore(tmp_path).initial_max_step() == 10

    def test_a_full_disk_is_logged_counted_and_retried(self, tmp_path, monkeypatch, caplog):
        store = QuorumIdStore(tmp_path)
        store.initial()
        real_write = fencing._write_atomically
        monkeypatch.setattr(fencing, "_write_atomically", disk_full)
        with caplog.at_level(logging.ERROR, logger="lighthouse.fencing"):
            store.save(41)  # no exception: the lighthouse serves on
            store.quorum_reached([8], now=1.0)
            store.save(42)
        assert store.write_failures == 3
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "No space left on device" in errors[0].getMessage()  # once per streak
        assert not list(tmp_path.iterdir())

        monkeypatch.setattr(fencing, "_write_atomically", real_write)
        store.quorum_reached([8], now=2.0)  # the step that failed is written at the next chance
        store.save(43)
        restarted = QuorumIdStore(tmp_path, wall_clock=lambda: 0.0)
        assert (restarted.initial(), restarted.initial_max_step()) == (43, 8)

    def test_a_failed_write_leaves_no_temporary_file(self, tmp_path, monkeypatch):
        monkeypatch.setattr(fencing.os, "fsync", disk_full)
        store = QuorumIdStore(tmp_path)
        store.save(7)
        assert store.write_failures == 1 and not list(tmp_path.iterdir())

    def test_corrupt_state_file_is_a_clear_error(self, tmp_path):
        (tmp_path / "last_quorum_id").write_text("garbage")
        with pytest.raises(ValueError, match="does not hold a quorum id"):
            QuorumIdStore(tmp_path).initial()


class TestConfig:
    def parse(self, *argv, environ=None):
        args = LighthouseConfig.arg_parser().parse_args(list(argv))
        return LighthouseConfig.from_args(args, environ or {})

    def test_torchft_flag_names_and_units(self):
        c = self.parse("--min_replicas", "3", "--join_timeout_ms", "1500", "--quorum_tick_ms", "50",
                       "--heartbeat_timeout_ms", "2000", "--bind", "127.0.0.1:0")
        assert (c.min_replicas, c.join_timeout, c.quorum_tick, c.heartbeat_timeout) == (3, 1.5, 0.05, 2.0)
        assert c.bind == "127.0.0.1:0"
        assert c.http_bind == "[::]:29511"
        assert c.admin_token is None

    def test_defaults_match_torchft(self):
        c = self.parse("--min_replicas", "1")
        assert (c.bind, c.join_timeout, c.quorum_tick, c.heartbeat_timeout) == ("[::]:29510", 60.0, 0.1, 5.0)

    def test_holder_timeout_flag_in_milliseconds_reaches_the_quorum_rules(self):
        assert self.parse("--min_replicas", "1").holder_timeout == 30.0
        c = self.parse("--min_replicas", "1", "--holder-timeout-ms", "1500")
        assert c.holder_timeout == 1.5 and c.quorum_config().holder_timeout == 1.5
        assert self.parse("--min_replicas", "1", "--holder_timeout_ms", "2000").holder_timeout == 2.0
        assert c.advertised()["holder_timeout_ms"] == "1500"

    @pytest.mark.parametrize("value", ["0", "-1"])
    def test_holder_timeout_must_be_positive(self, value):
        with pytest.raises(ValueError, match="holder_timeout"):
            self.parse("--min_replicas", "1", "--holder_timeout_ms", value)

    def test_admin_token_from_env_and_http_off(self):
        c = self.parse("--min_replicas", "1", "--http-bind", "off", environ={"TORCHFT_LITE_ADMIN_TOKEN": "t"})
        assert c.admin_token == "t"
        assert c.http_bind is None

    def test_min_replicas_is_required(self, capsys):
        with pytest.raises(SystemExit):
            LighthouseConfig.arg_parser().parse_args([])
        assert "--min_replicas" in capsys.readouterr().err

    @pytest.mark.parametrize("argv", [["--min_replicas", "0"], ["--min_replicas", "1", "--bind", "nohostport"],
                                      ["--min_replicas", "1", "--quorum_tick_ms", "0"],
                                      ["--min_replicas", "1", "--heartbeat_timeout_ms", "-5"]])
    def test_bad_values_are_value_errors(self, argv):
        with pytest.raises(ValueError):
            self.parse(*argv)

    def test_split_host_port(self):
        assert split_host_port("[::]:29510") == ("::", 29510)
        assert split_host_port("localhost:0") == ("localhost", 0)
        with pytest.raises(ValueError):
            split_host_port("host:99999")
