"""The vLLM engine driven directly by one plain script: benchmarks/rollout.py's baseline.

No Baton: ``vllm.LLM`` on the Hugging Face folder, started with the engine arguments Baton's
``generator.engine: vllm`` uses (core.model.gpt.vllm_engine: the run's dtype, V1 engine processes,
token-id prompts, prefix caching, processed log-probs, the same KV cache and sequence
limits), then, for each RL step benchmarks/rollout.py measures, the counting task's prompts
of that step (core.rl.tasks.counting, each ``n`` times) with the per-row seeds Baton gives
them and one ``SamplingParams`` per row, generated in one ``LLM.generate`` call and timed.
The first step's call is a warm-up (Baton's first RL steps are dropped too).

The weight sync's baseline: the folder's tensors written to /dev/shm as one safetensors file
(the bytes Baton writes per sync), and the engine's own ``reload_weights`` from that file.

    python benchmarks/plain_vllm_rollout.py SPEC.json OUT.json   (SPEC: written by rollout.py)
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def prompts_of(spec: dict, step: int) -> list[tuple[int, ...]]:
    """The rows of RL step ``step``, as core.controller.rl_program asks them."""
    from core.rl import tasks

    asked = tasks.counting(spec["seed"], step, spec["prompts_per_step"], spec["prompt_length"], spec["vocab_size"])
    return [a.tokens for a in asked for _ in range(spec["n"])]


def row_seeds(spec: dict, step: int, rows: int) -> list[int]:
    """Baton's per-row seeds of RL step ``step`` (rl_program's step seed, then the row's)."""
    base = (spec["seed"] * 7919 + step) * 1009 + 7
    return [(base * 1_000_003 + i) % 2**63 for i in range(rows)]


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["folder"], skip_tokenizer_init=True, dtype=spec["dtype"], tensor_parallel_size=1,
              max_model_len=spec["max_model_len"], seed=spec["seed"], logprobs_mode="processed_logprobs",
              max_num_seqs=spec["max_num_seqs"], enable_prefix_caching=True, enforce_eager=spec["enforce_eager"],
              gpu_memory_utilization=spec["gpu_memory_utilization"], kv_cache_memory_bytes=spec["kv_cache_bytes"], load_format="safetensors")
    gen_s, tokens = [], []
    for step in spec["steps"]:
        rows = prompts_of(spec, step)
        params = [SamplingParams(n=1, temperature=spec["temperature"], top_k=spec["top_k"], top_p=spec["top_p"],
                                 max_tokens=spec["max_new_tokens"], seed=s,
                                 logprobs=0, ignore_eos=True, detokenize=False)
                  for s in row_seeds(spec, step, len(rows))]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in rows], params, use_tqdm=False)
        gen_s.append(time.perf_counter() - t0)
        tokens.append(sum(len(o.outputs[0].token_ids) for o in outs))
    # the bytes Baton writes per sync: every tensor in the engine's dtype
    tensors = {k: v.to(getattr(torch, spec["dtype"])) for k, v in load_file(str(Path(spec["folder"]) / "model.safetensors")).items()}
    shm = tempfile.mkdtemp(prefix="baton-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    write_s, reload_s = [], []
    try:
        for _ in range(spec["repeat"]):
            t0 = time.perf_counter()
            save_file(tensors, str(Path(shm) / "model.safetensors"))
            write_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": shm, "is_checkpoint_format": True})
            llm.reset_prefix_cache()
            reload_s.append(time.perf_counter() - t0)
    finally:
        for f in Path(shm).iterdir():
            f.unlink()
        os.rmdir(shm)
    Path(sys.argv[2]).write_text(json.dumps({
        "generate_s": gen_s[1:], "tokens": tokens[1:], "shm_write_s": statistics.median(write_s),
        "reload_s": statistics.median(reload_s), "bytes": sum(t.nbytes for t in tensors.values()),
        "dtype": spec["dtype"]}))
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":  # vLLM starts its engine processes with spawn
    raise SystemExit(main())
