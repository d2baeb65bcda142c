"""EvalActor: scores the published policy on held-out prompts every ``eval.every`` versions.

It holds its own inference engine and reward pool, listens to ``WeightsUpdated`` like a
rollout actor and loads weights with the same helper, but only the versions it evaluates:
0 (the starting policy; on resume, the restored one), every multiple of ``eval.every``,
and ``trainer.max_steps``. When it falls behind, it evaluates the newest due version and
skips the ones in between (counted in ``eval/skipped``). A version announced before it
listens never reaches it, so the trainer of a run with ``eval.every`` holds its first step
until this actor's first heartbeat (at most ``EVAL_WAIT_S``, 120 s). After the last version it
returns, so ``up`` (which waits for it like for the trainer) ends the run only once the
final evaluation is written.

Per evaluation, over ``eval.max_prompts`` held-out prompts (see
:func:`asyncrl.data.load_eval_records`), with rewards r in [0, 1]:

- ``eval/accuracy``: mean reward of one greedy completion per prompt;
- ``eval/mean@k``: mean reward of k sampled completions, averaged over prompts;
- ``eval/pass@k``: share of prompts whose best of k samples scored at least 0.5 (for
  binary rewards, the usual pass@k with n = k);
- ``eval/response_length``, ``eval/clip_ratio`` (share that hit the token budget),
  ``eval/seconds``, ``eval/tokens_per_s``.

Each prompt is an episode of the recipe's own workflow, of any kind, built as the rollout
actor builds it (:func:`asyncrl.actors.generation.build_workflow`) with the eval's
sampling (seeded by the run's seed) and samples per prompt, and offered the eval's reward
pool: ``rlvr`` replies once, ``multi_turn`` takes its feedback turns, ``agent`` runs its
tool calls; agent code and ``verifiers`` environments run through an endpoint of the eval's
own per job (per sample of the ``k``, each seeded apart), whose sampling is the job's;
with ``rollout.endpoint_sampling = "per_call"`` a call that sends its own temperature,
top_p or top_k is served with them (nothing is trained from an eval), the job's being
the default of calls that send none. A sample its workflow left
unscored is scored with ``reward.fn``. When the episodes report tool calls (``agent``,
agent code), the record adds, over the greedy episodes (the sampled ones when ``greedy``
is off):

- ``eval/tool_call_rate``: share of episodes with at least one parsable tool call;
- ``eval/tool_success``: share of the calls that succeeded;
- ``eval/turns``: mean replies per episode.

``eval/response_length`` counts the generated tokens of a whole episode, and
``eval/clip_ratio`` the episodes whose last reply hit the token budget.

Each record goes to ``eval.jsonl`` (and TensorBoard / W&B) and to the ``metrics.eval``
subject, with ``version`` the policy version it evaluated.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.actors.generation import build_workflow, latest_weights, serve_endpoint
from asyncrl.api.inference import InferenceEngine, SamplingParams
from asyncrl.api.weights import NothingAnnounced
from asyncrl.api.workflow import RolloutWorkflow
from asyncrl.config.recipe import Recipe
from asyncrl.data import load_eval_records
from asyncrl.engines import build_engine
from asyncrl.observe.sinks import Sinks, open_sinks
from asyncrl.rewards.pool import RewardPool, build_reward_pool
from asyncrl.runtime.actor import Actor, ActorContext
from asyncrl.train.checkpoint import latest_checkpoint_meta
from asyncrl.weights.build import build_receiver
from asyncrl.weights.receiver import EngineWeights
from asyncrl.weights.version import Wanted
from asyncrl.workflows.rlvr import sample_seed

EVAL_FILE = "eval.jsonl"

PASS_THRESHOLD = 0.5
"""A sample with at least this reward counts as solved for pass@k."""

FINAL_CHECK_EVERY = 5.0
"""Seconds without a due version after which the eval actor looks for the trainer's final
checkpoint (:meth:`EvalActor._evaluate_final_checkpoint`)."""


@dataclass
class EvalJob:
    """One way of scoring every prompt: ``n`` samples each with ``sampling``, through
    ``workflows``, whose samples of a prompt together are its ``n``: one workflow of ``n``
    samples, or, for a workflow that runs through an endpoint, ``n`` of one sample each
    (see :meth:`EvalActor.prepare_jobs`)."""

    n: int
    sampling: SamplingParams
    workflows: list[RolloutWorkflow]


@dataclass
class Scored:
    """One scored completion or episode: its reward, the tokens generated, whether it
    ended on the token budget, and the workflow's ``reward_info`` (agent episodes)."""

    reward: float
    length: int
    hit_max: bool
    info: dict[str, Any] = field(default_factory=dict)


