"""The access policy itself: where the token comes from, who is admitted, and that the token never shows."""

from __future__ import annotations

import logging

import pytest

from torchft_lite.rpc.access import INSECURE_ENV, TOKEN_ENV, TOKEN_FILE_ENV, Access, Refusal, peer_host
from torchft_lite.rpc.refusals import RefusalLog

TOKEN = "s3cret-Job_token.42"


# ------------------------------------------------------------------ from_env


def test_no_variables_is_protected_mode():
    access = Access.from_env({})
    assert access.token is None and not access.insecure
    assert access.mode == "loopback-only"
    assert access.metadata() == () and access.headers() == {}


def test_the_token_variable_is_used_stripped():
    access = Access.from_env({TOKEN_ENV: f"  {TOKEN}\n"})
    assert access.token == TOKEN and access.mode == "token"
    assert access.metadata() == (("authorization", f"Bearer {TOKEN}"),)
    assert access.headers() == {"Authorization": f"Bearer {TOKEN}"}


def test_the_token_file_is_read_and_stripped(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert Access.from_env({TOKEN_FILE_ENV: str(path)}).token == TOKEN


def test_a_token_file_flag_wins_over_the_variables(tmp_path):
    path = tmp_path / "token"
    path.write_text("from-the-flag")
    access = Access.from_env({TOKEN_ENV: TOKEN}, token_file=path)
    assert access.token == "from-the-flag"


@pytest.mark.parametrize("environ, words", [
    ({TOKEN_ENV: "   "}, "is set but empty"),
    ({TOKEN_ENV: "a", TOKEN_FILE_ENV: "/x"}, "not both"),
    ({TOKEN_ENV: "two words"}, "without whitespace"),
    ({TOKEN_ENV: "caf\u00e9"}, "printable ASCII"),
    ({INSECURE_ENV: "maybe"}, "must be 1/true/yes/on"),
])
def test_bad_variables_are_a_clear_error(environ, words):
    with pytest.raises(ValueError, match=words):
        Access.from_env(environ)


def test_a_missing_or_empty_token_file_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"{TOKEN_FILE_ENV}: cannot read the token file {missing}"):
        Access.from_env({TOKEN_FILE_ENV: str(missing)})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        Access.from_env({TOKEN_FILE_ENV: str(empty)})


@pytest.mark.parametrize("value, insecure", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                             ("0", False), ("", False), ("off", False)])
def test_the_insecure_variable(value, insecure):
    assert Access.from_env({INSECURE_ENV: value}).insecure is insecure


def test_the_insecure_flag_adds_to_the_variable_and_a_token_overrides_it():
    assert Access.from_env({}, insecure=True).mode == "insecure"
    assert Access.from_env({TOKEN_ENV: TOKEN, INSECURE_ENV: "1"}).mode == "token"


# ------------------------------------------------------------------ check with a token


def test_with_a_token_only_the_right_bearer_is_admitted_from_any_peer():
    access = Access(TOKEN)
    for peer in ("ipv4:127.0.0.1:5000", "ipv4:10.1.2.3:5000", "ipv6:[2001:db8::1]:80"):
        assert access.check(peer, f"Bearer {TOKEN}") is None
        assert access.check(peer, f"bearer {TOKEN}".encode()) is None  # the scheme is case-insensitive
        missing = access.check(peer, None)
        assert missing == Refusal("unauthenticated", missing.message) and TOKEN_ENV in missing.message
        wrong = access.check(peer, "Bearer not-the-token")
        assert wrong.kind == "unauthenticated" and "wrong job token" in wrong.message
    for malformed in (TOKEN, f"Basic {TOKEN}", "Bearer", "Bearer ", b"Bearer \xff\xfe", f"Bearer {TOKEN}x",
                      f"Bearer {TOKEN[:-1]}"):
        assert access.check("ipv4:127.0.0.1:1", malformed).kind == "unauthenticated", malformed


