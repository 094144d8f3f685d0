"""The generator colocated with a trainer: exact weight sync across layouts, and generation.

Real Megatron-core ranks (tests/integration/gpt_harness.py), the controller's part played by
the test: it plans the sync from every rank's slices (core.flows.reshard) and sends each
rank its pieces, as the controller's program does.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from core.checkpoint.spec import TensorSlice
from core.flows import calls as gen_calls
from core.flows import reshard
from core.wire.contract import NO_ARGS
from tests.helpers import as_rows, ints
from tests.integration.gpt_harness import RankGroup, gpt_config, greedy_reference

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]
PROMPTS = ((3, 4, 5, 6), (20, 21, 22, 23), (50, 51, 52, 53), (7, 9, 11, 13))


def _held(g: RankGroup) -> list[gen_calls.HeldSlices]:
    return [gen_calls.GEN_SLICES.decode_result(h) for h in g.call("gen_slices", **gen_calls.GEN_SLICES.encode_request(NO_ARGS))]


def _sync(g: RankGroup, version: int, bucket_bytes: int = 1 << 14) -> list[dict[str, Any]]:
    held = _held(g)
    pieces = reshard.plan({r: h.sources for r, h in enumerate(held)}, {r: h.targets for r, h in enumerate(held)},
                          bucket_bytes=bucket_bytes)
    remote = any(p.src != p.dst for p in pieces)  # local copies need no bucket of buffers
    assert len({p.bucket for p in pieces}) > 1 or not remote, "the plan should need several buckets at this size"
    per_rank = [gen_calls.SYNC_WEIGHTS.encode_request(gen_calls.SyncWeights(
        pieces=tuple(reshard.for_rank(pieces, r)), version=version)) for r in range(g.world_size)]
    return g.call_each("sync_weights", per_rank)


def _weights(task: Any) -> tuple[list[tuple[TensorSlice, np.ndarray]], list[tuple[TensorSlice, np.ndarray]]]:
    """This rank's trainer slices (every replica's) and generator slices, as arrays."""
    link = task.rank.link
    return ([(s, p.detach().numpy().copy()) for s, p in link._sources()],
            [(s, p.detach().numpy().copy()) for s, p in link._targets()])


def _plain_greedy(task: Any, prompts: tuple[tuple[int, ...], ...], new: int) -> list[list[int]]:
    """A reference loop: the whole sequence forward again for every token, no KV cache."""
    return greedy_reference(task.role("rollout").model.model, prompts, new)


def _generate(g: RankGroup, prompts: tuple[tuple[int, ...], ...] = PROMPTS, **kw: Any) -> list[dict[str, Any]]:
    req = gen_calls.GENERATE.encode_request(gen_calls.Generate(prompts=ints(prompts), **kw))
    return [r for r in map(as_rows, g.call("generate", **req)) if r.get("tokens")]


def _assert_synced_exactly(g: RankGroup) -> None:
    """Bit for bit: every generator slice equals the trainer's global tensor there (and every
    trainer replica holds the same values: any of them may have sent it)."""
    parts = g.apply(_weights)
    full: dict[str, np.ndarray] = {}
    for sources, _ in parts:
        for s, a in sources:
            box = tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape, strict=True))
            whole = full.setdefault(s.name, np.full(s.global_shape, np.nan, a.dtype))
            assert np.isnan(whole[box]).all() or np.array_equal(whole[box], a.reshape(s.shape)), s.name
            whole[box] = a.reshape(s.shape)
    for rank, (_, targets) in enumerate(parts):
        for s, a in targets:
            box = full[s.name][tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape, strict=True))]
            assert np.array_equal(box.reshape(a.shape), a), f"rank {rank}: {s.name} differs after the sync"


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2)],
                         ids=["tp1dp4-to-tp1dp4", "tp2dp2-zero1-to-tp1dp4", "tp2pp2-tied-to-tp1dp4"])
def test_every_trainer_replica_sends_its_share_exactly(tmp_path, tp: int, pp: int) -> None:
    """Colocated, each rank copies what it holds and every data-parallel replica of the
    trainer sends: no rank sends more than the model over the replicas and one bucket. With
    a tied embedding over two stages the last stage's copy is a source too (it is equal)."""
    cfg = gpt_config(tp=tp, pp=pp, world_size=4, parallel={"sharding": "optimizer"}, model={"tie_embeddings": pp > 1},
                     generator={"enabled": True, "tp": 1})
    bucket, replicas = 1 << 14, 4 // tp // pp
    with RankGroup(cfg, world_size=4, run_dir=tmp_path) as g:
        g.setup()
        g.train(range(2))
        model_bytes = sum(4 * math.prod(s.shape) for s in _held(g)[0].targets)  # a tp1 replica: the whole model
        synced = [gen_calls.SYNC_WEIGHTS.decode_result(s) for s in _sync(g, version=2, bucket_bytes=bucket)]
        _assert_synced_exactly(g)
    sent = [s.bytes_sent for s in synced]
    assert sum(sent) == sum(s.bytes_received for s in synced)
    if tp == 1:
        assert sent == [0] * 4  # every byte a local copy
    else:  # each rank receives what it lacks, from any replica that holds it
        assert max(sent) <= model_bytes // replicas + bucket and min(sent) > 0, sent


