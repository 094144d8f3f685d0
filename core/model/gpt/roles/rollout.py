"""The rollout: a generator's model (core.model.gpt.rollout.Rollout) in the generator's layout.

Colocated it lives in the trainer's processes (after the actor, reference and critic)
with process groups of its own; split it is the only role of the generator's own
processes, whose torch.distributed world and Megatron state are the generator's. Either
way its layout is its group's plan (``RolePlan.dims``) and its rank there
``RolePlan.local``. Its model is built at ``start``: after the actor has seeded the
training streams and resolved the micro batch, as the generator always was (building it
draws from the default stream). Calls: SCORE (teacher-forced log-probs: the probe),
GENERATE, and the target end of weight syncs (GEN_SLICES, SYNC_WEIGHTS; split: BRIDGE).
It holds nothing a checkpoint needs: its weights are the actor's, synced again after
every restart.
"""
from __future__ import annotations

import dataclasses

from core.config.roles import RolePlan
from core.flows import calls as gen_calls
from core.model.gpt import model as model_mod
from core.model.gpt.roles.base import Rank, Role
from core.model.gpt.rollout import Rollout
from core.wire import calls
from core.wire.contract import Handlers


class RolloutRole(Role):
    name = "rollout"

    def __init__(self, rank: Rank, plan: RolePlan) -> None:
        super().__init__(rank, plan)
        self.model: Rollout | None = None

    def start(self, req: calls.Setup) -> None:
        r = self.rank
        self.model = Rollout(r.cfg, self.plan.dims, self.plan.local(r.ctx.rank), on_cuda=r.on_cuda)
        self.model.link = r.link
        r.link.model = self.model.model  # the target end of weight syncs

    def info(self) -> calls.SetupInfo:
        gen, rank = self.model, self.rank.ctx.rank
        assert gen is not None, "info follows start"
        return calls.SetupInfo(coords=dataclasses.replace(self.plan.dims.coords(self.plan.local(rank)), rank=rank),
                               layers=tuple(model_mod.global_layer_indices(gen.model)),
                               num_params=model_mod.num_local_params(gen.model), device=self.rank.device.type)

    def handlers(self) -> Handlers:
        return {
            gen_calls.SCORE: lambda req: self._ready().score(req),
            gen_calls.GENERATE: lambda req: self._ready().generate(req),
            **self.rank.link_handlers(),
        }

    def _ready(self) -> Rollout:
        self.rank.linked()  # refuses a call before SETUP
        assert self.model is not None, "set up"
        return self.model
