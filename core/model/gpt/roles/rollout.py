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
every restart. With ``generator.engine: vllm`` the model is a vLLM engine per replica
(core.model.gpt.vllm_rollout: the sync's targets are whole tensors it stages, STAGE), shut
down with the process (``close``).
"""
from __future__ import annotations

import dataclasses

from core.config.roles import RolePlan
from core.flows import calls as gen_calls
from core.job import faults
from core.model.gpt import model as model_mod
from core.model.gpt.roles.base import Rank, Role
from core.model.gpt.rollout import Rollout
from core.model.gpt.vllm_rollout import VLLMRollout
from core.wire import calls
from core.wire.contract import Handlers


class RolloutRole(Role):
    name = "rollout"

    def __init__(self, rank: Rank, plan: RolePlan) -> None:
        super().__init__(rank, plan)
        self.model: Rollout | VLLMRollout | None = None

    def start(self, req: calls.Setup) -> None:
        r = self.rank
        if r.cfg.generator.engine == "vllm":
            self.model = VLLMRollout(r.cfg, self.plan.dims, self.plan.local(r.ctx.rank), on_cuda=r.on_cuda)
            self.model.link = r.link
            r.link.staging = self.model
            return
        self.model = Rollout(r.cfg, self.plan.dims, self.plan.local(r.ctx.rank), on_cuda=r.on_cuda)
        self.model.link = r.link
        r.link.model = self.model.model  # the target end of weight syncs

    def info(self) -> calls.SetupInfo:
        gen, rank = self.model, self.rank.ctx.rank
        assert gen is not None, "info follows start"
        coords = dataclasses.replace(self.plan.dims.coords(self.plan.local(rank)), rank=rank)
        if isinstance(gen, VLLMRollout):  # the engine starts at the first sync: no layers held yet
            return calls.SetupInfo(coords=coords, layers=(), num_params=0, device=self.rank.device.type)
        return calls.SetupInfo(coords=coords, layers=tuple(model_mod.global_layer_indices(gen.model)),
                               num_params=model_mod.num_local_params(gen.model), device=self.rank.device.type)

    def handlers(self) -> Handlers:
        return {
            gen_calls.SCORE: lambda req: self._ready().score(req),
            gen_calls.GENERATE: self._generate,
            gen_calls.STAGE: lambda req: self._vllm().stage(req),
            **self.rank.link_handlers(),
        }

    def _generate(self, req: gen_calls.Generate) -> gen_calls.Generated:
        model = self._ready()
        faults.generate(req.step, self.plan.local(self.rank.ctx.rank) == 0)
        return model.generate(req)

    def _ready(self) -> Rollout | VLLMRollout:
        self.rank.linked()  # refuses a call before SETUP
        assert self.model is not None, "set up"
        return self.model

    def _vllm(self) -> VLLMRollout:
        model = self._ready()
        if not isinstance(model, VLLMRollout):
            raise RuntimeError(f"rank {self.rank.ctx.rank}: STAGE is for generator.engine vllm")
        return model

    def close(self) -> None:
        if isinstance(self.model, VLLMRollout):
            self.model.close()
