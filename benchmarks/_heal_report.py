"""What ``heal_bench`` concludes from its cases: the ratios its targets are judged on, the table, the JSON line.

Every case arrives as a dict with its paired ratios to the raw TCP step run
right after each of its steps: ``vs_tcp`` (the median over all steps),
``first_vs_tcp`` (the first transfer, into a receiver process that never
received) and ``repeated_vs_tcp`` (the median over the steps after it).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

__all__ = ["TLS_SUFFIX", "print_report", "summary"]

TLS_SUFFIX = "+tls"
DEFAULT_CASE = "ours-default"
"""``HTTPTransport(timeout)`` and ``recv_checkpoint`` with torchft's arguments: fresh tensors, our defaults."""
VIEWS = (("all_steps", "vs_tcp"), ("first_transfer", "first_vs_tcp"), ("repeated", "repeated_vs_tcp"))


def _best(values: dict, keep: Callable[[str], bool]) -> tuple[str | None, float | None]:
    """The case (and its value) with the highest value among those ``keep`` accepts."""
    return max(((c, v) for c, v in values.items() if keep(c) and v is not None), key=lambda cv: cv[1],
               default=(None, None))


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _at_least(value: float | None, floor: float) -> bool | None:
    return None if value is None else value >= floor


def _raw_tcp(case: str) -> bool:
    """One raw stream (``tcp``) or several (``tcp-N``): the candidates for the multi-stream ceiling."""
    return case == "tcp" or re.fullmatch(r"tcp-\d+", case) is not None


def _default_view(views: dict[str, dict[str, float | None]]) -> tuple[dict, dict]:
    """Our defaults (fresh tensors) against torchft's best case and the multi-stream ceiling in each view, and
    the goals: the recovery-speed issue's three, and the scaling issue's (all steps >= torchft's best, >= 0.6 of
    the best raw stream count)."""
    report: dict[str, Any] = {"case": DEFAULT_CASE}
    for view, paired in views.items():
        theirs, theirs_paired = _best(paired, lambda c: c.startswith("torchft"))
        ceiling, ceiling_paired = _best(paired, _raw_tcp)
        report[view] = {"vs_tcp": paired.get(DEFAULT_CASE), "torchft_case": theirs, "torchft_vs_tcp": theirs_paired,
                        "vs_torchft": _ratio(paired.get(DEFAULT_CASE), theirs_paired),
                        "multi_stream_case": ceiling, "vs_multi_stream": _ratio(paired.get(DEFAULT_CASE),
                                                                                ceiling_paired)}
    targets = {"first_vs_torchft_ge_1.5": _at_least(report["first_transfer"]["vs_torchft"], 1.5),
               "repeated_vs_torchft_ge_1.0": _at_least(report["repeated"]["vs_torchft"], 1.0),
               "vs_loopback_ge_0.5": _at_least(report["all_steps"]["vs_tcp"], 0.5),
               "all_steps_vs_torchft_ge_1.0": _at_least(report["all_steps"]["vs_torchft"], 1.0),
               "vs_multi_stream_ge_0.6": _at_least(report["all_steps"]["vs_multi_stream"], 0.6)}
    return report, targets


