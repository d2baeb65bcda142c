"""TrainerActor: one GRPO / decoupled-PPO step per batch, then new weights for everyone.

Under torchrun every rank builds the FSDP engine, but only rank 0 is an actor (on NATS):
it fetches each batch from the buffer and broadcasts it to the other ranks, which follow
along in :func:`follower_loop`. Torch work runs in a worker thread so that rank 0 keeps
heartbeating while it trains.

Per step: shaped rewards → advantages per group → ``train_step`` (``ppo_minibatches``
optimizer steps against the proximal policy of ``trainer.loss.proximal``, with the KL
penalty to the initial policy when ``trainer.loss.kl_coef`` > 0) → version + 1 → every
``update_every`` steps the weights go out (a shared directory or the NATS object store)
with ``WeightsUpdated`` → a line in ``metrics.jsonl`` and, for every trained sample, a
record of its staleness and token fingerprint in ``trained_samples.jsonl`` → a checkpoint
every ``checkpoint_every`` steps and at the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

from asyncrl.actors.buffer.admission import split_groups
from asyncrl.actors.common import build_train_engine
from asyncrl.actors.weights import KeptExports, delete_weights, export_name, put_weights
from asyncrl.messages import (
    ActorInfo,
    BatchRequest,
    MemoryControl,
    MemoryReleased,
    Metrics,
    TrainBatchRef,
    Trajectory,
    WeightsUpdated,
    decode,
)
from asyncrl.runtime.actor import Actor, ActorContext
from asyncrl.runtime.bus import BusTimeout, RemoteError
from asyncrl.runtime.supervisor import RESTART_ENV
from asyncrl.train.checkpoint import commit_checkpoint, latest_checkpoint_meta

BATCH_REQUEST_TIMEOUT = 15.0
"""Seconds to wait for the buffer's answer; the buffer answers "not ready" after 5 s."""

BATCH_WAIT_LOG_EVERY = 30.0
"""Seconds between two log lines that say what a batch request waits for."""

RELEASE_TIMEOUT = 60.0
"""Seconds a colocated trainer waits for the rollout actors it knows to release their
memory before it steps anyway (an actor that died meanwhile never answers)."""

ALIVE_WINDOW = 3.0
"""An actor counts as live (``actors/<role>``) if its last heartbeat is this recent
(heartbeats come every second)."""


def token_digest(ids: list[int]) -> str:
    """A short fingerprint of a token sequence (``trained_samples.jsonl``'s
    ``tokens_sha1``): what was trained can be matched with what was sampled without
    writing every sequence out."""
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


def _replies(mask: Any) -> int:
    """Stretches of generated tokens in a sample's loss mask: its replies."""
    return int(mask[0]) + int((mask[1:] & ~mask[:-1]).sum())


def batch_stats(
    trajectories: list[Trajectory], group_size: int, max_new_tokens: int
) -> dict[str, float]:
    """Response lengths and per-group reward shape of one training batch.

    - ``response_length/mean``, ``/max``: generated tokens per sample (loss-mask sum);
    - ``response_length/clip_ratio``: share of samples whose (last) reply stopped on the
      token budget;
    - ``reward_groups/all_zero``, ``/all_one``: share of groups whose rewards are all <= 0,
      or all >= 1 (no GRPO signal either way);
    - ``reward_groups/std_mean``: mean over groups of the within-group reward std
      (population std: the spread GRPO normalises by);
    - ``versions/mixed_samples``: samples whose tokens span two policy versions or more.
    """
    masks = [t.loss_mask.numpy().astype(bool) for t in trajectories]
    lengths = [int(m.sum()) for m in masks]
    # A reply that filled its budget counts as cut even when it ended on a stop token; a
    # sample of several replies (multi-turn, agents) is judged by its last reply's finish
    # reason only, since its total length may exceed one reply's budget.
    clipped = [
        t.finish_reason == "length" or (n >= max_new_tokens and _replies(m) == 1)
        for t, n, m in zip(trajectories, lengths, masks, strict=True)
    ]
    groups = [
        [float(t.reward or 0.0) for t in group] for group in split_groups(trajectories, group_size)
    ]
    stds = []
    for g in groups:
        mu = sum(g) / len(g)
        stds.append((sum((r - mu) ** 2 for r in g) / len(g)) ** 0.5)
    n_groups = max(1, len(groups))
    return {
        "response_length/mean": sum(lengths) / max(1, len(lengths)),
        "response_length/max": float(max(lengths, default=0)),
        "response_length/clip_ratio": sum(clipped) / max(1, len(clipped)),
        "reward_groups/all_zero": sum(all(r <= 0 for r in g) for g in groups) / n_groups,
        "reward_groups/all_one": sum(all(r >= 1 for r in g) for g in groups) / n_groups,
        "reward_groups/std_mean": sum(stds) / n_groups,
        # samples whose tokens came from two versions or more (an update mid-generation)
        "versions/mixed_samples": float(sum(t.versions_spanned > 1 for t in trajectories)),
    }


