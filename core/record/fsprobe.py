"""What lock a folder's filesystem gives across nodes: flock, fcntl, or neither (a lease file).

Cluster filesystems differ (all seen in their manuals):

    local disk, tmpfs     flock and fcntl both work and exclude
    NFS                   flock is emulated with fcntl (byte-range) locks over NLM/NFSv4, which
                          need the file open for writing: flock on an O_RDONLY fd is EBADF
    NFS ``nolock``,       the locks are kept on the client only: they "work" and exclude
    ``local_lock=all``    nothing on another node (``local_lock=flock``: flock only;
                          ``local_lock=posix``: fcntl only)
    Lustre ``flock``      coherent flock and fcntl across the clients
    Lustre ``localflock`` node-local flock and fcntl (they exclude nothing across nodes)
    Lustre ``noflock``    (its default on many sites) every flock and fcntl lock fails: ENOSYS

So ``probe`` tries the calls themselves on a scratch file of the folder (flock, then fcntl
on a read-write fd, an unsupported call answering one of ``UNSUPPORTED``) and reads the
mount's type and options from /proc/self/mountinfo: a call that works but is node-local
there is not used. What is left is ``Support.method``: "flock", "fcntl" or "lease" (an
atomic lease file, core.record.lease). The answer is kept per folder for the process.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from core.errors import BatonError, RunFolderError, TransientIOError, is_transient

# What a lock call answers when the filesystem does not do that kind of lock.
UNSUPPORTED = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF})
MOUNTINFO = "/proc/self/mountinfo"


def lock_error(path: Path, exc: OSError) -> BatonError:
    """A lock's OSError as Baton reports it: a storage fault (EIO, ESTALE, EDQUOT ...) is
    transient (retried); anything else (EACCES, EROFS ...) is the run folder's, in one line."""
    why = exc.strerror or str(exc)
    if is_transient(exc):
        return TransientIOError(f"{path}: cannot lock ({why}); a storage fault, tried again")
    return RunFolderError(f"{path}: cannot lock ({why}); fix the permissions/quota of the run folder")


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo: where, what type, and its options (mount and superblock)."""

    point: str
    fstype: str
    source: str
    options: frozenset[str]

    def option(self, name: str) -> str | None:
        """The value of ``name=value`` (or "" for a bare ``name``); None when absent."""
        for o in self.options:
            key, _, value = o.partition("=")
            if key == name:
                return value
        return None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """Every mount of a mountinfo text (proc(5)): ``ID PARENT MAJ:MIN ROOT POINT OPTS [TAGS] - TYPE SRC SUPER``."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or len(tail) < 2:
            continue
        opts = set(fields[5].split(",")) | set(tail[2].split(",") if len(tail) > 2 else ())
        mounts.append(Mount(point=_unescape(fields[4]), fstype=tail[0], source=_unescape(tail[1]),
                            options=frozenset(opts)))
    return mounts


def mount_of(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount ``path`` (resolved) lies on: the last-mounted longest mount point above it."""
    target = str(path.resolve())
    best: Mount | None = None
    for m in mounts:
        inside = target == m.point or target.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def node_local(mount: Mount | None) -> tuple[set[str], str]:
    """Which of flock and fcntl this mount keeps on the node only, and the option that says so."""
    if mount is None:
        return set(), ""
    kind = mount.fstype.split(".")[0]
    if kind in ("nfs", "nfs4"):
        if "nolock" in mount.options:
            return {"flock", "fcntl"}, f"{mount.fstype} mounted nolock"
        local = mount.option("local_lock")
        if local in ("all", "flock", "posix"):
            return ({"flock", "fcntl"} if local == "all" else {"flock"} if local == "flock" else {"fcntl"},
                    f"{mount.fstype} mounted local_lock={local}")
    if kind == "lustre" and "localflock" in mount.options:
        return {"flock", "fcntl"}, "lustre mounted localflock"
    return set(), ""


@dataclass(frozen=True)
class Support:
    """The lock a folder's filesystem gives across nodes (``method``), and why not a better one."""

    method: str  # "flock" | "fcntl" | "lease"
    mount: Mount | None
    why: str  # empty for flock; else what ruled out the calls before it

    def where(self) -> str:
        m = self.mount
        return f"{m.fstype} at {m.point}" if m is not None else "its filesystem"


def _works(fd: int, call: str) -> bool | None:
    """True: the call locks (or finds the lock held); False: unsupported here. Released at once."""
    try:
        if call == "flock":
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        else:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.lockf(fd, fcntl.LOCK_UN)
    except (BlockingIOError, PermissionError):  # held by another: the call works (fcntl: EAGAIN or EACCES)
        return True
    except OSError as exc:
        if exc.errno in UNSUPPORTED:
            return False
        raise
    return True


def _calls_that_work(folder: Path) -> tuple[dict[str, bool], str]:
    scratch = folder / f".baton-lockprobe.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
    try:
        fd = os.open(scratch, os.O_RDWR | os.O_CREAT, 0o660)
    except OSError as exc:
        raise lock_error(folder, exc) from exc
    try:
        works = {call: bool(_works(fd, call)) for call in ("flock", "fcntl")}
    except OSError as exc:
        raise lock_error(folder, exc) from exc
    finally:
        os.close(fd)
        scratch.unlink(missing_ok=True)
    failed = [c for c, ok in works.items() if not ok]
    return works, f"{' and '.join(failed)} unsupported" if failed else ""


_CACHE: dict[str, Support] = {}
_CACHE_LOCK = threading.Lock()


def probe(folder: Path, *, mountinfo: str | None = None) -> Support:
    """What lock ``folder`` (an existing folder) gives across nodes; kept for the process."""
    key = str(folder.resolve())
    from_proc = mountinfo is None
    with _CACHE_LOCK:
        if from_proc and key in _CACHE:
            return _CACHE[key]
    if mountinfo is None:
        try:
            mountinfo = Path(MOUNTINFO).read_text()
        except OSError:
            mountinfo = ""
    mount = mount_of(folder, parse_mountinfo(mountinfo))
    works, unsupported = _calls_that_work(folder)
    local, option = node_local(mount)
    why = []
    if unsupported:
        why.append(unsupported)
    if local:
        why.append(f"{' and '.join(sorted(local))} node-local ({option})")
    usable = [c for c in ("flock", "fcntl") if works[c] and c not in local]
    support = Support(method=usable[0] if usable else "lease", mount=mount, why="; ".join(why))
    if from_proc:
        with _CACHE_LOCK:
            _CACHE[key] = support
    return support


def forget() -> None:
    """Probe again next time (tests that mount and unmount under one process)."""
    with _CACHE_LOCK:
        _CACHE.clear()
