"""EvalActor: scores the published policy on held-out prompts every ``eval.every`` versions.

It holds its own inference engine and reward pool, listens to ``WeightsUpdated`` like a
rollout actor and loads weights with the same helper, but only the versions it evaluates:
0 (the starting policy; on resume, the restored one), every multiple of ``eval.every``,
and ``trainer.max_steps``. When it falls behind, it evaluates the newest due version and
skips the ones in between (counted in ``eval/skipped``). After the last version it
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

For ``rollout.workflow = "rlvr"`` (and any workflow but ``agent``) generation is
single-turn, from the prompt record's chat as the ``rlvr`` workflow builds it. For
``agent`` runs each prompt is an episode of the recipe's own workflow (built like the
rollout actor's, by :func:`asyncrl.workflows.build.build_workflow`, with the eval's
sampling and samples per prompt): tool calls run, and the final answer is scored. The
record then adds, over the greedy episodes (the sampled ones when ``greedy`` is off):

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
from typing import TYPE_CHECKING, Any

from asyncrl.runtime.actor import Actor, ActorContext
from asyncrl.runtime.bus import BusTimeout, RemoteError
from asyncrl.weights.build import build_receiver
from asyncrl.weights.receiver import EngineWeights
from asyncrl.wire.messages import WeightsQuery, WeightsUpdated

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe

WEIGHTS_QUERY_TIMEOUT = 5.0
"""Seconds to wait for the buffer's answer to "which weights are the latest?"."""

EVAL_FILE = "eval.jsonl"

PASS_THRESHOLD = 0.5
"""A sample with at least this reward counts as solved for pass@k."""

AGENT_WORKFLOWS = ("agent",)
"""Workflows whose episodes the eval runs through the workflow itself."""


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


def is_due(version: int, every: int, last: int) -> bool:
    """Whether a policy version is one the eval actor evaluates."""
    return version == 0 or version == last or (every > 0 and version % every == 0)


