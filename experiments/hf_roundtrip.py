"""Baton -> Hugging Face -> Baton on a CPU in about a minute (`make hf-demo`).

1. Pretrain a tiny Qwen3-shaped GPT (experiments/qwen3_tiny.yaml) on the counting task; at its
   last step the generator continues two prompts greedily and records each token's log-prob.
2. `baton export RUN --hf OUT`; transformers loads OUT and continues the same prompts: the
   same tokens, the same log-probs (to 1e-5: two frameworks sum in different orders, and
   samples.jsonl keeps 6 decimals).
3. GRPO from the exported folder (`program=grpo init_from=hf:OUT`, two steps). The counting
   task's prompts and rewards are token ids, so no tokenizer is needed (an export of a run
   pretrained by Baton has none); its step-0 checkpoint, exported again, is OUT tensor for tensor.
4. `baton export` of experiments/tiny_gpt.yaml's run (LayerNorm, GELU, learned positions): refused
   in one line.

    python experiments/hf_roundtrip.py [--work DIR] [--json PATH]

Exit 0 when every check holds, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5


def baton(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it."""
    res = subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, cwd=REPO)
    if check and res.returncode != 0:
        sys.exit(f"baton {' '.join(args)} failed ({res.returncode}):\n{res.stdout}{res.stderr}")
    return res


def submit(*args: str) -> Path:
    """A local run to its end; its run folder."""
    res = baton("submit", *args, "--backend", "local")
    return Path(res.stdout.strip().splitlines()[-1].split(": ", 1)[1])


def transformers_check(folder: Path, samples: list[dict]) -> dict[str, float | bool]:
    """transformers' greedy continuation of each sample's prompt and its log-probs, beside Baton's."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gap, same = 0.0, True
    with torch.no_grad():
        for s in samples:
            prompt = torch.tensor([s["prompt"]])
            out = model.generate(prompt, do_sample=False, max_new_tokens=len(s["tokens"]), eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            tokens = out.sequences[0, prompt.shape[1]:].tolist()
            logps = [float(torch.log_softmax(score[0].float(), -1)[t]) for score, t in zip(out.scores, tokens, strict=True)]
            same &= tokens == s["tokens"]
            gap = max(gap, *(abs(a - b) for a, b in zip(logps, s["logprobs"], strict=True)))
            print(f"  prompt {s['prompt']}: Baton {s['tokens']}  transformers {tokens}")
    return {"same_tokens": same, "logprob_gap": gap}


def same_tensors(a: Path, b: Path) -> bool:
    """Two exported folders hold the same tensors, bit for bit."""
    from safetensors.numpy import load_file

    def load(folder: Path) -> dict:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    x, y = load(a), load(b)
    return x.keys() == y.keys() and all((x[k] == y[k]).all() and x[k].dtype == y[k].dtype for k in x)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=None, help="folder for the runs and exports (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="baton-hf-demo-"))).resolve()
    runs = work / "runs"

    print("1. pretrain a tiny Qwen3-shaped GPT (experiments/qwen3_tiny.yaml)")
    run = submit("experiments/qwen3_tiny.yaml", f"runs_root={runs}")
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    samples = [s for s in samples if s["kind"] == "greedy" and s["step"] == max(r["step"] for r in samples)]
    print(f"   {run}")

    out = work / "hf"
    print(f"2. baton export {run.name} --hf {out}; transformers continues the same prompts")
    baton("export", str(run), "--hf", str(out))
    hf = transformers_check(out, samples)
    print(f"   same greedy tokens: {hf['same_tokens']}; largest log-prob gap: {hf['logprob_gap']:.2e} (< {TOL:g})")

    print(f"3. GRPO from the export: init_from=hf:{out}, two steps (counting task: token ids, no tokenizer)")
    grpo = submit("experiments/qwen3_tiny.yaml", f"runs_root={runs}", "name=qwen3-tiny-grpo", "program=grpo",
                  f"init_from=hf:{out}", "trainer.steps=2", "generator.sync_interval_steps=2")
    rewards = [r["reward_mean"] for r in map(json.loads, (grpo / "metrics.jsonl").read_text().splitlines())
               if "reward_mean" in r]
    baton("export", f"{grpo}:0", "--hf", str(work / "hf_grpo_step0"))
    step0 = same_tensors(out, work / "hf_grpo_step0")
    print(f"   {grpo}\n   mean reward per step: {rewards}; step-0 checkpoint == the export's tensors: {step0}")

    print("4. baton export of a LayerNorm/GELU/learned-positions run (experiments/tiny_gpt.yaml)")
    gpt = submit("experiments/tiny_gpt.yaml", f"runs_root={runs}", "trainer.steps=1", "parallel.tp=1", "parallel.pp=1",
                 "trainer.n_gpus_per_node=1", "checkpoint.interval_steps=0")
    refused = baton("export", str(gpt), "--hf", str(work / "hf_gpt"), check=False)
    print(f"   exit {refused.returncode}: {refused.stderr.strip()}")

    result = {"run": str(run), "export": str(out), "grpo_run": str(grpo), **hf, "grpo_rewards": rewards,
              "step0_equals_export": step0, "refusal_exit": refused.returncode, "refusal": refused.stderr.strip()}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    ok = (hf["same_tokens"] and hf["logprob_gap"] < TOL and step0 and len(rewards) == 2
          and refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1)
    print("all checks hold" if ok else "A CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
