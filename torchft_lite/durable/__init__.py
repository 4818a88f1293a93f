"""Durable checkpoints and whole-job resume (ours; torchft leaves this to the trainer).

``DurableCheckpointer(manager, directory, every=N, keep_last=K)`` saves the
Manager's state (every registered state dict fn and the Manager's step) plus
each rank's RNG states and registered local state every N committed steps,
written by one replica group in the background, in the heal format; and
``resume()`` loads the newest complete checkpoint that reads back intact.

Where things live::

    checkpointer.py   DurableCheckpointer: when to save, the snapshot, the writer thread, preemption
    _resume.py        Resumer: find, check (every byte, and that it fits the model), then load
    _layout.py        the directory layout, manifests, which checkpoints are complete, pruning
    _files.py         one state dict in one file (atomic write, verified read)
    _sharded.py       DTensor state: each rank writes its shard; a resume needs the layout it was written with
    _rng.py           torch / CUDA / Python / NumPy generator states as plain data
"""

from torchft_lite.durable._layout import CheckpointInfo
from torchft_lite.durable.checkpointer import DurableCheckpointer, DurableCheckpointStatistics, read_checkpoint

__all__ = ["CheckpointInfo", "DurableCheckpointStatistics", "DurableCheckpointer", "read_checkpoint"]
