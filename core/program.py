"""The controller's training program: one readable loop over the worker group.

    register → setup → for each step: train_step, record, maybe checkpoint → shutdown

Bulk tensors never come here; each step brings back a few numbers per rank.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

from core import config as config_mod
from core.config import RunConfig
from core.controller import WorkerGroup
from core.dispatch import collect_all
from core.runfolder import RunFolder, event

log = logging.getLogger(__name__)


@dataclass
class Program:
    cfg: RunConfig
    run: RunFolder
    group: WorkerGroup
    state: dict[str, Any]

    def save_state(self) -> None:
        self.run.write_state(self.state)

    def setup(self) -> None:
        group = self.group
        group.wait_for_workers()
        addr, port = group.rendezvous
        infos = group.call(
            "setup", config=config_mod.to_dict(self.cfg), master_addr=addr, master_port=port,
            timeout_s=self.cfg.timeouts.setup_s,
        )
        self.state["ranks"] = [
            {"rank": p.rank, "node": p.node, "host": p.host, "pid": p.pid, **(infos[p.rank] or {})}
            for p in sorted(group.peers.values(), key=lambda p: p.rank)
        ]
        event(self.state, "workers_ready", world_size=group.world_size, epoch=group.epoch)
        self.save_state()

    def train(self) -> None:
        cfg = self.cfg
        start = int(self.state.get("step", 0))
        owners = self.group.dims.loss_owners()
        for step in range(start, cfg.trainer.steps):
            t0 = time.perf_counter()
            results = self.group.call("train_step", step=step, collect=collect_all, timeout_s=cfg.timeouts.step_s)
            wall = time.perf_counter() - t0
            record = self._record(step, results, owners, wall)
            self.run.append_metrics(record)
            self.state.update(step=step + 1, last_loss=record["loss"], updated=time.time())
            if (step + 1) % cfg.trainer.log_interval_steps == 0 or step + 1 == cfg.trainer.steps:
                log.info("step %d/%d loss %.4f (%.3f s)", step + 1, cfg.trainer.steps, record["loss"], wall)
                self.save_state()

    def _record(self, step: int, results: list[Any], owners: list[int], wall: float) -> dict[str, Any]:
        losses = [results[r]["loss"] for r in owners]
        first = results[owners[0]]
        rank_times = [float(r.get("step_time_s", 0.0)) for r in results]
        tokens = sum(int(results[r].get("tokens", 0)) for r in owners)
        return {
            "step": step,
            "loss": statistics.fmean(losses),
            "grad_norm": first.get("grad_norm"),
            "lr": first.get("lr"),
            "tokens": tokens,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "step_time_s": wall,
            "rank_step_time_s": rank_times,
            "rss_mb": [float(r.get("rss_mb", 0.0)) for r in results],
            "time": time.time(),
        }
