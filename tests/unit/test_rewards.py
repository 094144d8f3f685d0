"""Rewards in the controller's reward processes (core.rl.reward_pool), the built-in ``math``
reward (core.rl.math_reward), and a reward module's failures to load (core.rl.rewards.load),
each against a reference: the reward function called directly, a table of answers.

The users' reward modules are written into a temporary folder on ``sys.path`` (the reward
processes start with the controller's ``sys.path``, as the controller's are).
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from core.errors import ConfigError, RewardError, UserError, fault_class
from core.rl import rewards
from core.rl.reward_pool import Scorer
from core.rl.rewards import Sample
from tests.helpers import wait_for

USER_MODULE = '''
import math, os, time

def mixed(prompt, response, metadata):
    """Depends on every input; the even prompts' calls take longer, so a pool finishes out of order."""
    if metadata["i"] % 2 == 0:
        sum(range(200_000))
    return sum(response) * 0.5 + len(prompt) + metadata["i"] / 7 + len(metadata.get("prompt_text", ""))

def hang_on_two(prompt, response, metadata):
    if metadata["i"] == 2:
        time.sleep(3600)
    return 1.0

def hang_marked(prompt, response, metadata):
    open(os.environ["HANG_MARK"] + str(os.getpid()), "w").close()
    time.sleep(3600)

def spin_marked(prompt, response, metadata):
    """Stuck in C code that holds the GIL: no Python thread of its process runs again."""
    open(os.environ["HANG_MARK"] + str(os.getpid()), "w").close()
    sum(range(10**18))

def quarter_second(prompt, response, metadata):
    time.sleep(0.25)
    return 1.0

def crash_on_one(prompt, response, metadata):
    if metadata["i"] == 1:
        os._exit(7)
    return 0.0

def nan_on_three(prompt, response, metadata):
    return math.nan if metadata["i"] == 3 else 0.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture()
