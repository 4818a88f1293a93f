"""The training-script surface: torchft's names, and settings resolved before anything starts."""

import logging
from datetime import timedelta

import pytest

import torchft_lite
from torchft_lite.core.settings import ManagerSettings, default_advertised_host
from torchft_lite.errors import ConfigError


def test_public_api_is_pinned_and_importable():
    assert sorted(torchft_lite.__all__) == [
        "DistributedDataParallel", "DistributedSampler", "DurableCheckpointer", "HealthConfig", "Manager", "Optimizer",
        "OptimizerWrapper",
        "ProcessGroupBabyGloo", "ProcessGroupBabyNCCL", "ProcessGroupGloo", "ProcessGroupNCCL", "ShardedState",
        "WatchdogConfig", "WorldSizeMode", "average_across_groups", "init_group_mesh",
    ]
    for name in torchft_lite.__all__:
        assert getattr(torchft_lite, name) is not None
    from torchft_lite.checkpointing import CheckpointTransport, HTTPTransport  # noqa: F401
    from torchft_lite.checkpointing.pg_transport import PGTransport  # noqa: F401
    with pytest.raises(AttributeError):
        torchft_lite.NotAThing  # noqa: B018


def resolve(env, **overrides):
    args = dict(min_replica_size=1, timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=60),
                connect_timeout=timedelta(seconds=60), rank=None, world_size=None, store_addr=None,
                store_port=None, lighthouse_addr=None, replica_id="r", port=None, hostname=None,
                heartbeat_interval=timedelta(milliseconds=100), max_retries=None, quorum_retries=0)
    args.update(overrides)
    return ManagerSettings.resolve(env=env, **args)


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
            "TORCHFT_LIGHTHOUSE": "http://lh:29510"}


def test_torchrun_environment_is_enough():
    s = resolve(TORCHRUN)
    assert (s.group_rank, s.group_world_size, s.store_address) == (0, 2, "10.0.0.1:29500")
    assert s.lighthouse_addr == "http://lh:29510" and s.port == 0 and s.timeouts.step == timedelta(seconds=60)


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHFT_LIGHTHOUSE"])
def test_a_missing_setting_is_named(missing):
    env = {k: v for k, v in TORCHRUN.items() if k != missing}
    with pytest.raises(ConfigError, match=missing):
        resolve(env)


def test_lighthouse_is_only_required_on_group_rank_zero():
    env = {k: v for k, v in TORCHRUN.items() if k != "TORCHFT_LIGHTHOUSE"}
    assert resolve(dict(env, RANK="1")).lighthouse_addr is None


def test_explicit_arguments_win_except_torchfts_timeout_variables():
    env = dict(TORCHRUN, TORCHFT_TIMEOUT_SEC="7", TORCHFT_QUORUM_RETRIES="3", TORCHFT_MANAGER_PORT="1234",
               TORCHFT_LITE_HOSTNAME="10.1.1.1")
    s = resolve(env, rank=1, world_size=4, store_addr="h", store_port=1, timeout=timedelta(seconds=99),
                quorum_retries=0)
    assert (s.group_rank, s.group_world_size, s.store_address) == (1, 4, "h:1")
    assert s.timeouts.step == timedelta(seconds=7) and s.quorum_retries == 3  # torchft: these env vars take precedence
    assert s.port == 1234 and s.hostname == "10.1.1.1"
    assert resolve(env, hostname="explicit").hostname == "explicit"


@pytest.mark.parametrize("env,message", [
    (dict(TORCHRUN, RANK="2"), "rank must be in"),
    (dict(TORCHRUN, RANK="x"), r"\$RANK must be an integer"),
    (dict(TORCHRUN, MASTER_PORT="0"), "store_port"),
    (dict(TORCHRUN, TORCHFT_TIMEOUT_SEC="soon"), "TORCHFT_TIMEOUT_SEC"),
    (dict(TORCHRUN, TORCHFT_QUORUM_TIMEOUT_SEC="-1"), "quorum_timeout must be positive"),
    (dict(TORCHRUN, TORCHFT_LITE_LEASE_TIMEOUT_SEC="0"), "lease_timeout must be positive"),
    (dict(TORCHRUN, TORCHFT_LITE_LEASE_TIMEOUT_SEC="long"), "TORCHFT_LITE_LEASE_TIMEOUT_SEC must be a number"),
])
def test_invalid_settings_are_clear_errors(env, message):
    with pytest.raises(ConfigError, match=message):
        resolve(env)


