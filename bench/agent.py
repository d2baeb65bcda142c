"""What an agent episode costs against a single-turn one, and what the OpenAI endpoint adds.

    python bench/agent.py                      # SmolLM2-135M fp32, hf engine, concurrency 8 32
    python bench/agent.py --threads 1          # the same on a machine other jobs share
    python bench/agent.py --engine vllm        # the same on a vLLM server (`make vllm`)
    python bench/agent.py --quick              # the tiny random model, seconds (a smoke run)
    python bench/agent.py --threads 1 --prefix-cache-mb 0 512 --latency-requests 0
                                               # the hf engine's prefix cache off, then on
    python bench/agent.py --threads 1 --pairs 4 --latency-requests 0
                                               # four pairs of levels a concurrency, in
                                               # turns: the median ratio, less drift

**Episodes.** Both workloads run on one engine, ``--concurrency`` episodes in flight (as a
rollout actor keeps them), each client running ``--rounds`` episodes one after another; a
record asks ``What is a * b + c * d?``.

- ``single-turn``: :class:`~asyncrl.workflows.rlvr.RLVRWorkflow`, one reply per episode
  (RLVR as the quickstart trains it).
- ``3-turn tool``: :class:`~asyncrl.workflows.agent.AgentWorkflow` with the ``calculator``,
  three replies per episode. The first two replies are each answered with the calculator's
  result for one product of the record (``a * b``, then ``c * d``), in the template's tool
  role; the third is scored. The system prompt lists the tool and shows a worked example,
  so the prompt is as long as a real tool prompt, and SmolLM2 often writes the call
  itself (``own calls`` counts the replies that hold a readable calculator call), but the
  observation does not depend on what it wrote.

Why the turns are driven and not left to the model: what a turn costs the engine depends on
how many tokens it reads and writes, not on what they say. Driving the turns makes every
3-turn episode exactly 3 replies of ``--new`` tokens (end-of-sequence is ignored in both
workloads, so a reply is always ``--new`` tokens) with the same observations, on either
engine and at any concurrency, so the figures compare like for like. Everything else in a
3-turn episode is real and timed: the workflow's loop, the calculator called through the
tool box (validation, timeout), the parser on the model's text, the end of the assistant
turn and the observation rendered through the chat template and encoded, and above all
the growing context: turn 2 and 3 send the whole episode so far back to the engine. Both
engines' prefix caches can reuse it: ``prefill/ep`` counts the prompt tokens the ``hf``
engine computed, ``cache hit`` is the share of prompt tokens the engine found cached (the
``hf`` engine's ``prefix_cache_hit_tokens``, vLLM's server metrics).
``--prefix-cache-mb`` runs the workloads once per size of the ``hf`` engine's cache (0:
off), each on a fresh engine. ``host ms/ep``
(median) is an episode's wall time outside the engine's ``agenerate``: the tool, template,
encoding, parsing and scoring, and waiting for the event loop (and the interpreter lock)
that the other episodes and the hf engine's model thread share; the line under the table
times the same per-turn work alone.

A machine's speed drifts by up to a fifth within minutes, and a level lasts 10–60 s:
``--pairs N`` runs the two workloads N times a concurrency in ABBA order (single-turn
first in even pairs, 3-turn first in odd ones) and gives the median of the pairs' ratios
with each pair's beside it. Every pair asks questions of its own (at each concurrency), so
that no level finds its prompts cached by an earlier one.

**Endpoint latency.** ``--latency-requests`` chat requests (the question, the calculator
in ``tools``, ``--latency-new`` tokens, end-of-sequence ignored, one seed per request)
through the ``openai`` client to an :class:`~asyncrl.endpoint.OpenAIEndpoint` on the same
engine, each its own recorded episode as the agent workflow makes them, against the same
prompt ids and sampling sent to ``engine.agenerate`` directly; the two paths alternate in
batches of ``--latency-concurrency`` requests. Reported: p50/p99 of both total latencies,
their difference, and the endpoint's own ``added_latency_s`` from its records (its time
minus the engine's: request parsing, templating, encoding, decoding, tool-call parsing).
The difference also holds what the endpoint's records do not: the ``openai`` client and
HTTP on localhost. The client runs in the engine's process, as agent code does in a
rollout actor, so with the hf engine it also waits for the interpreter lock and event
loop that the model thread and the engine's scheduler hold. The last table runs the same
requests, one at a time, against the ``instant`` engine (no model): the client's, HTTP's
and the endpoint's own cost with nothing else running.

Timings on a shared machine include other jobs' work; compare figures within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from asyncrl.api.reward import RewardResult

SYSTEM_PROMPT = """You solve arithmetic with the calculator. Call it for every product, then give the answer.
Example:
user: What is 12 * 34 + 56 * 78?
assistant: <tool_call>
{"name": "calculator", "arguments": {"expression": "12 * 34"}}
</tool_call>
tool: 408
assistant: <tool_call>
{"name": "calculator", "arguments": {"expression": "56 * 78"}}
</tool_call>
tool: 4368
assistant: 408 + 4368 = 4776. The answer is 4776."""


def make_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` questions ``a * b + c * d`` with 3- and 4-digit factors, their two products as
    the calculator steps and the sum as the answer."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(1000, 9999)
        c, d = rng.randint(100, 999), rng.randint(1000, 9999)
        records.append(
            {
                "uid": f"q{i}",
                "prompt": f"What is {a} * {b} + {c} * {d}?",
                "steps": [f"{a} * {b}", f"{c} * {d}"],
                "answer": str(a * b + c * d),
            }
        )
    return records


class AnswerIn:
    """Reward 1 when the reply holds the answer; the bench only needs a scorer to run."""

    async def score(self, completion: str, data: dict[str, Any]) -> RewardResult:
        return RewardResult(float(data["answer"] in completion))


def three_turn_env(tool: Any, list_tools: bool) -> Any:
    """The environment class of the ``3-turn tool`` workload (see the module docstring)."""
    from asyncrl.tools.base import ToolBox
    from asyncrl.tools.calls import ParsedReply, ToolCall
    from asyncrl.workflows.tool_env import Environment, Reset, Step, first_messages, tool_counts

    class ThreeTurns(Environment):
        def __init__(self) -> None:
            self.box = ToolBox([tool])
            self.record: dict[str, Any] = {}
            self.turn = 0
            self.own_calls = 0

        async def reset(self, record: dict[str, Any]) -> Reset:
            self.record = record
            system = SYSTEM_PROMPT if list_tools else None
            return Reset(first_messages(record, system), [tool] if list_tools else [])

        async def step(self, reply: ParsedReply, *, last: bool = False) -> Step:
            self.own_calls += any(c.name == tool.name for c in reply.tool_calls)
            steps = self.record["steps"]
            if last or self.turn >= len(steps):
                outcome = await AnswerIn().score(reply.content, self.record)
                return Step(done=True, reward=outcome.reward, info={"own_calls": self.own_calls})
            call = ToolCall(tool.name, {"expression": steps[self.turn]}, f"call_{self.turn}")
            self.turn += 1
            results = [await self.box.run(call)]
            return Step(
                messages=[r.message() for r in results], info=tool_counts(results), results=results
            )

    return ThreeTurns


class TimedEngine:
    """Passes requests to ``engine``, adding up per episode (the ``uid`` before the first
    ``/`` of the request's ``rid``) the time spent in ``agenerate`` and the prompt tokens
    sent."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.engine_s: dict[str, float] = defaultdict(float)
        self.prompt_tokens = 0

    async def agenerate(self, request: Any) -> Any:
        t0 = time.perf_counter()
        resp = await self.engine.agenerate(request)
        self.engine_s[request.rid.split("/")[0]] += time.perf_counter() - t0
        self.prompt_tokens += len(request.input_ids)
        return resp


@dataclass
class Level:
    workload: str
    concurrency: int
    episodes: int = 0
    turns: int = 0
    generated: int = 0
    prompt_tokens: int = 0
    prefill_tokens: float = float("nan")
    cache_hit: float = float("nan")
    relayouts: float = float("nan")
    seconds: float = 0.0
    host_s: list[float] = field(default_factory=list)
    tool_calls: int = 0
    own_calls: int = 0

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds


async def vllm_prefix_counters(engine: Any) -> tuple[float, float]:
    """(prefix cache queries, hits) in tokens, summed over the engine's vLLM servers' metrics;
    NaN where the engine is not a server engine or the counters are missing."""
    import aiohttp

    servers = getattr(engine, "servers", None)
    if not servers:
        return float("nan"), float("nan")
    queries = hits = 0.0
    async with aiohttp.ClientSession() as session:
        for server in servers:
            async with session.get(f"{server.url}/metrics") as resp:
                text = await resp.text()
            for line in text.splitlines():
                if line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.split()[-1])
                elif line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.split()[-1])
    return (queries, hits) if queries else (float("nan"), float("nan"))


