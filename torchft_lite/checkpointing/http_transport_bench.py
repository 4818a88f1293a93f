"""A small benchmark of HTTPTransport: publish a state dict of equal chunks and fetch it back over loopback.

Takes the flags of torchft's ``http_transport_bench`` (same names, same
defaults), so the two can be run side by side::

    python -m torchft_lite.checkpointing.http_transport_bench --total-size=1000000000 --num-chunks=4

``--chunk-size`` bytes per tensor (float32), ``--total-size`` bytes in all,
``--device`` where the tensors live, ``--num-chunks`` concurrent HTTP ranges
on the receiving side (0: one stream). Prints one JSON line of results, then
a human summary. A benchmark, not a test: figures on a shared machine are
noisy (see ``benchmarks/`` for the measured comparisons).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from datetime import timedelta
from typing import Sequence

import torch

from torchft_lite.checkpointing.http_transport import HTTPTransport

__all__ = ["main", "parse_args"]

logger = logging.getLogger(__name__)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-chunks", type=int, default=0,
                        help="HTTP ranges the receiver fetches at once (0: one stream)")
    parser.add_argument("--device", type=str, default="cpu", help="device of the state dict's tensors")
    parser.add_argument("--chunk-size", type=int, default=3_000_000, help="bytes per tensor (float32 elements x 4)")
    parser.add_argument("--total-size", type=int, default=12_000_000_000, help="bytes of the whole state dict")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for serving and receiving")
    args = parser.parse_args(argv)
    if args.chunk_size < 4 or args.total_size < 0 or args.num_chunks < 0 or args.timeout <= 0:
        parser.error("--chunk-size must be >= 4, --total-size and --num-chunks >= 0, --timeout > 0")
    return args


def _state_dict(chunk_size: int, total_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One float32 tensor of ``chunk_size // 4`` elements per ``chunk_size`` bytes of ``total_size``."""
    return {f"chunk/{offset}": torch.zeros(chunk_size // 4, dtype=torch.float32, device=device)
            for offset in range(0, total_size, chunk_size)}


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark with command-line ``argv`` (default: ``sys.argv[1:]``); returns the results."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    timeout = timedelta(seconds=args.timeout)
    device = torch.device(args.device)

    started = time.perf_counter()
    state_dict = _state_dict(args.chunk_size, args.total_size, device)
    created = time.perf_counter() - started
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in state_dict.values())
    logger.info("state dict of %d tensors, %d bytes on %s (created in %.3fs)", len(state_dict), nbytes, device,
                created)

    transport: HTTPTransport[dict[str, torch.Tensor]] = HTTPTransport(
        timeout, num_chunks=args.num_chunks, hostname="127.0.0.1", bind_host="127.0.0.1")
    try:
        started = time.perf_counter()
        transport.send_checkpoint(dst_ranks=[0], step=1, state_dict=state_dict, timeout=timeout)
        published = time.perf_counter() - started
        started = time.perf_counter()
        received = transport.recv_checkpoint(src_rank=0, metadata=transport.metadata(), step=1, timeout=timeout)
        fetched = time.perf_counter() - started
        if list(received) != list(state_dict):
            raise RuntimeError("the received state dict does not have the sent tensors")
        transport.disallow_checkpoint()
    finally:
        transport.shutdown()

    results = {"bytes": nbytes, "tensors": len(state_dict), "num_chunks": args.num_chunks, "device": str(device),
               "create_s": round(created, 6), "publish_s": round(published, 6), "fetch_s": round(fetched, 6),
               "fetch_mb_per_s": round(nbytes / max(fetched, 1e-9) / 1e6, 1)}
    print(json.dumps(results))
    print(f"fetched {nbytes / 1e6:.1f} MB in {len(state_dict)} tensors over {max(args.num_chunks, 1)} stream(s) "
          f"in {fetched:.3f}s ({results['fetch_mb_per_s']} MB/s); publishing took {published:.3f}s")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