def build_samples(
    trajectories: list[Trajectory], recipe: Any
) -> tuple[list[Any], dict[str, float]]:
    """Train samples with group advantages from whole groups laid end to end.

    The rewards are shaped first (``trainer.shaping``, :func:`shaped_rewards`: the numbers
    the buffer's dynamic filter judges too), with ``L`` the generated tokens of a sample
    (its loss-mask sum)::

        r' = clamp((r + overlong(L) + bias) · scale, −clip, clip)

    where ``overlong`` is DAPO's soft penalty over the last ``overlong_buffer`` tokens of
    the generation budget (0 when the buffer is 0). ``reward_mean`` stays the raw reward.

    Episodes of several samples (agent code whose calls do not all continue one another)
    take the baseline and scale of their group's episodes, each episode's reward being its
    final sample's (:func:`~asyncrl.algo.advantages.episode_advantages`).

    With ``trainer.loss.mask_truncated`` (DAPO's overlong filtering), a sample that stopped
    on its token budget (``finish_reason == "length"``) keeps its place in its group's
    baseline but carries no loss: its loss mask is cleared.
    """
    import torch

    from asyncrl.actors.common import shaped_rewards
    from asyncrl.algo import episode_advantages, group_advantages
    from asyncrl.train import Sample

    loss_cfg = recipe.trainer.loss
    rewards = torch.tensor([float(t.reward or 0.0) for t in trajectories], dtype=torch.float32)
    shaped = torch.tensor(shaped_rewards(trajectories, recipe), dtype=torch.float32)
    std_level = None if loss_cfg.adv_std_level == "none" else loss_cfg.adv_std_level
    if all(t.episode_samples == 1 for t in trajectories):
        adv = group_advantages(
            shaped,
            recipe.rollout.group_size,
            std_level=std_level,
            leave_one_out=loss_cfg.leave_one_out,
        )
    else:
        episode_of, finals = episodes_of(trajectories)
        adv = episode_advantages(
            shaped,
            torch.tensor(episode_of),
            shaped[finals],
            recipe.rollout.group_size,
            std_level=std_level,
            leave_one_out=loss_cfg.leave_one_out,
        )
    samples = []
    masked = 0
    for t, a in zip(trajectories, adv.tolist(), strict=True):
        loss_mask = torch.from_numpy(t.loss_mask.numpy().astype(bool))
        if loss_cfg.mask_truncated and t.finish_reason == "length":
            loss_mask = torch.zeros_like(loss_mask)
            masked += 1
        samples.append(
            Sample(
                input_ids=torch.from_numpy(t.input_ids.numpy().astype("int64")),
                loss_mask=loss_mask,
                behav_logprobs=torch.from_numpy(t.logprobs.numpy().astype("float32")),
                advantages=float(a),
            )
        )
    stats = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "reward_shaped_mean": float(shaped.mean()),
        "adv_abs_mean": float(adv.abs().mean()),
    }
    if loss_cfg.mask_truncated:
        stats["truncated_masked"] = float(masked)
    return samples, stats


def episodes_of(trajectories: list[Trajectory]) -> tuple[list[int], list[int]]:
    """For samples of whole groups laid end to end, each in episode order: the episode
    index of every sample, and the position of each episode's final sample (the one that
    holds its last call, whose reward is the episode's)."""
    episode_of: list[int] = []
    finals: list[int] = []
    key = None
    for i, t in enumerate(trajectories):
        if (t.prompt_uid, t.group_index) != key:
            key = (t.prompt_uid, t.group_index)
            finals.append(i)
        if t.episode_sample == t.episode_samples - 1:
            finals[-1] = i
        episode_of.append(len(finals) - 1)
    return episode_of, finals


