"""Exclusive locks of a run folder that hold on every filesystem a cluster uses.

One mechanism for the three locks Baton takes:

    controller.lock  one controller per run folder, held for the controller's life (a try:
                     a second controller is refused at once, naming the holder)
    state.lock       the run record's writers (core.record.state), held for one update
    sweep.lock       the sweep ledger's read-modify-write (launcher.ledger)

``FileLock`` asks what the folder's filesystem gives across nodes once (core.record.fsprobe)
and uses it: ``flock``, else an fcntl (POSIX) lock, each on the file opened read-write (NFS
emulates flock with fcntl locks, which need write access), else (Lustre ``noflock``, NFS
``nolock``, Lustre ``localflock``: no call, or only node-local ones) a lease file
``NAME.lease`` with host, pid, Slurm job and a heartbeat (core.record.lease). A call that
answers "unsupported" at lock time falls through to the next kind the same way. Within a
process, threads are excluded by a ``threading.Lock`` per path (fcntl locks belong to the
process, not the open file, and closing any fd of the file drops them).

The controller lock is also a lease: whatever kernel lock it holds, the controller writes and
heartbeats ``controller.lease`` too, and every contender honours a fresh one. Nodes may
choose different kinds (a login node without NFS lockd gets ENOLCK and leases, a node
mounted ``localflock`` or ``nolock`` leases where the others flock): the lease excludes them
all. A controller whose lease is lost (taken over after an NFS stall, or not heartbeaten
for ``STALE_S``) is fenced: ``check_fence`` (at each step boundary and before a commit)
raises ``ControllerLockLost`` and the controller ends without committing or requeueing.

A lock held by a dead controller never blocks the next start of its job: once its holder
is known over (an earlier epoch of this Slurm job, or Slurm says its job is over), the
kernel lock file is renamed aside (``controller.lock.stale-<token>``, kept) and a fresh
inode is locked (an NLM lock of a crashed node lasts until that node reboots); every taker
checks after locking that the path still names the inode it locked. A lease of such a
holder is taken over at once. A live controller of a running job is refused at once.

Limit: state.lock is not doubled by a lease (it is taken for every record update). Two
nodes that chose different kinds for it do not exclude each other; the controller lease
keeps the login node's resume off a live run, and every record write is whole (a renamed
state.json, one-write event lines), so at worst one concurrent update (a ``baton cancel``
while the controller updates) is lost, never torn.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core.errors import BatonError, TransientIOError, UserError
from core.job import slurmctl
from core.record import fsprobe
from core.record import lease as lease_mod
from core.record.runfolder import RunFolder

log = logging.getLogger(__name__)

REQUEUE_WAIT_S = 120.0  # a requeued controller waits this long for a dead holder's lock to go
WAIT_S = 300.0  # a blocking lock (state.lock, sweep.lock) taken as a lease: the longest poll
METHODS = ("flock", "fcntl", "lease")

_THREADS: dict[str, threading.Lock] = {}  # one per lock path: the threads of this process
_THREADS_GUARD = threading.Lock()
_HELD: dict[str, str] = {}  # path → how this process holds it (controller_alive asks in-process)


class ControllerLockLost(BatonError):
    """This controller's lock was taken over (or could not be kept): it must stop at once,
    commit nothing more and requeue nothing (the run belongs to another controller now)."""


_FENCED: dict[str, FileLock] = {}  # the controller locks this process holds: check_fence asks them


def check_fence() -> None:
    """Raise ControllerLockLost when a controller lock this process holds was lost."""
    for path, held in list(_FENCED.items()):
        why = held.lost_reason()
        if why is not None:
            raise ControllerLockLost(f"{path}: this controller's lock was lost ({why}); it stops without "
                                     "committing or requeueing: the run is another controller's now")


def _thread_lock(path: Path) -> threading.Lock:
    with _THREADS_GUARD:
        return _THREADS.setdefault(str(path), threading.Lock())


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not renamed aside meanwhile)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def _kernel(fd: int, method: str, *, blocking: bool) -> bool:
    """Lock ``fd`` with flock or fcntl; False when another holds it (non-blocking only).
    An unsupported call raises its OSError (errno in fsprobe.UNSUPPORTED)."""
    flags = fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB)
    try:
        (fcntl.flock if method == "flock" else fcntl.lockf)(fd, flags)
    except (BlockingIOError, PermissionError):  # lockf answers a held lock with EAGAIN or EACCES
        return False
    return True


class FileLock:
    """An exclusive lock on ``path`` by the best kind its folder's filesystem gives."""

    def __init__(self, path: Path, *, job_id: str | None = None, epoch: int = 0, guard: bool = False) -> None:
        self.path = path
        self.guard = guard  # also hold NAME.lease over a kernel lock (the controller lock)
        self.holder = lease_mod.me(job_id=job_id, epoch=epoch)
        self.support = fsprobe.probe(path.parent)
        self.method: str | None = None  # how it is held, once held
        self._fd: int | None = None
        self._lease: lease_mod.Lease | None = None
        self._guard: lease_mod.Lease | None = None
        self._thread = _thread_lock(path)

    @property
    def lease_path(self) -> Path:
        return self.path.with_suffix(".lease")

    def try_acquire(self) -> bool:
        """Take the lock now if free; False while another holds it."""
        if not self._thread.acquire(blocking=False):
            return False
        return self._take(blocking=False)

    def acquire(self, wait_s: float = WAIT_S) -> None:
        """Wait for the lock: a flock or fcntl lock as the kernel grants it, a lease polled up to
        ``wait_s`` (then a TransientIOError naming the holder)."""
        deadline = time.monotonic() + wait_s
        if not self._thread.acquire(timeout=wait_s):
            raise TransientIOError(f"{self.path}: another thread of this process held it for {wait_s:.0f} s")
        if self._take(blocking=True):
            return
        pause = 0.02
        while time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
            if self._lease is not None and self._lease.try_acquire():
                self._held("lease")
                return
        self._thread.release()
        held = self._lease.current() if self._lease is not None else None
        raise TransientIOError(f"{self.path}: still held after {wait_s:.0f} s by "
                               f"{held.describe() if held else 'another holder'} (lease {self.lease_path})")

    def _take(self, *, blocking: bool) -> bool:
        """The kernel locks from the folder's best kind down, then the lease. With ``blocking``,
        a kernel lock waits; a lease is tried once (``acquire`` polls it). The thread lock is
        held on entry; released here unless the lock was taken or a lease is to be polled."""
        try:
            for method in METHODS[METHODS.index(self.support.method):]:
                if method == "lease":
                    self._lease = lease_mod.Lease(self.lease_path, self.holder)
                    try:
                        taken = self._lease.try_acquire()
                    except OSError as exc:
                        raise fsprobe.lock_error(self.lease_path, exc) from exc
                    if taken:
                        return self._held("lease")
                    if not blocking:
                        self._thread.release()
                    return False
                got = self._kernel_take(method, blocking=blocking)
                if got is None:
                    continue
                if got and self._guarded():
                    return self._held(method)
                self._close()
                self._thread.release()
                return False
        except BaseException:
            self._close()
            self._thread.release()
            raise
        raise AssertionError("the lease is the last kind")  # pragma: no cover

    def _kernel_take(self, method: str, *, blocking: bool) -> bool | None:
        """Lock the file the path names now by ``method``: True (held, ``_fd`` set), False
        (another holds it), None (unsupported here). A file renamed aside between the open and
        the lock (a dead holder's, core.record.lock's takeover) is let go and the path opened again."""
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o660)  # teammates of the group take it too
            except OSError as exc:
                raise fsprobe.lock_error(self.path, exc) from exc
            try:
                got = _kernel(fd, method, blocking=blocking)
                same = got and _names(self.path, fd)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in fsprobe.UNSUPPORTED:
                    raise fsprobe.lock_error(self.path, exc) from exc
                log.info("%s: %s unsupported here (%s); trying the next kind", self.path, method, exc.strerror)
                return None
            if got and not same:
                os.close(fd)  # locked an inode the path no longer names: it proves nothing
                continue
            if not got:
                os.close(fd)
                return False
            self._fd = fd
            return True
        raise TransientIOError(f"{self.path}: renamed under every lock taken (20 tries); the next start tries again")

    def _guarded(self) -> bool:
        """With ``guard``, also take the lease (a node that leases sees this holder); False
        (nothing kept) while a live holder has it."""
        if not self.guard:
            return True
        self._guard = lease_mod.Lease(self.lease_path, self.holder)
        try:
            if self._guard.try_acquire():
                return True
        except OSError as exc:
            raise fsprobe.lock_error(self.lease_path, exc) from exc
        self._guard = None
        return False

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def taken_over(self) -> bool:
        """Whether another holder's lease now stands where this one's was (not a mere stall)."""
        held = self._guard or self._lease
        current = lease_mod.read_holder(self.lease_path) if held is not None else None
        return current is not None and current.token != self.holder.token

    def lost_reason(self) -> str | None:
        """Why this holder's lease (its lock, or the lease guarding its kernel lock) is lost."""
        held = self._guard or self._lease
        return held.lost_reason() if held is not None and self.method is not None else None

    def _held(self, method: str) -> bool:
        self.method = method
        _HELD[str(self.path)] = method
        return True

    def release(self) -> None:
        """Give the lock back (closing the fd drops a flock or fcntl lock)."""
        _HELD.pop(str(self.path), None)
        _FENCED.pop(str(self.path), None)
        self._close()
        if self._guard is not None:
            self._guard.release()
            self._guard = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self.method = None
        self._thread.release()