def users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on sys.path holding the users' reward modules (``user_rewards`` and the broken ones)."""
    (tmp_path / "user_rewards.py").write_text(USER_MODULE)
    (tmp_path / "broken_syntax.py").write_text("def reward(p, r, m):\n    return (1.0\n")
    (tmp_path / "raises_on_import.py").write_text("import json\nSETTINGS = json.loads('{not json')\n")
    (tmp_path / "imports_missing.py").write_text("import no_such_library_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _samples(n: int) -> list[Sample]:
    return [Sample(prompt=(1, 2, i), response=tuple(range(i % 5 + 1)), metadata={"i": i, "prompt_text": f"q{i}" * (i % 3 + 1)},
                   index=i // 2) for i in range(n)]


def test_a_pool_of_two_gives_the_rewards_of_one_and_of_the_function_itself(users: Path) -> None:
    samples = _samples(12)
    import user_rewards  # the reference: the user's function called here, one sample at a time

    want = [user_rewards.mixed(s.prompt, s.response, s.metadata) for s in samples]
    with Scorer("user_rewards:mixed", workers=1, timeout_s=60) as one, \
            Scorer("user_rewards:mixed", workers=2, timeout_s=60) as two:
        assert len(set(two.pids)) == 2 and not set(one.pids) & set(two.pids)
        assert one.score_all(samples) == want
        assert two.score_all(samples) == want
        assert two.score_all(samples[::-1]) == want[::-1]  # order follows the samples, not the processes
        assert two.score_all([]) == []


def test_a_hanging_reward_is_stopped_at_its_timeout_naming_the_prompt_and_its_process_killed(users: Path) -> None:
    scorer = Scorer("user_rewards:hang_on_two", workers=2, timeout_s=1.0)
    scorer.start()
    pids = scorer.pids
    with pytest.raises(RewardError, match=r"^rl.reward: user_rewards:hang_on_two took more than "
                                          r"rl.reward_timeout_s = 1 s on prompt 1 \('q2q2q2'\); its process was killed"):
        scorer.score_all(_samples(6))
    assert scorer.pids == []  # the pool is closed after a failure
    for pid in pids:
        wait_for(lambda pid=pid: not _alive(pid), 10, f"reward process {pid} to be gone")


def test_the_timeout_bounds_each_call_not_the_whole_batch(users: Path) -> None:
    """Eight calls of 0.25 s in one process take 2 s, twice the 1 s bound of each: none times out."""
    with Scorer("user_rewards:quarter_second", workers=1, timeout_s=1.0) as scorer:
        assert scorer.score_all(_samples(8)) == [1.0] * 8


def test_a_reward_that_ends_its_process_or_returns_no_number_fails_naming_the_prompt(users: Path) -> None:
    with pytest.raises(RewardError, match=r"user_rewards:crash_on_one ended its reward process \(exit code 7\) on "
                                          r"prompt 0 \('q1q1'\)") as crash:
        Scorer("user_rewards:crash_on_one", workers=2, timeout_s=30).score_all(_samples(4))
    with pytest.raises(RewardError, match=r"^rl.reward: user_rewards:nan_on_three returned nan on prompt 1 \('q3'\): "
                                          "a reward must be a finite number") as nan:
        Scorer("user_rewards:nan_on_three", workers=2, timeout_s=30).score_all(_samples(5))
    assert fault_class(crash.value) == fault_class(nan.value) == "user"  # exit 2, not retried


def test_a_reward_process_killed_between_steps_fails_the_next_step_naming_it(users: Path) -> None:
    """An idle process killed from outside (the out-of-memory killer) is a RewardError at the
    next ``score_all``, not a BrokenPipeError of the socket."""
    import signal

    scorer = Scorer("user_rewards:mixed", workers=1, timeout_s=30)
    scorer.start()
    (pid,) = scorer.pids
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _ended(pid), 10, f"reward process {pid} to be gone, every thread of it")
    with pytest.raises(RewardError, match=rf"^rl.reward: the reward process of user_rewards:mixed \(pid {pid}\) had "
                                          r"ended \(killed by signal 9\) while idle, before prompt 0 \('q0'\)") as err:
        scorer.score_all(_samples(2))
    assert "\n" not in str(err.value) and fault_class(err.value) == "user"
    assert scorer.pids == []


@pytest.mark.parametrize(("spec", "message"), [
    ("not_a_module_xyz:reward", r"^rl.reward: cannot find module 'not_a_module_xyz'; put the folder that holds it on "
                                r"PYTHONPATH \(on Slurm the controller runs in the run folder, not where you submit\)$"),
    ("user_rewards:missing", r"^rl.reward: user_rewards \(.*user_rewards.py\) has no function 'missing'; "),
    ("user_rewards:NOT_A_FUNCTION", r"^rl.reward: user_rewards:NOT_A_FUNCTION is a int, not a function; "),
    ("broken_syntax:reward", r"^rl.reward: 'broken_syntax' does not compile: .* \(.*broken_syntax.py, line 2\); "),
    ("raises_on_import:reward", r"^rl.reward: importing 'raises_on_import' raised JSONDecodeError: Expecting property "
                                r"name enclosed in double quotes: line 1 column 2 \(char 1\); fix the module$"),
    ("imports_missing:reward", r"^rl.reward: importing 'imports_missing' failed: ModuleNotFoundError: No module named "
                               r"'no_such_library_xyz'; install what it imports"),
])
def test_a_reward_that_cannot_be_loaded_is_one_line_naming_the_cause(users: Path, spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        rewards.load(spec, "rl.reward")
    assert "\n" not in str(err.value)


def test_the_pool_refuses_a_reward_that_cannot_be_loaded_when_it_starts(users: Path) -> None:
    """The controller's reward processes import the reward: the user error comes back to it."""
    scorer = Scorer("raises_on_import:reward", workers=2, timeout_s=30)
    with pytest.raises(ConfigError, match=r"^rl.reward: importing 'raises_on_import' raised JSONDecodeError"):
        scorer.start()
    assert scorer.pids == []


# --- the math reward: a table of answers, scored as math-verify compares them -------------------
MATH_TABLE = [  # (ground truth, response text, reward)
    ("0.5", r"The answer is \boxed{1/2}", 1.0),
    ("0.5", r"so \boxed{\frac{1}{2}}", 1.0),
    (r"\frac{1}{2}", "It is $0.5$.", 1.0),
    ("1/2", r"\boxed{0.5}", 1.0),
    ("12", "The answer is 12.", 1.0),
    ("12", "The answer is 13.", 0.0),
    ("12", r"first \boxed{13}, then 12", 0.0),  # the boxed answer is the answer
    ("x^2+1", r"\boxed{1 + x^2}", 1.0),
    (r"\sqrt{2}", r"$\sqrt{2}$", 1.0),
    (r"\sqrt{2}", r"$\sqrt{3}$", 0.0),
    ("3", "", 0.0),  # no answer to read
    ("3", "I do not know", 0.0),
]


def _math_meta(truth: str, text: str) -> dict[str, object]:
    return {"answer": truth, "response_text": text}


@pytest.mark.parametrize(("truth", "text", "reward"), MATH_TABLE)
def test_math_scores_a_table_of_answers(truth: str, text: str, reward: float) -> None:
    assert rewards.load("math") is rewards.math_answer
    assert rewards.math_answer((), (), _math_meta(truth, text)) == reward


def test_math_reads_verls_ground_truth_and_needs_one() -> None:
    assert rewards.math_answer((), (), {"reward_model": {"ground_truth": "7"}, "response_text": r"\boxed{7}"}) == 1.0
    assert rewards.math_answer((), (), {"ground_truth": 7, "response_text": "7"}) == 1.0
    with pytest.raises(UserError, match=r"rl.reward: math raised KeyError: .*math needs records with an 'answer' field"):
        rewards.score(rewards.math_answer, (1,), (2,), {"response_text": "7"}, index=0, name="math")


def test_math_scores_the_same_in_the_reward_processes_and_outside_the_main_thread() -> None:
    """math-verify's signal-based bounds work only in a main thread: the reward processes call it
    there; elsewhere its bounds are off, not its answers (it would turn the signal's error into 0.0)."""
    samples = [Sample((), (), _math_meta(truth, text), i) for i, (truth, text, _) in enumerate(MATH_TABLE)]
    want = [reward for _, _, reward in MATH_TABLE]
    with Scorer("math", workers=2, timeout_s=60) as scorer:
        assert scorer.score_all(samples) == want
    got: list[float] = []
    thread = threading.Thread(target=lambda: got.extend(rewards.math_answer((), (), s.metadata) for s in samples))
    thread.start()
    thread.join(60)
    assert got == want


@pytest.mark.parametrize("reward", ["hang_marked", "spin_marked"])
def test_reward_processes_end_when_their_controller_dies(users: Path, reward: str) -> None:
    """A controller killed outright (SIGKILL: nothing of it runs again) while both its reward
    processes hang in a reward (sleeping, or spinning in C code that holds the GIL, where no
    watching thread runs) leaves neither behind."""
    import signal
    import subprocess

    code = ("import glob, os, signal, sys, threading\n"
            "from core.rl.reward_pool import Scorer\n"
            "from core.rl.rewards import Sample\n"
            "from tests.helpers import wait_for\n"
            f"s = Scorer('user_rewards:{reward}', workers=2, timeout_s=600)\n"
            "s.start()\n"
            "print(' '.join(map(str, s.pids)), flush=True)\n"
            "threading.Thread(target=s.score_all, args=([Sample((1,), (2,))] * 2,), daemon=True).start()\n"
            "wait_for(lambda: len(glob.glob(os.environ['HANG_MARK'] + '*')) == 2, 60, 'both rewards to hang')\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(users), *sys.path))),
           "HANG_MARK": str(users / "hanging.")}
    out = users / "controller.out"  # a file, not a pipe: a reward process left behind would hold a pipe open
    with out.open("w") as f:
        res = subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, env=env, timeout=120)
    text = out.read_text()
    pids = [int(p) for p in text.splitlines()[0].split()] if text else []
    try:
        assert res.returncode == -9 and len(pids) == 2, text
        for pid in pids:
            wait_for(lambda pid=pid: not _alive(pid), 15, f"reward process {pid} to end after its controller")
    finally:  # a test that fails leaves no spinning process behind
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)


def test_a_pool_started_from_a_thread_that_ended_still_scores(users: Path) -> None:
    """The kernel's parent-death signal follows the thread that started a process: a pool
    started from a thread that has ended since must not have lost its processes."""
    scorer = Scorer("user_rewards:mixed", workers=2, timeout_s=60)
    thread = threading.Thread(target=scorer.start)
    thread.start()
    thread.join(120)
    try:
        samples = _samples(4)
        import user_rewards

        assert scorer.score_all(samples) == [user_rewards.mixed(s.prompt, s.response, s.metadata) for s in samples]
    finally:
        scorer.close()


def _ended(pid: int) -> bool:
    """Whether ``pid`` has ended with all its threads (a thread group leader reads as a zombie
    while its other threads still exit; until they have, it cannot be reaped and its files are open)."""
    try:
        return not _alive(pid) and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except FileNotFoundError:
        return True


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"




# --- the submit's check: refused on the login node before anything is written ------------------
GRPO = Path(__file__).resolve().parents[2] / "experiments" / "grpo_tiny.yaml"


@pytest.mark.parametrize(("spec", "message"), [
    ("not_a_module_xyz:reward", "rl.reward: cannot find module 'not_a_module_xyz'; "),
    ("user_rewards:missing", "has no function 'missing'"),
    ("user_rewards:NOT_A_FUNCTION", "user_rewards:NOT_A_FUNCTION is a int, not a function"),
    ("broken_syntax:reward", "broken_syntax.py, line 2"),
    ("raises_on_import:reward", "rl.reward: importing 'raises_on_import' raised JSONDecodeError: Expecting property"),
])
def test_submit_refuses_a_reward_that_cannot_be_loaded_before_writing(users: Path, spec: str, message: str) -> None:
    """The module is looked up as the controller will: on PYTHONPATH."""
    from tests.helpers import REPO, baton  # the real CLI in a subprocess

    res = baton("submit", str(GRPO), "--backend", "local", f"runs_root={users / 'runs'}", f"rl.reward={spec}",
                cwd=users, timeout=120, env={"PYTHONPATH": os.pathsep.join((str(REPO), str(users)))})
    line = res.stderr.strip()
    assert res.returncode == 2 and "\n" not in line, res.stderr
    assert line.startswith("baton: error: rl.reward: ") and message in line, line
    assert not (users / "runs").exists()


def test_the_submit_check_loads_a_good_reward_and_math(users: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from core.config import run as config_mod
    from launcher import runprep

    monkeypatch.chdir(users)  # the folder submitted from: not where the controller looks on Slurm
    with pytest.raises(ConfigError, match="cannot find module 'user_rewards'; put the folder that holds it on PYTHONPATH"):
        runprep.check_reward(config_mod.load(GRPO, ["rl.reward=user_rewards:mixed"]))
    monkeypatch.setenv("PYTHONPATH", str(users))
    runprep.check_reward(config_mod.load(GRPO, ["rl.reward=user_rewards:mixed"]))
    runprep.check_reward(config_mod.load(GRPO, ["rl.reward=math", "rl.task=file", f"rl.prompts={GRPO}", "model.vocab_size=257"]))
    with pytest.raises(ConfigError, match="has no function 'mixed2'"):
        runprep.check_reward(config_mod.load(GRPO, ["rl.reward=user_rewards:mixed2"]))
