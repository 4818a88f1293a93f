"""DiLoCo benchmark: what syncing every H steps saves over a slow link between replica groups, and what it costs.

Two replica groups (one process each, CPU, gloo, a real lighthouse on
127.0.0.1) train ``examples/train_diloco.py``'s model (an MLP of width
``--hidden``) on its synthetic task for the same number of inner steps
(``--steps``) in every case:

* ``ddp``: gradients averaged every step (torchft_lite's DDP), over the slow link;
* ``ddp-fast-link``: the same with no limit on the link (loopback gloo): the
  ceiling the slow link is measured against;
* ``diloco-H``: DiLoCo syncing every H inner steps, for H in ``--sync-every``
  (inner AdamW, outer Nesterov SGD at lr 0.7);
* ``diloco-H-q``: the largest H with ``should_quantize=True`` (8-bit
  pseudo-gradients); when the flag has no effect or raises, the row says so.

The slow link is modelled inside the reduction, not with ``tc`` (which needs
root and a veth pair): ``examples/slow_link.MeteredLink`` wraps each group's
process group, counts the bytes every collective puts on the wire as a ring
algorithm sends them, and completes each collective no earlier than a link
of ``--link-mb-per-s`` and ``--link-latency-ms`` would deliver it, one
collective after another (``--link-mb-per-s 0``: no limit).

Reported per case: bytes one rank sent to the other group, wall time from
the moment both groups train to the moment the last one is done (process
start-up excluded), the loss on held-out data with the final global
parameters (the same in both groups), and ratios against ``ddp``. There is
no torchft row (``TORCHFT_NOTE`` says why).

    python benchmarks/diloco_bench.py
    python -m benchmarks.diloco_bench --steps 100 --sync-every 10,50 --hidden 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup  # noqa: E402

SCRIPT = REPO / "examples" / "train_diloco.py"
TORCHFT_NOTE = ("not run: torchft's Manager treats a process group that is not an instance of its own "
                "ProcessGroup differently (no set_rank_info; errors read from the c10d backend), so the metered "
                "link would need a second wrapper built on torchft's ProcessGroupWrapper, which this benchmark "
                "does not have yet; torchft's quantized reduction needs CUDA and Triton")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="inner steps per case (default 600)")
    parser.add_argument("--sync-every", default="10,50,100", help="DiLoCo's H, comma-separated (default 10,50,100)")
    parser.add_argument("--hidden", type=int, default=512, help="MLP width; 512 is 0.55 M parameters, 2.2 MB "
                        "(default 512)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-group batch size (default 32)")
    parser.add_argument("--link-mb-per-s", type=float, default=100.0, help="modelled link bandwidth between the "
                        "groups, MB/s; 0: no limit (default 100)")
    parser.add_argument("--link-latency-ms", type=float, default=10.0, help="modelled one-way latency (default 10)")
    parser.add_argument("--no-quantized", action="store_true", help="leave out the quantized case")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a case may take (default 300)")
    parser.add_argument("--json", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    try:
        args.sync_values = [int(h) for h in args.sync_every.split(",") if h.strip()]
    except ValueError:
        parser.error(f"--sync-every takes integers separated by commas, got {args.sync_every!r}")
    if not args.sync_values or min(args.sync_values) < 1 or args.steps < 1:
        parser.error("--steps and every --sync-every value must be >= 1")
    if any(args.steps % h for h in args.sync_values):
        parser.error(f"--steps {args.steps} must be a multiple of every --sync-every value, so every case trains "
                     f"the same number of inner steps")
    if args.link_mb_per_s < 0 or args.link_latency_ms < 0:
        parser.error("--link-mb-per-s and --link-latency-ms must be >= 0")
    return args


def cases(args: argparse.Namespace) -> list[tuple[str, list[str], bool]]:
    """(name, the example's flags, whether the slow link applies)."""
    found = [("ddp", ["--ddp"], True), ("ddp-fast-link", ["--ddp"], False)]
    found += [(f"diloco-{h}", ["--sync-every", str(h)], True) for h in args.sync_values]
    if not args.no_quantized:
        h = max(args.sync_values)
        found.append((f"diloco-{h}-q", ["--sync-every", str(h), "--quantize"], True))
    return found


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_case(name: str, flags: list[str], slow: bool, args: argparse.Namespace, workdir: Path) -> dict:
    """Both groups of one case, each to its ``done`` line; the case's figures, or why it has none."""
    case_dir = workdir / name
    case_dir.mkdir()
    report = case_dir / "report.jsonl"
    link = ["--link-mb-per-s", str(args.link_mb_per_s), "--link-latency-ms", str(args.link_latency_ms)] \
        if slow and args.link_mb_per_s > 0 else []
    script_args = ["--steps", str(args.steps), "--hidden", str(args.hidden), "--batch-size", str(args.batch_size),
                   "--min-replicas", "2", "--report", str(report), *link, *flags]
    lighthouse = LighthouseProcess(min_replicas=2, join_timeout=60.0, startup_grace=0.0,
                                   log_path=case_dir / "lighthouse.log").start()
    groups = [ReplicaGroup(g, 2, lighthouse.address, SCRIPT, script_args, log_dir=case_dir) for g in range(2)]
    try:
        for group in groups:
            group.start()
        codes = [group.wait(args.timeout) for group in groups]
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()
    done = [r for r in read_rows(report) if r["event"] == "done"]
    if codes != [[0], [0]] or len(done) != 2:
        logs = sorted(case_dir.glob("group*.log"))
        tail = logs[0].read_text(errors="replace").strip().splitlines()[-1:] if logs else []
        return {"case": name, "error": f"exit codes {codes}; group 0 said: {tail[0] if tail else 'nothing'}"}
    syncs = [r for r in read_rows(report) if r["event"] == "sync" and r["group"] == 0]
    return {"case": name, "link_limited": bool(link), "inner_steps": done[0]["inner_steps"],
            "syncs": len(syncs), "bytes_per_rank": statistics.mean(r["bytes_sent"] for r in done),
            "collectives_per_rank": statistics.mean(r["collectives"] for r in done),
            "wall_s": max(r["time"] for r in done) - max(r["loop_start"] for r in done),
            "eval_loss": done[0]["eval_loss"], "groups_agree": done[0]["eval_loss"] == done[1]["eval_loss"]}


def summarise(rows: list[dict], args: argparse.Namespace) -> dict:
    """Ratios against ``ddp``, and whether the quantized case did quantize."""
    base = next((r for r in rows if r["case"] == "ddp" and "error" not in r), None)
    for r in rows:
        if "error" in r or base is None:
            continue
        r["bytes_vs_ddp"] = round(r["bytes_per_rank"] / base["bytes_per_rank"], 4) if base["bytes_per_rank"] else None
        r["speedup_vs_ddp"] = round(base["wall_s"] / r["wall_s"], 2)
        r["loss_vs_ddp"] = round(r["eval_loss"] / base["eval_loss"], 3)
    for r in rows:
        if r["case"].endswith("-q") and "error" not in r:
            plain = next((p for p in rows if p["case"] == r["case"][:-2] and "error" not in p), None)
            if plain is not None and r["bytes_per_rank"] >= 0.9 * plain["bytes_per_rank"]:
                r["note"] = "should_quantize had no effect on the bytes sent (quantized reduction not available)"
    return {"bench": "diloco", "steps": args.steps, "hidden": args.hidden, "batch_size": args.batch_size,
            "link_mb_per_s": args.link_mb_per_s or None, "link_latency_ms": args.link_latency_ms,
            "link_model": "delay inside the reduction (examples/slow_link.py), not tc", "rows": rows,
            "torchft": TORCHFT_NOTE}


def print_report(result: dict) -> None:
    link = f"{result['link_mb_per_s']:g} MB/s + {result['link_latency_ms']:g} ms" if result["link_mb_per_s"] \
        else "no limit"
    print(f"2 groups x 1 rank, CPU gloo; MLP width {result['hidden']}, {result['steps']} inner steps, batch "
          f"{result['batch_size']}; modelled link between groups: {link}")
    header = (f"{'case':<16}{'syncs':>6}{'MB sent/rank':>13}{'x ddp':>8}{'wall s':>8}{'speedup':>8}"
              f"{'held-out loss':>14}{'x ddp':>7}")
    print(header)
    print("-" * len(header))
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['case']:<16} not available: {r['error']}")
            continue
        print(f"{r['case']:<16}{r['syncs']:>6}{r['bytes_per_rank'] / 1e6:>13.2f}{r.get('bytes_vs_ddp', 0):>8.3f}"
              f"{r['wall_s']:>8.1f}{r.get('speedup_vs_ddp', 0):>8.2f}{r['eval_loss']:>14.5f}"
              f"{r.get('loss_vs_ddp', 0):>7.2f}" + (f"   {r['note']}" if r.get("note") else "")
              + ("" if r["link_limited"] or not result["link_mb_per_s"] else "   (no link limit)"))
    print(f"torchft: {result['torchft']}")
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="diloco_bench_") as workdir:
        rows = [run_case(name, flags, slow, args, Path(workdir)) for name, flags, slow in cases(args)]
        result = summarise(rows, args)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
