"""The checkpoint format: folder and file names, the manifest, reading and verifying.

No h5py, numpy or torch: the controller and the login-node CLI use it. The commit
protocol that writes this layout is core.checkpoint.commit. Layout under the run's ``checkpoints/`` folder (``root`` below)::

    step_00000100.tmp-3f9a1c2e/   being written: rank files arrive, then the manifest
    step_00000100/                committed: rank_00000.h5 ... rank_NNNNN.h5, manifest.json
    latest                        "step_00000100\\n", replaced atomically after each commit

A checkpoint exists only once its folder has its final name, and it gets that name only
after ``manifest.json`` (the last file written) is on disk: the rename is the commit.
Anything else that looks like a step folder (a ``.tmp-``, ``.old-`` or ``.del-`` suffix,
or a final name without a manifest) is debris of a crash: never loaded, removed on commit.

The manifest maps every global tensor to the slices that hold it, so the controller and
the login-node CLI verify, list and inspect a checkpoint from file bytes alone. Shape::

    {"format": "baton-checkpoint", "format_version": 1, "step": 100,
     "time": "2026-05-09T07:35:25Z", "time_unix": 1778312125.0,
     "layout": {"tp": 2, "pp": 2, "dp": 1}, "config_hash": "ab12...", "meta": {...},
     "files": {"rank_00000.h5": {"rank": 0, "size_bytes": 8392704, "checksum": "xxh3_64:9f..."}},
     "tensors": {"decoder.w": {"dtype": "float32", "global_shape": [4, 4], "slices": [
         {"file": "rank_00000.h5", "dataset": "tensor_00000", "offset": [0, 0], "shape": [2, 2]}]}}}
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from core.checkpoint.storage import manifest_bytes, storage_io, unreadable
from core.errors import CheckpointError, ConfigError, RunFolderError, TransientIOError

logger = logging.getLogger(__name__)

FORMAT = "baton-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
CHECKSUM_ALGO = "xxh3_64"
STEP_RE = re.compile(r"^step_(\d{8})$")
DEBRIS_RE = re.compile(r"^step_(\d{8})\.(tmp|old|del)-[0-9a-f]+$")
DAMAGED_RE = re.compile(r"^step_(\d{8})\.damaged-[0-9a-f]+$")  # failed verification: kept, never loaded
DAMAGE_NOTE = "DAMAGED.txt"  # inside a damaged folder: why it was set aside
_RANK_RE = re.compile(r"^rank_(\d{5,})\.h5$")
_READ_BLOCK = 16 << 20


@dataclass(frozen=True, kw_only=True)
class SliceLocation:
    """Where one slice of a global tensor lives: a dataset in a rank file."""

    file: str
    dataset: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One global tensor: its dtype, global shape and the slices that tile it exactly."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    slices: tuple[SliceLocation, ...]


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One rank file: who wrote it, its size and its checksum over the file bytes."""

    name: str
    rank: int
    size_bytes: int
    checksum: str


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The parsed ``manifest.json`` of a committed checkpoint."""

    step: int
    time_unix: float
    layout: Any
    config_hash: str | None
    meta: dict[str, Any]
    files: tuple[FileEntry, ...]
    tensors: dict[str, TensorEntry]


@dataclass(frozen=True, kw_only=True)
class CheckpointEntry:
    """One line of ``baton ckpt ls``."""

    step: int
    path: Path
    committed: bool
    size_bytes: int
    layout: Any
    is_latest: bool
    damaged: bool = False  # set aside after failing verification (``step_N.damaged-*``)


def step_dir_name(step: int) -> str:
    """``step_00000100``: zero-padded so that names sort like steps."""
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    """``rank_00003.h5``: the one file a writing rank produces."""
    return f"rank_{rank:05d}.h5"


def file_checksum(path: Path) -> str:
    """``xxh3_64:<hex>`` over the file's bytes; the writer computes the same from its buffers."""
    return storage_io(path, lambda: _checksum(path))


