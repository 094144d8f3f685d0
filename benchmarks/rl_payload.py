"""An RL update's request on the wire: rows as Python tuples (before) vs numpy arrays (now).

One PolicyBatch of 64 rows x 5,120 tokens (a 1,024-token prompt and a 4,096-token response,
with advantages, old and reference log-probs per response token) goes to a tp=4 replica:
the controller encodes it once (core.wire.contract + core.wire.protocol), sends the same
frames to 4 worker processes over Baton's CURVE sockets (core.wire.transport), and each
decodes it and checks it against its method (``decode_request``: every field's type, and
for the arrays their dtypes and lengths) before it answers. The time is the controller's,
from the encoding until the last rank's answer; each rank's decode + check is printed too.

"Before" is the request as it was: the same dataclass with tuples of Python numbers
(``TuplePolicyBatch`` below, a copy of the old ``rl_calls.PolicyBatch``), the same values.
The two alternate ``--rounds`` times; the ratio is the median of the rounds' ratios and
the goal is >= 10x. After the timed rounds every rank sends a checksum of what it decoded
(the tokens' sum and the log-probs' sum) for the controller to compare with its own: both
payloads carry the same numbers.

    python benchmarks/rl_payload.py [--quick] [--rounds K] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from core.wire import protocol, rl_calls  # noqa: E402
from core.wire.contract import Dispatch, Method  # noqa: E402
from core.wire.ragged import FLOATS, TOKENS, Ragged  # noqa: E402
from core.wire.transport import ControllerSocket, WorkerSocket, generate_keys  # noqa: E402

GOAL = 10.0
TP = 4


@dataclass(frozen=True, kw_only=True)
class TuplePolicyBatch:
    """``rl_calls.PolicyBatch`` as it was: every row and every per-token number a Python value."""

    step: int
    agg: rl_calls.LossAgg
    prompt_length: int
    sequences: tuple[tuple[int, ...], ...]
    advantages: tuple[tuple[float, ...], ...]
    old_logprobs: tuple[tuple[float, ...], ...]
    ref_logprobs: tuple[tuple[float, ...], ...] = ()
    kl_coef: float = 0.0
    pads: tuple[int, ...] = ()


TUPLES = Method("policy_step_tuples", TuplePolicyBatch, None, dispatch=Dispatch.REPLICAS)
METHODS = {m.name: m for m in (TUPLES, rl_calls.POLICY_STEP)}


def batches(rows: int, prompt: int, response: int, seed: int = 0) -> tuple[rl_calls.PolicyBatch, TuplePolicyBatch]:
    """The same request both ways: token ids of a 151k vocabulary, float32 numbers."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 151_936, size=(rows, prompt + response), dtype=np.int32)
    adv, old, ref = (rng.normal(size=(rows, response)).astype(np.float32) for _ in range(3))
    old, ref = -np.abs(old), -np.abs(ref)
    agg = rl_calls.LossAgg(tokens=rows * response, rows=rows, horizon=response)
    arrays = rl_calls.PolicyBatch(step=1, agg=agg, prompt_length=prompt, sequences=Ragged.of(tokens, TOKENS),
                                  advantages=Ragged.of(adv, FLOATS), old_logprobs=Ragged.of(old, FLOATS),
                                  ref_logprobs=Ragged.of(ref, FLOATS), kl_coef=0.01)
    tuples = TuplePolicyBatch(step=1, agg=agg, prompt_length=prompt, sequences=tuple(map(tuple, tokens.tolist())),
                              advantages=tuple(map(tuple, adv.tolist())), old_logprobs=tuple(map(tuple, old.tolist())),
                              ref_logprobs=tuple(map(tuple, ref.tolist())), kl_coef=0.01)
    return arrays, tuples


def checksum(batch: Any) -> list[float]:
    """The tokens' sum and the old log-probs' sum (float64), however the batch holds them."""
    if isinstance(batch, rl_calls.PolicyBatch):
        return [float(batch.sequences.values.sum(dtype=np.int64)), float(batch.old_logprobs.values.astype(np.float64).sum())]
    return [float(sum(map(sum, batch.sequences))), float(np.asarray(batch.old_logprobs, dtype=np.float64).ravel().sum())]


# --- a tp rank ---------------------------------------------------------------------------------
def _rank(rank: int, address: Any, keys: str) -> None:
    sock = WorkerSocket(address.get(), Path(keys), identity=f"rank{rank}".encode())
    sock.send([b"ready"])
    while (frames := sock.recv_within(900)) is not None and bytes(frames[0]) != b"stop":
        t0 = time.perf_counter()
        env = protocol.decode(frames)
        assert isinstance(env.msg, protocol.Call)
        batch = METHODS[env.msg.method].decode_request(env.msg.kwargs)  # the worker's check at the boundary
        seconds = time.perf_counter() - t0
        sock.send([json.dumps({"rows": len(batch.sequences), "seconds": seconds}).encode()])
        sock.send([json.dumps({"checksum": checksum(batch)}).encode()])  # after the answer: not timed
    sock.close()


