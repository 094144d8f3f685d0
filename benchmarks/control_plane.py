"""Control-plane latency: one dispatch-and-collect round trip of a no-op call.

Baton (CURVE-authenticated ROUTER/DEALER, msgpack protocol, WorkerGroup.call) beside raw
pyzmq ROUTER/DEALER (no auth, bytes in, bytes out) doing the same exchange in the same run,
with the same number of processes. N = 1, 8, 64 are real worker processes (Baton: the real
worker runtime with the toy task; raw: one DEALER process each); N = 256 and 1024 are
sockets hosted by 4 processes (one zmq context each) on both sides. For reference, raw
pyzmq with CURVE alone is measured too (what authentication costs before any Baton code).
Every worker-hosting process runs in a session of its own (see ``_own_session``). The three
are set up side by side and run in alternating blocks, so that this machine's noisy spells
hit them alike; the ratio is the median over blocks of Baton's p50 over raw's.

Controller CPU per heartbeat, while N workers heartbeat at 4 Hz and no call runs: process
CPU (zmq's I/O and CURVE threads included) with heartbeats flowing, minus the same with
every worker stopped (SIGSTOP) for as long, divided by the heartbeats handled: what each
heartbeat costs, without the fixed timers of an idle controller. The plain quotient
(idle CPU / heartbeats, timers included) is printed beside it, and so is raw pyzmq's own
cost for the same heartbeat stream, measured the same way (a ROUTER drained at 10 Hz): the
floor set by zmq's I/O thread and the kernel, which dominates when few workers beat.

    python benchmarks/control_plane.py [--quick] [--n N ...] [--trials T] [--blocks B] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq  # noqa: E402

from core.config import run as config_mod  # noqa: E402
from core.config.roles import plan_roles  # noqa: E402
from core.controller.group import WorkerGroup  # noqa: E402
from core.controller.main import publish_address  # noqa: E402
from core.controller.roles import RoleGroup  # noqa: E402
from core.model.toy import NOOP  # noqa: E402
from core.wire import protocol  # noqa: E402
from core.wire.transport import ControllerSocket, WorkerSocket, generate_keys  # noqa: E402
from launcher import local, runprep  # noqa: E402

HB_INTERVAL = 0.25


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# --- raw pyzmq --------------------------------------------------------------------------
def _curve(sock: zmq.Socket, keys: str | None, *, server: bool) -> None:
    if keys is None:
        return
    import zmq.auth

    pub, sec = zmq.auth.load_certificate(os.path.join(keys, "controller.key_secret"))
    if server:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = sec, pub, True
    else:
        wpub, wsec = zmq.auth.load_certificate(os.path.join(keys, "worker.key_secret"))
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = pub, wpub, wsec


def _own_session() -> None:
    """Every process that hosts workers runs in a session of its own, as the local backend
    starts Baton's workers (start_new_session). With Linux's scheduler autogroups (on by
    default) a session is a scheduling group: processes left in the benchmark's session
    would share one group with the controller and be preempted far less often (measured:
    raw pyzmq's workers switched involuntarily 4x less, 15% lower p50), which is not the
    comparison this benchmark makes."""
    os.setsid()


def raw_host(address: str, n: int, keys: str | None) -> None:
    _own_session()
    ctx = zmq.Context()
    socks = []
    poller = zmq.Poller()
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        _curve(s, keys, server=False)
        s.connect(address)
        s.send(b"hello")
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    while True:
        for s, _ in poller.poll():
            msg = s.recv()
            if msg == b"quit":
                return
            s.send(b"ok")


class RawGroup:
    """Raw ROUTER/DEALER: ``procs`` processes hosting n DEALERs; ``curve``: with CURVE
    encryption (no ZAP check)."""

    def __init__(self, n: int, procs: int, *, curve: bool = False) -> None:
        keys = None
        if curve:
            keys = tempfile.mkdtemp(prefix="baton-bench-keys-")
            generate_keys(Path(keys))
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        _curve(self.router, keys, server=True)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        per = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
        self.children = [mp.Process(target=raw_host, args=(f"tcp://127.0.0.1:{port}", k, keys), daemon=True)
                         for k in per if k]
        for p in self.children:
            p.start()
        self.ids = [self.router.recv_multipart()[0] for _ in range(n)]
        for _ in range(5):
            self.round()

    def round(self) -> float:
        t0 = time.perf_counter()
        for i in self.ids:
            self.router.send_multipart([i, b"call"])
        for _ in self.ids:
            self.router.recv_multipart()
        return time.perf_counter() - t0

    def close(self) -> None:
        for i in self.ids:
            self.router.send_multipart([i, b"quit"])
        for p in self.children:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.ctx.destroy(linger=0)


def raw_beater(address: str, n: int) -> None:
    """n raw DEALERs, each sending a heartbeat-sized message every HB_INTERVAL."""
    _own_session()
    ctx = zmq.Context()
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        socks.append(s)
    beat = protocol.encode(protocol.Heartbeat(seq=1, busy="", rss_mb=123.4))[0]
    next_beat = time.monotonic()
    while True:
        for s in socks:
            s.send(beat)
        next_beat += HB_INTERVAL
        time.sleep(max(0.0, next_beat - time.monotonic()))  # a fixed-rate sender


def raw_heartbeat_cpu(n: int, procs: int, idle_s: float) -> float:
    """Raw pyzmq's own CPU per heartbeat: a ROUTER drained at 10 Hz by a thread (as
    Baton's pump does), same marginal method as Baton's figure."""
    import threading

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    per = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    children = [mp.Process(target=raw_beater, args=(f"tcp://127.0.0.1:{port}", k), daemon=True) for k in per if k]
    for p in children:
        p.start()
    count = [0]
    stop = threading.Event()

    def pump() -> None:
        while not stop.wait(0.1):
            while True:
                try:
                    router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                count[0] += 1

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while count[0] < n and time.monotonic() < deadline:  # every sender connected and beating
        stop.wait(0.05)
    c0, h0 = _cpu(), count[0]
    time.sleep(idle_s)  # measuring a rate over a fixed interval
    c1, h1 = _cpu(), count[0]
    for p in children:
        os.kill(p.pid, signal.SIGSTOP)
    time.sleep(0.3)  # let what was in flight drain before the baseline window
    c2, h2 = _cpu(), count[0]
    time.sleep(idle_s)  # the same interval with no heartbeats arriving
    c3, h3 = _cpu(), count[0]
    stop.set()
    thread.join(timeout=5)
    for p in children:
        os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=10)
    ctx.destroy(linger=0)
    return ((c1 - c0) - (c3 - c2)) / max(1, (h1 - h0) - (h3 - h2))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --- Baton ------------------------------------------------------------------------------
def baton_host(run_dir: str, address: str, first_rank: int, n: int) -> None:
    """Many Baton workers in one process: register, answer calls, heartbeat."""
    _own_session()
    keys = Path(run_dir) / "keys"
    first = WorkerSocket(address, keys, identity=f"h{first_rank}".encode())
    hosts = [first] + [WorkerSocket(address, keys, identity=f"h{first_rank + i}".encode(), share_context_with=first)
                       for i in range(1, n)]
    poller = zmq.Poller()
    by_sock = {}
    for i, h in enumerate(hosts):
        h.send(protocol.encode(protocol.Register(
            rank_hint=first_rank + i, host="bench", node="bench", pid=os.getpid(), rendezvous_port=1)))
        poller.register(h.zmq_socket, zmq.POLLIN)
        by_sock[h.zmq_socket] = h
    seq, next_beat = 0, time.monotonic()
    while True:
        now = time.monotonic()
        if now >= next_beat:
            seq += 1
            frames = protocol.encode(protocol.Heartbeat(seq=seq))
            for h in hosts:
                h.send(frames)
            next_beat = now + HB_INTERVAL
        for s, _ in poller.poll(max(1, int((next_beat - time.monotonic()) * 1000))):
            h = by_sock[s]
            env = protocol.decode(h.recv_nowait())
            if isinstance(env.msg, protocol.Call):
                h.send(protocol.encode(protocol.Result(value=None), req_id=env.req_id))
            elif isinstance(env.msg, protocol.Shutdown):
                return


class BatonGroup:
    """A real controller socket and WorkerGroup with n workers: real worker processes
    (hosts == 0) or sockets hosted by ``hosts`` processes."""

    def __init__(self, n: int, hosts: int) -> None:
        tmp = tempfile.mkdtemp(prefix="baton-bench-")
        cfg = config_mod.from_data({
            "name": "bench", "runs_root": tmp, "model": {"kind": "toy"}, "trainer": {"n_gpus_per_node": n},
            "timeouts": {"heartbeat_interval_s": HB_INTERVAL, "heartbeat_timeout_s": 10.0, "register_s": 300,
                         "controller_lost_s": 60.0},
        })
        run = runprep.prepare_run(cfg, backend="local")
        self.sock = ControllerSocket(run.keys, bind_host="127.0.0.1")
        info = publish_address(run, self.sock, host="127.0.0.1", epoch=0)
        self.group = WorkerGroup(self.sock, world_size=n, epoch=0, timeouts=cfg.timeouts, run=run)
        self.trainer = RoleGroup(self.group, plan_roles(cfg)[0])  # the calls a program makes
        if hosts == 0:  # one real worker process per rank
            self.procs: list = [local._spawn(run, "worker", epoch=0, rank=r) for r in range(n)]
        else:
            per = n // hosts
            self.procs = [mp.Process(target=baton_host, args=(str(run.path), info["address"], h * per, per),
                                     daemon=True) for h in range(hosts)]
            for p in self.procs:
                p.start()
        self.group.wait_for_workers(300)
        for _ in range(5):
            self.round()

    def round(self) -> float:
        t0 = time.perf_counter()
        self.trainer.call(NOOP)
        return time.perf_counter() - t0

    def heartbeat_cpu(self, idle_s: float) -> tuple[float, float]:
        """Controller CPU per heartbeat while idle (the pump receives and records them):
        (marginal, plain); see the module's docstring."""
        group = self.group
        c0, h0 = _cpu(), group.heartbeats_handled
        time.sleep(idle_s)  # measuring a rate over a fixed interval
        c1, h1 = _cpu(), group.heartbeats_handled
        for p in self.procs:
            os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.3)  # let what was in flight drain before the baseline window
        c2, h2 = _cpu(), group.heartbeats_handled
        time.sleep(idle_s)  # the same interval with every worker stopped: no heartbeats arrive
        c3, h3 = _cpu(), group.heartbeats_handled
        for p in self.procs:
            os.kill(p.pid, signal.SIGCONT)
        beats = max(1, (h1 - h0) - (h3 - h2))
        return ((c1 - c0) - (c3 - c2)) / beats, (c1 - c0) / max(1, h1 - h0)

    def close(self) -> None:
        self.group.shutdown("benchmark done")
        for p in self.procs:
            (p.wait if hasattr(p, "wait") else p.join)(timeout=30)
        self.group.close()
        self.sock.close()


