"""The commit protocol and retention, run by the controller (no h5py, numpy or torch).

    step_00000100.tmp-3f9a1c2e/   being written: rank files arrive, then the manifest
    step_00000100/                committed: rank_00000.h5 ... rank_NNNNN.h5, manifest.json
    latest                        "step_00000100\\n", replaced atomically after each commit

A checkpoint exists only once its folder has its final name, and it gets that name only
after ``manifest.json`` (the last file written) is on disk: the rename is the commit.
Anything else that looks like a step folder is debris of a crash: never loaded, removed
on commit (core.checkpoint.manifest describes the format and reads it).
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from core.checkpoint.manifest import (
    DAMAGE_NOTE,
    DEBRIS_RE,
    FORMAT,
    FORMAT_VERSION,
    LATEST_NAME,
    MANIFEST_NAME,
    STEP_RE,
    committed_steps,
    fsync_dir,
    rank_file_name,
    step_dir_name,
    verify,
)
from core.checkpoint.spec import ShardAck, SliceAck, TensorSlice
from core.errors import CheckpointError
from core.record.lock import check_fence
from core.record.runfolder import write_atomic

logger = logging.getLogger(__name__)


def tmp_step_dir(root: Path, step: int) -> Path:
    """Create the temporary folder that the ranks of one save write into."""
    if step < 0:
        raise ValueError(f"step must be ≥ 0, got {step}")
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    fsync_dir(root)
    return path



def commit(root: Path, step: int, tmp_dir: Path, acks: list[ShardAck], meta: dict[str, Any], *,
           world_size: int | None = None, keep_last: int = 2, pinned: frozenset[int] = frozenset(),
           retired: list[int] | None = None) -> Path:
    """Commit one save: validate the ranks' acks, write the manifest last, rename, move ``latest``.

    ``world_size`` is the number of writing ranks (default: ``len(acks)``); every rank
    ``0..world_size-1`` must have acknowledged exactly once, with a file in ``tmp_dir`` of
    the acked size, and the acked slices must tile every global tensor exactly. ``meta``
    is recorded as is; its ``layout`` and ``config_hash`` are also lifted to the top level.
    Then keeps ``keep_last`` checkpoints (the steps it deletes are added to ``retired``) and
    removes debris of older saves. Returns the
    committed folder. Raises ``CheckpointError`` naming the problem; nothing is committed then.
    """
    check_fence()  # a controller whose lock was taken over commits nothing (ControllerLockLost)
    tmp_dir = Path(tmp_dir)
    expected = len(acks) if world_size is None else world_size
    files, tensors = _validate_acks(tmp_dir, acks, expected)
    now = time.time()
    doc = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "time_unix": now,
        "layout": meta.get("layout"), "config_hash": meta.get("config_hash"), "meta": meta,
        "files": files, "tensors": tensors,
    }
    write_atomic(tmp_dir / MANIFEST_NAME, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), mode=0o600)
    final = root / step_dir_name(step)
    aside = None
    if final.exists():  # the same step saved again (e.g. after a requeue): move the old one aside
        aside = root / f"{final.name}.old-{secrets.token_hex(4)}"
        os.rename(final, aside)
    os.rename(tmp_dir, final)
    fsync_dir(root)
    write_atomic(root / LATEST_NAME, f"{final.name}\n".encode(), mode=0o600)
    logger.info("committed checkpoint %s (%d files, %d tensors)", final, len(files), len(tensors))
    if aside is not None:
        shutil.rmtree(aside)
    deleted = retain(root, keep_last, pinned)
    if retired is not None:
        retired.extend(int(STEP_RE.match(p.name).group(1)) for p in deleted)  # type: ignore[union-attr]
    remove_uncommitted(root, up_to_step=step)
    return final


def _validate_acks(tmp_dir: Path, acks: list[ShardAck], world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest's ``files`` and ``tensors`` tables from the acks, or a CheckpointError."""
    files: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    for ack in acks:
        name, rank = ack.file, ack.rank
        if name != rank_file_name(rank):
            raise CheckpointError(f"{tmp_dir}: rank {rank} acked file {name!r}, expected {rank_file_name(rank)!r}")
        if name in files:
            raise CheckpointError(f"{tmp_dir}: rank {rank} acknowledged twice; each rank writes one file")
        try:
            actual = os.stat(tmp_dir / name).st_size
        except FileNotFoundError:
            raise CheckpointError(f"{tmp_dir / name}: acked by rank {rank} but missing; "
                                  "was the folder on a filesystem the controller cannot see?") from None
        if actual != ack.size_bytes:
            raise CheckpointError(f"{tmp_dir / name}: acked {ack.size_bytes} bytes but holds {actual}; "
                                  "the write was cut short")
        files[name] = {"rank": rank, "size_bytes": ack.size_bytes, "checksum": ack.checksum}
        for s in ack.slices:
            _add_slice(tensors, s, tmp_dir / name, rank)
    ranks = {f["rank"] for f in files.values()}
    missing = sorted(set(range(world_size)) - ranks)
    extra = sorted(ranks - set(range(world_size)))
    if missing or extra:
        raise CheckpointError(f"{tmp_dir}: acks missing from ranks {missing[:20]}, unexpected from ranks {extra[:20]} "
                              f"(world size {world_size}); the save is incomplete and was not committed")
    for tname, entry in tensors.items():
        problem = _tiling_problem(tuple(entry["global_shape"]),
                                  [(tuple(s["offset"]), tuple(s["shape"])) for s in entry["slices"]])
        if problem:
            raise CheckpointError(f"{tmp_dir}: tensor {tname!r}: {problem}; check which ranks write replicated tensors")
    return files, tensors


