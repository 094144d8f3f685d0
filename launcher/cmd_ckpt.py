"""``baton ckpt ls|verify|inspect RUN_DIR``: a run's checkpoints, from manifests and file bytes.

No h5py here: the manifest names every tensor, slice and file, and checksums cover the
file bytes, so the login node can check a checkpoint without the job-side libraries.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from core.checkpoint import manifest
from core.config.inputs import arg_number
from core.errors import CheckpointError, ExitCode
from core.record.runfolder import RunFolder


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("ckpt", help="list, verify or inspect a run's checkpoints",
                       description="Work with the HDF5 checkpoints of a run folder.")
    cmds = p.add_subparsers(dest="ckpt_command", metavar="ACTION")
    cmds.required = True
    ls = cmds.add_parser("ls", help="steps, sizes, layout, committed or not",
                         description="List every step folder: committed ones and leftovers without a manifest.")
    ls.add_argument("run_dir", type=Path)
    ls.set_defaults(func=run_ls)
    verify = cmds.add_parser("verify", help="check completeness and checksums (exit 0 ok, 1 bad)",
                             description="Verify files, sizes and checksums of the latest (or --step N) checkpoint.")
    verify.add_argument("run_dir", type=Path)
    verify.add_argument("--step", type=arg_number(int, ge=0), metavar="N", help="this step instead of every committed one")
    verify.set_defaults(func=run_verify)
    inspect = cmds.add_parser("inspect", help="global tensors, shapes, dtypes, which file holds which slice",
                              description="Describe one committed checkpoint from its manifest.")
    inspect.add_argument("run_dir", type=Path)
    inspect.add_argument("--step", type=arg_number(int, ge=0), metavar="N", help="default: the latest committed step")
    inspect.set_defaults(func=run_inspect)


def _root(run_dir: Path) -> Path:
    return RunFolder.open(run_dir).checkpoints


def _step_dir(root: Path, step: int | None) -> Path:
    steps = manifest.committed_steps(root)
    if not steps:
        raise CheckpointError(f"{root}: no committed checkpoint yet")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise CheckpointError(f"{root}: no committed checkpoint of step {step}; committed steps: {steps}")
    return root / manifest.step_dir_name(step)


def _state(e: manifest.CheckpointEntry) -> str:
    if e.damaged:
        return "damaged"
    return ("latest" if e.is_latest else "committed") if e.committed else "uncommitted"


def run_ls(args: argparse.Namespace) -> int:
    root = _root(args.run_dir)
    entries = manifest.list_checkpoints(root)
    if not entries:
        print("no checkpoints")
    else:
        print(f"{'step':>8}  {'state':<11} {'size':>10}  layout")
        for e in entries:
            where = f"  {e.path.name}" if e.damaged else ""
            print(f"{e.step:>8}  {_state(e):<11} {e.size_bytes / 2**20:>8.1f}MB  {json.dumps(e.layout)}{where}")
    for finding in manifest.findings(root):
        print(f"note: {finding}")
    return ExitCode.OK


def run_verify(args: argparse.Namespace) -> int:
    root = _root(args.run_dir)
    steps = [args.step] if args.step is not None else manifest.committed_steps(root)
    if not steps:
        raise CheckpointError(f"{root}: no committed checkpoint yet")
    bad = 0
    for step in steps:
        problems = manifest.verify(_step_dir(root, step))
        print(f"step {step}: " + ("ok" if not problems else "BAD: " + "; ".join(problems)))
        bad += bool(problems)
    findings = manifest.findings(root)
    for finding in findings:
        print(f"BAD: {finding}")
    return ExitCode.FAILED if bad or findings else ExitCode.OK


def run_inspect(args: argparse.Namespace) -> int:
    print(manifest.describe(_step_dir(_root(args.run_dir), args.step)))
    return ExitCode.OK
