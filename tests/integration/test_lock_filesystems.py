"""Locking on a real filesystem without flock (a FUSE mount whose flock and fcntl calls answer
ENOSYS, as Lustre's default ``noflock`` does; tests/fuse_noflock.py).

NFS: this machine's kernel (and CI's, the same kind of VM) has no nfs filesystem
(/proc/filesystems lists none, no module to load), so a kernel NFS mount cannot run here;
tests/unit/test_lock.py injects the exact errnos NFS answers (EBADF for flock on a
read-only fd, ENOLCK without NLM) at the flock call instead, and parses the mountinfo
lines of NFS ``nolock``/``local_lock=`` and Lustre ``localflock``/``noflock`` mounts."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from core.record import fsprobe, lease
from core.record.runfolder import RunFolder
from core.record.state import RunRecord
from tests.helpers import REPO, baton, run_folder, wait_for

pytestmark = pytest.mark.timeout(300)
FAST = ["timeouts.heartbeat_interval_s=0.1", "timeouts.heartbeat_timeout_s=1.5", "timeouts.controller_lost_s=3",
        "recovery.backoff_s=0.1"]


def _fresh(mount: Path) -> Path:
    path = mount / uuid.uuid4().hex[:8]
    path.mkdir()
    return path


def test_lock_calls_answer_enosys_on_the_mount_and_the_probe_picks_the_lease(noflock_mount: Path) -> None:
    folder = _fresh(noflock_mount)
    fd = os.open(folder / "x.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for call in (fcntl.flock, fcntl.lockf):
            with pytest.raises(OSError) as err:
                call(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert err.value.errno == errno.ENOSYS  # what the kernel's FUSE layer gives the caller
    finally:
        os.close(fd)
    support = fsprobe.probe(folder)
    assert support.method == "lease" and support.why == "flock and fcntl unsupported"
    assert support.mount is not None and support.mount.fstype == "fuse" and support.mount.point == str(noflock_mount)


def test_record_updates_from_several_processes_lose_none_on_the_mount(noflock_mount: Path) -> None:
    folder = _fresh(noflock_mount)
    code = ("from pathlib import Path\nfrom core.record.runfolder import RunFolder\n"
            "from core.record.state import RunRecord\n"
            f"r = RunRecord(RunFolder(Path({str(folder)!r})))\n"
            "for _ in range(25):\n    with r.update() as s:\n        s.step += 1\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)})
             for _ in range(3)]
    assert [p.wait(timeout=200) for p in procs] == [0, 0, 0]
    assert RunRecord(RunFolder(folder)).read().step == 75
    assert sorted(p.name for p in folder.iterdir()) == ["state.json"]  # no lease, probe or scratch file left


def _warning(stderr: str, folder: Path) -> None:
    lines = [ln for ln in stderr.splitlines() if "no cross-node lock" in ln]
    assert len(lines) == 1, stderr
    assert str(folder) in lines[0] and "fuse at" in lines[0] and "unsupported" in lines[0] and "lease" in lines[0]


@pytest.mark.slow
def test_a_run_on_the_mount_submits_resumes_refuses_a_second_controller_and_takes_over_a_dead_ones_lease(
        noflock_mount: Path) -> None:
    root = _fresh(noflock_mount)
    first = baton("submit", "experiments/toy.yaml", f"runs_root={root}", "trainer.steps=20",
                  "checkpoint.interval_steps=10", *FAST, "--backend", "local")
    assert first.returncode == 0, first.stdout + first.stderr
    _warning(first.stderr, root)
    run = run_folder(first)
    assert json.loads((run / "state.json").read_text())["status"] == "completed"
    assert not (run / "controller.lease").exists()  # released at the end
    before = _snapshot(run)
    dry = baton("submit", "--resume", str(run), "trainer.steps=30", "--backend", "slurm", "--dry-run")
    assert dry.returncode == 0 and "#SBATCH" in dry.stdout, dry.stderr
    _warning(dry.stderr, run)  # said before anything would be written; and nothing was
    assert _snapshot(run) == before

    args = [sys.executable, "-m", "launcher.cli", "submit", "--resume", str(run), "trainer.steps=100000000",
            "recovery.max_retries=3", "--backend", "local"]
    out = (root / "resume.out").open("w")
    resumed = subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
                               stderr=subprocess.STDOUT, text=True)
    try:
        started = wait_for(lambda: (c := _controller(run)) and c["epoch"] == 1 and c, 60, "the resumed controller")
        wait_for(lambda: json.loads((run / "state.json").read_text()).get("step", 0) > 23, 60, "the resume to train")
        held = lease.read_holder(run / "controller.lease")
        assert held is not None and held.pid == started["pid"]

        refused = baton("submit", "--resume", str(run), "--backend", "local")
        assert refused.returncode == 2 and f"its controller still runs (pid {started['pid']}" in refused.stderr
        _warning(refused.stderr, run)
        env = {**os.environ, "PYTHONPATH": str(REPO), "BATON_RUN_DIR": str(run), "BATON_EPOCH": "7"}
        second = subprocess.run([sys.executable, "-m", "core.entrypoint", "controller"], env=env, cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and f"another controller runs this run (pid {started['pid']}" in second.stderr

        # The controller dies without a word (SIGKILL): its lease stays, naming a pid that is gone.
        os.kill(started["pid"], signal.SIGKILL)
        again = wait_for(lambda: (c := _controller(run)) and c["pid"] != started["pid"] and c, 90,
                         "the supervisor's next controller")
        step = json.loads((run / "state.json").read_text())["step"]
        wait_for(lambda: json.loads((run / "state.json").read_text()).get("step", 0) > step + 3, 60,
                 "the next controller to train")
        now = lease.read_holder(run / "controller.lease")
        assert now is not None and now.pid == again["pid"]
    finally:
        resumed.send_signal(signal.SIGINT)  # the CLI ends its own children
        try:
            resumed.wait(timeout=60)
        finally:
            if resumed.poll() is None:
                resumed.kill()
                resumed.wait()
            out.close()
    assert f"took over the lease of pid {started['pid']} on" in RunFolder(run).controller_log.read_text()


def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file of the run folder but the logs and the locks' own files (a lease comes and goes)."""
    out = {}
    for p in sorted(run.rglob("*")):
        if "logs" in p.parts or ".lease" in p.name or p.name.startswith(".baton-"):
            continue
        if p.is_file():
            out[str(p.relative_to(run))] = p.read_bytes()
    return out


