"""The same GRPO algorithm as ``program: grpo``, as one plain process: no controller, no
ZeroMQ, no worker groups, no second model to sync (the actor generates).

Launched by benchmarks/rl_step.py under torchrun with one process. The model, optimizer,
warm start, prompts, sampling seeds, rewards, advantages, scoring passes and clipped
updates are Baton's own functions (GPTTask, core.model.gpt.generate / policy, core.rl), called
directly; each RL step's phases are timed like the controller times them.
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


def rl_step(task: GPTTask, step: int, reward: rewards.RewardFn) -> dict[str, float]:
    """One GRPO iteration; seconds per phase."""
    ctx, cfg = task._ready(), task.cfg
    rl, t = cfg.rl, {}
    t0 = time.perf_counter()
    asked = tasks.counting(cfg.seed, step, rl.prompts_per_step, rl.prompt_length, cfg.model.vocab_size)
    prompts = [p for p, _ in asked for _ in range(rl.n)]
    seed = (cfg.seed * 7919 + step) * 1009 + 7
    actor = unwrap(ctx.model_chunks[0])
    actor.eval()
    how = gen_mod.Sampling(max_new_tokens=rl.max_response_length, temperature=rl.temperature, top_k=rl.top_k,
                           top_p=rl.top_p)
    tokens, _ = gen_mod.generate(actor, prompts, how, max_length=cfg.model.seq_length,
                                 seeds=[(seed * 1_000_003 + i) % 2**63 for i in range(len(prompts))])
    t["generate"], t0 = time.perf_counter() - t0, time.perf_counter()
    scores = [rewards.score(reward, prompts[i], tokens[i], asked[i // rl.n][1], index=i // rl.n)
              for i in range(len(prompts))]
    t["reward"], t0 = time.perf_counter() - t0, time.perf_counter()
    rows = Ragged.of([tuple(prompts[i]) + tuple(tokens[i]) for i in range(len(prompts))], TOKENS)
    old = score_rows(ctx, rl_calls.ScoreRows(model="actor", prompt_length=rl.prompt_length, sequences=rows),
                     ctx.model_chunks).logprobs
    t["old"], t0 = time.perf_counter() - t0, time.perf_counter()
    ref = score_rows(ctx, rl_calls.ScoreRows(model="reference", prompt_length=rl.prompt_length, sequences=rows),
                     task.role("reference").scored()).logprobs
    t["ref"], t0 = time.perf_counter() - t0, time.perf_counter()
    adv = advantages.grpo(scores, [i // rl.n for i in range(len(prompts))], norm_by_std=rl.norm_adv_by_std)
    agg = rl_calls.LossAgg(mode=rl.loss_agg_mode, tokens=sum(map(len, tokens)), rows=len(rows),
                           horizon=rl.max_response_length)
    batch = rl_calls.PolicyBatch(step=step, agg=agg, prompt_length=rl.prompt_length, sequences=rows,
                                  advantages=Ragged.of([(float(adv[i]),) * len(tokens[i]) for i in range(len(rows))],
                                                       FLOATS),
                                  old_logprobs=old, ref_logprobs=ref, kl_coef=float(rl.kl.coef))
    for _ in range(rl.ppo_epochs):
        policy_step(ctx, batch)
    t["update"] = time.perf_counter() - t0
    return t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--out", type=Path, required=True)
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
        t0 = time.perf_counter()
        phases = rl_step(task, step, reward)
        steps.append({"step_time_s": time.perf_counter() - t0, "phase_s": phases})
    args.out.write_text(json.dumps(steps))
    task.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
