"""What the actors build from a recipe: engines, workflows, records.

Heavy imports (torch, transformers) happen inside the functions, so an actor module
loads quickly and only the roles that need a model pay for one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import Recipe
    from asyncrl.messages import Trajectory


def load_prompt_records(recipe: Recipe) -> list[dict[str, Any]]:
    """The records the buffer leases: the run's data minus the held-out split."""
    from asyncrl.data import load_records

    records = load_records(recipe.data, seed=recipe.run.seed)
    held_out = set(held_out_indices(recipe, len(records)))
    return [r for i, r in enumerate(records) if i not in held_out]


def held_out_indices(recipe: Recipe, n_records: int) -> list[int]:
    """Indices of the run's records set aside for evaluation: ``eval.max_prompts`` of them,
    drawn by a seeded permutation (the same on every process and on resume), or none when
    evaluation is off or reads its own ``eval.data``."""
    import random

    cfg = recipe.eval
    if not cfg.every or cfg.data is not None:
        return []
    if n_records <= cfg.max_prompts:
        raise ValueError(
            f"eval.max_prompts={cfg.max_prompts} would hold out all {n_records} records: "
            f"set eval.max_prompts lower or give eval.data"
        )
    order = list(range(n_records))
    random.Random(f"heldout/{recipe.run.seed}").shuffle(order)
    return sorted(order[: cfg.max_prompts])


def load_eval_records(recipe: Recipe) -> list[dict[str, Any]]:
    """The held-out prompts: ``eval.data`` (its first ``max_prompts``), or the split that
    :func:`load_prompt_records` leaves out."""
    from asyncrl.data import load_records

    cfg = recipe.eval
    if cfg.data is not None:
        return load_records(cfg.data, seed=recipe.run.seed)[: cfg.max_prompts]
    records = load_records(recipe.data, seed=recipe.run.seed)
    return [records[i] for i in held_out_indices(recipe, len(records))]


def eval_sampling_params(recipe: Recipe, *, greedy: bool) -> Any:
    from asyncrl.engines.base import SamplingParams

    cfg, s = recipe.eval, recipe.rollout.sampling
    budget = cfg.max_new_tokens or s.max_new_tokens
    if greedy:
        return SamplingParams(temperature=0.0, max_new_tokens=budget)
    return SamplingParams(
        temperature=cfg.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=budget
    )


def sampling_params(recipe: Recipe) -> Any:
    from asyncrl.engines.base import SamplingParams

    s = recipe.rollout.sampling
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens
    )


def build_engine(recipe: Recipe) -> Any:
    """The rollout engine (not started)."""
    cfg = recipe.rollout.engine
    if cfg.type == "instant":
        from asyncrl.engines.instant import InstantEngine

        return InstantEngine(response_tokens=cfg.response_tokens)
    if cfg.type != "hf":
        return build_server_engine(recipe)
    from asyncrl.engines.hf import HFEngine

    return HFEngine(
        recipe.model.path,
        dtype=recipe.model.dtype,
        device=resolve_device(cfg.device),
        max_batch_size=cfg.max_batch_size,
        memory_saver=recipe.rollout.colocate and _has_memory_saver(),
    )


def build_server_engine(recipe: Recipe) -> Any:
    """A ``vllm`` or ``sglang`` engine: its servers are started (or joined) by ``start()``,
    their logs go to ``<run>/logs``."""
    cfg = recipe.rollout.engine
    assert cfg.type in ("vllm", "sglang")
    options: dict[str, Any] = {
        "urls": cfg.urls,
        "command": cfg.command,
        "args": cfg.args,
        "env": cfg.env,
        "servers": cfg.servers,
        "host": cfg.host,
        "ports": cfg.ports,
        "dtype": recipe.model.dtype,
        "startup_timeout": cfg.startup_timeout,
        "request_timeout": cfg.request_timeout,
        "retries": cfg.retries,
        "retry_backoff": cfg.retry_backoff,
        "log_dir": recipe.run.path / "logs",
    }
    if cfg.type == "vllm":
        from asyncrl.engines.vllm import VLLMEngine

        return VLLMEngine(
            recipe.model.path,
            python=cfg.python,
            cpu_kvcache_gib=cfg.cpu_kvcache_gib,
            cpu_threads_bind=cfg.cpu_threads_bind,
            max_model_len=cfg.max_model_len,
            **options,
        )
    from asyncrl.engines.sglang import SGLangEngine

    return SGLangEngine(
        recipe.model.path,
        memory_saver=recipe.rollout.colocate,
        mem_fraction_static=cfg.mem_fraction_static,
        **options,
    )