def summary(results: dict, args: Any, skipped: list[str]) -> dict:
    """The ratios the targets are judged on, over all steps, for the first transfer alone, and for the rest.

    Every ratio divides two cases' ``vs_tcp`` (each step against the raw TCP
    step run right after it), not their GB/s medians, which were measured
    minutes apart; the GB/s ratios are reported too, under ``gbps_ratios``.
    "ours" is our best HTTP case receiving in place: how the Manager heals by
    default (the ceiling's receiver, too, writes into memory it already
    holds). Allocating receives are reported apart, and ``default`` is
    ``ours-default`` (``HTTPTransport(timeout)``, fresh tensors: torchft's API
    with our defaults) against torchft's best case in the same view.

    Three views: the median over every step, the first transfer alone (a
    receiver process that never received, as a restarted replica healing; an
    allocating receiver pays for the first touch of every fresh page, which
    is slow in this VM), and the median of the steps after the first (an
    allocating receiver may then reuse memory it freed).
    """
    gbps = {case: r["gbps"] for case, r in results.items()}
    tls_vs_plain = {case: _ratio(r["vs_tcp"], results[case.removesuffix(TLS_SUFFIX)]["vs_tcp"])
                    for case, r in results.items() if case.endswith(TLS_SUFFIX) and case.removesuffix(TLS_SUFFIX)
                    in results}
    views = {view: {case: r.get(key) for case, r in results.items()} for view, key in VIEWS}
    plain_views = {view: {case: v for case, v in paired.items() if not case.endswith(TLS_SUFFIX)}
                   for view, paired in views.items()}
    plain = {case: r for case, r in results.items() if not case.endswith(TLS_SUFFIX)}  # the targets are plain text
    receiver_x = max((r["receiver_peak_extra_x"] for c, r in plain.items() if c.startswith("ours")), default=None)
    ratios, targets = {}, {}
    for view, paired in plain_views.items():
        ours, ours_paired = _best(paired, lambda c: c.startswith("ours") and c.endswith("inplace"))
        allocating, allocating_paired = _best(paired, lambda c: c.startswith("ours") and not c.endswith("inplace"))
        theirs, theirs_paired = _best(paired, lambda c: c.startswith("torchft"))
        pg, pg_paired = _best(paired, lambda c: c.startswith("pg-ours"))
        vs_loopback, vs_torchft = ours_paired, _ratio(ours_paired, theirs_paired)
        ratios[view] = {"ours_case": ours, "torchft_case": theirs,
                        "ours_vs_loopback": vs_loopback, "ours_vs_torchft": vs_torchft,
                        "ours_vs_checked_loopback": _ratio(ours_paired, paired.get("tcp-sum64")),
                        "ours_allocating_vs_loopback": allocating_paired,
                        "ours_allocating_vs_torchft": _ratio(allocating_paired, theirs_paired),
                        "pg_ours_vs_gloo": _ratio(pg_paired, paired.get("pg-gloo"))}
        targets[view] = {
            "http_vs_loopback_ge_0.75": _at_least(vs_loopback, 0.75),
            "http_vs_torchft_ge_1.5": _at_least(vs_torchft, 1.5),
            "receiver_peak_extra_le_1.1x": None if receiver_x is None else receiver_x <= 1.1,
        }
    default, default_targets = _default_view(plain_views)
    main_view = ratios["all_steps"]
    return {"bench": "heal", "size_mb": args.size_mb, "tensor_mb": args.tensor_mb, "steps": args.steps,
            "receiver": args.receiver,
            "gbps": gbps, "vs_tcp": views["all_steps"], "first_vs_tcp": views["first_transfer"],
            "repeated_vs_tcp": views["repeated"], **main_view,
            "first_transfer": ratios["first_transfer"], "repeated": ratios["repeated"],
            "default": default, "targets_met_default": default_targets,
            "gbps_ratios": {"ours_vs_loopback": _ratio(gbps.get(main_view["ours_case"]), gbps["tcp"]),
                            "ours_vs_torchft": _ratio(gbps.get(main_view["ours_case"]),
                                                      gbps.get(main_view["torchft_case"]))},
            "peak_extra_x": {c: {"server": r["server_peak_extra_x"], "receiver": r["receiver_peak_extra_x"]}
                             for c, r in results.items()},
            "cpu_s_per_gib": {c: r["cpu_s_per_gib"] for c, r in results.items()},
            "device": getattr(args, "device", "cpu"), "seconds": {c: r["seconds"] for c, r in results.items()},
            "send_s": {c: r.get("send_s", []) for c, r in results.items()},
            "skipped": skipped, "tls_vs_plain": tls_vs_plain, "targets_met": targets["all_steps"],
            "targets_met_first_transfer": targets["first_transfer"]}


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_report(results: dict, result: dict, receiver: str) -> None:
    """The table (one line per case), the lines of ratios, then the JSON line last."""
    print(f"{'case':<22}{'GB/s':>7}{'vs tcp':>8}{'1st vs tcp':>11}{'rep vs tcp':>11}{'extra x (srv/rcv)':>19}"
          f"{'CPU s/GiB (srv/rcv)':>21}   seconds per step")
    for r in results.values():
        extra = f"{r['server_peak_extra_x']:.3f}/{r['receiver_peak_extra_x']:.3f}"
        cpu = f"{r['cpu_s_per_gib']['server']:.2f}/{r['cpu_s_per_gib']['receiver']:.2f}"
        steps = r["seconds"] if len(r["seconds"]) <= 10 else f"{r['seconds'][:10]} and {len(r['seconds']) - 10} more"
        print(f"{r['case']:<22}{r['gbps']:>7.3f}{_shown(r['vs_tcp']):>8}{_shown(r['first_vs_tcp']):>11}"
              f"{_shown(r.get('repeated_vs_tcp')):>11}{extra:>19}{cpu:>21}   {steps}")
    first = result["first_transfer"]
    print(f"all steps: ours vs loopback {result['ours_vs_loopback']} (GB/s medians: "
          f"{result['gbps_ratios']['ours_vs_loopback']}; vs checked loopback {result['ours_vs_checked_loopback']}), "
          f"vs torchft {result['ours_vs_torchft']} (GB/s medians: {result['gbps_ratios']['ours_vs_torchft']}); "
          f"allocating: {result['ours_allocating_vs_loopback']} / {result['ours_allocating_vs_torchft']}; "
          f"PG vs plain gloo {result['pg_ours_vs_gloo']}")
    print(f"first transfer (a fresh receiver, as a restarted replica): ours vs loopback {first['ours_vs_loopback']}, "
          f"vs torchft {first['ours_vs_torchft']}; allocating: {first['ours_allocating_vs_loopback']} / "
          f"{first['ours_allocating_vs_torchft']}; PG vs plain gloo {first['pg_ours_vs_gloo']}")
    default = result["default"]
    if default["all_steps"]["vs_tcp"] is not None:
        print(f"{DEFAULT_CASE} (HTTPTransport(timeout), fresh tensors) vs torchft's best: "
              + "; ".join(f"{view.replace('_', ' ')} {default[view]['vs_torchft']} (vs {default[view]['torchft_case']}"
                          f"), {default[view]['vs_tcp']} of loopback, {default[view]['vs_multi_stream']} of the "
                          f"multi-stream ceiling ({default[view]['multi_stream_case']})" for view, _ in VIEWS)
              + f"; goals met: {result['targets_met_default']}")
    print(f"ours is the best in-place case, as the Manager heals; our receiver heals through the {receiver} "
          f"HTTP client")
    if result["tls_vs_plain"]:
        print("TLS on vs off (each +tls case's vs tcp over its plain twin's; 1.0 = free): "
              + ", ".join(f"{case} {ratio}" for case, ratio in result["tls_vs_plain"].items()))
    print(json.dumps(result))