def pass_at_k(rewards_PK: list[list[float]], threshold: float = PASS_THRESHOLD) -> float:
    """Share of prompts with at least one of their k rewards >= ``threshold``."""
    if not rewards_PK:
        return 0.0
    return sum(max(r) >= threshold for r in rewards_PK if r) / len(rewards_PK)


def mean_at_k(rewards_PK: list[list[float]]) -> float:
    """Mean over prompts of the mean of their k rewards."""
    rows = [sum(r) / len(r) for r in rewards_PK if r]
    return sum(rows) / len(rows) if rows else 0.0


def tool_metrics(infos: list[dict[str, Any]]) -> dict[str, float]:
    """``eval/tool_call_rate``, ``eval/tool_success`` and ``eval/turns`` of agent episodes
    (their ``reward_info``); a malformed call counts as a call that failed, not as a
    parsable one."""
    if not infos:
        return {}
    calls = sum(int(i.get("tool_calls", 0)) for i in infos)
    parsable = sum(
        int(i.get("tool_calls", 0)) - int(i.get("tool_errors", {}).get("malformed", 0)) > 0
        for i in infos
    )
    return {
        "eval/tool_call_rate": parsable / len(infos),
        "eval/tool_success": sum(int(i.get("tool_success", 0)) for i in infos) / calls
        if calls
        else 0.0,
        "eval/turns": sum(int(i.get("turns", 1)) for i in infos) / len(infos),
    }