@pytest.mark.parametrize("gen_tp", [1, 2], ids=["tp2pp2-to-tp1dp4", "tp2pp2-to-tp2dp2"])
def test_weights_sync_exactly_and_the_generator_scores_as_the_trainer(tmp_path, gen_tp: int) -> None:
    cfg = gpt_config(tp=2, pp=2, world_size=4, generator={"enabled": True, "tp": gen_tp})
    with RankGroup(cfg, world_size=4, run_dir=tmp_path) as g:
        g.setup()
        g.train(range(3))
        synced = _sync(g, version=3)
        assert {s["version"] for s in synced} == {3}
        _assert_synced_exactly(g)
        batch = [b for b in g.call("probe_batch", step=0) if b.get("tokens")]
        assert len(batch) == 1  # the trainer's last stage, first tp rank of data replica 0 (rank 2)
        first = {r for r in range(4) if r // gen_tp == 0}  # the generator's first replica scores it
        scored = [s for s in g.call_each("score", [dict(batch[0], logprobs=[]) if r in first else {}
                                                   for r in range(4)]) if s.get("logprobs")]
        gap = np.abs(np.array(scored[0]["logprobs"]) - np.array(batch[0]["logprobs"])).max()
        assert len(scored) == 1 and gap < 1e-5, gap  # fp32; the layouts sum in other orders

        greedy = _generate(g, max_new_tokens=6)
        assert {r["version"] for r in greedy} == {3} and len(greedy) == 4 // gen_tp  # one answer per replica
        assert all(r["tokens"] == greedy[0]["tokens"] for r in greedy)  # greedy: every replica agrees
        if gen_tp == 1:  # a tp1 generator is a whole model in one process: the reference loop runs there
            assert [list(t) for t in greedy[0]["tokens"]] == g.apply(_plain_greedy, prompts=PROMPTS, new=6)[0]
        sampled = _generate(g, max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.9, seed=11)
        again = _generate(g, max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.9, seed=11)
        assert [r["tokens"] for r in sampled] == [r["tokens"] for r in again]  # keyed by (seed, prompt index)
        assert all(r["tokens"] == sampled[0]["tokens"] for r in sampled)  # not by replica: layouts agree
        other = _generate(g, max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.9, seed=12)
        assert other[0]["tokens"] != sampled[0]["tokens"]
        alone = _generate(g, prompts=PROMPTS[2:3], max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.9, seed=11,
                          indices=(2,))
        assert alone[0]["tokens"][0] == sampled[0]["tokens"][2]  # a prompt draws the same in any batch
        for r in greedy + sampled:
            assert all(lp <= 0 for row in r["logprobs"] for lp in row)