def _controller(run: Path) -> dict | None:
    try:
        return json.loads((run / "controller.json").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.slurm
def test_a_lease_of_a_job_that_slurm_says_is_over_is_taken_over(
        slurm_cluster: str, slurm_jobs: list[int], noflock_mount: Path) -> None:
    """The holder ran on another node (its pid cannot be asked) and its heartbeat is fresh (the
    node died a moment ago): only Slurm can tell it is over, and then it does not block."""
    from tests.integration import slurm_helpers

    done = slurm_helpers.sbatch("--wrap=true", "-o", "/dev/null")  # a real job that ends at once
    slurm_jobs.append(done)
    live = slurm_helpers.sbatch("--wrap=sleep 300", "-o", "/dev/null")  # pending or running: not over
    slurm_jobs.append(live)
    wait_for(lambda: slurm_helpers.job_field(done, "JobState") == "COMPLETED", 120, f"job {done} to complete")
    path = _fresh(noflock_mount) / "controller.lease"
    asker = lease.me(job_id="999999", epoch=0)
    for job, taken in ((live, False), (done, True)):
        theirs = lease.Holder(host="node-far", pid=1, job_id=str(job), heartbeat=time.time(), token="t")
        path.write_text(json.dumps(theirs.__dict__))
        mine = lease.Lease(path, asker)
        assert mine.try_acquire() is taken, job
        assert lease.read_holder(path).token == (asker.token if taken else "t")  # type: ignore[union-attr]
        mine.release()


def test_a_refused_controller_on_slurm_writes_nothing_into_the_live_runs_record(tmp_path: Path) -> None:
    """Component 0 of a second job on a live run: refused at the lock, before it records its Slurm task."""
    from tests.helpers import make_run

    run = make_run(tmp_path, "toy.yaml", []).run
    before = run.state.read_bytes()
    (run.path / "controller.json").write_text(json.dumps({"pid": 31, "node": "n1", "epoch": 0, "job_id": None}))
    code = f"import fcntl, os, sys\nfd = os.open({str(run.path / 'controller.lock')!r}, os.O_RDWR | os.O_CREAT)\n" \
           "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\nsys.stdin.read()\n"
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        env = {**os.environ, "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "5550", "SLURM_RESTART_COUNT": "0"}
        second = subprocess.run([sys.executable, "-c", "import sys\nfrom core.controller.main import run_on_slurm\n"
                                 f"run_on_slurm({str(run.path)!r})"], env=env, cwd=REPO, capture_output=True,
                                text=True, timeout=60)
    finally:
        holder.communicate("", timeout=30)
    assert second.returncode != 0 and "another controller runs this run (pid 31 on n1" in second.stderr, second.stderr
    assert run.state.read_bytes() == before  # no state.slurm of job 5550 in the live run's record


@pytest.mark.slow
def test_a_controller_whose_lease_another_took_over_stops_and_commits_nothing_more(tmp_path: Path) -> None:
    """An NFS stall longer than STALE_S let another controller take the lease over: the old one
    (a real toy run) sees it at its next heartbeat, records `controller_fenced`, commits no
    further checkpoint and leaves the run to the other (its supervisor requeues nothing)."""
    args = [sys.executable, "-m", "launcher.cli", "submit", "experiments/toy.yaml", f"runs_root={tmp_path}",
            "trainer.steps=100000000", "checkpoint.interval_steps=5", *FAST, "--backend", "local"]
    out = (tmp_path / "submit.out").open("w")
    proc = subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
                            stderr=subprocess.STDOUT, text=True)
    try:
        run = wait_for(lambda: next((p.parent for p in tmp_path.glob("*/*/controller.lease")), None)
                       or next((p.parent for p in tmp_path.glob("*/controller.lease")), None), 60, "the lease")
        wait_for(lambda: (run / "checkpoints" / "latest").exists(), 60, "a first checkpoint")
        theirs = {"host": "node-new", "pid": 1, "job_id": None, "cluster": None, "epoch": 1, "token": "theirs"}

        def taken() -> bool:  # the other controller's lease, heartbeaten (a beat of the old one may race it)
            if proc.poll() is not None:
                return True
            held = lease.read_holder(run / "controller.lease")
            if held is None or held.token != "theirs" or time.time() - held.heartbeat > 5:
                (run / "controller.lease.tmp-test").write_text(json.dumps({**theirs, "heartbeat": time.time()}))
                os.replace(run / "controller.lease.tmp-test", run / "controller.lease")
            return False

        wait_for(taken, 120, "the old controller's launcher to end", interval_s=0.5)
        fenced_at = time.time()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        out.close()
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    kinds = [e["event"] for e in events]
    assert "controller_fenced" in kinds, (tmp_path / "submit.out").read_text()[-3000:]
    fenced = events[kinds.index("controller_fenced")]
    assert "another holder took over" in fenced["reason"]
    after = [e for e in events[kinds.index("controller_fenced"):] if e["event"] in (
        "checkpoint_committed", "requeued", "failed", "completed", "stopped", "controller_started")]
    assert after == []  # nothing committed, requeued or ended by the fenced controller or its launcher
    assert all(e["time"] <= fenced["time"] for e in events if e["event"] == "checkpoint_committed")
    assert fenced["time"] <= fenced_at
    assert lease.read_holder(run / "controller.lease").token == "theirs"  # type: ignore[union-attr]
