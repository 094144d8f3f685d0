"""ZeRO-3 (``parallel.sharding: params``, torch FSDP2) on a real Megatron-core GPT at dp2 (CPU,
gloo): each rank holds half the parameters (and their gradients and Adam moments); 20
steps from the same weights and batches give the losses of Megatron's DDP within 1e-5
(fp32); its checkpoint state (global names and shapes) loads into tp2, and a tp2 state
loads into it, the weights equal bit for bit, and training continues on the same curve.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.integration.gpt_harness import RankGroup, export_group, gpt_config, import_group, initial_weights

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]
STEPS, SAVE_AT = 20, 10
ZERO3 = {"tp": 1, "pp": 1, "sharding": "params"}


def _weights_equal(a: Path, b: Path) -> None:
    with np.load(a) as x, np.load(b) as y:
        assert sorted(x.files) == sorted(y.files)
        for name in x.files:
            np.testing.assert_array_equal(x[name], y[name], err_msg=name)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return initial_weights(tmp_path_factory.mktemp("zero3")).parent


def _train(work: Path, tag: str, parallel: dict, steps: range, *, start: tuple[Path, list] | None = None,
           save_at: int | None = None) -> tuple[list[float], list[dict], tuple | None]:
    world = 2
    with RankGroup(gpt_config(world_size=world, parallel=parallel), world_size=world, run_dir=work) as g:
        info = g.setup()
        if start is None:
            g.call("load_global_weights", path=str(work / "init.npz"))
        else:
            assert import_group(g, start[0], start[1]) == [steps.start] * world
            g.call("save_global_weights", path=str(work / f"{tag}_loaded.npz"))
        losses, saved = [], None
        for step in steps:
            if step == save_at:
                g.call("save_global_weights", path=str(work / f"{tag}_weights.npz"))
                arrays, blobs = export_group(g, step, work / f"{tag}_state.npz")
                saved = (work / f"{tag}_state.npz", blobs, arrays)
            losses += g.train(range(step, step + 1))
    return losses, info, saved


def test_zero3_holds_half_the_parameters_and_trains_like_ddp(work: Path) -> None:
    ddp, ddp_info, _ = _train(work, "ddp", {"tp": 1, "pp": 1}, range(STEPS))
    zero3, info, _ = _train(work, "zero3", ZERO3, range(STEPS))
    total = ddp_info[0]["num_params"]
    assert [i["num_params"] for i in ddp_info] == [total, total]
    assert sum(i["num_params"] for i in info) == total and max(i["num_params"] for i in info) <= total // 2 + 4096
    diff = max(abs(a - b) for a, b in zip(zero3, ddp, strict=True))
    print(f"max |loss ZeRO-3 - DDP| over {STEPS} steps: {diff:.3g}")
    assert diff < 1e-5, (zero3, ddp)


def test_a_zero3_state_loads_into_tp2_and_a_tp2_state_into_zero3(work: Path) -> None:
    zero3, _, saved = _train(work, "z", ZERO3, range(STEPS), save_at=SAVE_AT)
    assert saved is not None and not any(n.startswith("optim.main_param") for n in saved[2])
    # ZeRO-3 → tp2: the same weights, and the same curve on from there
    tp2, _, again = _train(work, "tp2", {"tp": 2, "pp": 1}, range(SAVE_AT, STEPS), start=saved[:2], save_at=SAVE_AT)
    _weights_equal(work / "tp2_loaded.npz", work / "z_weights.npz")
    assert max(abs(a - b) for a, b in zip(tp2, zero3[SAVE_AT:], strict=True)) < 1e-5
    # and back: tp2's state (saved right after loading) → ZeRO-3, bit for bit, the same curve
    assert again is not None
    back, _, _ = _train(work, "back", ZERO3, range(SAVE_AT, STEPS), start=again[:2])
    _weights_equal(work / "back_loaded.npz", work / "z_weights.npz")
    assert max(abs(a - b) for a, b in zip(back, zero3[SAVE_AT:], strict=True)) < 1e-6


def test_zero3_computes_in_bf16_over_fp32_storage(work: Path) -> None:
    """FSDP2's mixed precision: gathered and computed in bf16, reduced in fp32, stored fp32:
    the curve stays within bf16's rounding of the fp32 one."""
    fp32, _, _ = _train(work, "f", ZERO3, range(5))
    with RankGroup(gpt_config(world_size=2, parallel=ZERO3, training={"mixed_precision": {
            "param_dtype": "bf16", "reduce_dtype": "fp32"}}), world_size=2, run_dir=work) as g:
        g.setup()
        g.call("load_global_weights", path=str(work / "init.npz"))
        bf16 = g.train(range(5))
    assert bf16 != fp32 and max(abs(a - b) / b for a, b in zip(bf16, fp32, strict=True)) < 2e-2, (bf16, fp32)
