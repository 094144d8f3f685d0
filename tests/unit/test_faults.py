"""core.job.faults' settings of the overlapped RL loop: ``generate_delay_ms``,
``kill_at_generate`` (the generator's first rank SIGKILLs itself, once per run folder) and
``sigterm_at`` (the controller SIGTERMs its parent, once per run folder and point).

The signals are real and sent between real processes: a helper process (this test's child)
starts the process that calls ``faults.at_point`` and so is its parent; it blocks SIGTERM and
takes each one with sigtimedwait after every call, so it sees each signal separately and who
sent it. ``generate`` runs in a subprocess of its own, which must end by SIGKILL."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.job import faults
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(120)
Setter = Callable[[str], None]


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[Setter]:
    """Set BATON_FAULTS for this process, read afresh."""
    def set_faults(value: str) -> None:
        monkeypatch.setenv(faults.ENV, value)
        faults._settings.cache_clear()

    yield set_faults
    monkeypatch.delenv(faults.ENV, raising=False)
    faults._settings.cache_clear()


def test_the_overlap_settings_parse(settings: Setter) -> None:
    settings("generate_delay_ms=250; kill_at_generate=33 ;sigterm_at=32:generating,40:updating,41:between")
    assert faults._settings() == {"generate_delay_ms": "250", "kill_at_generate": "33",
                                  "sigterm_at": "32:generating,40:updating,41:between"}
    settings("generate_delay_ms=0.5")
    assert faults._settings() == {"generate_delay_ms": "0.5"}


@pytest.mark.parametrize(("value", "message"), [
    ("sigterm_at=32:training", r"'sigterm_at=32:training': give sigterm_at=STEP:POINT\[,STEP:POINT\] with POINT one "
                               r"of generating, updating, between$"),
    ("sigterm_at=32:generating,40", r"'sigterm_at=32:generating,40': give sigterm_at=STEP:POINT"),
    ("sigterm_at=x:between", r"'sigterm_at=x:between': give sigterm_at=STEP:POINT"),
    ("sigterm_at=", r"'sigterm_at=': give sigterm_at=STEP:POINT"),
    ("kill_at_generate=soon", r"'kill_at_generate=soon': give kill_at_generate=STEP"),
    ("generate_delay_ms=fast", r"'generate_delay_ms=fast': give generate_delay_ms=N"),
    ("sigterm_after=3", r"'sigterm_after=3' is not one of .*kill_at_generate=STEP, sigterm_at=STEP:POINT \(POINT: "
                        r"generating, updating, between\)$"),
])
def test_a_malformed_setting_is_refused_at_its_first_use_naming_it(settings: Setter, value: str, message: str) -> None:
    settings(value)
    for use in (lambda: faults.at_point(32, "generating"), lambda: faults.generate(32, True)):
        with pytest.raises(ValueError, match=f"^{faults.ENV}: {message}"):
            use()


def test_unset_nothing_happens(settings: Setter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings("")
    monkeypatch.setenv("BATON_RUN_DIR", str(tmp_path))
    faults.at_point(32, "generating")
    faults.generate(33, True)
    assert list(tmp_path.iterdir()) == []  # no marker: nothing was due


# The process that calls at_point: after each call it says which, then waits for the go-ahead.
CALLER = """
import json, sys
from core.job import faults
for step, point in json.loads(sys.argv[1]):
    faults.at_point(step, point)
    print(f"{step}:{point}", flush=True)
    sys.stdin.readline()
"""

# Its parent: SIGTERM blocked; after each call, the SIGTERM it got (if any) and who sent it.
PARENT = """
import json, os, signal, subprocess, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
out = []
for run_dir, calls in json.loads(sys.argv[1]):
    env = {**os.environ, "BATON_RUN_DIR": run_dir}
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], json.dumps(calls)], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    for line in child.stdout:
        got = signal.sigtimedwait([signal.SIGTERM], 0)  # the kill came before the line: it is pending
        out.append([line.strip(), None if got is None else ("child" if got.si_pid == child.pid else got.si_pid)])
        child.stdin.write("go\\n")
        child.stdin.flush()
    assert child.wait() == 0
print(json.dumps(out))
"""


def test_sigterm_at_signals_the_parent_once_per_run_folder_and_point(tmp_path: Path) -> None:
    first, other = tmp_path / "run", tmp_path / "other"
    first.mkdir()
    other.mkdir()
    calls = [[31, "between"], [32, "updating"], [32, "generating"], [32, "generating"], [32, "between"],
             [40, "updating"], [40, "updating"]]
    plan = [[str(first), calls],  # the first controller of the run
            [str(first), [[32, "generating"], [40, "updating"]]],  # its resume: the same run folder
            [str(other), [[32, "generating"]]]]  # another run
    env = {**os.environ, faults.ENV: "sigterm_at=32:generating,040:updating", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", PARENT, json.dumps(plan), CALLER], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    assert seen == [["31:between", None], ["32:updating", None], ["32:generating", "child"],
                    ["32:generating", None], ["32:between", None], ["40:updating", "child"], ["40:updating", None],
                    ["32:generating", None], ["40:updating", None],
                    ["32:generating", "child"]]
    assert sorted(p.name for p in first.iterdir()) == ["fault-sigterm-32-generating", "fault-sigterm-40-updating"]


GENERATOR = """
import sys
from core.job import faults
for item in sys.argv[1:]:
    step, first = item.split(":")
    faults.generate(int(step), first == "first")
    print(item, flush=True)
"""


def _generate(run_dir: Path, *calls: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, faults.ENV: "kill_at_generate=33", "BATON_RUN_DIR": str(run_dir), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", GENERATOR, *calls], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=100)


def test_kill_at_generate_kills_the_first_rank_only_and_once_per_run_folder(tmp_path: Path) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    other.mkdir()
    others = _generate(run, "32:first", "33:rest", "-1:first", "34:first")  # not the first rank; other steps
    assert (others.returncode, others.stdout.split()) == (0, ["32:first", "33:rest", "-1:first", "34:first"])
    assert list(run.iterdir()) == []
    killed = _generate(run, "32:first", "33:first", "34:first")
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    assert killed.stdout.split() == ["32:first"]  # it died in step 33's GENERATE
    assert [p.name for p in run.iterdir()] == ["fault-killed-generate-33"]
    again = _generate(run, "33:first", "34:first")  # the restarted rank regenerates step 33: no second kill
    assert (again.returncode, again.stdout.split()) == (0, ["33:first", "34:first"])
    elsewhere = _generate(other, "33:first")
    assert elsewhere.returncode == -signal.SIGKILL and elsewhere.stdout == ""