def test_the_login_cookie_is_derived_from_the_token_and_admits():
    access = Access(TOKEN)
    cookie = access.session_cookie()
    assert TOKEN not in cookie
    assert access.check("ipv4:10.0.0.1:1", None, cookie) is None
    assert access.check("ipv4:10.0.0.1:1", None, Access("another").session_cookie()).kind == "unauthenticated"
    with pytest.raises(ValueError, match="no job token"):
        Access().session_cookie()


# ------------------------------------------------------------------ protected mode and insecure


@pytest.mark.parametrize("peer", [
    "ipv4:127.0.0.1:5000", "ipv4:127.9.8.7:1", "ipv6:[::1]:5000", "ipv6:::1:5000",
    "ipv6:[::ffff:127.0.0.1]:5000", "ipv6:::ffff:127.0.0.1:5000", "ipv6:%5B::1%5D:5000", "unix:/tmp/socket",
    "127.0.0.1", "::1",
])
def test_without_a_token_loopback_peers_are_admitted(peer):
    assert Access().check(peer, None) is None


@pytest.mark.parametrize("peer", [
    "ipv4:10.1.2.3:5000", "ipv6:[2001:db8::1]:5000", "ipv6:2001:db8::1:5000", "ipv6:[::ffff:10.0.0.1]:1",
    "ipv4:0.0.0.0:1", "localhost", "ipv4:localhost:1", None, "", "unknown",
])
def test_without_a_token_other_peers_are_forbidden_with_how_to_fix_it(peer):
    refusal = Access().check(peer, f"Bearer {TOKEN}")  # a token the server does not know changes nothing
    assert refusal is not None and refusal.kind == "forbidden"
    assert TOKEN_ENV in refusal.message and INSECURE_ENV in refusal.message


def test_insecure_admits_every_peer():
    assert Access(insecure=True).check("ipv4:10.1.2.3:5000", None) is None
    assert Access(insecure=True).check(None, None) is None


def test_peer_host():
    assert peer_host("ipv4:1.2.3.4:5") == "1.2.3.4"
    assert peer_host("ipv6:[fe80::1%25eth0]:5") == "fe80::1%eth0"
    assert peer_host("unix:/x") == "unix"
    assert peer_host(None) is None


# ------------------------------------------------------------------ the token never shows


def test_repr_describe_and_refusals_never_hold_the_token():
    access = Access(TOKEN)
    shown = [repr(access), str(access), access.describe(), access.mode,
             access.check("ipv4:10.0.0.1:1", None).message, access.check("ipv4:10.0.0.1:1", "Bearer x").message]
    assert all(TOKEN not in text for text in shown)
    assert "INSECURE" in Access(insecure=True).describe()
    assert TOKEN_ENV in Access().describe()


# ------------------------------------------------------------------ the refusal log


def test_refusals_are_counted_by_kind_and_logged_at_most_once_per_interval(caplog):
    now = [100.0]
    log = RefusalLog("test server", interval=10.0, clock=lambda: now[0])
    access = Access(TOKEN)
    caplog.set_level(logging.WARNING, logger="torchft_lite.rpc.refusals")
    for _ in range(500):
        log.note("ipv4:10.0.0.1:1", "/svc/Kill", access.check("ipv4:10.0.0.1:1", f"Bearer wrong-{TOKEN}"))
    log.note("ipv4:10.0.0.2:1", "/svc/Kill", Access().check("ipv4:10.0.0.2:1", None))
    assert log.counts == {"unauthenticated": 500, "forbidden": 1} and log.total == 501
    assert len(caplog.records) == 1  # a flood is one line, not 501
    first = caplog.records[0].getMessage()
    assert "test server refused '/svc/Kill' from ipv4:10.0.0.1:1 (unauthenticated)" in first
    now[0] += 10.0
    log.note("ipv4:10.0.0.3:1", "/svc/Quorum" + "x" * 10_000, access.check("ipv4:10.0.0.3:1", None))
    assert len(caplog.records) == 2
    second = caplog.records[1].getMessage()
    assert "500 more refused call(s)" in second and len(second) < 1000
    assert all(TOKEN not in record.getMessage() for record in caplog.records)


def test_a_refusal_log_interval_must_not_be_negative():
    with pytest.raises(ValueError, match="interval"):
        RefusalLog("x", interval=-1)