@contextlib.contextmanager
def exclusive(path: Path, *, wait_s: float = WAIT_S) -> Iterator[FileLock]:
    """Hold ``path``'s lock for the block (state.lock, sweep.lock): short, blocking."""
    lock = FileLock(path)
    lock.acquire(wait_s)
    try:
        yield lock
    finally:
        lock.release()


# --- the controller lock ------------------------------------------------------------------------
def _path(run: RunFolder) -> Path:
    return run.path / "controller.lock"


def _controller_json(run: RunFolder) -> dict[str, Any]:
    try:
        info = json.loads(run.controller.read_bytes())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def holder(run: RunFolder) -> str:
    """Who the lock's holder is, from controller.json (best effort)."""
    info = _controller_json(run)
    try:
        return f"pid {info['pid']} on {info['node']} (epoch {info['epoch']})"
    except KeyError:
        return "a controller whose controller.json is unreadable"


def _holder_is_over(run: RunFolder, job_id: str | None, epoch: int) -> str | None:
    """Why the controller named by controller.json is gone though its kernel lock may linger
    (an NFS lock of a dead node); None when it may be alive. Slurm is asked only about a job
    of this cluster (another cluster's job id is "invalid" here, yet alive)."""
    info = _controller_json(run)
    held_job, held_epoch = info.get("job_id"), info.get("epoch")
    if not held_job or not lease_mod.same_cluster(info.get("cluster"), os.environ.get("SLURM_CLUSTER_NAME") or None):
        return None
    if held_job == job_id and isinstance(held_epoch, int) and held_epoch < epoch:
        return f"it was epoch {held_epoch} of this Slurm job {job_id}, which Slurm started again (epoch {epoch})"
    if held_job != job_id and shutil.which("scontrol") and slurmctl.job_over(str(held_job)):
        return f"Slurm says its job {held_job} is over"
    return None


