"""Who joins a worker group: the registrations of one epoch and generation, by rank.

A worker registers with its epoch, its generation and a rank (or -1: the lowest free one).
``refusal`` says why one of another epoch or generation is turned away, by name; a
``Registrations`` gathers the rest until every rank is taken, refusing a rank outside the
group or one already taken, then makes each registered worker a ``Peer`` with the welcome
it is sent (rank 0's host and offered port are everyone's torch.distributed rendezvous).
Sockets, locks and logging stay with the group (core.controller.group).
"""
from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

from core.config.run import TimeoutsConfig
from core.wire import protocol

HB_SUFFIX = b"/hb"


@dataclass
class Peer:
    """A registered worker as the group sees it: where it runs, when it was last heard, whether it is lost."""

    rank: int
    identity: bytes
    host: str
    node: str
    pid: int
    last_seen: float
    rss_mb: float = 0.0
    busy: str = ""
    lost: str = ""  # why it was declared lost, "" while alive
    started: bool = False  # it has answered a call: done importing and setting up
    rendezvous_port: int = 0  # a free port on its host it offered for a torch.distributed rendezvous

    @property
    def hb_identity(self) -> bytes:
        return self.identity + HB_SUFFIX


def refusal(env: protocol.Envelope, *, epoch: int, generation: int) -> str | None:
    """Why the registration ``env`` belongs to another epoch or generation than the group's, or None."""
    reg = env.msg
    assert isinstance(reg, protocol.Register)
    if env.epoch != epoch:
        return f"stale epoch {env.epoch}: this run is at epoch {epoch}"
    if reg.generation != generation:
        age = "stale" if reg.generation < generation else "unexpected"
        return (f"{age} generation {reg.generation} of epoch {epoch}: "
                f"this run is at generation {generation}")
    return None


class Registrations:
    """The workers registered so far for one epoch and generation: rank → (identity, registration).
    ``ranks``: the only ranks this generation starts (a group restarted alone), else all."""

    def __init__(self, *, world_size: int, epoch: int, generation: int, ranks: Collection[int] | None = None) -> None:
        self.world_size = world_size
        self.epoch = epoch
        self.generation = generation
        self.ranks = frozenset(ranks or range(world_size))  # none named: every rank, as in workers.json
        self.pending: dict[int, tuple[bytes, protocol.Register]] = {}

    def __len__(self) -> int:
        return len(self.pending)

    @property
    def expected(self) -> int:
        return len(self.ranks)

    def missing(self) -> list[int]:
        """The ranks nobody has registered yet."""
        return sorted(self.ranks - set(self.pending))

    def refusal(self, env: protocol.Envelope) -> str | None:
        """Why the registration ``env`` may not join, or None when ``admit`` takes it."""
        reason = refusal(env, epoch=self.epoch, generation=self.generation)
        if reason is not None:
            return reason
        reg = env.msg
        assert isinstance(reg, protocol.Register)
        rank = self._rank(reg)
        if not 0 <= rank < self.world_size:
            return f"rank {reg.rank_hint} outside the group of {self.world_size}"
        if rank not in self.ranks:
            return f"rank {rank} is not restarted in generation {self.generation}: it is still running"
        if rank in self.pending:
            return f"rank {rank} already registered by pid {self.pending[rank][1].pid} on {self.pending[rank][1].host}"
        return None

    def admit(self, identity: bytes, reg: protocol.Register) -> int:
        """Take the registration ``reg`` (``refusal`` found nothing against it); its rank."""
        rank = self._rank(reg)
        self.pending[rank] = (identity, reg)
        return rank

    def _rank(self, reg: protocol.Register) -> int:
        if reg.rank_hint != -1:
            return reg.rank_hint
        free = self.missing()
        return free[0] if free else self.world_size

    def welcomed(self, now: float, timeouts: TimeoutsConfig) -> Iterator[tuple[Peer, protocol.Welcome]]:
        """Each registered worker, in the order it registered, as a peer last seen ``now``,
        with the welcome it is sent."""
        rank0 = self.pending[min(self.pending)][1]
        for rank, (identity, reg) in self.pending.items():
            peer = Peer(rank=rank, identity=identity, host=reg.host, node=reg.node, pid=reg.pid, last_seen=now,
                        rendezvous_port=reg.rendezvous_port)
            yield peer, protocol.Welcome(
                rank=rank, world_size=self.world_size,
                heartbeat_interval_s=timeouts.heartbeat_interval_s,
                controller_lost_s=timeouts.controller_lost_s,
                master_addr=rank0.host, master_port=rank0.rendezvous_port,
            )
