"""The controller's Prometheus endpoint: live gauges and histograms of a run.

The only module that imports prometheus_client; only the controller uses it. Everything
lives on a private ``CollectorRegistry`` (never the library's global one), so two
``Metrics`` in one process (tests) do not collide, and the endpoint shows Baton's series
only. ``start`` serves it over HTTP and writes ``metrics.json`` into the run folder::

    {"address": "http://<host>:<port>/metrics", "host": ..., "port": ..., "pid": ..., "started": ...,
     "run": "<name>/<run id>", "node": ..., "sd_file": ... (with metrics.sd_dir)}

Exposed series (every one labelled ``run``, core.record.discovery, so one Prometheus keeps
runs apart; ``rank`` labels are worker ranks, ``method`` labels RPC method names):

    baton_step, baton_loss, baton_learning_rate, baton_grad_norm, baton_tokens_per_second
    baton_tokens_total (counter), baton_step_time_seconds (histogram)
    baton_rank_step_time_seconds{rank}, baton_straggler_score{rank} (rank compute time / median),
    baton_rank_compute_seconds{rank}
    baton_rank_rss_bytes{rank}, baton_rank_cuda_peak_bytes{rank}, baton_rank_data_wait_seconds{rank},
    baton_rank_grad_sync_seconds{rank}, baton_heartbeat_lag_seconds{rank}
    baton_dispatch_latency_seconds{method} (histogram)
    baton_checkpoint_duration_seconds, baton_checkpoint_gbps, baton_checkpoints_total (counter)
    baton_restarts, baton_goodput_ratio, baton_goodput_useful_seconds, baton_goodput_allocated_seconds
    baton_weight_sync_bytes_sent_max, baton_weight_sync_bytes_sent_total (the generator's last weight sync)

The recording methods take what the program already has (one ``StepRecord``, a lag, a
latency) and never raise on an odd value (None, NaN, a wrong type): a metric is
observability, and a bad number in a record must not stop a training run.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

from core.config.sections import NODE
from core.errors import UserError
from core.job import netaddr
from core.record import discovery
from core.record.runfolder import RunFolder, write_json
from core.record.steps import StepRecord

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
_MIB = 2**20  # rss_mb / cuda_peak_mb in records are MiB (see core.worker.runtime._rss_mb)

# Step times from a millisecond toy step to a minute-long pipeline step.
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A control-plane round trip is tens of microseconds; a setup call can take minutes.
DISPATCH_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                      1.0, 2.5, 10.0, 60.0, 300.0)


def metrics_file(run: RunFolder) -> Path:
    """Where ``start`` publishes the endpoint's address."""
    return run.path / METRICS_FILE


def _num(value: Any) -> float | None:
    """A finite-or-not float from a record field, or None when it is unset or not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _per_rank(value: Any) -> list[float | None]:
    """A per-rank list field as floats (None for holes); anything else as no ranks."""
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        return []
    return [_num(v) for v in value]


RL_GAUGES = (("reward_mean", "Mean reward"), ("reward_std", "Reward standard deviation"),
             ("response_length", "Mean response length in tokens"), ("kl", "KL estimate to the reference policy"),
             ("kl_coef", "KL coefficient"), ("entropy", "Token-mean entropy of the actor"),
             ("clip_frac", "Fraction of clipped tokens"), ("optimizer_steps", "The actor's optimizer steps in the RL step"),
             ("sync_logprob_maxdiff", "Largest actor vs rollout log-prob gap"), ("policy_version", "Policy version"),
             ("staleness", "Policy versions the step's rollout lags the actor (rl.max_staleness)"),
             ("value_loss", "The critic's value loss (ppo)"), ("values_mean", "Mean value of the response tokens (ppo)"))
VAL_GAUGES = (("val_reward_mean", "Mean reward of greedy responses to the held-out prompts"),
              ("val_reward_mean_sampled", "Mean reward of sampled responses to the held-out prompts"))

class _Labelled:
    """``registry``'s series with ``labels`` added to every sample (prometheus_client has no
    constant labels): what the endpoint serves."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._registry = registry
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**self._labels, **s.labels}) for s in family.samples]
            yield out

    def describe(self) -> list[Metric]:
        """The families' names, so a scrape restricted by ``name[]`` finds them."""
        return list(self.collect())