def test_the_assumed_lease_is_torchfts_heartbeat_timeout_unless_set():
    assert resolve(TORCHRUN).lease_timeout == 5.0
    assert resolve(dict(TORCHRUN, TORCHFT_LITE_LEASE_TIMEOUT_SEC="1.5")).lease_timeout == 1.5


def test_ipv6_store_host_is_bracketed():
    assert resolve(dict(TORCHRUN, MASTER_ADDR="::1")).store_address == "[::1]:29500"


def test_heal_settings_default_to_one_source_in_place():
    s = resolve(TORCHRUN)
    assert (s.heal_sources, s.heal_in_place) == (1, True)


def test_heal_settings_come_from_the_environment_unless_given():
    env = dict(TORCHRUN, TORCHFT_LITE_HEAL_SOURCES="3", TORCHFT_LITE_HEAL_IN_PLACE="0")
    assert (resolve(env).heal_sources, resolve(env).heal_in_place) == (3, False)
    s = resolve(env, heal_sources=2, heal_in_place=True)
    assert (s.heal_sources, s.heal_in_place) == (2, True)
    assert resolve(dict(TORCHRUN, TORCHFT_LITE_HEAL_IN_PLACE="Off")).heal_in_place is False
    assert resolve(dict(TORCHRUN, TORCHFT_LITE_HEAL_IN_PLACE="yes")).heal_in_place is True


@pytest.mark.parametrize("env,overrides,message", [
    (dict(TORCHRUN, TORCHFT_LITE_HEAL_SOURCES="0"), {}, r"heal_sources \(TORCHFT_LITE_HEAL_SOURCES\) must be >= 1"),
    (TORCHRUN, dict(heal_sources=-1), "heal_sources .* must be >= 1, got -1"),
    (dict(TORCHRUN, TORCHFT_LITE_HEAL_SOURCES="two"), {}, r"\$TORCHFT_LITE_HEAL_SOURCES must be an integer"),
    (dict(TORCHRUN, TORCHFT_LITE_HEAL_IN_PLACE="maybe"), {}, r"\$TORCHFT_LITE_HEAL_IN_PLACE must be 1 or 0"),
])
def test_invalid_heal_settings_are_clear_errors(env, overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve(env, **overrides)


class TestAdvertisedHost:
    """The default host a group advertises (TORCHFT_LITE_HOSTNAME unset), with the lookups injected."""

    @staticmethod
    def advertised(addresses, lighthouse="http://10.1.2.3:29510", store="10.1.2.4", routes=None):
        routes = routes if routes is not None else {"10.1.2.3": "10.1.2.9", "10.1.2.4": "10.1.2.9"}
        return default_advertised_host(lighthouse, store, hostname=lambda: "node7",
                                       resolve=lambda name: addresses, route=routes.get)

    def test_a_hostname_that_resolves_to_a_real_address_is_advertised(self):
        assert self.advertised(["10.1.2.9"]) == "node7"
        assert self.advertised([]) == "node7"  # unknown here: the peers' resolvers may know it

    def test_a_hostname_that_resolves_to_loopback_only_gives_way_to_the_address_that_reaches_the_lighthouse(self, caplog):
        with caplog.at_level(logging.WARNING):
            assert self.advertised(["127.0.1.1"]) == "10.1.2.9"
        assert "resolves to 127.0.1.1 only" in caplog.text and "TORCHFT_LITE_HOSTNAME" in caplog.text
        # a rank other than 0 need not know the lighthouse: its group's store tells the network apart
        assert self.advertised(["127.0.1.1", "::1"], lighthouse=None) == "10.1.2.9"

    def test_a_job_on_one_host_keeps_the_hostname(self):
        assert self.advertised(["127.0.1.1"], lighthouse="http://localhost:29510", store="127.0.0.1") == "node7"
        assert self.advertised(["127.0.1.1"], lighthouse="http://127.0.0.1:29510", store="localhost") == "node7"
        assert self.advertised(["127.0.1.1"], routes={}) == "node7"  # no route to either: nothing better known

    def test_the_route_is_looked_up_for_real(self):
        from torchft_lite.core.settings import _route_address
        assert _route_address("127.0.0.1") == "127.0.0.1"