async def run_level(
    engine: Any,
    workflow: Any,
    workload: str,
    records: list[dict[str, Any]],
    concurrency: int,
    rounds: int,
) -> Level:
    """``concurrency`` clients, each running ``rounds`` episodes of ``workflow`` in turn."""
    timed = TimedEngine(engine)
    level = Level(workload, concurrency)
    stats = getattr(engine, "stats", None)  # the hf engine counts the prompt tokens it computes
    prefill0 = stats.prefill_tokens if stats is not None else 0
    hit0 = stats.prefix_cache_hit_tokens if stats is not None else 0
    relayouts0 = stats.relayouts if stats is not None else 0
    queries0, hits0 = await vllm_prefix_counters(engine)

    async def client(i: int) -> None:
        for r in range(rounds):
            record = dict(records[(i * rounds + r) % len(records)], uid=f"{workload}-{i}-{r}")
            t0 = time.perf_counter()
            out = await workflow.arun_episode(timed, record)
            wall = time.perf_counter() - t0
            if out is None:
                raise RuntimeError("the engine stopped during the bench")
            level.episodes += 1
            level.host_s.append(wall - timed.engine_s[record["uid"]])
            for traj in out:
                info = traj.reward_info
                level.generated += int(traj.loss_mask.numpy().sum())
                level.turns += int(info.get("turns", 1))
                level.tool_calls += int(info.get("tool_calls", 0))
                level.own_calls += int(info.get("own_calls", 0))

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i in range(concurrency):
            tg.create_task(client(i))
    level.seconds = time.perf_counter() - t0
    level.prompt_tokens = timed.prompt_tokens
    if stats is not None:
        level.prefill_tokens = stats.prefill_tokens - prefill0
        level.cache_hit = (stats.prefix_cache_hit_tokens - hit0) / level.prompt_tokens
        level.relayouts = stats.relayouts - relayouts0
    queries1, hits1 = await vllm_prefix_counters(engine)
    if queries1 > queries0:
        level.cache_hit = (hits1 - hits0) / (queries1 - queries0)
    return level


