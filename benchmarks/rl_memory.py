"""Peak memory of an RL update at 2,560 tokens per row beside ``baton plan``'s figure for it
(core.config.rlplan), same run; asserts each within 15 %.

    python benchmarks/rl_memory.py [--quick] [--json PATH] [key=value ...]

One process builds the actor as a worker does (GPTTask, experiments/grpo_tiny.yaml at tp1
pp1 dp1, fp32 on this CPU) with a model whose head dominates: vocabulary 32,768, hidden 64,
2 layers, 2 attention heads, rows of prompt 512 + response 2,048 tokens (--quick: 128 +
512). Each variant (micro-batch rows, entropy bonus on or off; and a token budget,
``rl.max_tokens_per_micro_batch``, of two rows) takes one warm-up optimizer step
(core.model.gpt.policy.policy_step: Adam's moments exist afterwards), then one measured step.

Measured: the bytes held before the step (the actor's parameters, gradient buffers and
optimizer state, core.model.gpt.memory) plus the step's peak of live allocations above
them, read from the allocator through torch's profiler (``profile_memory``: every CPU
allocation and free with the allocator's running total; ``peak_above_start``, the one home
of that private API here, fails loudly if torch stops reporting them). The plan: the same
config through ``plan_rl_update``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from core.config import run as config_mod  # noqa: E402
from core.config.plan import make_plan  # noqa: E402
from core.config.rlplan import plan_rl_update  # noqa: E402
from core.config.runplan import plan_run  # noqa: E402
from core.model.gpt import memory  # noqa: E402
from core.model.gpt.policy import policy_step  # noqa: E402
from core.model.gpt.task import GPTTask  # noqa: E402
from core.wire import calls, rl_calls  # noqa: E402
from core.wire.ragged import FLOATS, TOKENS, Ragged  # noqa: E402
from core.worker.task import WorkerContext  # noqa: E402

EXP = REPO / "experiments" / "grpo_tiny.yaml"
TOLERANCE = 0.15
MODEL = ["trainer.n_gpus_per_node=1", "model.vocab_size=32768", "model.hidden_size=64", "model.num_layers=2",
         "model.num_attention_heads=2", "training.mixed_precision.enabled=false", "rl.kl.coef=0",
         "generator.prompt_length=8", "generator.max_new_tokens=8"]
ROWS = 2


def _events(nodes: list[Any]) -> Iterator[Any]:
    for n in nodes:
        yield n
        yield from _events(n.children)


def peak_above_start(fn: Callable[[], object]) -> int:
    """The most bytes allocated while ``fn`` ran, live at once, above what was allocated when
    it began (torch's CPU allocator as its profiler reports it)."""
    from torch._C._profiler import _EventType  # private: the profiler's raw allocation events

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocs = sorted((e for e in _events(prof.profiler.kineto_results.experimental_event_tree())
                     if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)
    if not allocs:
        raise RuntimeError("torch's profiler reported no allocations: its memory events changed; update "
                           "peak_above_start")
    first = allocs[0].extra_fields
    start = first.total_allocated - first.alloc_size
    return max(e.extra_fields.total_allocated for e in allocs) - start


def _batch(cfg: config_mod.RunConfig) -> rl_calls.PolicyBatch:
    """``ROWS`` rows of whole responses (the longest rows the config allows), random tokens."""
    rl, rng = cfg.rl, np.random.default_rng(0)
    p, r = rl.prompt_length, rl.max_response_length
    seqs = Ragged.of([rng.integers(0, cfg.model.vocab_size, p + r) for _ in range(ROWS)], TOKENS)
    return rl_calls.PolicyBatch(
        step=0, agg=rl_calls.LossAgg(mode="token-mean", tokens=ROWS * r, rows=ROWS, horizon=r), prompt_length=p,
        sequences=seqs, advantages=Ragged.of([rng.normal(0, 1, r) for _ in range(ROWS)], FLOATS),
        old_logprobs=Ragged.of([np.full(r, -10.0) for _ in range(ROWS)], FLOATS))


def _variants(base: config_mod.RunConfig) -> dict[str, list[str]]:
    out = {f"micro {m}{', entropy' if e else ''}": [f"training.micro_batch_size={m}", f"rl.entropy_coef={e}"]
           for m, e in ((1, 0), (1, 0.01), (2, 0), (2, 0.01))}
    row = base.rl.prompt_length + base.rl.max_response_length  # the token budget: two whole rows
    out["token budget 2 rows, entropy"] = [f"rl.max_tokens_per_micro_batch={2 * row}", "rl.entropy_coef=0.01"]
    return out


def measure(task: GPTTask, cfg: config_mod.RunConfig) -> dict[str, float]:
    """One warm-up step and one measured step of the actor under ``cfg``: bytes held and peak."""
    ctx = dataclasses.replace(task._ready(), cfg=cfg)
    batch = _batch(cfg)
    policy_step(ctx, batch)
    weights, grads, moments, _ = memory.measured(ctx, 1)
    peak = peak_above_start(lambda: policy_step(ctx, batch))
    return {"held": weights + grads + moments, "peak_above": float(peak), "total": weights + grads + moments + peak}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="rows of 128 + 512 tokens")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args()
    prompt, response = (128, 512) if args.quick else (512, 2048)
    lengths = [f"rl.prompt_length={prompt}", f"rl.max_response_length={response}",
               f"model.seq_length={prompt + response}", f"training.global_batch_size={ROWS}",
               "training.micro_batch_size=1"]
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    base = config_mod.load(EXP, [*MODEL, *lengths, *args.overrides])
    ctx = WorkerContext(rank=0, world_size=1, epoch=0, run_dir=Path("/tmp"), host=socket.gethostname(),
                        log=logging.getLogger("rl_memory"), config=base, roles=plan_run(base).roles_at(0))
    task = GPTTask(ctx)
    task.setup(calls.Setup(master_addr="", master_port=0))
    results: dict[str, Any] = {}
    for name, extra in _variants(base).items():
        cfg = config_mod.load(EXP, [*MODEL, *lengths, *args.overrides, *extra])
        planned = plan_rl_update(cfg, make_plan(cfg))
        assert planned is not None
        got = measure(task, cfg)
        results[name] = {"measured": got, "plan": dataclasses.asdict(planned),
                         "ratio": planned.total_bytes / got["total"]}
    task.close()
    print(f"RL update at {prompt + response:,} tokens per row (vocab {base.model.vocab_size:,}, fp32, CPU): "
          f"peak per rank, measured beside the plan (tolerance ±{TOLERANCE:.0%})")
    print(f"  {'variant':<30} {'measured MiB':>13} {'plan MiB':>10} {'ratio':>7}   plan: static / layers / head")
    for name, r in results.items():
        p = r["plan"]
        print(f"  {name:<30} {r['measured']['total'] / 2**20:>13.1f} {p['total_bytes'] / 2**20:>10.1f} "
              f"{r['ratio']:>7.3f}   {p['static_bytes'] / 2**20:.1f} / {p['activations_bytes'] / 2**20:.1f} / "
              f"{p['logits_bytes'] / 2**20:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"tokens_per_row": prompt + response, "results": results}, indent=1))
    off = [name for name, r in results.items() if abs(r["ratio"] - 1) > TOLERANCE]
    assert not off, f"the plan is off by more than {TOLERANCE:.0%} for: {', '.join(off)}"
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
