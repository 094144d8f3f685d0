"""Damaged run folders through the real CLI: every reader answers in one line or shows what it can.

One finished toy run (two committed checkpoints) is copied per case and one of its files is
damaged: binary bytes, valid JSON of the wrong shape, wrong types, a folder where a file
belongs. Each command that reads that file must then either work (warnings allowed) or refuse
with exit code 2 and one stderr line naming the file; never a traceback; and it must change
nothing in the folder. ``baton ckpt verify`` exits 1 when it finds a bad checkpoint.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.helpers import baton

pytestmark = pytest.mark.timeout(300)
STEP20 = "checkpoints/step_00000020"
READERS = {
    "state.json": [["status"], ["doctor"], ["cancel"]],
    "events.jsonl": [["status"]],
    "checkpoints/latest": [["status"], ["ckpt", "ls"], ["ckpt", "verify"], ["ckpt", "inspect"]],
    f"{STEP20}/manifest.json": [["status"], ["ckpt", "ls"], ["ckpt", "verify"], ["ckpt", "inspect"]],
    "metrics.jsonl": [["doctor"], ["status"]],
    "slurm.json": [["status"], ["cancel"]],
    "logs/controller.log": [["logs", "--tail", "3"], ["logs", "--controller"]],
    "checkpoints": [["status"], ["ckpt", "ls"], ["ckpt", "verify"]],
}
DAMAGE: list[tuple[str, str, bytes | str]] = [
    ("state-list", "state.json", b"[1, 2]"),
    ("state-binary", "state.json", bytes(range(256))),
    ("state-empty", "state.json", b""),
    ("state-wrong-types", "state.json", b'{"version": 2, "status": 5, "step": "x"}'),
    ("state-newer", "state.json", b'{"version": 99}'),
    ("state-folder", "state.json", "folder"),
    ("events-binary", "events.jsonl", bytes(range(256)) + b"\n"),
    ("events-not-events", "events.jsonl", b'[1]\n{"event": "created", "time": "noon"}\n"x"\n'),
    ("latest-binary", "checkpoints/latest", bytes(range(256))),
    ("latest-word", "checkpoints/latest", b"step_abc\n"),
    ("latest-huge", "checkpoints/latest", b"9" * 5000 + b"\n"),
    ("latest-folder", "checkpoints/latest", "folder"),
    ("manifest-garbled", f"{STEP20}/manifest.json", b"{not json"),
    ("manifest-list", f"{STEP20}/manifest.json", b"[1]"),
    ("manifest-wrong-types", f"{STEP20}/manifest.json", b'{"step": "x", "files": 3}'),
    ("metrics-garbage", "metrics.jsonl", b'[1]\n\xff\xfe\n{"step": "x"}\n'),
    ("slurm-list", "slurm.json", b"[1]"),
    ("slurm-injected-id", "slurm.json", b'{"job_id": "1; rm -rf ~"}'),
    ("log-binary", "logs/controller.log", bytes(range(256))),
    ("checkpoints-a-file", "checkpoints", b"x"),
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    res = baton("submit", "experiments/toy.yaml", f"runs_root={root}", "trainer.steps=20",
                "checkpoint.interval_steps=10", "--backend", "local")
    assert res.returncode == 0, res.stdout + res.stderr
    return Path(res.stdout.strip().splitlines()[-1].split(": ", 1)[1])


def _damage(run: Path, rel: str, content: bytes | str) -> None:
    p = run / rel
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
    if content == "folder":
        p.mkdir()
    else:
        assert isinstance(content, bytes)
        p.write_bytes(content)


def _snapshot(run: Path) -> dict[str, str | None]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(run.rglob("*"))}


@pytest.mark.parametrize(("label", "rel", "content"), DAMAGE, ids=[d[0] for d in DAMAGE])
def test_every_reader_of_a_damaged_file_answers_in_one_line(finished_run: Path, tmp_path: Path,
                                                            label: str, rel: str, content: bytes | str) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    _damage(run, rel, content)
    before = _snapshot(run)
    for command in READERS[rel]:
        res = baton(*command[:2 if command[0] == "ckpt" else 1], str(run), *command[2 if command[0] == "ckpt" else 1:],
                    timeout=120)
        said = f"baton {' '.join(command)} on {label}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
        assert "Traceback" not in res.stdout + res.stderr, said
        allowed = {0, 1, 2} if command[:2] == ["ckpt", "verify"] else {0, 2}
        assert res.returncode in allowed, said
        if res.returncode == 2:
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1 and Path(rel).name in lines[0], said
        assert _snapshot(run) == before, f"{said}\nchanged the run folder"


def test_a_state_file_of_the_wrong_shape_is_refused_naming_it(finished_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    _damage(run, "state.json", b"[1, 2]")
    res = baton("status", str(run))
    assert res.returncode == 2 and "state.json" in res.stderr and "not an object" in res.stderr, res.stderr


def test_a_latest_pointer_that_names_nothing_is_a_finding_and_the_resume_uses_the_newest_checkpoint(
        finished_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    _damage(run, "checkpoints/latest", bytes(range(256)))
    listing = baton("ckpt", "ls", str(run))
    assert listing.returncode == 0 and "latest" in listing.stdout + listing.stderr, listing.stdout + listing.stderr
    status = baton("status", str(run))
    assert status.returncode == 0 and "note:" in status.stdout and "latest" in status.stdout, status.stdout
    res = baton("submit", "--resume", str(run), "trainer.steps=25", "--backend", "local")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "latest" in res.stdout, res.stdout
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000025"


def test_a_garbled_newest_manifest_is_named_by_verify_and_skipped_by_the_resume(finished_run: Path,
                                                                                tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    _damage(run, f"{STEP20}/manifest.json", b"{not json")
    verify = baton("ckpt", "verify", str(run))
    assert verify.returncode == 1 and "manifest.json" in verify.stdout + verify.stderr, verify.stdout + verify.stderr
    res = baton("submit", "--resume", str(run), "trainer.steps=25", "--backend", "local")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "step_00000020" in res.stdout and "note:" in res.stdout, res.stdout
    assert any(p.name.startswith("step_00000020.damaged-") for p in (run / "checkpoints").iterdir())