def _checksum(path: Path) -> str:
    h = xxhash.xxh3_64()
    buf = bytearray(_READ_BLOCK)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := os.readv(fd, [buf]):
            h.update(view[:n])
    finally:
        os.close(fd)
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (creates, renames, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- reading and verifying
def committed_steps(root: Path) -> list[int]:
    """Steps with a committed checkpoint (final folder name and a manifest), ascending."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and storage_io(p, (p / MANIFEST_NAME).is_file):
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_latest(root: Path) -> int | None:
    """The step the ``latest`` pointer names, or None when there is none."""
    try:
        text = (root / LATEST_NAME).read_bytes().decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{root / LATEST_NAME}: unreadable ({exc.strerror}); delete it "
                              "(Baton rewrites it at the next commit)") from None
    m = STEP_RE.match(text)
    if not m:
        raise CheckpointError(f"{root / LATEST_NAME}: holds {text[:60]!r}, not a step folder name; delete it "
                              "(Baton rewrites it at the next commit)")
    return int(m.group(1))


def read_manifest(step_dir: Path) -> Manifest:
    """Parse and check ``step_dir/manifest.json``; bad input is a one-line CheckpointError."""
    path = Path(step_dir) / MANIFEST_NAME
    fix = f"this checkpoint is unusable: delete {step_dir} or resume from another step"
    try:
        raw = manifest_bytes(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing, so {step_dir} was never committed; {fix}") from None
    except OSError as exc:  # not transient (those are retried, then a TransientIOError): not damage either
        raise unreadable(path, exc) from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: unreadable (not valid JSON: {exc}); {fix}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a Baton checkpoint manifest; {fix}")
    version = doc.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {version!r}, this Baton reads ≤ {FORMAT_VERSION}; "
                              "upgrade Baton to load it")
    try:
        files = tuple(FileEntry(name=n, rank=int(f["rank"]), size_bytes=int(f["size_bytes"]),
                                checksum=str(f["checksum"])) for n, f in sorted(doc["files"].items()))
        tensors = {
            n: TensorEntry(name=n, dtype=str(t["dtype"]), global_shape=tuple(int(x) for x in t["global_shape"]),
                           slices=tuple(SliceLocation(file=str(s["file"]), dataset=str(s["dataset"]),
                                                      offset=tuple(int(x) for x in s["offset"]),
                                                      shape=tuple(int(x) for x in s["shape"]))
                                        for s in t["slices"]))
            for n, t in doc["tensors"].items()
        }
        meta = dict(doc.get("meta") or {})
        _check_attachments(meta.get("attachments"))
        return Manifest(step=int(doc["step"]), time_unix=float(doc["time_unix"]), layout=doc.get("layout"),
                        config_hash=doc.get("config_hash"), meta=meta, files=files, tensors=tensors)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: malformed ({exc!r}); {fix}") from None


def verify(step_dir: Path, *, checksums: bool = True) -> list[str]:
    """Problems of one checkpoint, each naming the file and the reason; empty when it is good.

    Checks the manifest, then each file's presence and size, then (``checksums``) its
    xxh3 checksum over the bytes on disk. A storage error is no problem of the checkpoint's:
    it is raised (TransientIOError after retries, RunFolderError), never returned.
    """
    step_dir = Path(step_dir)
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError as exc:
        return [str(exc)]
    problems = []
    entries = [(f.name, f.size_bytes, f.checksum, f"rank {f.rank}'s shard") for f in manifest.files]
    entries += [(name, int(a["size_bytes"]), str(a["checksum"]), "the controller's attachment")
                for name, a in sorted(attachments(manifest).items())]
    for name, size_bytes, checksum, what in entries:
        path = step_dir / name
        try:
            size = storage_io(path, lambda p=path: os.stat(p).st_size)  # type: ignore[misc]
            actual = file_checksum(path) if checksums and size == size_bytes else checksum
        except FileNotFoundError:
            problems.append(f"{path}: missing ({what})")
            continue
        except OSError as exc:
            raise unreadable(path, exc) from None
        if size != size_bytes:
            problems.append(f"{path}: size {size} bytes, manifest says {size_bytes} (truncated or overwritten)")
        elif actual != checksum:
            problems.append(f"{path}: checksum {actual}, manifest says {checksum} (the bytes are corrupt)")
    return problems


def _check_attachments(found: Any) -> None:
    """``meta.attachments`` (when present): file names of the step's folder, each with an integer
    size and a checksum (else ValueError/TypeError/KeyError: the manifest is malformed)."""
    for name, entry in (found or {}).items():
        if not isinstance(name, str) or name in ("", ".", "..", MANIFEST_NAME) or "/" in name or "\0" in name:
            raise ValueError(f"attachment name {name!r} is not a file of the step's folder")
        size, checksum = entry["size_bytes"], entry["checksum"]
        if type(size) is not int or size < 0 or not isinstance(checksum, str):
            raise ValueError(f"attachment {name!r}: {entry!r} is not a size and a checksum")


def attachments(manifest: Manifest) -> dict[str, dict[str, Any]]:
    """The files the controller wrote into the checkpoint beside the rank files (``meta.attachments``:
    name → size and checksum; an RL run's rollouts not yet trained on)."""
    found = manifest.meta.get("attachments") or {}
    return found if isinstance(found, dict) else {}


def read_attachment(step_dir: Path, name: str) -> bytes | None:
    """The bytes of attachment ``name`` of a committed checkpoint, or None when the checkpoint
    has none of that name (``verify`` checks its size and checksum with the rest)."""
    if name not in attachments(read_manifest(step_dir)):
        return None
    path = Path(step_dir) / name
    try:
        return storage_io(path, path.read_bytes)
    except OSError as exc:
        raise unreadable(path, exc) from None


def latest_valid(root: Path, *, verify: bool = True, log: logging.Logger | None = None) -> Path | None:
    """The newest committed checkpoint that passes verification, or None.

    A failing checkpoint is skipped with a warning naming the file and the reason, and the
    previous one is tried; uncommitted folders are never considered. ``verify=False``
    checks only that the manifest parses and the files have their sizes.
    """
    log = log or logger
    for step in reversed(committed_steps(root)):
        step_dir = root / step_dir_name(step)
        problems = _verify(step_dir, checksums=verify)
        if not problems:
            return step_dir
        log.warning("skipping checkpoint %s: %s", step_dir, "; ".join(problems))
    return None


_verify = verify  # latest_valid's keyword shadows the function


def init_checkpoint(run_dir: str, step: int | None) -> Path:
    """``init_from``'s checkpoint: ``run_dir``'s committed one of ``step`` (its newest that
    passes the quick check without one); a one-line ConfigError naming what is missing."""
    root = Path(run_dir).expanduser() / "checkpoints"
    if not root.is_dir():
        raise ConfigError(f"init_from: {run_dir} is not a run folder with checkpoints (no {root}); give the folder "
                          "of a Baton run, RUN_DIR or RUN_DIR:STEP")
    if step is None:
        found = latest_valid(root, verify=False)
        if found is None:
            raise ConfigError(f"init_from: {root} holds no committed checkpoint that passes its check; "
                              "give a run that has saved one")
        return found
    step_dir = root / step_dir_name(step)
    problems = _verify(step_dir, checksums=False) if step in committed_steps(root) else ["not committed"]
    if problems:
        have = ", ".join(str(s) for s in committed_steps(root)) or "none"
        raise ConfigError(f"init_from: {step_dir}: {'; '.join(problems)}; committed steps: {have}")
    return step_dir


# ---------------------------------------------------------------- the CLI's views


def list_checkpoints(root: Path) -> list[CheckpointEntry]:
    """Every step folder under ``root``, committed or not, for ``baton ckpt ls``; by step."""
    if not root.is_dir():
        return []
    try:
        latest = read_latest(root)
    except CheckpointError:
        latest = None
    out = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name) or DEBRIS_RE.match(p.name) or DAMAGED_RE.match(p.name)
        if not m or not p.is_dir():
            continue
        committed = bool(STEP_RE.match(p.name)) and (p / MANIFEST_NAME).is_file()
        layout = None
        if committed:
            try:
                layout = read_manifest(p).layout
            except (CheckpointError, RunFolderError, TransientIOError):
                pass  # listed as committed with no layout; `baton ckpt verify` says why
        size = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
        out.append(CheckpointEntry(step=int(m.group(1)), path=p, committed=committed, size_bytes=size,
                                   layout=layout, is_latest=committed and int(m.group(1)) == latest,
                                   damaged=bool(DAMAGED_RE.match(p.name))))
    return sorted(out, key=lambda e: (e.step, not e.committed, e.path.name))


def newest_intact(root: Path) -> tuple[Path | None, list[str]]:
    """The newest committed checkpoint that passes the quick check (manifest, files, sizes:
    what a login node can afford), and one line per newer one that does not."""
    problems = []
    for step in reversed(committed_steps(root)):
        step_dir = root / step_dir_name(step)
        found = verify(step_dir, checksums=False)
        if not found:
            return step_dir, problems
        problems.append(f"{step_dir.name}: {'; '.join(found)}")
    return None, problems


def vanished(root: Path, recorded: Sequence[int]) -> tuple[str | None, list[str]]:
    """The run's record (``recorded``: the steps it committed and retention did not delete)
    against what ``root`` holds: a refusal (one line) when the newest recorded checkpoint is
    gone and nothing as new is left (a resume would go back, or start from step 0), and a
    note per older one gone. A damaged one (set aside) is not gone: it is named elsewhere. A
    step folder without its manifest (a purge that deleted the files, not the folders) is gone."""
    here = set(committed_steps(root)) | {int(m.group(1)) for p in damaged(root) if (m := DAMAGED_RE.match(p.name))}
    gone = sorted((s for s in set(recorded) - here), reverse=True)
    if not gone:
        return None, []
    names = [step_dir_name(s) for s in gone]
    left = committed_steps(root)
    if max(here, default=-1) >= gone[0]:
        return None, [f"checkpoint {root / n}: missing, though the run's record says it was committed; the resume "
                      f"uses a newer one" for n in names]
    where = f"{root} (the folder itself is gone)" if not root.is_dir() else str(root)
    fallback = (f"go on from {step_dir_name(left[-1])}, the newest left (steps {left[-1]} to {gone[0]} are redone)"
                if left else "start again from step 0 (no checkpoint is left)")
    return (f"{where}: {', '.join(names)} missing, though the run's record says "
            f"{'they were' if len(names) > 1 else 'it was'} committed and not deleted by retention (moved away, "
            f"emptied or purged?); restore {'them' if len(names) > 1 else 'it'} into {root} and resume, or add --from-scratch to "
            f"{fallback}"), []


def damaged(root: Path) -> list[Path]:
    """Checkpoints set aside after failing verification, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if DAMAGED_RE.match(p.name) and p.is_dir())


def findings(root: Path) -> list[str]:
    """What a user must hear about a run's checkpoints: damaged ones set aside, and a ``latest``
    pointer that names no committed checkpoint. One line each; [] when all is well."""
    out = []
    for p in damaged(root):
        note = p / DAMAGE_NOTE
        why = note.read_text(errors="replace").strip().splitlines()[0] if note.is_file() else "failed verification"
        out.append(f"{p}: damaged, set aside and kept ({why})")
    try:
        latest = read_latest(root)
    except CheckpointError as exc:
        return [*out, str(exc)]
    if latest is not None and latest not in committed_steps(root):
        out.append(f"{root / LATEST_NAME}: points at {step_dir_name(latest)}, which is not a committed checkpoint "
                   "(missing or without its manifest); resumes use the newest committed one")
    return out


def describe(step_dir: Path) -> str:
    """A text report for ``baton ckpt inspect``: meta, files, tensors and which file holds which slice."""
    m = read_manifest(step_dir)
    lines = [f"checkpoint {step_dir}", f"  step {m.step}  layout {json.dumps(m.layout)}  config_hash {m.config_hash}  "
             f"written {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(m.time_unix))}",
             f"  files ({len(m.files)}, {sum(f.size_bytes for f in m.files)} bytes):"]
    lines += [f"    {f.name}  rank {f.rank}  {f.size_bytes} bytes  {f.checksum}" for f in m.files]
    lines.append(f"  tensors ({len(m.tensors)}):")
    for t in sorted(m.tensors.values(), key=lambda t: t.name):
        lines.append(f"    {t.name}  {t.dtype}  {list(t.global_shape)}")
        lines += [f"      {s.file}:{s.dataset}  offset {list(s.offset)}  shape {list(s.shape)}" for s in t.slices]
    return "\n".join(lines)

