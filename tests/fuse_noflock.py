"""A passthrough FUSE filesystem whose lock operations answer ENOSYS: a mount without flock.

Lustre mounted with its default ``noflock`` answers every flock(2) and fcntl(2) lock
with ENOSYS; this filesystem does the same through the kernel's FUSE layer (its ``flock``
and ``lock`` operations are defined and refuse, so the kernel forwards each lock request
instead of keeping it node-local). Everything else passes through to a backing folder.

Run as ``python -m tests.fuse_noflock BACKING MOUNTPOINT`` (foreground; needs /dev/fuse
and root, as CI has); ``mounted`` is the context manager tests use: it starts the process,
waits for the mount, and unmounts at the end.
"""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Passthrough:
    """Every call on ``root`` + path; the lock calls refused like Lustre's ``noflock``. Mixed
    into mfusepy's ``Operations`` by ``main`` (only the filesystem process imports mfusepy);
    an OSError's errno is what the caller gets."""

    use_ns = True

    def __init__(self, root: str) -> None:
        self.root = root

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
        st = os.lstat(self._p(path))
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
        return {k.removesuffix("_ns"): getattr(st, k) for k in keys}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._p(path))]

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._p(path), amode):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return 0

    def open(self, path: str, flags: int) -> int:
        return os.open(self._p(path), flags)

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._p(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        os.truncate(self._p(path), length)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        os.fsync(fh)
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._p(path))
        return 0

    def rename(self, old: str, new: str) -> int:
        os.rename(self._p(old), self._p(new))
        return 0

    def link(self, target: str, source: str) -> int:
        os.link(self._p(source), self._p(target))
        return 0

    def symlink(self, target: str, source: str) -> int:
        os.symlink(source, self._p(target))
        return 0

    def readlink(self, path: str) -> str:
        return os.readlink(self._p(path))

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._p(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._p(path))
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._p(path), mode)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        os.utime(self._p(path), ns=times)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._p(path))
        return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                             "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    def flock(self, path: str, fh: int, op: int) -> int:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    def lock(self, path: str, fh: int, cmd: int, lock: Any) -> int:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))


def is_mounted(mountpoint: Path) -> bool:
    """``mountpoint`` is a FUSE mount in /proc/self/mountinfo."""
    target = str(mountpoint)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target and " - fuse" in line for line in f)


@contextlib.contextmanager
def mounted(backing: Path, mountpoint: Path, timeout_s: float = 30.0) -> Iterator[Path]:
    """The filesystem mounted on ``mountpoint`` (created) over ``backing``; unmounted after."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    backing.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-m", "tests.fuse_noflock", str(backing), str(mountpoint)], cwd=repo,
                            env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not is_mounted(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the FUSE mount on {mountpoint} did not come up: {proc.communicate()[0][-2000:]}")
            time.sleep(0.05)
        yield mountpoint
    finally:
        if is_mounted(mountpoint):
            subprocess.run(["umount", "-l", str(mountpoint)], check=False, capture_output=True)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def main(argv: list[str]) -> None:
    import mfusepy as fuse

    backing, mountpoint = argv
    ops = type("NoflockPassthrough", (Passthrough, fuse.Operations), {})(os.path.abspath(backing))
    # default_permissions: the kernel checks modes; no allow_other: only root uses it (as CI runs).
    fuse.FUSE(ops, mountpoint, foreground=True, nothreads=False,
              fsname="baton-noflock", default_permissions=True)


if __name__ == "__main__":
    main(sys.argv[1:])
