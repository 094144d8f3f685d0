"""Rewards in a real GRPO run (local backend, CPU): the controller's reward processes bound
each call by ``rl.reward_timeout_s`` and a reward module that fails only on the controller's
side is a user error, each ending the run at once (exit 2, not retried) with its cause on the
terminal and in ``baton status``."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import REPO, baton, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
EXPERIMENT = str(Path(__file__).resolve().parents[2] / "experiments" / "grpo_tiny.yaml")
FAST = ("rl.warmup_steps=0", "trainer.steps=2", "--backend", "local")  # the first step is an RL step

REWARDS = '''
import os, time

if os.environ.get("BATON_RUN_DIR") and os.environ.get("FAIL_ON_CONTROLLER"):  # the submit's check imports it fine
    raise RuntimeError("the judge's API key is missing on the compute node")


def hangs_on_prompt_two(prompt, response, meta):
    if meta["index"] == 2:
        with open(os.environ["HUNG_PID"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
    return 0.0


def zero(prompt, response, meta):
    return 0.0
'''


def _submit(tmp_path: Path, reward: str, *extra: str, env: dict[str, str]) -> tuple[int, str, str]:
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    res = baton("submit", EXPERIMENT, f"runs_root={tmp_path / 'runs'}", f"rl.reward=my_rewards:{reward}", *FAST,
                *extra, cwd=tmp_path, timeout=800, env={**env, "PYTHONPATH": os.pathsep.join((str(REPO), str(tmp_path)))})
    runs = list((tmp_path / "runs" / "grpo-tiny").glob("*"))
    assert len(runs) == 1, res.stdout + res.stderr
    run = runs[0]
    return res.returncode, res.stdout + res.stderr, baton("status", str(run)).stdout


def test_a_hanging_reward_fails_the_run_at_its_timeout_and_its_process_is_killed(tmp_path: Path) -> None:
    hung = tmp_path / "hung.pid"
    from core.config import run as config_mod
    from core.rl import tasks

    cfg = config_mod.load(EXPERIMENT)
    asked = tasks.counting(cfg.seed, 0, cfg.rl.prompts_per_step, cfg.rl.prompt_length, cfg.model.vocab_size)
    prompt = list(asked[2].tokens)  # the reference: the third prompt of step 0, as the controller asks it
    code, out, status = _submit(tmp_path, "hangs_on_prompt_two", "rl.reward_timeout_s=2", "rl.reward_workers=2",
                                env={"HUNG_PID": str(hung)})
    assert code == 2, out
    assert f"my_rewards:hangs_on_prompt_two took more than rl.reward_timeout_s = 2 s on prompt 2 ({prompt})" in out, out
    assert "user error" in status and "its process was killed" in status and "retry" not in status, status
    pid = int(hung.read_text())
    wait_for(lambda: not _alive(pid), 10, f"the hung reward process {pid} to be gone")


def test_a_reward_module_that_raises_on_the_controller_is_a_user_error_with_its_cause(tmp_path: Path) -> None:
    code, out, status = _submit(tmp_path, "zero", env={"FAIL_ON_CONTROLLER": "1"})
    assert code == 2, out
    cause = "importing 'my_rewards' raised RuntimeError: the judge's API key is missing on the compute node"
    assert cause in out and "Traceback" not in out, out
    assert cause in status and "user error" in status and "retry" not in status, status


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