def _set_aside(path: Path) -> Path | None:
    """Rename a finished holder's lock file aside (kept): the next lock is on a fresh inode."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise fsprobe.lock_error(path, exc) from exc
    return aside


@contextlib.contextmanager
def controller_lock(run: RunFolder, *, job_id: str | None = None, epoch: int = 0,
                    wait_s: float = REQUEUE_WAIT_S) -> Iterator[FileLock]:
    """Hold the run's controller lock (and its lease); a UserError naming the holder when a
    live one has it. A holder that is an earlier start of this job, or whose Slurm job is
    over, has its lock file renamed aside, and its lease taken over; what a lease still
    keeps is waited for (up to ``wait_s``). While held, ``check_fence`` says if it was lost."""
    lock = FileLock(_path(run), job_id=job_id, epoch=epoch, guard=True)
    if not lock.try_acquire():
        why = _holder_is_over(run, job_id, epoch)
        if why is None:
            raise UserError(f"{run.path}: another controller runs this run ({holder(run)}); a second one would "
                            "undo its checkpoints: wait for it, or end it (`baton cancel`) first")
        aside = _set_aside(_path(run)) if lock.support.method != "lease" else None
        log.warning("%s: the controller lock is still held by %s, but %s: %s", run.path, holder(run), why,
                    f"its lock file is set aside as {aside.name}" if aside else "taking it over")
        _wait_for(lock, wait_s, run)
    _FENCED[str(lock.path)] = lock
    try:
        yield lock
    finally:
        lock.release()


def _wait_for(lock: FileLock, wait_s: float, run: RunFolder) -> None:
    deadline = time.monotonic() + wait_s
    pause = 0.05
    while not lock.try_acquire():
        if time.monotonic() > deadline:
            raise TransientIOError(f"{run.path}: the controller lock of a finished controller ({holder(run)}) was "
                                   f"not released within {wait_s:.0f} s; the next start tries again")
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def controller_alive(run: RunFolder) -> str | None:
    """The live controller's description when one holds the lock, else None (the lock is not kept)."""
    path = _path(run)
    if str(path) in _HELD:
        return holder(run)
    if not path.exists() and not path.with_suffix(".lease").exists():
        return None
    leased = lease_mod.read_holder(path.with_suffix(".lease"))  # another node may lease where this one flocks
    if leased is not None and lease_mod.stale_reason(leased, lease_mod.me(), time.time()) is None:
        return holder(run)
    lock = FileLock(path)
    if not lock.try_acquire():
        return holder(run)
    lock.release()
    return None


