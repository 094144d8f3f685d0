"""Run-folder locks on every filesystem (core.record.fsprobe, lease, lock): mountinfo options
that make locks node-local, the errnos NFS and Lustre answer (injected at the lock call:
this machine's kernel has no NFS), real holders in other processes, stale leases."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.errors import UserError
from core.job import slurmctl
from core.record import fsprobe, lease, lock
from core.record.runfolder import RunFolder
from core.record.state import RunRecord
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(120)

# Lines as the kernel writes them (proc(5)), one per kind of mount a cluster has.
MOUNTINFO = "\n".join([
    "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
    "40 22 0:44 / /nfs/home rw,relatime shared:20 - nfs4 srv:/home rw,vers=4.2,local_lock=none,addr=10.0.0.1",
    "41 22 0:45 / /nfs/scratch rw,relatime - nfs srv:/scratch rw,vers=3,nolock,proto=tcp",
    "42 22 0:46 / /nfs/work rw,relatime - nfs4 srv:/work rw,vers=4.1,local_lock=flock",
    "43 22 0:47 / /lustre rw,relatime - lustre 10.0.0.2@o2ib:/fs rw,localflock,lazystatfs",
    "44 22 0:48 / /lustre2 rw,relatime - lustre 10.0.0.2@o2ib:/fs2 rw,noflock,lazystatfs",
    "45 22 0:49 / /lustre3 rw,relatime - lustre 10.0.0.2@o2ib:/fs3 rw,flock,lazystatfs",
    r"46 22 0:50 / /mnt/my\040runs rw - nfs srv:/runs rw,local_lock=all",
])


def _at(path: str) -> fsprobe.Mount:
    m = fsprobe.mount_of(Path(path), fsprobe.parse_mountinfo(MOUNTINFO))
    assert m is not None
    return m


def test_mountinfo_names_the_options_that_make_locks_node_local() -> None:
    assert fsprobe.node_local(_at("/nfs/home/u/runs")) == (set(), "")
    assert fsprobe.node_local(_at("/nfs/scratch/u")) == ({"flock", "fcntl"}, "nfs mounted nolock")
    assert fsprobe.node_local(_at("/nfs/work/x")) == ({"flock"}, "nfs4 mounted local_lock=flock")
    assert fsprobe.node_local(_at("/lustre/p/run")) == ({"flock", "fcntl"}, "lustre mounted localflock")
    assert fsprobe.node_local(_at("/lustre2/p")) == (set(), "")  # noflock: the calls themselves fail (probe)
    assert fsprobe.node_local(_at("/lustre3/p")) == (set(), "")
    spaced = _at("/mnt/my runs/a")  # \040 is a space
    assert spaced.point == "/mnt/my runs" and fsprobe.node_local(spaced)[0] == {"flock", "fcntl"}
    assert _at("/nfs/homework").fstype == "ext4"  # a prefix of the name is not the mount
    assert _at("/lustre2/p").option("noflock") == "" and _at("/nfs/home").option("vers") == "4.2"


def test_a_node_local_mount_is_given_the_lease_even_where_the_calls_work(tmp_path: Path) -> None:
    nolock = f"30 1 0:60 / {tmp_path} rw - nfs srv:/x rw,nolock\n"
    support = fsprobe.probe(tmp_path, mountinfo=nolock)
    assert support.method == "lease" and "nolock" in support.why
    posix_local = f"30 1 0:60 / {tmp_path} rw - nfs srv:/x rw,local_lock=posix\n"
    assert fsprobe.probe(tmp_path, mountinfo=posix_local).method == "flock"  # flock still goes to the server
    flock_local = f"30 1 0:60 / {tmp_path} rw - nfs4 srv:/x rw,local_lock=flock\n"
    assert fsprobe.probe(tmp_path, mountinfo=flock_local).method == "fcntl"
    assert list(tmp_path.iterdir()) == []  # the probe's scratch file is gone


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    fsprobe.forget()
    yield
    fsprobe.forget()


def _hold(path: Path, method: str) -> subprocess.Popen[str]:
    """Another process holding ``path`` by ``method`` until its stdin closes."""
    call = "fcntl.flock(fd, fcntl.LOCK_EX)" if method == "flock" else "fcntl.lockf(fd, fcntl.LOCK_EX)"
    code = (f"import fcntl, os, sys\nfd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT, 0o600)\n{call}\n"
            "print('held', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _end(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def test_enolck_from_flock_falls_back_to_an_fcntl_lock_that_excludes_another_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_probe: None) -> None:
    def no_flock(fd: int, op: int) -> None:  # NFS without NLM (lockd down): flock answers ENOLCK
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    path = tmp_path / "state.lock"
    holder = _hold(path, "fcntl")  # a real fcntl holder in another process
    try:
        first = lock.FileLock(path)
        assert first.support.method == "fcntl" and "flock unsupported" in first.support.why
        assert not first.try_acquire()
    finally:
        _end(holder)
    second = lock.FileLock(path)
    assert second.try_acquire() and second.method == "fcntl"
    other = subprocess.run([sys.executable, "-c", f"import fcntl, os\nfd = os.open({str(path)!r}, os.O_RDWR)\n"
                            "try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError as e:\n"
                            "    print('refused', e.errno)\nelse:\n    print('got it')\n"],
                           capture_output=True, text=True, timeout=30)
    assert other.stdout.split()[0] == "refused", other.stdout + other.stderr
    second.release()


def _nfs_flock(real: object) -> object:
    """flock as NFS gives it: emulated with fcntl locks, so a fd opened read-only is EBADF."""
    def flock(fd: int, op: int) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        real(fd, op)  # type: ignore[operator]
    return flock


def test_on_nfs_the_login_node_sees_a_live_controller_without_ebadf(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_probe: None) -> None:
    monkeypatch.setattr(fcntl, "flock", _nfs_flock(fcntl.flock))
    run = RunFolder(tmp_path)
    (tmp_path / "controller.json").write_text(json.dumps({"pid": 4242, "node": "node7", "epoch": 3}))
    holder = _hold(tmp_path / "controller.lock", "flock")
    try:
        assert lock.controller_alive(run) == "pid 4242 on node7 (epoch 3)"
    finally:
        _end(holder)
    assert lock.controller_alive(run) is None
    with lock.controller_lock(run) as held:
        assert held.method == "flock"
        assert lock.controller_alive(run) is not None  # this process holds it


def test_a_controller_of_a_live_job_is_refused_at_once_naming_it(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    (tmp_path / "controller.json").write_text(json.dumps({"pid": 11, "node": "n1", "epoch": 0, "job_id": None}))
    holder = _hold(tmp_path / "controller.lock", "flock")
    try:
        with pytest.raises(UserError, match=r"another controller runs this run \(pid 11 on n1 \(epoch 0\)\)"):
            with lock.controller_lock(run, job_id="90", epoch=0, wait_s=600):
                pass
    finally:
        _end(holder)


def test_a_requeued_controller_sets_the_lock_of_its_jobs_earlier_start_aside(tmp_path: Path) -> None:
    """An NLM lock of a crashed node lasts until that node reboots: the next start of the same
    Slurm job renames the lock file aside (kept) and locks a fresh inode instead of waiting."""
    run = RunFolder(tmp_path)
    (tmp_path / "controller.json").write_text(json.dumps({"pid": 11, "node": "n1", "epoch": 0, "job_id": "77"}))
    holder = _hold(tmp_path / "controller.lock", "flock")  # the dead node's lock, still granted
    try:
        old = os.stat(tmp_path / "controller.lock").st_ino
        with lock.controller_lock(run, job_id="77", epoch=1, wait_s=0) as held:
            assert held.method == "flock"
            assert os.stat(tmp_path / "controller.lock").st_ino != old
            (aside,) = tmp_path.glob("controller.lock.stale-*")
            assert aside.stat().st_ino == old  # kept, not deleted
            assert lease.read_holder(tmp_path / "controller.lease").epoch == 1  # type: ignore[union-attr]
    finally:
        _end(holder)


def test_a_holder_of_another_cluster_is_never_judged_over_by_its_job_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunFolder(tmp_path)
    (tmp_path / "controller.json").write_text(json.dumps({"pid": 11, "node": "n1", "epoch": 0, "job_id": "77",
                                                          "cluster": "beta"}))
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "alpha")  # job 77 of cluster alpha is another job
    holder = _hold(tmp_path / "controller.lock", "flock")
    try:
        with pytest.raises(UserError, match="another controller runs this run"):
            with lock.controller_lock(run, job_id="77", epoch=1, wait_s=0):
                pass
        assert list(tmp_path.glob("controller.lock.stale-*")) == []
    finally:
        _end(holder)


def test_a_taker_that_locked_a_file_renamed_aside_meanwhile_locks_the_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A contender opens controller.lock, another renames it aside before the first locks: the
    first must not believe it holds the lock on an inode the path no longer names."""
    path = tmp_path / "controller.lock"
    path.touch()
    real_open, opened = os.open, []

    def open_then_renamed(name: object, flags: int, mode: int = 0o777) -> int:
        fd = real_open(name, flags, mode)  # type: ignore[arg-type]
        if not opened:
            opened.append(fd)
            os.rename(path, tmp_path / "controller.lock.stale-x")
        return fd

    taker = lock.FileLock(path)  # probed before
    monkeypatch.setattr(lock.os, "open", open_then_renamed)
    assert taker.try_acquire() and opened
    assert taker._fd is not None and os.fstat(taker._fd).st_ino == os.stat(path).st_ino
    taker.release()


