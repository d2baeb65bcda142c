"""How well does a base model use the calculator before any training?

Runs the agent workflow (hf engine, the built-in ``calculator``, the ``math`` reward on
the final answer) on held-out ``products`` prompts and prints, per system prompt:

- ``tried``: share of episodes with at least one ``<tool_call>`` (parsable or not);
- ``call``: share of episodes with at least one parsable call (``eval/tool_call_rate``);
- ``success``: share of calls that succeeded (the calculator returned a value);
- ``right_call``: share of episodes that called the calculator with the product asked;
- ``accuracy``: share of episodes whose final answer is the product (the reward);
- ``mixed``: share of prompts whose samples were neither all right nor all wrong (the
  groups that carry a GRPO signal);
- ``turns``, ``tokens`` (generated per episode), ``clip`` (share of replies cut by the
  token budget), and the episodes per second.

    PYTHONPATH=src python bench/tool_probe.py --prompts 32 --samples 4 --example
    PYTHONPATH=src python bench/tool_probe.py --show 3 --example   # print episodes

``--system`` names one of :data:`SYSTEM_PROMPTS` (or ``all``) or gives the text itself.
``--recipe`` takes the system prompt, sampling, limits and data settings from a recipe
(its ``[rollout.agent]`` section) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import statistics
import time
from typing import Any

from asyncrl.api.inference import SamplingParams
from asyncrl.api.reward import RewardResult
from asyncrl.data.synthetic import PRODUCTS_INSTRUCTION, products_records
from asyncrl.engines.config import HFEngineConfig
from asyncrl.engines.hf import HFEngine
from asyncrl.models.resolve import resolve_model_path
from asyncrl.rewards.math_reward import math_reward
from asyncrl.workflows.agent import AgentWorkflow

DESCRIBED = (
    "You are a helpful assistant with a calculator. To multiply, call the calculator "
    "like this:\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 4567"}}\n'
    "</tool_call>\n"
    "The calculator answers with the result, for example 561741. Then write the final "
    "answer: \\boxed{561741}"
)

TRANSCRIPT = (
    "You are a helpful assistant with a calculator tool. Example:\n"
    "user: What is 123 * 4567?\n"
    'assistant: <tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 4567"}}\n'
    "</tool_call>\n"
    "tool: 561741\n"
    "assistant: The answer is \\boxed{561741}."
)

SYSTEM_PROMPTS: dict[str, str | None] = {
    "transcript": TRANSCRIPT,
    "none": None,
    "short": "You are a helpful assistant. Use the calculator for arithmetic.",
    "described": DESCRIBED,
}


class MathScorer:
    """The ``math`` reward in-process (two plain numbers never reach math-verify)."""

    async def score(self, completion: str, data: dict[str, Any]) -> RewardResult:
        return RewardResult(math_reward(completion, data))


def right_call(traj: Any, tokenizer: Any) -> bool:
    """Whether a calculator call of the episode computed the product asked."""
    text = tokenizer.decode(traj.input_ids.numpy().tolist())
    answer = traj.data["answer"]
    return f"<tool_response>\n{answer}\n</tool_response>" in text or f"\n{answer}<|im_end|>" in text


async def probe(
    engine: HFEngine,
    system: str | None,
    records: list[dict[str, Any]],
    samples: int,
    sampling: SamplingParams,
    max_turns: int,
    max_total_tokens: int,
    show: int,
    listing: str = "template",
) -> dict[str, float]:
    wf = AgentWorkflow(
        engine.tokenizer,
        sampling,
        reward=MathScorer(),
        tools=["calculator"],
        group_size=samples,
        max_turns=max_turns,
        max_total_tokens=max_total_tokens,
        system_prompt=system,
        tool_listing=listing,
    )
    start = await wf.env_factory().reset(records[0])
    prompt_tokens = len(wf.chat.prompt_ids(start.messages, start.tools, listing))
    t0 = time.perf_counter()
    groups = await asyncio.gather(
        *(wf.arun_episode(engine, {"uid": f"p{i}", **r}) for i, r in enumerate(records))
    )
    seconds = time.perf_counter() - t0
    trajs = [t for g in groups if g for t in g]
    tok = engine.tokenizer
    first_call = any_call = calls = ok = right = 0
    clipped = replies = 0
    for t in trajs:
        info = t.reward_info
        parsed = info["tool_calls"] - info["tool_errors"].get("malformed", 0)
        any_call += parsed > 0
        calls += info["tool_calls"]
        ok += info["tool_success"]
        right += right_call(t, tok)
        replies += info["turns"]
        clipped += t.finish_reason == "length"
        first_call += info["tool_calls"] > 0
    n = max(1, len(trajs))
    # episodes that tried a call first: those are the ones worth reading
    for t in sorted(trajs, key=lambda t: -t.reward_info["tool_calls"])[:show]:
        print("-" * 80)
        print(tok.decode(t.input_ids.numpy().tolist()))
        print(f"== reward {t.reward} info {t.reward_info}")
    return {
        "episodes": float(len(trajs)),
        "prompt_tokens": float(prompt_tokens),
        "tried": first_call / n,
        "call": any_call / n,
        "success": ok / calls if calls else 0.0,
        "right_call": right / n,
        "accuracy": statistics.fmean(float(t.reward or 0.0) for t in trajs) if trajs else 0.0,
        "mixed": sum(len({t.reward for t in g}) > 1 for g in groups if g) / max(1, len(groups)),
        "turns": statistics.fmean(t.reward_info["turns"] for t in trajs) if trajs else 0.0,
        "tokens": statistics.fmean(int(t.loss_mask.numpy().sum()) for t in trajs) if trajs else 0,
        "clip": clipped / n,
        "episodes_per_s": len(trajs) / seconds,
        "replies": replies / n,
    }


def from_recipe(path: str) -> dict[str, Any]:
    from asyncrl.config.recipe import load_recipe

    recipe = load_recipe(path)
    r = recipe.rollout
    return {
        "system": r.agent.system_prompt or None,
        "temperature": r.sampling.temperature,
        "max_new_tokens": r.sampling.max_new_tokens,
        "max_turns": r.max_turns,
        "max_total_tokens": r.agent.max_total_tokens,
        "digits": tuple(recipe.data.digits),  # type: ignore[union-attr]
        "instruction": recipe.data.instruction,  # type: ignore[union-attr]
        "example": recipe.data.example,  # type: ignore[union-attr]
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--recipe", default=None, help="take the settings from this recipe")
    ap.add_argument("--system", default="none", help="a name in SYSTEM_PROMPTS, all, or text")
    ap.add_argument("--instruction", default=PRODUCTS_INSTRUCTION)
    ap.add_argument("--digits", default="3,4")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=12345, help="data seed (held out from runs)")
    ap.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-total-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--example",
        action="store_true",
        help="a solved exchange before each question (data.example)",
    )
    ap.add_argument("--show", type=int, default=0, help="print the first N episodes whole")
    ap.add_argument("--show-prompt", action="store_true", help="print what the model sees")
    ap.add_argument(
        "--tool-listing",
        nargs="+",
        choices=["template", "compact"],
        default=["template"],
        help="how the tools are shown (rollout.agent.tool_listing); several: each in turn",
    )
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    settings = {
        "system": None,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "max_turns": args.max_turns,
        "max_total_tokens": args.max_total_tokens,
        "digits": tuple(int(d) for d in re.split(r"[, ]+", args.digits)),
        "instruction": args.instruction.replace("\\n", "\n"),
        "example": args.example,
    }
    if args.recipe:
        settings.update(from_recipe(args.recipe))
        systems: dict[str, str | None] = {"recipe": settings["system"]}
    elif args.system == "all":
        systems = dict(SYSTEM_PROMPTS)
    elif args.system in SYSTEM_PROMPTS:
        systems = {args.system: SYSTEM_PROMPTS[args.system]}
    else:
        systems = {"given": args.system.replace("\\n", "\n")}
    records = products_records(
        args.prompts,
        seed=args.seed,
        digits=settings["digits"],
        instruction=settings["instruction"],
        example=settings["example"],
    )
    greedy = settings["temperature"] == 0
    sampling = SamplingParams(
        temperature=settings["temperature"],
        max_new_tokens=settings["max_new_tokens"],
        seed=0,
    )
    samples = 1 if greedy else args.samples

    async def run() -> None:
        async with HFEngine(
            resolve_model_path(args.model), HFEngineConfig(max_batch_size=64)
        ) as engine:
            for (name, system), listing in itertools.product(systems.items(), args.tool_listing):
                if args.show_prompt:
                    wf = AgentWorkflow(
                        engine.tokenizer,
                        sampling,
                        reward=MathScorer(),
                        tools=["calculator"],
                        system_prompt=system,
                        tool_listing=listing,
                    )
                    env = wf.env_factory()
                    start = await env.reset(records[0])
                    ids = wf.chat.prompt_ids(start.messages, start.tools, listing)
                    print(f"== prompt ({len(ids)} tokens):\n{engine.tokenizer.decode(ids)}")
                stats = await probe(
                    engine,
                    system,
                    records,
                    samples,
                    sampling,
                    settings["max_turns"],
                    settings["max_total_tokens"],
                    args.show,
                    listing,
                )
                line = " ".join(f"{k}={v:.3g}" for k, v in stats.items())
                print(
                    f"[{name}, {listing} listing] T={settings['temperature']} "
                    f"budget={settings['max_new_tokens']} digits={settings['digits']} {line}",
                    flush=True,
                )

    asyncio.run(run())


if __name__ == "__main__":
    main()