class Metrics:
    """Prometheus series for one controller process; ``start`` to serve, ``close`` to stop."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.step = Gauge("baton_step", "Last completed training step (0-based index + 1)", registry=reg)
        self.loss = Gauge("baton_loss", "Training loss of the last step", registry=reg)
        self.lr = Gauge("baton_learning_rate", "Learning rate of the last step", registry=reg)
        self.grad_norm = Gauge("baton_grad_norm", "Gradient norm of the last step", registry=reg)
        self.tokens_per_s = Gauge("baton_tokens_per_second", "Tokens per second of the last step", registry=reg)
        self.tokens = Counter("baton_tokens", "Tokens trained on by this controller", registry=reg)
        self.step_time = Histogram("baton_step_time_seconds", "Wall time of one step as the controller saw it",
                                   buckets=STEP_BUCKETS_S, registry=reg)
        self.rank_step_time = Gauge("baton_rank_step_time_seconds", "Compute time of the last step on one rank",
                                    ["rank"], registry=reg)
        self.straggler = Gauge("baton_straggler_score", "Rank compute time (else step time) divided by the median "
                               "over ranks", ["rank"], registry=reg)
        self.compute = Gauge("baton_rank_compute_seconds", "Time one rank computed in the last step (less its data "
                             "wait and gradient reduction)", ["rank"], registry=reg)
        self.rss = Gauge("baton_rank_rss_bytes", "Resident memory of one worker", ["rank"], registry=reg)
        self.cuda_peak = Gauge("baton_rank_cuda_peak_bytes", "Peak CUDA memory allocated on one rank",
                               ["rank"], registry=reg)
        self.data_wait = Gauge("baton_rank_data_wait_seconds", "Time one rank waited for its batch in the last step",
                               ["rank"], registry=reg)
        self.grad_sync = Gauge("baton_rank_grad_sync_seconds", "Gradient all-reduce time of one rank in the last step",
                               ["rank"], registry=reg)
        self.hb_lag = Gauge("baton_heartbeat_lag_seconds", "Seconds since the controller last heard from a rank",
                            ["rank"], registry=reg)
        self.dispatch = Histogram("baton_dispatch_latency_seconds", "Controller-side latency of one group call",
                                  ["method"], buckets=DISPATCH_BUCKETS_S, registry=reg)
        self.ckpt_duration = Gauge("baton_checkpoint_duration_seconds", "Duration of the last checkpoint save",
                                   registry=reg)
        self.ckpt_gbps = Gauge("baton_checkpoint_gbps", "Write throughput of the last checkpoint, GB/s (1e9 B)",
                               registry=reg)
        self.ckpts = Counter("baton_checkpoints", "Checkpoints saved by this controller", registry=reg)
        self.restarts = Gauge("baton_restarts", "Restarts (requeues) of this run so far", registry=reg)
        self.goodput = Gauge("baton_goodput_ratio", "Useful training time / allocated time, across requeues",
                             registry=reg)
        self.useful = Gauge("baton_goodput_useful_seconds", "Time spent in completed steps, across requeues",
                            registry=reg)
        self.allocated = Gauge("baton_goodput_allocated_seconds", "Time the run held its allocation, across requeues",
                               registry=reg)
        # program: grpo or ppo, on RL steps (core.controller.rl_program)
        self.rl = {key: Gauge(f"baton_rl_{key}", f"{what} of the last RL step", registry=reg) for key, what in RL_GAUGES}
        self.rl.update({key: Gauge(f"baton_rl_{key}", f"{what} at the last validation (rl.val_every)", registry=reg)
                        for key, what in VAL_GAUGES})
        self.sync_sent = {key: Gauge(f"baton_weight_{key}", what, registry=reg) for key, what in (
            ("sync_bytes_sent_max", "Bytes the rank that sent most sent in the last weight sync"),
            ("sync_bytes_sent_total", "Bytes all ranks sent to other ranks in the last weight sync"))}
        self.rl_phase = Gauge("baton_rl_phase_seconds", "Wall time of one phase of the last RL step", ["phase"],
                              registry=reg)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sd_file: Path | None = None
        self.address = ""

    # --- serving ------------------------------------------------------------------------
    def start(self, run: RunFolder, port: int = 0, *, host: str | None = None, bind: str = "127.0.0.1",
              sd_dir: str | None = None) -> str:
        """Serve ``/metrics`` on ``port`` (0: any free one); publish and return the address.

        ``bind`` is the interface the server listens on (``metrics.bind``: loopback by default;
        "0.0.0.0" for all interfaces, which a scraper on another host needs; ``node`` this
        node's routable address, core.job.netaddr). ``host`` is the name scrapers should use
        when it listens on all interfaces (the controller host; defaults to this machine's
        hostname); otherwise the published address is the one it listens on. Every series
        carries the run's ``run`` label. ``sd_dir``: also publish a file_sd target there
        (core.record.discovery), withdrawn by ``close``.
        """
        if self._server is not None:
            raise RuntimeError("Metrics.start called twice")
        node = netaddr.node_address(os.environ) if bind == NODE else None
        listen = node.ip if node is not None else bind
        served = CollectorRegistry()
        served.register(_Labelled(self.registry, {"run": discovery.run_label(run.path)}))
        try:
            self._server, self._thread = start_http_server(port, addr=listen, registry=served)
        except OSError as exc:
            raise UserError(f"metrics.port: cannot serve on {listen}:{port} ({exc.strerror}); "
                            "set metrics.port=0 for any free port or metrics.enabled=false") from None
        actual = int(self._server.server_port)
        if listen in ("0.0.0.0", "::", ""):
            host = host or socket.gethostname()
        else:
            host = netaddr.url_host(listen)
        self.address = f"http://{host}:{actual}/metrics"
        info = {"address": self.address, "host": host, "port": actual, "pid": os.getpid(), "started": time.time(),
                "run": discovery.run_label(run.path),
                "node": os.environ.get("SLURMD_NODENAME") or (node.name if node else socket.gethostname())}
        if sd_dir is not None:
            self._sd_file = discovery.write_target(Path(sd_dir), run.path, f"{host}:{actual}", {"node": info["node"]})
            info["sd_file"] = None if self._sd_file is None else str(self._sd_file)
        write_json(run.path / METRICS_FILE, info)
        log.info("metrics at %s", self.address)
        return self.address

    def close(self) -> None:
        """Withdraw the file_sd target and stop the HTTP server (idempotent). metrics.json
        stays: it names the last address."""
        sd_file, self._sd_file = self._sd_file, None
        if sd_file is not None:
            discovery.remove_target(sd_file)
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    # --- recording ----------------------------------------------------------------------
    def observe_step(self, record: StepRecord) -> None:
        """Update every per-step series from one step's record (core.controller.program)."""
        step = _num(record.step)
        if step is not None:
            self.step.set(step + 1)
        for gauge, value in ((self.loss, record.loss), (self.lr, record.lr), (self.grad_norm, record.grad_norm),
                             (self.tokens_per_s, record.tokens_per_s)):
            num = _num(value)
            if num is not None:
                gauge.set(num)
        tokens = _num(record.tokens)
        if tokens is not None and tokens >= 0:  # NaN fails this too: a Counter only goes up
            self.tokens.inc(tokens)
        wall = _num(record.step_time_s)
        if wall is not None and wall >= 0:
            self.step_time.observe(wall)
        self._observe_ranks(record)
        self._observe_rl(record)

    def _observe_rl(self, record: StepRecord) -> None:
        for gauges in (self.rl, self.sync_sent):
            for key in gauges:
                num = _num(getattr(record, key))
                if num is not None:
                    gauges[key].set(num)
        for phase, seconds in (record.phase_s or {}).items():
            num = _num(seconds)
            if num is not None:
                self.rl_phase.labels(phase=phase).set(num)

    def _observe_ranks(self, record: StepRecord) -> None:
        for rank, t in enumerate(_per_rank(record.rank_step_time_s)):
            if t is not None:
                self.rank_step_time.labels(rank=str(rank)).set(t)
        # The score compares compute times where the task measures them: in a synchronous
        # step every rank's wall time is the slowest one's (the others wait for it).
        times = _per_rank(record.compute_s or record.rank_step_time_s)
        # A NaN time would make the median, and so every rank's score, meaningless.
        known = [t for t in times if t is not None and math.isfinite(t)]
        median = statistics.median(known) if known else 0.0
        for rank, t in enumerate(times):
            if t is not None:  # with all-zero times (no timing from the task) every rank is "typical": 1.0
                self.straggler.labels(rank=str(rank)).set(t / median if median > 0 else 1.0)
        for values, gauge, scale, unset_at_zero in (
                (record.rss_mb, self.rss, _MIB, True), (record.cuda_peak_mb, self.cuda_peak, _MIB, False),
                (record.data_wait_s, self.data_wait, 1.0, False), (record.grad_sync_s, self.grad_sync, 1.0, False),
                (record.compute_s, self.compute, 1.0, False)):
            for rank, value in enumerate(_per_rank(values)):
                # A resident set of 0 is "not measured" (a task that does not report it), never real.
                if value is not None and not (unset_at_zero and value <= 0):
                    gauge.labels(rank=str(rank)).set(value * scale)

    def observe_heartbeat_lag(self, rank: int, lag_s: float) -> None:
        """Seconds since the controller last heard from ``rank`` (call per step, per rank)."""
        self.hb_lag.labels(rank=str(rank)).set(max(0.0, float(lag_s)))

    def observe_dispatch(self, method: str, seconds: float) -> None:
        """One group call's latency, send to last answer, as the controller measured it."""
        self.dispatch.labels(method=method).observe(max(0.0, float(seconds)))

    def observe_checkpoint(self, seconds: float, nbytes: int) -> None:
        """One checkpoint save: its duration and size (throughput in GB/s, 1e9 bytes)."""
        seconds = float(seconds)
        self.ckpt_duration.set(seconds)
        self.ckpt_gbps.set(nbytes / seconds / 1e9 if seconds > 0 else 0.0)
        self.ckpts.inc()

    def set_restarts(self, n: int) -> None:
        """Restarts so far (state.json ``restarts``; the epoch of this controller)."""
        self.restarts.set(int(n))

    def observe_goodput(self, useful_s: float, allocated_s: float) -> None:
        """Totals across requeues (the caller keeps them in state.json); ratio = useful/allocated."""
        self.useful.set(float(useful_s))
        self.allocated.set(float(allocated_s))
        self.goodput.set(min(1.0, useful_s / allocated_s) if allocated_s > 0 else 0.0)