# --- what `baton submit` says about a folder ----------------------------------------------------
def cross_node_notice(folder: Path) -> str | None:
    """None when ``folder``'s filesystem gives a cross-node flock or fcntl lock; else the one
    line saying that Baton keeps one controller per run there with a lease file. A UserError
    when no lock of any kind can work (not even a lease file can be made). ``folder`` need
    not exist yet: its nearest existing parent is asked (where it will be made)."""
    existing = folder
    while not existing.is_dir() and existing != existing.parent:
        existing = existing.parent
    try:
        support = fsprobe.probe(existing)
        refused = lease_mod.can_create(existing) if support.method == "lease" else None
    except (OSError, BatonError) as exc:
        cause = exc if isinstance(exc, OSError) else exc.__cause__
        if isinstance(exc, TransientIOError) or not isinstance(cause, OSError):
            raise
        support, refused = fsprobe.Support(method="lease", mount=None, why="no lock call could be tried"), cause
    if refused is not None:
        raise UserError(f"{folder}: no lock can work on {support.where()} ({support.why}; a lease file cannot be "
                        f"made there either: {refused.strerror or refused}); put the run on a filesystem where Baton "
                        "can write (runs_root=...)")
    if support.method != "lease":
        return None
    return (f"{folder}: {support.where()} gives no cross-node lock ({support.why}); Baton keeps one controller per "
            f"run with a lease file instead (host, pid, Slurm job, a heartbeat every {lease_mod.HEARTBEAT_S:.0f} s; "
            f"taken over once its holder is silent {lease_mod.STALE_S:.0f} s or its job is over)")
