"""Heal copies on the recovery stream: GPU state served and received through pinned host memory."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from torchft_lite.checkpointing import HTTPTransport
from torchft_lite.serialization import cuda, decode, encode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]

LONG = timedelta(seconds=120)


def heal(source: dict, local: dict, step: int, num_chunks: int | None = None) -> dict:
    """Send ``source`` as ``step`` over HTTP on loopback and receive it in place into ``local``."""
    chunks = {} if num_chunks is None else {"num_chunks": num_chunks}
    server = HTTPTransport(LONG, hostname="127.0.0.1", bind_host="127.0.0.1")
    client = HTTPTransport(LONG, hostname="127.0.0.1", bind_host="127.0.0.1", state_dict=lambda: local, **chunks)
    try:
        server.send_checkpoint([1], step, source, LONG)
        received = client.recv_checkpoint(0, server.metadata(), step, LONG)
        server.disallow_checkpoint()
    finally:
        server.shutdown()
        client.shutdown()
    return received


def test_to_host_sees_work_queued_before_it_and_uses_pinned_buffers():
    tensor = torch.ones(1 << 22, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the current stream busy, then change the tensor at its end
        big = big @ big / 4096
    tensor.mul_(3)
    (host,) = cuda.to_host([tensor])
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, torch.full((1 << 22,), 3.0))
    assert cuda.recovery_stream(tensor.device) != torch.cuda.current_stream()


def test_to_device_fills_targets_and_returns_when_the_copies_are_done():
    target = torch.zeros(1 << 22, device="cuda")
    buffer = cuda.host_buffer(target)
    assert buffer.is_pinned()
    buffer.fill_(7.0)
    cuda.to_device([(buffer, target)])
    assert torch.equal(target.cpu(), torch.full((1 << 22,), 7.0))


def test_an_http_heal_of_gpu_state_lands_in_the_gpu_targets():
    source = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(4096, device="cuda").bfloat16(),
              "step": 3}
    local = {"w": torch.zeros(1024, 1024, device="cuda"), "b": torch.zeros(4096, device="cuda").bfloat16(),
             "step": 0}
    received = heal(source, local, 3)
    assert received["w"] is local["w"] and torch.equal(local["w"], source["w"])
    assert received["b"] is local["b"] and torch.equal(local["b"], source["b"])
    assert received["step"] == 3


def test_encode_reads_gpu_tensors_through_the_recovery_stream():
    state = {"w": torch.arange(10, dtype=torch.float32, device="cuda")}
    step, decoded = decode.decode_bytes(encode.encode_to_bytes(1, state))
    assert step == 1 and torch.equal(decoded["w"], torch.arange(10, dtype=torch.float32))


def test_a_heal_into_gpu_targets_goes_through_the_staging_ring_not_a_host_copy_per_tensor(monkeypatch):
    # 256 MiB of GPU state through the ring of pinned slots (torchft_lite.serialization.staging): the
    # receiver pins the ring once, never a host buffer per tensor, and the targets hold the sender's bytes.
    from torchft_lite.serialization import decode, staging

    def per_tensor_buffer(target):
        raise AssertionError(f"a pinned host buffer of {tuple(target.shape)} was allocated for a GPU target")

    monkeypatch.setattr(decode._cuda, "host_buffer", per_tensor_buffer)
    source = {f"w{i}": torch.randn(16 << 20, device="cuda") for i in range(4)}
    source["step"] = 5
    local = {f"w{i}": torch.zeros(16 << 20, device="cuda") for i in range(4)}
    local["step"] = 0
    received = heal(source, local, 5, num_chunks=4)
    for i in range(4):
        assert received[f"w{i}"] is local[f"w{i}"] and torch.equal(local[f"w{i}"], source[f"w{i}"])
    ring = staging.pinned_ring()
    assert ring.free() == ring.slots  # every slot came back
