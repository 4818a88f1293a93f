"""heal_bench's conclusions: ours-default is judged against the best raw stream count (the multi-stream
ceiling), not one stream, and against torchft's best case."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks._heal_report import summary


def case(name: str, vs_tcp: float, gbps: float = 1.0) -> dict:
    return {"case": name, "gbps": gbps, "vs_tcp": vs_tcp, "first_vs_tcp": vs_tcp, "repeated_vs_tcp": vs_tcp,
            "server_peak_extra_x": 0.0, "receiver_peak_extra_x": 1.0, "cpu_s_per_gib": {"server": 0, "receiver": 0},
            "seconds": [1.0], "send_s": []}


def result_of(**cases: float) -> dict:
    results = {name.replace("_", "-"): case(name.replace("_", "-"), value) for name, value in cases.items()}
    return summary(results, SimpleNamespace(size_mb=64, tensor_mb=4, steps=1, receiver="lean"), [])


def test_the_multi_stream_ceiling_is_the_best_raw_stream_count():
    result = result_of(tcp=1.0, tcp_2=1.6, tcp_4=2.0, tcp_8=1.8, tcp_sum64=0.9, ours_default=1.3, torchft_8=1.2)
    view = result["default"]["all_steps"]
    assert view["multi_stream_case"] == "tcp-4" and view["vs_multi_stream"] == 0.65
    assert view["torchft_case"] == "torchft-8" and view["vs_torchft"] == round(1.3 / 1.2, 3)
    assert result["targets_met_default"]["vs_multi_stream_ge_0.6"] is True
    assert result["targets_met_default"]["all_steps_vs_torchft_ge_1.0"] is True


def test_with_one_stream_only_the_ceiling_is_that_stream():
    result = result_of(tcp=1.0, ours_default=0.5, torchft_4=0.6)
    view = result["default"]["all_steps"]
    assert view["multi_stream_case"] == "tcp" and view["vs_multi_stream"] == 0.5
    assert result["targets_met_default"]["vs_multi_stream_ge_0.6"] is False
    assert result["targets_met_default"]["all_steps_vs_torchft_ge_1.0"] is False
