"""The same GRPO algorithm as ``program: grpo``, as one plain process: no controller, no
ZeroMQ, no worker groups, no reward processes, no second model to sync (the actor generates).

Launched by benchmarks/rl_step.py under torchrun with one process. The model, optimizer,
warm start, prompts (the built-in tasks: ``counting``, ``count_to``), sampling seeds, stop
tokens, rewards, advantages, scoring passes, mini-batches and clipped updates are Baton's own
functions (GPTTask, core.model.gpt.generate / policy, core.rl), called directly as
core.controller.rl_program calls them through the workers; each RL step's phases are timed
like the controller times them.

``--no-eos-rollout``: before each RL step (outside its time), the step's rollout with its
stop tokens ignored (every row ``rl.max_response_length`` new tokens; the same prompts, seeds
and weights), timed as ``generate_no_eos_s``: what the rollout costs when it cannot stop at
the end of text. Up to each row's first stop token it draws what the step's rollout draws
(``no_eos_agrees``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from core.config import run as config_mod  # noqa: E402
from core.config.runplan import plan_run  # noqa: E402
from core.model.gpt import generate as gen_mod  # noqa: E402
from core.model.gpt.model import unwrap  # noqa: E402
from core.model.gpt.policy import policy_step, score_rows  # noqa: E402
from core.model.gpt.task import GPTTask  # noqa: E402
from core.rl import advantages, rewards, tasks  # noqa: E402
from core.wire import calls, rl_calls  # noqa: E402
from core.wire.ragged import FLOATS, TOKENS, Ragged  # noqa: E402
from core.worker.task import WorkerContext  # noqa: E402


def _rows(rows: list[tuple[Any, ...]], ints: bool) -> Any:
    """Rows as the RL calls take them (the controller builds the same from the same numbers)."""
    return Ragged.of(rows, TOKENS if ints else FLOATS)


def ask(cfg: Any, step: int) -> tuple[list[tasks.Asked], tuple[int, ...]]:
    """The step's prompts and the stop tokens, as RLStep asks them for a built-in task."""
    rl = cfg.rl
    if rl.task == "count_to":
        return (tasks.count_to(cfg.seed, step, rl.prompts_per_step, rl.prompt_length, rl.max_response_length,
                               cfg.model.vocab_size), (tasks.count_to_eot(cfg.model.vocab_size),))
    if rl.task != "counting":
        raise SystemExit(f"plain_grpo_loop: rl.task {rl.task!r}: only the built-in tasks (counting, count_to)")
    return tasks.counting(cfg.seed, step, rl.prompts_per_step, rl.prompt_length, cfg.model.vocab_size), ()


def rollout(task: GPTTask, step: int, prompts: list[tuple[int, ...]], stop: tuple[int, ...]
            ) -> tuple[list[list[int]], list[list[float]]]:
    """The actor's continuations of ``prompts`` with the seeds the generator group uses."""
    cfg, rl = task.cfg, task.cfg.rl
    seed = (cfg.seed * 7919 + step) * 1009 + 7
    actor = unwrap(task._ready().model_chunks[0])
    actor.eval()
    how = gen_mod.Sampling(max_new_tokens=rl.max_response_length, temperature=rl.temperature, top_k=rl.top_k,
                           top_p=rl.top_p, eos=stop)
    return gen_mod.generate(actor, prompts, how, max_length=cfg.model.seq_length,  # chunked as the generator is
                            seeds=[(seed * 1_000_003 + i) % 2**63 for i in range(len(prompts))],
                            max_batch_tokens=cfg.generator.max_batch_tokens)