async def per_turn_work(tokenizer: Any, tool: Any, n: int = 200) -> str:
    """The host work of one tool turn, timed alone: parsing the reply, the calculator
    through the tool box, the end of the turn and the observation templated and encoded."""
    from asyncrl.tools.base import ToolBox
    from asyncrl.tools.calls import ToolCall, get_parser
    from asyncrl.workflows.agent import ChatFormat

    chat, box, parse = ChatFormat(tokenizer), ToolBox([tool]), get_parser("hermes")
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 5821"}}\n</tool_call>'
    output_ids = chat.encode(text)  # a reply that calls the tool
    call = ToolCall(tool.name, {"expression": "347 * 5821"}, "call_0")

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e3

    def observation() -> None:
        message = [{"role": "tool", "tool_call_id": "call_0", "name": tool.name, "content": "1"}]
        chat.close_ids(output_ids) + chat.encode(chat.observation_text(message))

    t0 = time.perf_counter()
    for _ in range(n):
        await box.run(call)
    tool_ms = (time.perf_counter() - t0) / n * 1e3
    return (
        f"# one tool turn alone (mean of {n}): parse {timed(lambda: parse(text)):.3f} ms, "
        f"calculator through the tool box {tool_ms:.3f} ms, "
        f"turn end + observation templated and encoded {timed(observation):.3f} ms"
    )


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1]


@dataclass
class Latencies:
    concurrency: int
    direct: list[float] = field(default_factory=list)
    endpoint: list[float] = field(default_factory=list)
    added: list[float] = field(default_factory=list)


