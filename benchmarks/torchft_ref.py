"""Load torchft's Rust extension (``torchft/_torchft*.so``) without importing torchft.

torchft's package ``__init__`` imports torch and OpenTelemetry; its native
extension (lighthouse, ManagerServer, ManagerClient, LighthouseClient) needs
neither. Loading the shared object as a top-level module gives the benchmarks
and the interop tests torchft's real implementation, started in milliseconds.

    python benchmarks/torchft_ref.py --bind 127.0.0.1:0 --min_replicas 2
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def find_extension() -> Path | None:
    """Path of torchft's native extension in this environment, or None."""
    spec = importlib.util.find_spec("torchft")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            candidate = Path(location) / f"_torchft{suffix}"
            if candidate.exists():
                return candidate
    return None


def load() -> ModuleType | None:
    """torchft's ``_torchft`` module, or None when torchft is not installed."""
    if "_torchft" in sys.modules:
        return sys.modules["_torchft"]
    path = find_extension()
    if path is None:
        return None
    loader = importlib.machinery.ExtensionFileLoader("_torchft", str(path))
    spec = importlib.util.spec_from_file_location("_torchft", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules["_torchft"] = module
    return module


def main() -> int:
    import argparse
    import signal
    import threading

    parser = argparse.ArgumentParser(description="run torchft's Rust lighthouse (flags as torchft_lighthouse)")
    parser.add_argument("--bind", default="[::]:29510")
    parser.add_argument("--min_replicas", type=int, required=True)
    parser.add_argument("--join_timeout_ms", type=int, default=60000)
    parser.add_argument("--quorum_tick_ms", type=int, default=100)
    parser.add_argument("--heartbeat_timeout_ms", type=int, default=5000)
    args = parser.parse_args()
    native = load()
    if native is None:
        print("torchft is not installed (pip install --no-deps torchft-nightly)", file=sys.stderr)
        return 1
    server = native.LighthouseServer(
        bind=args.bind, min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    print(f"Lighthouse listening on: {server.address()}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