class Replica:
    """TP worker processes behind one controller socket."""

    def __init__(self, keys: Path, ranks: int) -> None:
        ctx = mp.get_context("fork")  # before this process makes any zmq context
        self.address = ctx.Queue()
        self.procs = [ctx.Process(target=_rank, args=(r, self.address, str(keys)), daemon=True) for r in range(ranks)]
        for p in self.procs:
            p.start()
        self.sock = ControllerSocket(keys, bind_host="127.0.0.1")
        for _ in self.procs:
            self.address.put(f"tcp://127.0.0.1:{self.sock.port}")
        self.sock.set_timeout(900)
        self.peers = [self._recv()[0] for _ in self.procs]

    def _recv(self) -> tuple[bytes, list[Any]]:
        got = self.sock.recv()
        if got is None:
            raise TimeoutError("a rank did not answer within 900 s")
        return got

    def send(self, method: Method[Any, Any], batch: Any, req: int) -> dict[str, Any]:
        """Encode once, send to every rank, wait for every answer; the times and the checksums."""
        t0 = time.perf_counter()
        frames = protocol.encode(protocol.Call(method=method.name, kwargs=method.encode_request(batch)), req_id=req)
        encoded = time.perf_counter() - t0
        for peer in self.peers:
            self.sock.send(peer, frames)
        answers: dict[bytes, dict[str, Any]] = {}
        sums: dict[bytes, list[float]] = {}  # a rank's checksum may come before another's answer
        total = 0.0
        while len(answers) < len(self.peers) or len(sums) < len(self.peers):
            peer, got = self._recv()
            msg = json.loads(bytes(got[0]))
            if "checksum" in msg:
                sums[peer] = msg["checksum"]
                continue
            answers[peer] = msg
            if len(answers) == len(self.peers):
                total = time.perf_counter() - t0
        return {"total_s": total, "encode_s": encoded, "rank_check_s": max(a["seconds"] for a in answers.values()),
                "bytes": sum(len(memoryview(f).cast("B")) for f in frames),
                "rows": [answers[p]["rows"] for p in self.peers], "checksums": [sums[p] for p in self.peers]}

    def close(self) -> None:
        for peer in self.peers:
            self.sock.send(peer, [b"stop"])
        for p in self.procs:
            p.join(timeout=30)
        self.sock.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 rows, 2 rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the numbers here")
    args = ap.parse_args()
    rows, rounds = (16, 2) if args.quick else (64, args.rounds)
    arrays, tuples = batches(rows, 1024, 4096)
    want = checksum(arrays)
    with tempfile.TemporaryDirectory() as keys:
        generate_keys(Path(keys))
        replica = Replica(Path(keys), TP)
        try:
            runs: dict[str, list[dict[str, Any]]] = {"tuples": [], "arrays": []}
            for k in range(rounds):
                runs["tuples"].append(replica.send(TUPLES, tuples, 2 * k))
                runs["arrays"].append(replica.send(rl_calls.POLICY_STEP, arrays, 2 * k + 1))
        finally:
            replica.close()
    for name, got in runs.items():  # the same numbers arrived both ways
        assert all(r["rows"] == [rows] * TP and r["checksums"] == [want] * TP for r in got), (name, got[0], want)
    ratios = [t["total_s"] / a["total_s"] for t, a in zip(runs["tuples"], runs["arrays"], strict=True)]
    ratio = statistics.median(ratios)
    print(f"PolicyBatch of {rows} rows x 5,120 tokens to a tp={TP} replica (encode once, send to {TP} ranks, "
          "each decodes and checks); median of rounds")
    print(f"{'payload':<8} {'total s':>9} {'encode s':>9} {'rank check s':>13} {'MB sent':>8}")
    for name, got in runs.items():
        med = {k: statistics.median(r[k] for r in got) for k in ("total_s", "encode_s", "rank_check_s", "bytes")}
        print(f"{name:<8} {med['total_s']:>9.4f} {med['encode_s']:>9.4f} {med['rank_check_s']:>13.4f} "
              f"{med['bytes'] / 1e6:>8.1f}")
    print(f"arrays are {ratio:.0f}x faster (rounds: {', '.join(f'{r:.0f}' for r in ratios)}); goal >= {GOAL:.0f}x")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "tokens_per_row": 5120, "tp": TP, "ratio": ratio,
                                         "ratios": ratios, "goal": GOAL, "runs": {
                                             k: [{x: r[x] for x in ("total_s", "encode_s", "rank_check_s", "bytes")}
                                                 for r in v] for k, v in runs.items()}}, indent=1))
    assert ratio >= GOAL, f"arrays are only {ratio:.1f}x faster than tuples (goal {GOAL:.0f}x)"
    return 0


if __name__ == "__main__":
    sys.exit(main())