def _has_memory_saver() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_memory_saver") is not None


def resolve_device(choice: str) -> str:
    """``auto`` becomes ``cuda`` when a CUDA device is visible, else ``cpu``."""
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_reward_pool(recipe: Recipe) -> Any:
    """The reward function of the recipe in worker processes (not started)."""
    from asyncrl.rewards import RewardPool

    cfg = recipe.reward
    return RewardPool(cfg.fn, workers=cfg.workers, timeout=cfg.timeout)


def build_workflow(
    recipe: Recipe,
    engine: Any,
    reward: Any = None,
    *,
    endpoint: Any = None,
    tools: Sequence[Any] | None = None,
) -> Any:
    """The recipe's workflow. ``reward`` (a started reward pool) is offered to workflows
    that score inline; the built-in ``rlvr`` never gets it, because in a run its samples
    are scored by the reward actors. ``endpoint`` (the actor's started
    :class:`~asyncrl.endpoint.OpenAIEndpoint`, or None) is what agent code runs through,
    and is offered to a user's workflow factory too. ``tools`` (the ``agent`` workflow's,
    MCP tools included) default to :func:`build_agent_tools`."""
    from asyncrl.endpoint import OpenAIAgentWorkflow
    from asyncrl.workflows import make_workflow
    from asyncrl.workflows.loader import load_callable

    r = recipe.rollout
    options: dict[str, Any] = {
        "tokenizer": engine.tokenizer,
        "sampling": sampling_params(recipe),
        "group_size": r.group_size,
        "max_turns": r.max_turns,
        "turn_discount": r.turn_discount,
    }
    if endpoint is not None:
        options["endpoint"] = endpoint
    if r.workflow.startswith("verifiers:"):
        options["env_args"] = dict(r.agent.env_args)
    if r.workflow != "rlvr" and reward is not None:
        options["reward"] = reward
    if r.workflow == "agent":
        agent = r.agent
        options.update(
            max_total_tokens=agent.max_total_tokens,
            tool_parser=agent.parser,
            system_prompt=agent.system_prompt or None,
        )
        if agent.env:
            options["env_factory"] = load_callable(agent.env)
        else:
            options["tools"] = list(tools) if tools is not None else build_agent_tools(recipe)
    workflow = make_workflow(r.workflow, **options)
    if isinstance(workflow, OpenAIAgentWorkflow) and r.endpoint_record:
        workflow.record_path = recipe.run.path / ENDPOINT_CALLS
    return workflow


ENDPOINT_CALLS = "endpoint_calls.jsonl"
"""Where ``rollout.endpoint_record`` appends the calls of agent code's episodes."""


def build_agent_tools(recipe: Recipe) -> list[Any]:
    """The tools ``rollout.agent.tools`` names (MCP servers' tools come apart, from
    :func:`mcp_server_specs`), each under ``rollout.agent.tool_timeout``. Raises
    ``ValueError`` naming the key for a name that is no built-in tool and a spec that does
    not load or cannot be a tool."""
    from asyncrl.tools.base import function_tool
    from asyncrl.tools.builtin import BUILTIN_TOOLS, calculator_tool, python_tool
    from asyncrl.tools.sandbox import Limits
    from asyncrl.workflows.loader import SpecError, load_callable

    cfg = recipe.rollout.agent
    tools = []
    for i, name in enumerate(cfg.tools):
        key = f"rollout.agent.tools[{i}] = {name!r}"
        if name == "calculator":
            tools.append(calculator_tool(timeout_s=cfg.tool_timeout))
        elif name == "python":
            tools.append(python_tool(Limits(wall_s=cfg.tool_timeout)))
        elif ":" in name:
            try:
                fn = load_callable(name)
                tools.append(function_tool(fn, timeout_s=cfg.tool_timeout))
            except (SpecError, TypeError, ValueError) as exc:
                raise ValueError(f"{key}: {exc}") from exc
        else:
            raise ValueError(
                f"{key} is no built-in tool ({', '.join(sorted(BUILTIN_TOOLS))}) nor a "
                "path/to/file.py:fn or module:fn"
            )
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        raise ValueError(f"rollout.agent.tools: two tools share a name: {names}")
    return tools


