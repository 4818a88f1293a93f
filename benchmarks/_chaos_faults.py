"""The chaos run's fault schedule, and the network namespaces its partitions cut.

A schedule is drawn in full from the seed before anything starts, so the
very same faults (kinds, order, times, how long each lasts, which group each
picks) are injected into every implementation a side-by-side run compares:
nothing drawn depends on how a run went. Each fault carries a seed of its
own for the choices it makes when it is injected (which of the live groups,
how long until the restart), and the supervisor draws from its own stream
for what the schedule can't foresee (a rank that exits by itself).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KINDS", "BridgedHosts", "Fault", "Network", "make_schedule"]

KINDS = ("kill", "kill-rank", "term", "hang", "hang-before-vote", "partition", "lighthouse", "kill-all")


@dataclass(frozen=True)
class Fault:
    at: float
    """Seconds after the chaos phase starts when it is due (it waits while it can't be injected)."""
    kind: str
    seed: int
    """Seeds the fault's own choices: the group it picks among those eligible, how long it lasts."""

    def rng(self) -> random.Random:
        return random.Random(self.seed)


def make_schedule(seed: int, kinds: list[str], *, weights: dict[str, float] | None = None, count: int | None = None,
                  interval: float = 2.0, every: float | None = None, duration: float | None = None,
                  first: str | None = None) -> list[Fault]:
    """``count`` faults a mean ``interval`` apart (exponential gaps, as independent failures arrive), or with
    ``every`` and ``duration`` one fault in the middle of each ``every`` seconds of ``duration`` (the rate is
    exact, so short runs at a slow rate still compare like with like). ``first``: the first fault's kind."""
    rng = random.Random(seed)
    weights = weights or {}
    weight_list = [weights.get(kind, 1.0) for kind in kinds]
    if every is not None:
        if duration is None:
            raise ValueError("a fault rate (every) needs a duration")
        count = max(1, round(duration / every))
        times = [(k + 0.5) * every for k in range(count)]
    else:
        if count is None:
            raise ValueError("give either count or every and duration")
        times, at = [], 0.0
        for _ in range(count):
            times.append(at)
            at += rng.expovariate(1.0 / interval)
    faults = []
    for k, at in enumerate(times):
        kind = rng.choices(kinds, weight_list)[0] if sum(weight_list) else kinds[0]
        if k == 0 and first is not None:
            kind = first
        faults.append(Fault(at=at, kind=kind, seed=rng.getrandbits(32)))
    return faults


class Network:
    """One network namespace per replica group, joined to the host by a veth pair.

    Group i lives at 10.<net>.<i>.2 and reaches the host (the lighthouse, the
    stores, the other groups through forwarding) at 10.<net>.<i>.1. A partition
    sets the host end down: packets vanish (no reset), as in a real partition.

    torchft advertises ``socket.gethostname()`` (the training script can't set
    it), so with ``hostnames`` each group also runs in a UTS namespace of its
    own, named like its network namespace, and every namespace's hosts file
    (``/etc/netns/NS/hosts``, which ``ip netns exec`` mounts) maps those names
    to the groups' addresses: each group advertises a name the others resolve.

    Every namespace also gets a ``resolv.conf`` naming only its own loopback,
    where nothing answers: the host's DNS server is not reachable from the
    namespaces (no NAT), so each reverse lookup a process made there (c10d's
    store client makes one per connection) waited 10 s for a timeout, and a
    restarted group took 16-18 s to reach its first quorum. Now a lookup
    fails at once (there are no names to find beyond the hosts file).
    """

    def __init__(self, groups: int, hostnames: bool = False) -> None:
        self.hostnames = hostnames
        self.tag = f"{os.getpid() % 10000}"
        self.net = self._free_net(200 + os.getpid() % 50)
        self.groups = groups
        self.forwarding = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()

    @staticmethod
    def _free_net(preferred: int) -> int:
        """A 10.N.0.0/16 no interface of the host uses: another run's (or a crashed run's leftover) veths
        with the same addresses would take this run's packets, and its groups would reach no store."""
        listed = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
        used = {int(n) for n in re.findall(r"inet 10\.(\d+)\.", listed)}
        for net in [*range(preferred, 255), *range(200, preferred)]:
            if net not in used:
                return net
        raise SystemExit("no free 10.200-254.0.0/16 network for the partition namespaces; remove stale "
                         "namespaces (ip netns list) or run without partition faults (--kinds)")

    @staticmethod
    def unavailable(hostnames: bool = False) -> str | None:
        if os.geteuid() != 0:
            return "needs root for network namespaces"
        if shutil.which("ip") is None:
            return "the `ip` command (iproute2) is missing"
        if hostnames and shutil.which("unshare") is None:
            return "the `unshare` command (util-linux) is missing: torchft's groups need hostnames of their own"
        probe = subprocess.run(["ip", "netns", "add", f"tftlprobe{os.getpid()}"], capture_output=True, text=True)
        if probe.returncode != 0:
            return f"network namespaces unavailable: {probe.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", f"tftlprobe{os.getpid()}"], capture_output=True)
        return None

    def ns(self, g: int) -> str:
        return f"tftl{self.tag}g{g}"

    def host_if(self, g: int) -> str:
        return f"th{self.tag}g{g}"

    def host_ip(self, g: int) -> str:
        return f"10.{self.net}.{g}.1"

    def group_ip(self, g: int) -> str:
        return f"10.{self.net}.{g}.2"

    def interface(self, g: int) -> str:
        """Group ``g``'s own end of its veth pair (inside its namespace)."""
        return f"tn{self.tag}g{g}"

    def setup(self) -> None:
        self._prepare()
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.group_ip(g)} {self.ns(g)}\n" for g in range(self.groups))
        for g in range(self.groups):
            etc = Path(f"/etc/netns/{self.ns(g)}")
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            if self.hostnames:
                (etc / "hosts").write_text(hosts)
            for command in self._link_commands(g):
                subprocess.run(command.split(), check=True, capture_output=True)

    def _prepare(self) -> None:
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")

    def _link_commands(self, g: int) -> list[str]:
        ns, host_if, ns_if = self.ns(g), self.host_if(g), self.interface(g)
        return [
            f"ip netns add {ns}",
            f"ip link add {host_if} type veth peer name {ns_if}",
            f"ip link set {ns_if} netns {ns}",
            *self._attach(g),
            f"ip link set {host_if} up",
            f"ip netns exec {ns} ip addr add {self.group_ip(g)}/24 dev {ns_if}",
            f"ip netns exec {ns} ip link set {ns_if} up",
            f"ip netns exec {ns} ip link set lo up",
            *self._routes(g),
        ]

    def _attach(self, g: int) -> list[str]:
        """How the host's end of group ``g``'s veth pair joins the host: an address of its own."""
        return [f"ip addr add {self.host_ip(g)}/24 dev {self.host_if(g)}"]

    def _routes(self, g: int) -> list[str]:
        return [f"ip netns exec {self.ns(g)} ip route add default via {self.host_ip(g)}"]

    def prefix(self, g: int) -> list[str]:
        """The command prefix that runs a process of group ``g`` in its namespace(s)."""
        prefix = ["ip", "netns", "exec", self.ns(g)]
        if self.hostnames:  # the name is $0 of the shell, the command its "$@"
            prefix += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.ns(g)]
        return prefix

    def env(self, g: int) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": self.interface(g)}  # gloo must not pick the namespace's loopback

    def cut(self, g: int, connected: bool) -> None:
        subprocess.run(["ip", "link", "set", self.host_if(g), "up" if connected else "down"], check=True)

    def teardown(self) -> None:
        for g in range(self.groups):
            subprocess.run(["ip", "netns", "del", self.ns(g)], capture_output=True)
            subprocess.run(["ip", "link", "del", self.host_if(g)], capture_output=True)
            shutil.rmtree(f"/etc/netns/{self.ns(g)}", ignore_errors=True)
        Path("/proc/sys/net/ipv4/ip_forward").write_text(self.forwarding)