class EvalActor(Actor):
    role = "eval"

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.engine: Any = None
        self.reward_pool: Any = None
        self.records: list[dict[str, Any]] = []
        self.counters: Counter[str] = Counter()
        self.sinks: Any = None
        self.receiver: EngineWeights | None = None
        self.evaluated: list[int] = []
        self._baseline = True
        self.agent = False
        self.tools: list[Any] | None = None
        self._resources = contextlib.AsyncExitStack()
        """MCP servers of an agent run's tools; closed in teardown, in setup's task, as the
        MCP transport requires."""

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        from asyncrl.data import load_eval_records
        from asyncrl.engines import build_engine
        from asyncrl.observe.sinks import open_sinks
        from asyncrl.rewards import build_reward_pool
        from asyncrl.train.checkpoint import latest_checkpoint_meta

        self.records = load_eval_records(self.recipe)
        if not self.records:
            raise ValueError(
                "eval: no held-out prompts: this run has eval.every = 0 and no eval.data, so "
                "none of its data was set aside (every prompt may have been trained on)"
                if not self.recipe.eval.every and self.recipe.eval.data is None
                else "eval: eval.data has no records"
            )
        self.engine = build_engine(self.recipe)
        await self.engine.start()
        self.reward_pool = build_reward_pool(self.recipe)
        await self.reward_pool.start()
        self.agent = self.recipe.rollout.workflow in AGENT_WORKFLOWS
        if self.agent:
            self.tools = await self._open_tools()
        self.sinks = open_sinks(self.recipe, self.ctx.run_dir, jsonl=EVAL_FILE, job="eval")
        self.receiver = build_receiver(
            self.recipe,
            self.engine,
            self.bus,
            self.subjects,
            self.actor_id,
            want=self._is_due,
            in_order=True,  # every due version is evaluated, however fast training goes
        )
        await self.receiver.listen()
        latest = await self._query_weights()
        # a fresh run's engine holds its starting policy, version 0: the baseline is scored
        # first even if the trainer has moved on; a resumed run's starting policy is the
        # restored one, which arrives as the latest weights
        self._baseline = latest_checkpoint_meta(self.ctx.run_dir) is None
        if latest is not None:
            self.receiver.announce(latest, force=not self._baseline)
        self.log.info("eval ready", prompts=len(self.records))

    def _is_due(self, version: int) -> bool:
        return is_due(version, self.recipe.eval.every, self.recipe.trainer.max_steps)

    async def teardown(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()
        if self.reward_pool is not None:
            await self.reward_pool.aclose()
        if self.engine is not None:
            await self.engine.stop()
        await self._resources.aclose()
        if self.sinks is not None:
            self.sinks.close()

    async def _query_weights(self) -> WeightsUpdated | None:
        try:
            return await self.bus.request(
                self.subjects.weights_query,
                WeightsQuery(actor_id=self.actor_id),
                WeightsUpdated,
                timeout=WEIGHTS_QUERY_TIMEOUT,
            )
        except (BusTimeout, RemoteError):
            return None  # nothing published yet: the engine holds version 0

    async def run(self) -> None:
        assert self.receiver is not None
        last = self.recipe.trainer.max_steps
        if self._baseline:
            await self._evaluate_and_record(int(self.engine.version))
        while not self.evaluated or self.evaluated[-1] < last:
            try:
                async with self.receiver.receive() as got:
                    if self.evaluated and got.version <= self.evaluated[-1]:
                        continue
                    if got.version != self.engine.version:
                        with self.tracer.span("load weights", to_version=got.version):
                            await self.engine.update_weights(got.source, got.version)
            except (FileNotFoundError, OSError) as exc:
                # the trainer keeps only a few versions: this one is already gone
                self.counters["skipped"] += 1
                self.log.warning("weights gone, skipping", error=str(exc))
                continue
            self.version = got.version
            await self._evaluate_and_record(got.version, got.epoch)

    async def _evaluate_and_record(self, version: int, epoch: int = 0) -> None:
        """Scores ``version`` and appends its record to ``eval.jsonl``. Versions are
        recorded in increasing order, each once (``run`` skips one not above the last
        evaluated: after a trainer restart, the versions up to the last one evaluated are
        not evaluated again); ``epoch`` says which trainer lineage a record's weights
        came from."""
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
        """Generates and scores every held-out prompt at the engine's current weights."""
        cfg = self.recipe.eval
        jobs: list[tuple[int, Any]] = []
        if cfg.greedy:
            jobs.append((1, eval_sampling_params(self.recipe, greedy=True)))
        if cfg.k:
            jobs.append((cfg.k, eval_sampling_params(self.recipe, greedy=False)))
        async with asyncio.TaskGroup() as tg:
            tasks = []
            for n, sampling in jobs:
                if self.agent:
                    workflow = self._workflow(sampling, n)
                    row = [
                        tg.create_task(self._episodes(i, rec, workflow))
                        for i, rec in enumerate(self.records)
                    ]
                else:
                    row = [
                        tg.create_task(self._complete(i, rec, sampling, n))
                        for i, rec in enumerate(self.records)
                    ]
                tasks.append(row)
        out: dict[str, float] = {"eval/prompts": float(len(self.records)), "_tokens": 0.0}
        lengths: list[int] = []
        clipped = 0
        infos: list[dict[str, Any]] = []
        for (n, sampling), row in zip(jobs, tasks, strict=True):
            results = [t.result() for t in row]
            rewards_PK = [[r.reward for r in res] for res in results]
            for res in results:
                for r in res:
                    lengths.append(r.length)
                    clipped += r.hit_max
            if not infos:  # the first job's episodes: the greedy ones when there are
                infos = [r.info for res in results for r in res]
            if sampling.temperature == 0:
                out["eval/accuracy"] = mean_at_k(rewards_PK)
            else:
                out[f"eval/mean@{n}"] = mean_at_k(rewards_PK)
                out[f"eval/pass@{n}"] = pass_at_k(rewards_PK)
        out["_tokens"] = float(sum(lengths))
        out["eval/response_length"] = sum(lengths) / max(1, len(lengths))
        out["eval/clip_ratio"] = clipped / max(1, len(lengths))
        if self.agent:
            out.update(tool_metrics(infos))
        return out

    async def _open_tools(self) -> list[Any] | None:
        """The agent workflow's tools as a rollout actor opens them (``rollout.agent.tools``
        and the tools of the MCP servers, started here); None when an environment brings
        its own."""
        from asyncrl.tools.mcp import MCPTools
        from asyncrl.workflows.build import build_agent_tools, mcp_server_specs

        if self.recipe.rollout.agent.env:
            return None
        tools = build_agent_tools(self.recipe)
        for spec in mcp_server_specs(self.recipe):
            server = await self._resources.enter_async_context(MCPTools(spec))
            tools += server.tools
        return tools

    def _workflow(self, sampling: Any, n: int) -> Any:
        """The recipe's workflow, built as the rollout actor builds it, with the eval's
        sampling (seeded by the run's seed) and ``n`` samples per prompt."""
        from asyncrl.workflows.build import build_workflow

        workflow = build_workflow(self.recipe, self.engine, self.reward_pool, tools=self.tools)
        workflow.sampling = sampling.model_copy(update={"seed": self.recipe.run.seed})
        workflow.group_size = n
        return workflow

    async def _episodes(self, index: int, record: dict[str, Any], workflow: Any) -> list[Scored]:
        """The episodes of one prompt through ``workflow`` (see :meth:`_workflow`), as
        :class:`Scored`: the length counts every generated token of an episode, ``info``
        is the workflow's ``reward_info``. Sample j of prompt i is seeded by the run's
        seed, i and j, as in :meth:`_complete`. An episode the engine aborted scores
        nothing."""
        with self.tracer.span("episode", n=workflow.group_size):
            trajectories = await workflow.arun_episode(
                self.engine, {**record, "uid": f"eval/{index}"}
            )
        return [
            Scored(
                float(t.reward or 0.0),
                int(t.loss_mask.numpy().sum()),
                t.finish_reason == "length",
                dict(t.reward_info),
            )
            for t in trajectories or []
        ]

    async def _complete(
        self, index: int, record: dict[str, Any], sampling: Any, n: int
    ) -> list[Scored]:
        """``n`` single-turn completions of one prompt as :class:`Scored`.

        Sample j of prompt i has a seed fixed by the run's seed, i and j: every version
        is scored on the same draws, so a change between versions is the policy's."""
        from asyncrl.engines.base import GenerateRequest
        from asyncrl.workflows.base import chat_messages, encode_chat
        from asyncrl.workflows.rlvr import sample_seed

        tokenizer = self.engine.tokenizer
        prompt_ids = encode_chat(tokenizer, chat_messages(record))
        with self.tracer.span("generate", n=n):
            async with asyncio.TaskGroup() as tg:
                gens = [
                    tg.create_task(
                        self.engine.agenerate(
                            GenerateRequest(
                                input_ids=prompt_ids,
                                sampling=sampling.model_copy(
                                    update={
                                        "seed": sample_seed(
                                            self.recipe.run.seed, f"eval/{index}", j
                                        )
                                    }
                                ),
                            )
                        )
                    )
                    for j in range(n)
                ]
        out = []
        for g in gens:
            resp = g.result()
            text = tokenizer.decode(resp.output_ids, skip_special_tokens=True)
            with self.tracer.span("score"):
                scored = await self.reward_pool.score(text, record)
            out.append(
                Scored(float(scored.reward), len(resp.output_ids), resp.finish_reason == "length")
            )
        return out


def eval_sampling_params(recipe: Recipe, *, greedy: bool) -> Any:
    """Greedy (temperature 0) or the eval's sampling, under the eval's token budget."""
    from asyncrl.engines.base import SamplingParams

    cfg, s = recipe.eval, recipe.rollout.sampling
    budget = cfg.max_new_tokens or s.max_new_tokens
    if greedy:
        return SamplingParams(temperature=0.0, max_new_tokens=budget)
    return SamplingParams(
        temperature=cfg.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=budget
    )