def test_job_over_reads_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    def answers(rc: int, out: str, err: str = "") -> slurmctl.Runner:
        return lambda args: subprocess.CompletedProcess(list(args), rc, out, err)

    running = "JobId=5 HetJobId=5 JobState=RUNNING Restarts=0\nJobId=6 HetJobId=5 JobState=RUNNING Restarts=0\n"
    done = "JobId=5 JobState=COMPLETED Restarts=0\nJobId=6 JobState=CANCELLED Restarts=0\n"
    assert slurmctl.job_over("5", answers(0, running)) is False
    assert slurmctl.job_over("5", answers(0, "JobId=5 JobState=COMPLETED\nJobId=6 JobState=COMPLETING\n")) is False
    assert slurmctl.job_over("5", answers(0, done)) is True
    assert slurmctl.job_over("5", answers(1, "", "slurm_load_jobs error: Invalid job id specified")) is True
    assert slurmctl.job_over("5", answers(1, "", "slurm_load_jobs error: Unable to contact slurm controller")) is None


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def _lease_of(path: Path, **kw: object) -> lease.Holder:
    h = lease.Holder(**{"host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time(),
                        "token": "theirs", **kw})  # type: ignore[arg-type]
    path.write_text(json.dumps(h.__dict__))
    return h


def test_a_lease_of_a_finished_holder_is_taken_over_and_a_live_one_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "controller.lease"
    asker = lease.me(job_id="200", epoch=0)
    _lease_of(path)  # this process's pid: alive, fresh heartbeat, no job
    assert not lease.Lease(path, asker).try_acquire()
    assert lease.read_holder(path).token == "theirs"  # type: ignore[union-attr]

    cases = [dict(pid=_dead_pid()),  # its pid has ended on this host
             dict(host="node-gone", heartbeat=time.time() - lease.STALE_S - 5),  # silent too long
             dict(host="node-gone", job_id="200", epoch=0)]  # ... an earlier start of the asker's job, below
    for kw in cases[:2]:
        _lease_of(path, **kw)
        taker = lease.Lease(path, asker)
        assert taker.try_acquire(), kw
        assert lease.read_holder(path).token == asker.token  # type: ignore[union-attr]
        taker.release()
        assert not path.exists()
    _lease_of(path, **cases[2])
    assert not lease.Lease(path, asker).try_acquire()  # the same start of the same job: alive
    assert lease.Lease(path, lease.me(job_id="200", epoch=1)).try_acquire()  # its requeue takes over

    # A holder on another node whose Slurm job is over (scontrol faked at its process boundary).
    states = {"300": "JobId=300 JobState=RUNNING\n", "301": "JobId=301 JobState=NODE_FAIL\n"}
    monkeypatch.setattr(slurmctl, "_quick", lambda args: subprocess.CompletedProcess(args, 0, states[args[-1]], ""))
    monkeypatch.setattr(lease.shutil, "which", lambda name: "/usr/bin/" + name)
    path.unlink()
    _lease_of(path, host="node-far", job_id="300")
    assert not lease.Lease(path, asker).try_acquire()
    _lease_of(path, host="node-far", job_id="301")
    assert lease.Lease(path, asker).try_acquire()


