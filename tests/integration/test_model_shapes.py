"""Modern model shapes on a real Megatron-core GPT (CPU, gloo): RMSNorm, SwiGLU, rotary
positions, grouped-query attention (2 key/value groups for 4 heads), bias-free linears and
tied embeddings (at pp2 the last stage's copy of the embedding, kept equal by Megatron's
embedding group, is not written: the checkpoint holds the embedding once).

As in test_gpt_parallel: every layout starts from the same global weights and reads the
same batches, so tp2pp2 (each tensor-parallel rank one key/value group, half the gate and
half the up rows of SwiGLU's fc1) matches tp1pp1 to float32 reduction-order noise. Its
state (SwiGLU's fc1 is two boxes per rank of one global ``[gates; ups]`` tensor, in the
model and in the optimizer's ranges) loads into tp1pp1 and into a distributed optimizer
over two data-parallel replicas bit for bit and continues the same loss curve.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import baton
from tests.integration.gpt_harness import RankGroup, export_group, gpt_config, import_group

STEPS, RESUME_AT = 10, 5
LAYOUT_TOL, RESUME_TOL = 1e-5, 1e-6
MODEL = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope", "num_query_groups": 2,
         "bias": False, "tie_embeddings": True}

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]


def _cfg(**kw: object) -> dict:
    return gpt_config(model=MODEL, **kw)  # type: ignore[arg-type]


def _diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("shapes")
    init = work / "init.npz"
    with RankGroup(_cfg(), world_size=1, run_dir=work) as g:
        g.setup()
        g.call("save_global_weights", path=str(init))
        reference = g.train(range(STEPS))
    weights = work / "tp2pp2_weights.npz"
    with RankGroup(_cfg(tp=2, pp=2, world_size=4), world_size=4, run_dir=work) as g:
        g.setup()
        g.call("load_global_weights", path=str(init))
        tp2pp2 = g.train(range(RESUME_AT))
        g.call("save_global_weights", path=str(weights))
        arrays, blobs = export_group(g, RESUME_AT, work / "tp2pp2_state.npz")
        tp2pp2 += g.train(range(RESUME_AT, STEPS))
    return {"work": work, "init": init, "reference": reference, "tp2pp2": tp2pp2, "weights": weights,
            "arrays": arrays, "blobs": blobs}


def _resume_from_tp2pp2(g: RankGroup, runs: dict, tag: str) -> list[float]:
    """Import the tp2pp2 state: the weights and a fresh export equal it; train on from it."""
    assert import_group(g, runs["work"] / "tp2pp2_state.npz", runs["blobs"]) == [RESUME_AT] * g.world_size
    weights = runs["work"] / f"{tag}_weights.npz"
    g.call("save_global_weights", path=str(weights))
    with np.load(weights) as got, np.load(runs["weights"]) as want:
        assert sorted(got.files) == sorted(want.files)
        for name in want.files:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    again, _ = export_group(g, RESUME_AT, runs["work"] / f"{tag}_again.npz")
    assert sorted(again) == sorted(runs["arrays"])
    for name, array in runs["arrays"].items():
        np.testing.assert_array_equal(again[name], array, err_msg=name)
    return g.train(range(RESUME_AT, STEPS))


def test_modern_shapes_in_tp2pp2_match_tp1pp1(runs: dict) -> None:
    assert runs["reference"][-1] < runs["reference"][0]
    diff = _diff(runs["tp2pp2"], runs["reference"])
    print(f"max |loss - reference| tp2pp2 modern shapes: {diff:.3g}")
    assert diff < LAYOUT_TOL, (runs["tp2pp2"], runs["reference"])
    fc1 = [n for n in runs["arrays"] if n.endswith("mlp.linear_fc1.weight") and not n.startswith("optim.")]
    assert fc1 and runs["arrays"][fc1[0]].shape == (4, 2 * 256, 64)  # layers x [gates; ups] x hidden
    assert not any("bias" in n for n in runs["arrays"]) and not any("position_embeddings" in n for n in runs["arrays"])
    assert "embedding.word_embeddings.weight" in runs["arrays"] and "output_layer.weight" not in runs["arrays"]


def test_a_tp2pp2_state_of_modern_shapes_resumes_in_tp1pp1(runs: dict) -> None:
    with RankGroup(_cfg(), world_size=1, run_dir=runs["work"]) as g:
        g.setup()
        resumed = _resume_from_tp2pp2(g, runs, "tp1pp1")
    assert _diff(resumed, runs["tp2pp2"][RESUME_AT:]) < RESUME_TOL


def test_a_tp2pp2_state_of_modern_shapes_resumes_in_a_distributed_optimizer_over_two_replicas(runs: dict) -> None:
    cfg = _cfg(tp=2, world_size=4, parallel={"tp": 2, "pp": 1, "distributed_optimizer": True})
    with RankGroup(cfg, world_size=4, run_dir=runs["work"]) as g:
        g.setup()
        resumed = _resume_from_tp2pp2(g, runs, "distopt")
    assert _diff(resumed, runs["tp2pp2"][RESUME_AT:]) < RESUME_TOL


def test_the_rollout_of_a_modern_shaped_policy_agrees_with_its_actor(tmp_path: Path) -> None:
    """GRPO with the actor in tp2 and the rollout in tp1 (KV cache, rotary positions, key/value
    groups): after every weight sync the rollout's log-probs of its own samples are the
    actor's within 1e-5, and each step's record has the bytes the sync sent."""
    res = baton("submit", "experiments/grpo_tiny.yaml", f"runs_root={tmp_path}", "trainer.steps=34",
                *(f"model.{k}={str(v).lower()}" for k, v in MODEL.items()), "parallel.tp=2", "generator.tp=1",
                "--backend", "local", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in next((tmp_path / "grpo-tiny").glob("*/metrics.jsonl")).read_text().splitlines()]
    gaps = [r["sync_logprob_maxdiff"] for r in rows if "reward_mean" in r]
    assert len(gaps) == 4 and max(gaps) <= 1e-5, gaps
    # Every RL step synced: each of the two ranks sent the other its tensor-parallel half
    sent = [(r["sync_bytes_sent_max"], r["sync_bytes_sent_total"]) for r in rows if "reward_mean" in r]
    assert len(sent) == 4 and all(0 < most and total == 2 * most for most, total in sent), sent