class EvalActor(Actor):
    role = "eval"

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.engine: InferenceEngine | None = None
        self.reward_pool: RewardPool | None = None
        self.records: list[dict[str, Any]] = []
        self.counters: Counter[str] = Counter()
        self.sinks: Sinks | None = None
        self.receiver: EngineWeights | None = None
        self.evaluated: list[int] = []
        self._baseline = True
        self.jobs: list[EvalJob] = []
        self._resources = contextlib.AsyncExitStack()
        """The workflow's MCP servers and endpoints; closed in teardown, in setup's task, as
        the MCP transport requires."""

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        self.records = load_eval_records(self.recipe)
        if not self.records:
            raise ValueError(
                "eval: no held-out prompts: this run has eval.every = 0 and no eval.data, so "
                "none of its data was set aside (every prompt may have been trained on)"
                if not self.recipe.eval.every and self.recipe.eval.data is None
                else "eval: eval.data has no records"
            )
        engine = self.engine = build_engine(self.recipe)
        await engine.start()
        self.reward_pool = build_reward_pool(self.recipe)
        await self.reward_pool.start()
        await self.prepare_jobs()
        self.sinks = open_sinks(self.recipe, self.ctx.run_dir, jsonl=EVAL_FILE, job="eval")
        self.receiver = build_receiver(
            self.recipe,
            engine,
            self.bus,
            self.subjects,
            self.actor_id,
            want=self.due,
            in_order=True,  # every due version is evaluated, however fast training goes
        )
        await self.receiver.listen()
        latest = await latest_weights(self)
        # a fresh run's engine holds its starting policy, version 0: the baseline is scored
        # first even if the trainer has moved on; a resumed run's starting policy is the
        # restored one, which arrives as the latest weights
        self._baseline = latest_checkpoint_meta(self.ctx.run_dir) is None
        if latest is not None:
            self.receiver.announce(latest, force=not self._baseline)
        self.log.info("eval ready", prompts=len(self.records))

    @property
    def _engine(self) -> InferenceEngine:
        assert self.engine is not None, "the engine starts in setup"
        return self.engine

    async def prepare_jobs(self) -> None:
        """One :class:`EvalJob` per way of scoring (greedy, ``k`` samples), each with the
        recipe's workflow built for it: the tools opened once, an endpoint per job for a
        workflow that runs through one.

        An endpoint gives every call the one seed of its default sampling, so the ``k``
        seeded samples of a prompt through one endpoint would be one draw ``k`` times:
        such a job runs ``k`` workflows of one sample, sample j on an endpoint of its own
        seeded by the run's seed and j."""
        r, engine = self.recipe.rollout, self._engine
        tools = await r.workflow.open_tools(r, self._resources)
        for n, sampling in eval_samplings(self.recipe):
            shares = [(n, sampling)]
            if r.workflow.needs_endpoint and n > 1 and sampling.seed is not None:
                shares = [
                    (1, sampling.model_copy(update={"seed": sample_seed(sampling.seed, "eval", j)}))
                    for j in range(n)
                ]
            workflows = []
            for size, share in shares:
                endpoint = None
                if r.workflow.needs_endpoint:
                    endpoint = await serve_endpoint(
                        self, engine, share, self._resources, sampling_keys=eval_keys(share)
                    )
                workflows.append(
                    build_workflow(
                        self,
                        engine,
                        share,
                        size,
                        reward=self.reward_pool,
                        endpoint=endpoint,
                        tools=tools,
                        data=self.recipe.eval.data,
                    )
                )
            self.jobs.append(EvalJob(n, sampling, workflows))

    @property
    def due(self) -> Wanted:
        """The versions this actor evaluates: 0, every ``eval.every``-th and the last."""
        return Wanted(self.recipe.eval.every, self.recipe.trainer.max_steps)

    async def teardown(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()
        if self.engine is not None:
            await self.engine.stop()
        await self._resources.aclose()
        if self.reward_pool is not None:
            await self.reward_pool.aclose()
        if self.sinks is not None:
            self.sinks.close()

    async def run(self) -> None:
        assert self.receiver is not None
        engine = self._engine
        last = self.recipe.trainer.max_steps
        if self._baseline:
            await self._evaluate_and_record(int(engine.version))
        while not self.evaluated or self.evaluated[-1] < last:
            try:
                async with self.receiver.receive(idle=FINAL_CHECK_EVERY) as got:
                    # versions only, across trainer epochs: what was evaluated stays so
                    if self.evaluated and got.version <= self.evaluated[-1]:
                        continue
                    if got.version != engine.version:
                        with self.tracer.span("load weights", to_version=got.version):
                            await engine.update_weights(got.source, got.version)
            except NothingAnnounced:
                await self._evaluate_final_checkpoint()
                continue
            except (FileNotFoundError, OSError) as exc:
                # the trainer keeps only a few versions: this one is already gone
                self.counters["skipped"] += 1
                self.log.warning("weights gone, skipping", error=str(exc))
                continue
            self.version = got.version
            await self._evaluate_and_record(got.version, got.epoch)

    async def _evaluate_final_checkpoint(self) -> None:
        """The last version from the trainer's final checkpoint, once the trainer wrote it
        and no announcement brought it: an eval actor that started (a replacement of one
        that died) after the trainer announced its last weights and left, when no one is
        left to send them (a broadcast, or a fallback copy the trainer makes on request).
        The checkpoint's export is those weights, as the trainer published them."""
        last = self.recipe.trainer.max_steps
        meta = latest_checkpoint_meta(self.ctx.run_dir)
        if meta is None or meta["version"] < last:
            return  # the trainer is still training, and will announce what it reaches
        if self.evaluated and self.evaluated[-1] >= meta["version"]:
            return
        engine = self._engine
        folder = Path(meta["path"]) / "hf"
        self.log.info("final weights from the checkpoint", version=meta["version"], path=folder)
        with self.tracer.span("load weights", to_version=meta["version"]):
            await engine.update_weights(await engine.stage_weights(folder), meta["version"])
        # a checkpoint does not record its trainer epoch: the record says 0
        await self._evaluate_and_record(meta["version"])

    async def _evaluate_and_record(self, version: int, epoch: int = 0) -> None:
        """Scores ``version`` and appends its record to ``eval.jsonl``. Versions are
        recorded in increasing order, each once (``run`` skips one not above the last
        evaluated: after a trainer restart, the versions up to the last one evaluated are
        not evaluated again); ``epoch`` says which trainer lineage a record's weights
        came from."""
        assert self.sinks is not None
        self.version = version
        t0 = time.monotonic()
        with self.tracer.span("eval", version=version, prompts=len(self.records)):
            values = await self.evaluate()
        seconds = time.monotonic() - t0
        values["eval/seconds"] = seconds
        values["eval/tokens_per_s"] = values.pop("_tokens", 0.0) / max(seconds, 1e-9)
        values["eval/skipped"] = float(self.counters["skipped"])
        record = {
            "step": version,
            "version": version,
            "epoch": epoch,
            **values,
            "time": time.time(),
        }
        self.sinks.log(record, version)
        await self.emit_metrics({k: float(v) for k, v in record.items()}, step=version)
        self.evaluated.append(version)
        self.log.info("evaluated", **{k: round(v, 4) for k, v in values.items()})

    async def evaluate(self) -> dict[str, float]:
        """Runs and scores every held-out prompt's episodes at the engine's current weights."""
        async with asyncio.TaskGroup() as tg:
            tasks = [
                [
                    tg.create_task(self._episodes(i, rec, job.workflows, job.n))
                    for i, rec in enumerate(self.records)
                ]
                for job in self.jobs
            ]
        out: dict[str, float] = {"eval/prompts": float(len(self.records)), "_tokens": 0.0}
        lengths: list[int] = []
        clipped = 0
        infos: list[dict[str, Any]] = []
        for job, row in zip(self.jobs, tasks, strict=True):
            results = [t.result() for t in row]
            rewards_PK = [[r.reward for r in res] for res in results]
            for res in results:
                for r in res:
                    lengths.append(r.length)
                    clipped += r.hit_max
            if not infos:  # the first job's episodes: the greedy ones when there are
                infos = [r.info for res in results for r in res]
            if job.sampling.temperature == 0:
                out["eval/accuracy"] = mean_at_k(rewards_PK)
            else:
                out[f"eval/mean@{job.n}"] = mean_at_k(rewards_PK)
                out[f"eval/pass@{job.n}"] = pass_at_k(rewards_PK)
        out["_tokens"] = float(sum(lengths))
        out["eval/response_length"] = sum(lengths) / max(1, len(lengths))
        out["eval/clip_ratio"] = clipped / max(1, len(lengths))
        out.update(tool_metrics([i for i in infos if "tool_calls" in i]))
        return out

    async def _episodes(
        self, index: int, record: dict[str, Any], workflows: list[RolloutWorkflow], n: int
    ) -> list[Scored]:
        """The ``n`` samples of one prompt through ``workflows``, as :class:`Scored`: the
        length counts every generated token of an episode, ``info`` is the workflow's
        ``reward_info``. Sample j of prompt i is seeded by the run's seed, i and j (through
        an endpoint, by the run's seed and j): every version is scored on the same draws,
        so a change between versions is the policy's. A sample the workflow left unscored
        is scored here; an episode the engine aborted scores nothing."""
        assert self.reward_pool is not None
        item = {**record, "uid": f"eval/{index}"}
        with self.tracer.span("episode", n=n):
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(w.arun_episode(self._engine, item)) for w in workflows]
        out = []
        for t in [t for task in tasks for t in task.result() or []]:
            reward = t.reward
            if reward is None:
                with self.tracer.span("score"):
                    reward = (await self.reward_pool.score(t.completion, record)).reward
            out.append(
                Scored(
                    float(reward),
                    int(t.loss_mask.numpy().sum()),
                    t.finish_reason == "length",
                    dict(t.reward_info),
                )
            )
        return out


