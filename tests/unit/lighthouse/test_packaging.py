"""Things that must stay true of the package as shipped."""

import subprocess
import sys

import lighthouse
from torchft_lite.rpc.protocol import generate


def test_lighthouse_never_imports_torch():
    code = (
        "import sys, lighthouse, lighthouse.server, lighthouse.http, lighthouse.__main__, lighthouse.thread; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_rpc_kit_imports_neither_server():
    # Both servers build on torchft_lite.rpc; it must not import either back (nor torch).
    code = (
        "import importlib, pkgutil, sys, torchft_lite.rpc\n"
        "for module in pkgutil.walk_packages(torchft_lite.rpc.__path__, 'torchft_lite.rpc.'):\n"
        "    importlib.import_module(module.name)\n"
        "print(' '.join(sorted(sys.modules)))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            timeout=120).stdout.split()
    assert "torchft_lite.rpc.h2grpc.connection" in loaded and "torchft_lite.rpc.engines" in loaded
    # torchft_lite itself is the package the kit sits in: its names resolve lazily, so it loads nothing else.
    outside = [m for m in loaded if m.split(".")[0] in ("torch", "lighthouse")
               or (m.startswith("torchft_lite.") and not m.startswith("torchft_lite.rpc"))]
    assert outside == []


def test_generated_protocol_code_is_not_stale():
    stale = generate.stale_files()
    assert not stale, "run `make proto`; stale files:\n" + "\n".join(stale)


def test_public_api_is_pinned():
    assert sorted(lighthouse.__all__) == [
        "BackgroundLighthouse", "Decision", "IssuedQuorum", "LighthouseClient", "LighthouseConfig",
        "LighthouseError", "LighthouseServer", "LighthouseStatistics", "LighthouseTimeout", "Member",
        "QuorumConfig", "QuorumState", "Status",
    ]
    for name in lighthouse.__all__:
        assert hasattr(lighthouse, name)


def test_wire_field_numbers_match_torchft():
    from torchft_lite.rpc.protocol import torchft_pb2 as pb

    def numbers(message):
        return {f.name: f.number for f in message.DESCRIPTOR.fields}

    assert numbers(pb.QuorumMember) == {
        "replica_id": 1, "address": 2, "store_address": 3, "step": 4, "world_size": 5, "shrink_only": 6,
        "data": 7, "commit_failures": 8, "reconfigure_handles": 9,
    }
    assert numbers(pb.Quorum) == {"quorum_id": 1, "participants": 2, "created": 3}
    assert pb.QuorumMember.DESCRIPTOR.fields_by_name["world_size"].type == 4  # TYPE_UINT64
    assert pb.DESCRIPTOR.package == "torchft"
    services = {s.name: [m.name for m in s.methods] for s in pb.DESCRIPTOR.services_by_name.values()}
    assert services["LighthouseService"][:2] == ["Quorum", "Heartbeat"]
    # torchft's methods first, in its order; ours (new RPCs only) after them
    assert services["ManagerService"] == ["Quorum", "CheckpointMetadata", "ShouldCommit", "Kill", "Events"]
    assert services["LighthouseService"] == ["Quorum", "Heartbeat", "SubscribeFailures", "GetConfig", "Lease"]


def test_requires_python_admits_no_version_the_code_cannot_run_on():
    """The code uses 3.11 APIs (asyncio.TaskGroup, asyncio.timeout): pip must not install it on 3.10."""
    import pathlib
    import tomllib  # itself new in 3.11

    pyproject = pathlib.Path(lighthouse.__file__).resolve().parent.parent / "pyproject.toml"
    assert tomllib.loads(pyproject.read_text())["project"]["requires-python"] == ">=3.11"