class TrainerActor(Actor):
    role = "trainer"

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.engine: Any = None
        self.step = 0
        self.version = 0
        self.published_version = 0  # rollouts start from the initial weights, version 0
        self.data_state: dict[str, Any] = {}
        self.epoch = int(os.environ.get(RESTART_ENV, "0"))
        """How many times ``up`` restarted the trainer in this run: its weights and batch
        requests carry it, so the buffer and the rollouts know the versions after the
        checkpoint it restarted from were rolled back."""
        self.checkpoint_step = 0
        """The step of the latest checkpoint: a restarted trainer goes on from there."""
        self.samples_file = ctx.run_dir / "trained_samples.jsonl"
        self.weights_dir = ctx.run_dir / "weights"
        self.exports = KeptExports(self.weights_dir)
        self.ckpt_dir = ctx.run_dir / "checkpoints"
        self._t_start = time.monotonic()
        self._samples_total = 0
        self._tokens_total = 0
        self._colocated_seen: dict[str, float] = {}  # rollout actor id -> last heartbeat
        self._released: dict[str, MemoryReleased] = {}
        self._release_answered = asyncio.Event()

        self.sinks: Any = None
        self._last_heartbeat: dict[str, tuple[str, float]] = {}
        self._rollout_latest: dict[str, dict[str, float]] = {}
        self._rollout_seen: dict[str, tuple[float, float]] = {}
        # each actor's latest drop counters, kept after it dies: they are totals of the run
        self._dropped: dict[str, dict[str, int]] = {}

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        from asyncrl.observe.sinks import open_sinks

        meta = latest_checkpoint_meta(self.ctx.run_dir)
        # what a dead trainer (of this run, or of the run before a --resume) recorded after
        # the last checkpoint did not happen; a fresh run has nothing to drop
        kept = int(meta["step"]) if meta is not None else 0
        for name in (self.samples_file.name, "metrics.jsonl"):
            drop_records_after(self.ctx.run_dir / name, kept)
        self.sinks = open_sinks(self.recipe, self.ctx.run_dir, jsonl="metrics.jsonl", job="trainer")
        await self.bus.subscribe(self.subjects.heartbeat("*"), ActorInfo, self._on_heartbeat)
        await self.bus.subscribe(
            self.subjects.metrics("rollout"), Metrics, self._on_rollout_metrics
        )
        if self.recipe.rollout.colocate:
            await self.bus.subscribe(
                self.subjects.heartbeat("rollout"), ActorInfo, self._on_rollout
            )
            await self.bus.subscribe(
                self.subjects.memory_released, MemoryReleased, self._on_released
            )
        self.engine = await asyncio.to_thread(build_train_engine, self.recipe)
        if meta is not None:
            await asyncio.to_thread(self._broadcast, ("load", meta["path"]))
            self.step, self.version = int(meta["step"]), int(meta["version"])
            self.checkpoint_step = self.step
            self.log.info("resumed", step=self.step, version=self.version, epoch=self.epoch)
        if meta is not None or self.epoch:
            # the rollouts may hold weights of versions this trainer never reached
            await self._publish_weights()

    async def teardown(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self._broadcast, ("stop", None))
        if self.sinks is not None:
            self.sinks.close()

    async def _on_heartbeat(self, info: ActorInfo) -> None:
        self._last_heartbeat[info.actor_id] = (info.role, time.monotonic())
        if info.dropped:
            self._dropped[info.actor_id] = info.dropped

    def _drop_stats(self) -> dict[str, float]:
        """The messages the run's actors received and could not handle, summed over the
        actors by ``dropped/<subject>/<reason>``: bad input shows in the metrics stream.
        The trainer's own count is current; the others' as of their last heartbeat."""
        self._dropped[self.actor_id] = self.dropped()
        out: dict[str, float] = {}
        for counts in self._dropped.values():
            for key, n in counts.items():
                out[f"dropped/{key}"] = out.get(f"dropped/{key}", 0.0) + n
        return out

    async def _on_rollout_metrics(self, m: Metrics) -> None:
        # two kinds of record (progress, weight update): keep the latest of each value
        self._rollout_latest.setdefault(m.actor_id, {}).update(m.values, _time=m.time)

    def _fleet_stats(self) -> dict[str, float]:
        """Live actors per role, each live rollout actor's generation rate over the step,
        the rollout actors' latest pause for a weight update (the pause of the previous
        version: this step's weights are still on their way) and their idle time."""
        now = time.monotonic()
        alive: dict[str, int] = {}
        for actor_id, (role, seen) in list(self._last_heartbeat.items()):
            if now - seen <= ALIVE_WINDOW:
                alive[role] = alive.get(role, 0) + 1
            else:
                del self._last_heartbeat[actor_id]
                self._rollout_latest.pop(actor_id, None)
                self._rollout_seen.pop(actor_id, None)
        out: dict[str, float] = {f"actors/{role}": float(n) for role, n in sorted(alive.items())}
        out["actors/trainer"] = float(self.recipe.trainer.nproc)
        rates = {}
        for actor_id, v in self._rollout_latest.items():
            # generated tokens over the time between this step's and the previous step's
            # view of the actor's counter: its average rate over the step, idle time included
            now_point = (v.get("_time", 0.0), v.get("tokens", 0.0))
            before = self._rollout_seen.get(actor_id)
            if before is not None and now_point[0] > before[0]:
                rates[actor_id] = (now_point[1] - before[1]) / (now_point[0] - before[0])
            else:
                rates[actor_id] = v.get("gen_tokens_per_s_total", 0.0)
            if before is None or now_point[0] > before[0]:
                self._rollout_seen[actor_id] = now_point
        for actor_id, rate in sorted(rates.items()):
            out[f"rollout/{actor_id}/tokens_per_s"] = rate
        out["rollout/tokens_per_s"] = sum(rates.values())
        pauses = [
            v["weight_update_s"] for v in self._rollout_latest.values() if "weight_update_s" in v
        ]
        out["time_gen_pause_s"] = max(pauses, default=0.0)
        idle = [(v["idle_s"], v["run_s"]) for v in self._rollout_latest.values() if "run_s" in v]
        if idle:
            # the live rollout actors' time with no episode running, and its share of their
            # running time: generation starved by the staleness budget (η = 0 waits here)
            out["rollout/idle_s"] = sum(i for i, _ in idle)
            out["rollout/idle_frac"] = out["rollout/idle_s"] / max(sum(r for _, r in idle), 1e-9)
        return out

    # -- the step loop ----------------------------------------------------------------------

    async def run(self) -> None:
        cfg = self.recipe.trainer
        while self.step < cfg.max_steps:
            t0 = time.monotonic()
            with self.tracer.span("wait batch", step=self.step + 1):
                batch = await self._fetch_batch(self.step)
            t_batch = time.monotonic() - t0
            samples, stats = build_samples(batch.trajectories, self.recipe)
            if self.recipe.rollout.colocate:
                stats["rollout_freed_bytes"] = await self._release_rollout_memory()
            t1 = time.monotonic()
            with self.tracer.span("train", step=self.step + 1, samples=len(samples)):
                train_stats = await asyncio.to_thread(self._broadcast, ("train", samples))
            t_train = time.monotonic() - t1
            self.step += 1
            self.version += 1
            self.data_state = batch.data_state
            t2 = time.monotonic()
            last = self.step == cfg.max_steps
            if self.step % cfg.update_every == 0 or last:
                with self.tracer.span("publish weights", step=self.step):
                    await self._publish_weights()
            elif self.recipe.rollout.colocate:  # no new weights to bring the memory back
                await self.bus.publish(
                    self.subjects.memory, MemoryControl(action="resume", step=self.step)
                )
            t_weights = time.monotonic() - t2
            values = self._record(batch, stats, train_stats, t_batch, t_train, t_weights)
            await self.emit_metrics(values, step=self.step)
            if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or last:
                await self._checkpoint()

    # -- colocation ---------------------------------------------------------------------------

    async def _on_rollout(self, info: ActorInfo) -> None:
        if info.status == "running":
            self._colocated_seen[info.actor_id] = time.monotonic()
        else:
            self._colocated_seen.pop(info.actor_id, None)
        self._release_answered.set()  # a release wait re-counts who is alive

    async def _on_released(self, msg: MemoryReleased) -> None:
        if msg.step == self.step:
            self._released[msg.actor_id] = msg
            self._release_answered.set()

    async def _release_rollout_memory(self) -> float:
        """Asks every live rollout actor to free the accelerator and waits for all of
        them (or :data:`RELEASE_TIMEOUT`); returns the bytes they freed together."""
        ttl = self.recipe.rollout.lease_ttl
        live: set[str] = set()
        self._released.clear()
        await self.bus.publish(
            self.subjects.memory, MemoryControl(action="release", step=self.step)
        )
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT):
                while True:
                    now = time.monotonic()
                    live = {a for a, t in self._colocated_seen.items() if now - t < ttl}
                    if live <= self._released.keys():
                        break
                    self._release_answered.clear()
                    await self._release_answered.wait()
        except TimeoutError:
            missing = sorted(live - self._released.keys())
            self.log.warning("rollout actors did not release memory", actors=missing)
        return float(sum(m.freed_bytes for m in self._released.values()))

    async def _fetch_batch(self, step: int) -> TrainBatchRef:
        """Asks the buffer until it has the batch, and logs (rate-limited) what it waits
        for. The request names the published version too: the buffer judges staleness
        against the weights rollouts can have, not against steps whose weights were never
        sent (``update_every`` > 1)."""
        req = BatchRequest(
            step=step,
            version=self.version,
            published_version=self.published_version,
            epoch=self.epoch,
            checkpoint_step=self.checkpoint_step,
        )
        last_log = -BATCH_WAIT_LOG_EVERY
        while True:
            try:
                reply = await self.bus.request(
                    self.subjects.batch, req, TrainBatchRef, timeout=BATCH_REQUEST_TIMEOUT
                )
            except (BusTimeout, RemoteError) as exc:
                detail = str(exc)  # no buffer yet, or it failed: ask again
            else:
                if reply.waiting is None:
                    break
                detail = reply.waiting.describe()
            if time.monotonic() - last_log >= BATCH_WAIT_LOG_EVERY:
                last_log = time.monotonic()
                self.log.info("waiting for a batch", step=step, detail=detail)
        if not reply.blob_key:
            return reply
        import io

        buf = io.BytesIO()
        await self.bus.get_blob(self.subjects.batch_bucket, reply.blob_key, buf)
        # the batch is in hand: its blob would only pile up (a repeated request puts it back)
        await self.bus.delete_blob(self.subjects.batch_bucket, reply.blob_key)
        return decode(buf.getvalue(), TrainBatchRef)

    def _record(
        self,
        batch: TrainBatchRef,
        stats: dict[str, float],
        train_stats: dict[str, float],
        t_batch: float,
        t_train: float,
        t_weights: float,
    ) -> dict[str, float]:
        """Logs the step's record to every sink (``metrics.jsonl`` always) and its samples
        to trained_samples.jsonl; returns the numeric metrics. Agent workflows' samples add
        the ``agent/...`` metrics (:func:`~asyncrl.workflows.agent.agent_metrics`)."""
        from asyncrl.workflows.agent import agent_metrics

        trained_at = self.version - 1  # the weights these samples updated
        staleness = []
        n_tokens = 0
        with open(self.samples_file, "a") as f:
            for t in batch.trajectories:
                s = trained_at - t.head_version
                staleness.append(s)
                response_tokens = int(t.loss_mask.numpy().sum())
                n_tokens += response_tokens
                f.write(
                    json.dumps(
                        {
                            "step": self.step,
                            "uid": t.uid,
                            "prompt_uid": t.prompt_uid,
                            "actor_id": t.actor_id,
                            "head_version": t.head_version,
                            "trained_version": trained_at,
                            "staleness": s,
                            "reward": t.reward,
                            "response_tokens": response_tokens,
                            "tokens_sha1": token_digest(t.input_ids.numpy().tolist()),
                        }
                    )
                    + "\n"
                )
        self._samples_total += len(batch.trajectories)
        self._tokens_total += n_tokens
        elapsed = time.monotonic() - self._t_start
        record: dict[str, Any] = {
            "step": self.step,
            "version": self.version,
            **stats,
            "accepted": batch.counters.get("accepted", 0),
            "rejected": batch.counters.get("rejected", 0),
            "staleness_mean": sum(staleness) / max(1, len(staleness)),
            "staleness_max": max(staleness, default=0),
            **{f"staleness/{s}": n for s, n in sorted(Counter(staleness).items())},
            "samples": len(batch.trajectories),
            "samples_per_s": self._samples_total / elapsed,
            "tokens_per_s": self._tokens_total / elapsed,
            "loss": train_stats.get("loss"),
            "kl": train_stats.get("kl_ref"),
            "clip_frac": train_stats.get("clip_frac"),
            "grad_norm": train_stats.get("grad_norm"),
            "lr": train_stats.get("lr"),
            "time_wait_batch_s": t_batch,
            "time_train_s": t_train,
            "time_weights_s": t_weights,
            **batch_stats(
                batch.trajectories,
                self.recipe.rollout.group_size,
                self.recipe.rollout.sampling.max_new_tokens,
            ),
            **agent_metrics(batch.trajectories),
            **self._fleet_stats(),
            **self._drop_stats(),
            **{
                f"train/{k}": v
                for k, v in train_stats.items()
                if k not in ("loss", "kl_ref", "clip_frac", "grad_norm", "lr")
            },
            "time": time.time(),
        }
        self.sinks.log(record, self.step)
        return {k: float(v) for k, v in record.items() if isinstance(v, int | float)}

    # -- weights and checkpoints -----------------------------------------------------------------

    async def _publish_weights(self) -> None:
        kind = self.recipe.trainer.weights_transport
        target = self.weights_dir / export_name(self.epoch, self.version)
        # only a --resume finds its name taken (epochs count the restarts of one ``up``),
        # by an export of the run before it that nothing reads any more
        await asyncio.to_thread(shutil.rmtree, target, ignore_errors=True)
        await asyncio.to_thread(self._broadcast, ("export", str(target)))
        if kind == "dir":
            location = str(target.resolve())
        else:
            location = await put_weights(self.bus, self.subjects.weights_bucket, target)
        await self.bus.publish(
            self.subjects.weights,
            WeightsUpdated(
                version=self.version,
                kind=kind,
                location=location,
                step=self.step,
                epoch=self.epoch,
            ),
        )
        self.published_version = self.version
        for old in self.exports.published(target):
            if kind == "object_store":
                await delete_weights(self.bus, self.subjects.weights_bucket, old)
            shutil.rmtree(old, ignore_errors=True)

    async def _checkpoint(self) -> None:
        path = self.ckpt_dir / f"step_{self.step:06d}"
        extra = {"step": self.step, "version": self.version, "data_state": self.data_state}

        def write(folder: Path) -> None:
            self._broadcast(("save", (str(folder), extra)))
            # the policy of this checkpoint as plain HF weights: what rollout actors load
            # on --resume, before the trainer has published anything
            self._broadcast(("export", str(folder / "hf")))

        # a failure (a full disk) ends the trainer with a CheckpointError that names the
        # checkpoint still in place: training on past it would risk more than it saves
        await asyncio.to_thread(commit_checkpoint, self.ctx.run_dir, path, self.step, write)
        self.checkpoint_step = self.step
        self.log.info("checkpoint", step=self.step, path=str(path))

    # -- collective work (rank 0 leads, the other ranks follow) -----------------------------------

    def _broadcast(self, command: tuple[str, Any]) -> Any:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list([command], src=0)
        return execute(self.engine, command)


def execute(engine: Any, command: tuple[str, Any]) -> Any:
    """What every rank does for one command (collectives inside happen on all ranks)."""
    name, arg = command
    if name == "train":
        return engine.train_step(arg)
    if name == "export":
        return engine.export_hf(Path(arg))
    if name == "save":
        path, extra = arg
        return engine.save_checkpoint(Path(path), extra)
    if name == "load":
        return engine.load_checkpoint(Path(arg))
    if name == "stop":
        return None
    raise ValueError(f"unknown trainer command {name!r}")


def follower_loop(recipe: Any) -> int:
    """Ranks > 0: build the engine, then execute rank 0's commands until ``stop``."""
    import torch.distributed as dist

    engine = build_train_engine(recipe)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        command = box[0]
        execute(engine, command)
        if command[0] == "stop":
            return 0


def drop_records_after(path: Path, step: int) -> int:
    """Rewrites a JSON-lines file without the records of steps after ``step`` (written
    under a temporary name, then renamed); returns how many were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1  # a line torn by the killed writer
            continue
        if record_step > step:
            dropped += 1
        else:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
    return dropped


__all__ = ["TrainerActor", "drop_records_after", "follower_loop"]
