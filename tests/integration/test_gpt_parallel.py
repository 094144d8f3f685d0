"""A real Megatron-core GPT on CPU (gloo) in several tp/pp/dp layouts, without the controller.

Every layout starts from the same global weights (dumped by a tp1pp1 run, loaded by
slicing) and reads the same global batches, so its loss curve must match tp1pp1 to
float32 reduction-order noise. State exported in one layout and imported in another must
reproduce the weights bit for bit and continue the loss curve.

Runtime: about 2-3 minutes on 2 cores (process start-up and ``import megatron`` dominate).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.gpt_harness import RankGroup, check_groups_against, export_group, gpt_config, import_group

STEPS = 10
RESUME_AT = 5
LAYOUT_TOL = 1e-5
RESUME_TOL = 1e-6

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]


@dataclass(frozen=True)
class Run:
    losses: list[float]
    eval_loss: float
    weights: Path  # global weights: initial for the reference, at RESUME_AT for tp2pp2
    state: Path | None = None  # exported global state at RESUME_AT
    arrays: dict[str, np.ndarray] | None = None
    blobs: list[dict[str, Any]] | None = None


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _report(name: str, diff: float) -> None:
    print(f"max |loss - reference| {name}: {diff:.3g}")  # shown with -s / -rP; the numbers in the report


def _start(group: RankGroup, reference: Run) -> None:
    group.setup()
    group.call("load_global_weights", path=str(reference.weights))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpt")


@pytest.fixture(scope="module")
def reference(workdir: Path) -> Run:
    """tp1pp1dp1: the initial global weights and the loss curve every layout must match."""
    init = workdir / "init.npz"
    with RankGroup(gpt_config(), world_size=1, run_dir=workdir) as g:
        g.setup()
        g.call("save_global_weights", path=str(init))
        losses = g.train(range(STEPS))
        eval_loss = g.loss(g.call("eval_step", step=0))
    return Run(losses=losses, eval_loss=eval_loss, weights=init)


@pytest.fixture(scope="module")
def tp2pp2(workdir: Path, reference: Run) -> Run:
    """tp2pp2dp1 from the reference weights; its full state exported after RESUME_AT steps."""
    state, weights = workdir / "tp2pp2_state.npz", workdir / "tp2pp2_weights.npz"
    with RankGroup(gpt_config(tp=2, pp=2, world_size=4), world_size=4, run_dir=workdir) as g:
        _start(g, reference)
        losses = g.train(range(RESUME_AT))
        g.call("save_global_weights", path=str(weights))
        arrays, blobs = export_group(g, RESUME_AT, state)
        losses += g.train(range(RESUME_AT, STEPS))
        eval_loss = g.loss(g.call("eval_step", step=0))
    return Run(losses=losses, eval_loss=eval_loss, weights=weights, state=state, arrays=arrays, blobs=blobs)


def _check_roundtrip(group: RankGroup, saved: Run, workdir: Path, tag: str) -> None:
    """Import ``saved``'s state; the weights and a fresh export must equal what was saved."""
    assert saved.state is not None and saved.arrays is not None and saved.blobs is not None
    assert import_group(group, saved.state, saved.blobs) == [RESUME_AT] * group.world_size
    weights = workdir / f"{tag}_imported_weights.npz"
    group.call("save_global_weights", path=str(weights))
    with np.load(weights) as got, np.load(saved.weights) as want:
        assert sorted(got.files) == sorted(want.files)
        for name in want.files:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    again, _ = export_group(group, RESUME_AT, workdir / f"{tag}_reexport.npz")
    assert sorted(again) == sorted(saved.arrays)
    for name, array in saved.arrays.items():
        np.testing.assert_array_equal(again[name], array, err_msg=name)


def test_reference_loss_is_finite_and_eval_is_deterministic(reference: Run) -> None:
    assert all(np.isfinite(reference.losses))
    assert abs(reference.losses[0] - np.log(128)) < 0.3  # untrained: about uniform over the vocab
    assert reference.losses[-1] < reference.losses[0]