def mcp_server_specs(recipe: Recipe) -> list[Any]:
    """``rollout.agent.mcp`` as :class:`~asyncrl.tools.mcp.MCPServerSpec`, each call
    under ``rollout.agent.tool_timeout``."""
    from asyncrl.tools.mcp import MCPServerSpec

    cfg = recipe.rollout.agent
    return [
        MCPServerSpec(s.command, list(s.args), dict(s.env), timeout_s=cfg.tool_timeout)
        for s in cfg.mcp
    ]


def _agent_code(recipe: Recipe) -> bool:
    """Whether the workflow is agent code; a spec that does not load is not (building the
    workflow then says why)."""
    from asyncrl.workflows import is_agent_code

    try:
        return is_agent_code(recipe.rollout.workflow)
    except Exception:
        return False


def endpoint_wanted(recipe: Recipe) -> bool:
    """Whether each rollout actor serves the endpoint: ``rollout.endpoint``, or when it is
    unset, whether the workflow is agent code."""
    if recipe.rollout.endpoint is not None:
        return recipe.rollout.endpoint
    return _agent_code(recipe)


def workflow_scores_inline(recipe: Recipe) -> bool:
    """Whether the rollout actor needs its own reward pool for the workflow: not for
    ``rlvr`` (the reward actors score it), agent code (it returns its reward) or an
    ``agent`` workflow whose environment scores."""
    r = recipe.rollout
    if r.workflow == "rlvr" or (r.workflow == "agent" and r.agent.env):
        return False
    return not _agent_code(recipe)


def build_train_engine(recipe: Recipe) -> Any:
    """The FSDP train engine; joins the torchrun process group first when there is one."""
    import torch.distributed as dist

    from asyncrl.checks import generation_budget
    from asyncrl.models import resolve_model_path
    from asyncrl.train import LossConfig, TrainConfig, TrainEngine

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if recipe.trainer.device == "cuda" else "gloo"
        dist.init_process_group(backend)
    t, loss = recipe.trainer, recipe.trainer.loss
    norm_len = None
    if loss.loss_agg == "seq-mean-token-sum-norm":
        # Dr.GRPO divides by a constant, the generation budget: a batch-dependent divisor
        # (the longest answer) would bring back the length bias the variant removes.
        norm_len = float(loss.norm_len or generation_budget(recipe))
    config = TrainConfig(
        model=resolve_model_path(recipe.model.path),
        seed=recipe.run.seed,
        device=t.device,
        param_dtype=recipe.model.dtype,
        gradient_checkpointing=t.gradient_checkpointing,
        max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        temperature=recipe.rollout.sampling.temperature,
        top_k=recipe.rollout.sampling.top_k,
        top_p=recipe.rollout.sampling.top_p,
        lr=t.optim.lr,
        weight_decay=t.optim.weight_decay,
        warmup_steps=t.optim.warmup_steps,
        lr_schedule=t.optim.schedule,
        total_steps=t.max_steps if t.optim.schedule == "cosine" else None,
        max_grad_norm=t.optim.grad_clip,
        ppo_minibatches=t.ppo_minibatches,
        loss=LossConfig(
            eps_clip=loss.eps_clip,
            eps_clip_high=loss.eps_clip_high,
            c_clip=loss.c_clip,
            behav_imp_weight_cap=loss.behav_imp_weight_cap,
            importance_sampling_level=loss.importance_sampling_level,
            loss_agg=loss.loss_agg,
            norm_len=norm_len,
            kl_coef=loss.kl_coef,
            kl_type=loss.kl_type,
            kl_in=loss.kl_in,
            entropy_coef=loss.entropy_coef,
            recompute_proximal=loss.proximal == "recompute",
        ),
    )
    return TrainEngine(config)


def shaped_rewards(trajectories: Sequence[Trajectory], recipe: Recipe) -> list[float]:
    """The rewards the trainer's advantages use (``trainer.shaping`` applied to each
    sample's reward and generated length); the buffer's dynamic filter judges groups on
    the same numbers. Imports no torch."""
    from asyncrl.algo.shaping import shaped_rewards as shape
    from asyncrl.checks import generation_budget

    s = recipe.trainer.shaping
    return shape(
        [float(t.reward or 0.0) for t in trajectories],
        [int(t.loss_mask.numpy().sum()) for t in trajectories],
        max_len=generation_budget(recipe),
        overlong_buffer=s.overlong_buffer,
        overlong_penalty_at_max=s.overlong_penalty,
        scale=s.scale,
        bias=s.bias,
        clip=s.clip,
    )