def _add_slice(tensors: dict[str, Any], s: SliceAck, path: Path, rank: int) -> None:
    """Enter one acked slice into the manifest's ``tensors`` table, checked against the others."""
    try:
        TensorSlice(name=s.name, global_shape=s.global_shape, offset=s.offset, shape=s.shape, dtype=s.dtype)
    except ValueError as exc:
        raise CheckpointError(f"{path}: rank {rank} acked a bad slice ({exc}); "
                              "its checkpoint_state() returned inconsistent slices") from None
    entry = tensors.setdefault(s.name, {"dtype": s.dtype, "global_shape": list(s.global_shape), "slices": []})
    if entry["dtype"] != s.dtype or entry["global_shape"] != list(s.global_shape):
        raise CheckpointError(
            f"{path}: tensor {s.name!r} is {s.dtype}{list(s.global_shape)} here but "
            f"{entry['dtype']}{entry['global_shape']} in another rank's file; the ranks disagree on the model")
    entry["slices"].append({"file": path.name, "dataset": s.dataset, "offset": list(s.offset), "shape": list(s.shape)})


def _tiling_problem(global_shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
                    ) -> str | None:
    """Why ``boxes`` do not tile ``global_shape`` exactly once, or None.

    Cuts the tensor into the grid of all slice boundaries and counts how often each cell is
    covered: linear in the number of cells, which is the number of slices for the
    rectangular layouts that tensor and pipeline parallelism produce.
    """
    cuts = [sorted({0, g, *(o[d] for o, _ in boxes), *(o[d] + s[d] for o, s in boxes)})
            for d, g in enumerate(global_shape)]
    index = [{c: i for i, c in enumerate(cs)} for cs in cuts]
    count: dict[tuple[int, ...], int] = {}
    for off, shape in boxes:
        if math.prod(shape) == 0:
            continue
        ranges = [range(index[d][off[d]], index[d][off[d] + shape[d]]) for d in range(len(global_shape))]
        for cell in itertools.product(*ranges):
            count[cell] = count.get(cell, 0) + 1
    if any(c > 1 for c in count.values()):
        return "slices overlap (a replicated copy was written twice)"
    cells = math.prod(len(cs) - 1 for cs in cuts) if math.prod(global_shape) else 0
    if len(count) != cells:
        return "slices do not cover the whole tensor (a rank did not write its part)"
    return None



def quarantine(step_dir: Path, why: str) -> Path:
    """Set a checkpoint that failed verification aside (``step_N.damaged-*``), with ``why`` in
    DAMAGED.txt: never loaded, never deleted by Baton; the user decides."""
    aside = step_dir.with_name(f"{step_dir.name}.damaged-{secrets.token_hex(4)}")
    os.rename(step_dir, aside)
    write_atomic(aside / DAMAGE_NOTE, why.strip() + "\n")
    fsync_dir(step_dir.parent)
    logger.warning("checkpoint %s failed verification (%s): set aside as %s", step_dir, why, aside)
    return aside


def retain(root: Path, keep_last: int, pinned: frozenset[int] = frozenset()) -> list[Path]:
    """Delete committed checkpoints beyond the newest ``keep_last`` (never a ``pinned`` step);
    return what was deleted.

    Never leaves no good checkpoint: when none of the kept ones passes the quick check
    (manifest, files and sizes), the newest older one that does is kept as well. An older one
    that fails the quick check is set aside (``quarantine``), never deleted. Deletion renames
    to ``.del-`` first, so a crash mid-delete leaves debris, not a committed checkpoint with
    missing files.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be ≥ 1, got {keep_last}")
    steps = list(reversed(committed_steps(root)))
    kept, older = steps[:keep_last], [s for s in steps[keep_last:] if s not in pinned]
    if older and all(verify(root / step_dir_name(s), checksums=False) for s in kept):
        for s in older:
            if not verify(root / step_dir_name(s), checksums=False):
                logger.warning("keeping checkpoint step %d: none of the %d newest passes a quick check", s, keep_last)
                older.remove(s)
                break
    deleted = []
    for s in older:
        path = root / step_dir_name(s)
        problems = verify(path, checksums=False)
        if problems:
            quarantine(path, "; ".join(problems))
            continue
        doomed = root / f"{path.name}.del-{secrets.token_hex(4)}"
        os.rename(path, doomed)
        shutil.rmtree(doomed)
        deleted.append(path)
        logger.info("retention: deleted checkpoint %s (keep_last=%d)", path, keep_last)
    if deleted:
        fsync_dir(root)
    return deleted


def remove_uncommitted(root: Path, *, up_to_step: int | None = None) -> list[Path]:
    """Remove debris of interrupted saves (at steps ≤ ``up_to_step``; all when None).

    Debris is a ``.tmp-``/``.old-``/``.del-`` folder. A step folder with its final name but
    no manifest is no crash of Baton's (the rename comes after the manifest) but damage: it
    is set aside (``quarantine``), not removed. A newer ``.tmp-`` folder may be a save in
    flight and is left alone.
    """
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        m = DEBRIS_RE.match(p.name) or STEP_RE.match(p.name)
        if not m or not p.is_dir() or (up_to_step is not None and int(m.group(1)) > up_to_step):
            continue
        if STEP_RE.match(p.name):
            if not (p / MANIFEST_NAME).is_file():
                quarantine(p, f"{p / MANIFEST_NAME}: missing under a committed name")
            continue
        logger.warning("removing uncommitted checkpoint folder %s", p)
        shutil.rmtree(p)
        removed.append(p)
    return removed
