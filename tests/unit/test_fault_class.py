"""Faults classified by cause (core.errors.fault_class) over real exceptions: a TCP reset, a
full tmpfs, h5py on a full tmpfs, gloo's timeout, a failing reward; the recovery policy
(core.controller.recovery.deterministic) over RemoteErrors built as the controller builds
them (diagnose.remote_error) from the Errors workers send (runtime.error_of); shard writes and
commits on a real tmpfs that fills."""
from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from core.checkpoint import hdf5, manifest
from core.checkpoint.commit import commit, tmp_step_dir
from core.checkpoint.hdf5 import write_shard
from core.checkpoint.spec import TensorSlice
from core.controller.diagnose import remote_error
from core.controller.recovery import deterministic, signature
from core.errors import CheckpointError, RewardError, TransientIOError, UserError, fault_class, is_transient
from core.rl import rewards
from core.worker.runtime import error_of
from tests.helpers import REPO, fill_up, small_tmpfs


def _raised(fn, *args: object, **kwargs: object) -> BaseException:
    try:
        fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the exception is the test's subject
        return exc
    raise AssertionError(f"{fn.__name__} did not raise")


def _connection_reset() -> None:
    """recv on a loopback TCP connection whose peer closed with SO_LINGER 0: the kernel's RST."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as c:
        peer, _ = server.accept()
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.close()
        c.settimeout(10)
        c.recv(1)


def _gloo_recv_timeout() -> None:
    """A real gloo process group of two ranks (threads) where rank 1 never sends: gloo's timeout."""
    import torch  # only this test needs torch: the rest of the module runs without it
    import torch.distributed as dist
    store, groups = dist.HashStore(), {}

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=1))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    groups[0].recv([torch.zeros(2)], 1, 0).wait()


def _store_timeout() -> None:
    """torch's TCPStore waiting for a peer that never comes: DistStoreError."""
    import torch.distributed as dist  # see _gloo_recv_timeout
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=1), wait_for_workers=False)
    dist.init_process_group("gloo", rank=0, world_size=2, store=store, timeout=datetime.timedelta(seconds=1))


def test_a_real_connection_reset_is_transient() -> None:
    exc = _raised(_connection_reset)
    assert isinstance(exc, ConnectionResetError) and exc.errno == errno.ECONNRESET
    assert fault_class(exc) == "transient"


def test_a_real_enospc_is_transient_also_under_a_runtime_error_raised_from_it(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "fs", 64 << 10) as fs:
        fill_up(fs)
        exc = _raised(lambda: (fs / "more").write_bytes(bytes(8192)))
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    assert fault_class(exc) == "transient"

    def wrapped() -> None:
        try:
            raise exc
        except OSError as e:
            raise RuntimeError("the save failed") from e
    assert fault_class(_raised(wrapped)) == "transient"
    assert fault_class(RuntimeError("the save failed")) == "unknown"


_H5PY_CHILD = """
import json, os, sys
import h5py, numpy as np
from core.errors import fault_class
folder, fill = sys.argv[1], int(sys.argv[2])
with open(os.path.join(folder, "filler"), "wb") as f:
    f.write(bytes(fill))
dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
try:  # a shard's layout as Baton wrote it on disk before: datasets allocated, the metadata at close
    with h5py.File(os.path.join(folder, "x.h5"), "w") as f:
        for i in range(10):
            f.create_dataset(f"t{i}", (1000,), np.float32, dcpl=dcpl)
    print(json.dumps({"type": "ok"}))
except Exception as exc:
    print(json.dumps({"type": type(exc).__name__, "message": str(exc)[:300], "class": fault_class(exc)}))
"""


