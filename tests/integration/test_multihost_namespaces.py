"""A multi-host job on one machine: each "host" a network namespace on one bridge, token and TLS on.

Host 0 runs the lighthouse, bound to its bridge address only; hosts 1 and 2
each run a replica group of two ranks under torchrun. Group 0 advertises its
bridge address (``TORCHFT_LITE_HOSTNAME``, the way to pick a network); group 1
advertises the default, its hostname, which every host resolves to its bridge
address (the hosts file, as a cluster's DNS). The test checks that quorums form
with every advertised address a bridge address (never loopback nor a name that
resolves elsewhere), that a SIGKILLed group restarted on its host heals over
the bridge (the serving group logs the receiver's bridge address), and that a
partitioned host is declared gone, comes back and heals, every shared step
identical.
"""

from __future__ import annotations

import json
import re
import ssl
import time
from pathlib import Path

import pytest

from benchmarks._chaos_faults import BridgedHosts
from benchmarks._throwaway_pki import make_pki, openssl_missing
from tests.conftest import wait_until_sync
from tests.integration.cluster_jobs import assert_identical_per_step, kill_and_rejoin, read_reports, wait_for_rows
from tests.integration.helpers import TRAIN_DDP, fetch
from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup, job_access

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WAIT = 240.0
UNAVAILABLE = BridgedHosts.unavailable(hostnames=True) or openssl_missing()
_RECEIVER = re.compile(r"receivers finished \((?:::ffff:)?([0-9a-f.:]+) sent")


@pytest.fixture
def hosts():
    network = BridgedHosts(3, hostnames=True)
    network.setup()
    try:
        yield network
    finally:
        network.teardown()


def status(lighthouse: LighthouseProcess, host: str, ca: Path) -> dict:
    """The lighthouse's /api/status, fetched over the bridge with the token and TLS, as a peer would."""
    context = ssl.create_default_context(cafile=str(ca))
    return json.loads(fetch(f"https://{host}:{lighthouse.http_port}/api/status", headers=job_access().headers(),
                            context=context, timeout=10, expect=200)[1])


def heal_receivers(log_dir: Path, group: int) -> list[str]:
    """The addresses that fetched a heal from ``group`` (its checkpoint server logs each)."""
    found = []
    for log in sorted(log_dir.glob(f"group{group}.*.torchrun.log")):
        found += _RECEIVER.findall(log.read_text(errors="replace"))
    return found


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"skipped: {UNAVAILABLE}")
def test_a_job_across_namespaces_heals_over_the_bridge_after_a_kill_and_a_partition(tmp_path, hosts):
    addresses = [hosts.group_ip(h) for h in range(3)]
    names = [hosts.ns(h) for h in range(3)]
    pki = make_pki(tmp_path / "tls", "cluster", hosts=(*addresses, *names))
    lighthouse = LighthouseProcess(min_replicas=1, join_timeout=2.0, heartbeat_timeout=3.0, host=addresses[0],
                                   http=True, startup_grace=0.0, prefix=hosts.prefix(0), env=pki.env(),
                                   log_path=tmp_path / "lighthouse.log")
    report = tmp_path / "report.jsonl"
    args = ["--steps", "100000", "--step-sleep", "0.05", "--timeout", "10", "--report", str(report)]
    groups: list[ReplicaGroup] = []
    try:
        lighthouse.start()
        assert lighthouse.address.startswith(f"https://{addresses[0]}:")  # its bind address, TLS on
        for g, advertise in ((0, addresses[1]), (1, None)):
            host = g + 1
            groups.append(ReplicaGroup(g, 2, lighthouse.address, TRAIN_DDP, args, world_size=2, use_torchrun=True,
                                       env={**pki.env(), **hosts.env(host)}, log_dir=tmp_path,
                                       store_host=addresses[host], advertise=advertise,
                                       prefix=hosts.prefix(host)).start())

        def ended() -> str | None:
            dead = [g.group_id for g in groups if not g.alive()]
            return f"group(s) {dead} exited (see {tmp_path})" if dead else None

        wait_for_rows(report, lambda rows: {r["group"] for r in rows if r["participants"] == 2} == {0, 1},
                      "both groups to commit together", WAIT, ended)

        # Every address the job advertises is a bridge address, or a name every host resolves to one.
        members = status(lighthouse, addresses[0], pki.ca)["quorum"]["members"]
        advertised = {m["replica_id"].split(":")[0]: (m["address"], m["store_address"]) for m in members}
        hosts_of = {rid: {a.split("//")[-1].rsplit(":", 1)[0] for a in pair} for rid, pair in advertised.items()}
        assert hosts_of["train_ddp_0"] == {addresses[1]}
        # The default: the ManagerServer at its hostname; the store where torchrun's MASTER_ADDR says.
        assert advertised["train_ddp_1"][0].split("//")[-1].rsplit(":", 1)[0] == names[2]
        assert hosts_of["train_ddp_1"] <= {names[2], addresses[2]}
        assert all(a.startswith("https://") for a, _ in advertised.values())

        # A SIGKILLed group restarts on its host and heals from the other over the bridge.
        def kill_and_restart(_: set[int]) -> None:
            groups[1].kill()
            groups[1].start()

        _, rejoin = kill_and_rejoin(report, 1, at_step=0, timeout=WAIT, still_running=ended, kill=kill_and_restart)
        assert rejoin.first_step > 1, f"the restarted group started over at step {rejoin.first_step}: no heal"
        # The source logs its receivers once they report done, which may come after the healed group's commit.
        wait_until_sync(lambda: addresses[2] in heal_receivers(tmp_path, 0),
                        "group 0 to log the heal it served to host 2's bridge address", WAIT)

        # A partitioned host is declared gone; the other trains on alone; it comes back and heals.
        hosts.cut(1, connected=False)
        cut_at = time.time()
        rows = wait_for_rows(report, lambda rows: any(r["group"] == 1 and r["participants"] == 1
                                                      and r["time"] > cut_at for r in rows),
                             "group 1 to commit alone while host 1 is cut off", WAIT, ended)
        hosts.cut(1, connected=True)
        ahead = max(r["step"] for r in rows if r["group"] == 1)
        wait_for_rows(report, lambda rows: any(r["group"] == 0 and r["step"] > ahead and r["participants"] == 2
                                               for r in rows),
                      "group 0 to come back past the steps it missed", WAIT, ended)
        wait_until_sync(lambda: addresses[1] in heal_receivers(tmp_path, 1),
                        "group 1 to log the heal it served to host 1's bridge address", WAIT)
        receivers = set(heal_receivers(tmp_path, 0) + heal_receivers(tmp_path, 1))
        assert receivers <= {addresses[1], addresses[2]}, f"a heal went over another network: {receivers}"
        assert assert_identical_per_step(read_reports(report)) > 0
        print(f"namespaces: restart-to-rejoin {rejoin.seconds:.2f}s (first step {rejoin.first_step})")
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()