def test_tp2pp2dp1_matches_tp1pp1(reference: Run, tp2pp2: Run) -> None:
    diff = _max_diff(tp2pp2.losses, reference.losses)
    _report("tp2pp2dp1", diff)
    assert diff < LAYOUT_TOL, (tp2pp2.losses, reference.losses)
    assert abs(tp2pp2.eval_loss - reference.eval_loss) < LAYOUT_TOL


def test_tp2pp2dp2_with_full_recompute_matches_tp1pp1(reference: Run, workdir: Path) -> None:
    cfg = gpt_config(tp=2, pp=2, world_size=8, training={"recompute": "full"})
    with RankGroup(cfg, world_size=8, run_dir=workdir) as g:
        _start(g, reference)
        coords = [(i["coords"]["tp"], i["coords"]["pp"], i["coords"]["dp"]) for i in g.setup_info]
        assert coords == [(r % 2, r // 4, (r // 2) % 2) for r in range(8)]
        assert [i["layers"] for i in g.setup_info] == [[0, 1]] * 4 + [[2, 3]] * 4
        results = [g.call("train_step", step=s) for s in range(STEPS)]
        # Megatron's groups are checked against ParallelDims at setup; a wrong layout must fail.
        errors = g.apply(check_groups_against, tp=2, pp=1, dp=4)
    assert all("pp group" in e and "ParallelDims(tp2pp1dp4)" in e for e in errors), errors
    owners = [[r for r, res in enumerate(step) if "loss" in res] for step in results]
    assert owners == [[4, 6]] * STEPS  # last stage, tp rank 0, one per DP replica
    losses = [g.loss(step) for step in results]
    diff = _max_diff(losses, reference.losses)
    _report("tp2pp2dp2 (recompute full)", diff)
    assert diff < LAYOUT_TOL, (losses, reference.losses)
    last = results[-1][4]
    assert set(last) == {"loss", "grad_norm", "lr", "tokens", "step_time_s", "rss_mb", "rss_peak_mb", "grad_sync_s",
                         "data_wait_s", "compute_s"}
    # the data-parallel gradient reduction, timed; the rest of the step is data wait and compute
    assert last["grad_sync_s"] > 0 and last["compute_s"] > 0 and last["rss_peak_mb"] > 0
    assert last["data_wait_s"] + last["grad_sync_s"] + last["compute_s"] == pytest.approx(last["step_time_s"])
    # each of the 2 replicas' owners reports its own tokens: the step's 16 x 32 counted once in the sum
    assert sum(results[-1][r]["tokens"] for r in (4, 6)) == 16 * 32 and last["grad_norm"] > 0


def test_tp1pp4_matches_tp1pp1_and_resumes_a_tp2pp2_state(reference: Run, tp2pp2: Run, workdir: Path) -> None:
    cfg = gpt_config(tp=1, pp=4, world_size=4, training={"recompute": "selective"})
    with RankGroup(cfg, world_size=4, run_dir=workdir) as g:
        _start(g, reference)
        assert [i["layers"] for i in g.setup_info] == [[0], [1], [2], [3]]
        losses = g.train(range(STEPS))
        _check_roundtrip(g, tp2pp2, workdir, "tp1pp4")
        resumed = g.train(range(RESUME_AT, STEPS))
    diff = _max_diff(losses, reference.losses)
    _report("tp1pp4 (recompute selective)", diff)
    assert diff < LAYOUT_TOL, (losses, reference.losses)
    resume_diff = _max_diff(resumed, tp2pp2.losses[RESUME_AT:])
    _report("tp2pp2 state resumed as tp1pp4 vs uninterrupted tp2pp2", resume_diff)
    assert resume_diff < RESUME_TOL, (resumed, tp2pp2.losses[RESUME_AT:])


def test_tp2pp2_state_resumes_in_tp1pp1(tp2pp2: Run, workdir: Path) -> None:
    with RankGroup(gpt_config(), world_size=1, run_dir=workdir) as g:
        g.setup()
        _check_roundtrip(g, tp2pp2, workdir, "tp1pp1")
        resumed = g.train(range(RESUME_AT, STEPS))
    resume_diff = _max_diff(resumed, tp2pp2.losses[RESUME_AT:])
    _report("tp2pp2 state resumed as tp1pp1 vs uninterrupted tp2pp2", resume_diff)
    assert resume_diff < RESUME_TOL, (resumed, tp2pp2.losses[RESUME_AT:])


def test_distributed_optimizer_matches_plain_and_its_state_is_exchangeable(
    reference: Run, tp2pp2: Run, workdir: Path
) -> None:
    cfg = gpt_config(tp=2, pp=1, world_size=4, parallel={"tp": 2, "pp": 1, "distributed_optimizer": True})
    with RankGroup(cfg, world_size=4, run_dir=workdir) as g:
        _start(g, reference)
        losses = g.train(range(RESUME_AT))
        mine, _ = export_group(g, RESUME_AT, workdir / "distopt_state.npz")
        losses += g.train(range(RESUME_AT, STEPS))
        _check_roundtrip(g, tp2pp2, workdir, "distopt")  # plain-optimizer state into ZeRO-1 shards
        resumed = g.train(range(RESUME_AT, STEPS))
    diff = _max_diff(losses, reference.losses)
    _report("tp2pp1dp2 distributed optimizer", diff)
    assert diff < LAYOUT_TOL, (losses, reference.losses)
    # The gathered ZeRO-1 state equals the plain optimizer's (a missing DP range would be zeros).
    assert tp2pp2.arrays is not None and sorted(mine) == sorted(tp2pp2.arrays)
    for name, array in tp2pp2.arrays.items():
        np.testing.assert_allclose(mine[name], array, rtol=1e-3, atol=1e-6, err_msg=name)
    resume_diff = _max_diff(resumed, tp2pp2.losses[RESUME_AT:])
    _report("tp2pp2 state resumed as tp2pp1dp2 distopt vs uninterrupted tp2pp2", resume_diff)
    assert resume_diff < RESUME_TOL, (resumed, tp2pp2.losses[RESUME_AT:])


def test_loss_falls_on_the_increment_task(workdir: Path) -> None:
    with RankGroup(gpt_config(tp=1, pp=2, world_size=2, steps=30), world_size=2, run_dir=workdir) as g:
        g.setup()
        losses = g.train(range(30))
    assert losses[-1] < 0.5 * losses[0], losses


SHIM_CHECK = """
import torch
from core.parallel import cpu_shim
assert cpu_shim.activate_if_needed() and cpu_shim.activate_if_needed()  # idempotent
assert torch.get_num_threads() == 1

class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + torch.ones(1, device="cuda")
    @staticmethod
    def backward(ctx, g):  # runs inside backward, where dispatch would pop the mode
        return g * torch.full((1,), 2.0, device=torch.cuda.current_device())

for run in (lambda y: y.backward(), lambda y: torch.autograd.backward(y)):
    x = torch.zeros(2, requires_grad=True)
    run(Scale.apply(x).sum())
    assert x.grad.tolist() == [2.0, 2.0], x.grad
t = torch.zeros(3).cuda()
assert t.device.type == "cpu" and t.type() == "torch.cuda.FloatTensor"
assert torch.zeros(1).to("cuda").device.type == "cpu"
assert torch.empty(2, device="cuda", pin_memory=True).device.type == "cpu"
torch.cuda.synchronize()
print("ok")
"""


def test_cpu_shim_maps_cuda_to_cpu_in_forward_and_backward() -> None:
    import subprocess

    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, check=True)
    if probe.stdout.strip() == "True":
        pytest.skip("CUDA is available: the shim is a no-op here")
    out = subprocess.run([sys.executable, "-c", SHIM_CHECK], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
