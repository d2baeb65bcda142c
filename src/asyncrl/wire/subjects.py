"""Every NATS subject, stream and bucket name of a run, in one place.

All names are scoped by the run: ``asyncrl.<run>.<...>``. A run name is reduced to the
characters NATS allows in a subject token (and in a stream name), so any folder name works.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN_SAFE = re.compile(r"[^A-Za-z0-9_-]")


def run_token(run: str) -> str:
    """The run name as one subject token: no dots, spaces, wildcards or '>'."""
    token = _TOKEN_SAFE.sub("_", run.strip()) or "run"
    return token[:64]


@dataclass(frozen=True)
class Subjects:
    """The names of one run. Build it once with ``Subjects(run)``."""

    run: str

    @property
    def prefix(self) -> str:
        return f"asyncrl.{run_token(self.run)}"

    # control plane (plain subjects)
    @property
    def started(self) -> str:
        return f"{self.prefix}.actor.started"

    def heartbeat(self, role: str = "*") -> str:
        return f"{self.prefix}.actor.heartbeat.{role}"

    @property
    def exited(self) -> str:
        return f"{self.prefix}.actor.exit"

    @property
    def control(self) -> str:
        return f"{self.prefix}.control"

    def metrics(self, role: str = "*") -> str:
        """Metrics of one role (``metrics.trainer``) or, with the default, a wildcard."""
        return f"{self.prefix}.metrics.{role}"

    # data plane
    @property
    def lease(self) -> str:
        """Request/reply: LeaseRequest -> Lease."""
        return f"{self.prefix}.buffer.lease"

    @property
    def episode_aborted(self) -> str:
        """Request/reply: EpisodeAborted -> Ack."""
        return f"{self.prefix}.buffer.aborted"

    @property
    def batch(self) -> str:
        """Request/reply: BatchRequest -> TrainBatchRef."""
        return f"{self.prefix}.buffer.batch"

    @property
    def weights(self) -> str:
        """WeightsUpdated broadcasts."""
        return f"{self.prefix}.weights"

    @property
    def weights_join(self) -> str:
        """Request/reply to the trainer: WeightsJoin -> WeightsGrant (``collective``)."""
        return f"{self.prefix}.weights.join"

    @property
    def weights_fallback(self) -> str:
        """Request/reply to the trainer: WeightsFallback -> WeightsUpdated in the object
        store (an engine the broadcast cannot reach)."""
        return f"{self.prefix}.weights.fallback"

    @property
    def memory(self) -> str:
        """MemoryControl broadcasts from the trainer (colocation)."""
        return f"{self.prefix}.rollout.memory"

    @property
    def memory_released(self) -> str:
        """MemoryReleased answers from rollout actors (colocation)."""
        return f"{self.prefix}.rollout.memory.released"

    @property
    def weights_query(self) -> str:
        """Request/reply: WeightsQuery -> the latest WeightsUpdated."""
        return f"{self.prefix}.buffer.weights"

    @property
    def trajectories(self) -> str:
        """Unscored trajectories (JetStream)."""
        return f"{self.prefix}.traj.raw"

    @property
    def scored(self) -> str:
        """Scored trajectories (JetStream)."""
        return f"{self.prefix}.traj.scored"

    @property
    def trajectory_groups(self) -> str:
        """Unscored groups, one message per group (JetStream)."""
        return f"{self.prefix}.traj.raw_groups"

    @property
    def scored_groups(self) -> str:
        """Scored groups, one message per group (JetStream)."""
        return f"{self.prefix}.traj.scored_groups"

    @property
    def trajectory_subjects(self) -> list[str]:
        """Every subject of the trajectory stream."""
        return [self.trajectories, self.trajectory_groups, self.scored, self.scored_groups]

    @property
    def stream(self) -> str:
        """The JetStream stream holding the trajectory subjects, samples and groups."""
        return f"ASYNCRL_{run_token(self.run)}_TRAJ"

    @property
    def weights_bucket(self) -> str:
        """Object-store bucket for weights shipped over NATS."""
        return f"asyncrl_{run_token(self.run)}_weights"

    @property
    def buffer_bucket(self) -> str:
        """Object-store bucket holding the buffer's durable state (one snapshot)."""
        return f"asyncrl_{run_token(self.run)}_buffer"

    @property
    def batch_bucket(self) -> str:
        """Object-store bucket for training batches too large for one message; the
        trainer deletes each blob once it has decoded the batch."""
        return f"asyncrl_{run_token(self.run)}_batches"
