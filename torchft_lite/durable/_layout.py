"""Where a durable checkpoint's files live, its manifest, and which checkpoints are complete.

::

    DIR/step-000000000100/           a complete checkpoint (it appears whole, by a rename)
        MANIFEST.json                step, writer, files with sizes and digests (written last)
        state-r0.tft, state-r1.tft   each rank's state (every registered state dict fn + the Manager's)
                                     (state-r0.tft alone with replicated_in_group=True)
    DIR/.staging-000000000100-ID/    the writing group's files while they are written (ID: its replica id)
    DIR/local/step-000000000100/     rank-local state, one small file per (group, rank):
        GROUP-r0.tft                 RNG states, registered local state (data position), watchdog calibration

A checkpoint is complete only when ``step-N/MANIFEST.json`` exists and reads
back: the writing group assembles everything in its staging directory, its
group rank 0 writes the manifest there last, then renames the directory to
``step-N`` and fsyncs ``DIR``. Anything else (a staging directory, a step
directory without a manifest, ``*.tmp``) is an interrupted write, ignored by
readers and removed by :func:`prune`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchft_lite.durable._files import FileRecord, write_bytes_atomically
from torchft_lite.errors import DurableCheckpointError

__all__ = ["CheckpointInfo", "Layout", "MANIFEST", "read_manifest"]

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "torchft_lite.durable/1"
_STEP_DIR = re.compile(r"^step-(\d{12})$")
_STAGING_DIR = re.compile(r"^\.staging-(\d{12})-")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(text: str) -> str:
    """``text`` usable as a file name (replica ids hold ':' and may hold '/')."""
    return _UNSAFE.sub("_", text)[:120] or "_"


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint, as its manifest describes it."""

    step: int
    path: Path
    writer: str
    """The replica id of the group that wrote it."""
    writer_group: str
    """Its stable group name (for its rank-local files)."""
    group_world_size: int
    per_rank: bool
    """One state file per rank of the writing group (else group rank 0's, loaded by every rank)."""
    files: dict[str, FileRecord]
    created: float
    """Wall-clock seconds."""
    quorum_id: int | None = None
    """The id of the quorum its state was committed (or healed) under; None in manifests from before it was kept."""


def read_manifest(directory: Path) -> CheckpointInfo:
    path = directory / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise DurableCheckpointError(f"{directory} has no {MANIFEST} (an interrupted write)") from exc
    except (OSError, ValueError) as exc:
        raise DurableCheckpointError(f"{path} is unreadable: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
        raise DurableCheckpointError(f"{path} is not a {MANIFEST_FORMAT} manifest")
    try:
        step, size = raw["step"], raw["group_world_size"]
        if type(step) is not int or step < 0 or type(size) is not int or size < 1:
            raise TypeError("step or group_world_size")
        files = {name: FileRecord.from_json(name, entry) for name, entry in raw["files"].items()}
        quorum_id = raw.get("quorum_id")
        if quorum_id is not None and (type(quorum_id) is not int or quorum_id < 0):
            raise TypeError("quorum_id")
        info = CheckpointInfo(step, directory, str(raw["writer"]), str(raw["writer_group"]), size,
                              bool(raw["per_rank"]), files, float(raw["created"]), quorum_id)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise DurableCheckpointError(f"{path} is malformed ({exc})") from exc
    if directory.name != Layout.step_dir_name(step):
        raise DurableCheckpointError(f"{path} says step {step} but lives in {directory.name}")
    return info


class Layout:
    """The names under one checkpoint directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @staticmethod
    def step_dir_name(step: int) -> str:
        return f"step-{step:012d}"

    def step_dir(self, step: int) -> Path:
        return self.root / self.step_dir_name(step)

    def staging_dir(self, step: int, writer: str) -> Path:
        return self.root / f".staging-{step:012d}-{safe_name(writer)}"

    def local_dir(self, step: int) -> Path:
        return self.root / "local" / self.step_dir_name(step)

    def local_file(self, step: int, group: str, rank: int) -> Path:
        return self.local_dir(step) / f"{safe_name(group)}-r{rank}.tft"

    @staticmethod
    def state_file_name(rank: int) -> str:
        return f"state-r{rank}.tft"

    def steps_on_disk(self) -> list[int]:
        """Steps with a ``step-N`` directory, newest first (complete or not)."""
        try:
            names = [entry.name for entry in self.root.iterdir()]
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1)) for m in map(_STEP_DIR.match, names) if m), reverse=True)

    def complete(self) -> list[CheckpointInfo]:
        """Every checkpoint whose manifest reads back, newest first (data not checked: see ``read_state_file``)."""
        found = []
        for step in self.steps_on_disk():
            try:
                found.append(read_manifest(self.step_dir(step)))
            except DurableCheckpointError as exc:
                logger.debug("not a complete checkpoint: %s", exc)
        return found

    def write_manifest(self, directory: Path, step: int, writer: str, writer_group: str, group_world_size: int,
                       per_rank: bool, files: list[FileRecord], *, quorum_id: int | None = None) -> None:
        manifest: dict[str, Any] = {
            "format": MANIFEST_FORMAT, "step": step, "writer": writer, "writer_group": writer_group,
            "group_world_size": group_world_size, "per_rank": per_rank, "created": time.time(),
            "files": {record.name: record.to_json() for record in files},
        }
        if quorum_id is not None:  # the quorum the state was committed under (lighthouse.epochs' fence)
            manifest["quorum_id"] = quorum_id
        write_bytes_atomically(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())

    def prune(self, keep_last: int, *, busy_steps: set[int] = frozenset()) -> list[int]:
        """Keep the newest ``keep_last`` complete checkpoints; remove older ones and dead partial writes.

        Never removes the newest complete checkpoint (``keep_last >= 1``) nor
        anything at or above the oldest kept step (a write still in flight
        there may be another group's); ``busy_steps`` are never touched.
        Returns the steps removed.
        """
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        complete = [info.step for info in self.complete()]
        if len(complete) <= keep_last:
            floor = complete[-1] if complete else None
            removable_complete: list[int] = []
        else:
            floor = complete[keep_last - 1]
            removable_complete = complete[keep_last:]
        if floor is None:
            return []
        removed = []
        for step in self.steps_on_disk():
            if step < floor and step not in busy_steps:
                self._remove(self.step_dir(step))
                if step in removable_complete:
                    removed.append(step)
        for entry in self._entries(self.root):
            match = _STAGING_DIR.match(entry.name)
            if match and int(match.group(1)) < floor and int(match.group(1)) not in busy_steps:
                self._remove(entry)
        for entry in self._entries(self.root / "local"):
            match = _STEP_DIR.match(entry.name)
            if match and int(match.group(1)) < floor and int(match.group(1)) not in busy_steps:
                self._remove(entry)
        return removed

    @staticmethod
    def _entries(directory: Path) -> list[Path]:
        try:
            return list(directory.iterdir())
        except FileNotFoundError:
            return []

    @staticmethod
    def _remove(path: Path) -> None:
        # Another group may prune the same directory at the same time: a vanished entry is fine.
        shutil.rmtree(path, ignore_errors=True)