async def endpoint_latency(
    engine: Any, tool: Any | None, records: list[dict[str, Any]], args: argparse.Namespace
) -> list[Latencies]:
    """See "Endpoint latency" in the module docstring; ``tool`` None sends no ``tools``."""
    import openai

    from asyncrl.api.inference import GenerateRequest, SamplingParams
    from asyncrl.endpoint import OpenAIEndpoint

    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.latency_new, stop_token_ids=())
    tools = [tool.schema()] if tool is not None else None
    out = []
    endpoint = OpenAIEndpoint(engine, model_name="bench", token="bench-token", sampling=sampling)
    async with endpoint as ep:

        async def via_endpoint(messages: list[dict[str, Any]], seed: int, lat: Latencies) -> None:
            # a client per episode, as the agent workflow gives each episode its own
            async with (
                ep.episode() as rec,
                openai.AsyncOpenAI(
                    base_url=rec.base_url, api_key=ep.token, max_retries=0
                ) as client,
            ):
                t0 = time.perf_counter()
                await client.chat.completions.create(
                    model="bench",
                    messages=messages,  # type: ignore[arg-type]
                    tools=tools or openai.omit,  # type: ignore[arg-type]
                    max_tokens=args.latency_new,
                    seed=seed,
                )
                lat.endpoint.append(time.perf_counter() - t0)
                lat.added.extend(c.added_latency_s for c in rec.calls)

        async def direct(messages: list[dict[str, Any]], seed: int, lat: Latencies) -> None:
            ids = ep.renderer.fresh_ids(messages, tools)  # what the endpoint sends the engine
            request = GenerateRequest(
                input_ids=ids, sampling=sampling.model_copy(update={"seed": seed})
            )
            t0 = time.perf_counter()
            await engine.agenerate(request)
            lat.direct.append(time.perf_counter() - t0)

        warm = [{"role": "user", "content": "warm up"}]
        # the first call of each path pays one-time costs (lazy imports, first allocations)
        await direct(warm, 0, Latencies(0))
        await via_endpoint(warm, 0, Latencies(0))
        for c in args.latency_concurrency:
            lat = Latencies(c)
            for batch in range(max(1, args.latency_requests // c)):
                chats = [
                    (
                        [
                            {
                                "role": "user",
                                "content": records[(batch * c + i) % len(records)]["prompt"],
                            }
                        ],
                        batch * c + i,
                    )
                    for i in range(c)
                ]
                paths = [via_endpoint, direct] if batch % 2 == 0 else [direct, via_endpoint]
                for path in paths:
                    async with asyncio.TaskGroup() as tg:
                        for messages, seed in chats:
                            tg.create_task(path(messages, seed, lat))
            out.append(lat)
    return out


def build_engine(
    args: argparse.Namespace, cache_mb: int | None, shared: bool = True
) -> tuple[Any, str]:
    """An unstarted engine and a line saying where it runs; ``cache_mb`` sizes the hf
    engine's prefix cache (None: its default)."""
    import platform

    import torch

    if args.engine == "vllm":
        from asyncrl.engines.config import VLLMEngineConfig
        from asyncrl.engines.vllm import VLLMEngine
        from asyncrl.models.resolve import ModelConfig

        config = VLLMEngineConfig(
            python=args.vllm_python, cpu_kvcache_gib=args.vllm_kvcache_gib, max_model_len=4096
        )
        model = ModelConfig(path=args.model, dtype=args.dtype)
        server = VLLMEngine(model, config, log_dir="runs/bench-logs")
        return server, "a vLLM server (log in runs/bench-logs)"
    from asyncrl.engines.config import HFEngineConfig
    from asyncrl.engines.hf import HFEngine
    from asyncrl.models.resolve import ModelConfig

    hf_config = HFEngineConfig(max_batch_size=max(args.concurrency), shared_prefix_attention=shared)
    if cache_mb is not None:
        hf_config = hf_config.model_copy(update={"prefix_cache_mb": cache_mb})
    engine = HFEngine(ModelConfig(path=args.model, dtype=args.dtype), hf_config)
    return engine, (
        f"hf in process, {platform.processor() or 'cpu'} x{torch.get_num_threads()}, "
        f"prefix cache {hf_config.prefix_cache_mb} MiB, "
        f"shared-prefix attention {'on' if shared else 'off'}"
    )


def print_header() -> None:
    print(
        f"{'workload':<12} {'conc':>4} {'episodes':>8} {'turns':>5} {'gen tok':>7} "
        f"{'prompt/ep':>9} {'prefill/ep':>10} {'cache hit':>9} {'rebuilds':>8} {'seconds':>7} "
        f"{'ep/s':>6} {'tok/s':>7} {'host ms/ep':>10} {'own calls':>9}"
    )


def print_level(lv: Level) -> None:
    calls = f"{lv.own_calls}/{lv.tool_calls}" if lv.tool_calls else "-"
    hit = "-" if math.isnan(lv.cache_hit) else f"{lv.cache_hit:.0%}"
    prefill = "-" if math.isnan(lv.prefill_tokens) else f"{lv.prefill_tokens / lv.episodes:.0f}"
    rebuilds = "-" if math.isnan(lv.relayouts) else f"{lv.relayouts:.0f}"
    print(
        f"{lv.workload:<12} {lv.concurrency:>4} {lv.episodes:>8} {lv.turns:>5} "
        f"{lv.generated:>7} {lv.prompt_tokens / lv.episodes:>9.0f} {prefill:>10} {hit:>9} "
        f"{rebuilds:>8} {lv.seconds:>7.1f} {lv.episodes_per_s:>6.2f} {lv.tokens_per_s:>7.1f} "
        f"{statistics.median(lv.host_s) * 1e3:>10.1f} {calls:>9}",
        flush=True,
    )


def print_latencies(latencies: list[Latencies], title: str) -> None:
    print(f"\n# {title}, ms (p50 / p99)")
    print(
        f"{'conc':>4} {'calls':>5} {'engine.agenerate':>17} {'openai+endpoint':>17} "
        f"{'difference':>15} {'endpoint added':>15}"
    )
    for lat in latencies:

        def pair(xs: list[float]) -> str:
            return f"{percentile(xs, 0.5) * 1e3:.1f} / {percentile(xs, 0.99) * 1e3:.1f}"

        diff = (
            f"{(percentile(lat.endpoint, 0.5) - percentile(lat.direct, 0.5)) * 1e3:.1f} / "
            f"{(percentile(lat.endpoint, 0.99) - percentile(lat.direct, 0.99)) * 1e3:.1f}"
        )
        added = f"{percentile(lat.added, 0.5) * 1e3:.2f} / {percentile(lat.added, 0.99) * 1e3:.2f}"
        print(
            f"{lat.concurrency:>4} {len(lat.endpoint):>5} {pair(lat.direct):>17} "
            f"{pair(lat.endpoint):>17} {diff:>15} {added:>15}",
            flush=True,
        )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--rounds", type=int, default=1, help="episodes per client, in sequence")
    ap.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="single-turn and 3-turn levels per concurrency, in turns (ABBA); the ratio "
        "printed last is the median over the pairs",
    )
    ap.add_argument("--new", type=int, default=64, help="tokens per reply")
    ap.add_argument(
        "--latency-requests", type=int, default=32, help="per path and level; 0: no latency rows"
    )
    ap.add_argument("--latency-concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--latency-new", type=int, default=32)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the hf engine (0: torch's default); 1 on a machine that other "
        "jobs share, where threads spinning for cores they do not get slow every step",
    )
    ap.add_argument(
        "--prefix-cache-mb",
        type=int,
        nargs="+",
        default=None,
        help="hf: MiB of the engine's prefix cache (rollout.engine.prefix_cache_mb; 0: off); "
        "several values run the workloads once per value, on a fresh engine each",
    )
    ap.add_argument(
        "--shared-prefix-attention",
        choices=["on", "off"],
        nargs="+",
        default=["on"],
        help="hf: decode rows sharing a cached prefix with cascade attention "
        "(rollout.engine.shared_prefix_attention); several values run the workloads once "
        "per value, on a fresh engine each",
    )
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--vllm-kvcache-gib", type=int, default=2)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the tiny random model, one tiny level, one torch thread: a smoke run",
    )
    args = ap.parse_args()

    from asyncrl.api.inference import SamplingParams
    from asyncrl.engines.config import InstantEngineConfig
    from asyncrl.engines.instant import InstantEngine
    from asyncrl.tools.builtin import calculator_tool
    from asyncrl.workflows.agent import AgentWorkflow
    from asyncrl.workflows.rlvr import RLVRWorkflow

    list_tools = True
    if args.quick:
        from asyncrl.models.tiny import tiny_model_dir

        # The tiny model has 512 positions: no tool listing (in the 3-turn prompt and the
        # endpoint's requests), short replies.
        args.model, args.engine, list_tools = str(tiny_model_dir()), "hf", False
        args.concurrency, args.new, args.latency_new = [2], 6, 4
        args.latency_requests, args.latency_concurrency = 2, [1]
        args.threads = args.threads or 1

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    tool = calculator_tool()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new, stop_token_ids=())
    # every level pair its own questions: a repeated one would find its prompts cached
    records = make_records(sum(args.concurrency) * args.rounds * args.pairs)
    cache_sizes: list[int | None] = (
        args.prefix_cache_mb if args.engine == "hf" and args.prefix_cache_mb else [None]
    )
    shared_modes = args.shared_prefix_attention if args.engine == "hf" else ["on"]
    runs = [(mb, mode) for mb in cache_sizes for mode in shared_modes]
    levels: dict[tuple[int, str, int], list[Level]] = {}  # by (run, workload, concurrency)
    for run, (cache_mb, mode) in enumerate(runs):
        engine, where = build_engine(args, cache_mb, mode == "on")
        t0 = time.perf_counter()
        async with engine:
            print(
                f"# {args.engine}: {args.model} {args.dtype}, {where}; "
                f"up in {time.perf_counter() - t0:.1f}s"
            )
            tok = engine.tokenizer
            single = RLVRWorkflow(tok, sampling, reward=AnswerIn())
            agent = AgentWorkflow(
                tok, sampling, env_factory=three_turn_env(tool, list_tools), max_turns=3
            )
            print(
                f"# {args.new} tokens per reply, end-of-sequence ignored, T=1; "
                f"{'tool listing and a worked example' if list_tools else 'no tool listing'} "
                "in the 3-turn prompt"
            )
            await run_level(engine, single, "warm-up", make_records(1, seed=1), 1, 1)
            print()
            print_header()
            workloads = [("single-turn", single), ("3-turn tool", agent)]
            used = 0
            for c in args.concurrency:
                for pair in range(args.pairs):
                    fresh = records[used : used + c * args.rounds]
                    used += c * args.rounds
                    # ABBA: the machine's drift during a pair weighs on both workloads
                    for name, wf in workloads if pair % 2 == 0 else workloads[::-1]:
                        level = await run_level(engine, wf, name, fresh, c, args.rounds)
                        levels.setdefault((run, name, c), []).append(level)
                        print_level(level)
            stats = getattr(engine, "stats", None)
            if stats is not None:
                decoded = sum(n * k for n, k in stats.decode_batch_sizes.items())
                print(
                    f"# decoded rows that read a shared prefix once: {stats.shared_prefix_rows}"
                    f" of {decoded}"
                )
            print()
            if run < len(runs) - 1 or not args.latency_requests:
                continue
            print(await per_turn_work(tok, tool))
            latencies = await endpoint_latency(engine, tool if list_tools else None, records, args)
            print_latencies(latencies, f"latency per chat call, {args.latency_new} new tokens")
    if args.latency_requests:
        # The same path with no model behind it: the client's, HTTP's and the endpoint's
        # cost alone, without waiting for a model thread or other episodes.
        floor_args = argparse.Namespace(**{**vars(args), "latency_concurrency": [1]})
        floor_args.latency_requests = 50
        async with InstantEngine(
            config=InstantEngineConfig(response_tokens=args.latency_new)
        ) as instant:
            floor = await endpoint_latency(instant, tool, records, floor_args)
        print_latencies(
            floor, f"the same on the instant engine (no model, {args.latency_new} tokens)"
        )
    for run, (cache_mb, mode) in enumerate(runs):
        label = "" if cache_mb is None else f"prefix cache {cache_mb} MiB, "
        if len(shared_modes) > 1:
            label += f"shared-prefix attention {mode}, "
        for c in args.concurrency:
            pairs = list(
                zip(levels[run, "single-turn", c], levels[run, "3-turn tool", c], strict=True)
            )
            tokens = [a.tokens_per_s / s.tokens_per_s for s, a in pairs]
            episodes = [a.episodes_per_s / s.episodes_per_s for s, a in pairs]
            each = f" (pairs: {', '.join(f'{r:.2f}' for r in tokens)})" if len(pairs) > 1 else ""
            print(
                f"# {label}concurrency {c}: 3-turn tool episodes at "
                f"{statistics.median(tokens):.2f}x the single-turn tokens/s{each}, "
                f"{statistics.median(episodes):.2f}x its episodes/s"
            )


if __name__ == "__main__":
    asyncio.run(main())