def test_a_lease_keeps_its_heartbeat_and_is_released_only_by_its_holder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease, "HEARTBEAT_S", 0.05)
    path = tmp_path / "state.lease"
    mine = lease.Lease(path, lease.me())
    assert mine.try_acquire()
    first = lease.read_holder(path).heartbeat  # type: ignore[union-attr]
    wait_for(lambda: (h := lease.read_holder(path)) is not None and h.heartbeat > first, 10, "a newer heartbeat")
    lease.Lease(path, lease.me()).release()  # not its holder: nothing removed
    assert lease.read_holder(path).token == mine.holder.token  # type: ignore[union-attr]
    mine.release()
    assert not path.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("method", ["flock", "fcntl", "lease"])
def test_run_record_updates_from_several_processes_lose_none(tmp_path: Path, method: str) -> None:
    """The state lock excludes writers in other processes by each kind (each process's probe
    answer set to ``method``; the lease is also shown on a real mount without flock)."""
    code = ("import sys\nfrom pathlib import Path\nfrom core.record import fsprobe\n"
            f"fsprobe._CACHE[str(Path({str(tmp_path)!r}).resolve())] = fsprobe.Support({method!r}, None, 'test')\n"
            "from core.record.runfolder import RunFolder\nfrom core.record.state import RunRecord\n"
            f"r = RunRecord(RunFolder(Path({str(tmp_path)!r})))\n"
            "for _ in range(40):\n    with r.update() as s:\n        s.step += 1\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3)]
    assert [p.wait(timeout=100) for p in procs] == [0, 0, 0]
    assert RunRecord(RunFolder(tmp_path)).read().step == 120
    assert not (tmp_path / "state.lease").exists()


def test_submit_notice_names_the_folder_and_why(tmp_path: Path, fresh_probe: None) -> None:
    assert lock.cross_node_notice(tmp_path / "runs" / "new") is None  # a local disk: flock works
    fsprobe._CACHE[str(tmp_path.resolve())] = fsprobe.Support(
        "lease", fsprobe.Mount(point=str(tmp_path), fstype="lustre", source="fs", options=frozenset({"localflock"})),
        "flock and fcntl node-local (lustre mounted localflock)")
    line = lock.cross_node_notice(tmp_path / "runs" / "new")
    assert line is not None and "\n" not in line
    assert str(tmp_path / "runs" / "new") in line and "lustre at" in line and "localflock" in line and "lease" in line


def test_submit_refuses_where_no_lock_can_work(tmp_path: Path, fresh_probe: None) -> None:
    """A read-only mount (a real tmpfs, mounted read-only): neither a lock call nor a lease file."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        with pytest.raises(UserError, match=r"no lock can work .*a lease file cannot be made there either: "
                                            r"Read-only file system"):
            lock.cross_node_notice(ro / "runs")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_sweep_ledger_changes_from_several_processes_lose_none(tmp_path: Path) -> None:
    """Two `baton sweep` commands on one sweep (two login nodes): each changes its own points,
    and none of the other's changes is lost (sweep.json's read-modify-write under sweep.lock)."""
    from launcher import ledger as ledger_mod

    points = tuple(ledger_mod.Entry(index=i, params={"seed": i}, run_id=f"p{i}", run_dir=f"/nowhere/p{i}")
                   for i in range(6))
    ledger_mod.write_ledger(tmp_path, ledger_mod.Ledger(name="sw", sweep_file="/x/sw.yaml", created=1.0,
                                                        backend="slurm", base={}, points=points))
    code = ("import sys\nfrom dataclasses import replace\nfrom pathlib import Path\nfrom launcher import ledger as L\n"
            f"d = Path({str(tmp_path)!r})\nmine = [int(i) for i in sys.argv[1:]]\n"
            "for n in range(1, 16):\n    for i in mine:\n"
            "        e = L.read_ledger(d).points[i]\n        L.store_entry(d, replace(e, submissions=n))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(a), str(b)], env=env) for a, b in ((0, 1), (2, 3), (4, 5))]
    assert [p.wait(timeout=100) for p in procs] == [0, 0, 0]
    assert [e.submissions for e in ledger_mod.read_ledger(tmp_path).points] == [15] * 6


def test_a_node_that_leases_sees_and_is_refused_by_a_controller_holding_a_kernel_lock(
        tmp_path: Path, fresh_probe: None) -> None:
    """NFSv3 with lockd down on the login node (ENOLCK: it leases) while the compute nodes
    flock: the controller also holds controller.lease, so the leasing node sees it alive."""
    run = RunFolder(tmp_path)
    (tmp_path / "controller.json").write_text(json.dumps({"pid": 12, "node": "c1", "epoch": 0}))
    code = ("import sys\nfrom pathlib import Path\nfrom core.record import lock\nfrom core.record.runfolder import "
            f"RunFolder\nwith lock.controller_lock(RunFolder(Path({str(tmp_path)!r}))) as held:\n"
            "    print(held.method, flush=True)\n    sys.stdin.read()\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "flock"
        fsprobe._CACHE[str(tmp_path.resolve())] = fsprobe.Support("lease", None, "flock and fcntl unsupported")
        assert lock.controller_alive(run) == "pid 12 on c1 (epoch 0)"
        with pytest.raises(UserError, match="another controller runs this run"):
            with lock.controller_lock(run):
                pass
    finally:
        _end(proc)
    assert lock.controller_alive(run) is None  # its lease went with it
    assert not (tmp_path / "controller.lease").exists()


def test_a_controller_whose_lease_was_taken_over_commits_nothing_more(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An NFS stall longer than STALE_S: another controller took the lease over. The old one
    is fenced: its next step boundary and any commit raise ControllerLockLost."""
    from core.checkpoint import commit as commit_mod
    from core.controller.stop import StopPolicy

    monkeypatch.setattr(lease, "HEARTBEAT_S", 0.05)
    run = RunFolder(tmp_path)
    with lock.controller_lock(run, job_id="5", epoch=0) as held:
        assert not held.taken_over()
        lock.check_fence()  # held: nothing raised
        assert StopPolicy(None, None).check(step_s=1.0, save_s=None) is None
        _lease_of(tmp_path / "controller.lease", host="node-new", job_id="5", epoch=1)  # the takeover
        wait_for(lambda: lease.read_holder(tmp_path / "controller.lease") is not None
                 and _raises(lock.check_fence), 10, "the fence to close")
        assert held.taken_over()  # not a mere stall: the controller exits as refused, requeueing nothing
        with pytest.raises(lock.ControllerLockLost, match="another holder took over"):
            StopPolicy(None, None).check(step_s=1.0, save_s=None)
        (tmp_path / "tmp_step").mkdir()
        with pytest.raises(lock.ControllerLockLost):
            commit_mod.commit(tmp_path / "checkpoints", 10, tmp_path / "tmp_step", [], {})
        assert not (tmp_path / "checkpoints").exists()
    assert lease.read_holder(tmp_path / "controller.lease").host == "node-new"  # type: ignore[union-attr]
    lock.check_fence()  # released: no fence left in this process


