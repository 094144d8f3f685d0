"""``baton export RUN_DIR[:STEP] --hf OUT``: a committed checkpoint as a Hugging Face model folder.

The login node checks what it can from file names and the manifest (a run folder, a
committed checkpoint of that step, an OUT that is new or empty) and then runs
``python -m core.checkpoint.hf_export`` in a subprocess, as ``baton data build`` does: the export reads
HDF5 shards (h5py, numpy), which the login-node CLI never imports. That process checks the
model's shape against the families Hugging Face has before it writes anything.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from core.checkpoint import manifest
from core.config.inputs import arg_text
from core.config.rl import init_from
from core.errors import CheckpointError, UserError
from core.record.runfolder import RunFolder

REPO_ROOT = Path(__file__).resolve().parents[1]  # so `-m core.checkpoint.hf_export` resolves without an install
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def arg_size(text: str) -> int:
    """An argparse ``type=``: a size in bytes from ``5GB``, ``500MB``, ``2GiB`` or a plain number."""
    m = _SIZE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give one like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``export``."""
    p = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face model folder",
        description="Write a committed checkpoint of a GPT run (any layout: tp/pp/dp, ZeRO) as a Hugging Face "
                    "model folder that transformers and vLLM load like the original: config.json, "
                    "generation_config.json, model-0000i-of-0000N.safetensors with model.safetensors.index.json, "
                    "and the tokenizer files of the Hugging Face folder the run was imported from (init_from: "
                    "hf:PATH). Weights are written in that folder's dtype (its config.json's dtype or torch_dtype), "
                    "or float32 for a run trained from scratch. Llama, Qwen2 and Qwen3 shapes are supported. "
                    "Tensors are read and written one at a time: memory stays near one tensor, not a shard.",
    )
    p.add_argument("run", type=arg_text, metavar="RUN_DIR[:STEP]",
                   help="the run folder; :STEP picks a committed step (default: the newest)")
    p.add_argument("--hf", required=True, type=arg_text, metavar="OUT", help="the folder to write (new or empty)")
    p.add_argument("--max-shard-size", type=arg_size, default=arg_size("5GB"), metavar="SIZE",
                   help="the largest safetensors file (default 5GB, as transformers)")
    p.set_defaults(func=run)


def resolve(run: str) -> Path:
    """The committed step folder ``RUN_DIR[:STEP]`` names, or a one-line UserError."""
    run_dir, step = init_from(run)
    folder = RunFolder.open(Path(run_dir).expanduser())
    steps = manifest.committed_steps(folder.checkpoints)
    if not steps:
        raise CheckpointError(f"{folder.checkpoints}: no committed checkpoint yet; export a run after it saved one")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise CheckpointError(f"{run}: step {step} has no committed checkpoint; committed steps: "
                              f"{', '.join(map(str, steps))}")
    return folder.checkpoints / manifest.step_dir_name(step)


def check_out(out: Path) -> None:
    """OUT must be new, or an empty folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file" if not out.is_dir() else "exists and is not empty"
        raise UserError(f"--hf: {out} {what}; give a new folder (or remove it)")


def build_command(step_dir: Path, args: argparse.Namespace) -> list[str]:
    """The subprocess command line."""
    return [sys.executable, "-m", "core.checkpoint.hf_export", str(step_dir), "--hf", str(Path(args.hf).expanduser()),
            "--max-shard-size", str(args.max_shard_size)]


def run(args: argparse.Namespace) -> int:
    """Check, then export in a subprocess; its exit code is ours (2 on bad input)."""
    step_dir = resolve(args.run)
    check_out(Path(args.hf).expanduser())
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(build_command(step_dir, args), env=env, check=False).returncode