def eval_keys(sampling: SamplingParams) -> dict[str, str]:
    """The recipe key that sets each of an eval job's temperature, top_p and top_k, as its
    endpoint names them when a call sends another value: ``eval.greedy`` sets all three of
    the greedy job, ``eval.temperature`` the sampled jobs' temperature."""
    if sampling.temperature == 0:
        return dict.fromkeys(("temperature", "top_p", "top_k"), "eval.greedy")
    return {
        "temperature": "eval.temperature",
        "top_p": "rollout.sampling.top_p",
        "top_k": "rollout.sampling.top_k",
    }


def eval_samplings(recipe: Recipe) -> list[tuple[int, SamplingParams]]:
    """``(samples per prompt, sampling)`` of each eval job: one greedy completion
    (temperature 0) and ``k`` at the eval's temperature, under the eval's token budget,
    seeded by the run's seed."""
    cfg, s = recipe.eval, recipe.rollout.sampling
    budget = {"max_new_tokens": cfg.max_new_tokens or s.max_new_tokens, "seed": recipe.run.seed}
    jobs = []
    if cfg.greedy:
        jobs.append((1, s.params(temperature=0.0, top_p=1.0, top_k=0, **budget)))
    if cfg.k:
        jobs.append((cfg.k, s.params(temperature=cfg.temperature, **budget)))
    return jobs
