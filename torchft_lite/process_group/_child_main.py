"""The child side of a subprocess process group (see :mod:`torchft_lite.process_group.child_process`).

``python -m torchft_lite.process_group._child_main KIND FD``: FD is this end
of a socket pair to the parent. The parent first sends its multiprocessing
authentication key (raw bytes); this process answers ``("ready",)`` once torch
is imported and a first store client made (see :func:`_warm_up`). Then, any
number of times, ``("configure", generation, store, rank, world_size,
timeout_s, device)`` replaces the communicator and is answered
``("configured", generation)`` or ``("configure_failed", generation, type,
text)``; every ``("op", id, generation, name, tensors, args)`` is started at
once, in order, and a thread of that communicator waits for each and answers
``("done", id)`` or ``("error", id, type, text)``. When the socket closes (the
parent died, or killed us) the process exits at once, whatever it was doing.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import sys
import threading
import warnings
from datetime import timedelta
from typing import Any

# Run as __main__: named as it would be when imported.
logger = logging.getLogger("torchft_lite.process_group._child_main")


def _warm_up() -> None:
    """Pay c10d's once-per-process cost of a first store client now, while this child is a spare.

    The first TCPStore client of a process looks up a host name by address,
    and where reverse DNS is slow or unreachable (a container or network
    namespace without a resolver) that takes the resolver's whole timeout,
    ten seconds here: longer than a configure's rendezvous may take. Later
    clients skip it. A store on loopback is enough to take the hit.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=60)
    try:
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timeout)
        del client, server
    except Exception as exc:  # the real rendezvous will report what is wrong, if anything is
        logger.warning("warming up the store client failed: %s", exc)


def _build_backend(kind: str, store_addr: str, rank: int, world_size: int, timeout: timedelta,
                   device: int | None) -> Any:
    import torch

    from torchft_lite.process_group.store import connect_store, parse_store_addr

    store = connect_store(parse_store_addr(store_addr), timeout)
    if kind == "nccl":
        from torchft_lite.process_group.nccl import create_nccl_backend

        torch.cuda.set_device(device)
        return create_nccl_backend(store, rank, world_size, timeout, device)
    from torchft_lite.process_group.gloo import create_gloo_group

    return create_gloo_group(store, rank, world_size, timeout)


def _regroup(tensors: list, sizes: list[int]) -> list[list]:
    """The parent's tensor lists, from the flat list they travelled in."""
    groups, start = [], 0
    for size in sizes:
        groups.append(tensors[start:start + size])
        start += size
    if start != len(tensors):
        raise ValueError(f"{len(tensors)} tensors do not make lists of sizes {sizes}")
    return groups


def _start_op(backend: Any, name: str, tensors: list, args: dict[str, Any]) -> Any:
    """Start one operation on ``backend``; its c10d Work."""
    from torch.distributed import ReduceOp
    from torch.distributed.distributed_c10d import (
        AllgatherOptions,
        AllreduceCoalescedOptions,
        AllreduceOptions,
        AllToAllOptions,
        BarrierOptions,
        BroadcastOptions,
        ReduceScatterOptions,
    )

    def options(factory: Any) -> Any:
        opts = factory()
        if args.get("timeout", -1) >= 0:
            opts.timeout = timedelta(seconds=args["timeout"])
        if "op" in args:
            opts.reduceOp = getattr(ReduceOp, args["op"])
        return opts

    groups = _regroup(tensors, args["sizes"])
    if name == "allreduce":
        return backend.allreduce(groups[0], options(AllreduceOptions))
    if name == "allreduce_coalesced":
        return backend.allreduce_coalesced(groups[0], options(AllreduceCoalescedOptions))
    if name == "broadcast":
        opts = options(BroadcastOptions)
        opts.rootRank, opts.rootTensor = args["root"], args["root_tensor"]
        return backend.broadcast(groups[0], opts)
    if name == "allgather":
        return backend.allgather(groups[1:], groups[0], options(AllgatherOptions))
    if name == "allgather_into_tensor_coalesced":
        return backend.allgather_into_tensor_coalesced(groups[0], groups[1], options(AllgatherOptions))
    if name == "alltoall_base":
        output, input_ = groups[0]
        return backend.alltoall_base(output, input_, args["output_splits"], args["input_splits"],
                                     options(AllToAllOptions))
    if name == "barrier":
        return backend.barrier(options(BarrierOptions))
    if name == "reduce_scatter":
        return backend.reduce_scatter(groups[0], groups[1:], options(ReduceScatterOptions))
    if name == "reduce_scatter_tensor_coalesced":
        return backend.reduce_scatter_tensor_coalesced(groups[0], groups[1], options(ReduceScatterOptions))
    if name == "send":
        return backend.send(groups[0], args["peer"], args["tag"])
    if name == "recv":
        return backend.recv(groups[0], args["peer"], args["tag"])
    raise ValueError(f"unknown operation {name!r}")


