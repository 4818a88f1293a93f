"""Member-supplied fields are range-checked, and a lease belongs to the connection that opened it."""

from __future__ import annotations

import pytest

from lighthouse.leases import LeaseHeld, LeaseTable
from lighthouse.validation import (
    MAX_DATA_BYTES, MAX_REPLICA_ID_LEN, REASONS, STEP_LIMIT, member_problem, replica_id_problem,
)
from torchft_lite.rpc.protocol import torchft_pb2 as pb


def test_members_within_every_limit_pass():
    largest = pb.QuorumMember(replica_id="g" * MAX_REPLICA_ID_LEN, address="http://h:1", store_address="h:2",
                              step=STEP_LIMIT - 1, world_size=1 << 20, commit_failures=2**31 - 1,
                              data="d" * MAX_DATA_BYTES, reconfigure_handles=["{}"] * 8)
    assert member_problem(largest) is None
    assert member_problem(pb.QuorumMember(replica_id="train_ddp_0:1b2c3d4e5f60")) is None


@pytest.mark.parametrize("fields, reason", [
    (dict(step=-1), "step"), (dict(step=STEP_LIMIT), "step"), (dict(step=-(2**63)), "step"),
    (dict(world_size=(1 << 20) + 1), "world_size"), (dict(commit_failures=-1), "commit_failures"),
    (dict(commit_failures=2**31), "commit_failures"), (dict(replica_id=""), "replica_id"),
    (dict(replica_id="a b"), "replica_id"), (dict(replica_id="a\u202eb"), "replica_id"),
    (dict(address="x" * 1025), "address"), (dict(store_address="\x1b[31m"), "store_address"),
    (dict(data="\u00e9" * (MAX_DATA_BYTES // 2 + 1)), "data"),  # counted in UTF-8 bytes, not characters
    (dict(reconfigure_handles=["h"] * 4097), "reconfigure_handles"),
    (dict(reconfigure_handles=["h" * 4097]), "reconfigure_handles"),
])
def test_each_field_out_of_range_is_named_with_its_reason(fields, reason):
    fields.setdefault("replica_id", "m")
    problem = member_problem(pb.QuorumMember(**fields))
    assert problem is not None and problem[0] == reason and reason in REASONS
    assert len(problem[1]) < 300  # the message never echoes the oversized value


def test_unknown_fields_count_toward_the_member_size_cap():
    member = pb.QuorumMember(replica_id="m")
    raw = member.SerializeToString() + b"\xa2\x06" + b"\x80\x80\x40" + b"x" * (1 << 20)  # field 100, 1 MiB
    problem = member_problem(pb.QuorumMember.FromString(raw))
    assert problem is not None and problem[0] == "member_size"


def test_replica_id_problems():
    assert replica_id_problem("r" * (MAX_REPLICA_ID_LEN + 1)).endswith(f"({MAX_REPLICA_ID_LEN + 1})")
    assert "non-empty" in replica_id_problem("", "requester.replica_id")
    assert replica_id_problem("\u00e9" * 600) is None


class TestLeaseTable:
    def test_another_connection_is_refused_while_the_holder_is_heard_from(self):
        table = LeaseTable(heartbeat_timeout=5.0)
        held = table.open("a", "ipv4:10.0.0.1:1000", now=0.0)
        table.saw("a", "ipv4:10.0.0.1:1000", now=4.0)
        table.saw("a", "ipv4:10.0.0.9:6666", now=8.5)  # another connection's heartbeat keeps nothing alive
        with pytest.raises(LeaseHeld, match="already holds a lease on another connection"):
            table.open("a", "ipv4:10.0.0.9:6666", now=8.9)
        assert table.taken_over == 0 and len(table) == 1
        assert table.close(held) and table.broken == 1  # its own stream ending: gone

    def test_the_holder_silent_for_the_heartbeat_timeout_is_replaced_and_its_end_declares_nothing(self):
        table = LeaseTable(heartbeat_timeout=5.0)
        old = table.open("a", "ipv4:10.0.0.1:1000", now=0.0)
        new = table.open("a", "ipv4:10.0.0.1:2000", now=5.0)
        assert table.taken_over == 1
        assert not table.close(old) and old.ended and table.holds("a") and table.broken == 0
        assert table.close(new) and not table.holds("a")

    def test_the_same_connection_may_reopen_its_lease(self):
        table = LeaseTable(heartbeat_timeout=5.0)
        first = table.open("a", "ipv4:127.0.0.1:1000", now=0.0)
        second = table.open("a", "ipv4:127.0.0.1:1000", now=0.1)
        assert not table.close(first) and table.close(second)
