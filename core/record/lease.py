"""A lease file: the lock of a folder whose filesystem has no cross-node flock or fcntl.

``NAME.lease`` is created atomically (a hard link of a written scratch file: link fails
when the name exists, on NFS and Lustre too; ``O_CREAT|O_EXCL`` where links are refused)
and holds its holder as JSON::

    {"host": "node3", "pid": 4121, "job_id": "8123", "cluster": "alpha", "epoch": 1,
     "heartbeat": 1765000000.5, "token": "9f2c..."}

While held, a thread rewrites ``heartbeat`` every ``HEARTBEAT_S``. A holder is stale, and
its lease taken over, when its heartbeat is older than ``STALE_S``, when it is on this host
and its pid is gone, when it is an earlier start (epoch) of this same Slurm job (Slurm runs
one start of a job at a time), or when Slurm says its job is over (``scontrol``, a few
seconds at most; trusted only when the holder's Slurm cluster, ``SLURM_CLUSTER_NAME``, is the
asker's: a folder shared by two clusters must not read another cluster's live job as an
"invalid job id"). A holder whose heartbeat was taken over, or could not be written for
``STALE_S``, has lost its lease (``Lease.lost_reason``): its controller must stop committing. A takeover renames the stale lease aside and checks that what it moved
is the lease it judged (another contender may have replaced it meanwhile); release removes
the lease only while it is still this holder's.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from core.job import slurmctl

log = logging.getLogger(__name__)

HEARTBEAT_S = 15.0
STALE_S = 90.0  # six missed heartbeats; tolerates the clock skew NTP leaves between nodes


@dataclass(frozen=True, kw_only=True)
class Holder:
    """Who holds (or asks for) a lease."""

    host: str
    pid: int
    job_id: str | None = None
    cluster: str | None = None  # SLURM_CLUSTER_NAME: a job id means something on its own cluster only
    epoch: int = 0
    heartbeat: float = 0.0
    token: str = ""

    def describe(self) -> str:
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        return f"pid {self.pid} on {self.host} (epoch {self.epoch}{job})"


def me(*, job_id: str | None = None, epoch: int = 0) -> Holder:
    """This process as a holder."""
    return Holder(host=socket.gethostname(), pid=os.getpid(), job_id=job_id, epoch=epoch,
                  cluster=os.environ.get("SLURM_CLUSTER_NAME") or None, token=uuid.uuid4().hex)


def read_holder(path: Path) -> Holder | None:
    """The lease's holder; None when there is no lease or it is unreadable (being replaced)."""
    try:
        data = json.loads(path.read_bytes())
        return Holder(host=str(data["host"]), pid=int(data["pid"]), job_id=data.get("job_id"),
                      cluster=data.get("cluster"), epoch=int(data.get("epoch", 0)),
                      heartbeat=float(data["heartbeat"]), token=str(data["token"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def same_cluster(theirs: str | None, mine: str | None) -> bool:
    """Whether a holder of Slurm cluster ``theirs`` is on the asker's (``mine``; a login node
    outside a job asks scontrol for its ClusterName)."""
    if theirs == mine:
        return True
    if mine is None and theirs is not None and shutil.which("scontrol"):
        return slurmctl.local_cluster() == theirs
    return False


def stale_reason(holder: Holder, asker: Holder, now: float) -> str | None:
    """Why ``holder`` no longer holds its lease against ``asker``; None while it may be alive."""
    if holder.token == asker.token:
        return None
    age = now - holder.heartbeat
    if age > STALE_S:
        return f"its heartbeat is {age:.0f} s old (stale after {STALE_S:.0f} s)"
    if holder.host == asker.host and _pid_gone(holder.pid):
        return f"pid {holder.pid} has ended on this host"
    if not holder.job_id:
        return None
    if not same_cluster(holder.cluster, asker.cluster):
        return None  # another cluster's job: only its heartbeat says it is gone
    if holder.job_id == asker.job_id and holder.epoch < asker.epoch:
        return f"it is epoch {holder.epoch} of this same Slurm job {holder.job_id}, now at epoch {asker.epoch}"
    if holder.job_id != asker.job_id and shutil.which("scontrol") and slurmctl.job_over(holder.job_id):
        return f"Slurm says its job {holder.job_id} is over"
    return None


def _encode(holder: Holder) -> bytes:
    return (json.dumps(asdict(holder)) + "\n").encode()


def _write_new(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (a fresh scratch name), fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o660)  # teammates of the group read and take it
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _create(path: Path, data: bytes) -> bool:
    """Make ``path`` hold ``data`` if it does not exist: True when this call made it."""
    scratch = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    _write_new(scratch, data)
    try:
        os.link(scratch, path)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            return _create_exclusive(path, data)
        if os.stat(scratch).st_nlink == 2:  # NFS: the link was made, its reply lost
            return True
        raise
    finally:
        scratch.unlink(missing_ok=True)


def _create_exclusive(path: Path, data: bytes) -> bool:
    try:
        _write_new(path, data)
    except FileExistsError:
        return False
    return True


class Lease:
    """One holder's lease on ``path``: ``try_acquire``, then ``release``; heartbeats between."""

    def __init__(self, path: Path, holder: Holder) -> None:
        self.path = path
        self.holder = holder
        self.lost = False  # set when the heartbeat found another holder's lease in its place
        self._written = time.monotonic()  # when the heartbeat was last written (or the lease made)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def try_acquire(self) -> bool:
        """Take the lease if it is free or its holder stale; False while a live one holds it."""
        for _ in range(2):  # once more after a takeover
            if _create(self.path, _encode(self._now())):
                self._written = time.monotonic()
                self._start_heartbeat()
                return True
            current = read_holder(self.path)
            if current is None:
                if self._unreadable_for_long():
                    self._take_over(None, "its lease is unreadable and old")
                    continue
                return False
            why = stale_reason(current, self.holder, time.time())
            if why is None:
                return False
            self._take_over(current, why)
        return False

    def lost_reason(self) -> str | None:
        """Why this holder can no longer trust that it holds the lease; None while it does.
        Another holder took it over, or no heartbeat was written for ``STALE_S`` (others may
        take it over now; it holds again once a heartbeat finds its own lease in place)."""
        if self.lost:
            return f"another holder took over {self.path}"
        silent = time.monotonic() - self._written
        if self._thread is not None and silent > STALE_S:
            return f"no heartbeat written to {self.path} for {silent:.0f} s (others take it over after {STALE_S:.0f} s)"
        return None

    def current(self) -> Holder | None:
        return read_holder(self.path)

    def _now(self) -> Holder:
        return Holder(**{**asdict(self.holder), "heartbeat": time.time()})

    def _unreadable_for_long(self) -> bool:
        try:
            return time.time() - self.path.stat().st_mtime > STALE_S
        except FileNotFoundError:
            return False

    def _take_over(self, stale: Holder | None, why: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.{uuid.uuid4().hex}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another contender moved it first
        moved = read_holder(aside)
        if stale is not None and (moved is None or moved.token != stale.token):
            # Not the lease judged stale: a contender's fresh one. Put it back where it was.
            try:
                os.link(aside, self.path)
            except OSError as exc:
                log.warning("%s: could not put back a live lease (%s)", self.path, exc)
        else:
            log.warning("%s: took over the lease of %s: %s", self.path,
                        stale.describe() if stale else "an unknown holder", why)
        aside.unlink(missing_ok=True)

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"lease {self.path.name}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                current = read_holder(self.path)
                if current is None or current.token != self.holder.token:
                    self.lost = True
                    log.error("%s: this holder's lease was taken over (now %s)", self.path,
                              current.describe() if current else "no lease")
                    return
                scratch = self.path.with_name(f"{self.path.name}.{uuid.uuid4().hex}.tmp")
                _write_new(scratch, _encode(self._now()))
                os.replace(scratch, self.path)
                self._written = time.monotonic()
            except OSError as exc:  # a storage hiccup: the next beat tries again
                log.warning("%s: heartbeat not written: %s", self.path, exc)

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still this holder's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_S)
            self._thread = None
        current = read_holder(self.path)
        if current is not None and current.token == self.holder.token:
            self.path.unlink(missing_ok=True)


def can_create(folder: Path) -> OSError | None:
    """Whether a lease file can be made in ``folder``: None, or the error that refused it."""
    probe = folder / f".baton-leaseprobe.{uuid.uuid4().hex}"
    try:
        if not _create(probe, b"{}\n"):
            return OSError(errno.EEXIST, "a scratch name already exists")
    except OSError as exc:
        return exc
    probe.unlink(missing_ok=True)
    return None