def _answer_in_order(conn: multiprocessing.connection.Connection, send_lock: threading.Lock,
                     started: queue.Queue, device: int | None) -> None:
    """Wait for each operation of one communicator in turn and tell the parent how it ended.

    A ``None`` in the queue ends the thread: a newer communicator replaced
    this one. Its backend is released here, after the operations already
    started (a gloo backend's destructor waits for them).
    """
    import torch

    if device is not None:
        torch.cuda.set_device(device)  # the current device is per thread: NCCL's streams are on this one
    old_backend = None
    while True:
        item = started.get()
        if isinstance(item, tuple) and item[0] == "release":
            old_backend = item[1]  # replaced: destroyed below, after the operations before it, not on the main loop
            continue
        if item is None:
            del old_backend  # a gloo backend's destructor waits for its operations: this thread's to wait
            return
        op_id, work, tensors = item
        try:
            if isinstance(work, BaseException):
                raise work
            work.wait()
            if device is not None:
                torch.cuda.current_stream(device).synchronize()  # the parent reads the results once told
            answer: tuple = ("done", op_id)
        except BaseException as exc:  # reported to the parent, which kills this process
            answer = ("error", op_id, type(exc).__name__, _first_line(exc))
        del work, tensors, item  # unmap the parent's memory before saying done
        try:
            with send_lock:
                conn.send(answer)
        except OSError:
            os._exit(0)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def main(argv: list[str]) -> None:
    kind, fd = argv[0], int(argv[1])
    logging.basicConfig(level=logging.WARNING, format=f"[torchft_lite {kind} subprocess %(process)d] %(message)s")
    conn = multiprocessing.connection.Connection(fd)
    multiprocessing.current_process().authkey = conn.recv_bytes(1024)
    # torch warns at import when numpy is missing; the parent has shown it already, once per child is noise
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch.multiprocessing  # noqa: F401  (tensors arrive as shared memory / CUDA IPC handles)

    _warm_up()
    send_lock = threading.Lock()
    conn.send(("ready",))
    backend: Any = None
    generation = 0
    started: queue.Queue | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the parent is gone or dropped us: a collective still running must not keep us alive
        if message[0] == "configure":
            _, new_generation, store_addr, rank, world_size, timeout_s, device = message
            if started is not None:  # the old communicator's thread finishes its operations and releases it
                started.put(("release", backend))
                started.put(None)
            backend, started, generation = None, None, new_generation
            try:
                backend = _build_backend(kind, store_addr, rank, world_size, timedelta(seconds=timeout_s), device)
            except BaseException as exc:
                answer: tuple = ("configure_failed", generation, type(exc).__name__, _first_line(exc))
            else:
                started = queue.Queue()
                threading.Thread(target=_answer_in_order, args=(conn, send_lock, started, device),
                                 name=f"answers-{generation}", daemon=True).start()
                answer = ("configured", generation)
            with send_lock:
                conn.send(answer)
            continue
        if message[0] == "set_timeout":
            if backend is not None and hasattr(backend, "set_timeout"):
                backend.set_timeout(timedelta(seconds=message[1]))
            continue
        _, op_id, op_generation, name, tensors, args = message
        if op_generation != generation or started is None:
            with send_lock:
                conn.send(("error", op_id, "RuntimeError", f"{name} is for communicator {op_generation}, which "
                                                            f"this process no longer holds"))
            continue
        try:
            work: Any = _start_op(backend, name, tensors, args)
        except BaseException as exc:
            work = exc
        started.put((op_id, work, tensors))
        del work, tensors, message


if __name__ == "__main__":
    main(sys.argv[1:])