def test_a_lease_not_heartbeaten_for_stale_s_is_lost_until_a_beat_finds_it_still_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease, "STALE_S", 0.2)
    monkeypatch.setattr(lease, "HEARTBEAT_S", 3600.0)  # the storage stalls: no beat is written
    mine = lease.Lease(tmp_path / "x.lease", lease.me())
    assert mine.try_acquire() and mine.lost_reason() is None
    wait_for(mine.lost_reason, 10, "the silent lease to count as lost")
    assert "no heartbeat written" in mine.lost_reason()  # type: ignore[operator]
    mine.release()


def _raises(call: object) -> bool:
    try:
        call()  # type: ignore[operator]
    except lock.ControllerLockLost:
        return True
    return False


@pytest.mark.parametrize(("err", "kind"), [(errno.EIO, "transient"), (errno.ESTALE, "transient"),
                                           (errno.EACCES, "user"), (errno.EROFS, "user")])
def test_lock_errors_are_one_line_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_probe: None, err: int, kind: str) -> None:
    from core.errors import RunFolderError, TransientIOError

    expected = TransientIOError if kind == "transient" else RunFolderError
    lock.FileLock(tmp_path / "controller.lock")  # probed before the faults
    (tmp_path / "controller.lock").touch()
    real_open = os.open

    def failing_open(name: object, flags: int, mode: int = 0o777) -> int:
        if str(name).endswith("controller.lock"):
            raise OSError(err, os.strerror(err))
        return real_open(name, flags, mode)  # type: ignore[arg-type]

    with monkeypatch.context() as m:  # a teammate's 0600 file (EACCES), a read-only mount (EROFS) ...
        m.setattr(lock.os, "open", failing_open)
        with pytest.raises(expected, match=rf"controller.lock: cannot lock \({os.strerror(err)}\)") as got:
            lock.controller_alive(RunFolder(tmp_path))
        assert "\n" not in str(got.value)
    if kind == "transient":  # ... and the lock call itself (EIO or ESTALE from the NFS server)
        def failing_flock(fd: int, op: int) -> None:
            raise OSError(err, os.strerror(err))

        monkeypatch.setattr(fcntl, "flock", failing_flock)
        with pytest.raises(TransientIOError, match="cannot lock"):
            with lock.controller_lock(RunFolder(tmp_path)):
                pass