def test_h5py_errors_on_a_full_tmpfs_are_transient(tmp_path: Path) -> None:
    """h5py writing to disk (as Baton's shards no longer do) on a disk that fills at each point in
    turn: every error it raises, an OSError or a RuntimeError whose errno is only in its message,
    is transient. Other points crash h5py outright (a segfault in HDF5's close path): why a shard
    is laid out in memory (core.checkpoint.image)."""
    seen = []
    with small_tmpfs(tmp_path / "fs", 64 << 10) as fs:
        for fill in range(40 << 10, (64 << 10) + 1, 2 << 10):
            for p in fs.iterdir():
                p.unlink()
            res = subprocess.run([sys.executable, "-c", _H5PY_CHILD, str(fs), str(fill)], cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
            if res.returncode == 0:
                seen.append(json.loads(res.stdout.strip().splitlines()[-1]))
    errors = [s for s in seen if s["type"] != "ok"]
    assert {"OSError", "RuntimeError"} <= {s["type"] for s in errors}, seen
    assert all(s["class"] == "transient" and "errno = 28" in s["message"] for s in errors), errors


def test_gloo_and_torch_distributed_timeouts_are_transient() -> None:
    gloo = _raised(_gloo_recv_timeout)
    assert type(gloo) is RuntimeError and "Timed out" in str(gloo)
    store = _raised(_store_timeout)
    assert type(store).__name__ == "DistStoreError"
    assert fault_class(gloo) == "transient" and fault_class(store) == "transient"


def test_a_failing_reward_is_the_users_naming_the_reward_and_the_sample() -> None:
    def judge(prompt, response, meta):  # a remote judge whose connection fails is still the user's code
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    exc = _raised(rewards.score, judge, [5, 6], [7], {}, index=3)
    assert isinstance(exc, RewardError) and isinstance(exc, UserError)
    assert "judge" in str(exc) and "prompt 3" in str(exc) and "[5, 6]" in str(exc)
    assert fault_class(exc) == "user"
    nan = _raised(rewards.score, lambda p, r, m: float("nan"), [1], [2], {}, index=0)
    assert isinstance(nan, RewardError) and fault_class(nan) == "user"


def test_bugs_and_runtime_errors_of_no_known_cause_are_unknown() -> None:
    assert fault_class(_raised(lambda: None + 1)) == "unknown"  # a real TypeError
    assert fault_class(RuntimeError("CUDA error: an illegal memory access")) == "unknown"
    assert fault_class(RuntimeError("Timed out")) == "unknown"  # not raised in torch.distributed
    assert fault_class(OSError(errno.EACCES, "Permission denied")) == "unknown"
    assert fault_class(TransientIOError("a storage fault")) == "transient"


# --- the policy over RemoteErrors as the controller builds them ------------------------------
def _remote(excs: list[BaseException], n: int = 4):
    errors = {rank: error_of(exc) for rank, exc in enumerate(excs)}
    return remote_error("train_step", errors, n, lambda r: Path(f"logs/worker_r{r:05d}.log"))


def _type_error() -> None:
    {}["missing"] + 1  # noqa: B018 - a real KeyError: a bug


@pytest.mark.parametrize(("make", "final", "final_again"), [
    (lambda: [_raised(_connection_reset) for _ in range(4)], False, False),
    (lambda: [_raised(_gloo_recv_timeout)] * 4, False, False),
    (lambda: [_raised(_type_error) for _ in range(4)], True, True),
    (lambda: [_raised(lambda: None + 1) for _ in range(4)], True, True),
    (lambda: [RuntimeError("NCCL communicator was aborted")] * 4, False, True),  # unknown: one retry
    (lambda: [ValueError(f"rank {r}: bad shape") for r in range(4)], False, True),  # four causes
    (lambda: [UserError("data.path: no such file")], True, True),
    (lambda: [_raised(_connection_reset)] * 3 + [_raised(_type_error)], False, True),
], ids=["conn-reset-everywhere", "gloo-timeout-everywhere", "keyerror-everywhere", "typeerror-everywhere",
        "runtimeerror-everywhere", "valueerror-per-rank", "user-error-one-rank", "reset-and-a-bug"])
def test_only_the_same_bug_on_every_rank_or_a_users_error_is_deterministic(make, final: bool,
                                                                          final_again: bool) -> None:
    """``final``: at the first failure; ``final_again``: the same error at the same step after a restart."""
    exc = _remote(make())
    assert (deterministic(exc, 10, ()) is not None) is final
    assert (deterministic(exc, 10, signature(exc, 10)) is not None) is final_again


def test_the_flags_ride_the_wire_and_name_every_rank() -> None:
    exc = _remote([_raised(_connection_reset) for _ in range(4)])
    assert exc.transient and not exc.user_error and exc.same_on_all_ranks
    assert "the same on all 4 ranks" in str(exc) and "ConnectionResetError" in str(exc)
    user = _remote([UserError("data.path: no such file")] * 4)
    assert user.user_error and "user error" in deterministic(user, 1, ())


# --- shards and commits on a disk that fills ---------------------------------------------------
_SHARD_CHILD = """
import json, os, sys
import numpy as np
from core.checkpoint.hdf5 import write_shard
from core.checkpoint.spec import TensorSlice
from core.errors import TransientIOError
folder = sys.argv[1]
items = [(TensorSlice(name=f"t{i}", global_shape=(1000,), offset=(0,), shape=(1000,), dtype="float32"),
          np.arange(1000, dtype=np.float32) + i) for i in range(10)]
out = []
for fill in range(0, (64 << 10) + 1, 1 << 10):
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    with open(os.path.join(folder, "filler"), "wb") as f:
        f.write(bytes(fill))
    try:
        ack = write_shard(os.path.join(folder, "rank_00000.h5"), items, {"k": 1}, {"step": 1, "rank": 0})
        out.append({"fill": fill, "ok": ack.checksum})
    except TransientIOError as exc:
        out.append({"fill": fill, "errno": exc.__cause__.errno, "left": sorted(os.listdir(folder))})
print(json.dumps(out))
"""


def test_a_shard_write_on_a_disk_filling_at_any_point_acks_or_fails_transient_without_a_trace(tmp_path: Path) -> None:
    """The disk fills at every point of a shard write in turn (the open, the metadata, the data,
    the fsync): each write is acked (and verifies) or fails as a TransientIOError leaving no file;
    never a RuntimeError, never a crash (this process would die of a segfault)."""
    with small_tmpfs(tmp_path / "fs", 64 << 10) as fs:
        res = subprocess.run([sys.executable, "-c", _SHARD_CHILD, str(fs)], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, f"the writer died ({res.returncode}): {res.stderr[-2000:]}"
    outcomes = json.loads(res.stdout)
    failed = [o for o in outcomes if "errno" in o]
    assert failed and any("ok" in o for o in outcomes), outcomes
    assert all(o["left"] == ["filler"] for o in failed), failed
    assert all(o["errno"] == errno.ENOSPC for o in failed), failed  # a plain OSError under it, errno and all
    assert len({o["ok"] for o in outcomes if "ok" in o}) == 1  # what fits is the same file every time


def test_a_commit_on_a_full_disk_fails_transient_commits_nothing_and_the_next_commit_clears_it(tmp_path: Path) -> None:
    item = TensorSlice(name="w", global_shape=(8,), offset=(0,), shape=(8,), dtype="float32")
    with small_tmpfs(tmp_path / "ckpt", 256 << 10) as root:
        def save(step: int) -> tuple[Path, list]:
            tmp = tmp_step_dir(root, step)
            return tmp, [write_shard(tmp / manifest.rank_file_name(0), [(item, np.full(8, step, np.float32))], {},
                                     {"step": step, "rank": 0})]

        tmp, acks = save(10)
        filler = fill_up(root)
        exc = _raised(commit, root, 10, tmp, acks, {})
        assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC and is_transient(exc)
        assert manifest.committed_steps(root) == [] and tmp.is_dir()  # debris, not a checkpoint
        assert not (tmp / manifest.MANIFEST_NAME).exists()
        filler.unlink()
        tmp2, acks2 = save(10)
        final = commit(root, 10, tmp2, acks2, {})
        assert manifest.committed_steps(root) == [10] and not tmp.exists()
        assert manifest.verify(final) == [] and manifest.damaged(root) == []


def test_a_full_disk_after_the_manifest_leaves_the_step_committed_and_the_next_commit_moves_latest(
        tmp_path: Path) -> None:
    """Room for the manifest but not for ``latest``: the step is committed (the rename is the commit;
    a resume looks at the folders, not at ``latest``), the error is transient, the next commit fixes it."""
    item = TensorSlice(name="w", global_shape=(8,), offset=(0,), shape=(8,), dtype="float32")
    with small_tmpfs(tmp_path / "ckpt", 256 << 10) as root:
        def save(step: int) -> tuple[Path, list]:
            tmp = tmp_step_dir(root, step)
            return tmp, [write_shard(tmp / manifest.rank_file_name(0), [(item, np.full(8, step, np.float32))], {},
                                     {"step": step, "rank": 0})]

        tmp, acks = save(10)
        filler = fill_up(root, leave_bytes=4096)  # one page: the manifest's
        exc = _raised(commit, root, 10, tmp, acks, {})
        assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC and is_transient(exc)
        assert manifest.committed_steps(root) == [10] and manifest.read_latest(root) is None
        assert manifest.latest_valid(root) == root / "step_00000010"
        filler.unlink()
        tmp2, acks2 = save(20)
        commit(root, 20, tmp2, acks2, {})
        assert manifest.read_latest(root) == 20 and manifest.damaged(root) == []
        assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no temporary file of `latest`


def test_a_shard_that_cannot_be_read_for_a_storage_fault_is_transient_not_corrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO at a shard's open (injected at h5py's open, the library boundary: a real EIO needs a
    failing device) is a storage fault, retried; a file that is not HDF5 is a CheckpointError."""
    junk = tmp_path / "rank_00000.h5"
    junk.write_bytes(b"not hdf5")
    assert isinstance(_raised(hdf5.ShardReader, junk), CheckpointError)

    def eio(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "Unable to synchronously open file (file read failed: errno = 5, "
                      "error message = 'Input/output error')")
    monkeypatch.setattr(hdf5.h5py, "File", eio)
    exc = _raised(hdf5.ShardReader, junk)
    assert isinstance(exc, TransientIOError) and fault_class(exc) == "transient"
