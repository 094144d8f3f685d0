"""The model roles a GPT worker's task is composed of: one module per role.

    actor      roles/actor.py      the trained policy: training calls, RL updates and scoring,
                                   the trainer's side of the generator flow; ZeRO-3 and local
                                   SGD are its options. Items: model, optimizer, blobs, momentum
    reference  roles/reference.py  the frozen reference policy (rl.kl). No items: loaded by
                                   CKPT_LOAD into reference
    critic     roles/critic.py     PPO's value model: CRITIC_STEP, CRITIC_INIT. Items: critic.*
    rollout    roles/rollout.py    a generator's model: SCORE, GENERATE, weight syncs. No items

``compose`` gives a process's roles in the plan's order: the models of the groups it serves
(``WorkerContext.roles``, core.config.roles), its own group's first. Every role module imports
torch and Megatron at the top: only workers import this package, and it imports
``megatron.core`` first through ``core.parallel.imports`` (its ``torch.compile`` deferred).
"""
from __future__ import annotations

from core.parallel.imports import import_megatron

import_megatron()  # before any module below imports megatron.core

from core.model.gpt.roles.actor import ActorRole  # noqa: E402
from core.model.gpt.roles.base import Rank, Role  # noqa: E402
from core.model.gpt.roles.critic import CriticRole  # noqa: E402
from core.model.gpt.roles.reference import ReferenceRole  # noqa: E402
from core.model.gpt.roles.rollout import RolloutRole  # noqa: E402

ROLES: dict[str, type[Role]] = {r.name: r for r in (ActorRole, ReferenceRole, CriticRole, RolloutRole)}

__all__ = ["ROLES", "ActorRole", "CriticRole", "Rank", "ReferenceRole", "Role", "RolloutRole", "compose"]


def compose(rank: Rank) -> list[Role]:
    """This process's roles, one per model of the groups it serves, in the plan's order."""
    roles = [ROLES[model](rank, plan) for plan in rank.ctx.roles for model in plan.models]
    rank.models = {r.name: r for r in roles}
    return roles
