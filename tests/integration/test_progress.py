"""Live progress of ``baton submit --backend local``: a rich bar on a terminal (a real
pseudo-terminal here), plain lines elsewhere, both ending at the run's last step, loss and
throughput; the reader follows metrics.jsonl across a resume that rewrote it shorter."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from core.record.runfolder import RunFolder
from launcher.progress import LiveProgress
from tests.helpers import REPO, baton

pytestmark = pytest.mark.timeout(600)
RUN = ("trainer.steps=8", "checkpoint.interval_steps=0")


@pytest.mark.slow
def test_without_a_terminal_the_run_prints_plain_progress_lines(tmp_path: Path) -> None:
    res = baton("submit", "experiments/tiny_gpt.yaml", f"runs_root={tmp_path}", *RUN, "--backend", "local",
                timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    last = json.loads((next((tmp_path / "tiny-gpt").glob("*")) / "metrics.jsonl").read_text().splitlines()[-1])
    lines = [line for line in res.stdout.splitlines() if line.startswith("step ")]
    assert lines and lines[-1].startswith(f"step 8/8  loss {last['loss']:.4f}  ") and lines[-1].endswith("left 0:00:00")
    assert "\x1b[" not in res.stdout  # no terminal codes in a pipe


@pytest.mark.slow
def test_on_a_terminal_the_run_draws_a_live_bar(tmp_path: Path) -> None:
    leader, follower = os.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "submit", "experiments/tiny_gpt.yaml",
                             f"runs_root={tmp_path}", *RUN, "--backend", "local"], cwd=REPO, env=env,
                            stdout=follower, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    out = b""
    try:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the process and its children are done with it
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=600) == 0, out.decode(errors="replace")[-3000:]
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    text = out.decode(errors="replace")
    assert "\x1b[" in text and re.search(r"step\s+8/8", text) and "tok/s" in text, text[-2000:]


def test_the_reader_starts_over_when_a_resume_rewrote_the_metrics_shorter(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    rec = {"step": 0, "loss": 2.0, "tokens_per_s": 100.0, "step_time_s": 1.0}
    run.metrics.write_text("".join(json.dumps({**rec, "step": s, "loss": 2.0 - s / 10}) + "\n" for s in range(6)))
    live = LiveProgress(run, 10, tty=False)
    live.close()
    assert live.line() == "step 6/10  loss 1.5000  100 tok/s  left 0:00:04"
    run.metrics.write_text(json.dumps({**rec, "step": 3, "loss": 1.7}) + "\n")  # cut back to a checkpoint, one more
    live._read_at = 0.0
    live.poll()
    assert (live.step, live.loss) == (4, 1.7)