class BridgedHosts(Network):
    """One network namespace per simulated host, all on one Linux bridge, as machines on one switch.

    Host i lives at 10.<net>.0.<10+i> behind a veth pair whose other end is a
    port of the bridge; the bridge itself holds 10.<net>.0.1, so this process
    (the test) can reach every host too. Hosts talk to each other through the
    bridge only, never through the host's routing, and a partition (:meth:`cut`)
    sets a host's bridge port down. With ``hostnames`` every host gets its own
    name (a UTS namespace) that every host's hosts file maps to its bridge
    address, as a cluster's DNS would.
    """

    def bridge(self) -> str:
        return f"tb{self.tag}"

    def host_ip(self, g: int) -> str:
        return f"10.{self.net}.0.1"

    def group_ip(self, g: int) -> str:
        return f"10.{self.net}.0.{10 + g}"

    def _prepare(self) -> None:  # no forwarding: hosts meet on the bridge, never through this host's routes
        for command in (f"ip link add {self.bridge()} type bridge",
                        f"ip addr add {self.host_ip(0)}/24 dev {self.bridge()}",
                        f"ip link set {self.bridge()} up"):
            subprocess.run(command.split(), check=True, capture_output=True)

    def _attach(self, g: int) -> list[str]:
        return [f"ip link set {self.host_if(g)} master {self.bridge()}"]

    def _routes(self, g: int) -> list[str]:
        return []  # one subnet: every host is a neighbour

    def teardown(self) -> None:
        super().teardown()
        subprocess.run(["ip", "link", "del", self.bridge()], capture_output=True)
