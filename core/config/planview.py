"""The model plan as ``baton plan`` prints it: the layout, one row per rank (the first and
last ``MAX_RANK_ROWS`` of a larger world), the parameters, the worst rank's memory by kind,
every optimizer sharding and recompute variant beside it, and the plan's warnings."""
from __future__ import annotations

from core.config.plan import GIB, ParamCount, Plan, RankPlan

MAX_RANK_ROWS = 64  # larger worlds show the first and last ranks only


def _layer_span(layers: tuple[int, ...]) -> str:
    if not layers:
        return "-"
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


def _holds(r: RankPlan) -> str:
    parts = [name for name, flag in (("embeddings", r.embeddings), ("output", r.output_layer),
                                     ("loss", r.loss_owner)) if flag]
    return ", ".join(parts) or "-"


def _gib(n: int) -> str:
    return f"{n / GIB:10.3f} {n / 2**20:12.1f}"  # GiB, and MiB for the small models of tests


def format_plan(plan: Plan) -> str:
    """A human-readable plan: layout table, parameters, memory breakdown, warnings."""
    d, p, mem = plan.dims, plan.params, plan.memory
    lines = [
        f"layout: {d.describe()} on {d.world_size} workers ({plan.nodes} node(s) x {plan.gpus_per_node})",
        f"batch: global {plan.global_batch_size} = micro {plan.micro_batch_size}"
        f"{' (auto)' if plan.micro_batch_auto else ''} x {plan.num_micro_batches} micro-batches x dp {d.dp}",
        f"params: {p.total:,} total (embeddings {p.embeddings:,}, {p.per_layer:,} per layer, "
        f"final norm {p.final_norm:,}, " + _output_note(p) + ")",
        "",
        f"{'rank':>5}  {'node slot':<10} {'tp':>3} {'pp':>3} {'dp':>3}  {'layers':<8} {'params':>14}  holds",
    ]
    rows = plan.ranks
    shown = rows if len(rows) <= MAX_RANK_ROWS else rows[: MAX_RANK_ROWS // 2] + rows[-MAX_RANK_ROWS // 2:]
    for i, r in enumerate(shown):
        if len(rows) > MAX_RANK_ROWS and i == MAX_RANK_ROWS // 2:
            lines.append(f"{'...':>5}  ({len(rows) - MAX_RANK_ROWS} more ranks)")
        lines.append(f"{r.rank:>5}  {f'n{r.node}/g{r.local_rank}':<10} {r.tp:>3} {r.pp:>3} {r.dp:>3}  "
                     f"{_layer_span(r.layers):<8} {r.params:>14,}  {_holds(r)}")
    optim = "on" if mem.distributed_optimizer else "off"
    lines += [
        "",
        f"memory, worst rank {mem.rank} (distributed optimizer {optim}, recompute {mem.recompute}):",
        f"  {'':<11} {'GiB':>10} {'MiB':>12}",
        f"  weights     {_gib(mem.weights_bytes)}",
        f"  gradients   {_gib(mem.grads_bytes)}",
        f"  optimizer   {_gib(mem.optimizer_bytes)}",
        f"  activations {_gib(mem.activations_bytes)}",
        f"  logits      {_gib(mem.logits_bytes)}",
        f"  total       {_gib(mem.total_bytes)}" + _verdict(plan.gpu_mem_gb, mem.fits),
        "",
        "variants (worst rank):",
        f"  {'dist-opt':<9} {'recompute':<10} {'GiB':>10} {'MiB':>12}  fits",
    ]
    for v in plan.variants:
        mark = "  <- configured" if v == mem else ""
        fits = "-" if v.fits is None else ("yes" if v.fits else "no")
        lines.append(f"  {('on' if v.distributed_optimizer else 'off'):<9} {v.recompute:<10} "
                     f"{_gib(v.total_bytes)}  {fits}{mark}")
    if plan.warnings:
        lines += ["", "warnings:", *(f"  - {w}" for w in plan.warnings)]
    return "\n".join(lines)


def _output_note(p: ParamCount) -> str:
    if not p.tied:
        return f"output layer {p.output_layer:,}"
    return f"output layer tied, copy of {p.tied_copy:,} on the last stage" if p.tied_copy else "output layer tied"


def _verdict(gpu_mem_gb: float | None, fits: bool | None) -> str:
    if gpu_mem_gb is None or fits is None:
        return ""
    return f"  of {gpu_mem_gb:g} GiB: " + ("fits" if fits else "DOES NOT FIT")
