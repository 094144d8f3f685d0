"""``baton plan CONFIG [key=value ...]``: the layout, parameter count and memory of a run, before submitting."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from core.config import run as config
from core.config.genplan import format_generator, plan_generator
from core.config.inputs import arg_number
from core.config.plan import make_plan
from core.config.planview import format_plan
from core.config.rlplan import format_rl_update, plan_rl_update
from core.errors import ExitCode, UserError
from core.hf import families
from launcher.plan_check import run_check


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``plan`` subcommand."""
    p = sub.add_parser(
        "plan", help="show the parallel layout, parameter count and per-GPU memory estimate",
        description="Show who holds which layers (rank, node slot, tp/pp/dp), the parameter count and a "
                    "per-GPU memory estimate with and without the distributed optimizer and activation "
                    "recompute; under grpo/ppo the RL update's (its logits at the rollout's lengths) and the "
                    "generator's (its KV cache). Exit code 1 when the configured run is estimated not to fit.",
    )
    p.add_argument("config", nargs="?", help="the run's YAML config")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. parallel.tp=2")
    p.add_argument("--gpu-mem-gb", type=arg_number(float, gt=0, le=1e6), default=80.0,
                   help="memory of one GPU in GiB, > 0 (default: 80)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (what plan.json records)")
    p.add_argument("--check", metavar="RUN_DIR", help="compare a run's measured memory per rank (memory.json) "
                                                     "with the plan's estimate; exit 1 when off by more than 15%%")
    p.set_defaults(func=run)


def _source(cfg: config.RunConfig) -> str:
    """``model: qwen3 from FOLDER`` for ``init_from: hf:FOLDER`` (its shape is config.json's), else nothing."""
    folder = families.split_source(cfg.init_from or "")
    if folder is None:
        return ""
    family = families.model_section(Path(folder).expanduser()).family
    return f"model: {family} from {folder} (its config.json gives the shape; weights read at start)\n"


def run(args: argparse.Namespace) -> int:
    """Load the config, print the plan (and the generator's); 1 if it does not fit the GPU memory."""
    if args.check:
        if args.config or args.overrides:
            raise UserError("baton plan --check RUN_DIR takes no config or overrides: the run folder's config.yaml "
                            "is what ran")
        return run_check(Path(args.check))
    if not args.config:
        raise UserError("baton plan: give a config (baton plan CONFIG [key=value ...]) or --check RUN_DIR")
    cfg = config.load(args.config, args.overrides)
    plan = make_plan(cfg, gpu_mem_gb=args.gpu_mem_gb)
    gen = plan_generator(cfg, plan)
    update = plan_rl_update(cfg, plan)
    if args.json:
        print(json.dumps({**plan.to_dict(), "generator": gen and dataclasses.asdict(gen),
                          "rl_update": update and dataclasses.asdict(update)}, indent=2))
    else:
        print(_source(cfg) + format_plan(plan) + ("" if update is None else "\n" + format_rl_update(update))
              + ("" if gen is None else "\n" + format_generator(gen)))
    fits = (plan.fits, None if gen is None else gen.fits, None if update is None else update.fits)
    return ExitCode.FAILED if False in fits else ExitCode.OK
