"""The real precision path on CPU: fp32, bf16 and fp16 (dynamic loss scaling) GPT training with
dropout, checkpointed through the real calls and commit, resumed bit-exactly; layout changes.

Each resume runs in fresh processes: nothing survives but the checkpoint files.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.gpt_harness import RankGroup, assert_state_is_the_checkpoints, gpt_config

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]
STEPS, HALF = 12, 6
LAYOUT_HALF, LAYOUT_STEPS = 4, 8  # the layout tests run 4 workers on pp 4: fewer steps, same checks
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}


def _config(dtype: str, *, tp: int, pp: int, dropout: bool = True, steps: int = STEPS) -> dict[str, Any]:
    model = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128, "seq_length": 32,
             **(DROPOUT if dropout else {})}
    return gpt_config(tp=tp, pp=pp, world_size=tp * pp, steps=steps, model=model,
                      training={"global_batch_size": 16, "micro_batch_size": 2,
                                "mixed_precision": {"param_dtype": dtype}})


@pytest.fixture(scope="module")
def curves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[float]]]:
    """Per precision: the uninterrupted curve (saving at HALF on the way: a save changes nothing
    of the run), and a resume from that save in new processes."""
    out: dict[str, dict[str, list[float]]] = {}
    for dtype in ("fp32", "bf16", "fp16"):
        root = tmp_path_factory.mktemp(dtype)
        cfg = _config(dtype, tp=2, pp=1)
        with RankGroup(cfg, world_size=2, run_dir=root) as g:
            g.setup()
            first = g.train(range(HALF))
            step_dir = g.save(root / "checkpoints", HALF)
            full = first + g.train(range(HALF, STEPS))
        with RankGroup(cfg, world_size=2, run_dir=root) as g:
            g.setup()
            g.load(step_dir)
            assert_state_is_the_checkpoints(g, step_dir, HALF)
            second = g.train(range(HALF, STEPS))
        out[dtype] = {"full": full, "resumed": first + second}
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_resume_in_new_processes_gives_the_uninterrupted_losses_bit_for_bit(
        curves: dict[str, dict[str, list[float]]], dtype: str) -> None:
    full, resumed = curves[dtype]["full"], curves[dtype]["resumed"]
    assert resumed == full, [(i, a, b) for i, (a, b) in enumerate(zip(full, resumed, strict=True)) if a != b]
    assert full[-1] < full[0] * 0.9  # and it learns


def test_low_precision_really_runs(curves: dict[str, dict[str, list[float]]]) -> None:
    fp32, bf16, fp16 = (curves[d]["full"] for d in ("fp32", "bf16", "fp16"))
    assert bf16 != fp32 and fp16 != fp32 and bf16 != fp16
    assert max(abs(a - b) for a, b in zip(bf16, fp32, strict=True)) < 0.1  # the same training, rounded


def _resume(cfg: dict[str, Any], root: Path, step_dir: Path) -> list[float]:
    with RankGroup(cfg, world_size=4, run_dir=root) as g:
        g.setup()
        g.load(step_dir)
        return g.train(range(LAYOUT_HALF, LAYOUT_STEPS))


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
def test_a_tp2pp2_checkpoint_resumes_as_tp1pp4(tmp_path: Path, dropout: bool) -> None:
    """Without dropout the curve continues within 1e-5 of the same-layout resume. With dropout the
    masks of the new layout come from streams derived for its coordinates (core.parallel.rng):
    another curve, but the same one every time."""
    source = _config("fp32", tp=2, pp=2, dropout=dropout, steps=LAYOUT_STEPS)
    with RankGroup(source, world_size=4, run_dir=tmp_path) as g:
        g.setup()
        g.train(range(LAYOUT_HALF))
        step_dir = g.save(tmp_path / "checkpoints", LAYOUT_HALF)
    same = _resume(source, tmp_path, step_dir)
    other = _resume(_config("fp32", tp=1, pp=4, dropout=dropout, steps=LAYOUT_STEPS), tmp_path, step_dir)
    if not dropout:
        assert max(abs(a - b) for a, b in zip(same, other, strict=True)) <= 1e-5, (same, other)
        return
    again = _resume(_config("fp32", tp=1, pp=4, dropout=dropout, steps=LAYOUT_STEPS), tmp_path, step_dir)
    assert other == again and other != same
