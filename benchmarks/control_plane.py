"""Control-plane latency: one dispatch-and-collect round trip of a no-op call.

Baton (CURVE-authenticated ROUTER/DEALER, msgpack protocol, WorkerGroup.call) beside raw
pyzmq ROUTER/DEALER (no auth, bytes in, bytes out) doing the same exchange in the same run.
N = 1, 8, 64 are real worker processes (Baton: the real worker runtime with the toy task);
N = 256 and 1024 are sockets hosted by a few processes. Also: controller CPU time per
heartbeat while N workers heartbeat at 4 Hz (process CPU, zmq's I/O and CURVE threads included).

    python benchmarks/control_plane.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq  # noqa: E402

from core import config as config_mod  # noqa: E402
from core import protocol  # noqa: E402
from core.controller import WorkerGroup, publish_address  # noqa: E402
from core.transport import ControllerSocket, WorkerSocket  # noqa: E402
from launcher import local, runprep  # noqa: E402

HB_INTERVAL = 0.25


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# --- raw pyzmq --------------------------------------------------------------------------
def raw_host(address: str, n: int) -> None:
    ctx = zmq.Context()
    socks = []
    poller = zmq.Poller()
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
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


def bench_raw(n: int, hosts: int, reps: int) -> list[float]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    per = [n // hosts + (1 if i < n % hosts else 0) for i in range(hosts)]
    procs = [mp.Process(target=raw_host, args=(f"tcp://127.0.0.1:{port}", k), daemon=True) for k in per if k]
    for p in procs:
        p.start()
    ids = [router.recv_multipart()[0] for _ in range(n)]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in ids:
            router.send_multipart([i, b"call"])
        for _ in range(n):
            router.recv_multipart()
        times.append(time.perf_counter() - t0)
    for i in ids:
        router.send_multipart([i, b"quit"])
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    ctx.destroy(linger=0)
    return times


# --- Baton ------------------------------------------------------------------------------
def baton_host(run_dir: str, address: str, first_rank: int, n: int) -> None:
    """Many Baton workers in one process: register, answer calls, heartbeat."""
    keys = Path(run_dir) / "keys"
    hosts = [WorkerSocket(address, keys, identity=f"h{first_rank + i}".encode()) for i in range(n)]
    poller = zmq.Poller()
    by_sock = {}
    for i, h in enumerate(hosts):
        WorkerSocket.send(h.sock, protocol.encode(protocol.Register(
            rank_hint=first_rank + i, host="bench", node="bench", pid=os.getpid(), rendezvous_port=1)))
        poller.register(h.sock, zmq.POLLIN)
        by_sock[h.sock] = h
    seq, next_beat = 0, time.monotonic()
    while True:
        now = time.monotonic()
        if now >= next_beat:
            seq += 1
            frames = protocol.encode(protocol.Heartbeat(seq=seq))
            for h in hosts:
                WorkerSocket.send(h.sock, frames)
            next_beat = now + HB_INTERVAL
        for s, _ in poller.poll(max(1, int((next_beat - time.monotonic()) * 1000))):
            env = protocol.decode(WorkerSocket.recv(s))
            if isinstance(env.msg, protocol.Call):
                WorkerSocket.send(s, protocol.encode(protocol.Result(value=None), req_id=env.req_id))
            elif isinstance(env.msg, protocol.Shutdown):
                return


def bench_baton(n: int, hosts: int, reps: int, idle_s: float) -> tuple[list[float], float]:
    tmp = tempfile.mkdtemp(prefix="baton-bench-")
    cfg = config_mod.from_data({
        "name": "bench", "runs_root": tmp, "model": {"kind": "toy"}, "trainer": {"n_gpus_per_node": n},
        "timeouts": {"heartbeat_interval_s": HB_INTERVAL, "heartbeat_timeout_s": 10.0, "register_s": 300},
    })
    run = runprep.prepare_run(cfg, backend="local")
    sock = ControllerSocket(run.keys, bind_host="127.0.0.1")
    info = publish_address(run, sock, host="127.0.0.1", epoch=0)
    group = WorkerGroup(sock, world_size=n, epoch=0, dims=cfg.dims, timeouts=cfg.timeouts, run=run)
    if hosts == 0:  # one real worker process per rank
        procs = [local._spawn(run, "worker", epoch=0, rank=r) for r in range(n)]
    else:
        per = n // hosts
        procs = [mp.Process(target=baton_host, args=(str(run.path), info["address"], h * per, per), daemon=True)
                 for h in range(hosts)]
        for p in procs:
            p.start()
    group.wait_for_workers(300)
    for _ in range(5):
        group.call("noop")
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        group.call("noop")
        times.append(time.perf_counter() - t0)
    # Controller CPU per heartbeat, while idle: the pump answers and records them.
    r0, h0 = resource.getrusage(resource.RUSAGE_SELF), group.heartbeats_handled
    time.sleep(idle_s)  # measuring a rate over a fixed interval
    r1, h1 = resource.getrusage(resource.RUSAGE_SELF), group.heartbeats_handled
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    per_hb = cpu / max(1, h1 - h0)
    group.shutdown("benchmark done")
    for p in procs:
        (p.wait if hasattr(p, "wait") else p.join)(timeout=30)
    group.close()
    sock.close()
    return times, per_hb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 1, 8, 256 with fewer repetitions")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    args = ap.parse_args()
    cases = [(1, 0, 1), (8, 0, 4), (64, 0, 4), (256, 4, 4), (1024, 4, 4)]
    if args.quick:
        cases = [(1, 0, 1), (8, 0, 4), (256, 4, 4)]
    reps = 100 if args.quick else 300
    rows = []
    for n, hosts, raw_hosts in cases:
        r = reps if n <= 64 else reps // 3
        raw = bench_raw(n, raw_hosts if hosts == 0 else hosts, r) if hosts == 0 and n <= 8 else bench_raw(n, raw_hosts, r)
        bat, per_hb = bench_baton(n, hosts, r, idle_s=2.0 if args.quick else 4.0)
        row = {"n": n, "hosting": "processes" if hosts == 0 else f"{hosts} processes",
               "raw_p50_us": pct(raw, 0.5) * 1e6, "raw_p99_us": pct(raw, 0.99) * 1e6,
               "baton_p50_us": pct(bat, 0.5) * 1e6, "baton_p99_us": pct(bat, 0.99) * 1e6,
               "heartbeat_cpu_us": per_hb * 1e6}
        row["ratio_p50"] = row["baton_p50_us"] / row["raw_p50_us"]
        rows.append(row)
        print(f"  done N={n}", file=sys.stderr, flush=True)
    print(f"\nno-op dispatch+collect round trip (medians of {reps} reps; 2-core VM, one run)")
    print(f"{'N':>5} {'workers as':>12} {'raw p50':>10} {'raw p99':>10} {'baton p50':>10} {'baton p99':>10} "
          f"{'p50 ratio':>9} {'ctl CPU/heartbeat':>18}")
    for row in rows:
        print(f"{row['n']:>5} {row['hosting']:>12} {row['raw_p50_us']:>8.0f}us {row['raw_p99_us']:>8.0f}us "
              f"{row['baton_p50_us']:>8.0f}us {row['baton_p99_us']:>8.0f}us {row['ratio_p50']:>8.2f}x "
              f"{row['heartbeat_cpu_us']:>15.1f}us")
    print("targets: p50 ratio ≤ 1.5x at N=8, ≤ 2x at N=1024; controller CPU per heartbeat < 20 µs")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    _ = statistics
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