def _until(tokens: list[int], stop: tuple[int, ...]) -> tuple[int, ...]:
    """A response up to and including its first stop token (core.controller.generation.Responses.until)."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
    return tuple(tokens[:end])


def rl_step(task: GPTTask, step: int, reward: rewards.RewardFn) -> tuple[dict[str, float], list[int]]:
    """One GRPO iteration: seconds per phase, and its responses' lengths."""
    ctx, cfg = task._ready(), task.cfg
    rl, t = cfg.rl, {}
    t0 = time.perf_counter()
    asked, stop = ask(cfg, step)
    prompts = [a.tokens for a in asked for _ in range(rl.n)]
    tokens, _ = rollout(task, step, prompts, stop)
    responses = [_until(r, stop) for r in tokens]
    t["generate"], t0 = time.perf_counter() - t0, time.perf_counter()
    scores = [rewards.score(reward, prompts[i], responses[i], asked[i // rl.n].meta, index=i // rl.n)
              for i in range(len(prompts))]
    t["reward"], t0 = time.perf_counter() - t0, time.perf_counter()
    rows = [tuple(prompts[i]) + responses[i] for i in range(len(prompts))]
    sequences = _rows(rows, ints=True)
    mini = rl.mini_batch_size or 0  # one replica: its mini-batches are the whole batch's
    old = score_rows(ctx, rl_calls.ScoreRows(model="actor", prompt_length=rl.prompt_length, sequences=sequences,
                                             mini_batch=mini), ctx.model_chunks).logprobs
    t["old"], t0 = time.perf_counter() - t0, time.perf_counter()
    ref, coef = _rows([], ints=False), 0.0
    if rl.kl.enabled:
        ref = score_rows(ctx, rl_calls.ScoreRows(model="reference", prompt_length=rl.prompt_length,
                                                 sequences=sequences, mini_batch=mini),
                         task.role("reference").scored()).logprobs
        coef = float(rl.kl.coef)
        t["ref"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    adv = advantages.grpo(scores, [i // rl.n for i in range(len(prompts))], norm_by_std=rl.norm_adv_by_std)
    per_token = [(float(adv[i]),) * len(responses[i]) for i in range(len(rows))]
    size = mini or len(rows)
    batches = []
    for lo in range(0, len(rows), size):
        part = slice(lo, lo + size)
        agg = rl_calls.LossAgg(mode=rl.loss_agg_mode, tokens=sum(map(len, responses[part])), rows=len(rows[part]),
                               horizon=rl.max_response_length)
        batches.append(rl_calls.PolicyBatch(
            step=step, agg=agg, prompt_length=rl.prompt_length, sequences=_rows(rows[part], ints=True),
            advantages=_rows(per_token[part], ints=False), old_logprobs=_rows(list(old)[part], ints=False),
            ref_logprobs=_rows(list(ref)[part], ints=False), kl_coef=coef))
    for _ in range(rl.ppo_epochs):
        for batch in batches:
            policy_step(ctx, batch)
    t["update"] = time.perf_counter() - t0
    return t, [len(r) for r in responses]


def no_eos_rollout(task: GPTTask, step: int) -> dict[str, Any]:
    """Step ``step``'s rollout (its prompts, seeds and weights) with its stop tokens ignored,
    timed; where each row would have stopped. Nothing for a task without stop tokens."""
    asked, stop = ask(task.cfg, step)
    if not stop:
        return {}
    prompts = [a.tokens for a in asked for _ in range(task.cfg.rl.n)]
    t0 = time.perf_counter()
    tokens, _ = rollout(task, step, prompts, ())
    return {"generate_no_eos_s": time.perf_counter() - t0, "no_eos_lengths": [len(_until(r, stop)) for r in tokens]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-eos-rollout", action="store_true", help="time each step's rollout again, stops ignored")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
    cfg = config_mod.load(args.config, args.overrides)  # its generator model is built and never used
    rank = 0
    ctx = WorkerContext(rank=rank, world_size=1, epoch=0, run_dir=args.out.parent, host=socket.gethostname(),
                        log=logging.getLogger("plain"), config=cfg, roles=plan_run(cfg).roles_at(rank))
    task = GPTTask(ctx)
    task.setup(calls.Setup(master_addr="", master_port=0))
    for step in range(cfg.rl.warmup_steps):
        task.role("actor").train_step(calls.Step(step=step))
    reference = task.role("reference")
    with torch.no_grad():  # the reference: the actor at the end of the warm start
        for ref, actor in zip(reference.chunks[0].parameters(), unwrap(task._ready().model_chunks[0]).parameters(),
                              strict=True):
            ref.copy_(actor)
    reference.loaded = True
    reward = rewards.load(cfg.rl.reward)
    steps = []
    for step in range(cfg.rl.warmup_steps, cfg.trainer.steps):
        record: dict[str, Any] = {}
        if args.no_eos_rollout:
            record.update(no_eos_rollout(task, step))
        t0 = time.perf_counter()
        phases, lengths = rl_step(task, step, reward)
        record.update(step_time_s=time.perf_counter() - t0, phase_s=phases, lengths=lengths)
        if "no_eos_lengths" in record:  # the same draws up to each row's stop token
            record["no_eos_agrees"] = record.pop("no_eos_lengths") == lengths
        steps.append(record)
    args.out.write_text(json.dumps(steps))
    task.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
