"""The chaos run's command line: its flags, and the fault kinds left once every implementation is asked.

One schedule serves every implementation a run compares, so a kind that one
of them can't take (see ``_chaos_impls.unsupported_kinds``) is dropped for
all, and named with the reason; so is a kind this machine can't inject.
"""

from __future__ import annotations

import argparse

from benchmarks._chaos_faults import KINDS, Network
from benchmarks._chaos_impls import IMPLS, unsupported_kinds

__all__ = ["parse_args"]


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """The run's settings; ``description``: the --help text (the chaos script's docstring)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", default="torchft_lite",
                        help="comma-separated implementations to run the same schedule against, one after the "
                             f"other: {', '.join(IMPLS)} (default torchft_lite)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault schedule (default 1)")
    parser.add_argument("--faults", type=int, help="faults to inject, a mean --interval apart (default 200)")
    parser.add_argument("--interval", type=float, default=2.0, help="mean seconds between faults (default 2)")
    parser.add_argument("--fault-every", type=float, metavar="S",
                        help="a fault rate instead of --faults: one fault every S seconds of --duration")
    parser.add_argument("--duration", type=float, metavar="D", help="seconds of the chaos phase with --fault-every")
    parser.add_argument("--groups", type=int, default=3, help="replica groups (default 3)")
    parser.add_argument("--ranks", type=int, default=1, help="ranks per group, the same for all (default 1)")
    parser.add_argument("--pg", choices=["gloo", "baby-gloo"], default="gloo",
                        help="the groups' process group: gloo in the trainer, or in a child process (default gloo)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds to use (default {','.join(KINDS)})")
    parser.add_argument("--baseline", type=float, default=15.0,
                        help="fault-free seconds before the faults, and again once every group is back after "
                             "them: the baseline rate is over both (default 15)")
    parser.add_argument("--progress-timeout", type=float, default=120.0,
                        help="a live group must commit within this after the last fault (default 120)")
    parser.add_argument("--checkpoint-every", type=int, default=20,
                        help="with kill-all among the kinds, the groups save a durable checkpoint every this many "
                             "steps; 0: none, and no kill-all faults (default 20)")
    parser.add_argument("--kill-all-weight", type=float, default=1.0,
                        help="weight of kill-all in the draw of each fault's kind, each other kind weighing 1 "
                             "(default 1; 0 with --first-fault kill-all: exactly one)")
    parser.add_argument("--first-fault", choices=KINDS,
                        help="inject this kind first (tried until it can be), then the drawn ones")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless torchft_lite's efficiency is ahead of torchft's and it has no "
                             "divergent step (issue 19's goal; needs --impl torchft_lite,torchft)")
    parser.add_argument("--workdir", help="logs, reports and checkpoints, a folder per implementation "
                                          "(default: a temporary directory)")
    args = parser.parse_args(argv)
    args.impls = args.impl.split(",")
    if set(args.impls) - set(IMPLS) or len(set(args.impls)) != len(args.impls):
        parser.error(f"--impl: choose among {', '.join(IMPLS)}, each once (got {args.impl})")
    if (args.fault_every is None) != (args.duration is None):
        parser.error("--fault-every and --duration go together")
    if args.fault_every is not None and args.faults is not None:
        parser.error("give either --faults or --fault-every with --duration")
    if args.fault_every is not None and (args.fault_every <= 0 or args.duration < args.fault_every):
        parser.error("--fault-every must be > 0 and --duration at least one --fault-every")
    if args.faults is None and args.fault_every is None:
        args.faults = 200
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    if args.checkpoint_every < 0 or args.kill_all_weight < 0:
        parser.error("--checkpoint-every and --kill-all-weight must be >= 0")
    args.skipped_kinds = {}  # kind -> why it can't run here; in the summary, so no caller misses it
    if "kill-rank" in kinds and args.ranks < 2:
        kinds.remove("kill-rank")  # needs a group with more than one rank
    if "kill-all" in kinds and not args.checkpoint_every:
        kinds.remove("kill-all")  # with nothing on disk, a job that lost every copy starts over
    for impl in args.impls:  # one schedule for all: only the kinds every implementation can take
        for kind, why in unsupported_kinds(impl).items():
            if kind in kinds:
                kinds.remove(kind)
                args.skipped_kinds[kind] = f"{impl}: {why}"
    if "partition" in kinds:
        why = Network.unavailable(hostnames="torchft" in args.impls)
        if why:
            kinds.remove("partition")
            args.skipped_kinds["partition"] = why
    for kind, why in args.skipped_kinds.items():
        print(f"{kind} faults skipped: {why}", flush=True)
    if not kinds:
        parser.error("no fault kind left to inject (see the skipped kinds above)")
    if args.first_fault and args.first_fault not in kinds:
        parser.error(f"--first-fault {args.first_fault} is not among the kinds in use ({', '.join(kinds)})")
    if "kill-all" not in kinds:
        args.checkpoint_every = 0  # nothing would read them back
    args.kinds = kinds
    return args
