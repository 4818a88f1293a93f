"""Regenerate the Python gRPC code in this folder from ``proto/torchft.proto``.

Run ``make proto`` (or ``python -m torchft_lite.rpc.protocol.generate``). With
``--check`` nothing is written: it exits 1 and names the files that differ
when the committed code is stale against ``proto/``.

The generated modules live in ``torchft_lite.rpc``, the torch-free layer under both, so the
lighthouse and ``torchft_lite`` import the same code without pulling torch.
protoc writes ``import torchft_pb2`` as a top-level import; we rewrite it to a
relative one so the modules work inside this package.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PROTO_DIR = REPO / "proto"
PROTO_FILE = "torchft.proto"
GENERATED = ("torchft_pb2.py", "torchft_pb2.pyi", "torchft_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Run protoc on ``proto/torchft.proto`` writing into ``out_dir``."""
    try:
        from grpc_tools import protoc  # dev dependency only
    except ImportError as exc:
        raise SystemExit(
            "grpcio-tools is not installed; install the dev extras: pip install -e '.[dev]'"
        ) from exc
    import importlib.resources

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / PROTO_FILE),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    grpc_file = out_dir / "torchft_pb2_grpc.py"
    text = grpc_file.read_text()
    text = text.replace("import torchft_pb2 as", "from . import torchft_pb2 as")
    grpc_file.write_text(text)


def stale_files() -> list[str]:
    """Names of generated files whose committed text differs from a fresh run."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        generate(tmp_dir)
        stale = []
        for name in GENERATED:
            fresh = (tmp_dir / name).read_text()
            current_path = HERE / name
            current = current_path.read_text() if current_path.exists() else ""
            if fresh != current:
                diff = difflib.unified_diff(
                    current.splitlines(), fresh.splitlines(), f"committed/{name}", f"fresh/{name}", lineterm="", n=1
                )
                stale.append(name + "\n" + "\n".join(list(diff)[:40]))
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report whether the committed code is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for entry in stale:
            print(f"stale: {entry}", file=sys.stderr)
        return 1 if stale else 0
    generate(HERE)
    print(f"regenerated {', '.join(GENERATED)} in {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