def test_the_probe_maps_a_full_quota_and_a_denied_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_probe: None) -> None:
    from core.errors import RunFolderError, TransientIOError

    for err, expected in ((errno.EDQUOT, TransientIOError), (errno.EACCES, RunFolderError)):
        def refuse(name: object, flags: int, mode: int = 0o777, err: int = err) -> int:
            raise OSError(err, os.strerror(err))

        with monkeypatch.context() as m:
            m.setattr(fsprobe.os, "open", refuse)
            with pytest.raises(expected, match=rf"{tmp_path}: cannot lock \({os.strerror(err)}\)"):
                fsprobe.probe(tmp_path)
    made = lock.FileLock(tmp_path / "state.lock")  # teammates of the group may take it: 0o660 less the umask
    assert made.try_acquire()
    assert (tmp_path / "state.lock").stat().st_mode & 0o777 == 0o660 & ~_umask()
    made.release()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_slurm_is_asked_about_a_holder_only_on_its_own_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two clusters share the filesystem: the other cluster's job id is "invalid" here, yet alive."""
    def scontrol(args: list[str]) -> subprocess.CompletedProcess[str]:
        if args[1:3] == ["show", "config"]:  # a login node outside a job asks its ClusterName
            return subprocess.CompletedProcess(args, 0, "ClusterName             = alpha\nSlurmUser = slurm\n", "")
        return subprocess.CompletedProcess(args, 1, "", "slurm_load_jobs error: Invalid job id specified")

    monkeypatch.setattr(slurmctl, "_quick", scontrol)
    monkeypatch.setattr(slurmctl, "_CLUSTER", [])
    monkeypatch.setattr(lease.shutil, "which", lambda name: "/usr/bin/" + name)
    theirs = lease.Holder(host="far", pid=1, job_id="900", cluster="beta", heartbeat=time.time(), token="t")
    same = lease.Holder(**{**theirs.__dict__, "cluster": "alpha"})
    for env in ("alpha", None):  # inside a job of cluster alpha; on alpha's login node
        if env is None:
            monkeypatch.delenv("SLURM_CLUSTER_NAME", raising=False)
        else:
            monkeypatch.setenv("SLURM_CLUSTER_NAME", env)
        assert lease.stale_reason(theirs, lease.me(job_id="901"), time.time()) is None  # another cluster's: alive
        assert "Slurm says its job 900 is over" == lease.stale_reason(same, lease.me(job_id="901"), time.time())
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "beta")  # the same job id on another cluster is not an earlier epoch
    assert lease.stale_reason(lease.Holder(**{**same.__dict__, "job_id": "901"}), lease.me(job_id="901", epoch=1),
                              time.time()) is None