def measure(n: int, hosts: int, reps: int, blocks: int) -> tuple[dict[str, list[list[float]]], BatonGroup]:
    """Round trips of raw, raw+CURVE and Baton, all three set up at once and run in
    alternating blocks (the order rotating), so that a noisy spell hits all alike.
    Returns the times per block and the Baton group, still running (the caller closes it)."""
    procs = hosts or n
    raw, curve = RawGroup(n, procs), RawGroup(n, procs, curve=True)
    baton = BatonGroup(n, hosts)
    groups: dict[str, RawGroup | BatonGroup] = {"raw": raw, "curve": curve, "baton": baton}
    out: dict[str, list[list[float]]] = {name: [] for name in groups}
    try:
        order = list(groups)
        for b in range(blocks):
            for name in order[b % 3:] + order[:b % 3]:
                g = groups[name]
                out[name].append([g.round() for _ in range(max(1, reps // blocks))])
    except BaseException:
        baton.close()
        raise
    finally:
        raw.close()
        curve.close()
    return out, baton


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 1, 8, 256 with fewer repetitions")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    ap.add_argument("--trials", type=int, default=2, help="set-ups per N (each runs all three methods)")
    ap.add_argument("--blocks", type=int, default=10, help="alternating blocks per trial")
    ap.add_argument("--n", type=int, action="append", choices=[1, 8, 64, 256, 1024],
                    help="measure only this N (repeatable)")
    args = ap.parse_args()
    cases = [(1, 0), (8, 0), (64, 0), (256, 4), (1024, 4)]  # (N, hosting processes; 0 = one per worker)
    if args.quick:
        cases = [(1, 0), (8, 0), (256, 4)]
    if args.n:
        cases = [c for c in [(1, 0), (8, 0), (64, 0), (256, 4), (1024, 4)] if c[0] in args.n]
    reps = 100 if args.quick else 300
    trials = 1 if args.quick and args.trials == 2 else args.trials
    rows = []
    for n, hosts in cases:
        r = reps if n <= 64 else reps // 3
        procs = hosts or n
        raw, raw_curve, bat, ratios, marginal, plain, raw_hb = [], [], [], [], [], [], []
        idle_s = 2.0 if args.quick else 4.0
        for _ in range(trials):
            m, group = measure(n, hosts, r, args.blocks)
            try:
                mh, q = group.heartbeat_cpu(idle_s)
            finally:
                group.close()
            raw += m["raw"]
            raw_curve += m["curve"]
            bat += m["baton"]
            ratios += [statistics.median(b) / statistics.median(a) for a, b in zip(m["raw"], m["baton"], strict=True)]
            marginal.append(mh)
            plain.append(q)
            raw_hb.append(raw_heartbeat_cpu(n, procs, idle_s=idle_s))
        flat = lambda blocks: [x for blk in blocks for x in blk]  # noqa: E731
        row = {"n": n, "hosting": "processes" if hosts == 0 else f"{hosts} processes", "trials": trials,
               "blocks": len(bat),
               "raw_p50_us": pct(flat(raw), 0.5) * 1e6, "raw_p99_us": pct(flat(raw), 0.99) * 1e6,
               "raw_curve_p50_us": pct(flat(raw_curve), 0.5) * 1e6,
               "baton_p50_us": pct(flat(bat), 0.5) * 1e6, "baton_p99_us": pct(flat(bat), 0.99) * 1e6,
               "ratio_p50": statistics.median(ratios),
               "heartbeat_cpu_us": statistics.median(marginal) * 1e6,
               "heartbeat_cpu_with_timers_us": statistics.median(plain) * 1e6,
               "raw_heartbeat_cpu_us": statistics.median(raw_hb) * 1e6}
        rows.append(row)
        print(f"  done N={n}", file=sys.stderr, flush=True)
    print(f"\nno-op dispatch+collect round trip, {reps} per method ({reps // 3} for N > 64) in {args.blocks} alternating "
          f"blocks per trial, {trials} trial(s); p50/p99 over all; ratio = median over blocks of Baton's block p50 / "
          f"raw's block p50")
    print(f"{'N':>5} {'workers as':>12} {'raw p50':>9} {'raw p99':>9} {'+CURVE p50':>10} {'baton p50':>10} "
          f"{'baton p99':>10} {'p50 ratio':>9} {'CPU/heartbeat':>13} {'(with timers)':>13} {'raw CPU/hb':>10}")
    for row in rows:
        print(f"{row['n']:>5} {row['hosting']:>12} {row['raw_p50_us']:>7.0f}us {row['raw_p99_us']:>7.0f}us "
              f"{row['raw_curve_p50_us']:>8.0f}us {row['baton_p50_us']:>8.0f}us {row['baton_p99_us']:>8.0f}us "
              f"{row['ratio_p50']:>8.2f}x {row['heartbeat_cpu_us']:>11.1f}us {row['heartbeat_cpu_with_timers_us']:>11.1f}us "
              f"{row['raw_heartbeat_cpu_us']:>8.1f}us")
    print("targets: p50 ratio (Baton / raw without CURVE) ≤ 1.5x at N=8, ≤ 2x at N=1024; "
          "controller CPU per heartbeat < 20 µs")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
