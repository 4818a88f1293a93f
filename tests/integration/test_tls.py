"""TLS on every server of a job (torchft_lite.rpc.tls): clients that trust the CA are served, others get nothing.

A throwaway CA signs a certificate for 127.0.0.1/::1/localhost (made with the
openssl CLI); a second CA, which signed nothing of this job, stands for a
client or server that is not the job's. TLS composes with the job token: every
test here sets one too, as a job across hosts would.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import subprocess
import sys
from datetime import timedelta

import aiohttp
import grpc
import pytest
import torch

from benchmarks._throwaway_pki import openssl_missing
from tests.conftest import WAIT, running_lighthouse, wait_until
from tests.integration.helpers import manager_server, same_encoding
from torchft_lite.checkpointing import _streams
from torchft_lite.errors import CheckpointError, CheckpointURLError, ConfigError
from torchft_lite.group_server.client import ManagerStub
from torchft_lite.rpc.access import TOKEN_ENV, Access
from torchft_lite.rpc.lighthouse_client import LighthouseClient
from torchft_lite.rpc.protocol import torchft_pb2 as pb
from torchft_lite.rpc.tls import TlsSettings

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(openssl_missing() is not None, reason=str(openssl_missing()))]

TOKEN = secrets.token_urlsafe(24)
ENGINES = pytest.mark.parametrize("grpc_engine", ["native", "grpcio"])
LONG = timedelta(seconds=WAIT)


def job_tls(pki) -> TlsSettings:
    return TlsSettings(pki.cert, pki.key, pki.ca)


async def raw_heartbeat(port: int, channel: grpc.aio.Channel) -> tuple[grpc.StatusCode, str]:
    """One Heartbeat without wait_for_ready, so a failed handshake fails the call at once."""
    request = pb.LighthouseHeartbeatRequest(replica_id="outsider").SerializeToString()
    try:
        await channel.unary_unary("/torchft.LighthouseService/Heartbeat")(
            request, metadata=Access(TOKEN).metadata(), timeout=WAIT)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    finally:
        await channel.close()
    return grpc.StatusCode.OK, ""


# ------------------------------------------------------------------ the lighthouse's gRPC side


@ENGINES
def test_a_tls_lighthouse_serves_a_client_that_trusts_its_ca_and_no_other(grpc_engine, pki, other_pki):
    async def scenario():
        async with running_lighthouse(access=Access(TOKEN), tls=job_tls(pki), grpc_engine=grpc_engine) as lighthouse:
            assert lighthouse.address().startswith("https://")
            target = f"127.0.0.1:{lighthouse.grpc_port}"
            # The job's client: TLS from its settings, though the address says http:// (torchft's form).
            async with LighthouseClient(f"http://{target}", access=Access(TOKEN), tls=TlsSettings(ca=pki.ca)) \
                    as member:
                await member.heartbeat("member", timeout=WAIT)
                quorum = await member.quorum("member", step=4, timeout=WAIT)
                assert [(m.replica_id, m.step) for m in quorum.participants] == [("member", 4)]
            # Also by the host name the certificate names.
            async with LighthouseClient(f"https://localhost:{lighthouse.grpc_port}", access=Access(TOKEN),
                                        tls=TlsSettings(ca=pki.ca)) as by_name:
                assert (await by_name.get_config(timeout=WAIT))["implementation"] == "torchft_lite"
            before = lighthouse.statistics().heartbeats

            untrusting = grpc.aio.secure_channel(target, TlsSettings(ca=other_pki.ca).grpc_channel_credentials())
            code, details = await raw_heartbeat(lighthouse.grpc_port, untrusting)
            assert code == grpc.StatusCode.UNAVAILABLE and "handshake" in details.lower(), details
            plain = grpc.aio.insecure_channel(target)
            code, details = await raw_heartbeat(lighthouse.grpc_port, plain)
            assert code == grpc.StatusCode.UNAVAILABLE, details
            assert lighthouse.statistics().heartbeats == before  # neither reached a handler
            assert lighthouse.refusals.counts == {}  # nor the access check: TLS stopped them first

    asyncio.run(scenario())


def test_a_plain_lighthouse_is_unchanged_and_a_tls_client_fails_on_it(pki):
    async def scenario():
        async with running_lighthouse(access=Access(TOKEN)) as lighthouse:
            assert lighthouse.address().startswith("http://")
            async with LighthouseClient(f"127.0.0.1:{lighthouse.grpc_port}", access=Access(TOKEN),
                                        tls=TlsSettings()) as member:
                await member.heartbeat("plain", timeout=WAIT)
            channel = grpc.aio.secure_channel(f"127.0.0.1:{lighthouse.grpc_port}",
                                              TlsSettings(ca=pki.ca).grpc_channel_credentials())
            code, details = await raw_heartbeat(lighthouse.grpc_port, channel)
            assert code == grpc.StatusCode.UNAVAILABLE, details

    asyncio.run(scenario())


# ------------------------------------------------------------------ the lighthouse's HTTP side


def test_the_dashboard_and_status_over_https(pki, other_pki):
    async def scenario():
        async with running_lighthouse(access=Access(TOKEN), tls=job_tls(pki)) as lighthouse:
            base = f"https://127.0.0.1:{lighthouse.http_port}"
            trusted = TlsSettings(ca=pki.ca).client_context()
            async with aiohttp.ClientSession(headers=Access(TOKEN).headers()) as session:
                async with session.get(f"{base}/api/status", ssl=trusted) as answer:
                    assert answer.status == 200
                    status = await answer.json()
                    assert TOKEN not in str(status)
                async with session.get(f"{base}/api/status", ssl=False) as answer:  # TLS, but the token counts
                    assert answer.status == 200
                async with session.get(f"{base}/metrics", ssl=trusted) as answer:
                    assert answer.status == 200 and "lighthouse_" in await answer.text()
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    async with session.get(f"{base}/healthz", ssl=TlsSettings(ca=other_pki.ca).client_context()):
                        pass
                with pytest.raises(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{lighthouse.http_port}/healthz"):
                        pass
            # A browser's login: the cookie is Secure over HTTPS, so it never travels in plain text.
            async with aiohttp.ClientSession() as browser:
                async with browser.get(f"{base}/?token={TOKEN}", ssl=trusted, allow_redirects=False) as answer:
                    assert answer.status == 303
                    cookie = answer.headers["Set-Cookie"]
                    assert "Secure" in cookie and "HttpOnly" in cookie and TOKEN not in cookie

    asyncio.run(scenario())


def test_the_dashboard_kill_reaches_a_tls_manager_and_checks_its_certificate(pki, other_pki):
    async def kill(lighthouse, replica_id: str) -> tuple[int, str]:
        url = f"https://127.0.0.1:{lighthouse.http_port}/api/replicas/{replica_id}/kill"
        async with aiohttp.ClientSession(headers=Access(TOKEN).headers()) as session, \
                session.post(url, json={"msg": "over TLS"}, ssl=TlsSettings(ca=pki.ca).client_context()) as answer:
            return answer.status, await answer.text()

    async def scenario(lighthouse_tls: TlsSettings, expect_kill: bool):
        async with running_lighthouse(access=Access(TOKEN), admin_token=TOKEN, tls=lighthouse_tls) as lighthouse, \
                manager_server(lighthouse.address(), Access(TOKEN), tls=job_tls(pki)) as server:
            assert server.address().startswith("https://")
            member = ManagerStub(server.address(), access=Access(TOKEN), tls=job_tls(pki))
            try:  # a quorum makes the lighthouse know the ManagerServer's (https) address
                await member.quorum(group_rank=0, step=1, checkpoint_metadata="", shrink_only=False,
                                    init_sync=False, commit_failures=0, timeout=WAIT)
            finally:
                await member.close()
            status, text = await kill(lighthouse, "victim")
            if expect_kill:
                assert status == 200, text
                await wait_until(lambda: server.kills, "the dashboard's Kill over TLS")
                assert server.kills == ["over TLS"]
            else:  # the lighthouse trusts another CA: the manager's certificate is refused, nothing is killed
                assert status == 502 and "UNAVAILABLE" in text, text
                assert server.kills == [] and server.statistics().refused == {}

    asyncio.run(scenario(job_tls(pki), True))
    asyncio.run(scenario(TlsSettings(pki.cert, pki.key, other_pki.ca), False))


# ------------------------------------------------------------------ the ManagerServer


def test_a_tls_manager_server_refuses_plain_text_and_untrusted_clients(pki, other_pki):
    async def scenario():
        async with running_lighthouse(access=Access(TOKEN), tls=job_tls(pki)) as lighthouse, \
                manager_server(lighthouse.address(), Access(TOKEN), tls=job_tls(pki)) as server:
            # Its own lease on the TLS lighthouse works: its lighthouse client follows its settings.
            await wait_until(lambda: server.lease_held, "the ManagerServer's lease over TLS")
            target = server.address().removeprefix("https://")
            for channel in (grpc.aio.insecure_channel(target),
                            grpc.aio.secure_channel(target, TlsSettings(ca=other_pki.ca).grpc_channel_credentials())):
                try:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await channel.unary_unary("/torchft.ManagerService/Kill")(
                            pb.KillRequest(msg="pwned").SerializeToString(), metadata=Access(TOKEN).metadata(),
                            timeout=WAIT)
                    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                finally:
                    await channel.close()
            assert server.kills == []
            member = ManagerStub(server.address(), access=Access(TOKEN), tls=TlsSettings(ca=pki.ca))
            try:
                await member.quorum(group_rank=0, step=2, checkpoint_metadata="", shrink_only=False,
                                    init_sync=False, commit_failures=0, timeout=WAIT)
                assert await member.should_commit(group_rank=0, step=2, should_commit=True, timeout=WAIT)
            finally:
                await member.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------ heals


def state_dict() -> dict:
    generator = torch.Generator().manual_seed(7)
    return {"w": torch.randn(3_000_000, generator=generator), "b": torch.arange(5, dtype=torch.int64),
            "h": torch.randn(17, 33, generator=generator).to(torch.bfloat16), "step": 9, "lr": 0.125}


@pytest.mark.parametrize("cpus", [2, 8], ids=["ranges-on-the-loop", "ranges-on-threads"])
def test_a_heal_over_tls_is_bit_identical(make_transport, pki, monkeypatch, cpus):
    monkeypatch.setattr(_streams, "usable_cpus", lambda: cpus)  # 8: the ranged receiver reads on threads
    tls = job_tls(pki)
    sent = state_dict()
    source = make_transport(access=Access(TOKEN), tls=tls)
    assert source.metadata().startswith("https://127.0.0.1:")
    whole = make_transport(access=Access(TOKEN), tls=TlsSettings(ca=pki.ca))  # a receiver that serves no TLS
    ranged = make_transport(access=Access(TOKEN), tls=tls, num_chunks=4)
    targets = {key: value.clone().zero_() if isinstance(value, torch.Tensor) else value for key, value in sent.items()}
    in_place = make_transport(access=Access(TOKEN), tls=tls, state_dict=lambda: targets)
    source.send_checkpoint([1, 2, 3], 9, sent, LONG)
    for receiver in (whole, ranged, in_place):
        assert same_encoding(receiver.recv_checkpoint(0, source.metadata(), 9, LONG), sent, 9)
    assert torch.equal(targets["w"], sent["w"]) and torch.equal(targets["h"], sent["h"])  # landed in place
    source.disallow_checkpoint()
    assert source.statistics().bytes_served > 3 * sent["w"].numel() * 4


@pytest.mark.parametrize("cpus", [2, 8], ids=["ranges-on-the-loop", "ranges-on-threads"])
def test_a_heal_striped_over_two_tls_sources(make_transport, pki, monkeypatch, cpus):
    monkeypatch.setattr(_streams, "usable_cpus", lambda: cpus)
    tls = job_tls(pki)
    sent = state_dict()
    primary, secondary = make_transport(access=Access(TOKEN), tls=tls), make_transport(access=Access(TOKEN), tls=tls)
    receiver = make_transport(access=Access(TOKEN), tls=tls, num_chunks=4)
    primary.send_checkpoint([1], 9, sent, LONG)
    secondary.send_checkpoint([1], 9, sent, LONG)
    received = receiver.recv_checkpoint_striped([(0, primary.metadata()), (1, secondary.metadata())], 9, LONG)
    assert same_encoding(received, sent, 9)
    primary.disallow_checkpoint()
    secondary.disallow_checkpoint()
    assert primary.statistics().bytes_served > 0 and secondary.statistics().bytes_served > 0


def test_a_receiver_that_does_not_trust_the_ca_or_speaks_plain_text_gets_nothing(make_transport, pki, other_pki):
    source = make_transport(access=Access(TOKEN), tls=job_tls(pki))
    source.send_checkpoint([], 9, state_dict(), LONG)
    short = timedelta(seconds=10)
    for trust in (TlsSettings(ca=other_pki.ca), TlsSettings()):  # another CA; the system's CAs
        with pytest.raises(CheckpointURLError, match="TLS handshake failed.*TORCHFT_LITE_TLS_CA"):
            make_transport(access=Access(TOKEN), tls=trust).recv_checkpoint(0, source.metadata(), 9, short)
    plain_url = source.metadata().replace("https://", "http://")
    with pytest.raises(CheckpointError):
        make_transport(access=Access(TOKEN), tls=TlsSettings()).recv_checkpoint(0, plain_url, 9, short)
    assert source.statistics().bytes_served == 0
    source.disallow_checkpoint()


# ------------------------------------------------------------------ bad settings


def test_bad_settings_fail_at_start_with_the_setting_named(pki, other_pki, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHFT_LITE_TLS_CERT", str(pki.cert))
    monkeypatch.delenv("TORCHFT_LITE_TLS_KEY", raising=False)
    with pytest.raises(ConfigError, match="TORCHFT_LITE_TLS_CERT is set but TORCHFT_LITE_TLS_KEY is not"):
        from torchft_lite.checkpointing import HTTPTransport

        HTTPTransport(LONG, hostname="127.0.0.1", bind_host="127.0.0.1")
    with pytest.raises(ValueError, match="TORCHFT_LITE_TLS_KEY is not"):
        ManagerStub("127.0.0.1:1")
    monkeypatch.setenv("TORCHFT_LITE_TLS_KEY", str(other_pki.key))
    with pytest.raises(ValueError, match="cannot use .* with the key"):
        LighthouseClient("127.0.0.1:1")

    done = subprocess.run([sys.executable, "-m", "lighthouse", "--min_replicas", "1", "--bind", "127.0.0.1:0",
                           "--http-bind", "off", "--tls-cert", str(pki.cert)], capture_output=True, text=True,
                          timeout=WAIT, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and "--tls-cert is set but --tls-key is not" in done.stderr, done.stderr


# ------------------------------------------------------------------ training end to end


@pytest.mark.slow
def test_training_with_tls_and_a_token_commits_steps_and_heals(tmp_path, monkeypatch, pki, caplog):
    """Real groups (examples/train_ddp.py) and a real lighthouse; TLS and the token both from the environment."""
    from tests.integration.helpers import assert_identical_per_step, cluster, read_reports, steps_of, wait_for

    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    for name, value in pki.env().items():
        monkeypatch.setenv(name, value)
    with cluster(tmp_path, min_replicas=1, join_timeout=1.0, heartbeat_timeout=1.0) as (lighthouse, add, report):
        assert lighthouse.address.startswith("https://"), lighthouse.address
        survivor = add(0, 2, steps=400, sleep=0.05)
        victim = add(1, 2, steps=400, sleep=0.05)
        wait_for(lambda: min(len(steps_of(read_reports(report), g)) for g in (0, 1)) >= 3,
                 "both groups' 3rd committed step", groups=[survivor, victim])
        victim.kill(signal.SIGKILL)
        victim.start()
        restarted_before = len(steps_of(read_reports(report), 1))
        wait_for(lambda: len(steps_of(read_reports(report), 1)) >= restarted_before + 3,
                 "the restarted group to heal and commit 3 steps", groups=[survivor, victim])
        rows = read_reports(report)
        assert steps_of(rows, 1)[restarted_before] > 1, "the restarted group started over instead of healing"
        assert assert_identical_per_step(rows) >= 3
    logs = {log.name: log.read_text(errors="replace") for log in tmp_path.glob("*.log")}
    assert "TLS on: serving TLS" in logs["lighthouse.log"]
    assert any("received step" in text and "from https://127.0.0.1:" in text for text in logs.values()), \
        "no heal over https:// in the groups' logs"
    assert any("ManagerServer listening on https://" in text for text in logs.values())
    for name, text in logs.items():
        assert TOKEN not in text, f"{name} holds the job token"
