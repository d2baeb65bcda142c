"""The recipe is the components' configuration: every component builds from every shipped
recipe, and a recipe validates exactly when every component accepts its section."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError
from train_helpers.tiny import one_torch_thread, tiny_config

from asyncrl.config.recipe import Recipe, RecipeError, load_recipe
from asyncrl.engines.config import EngineConfig
from asyncrl.models.resolve import TINY_NAME, ModelConfig, resolve_dtype
from asyncrl.models.tiny_vlm import IDEFICS3_NAME, QWEN2_5_VL_NAME, QWEN2_VL_NAME, TINY_VLMS
from asyncrl.models.vision import vision_family_offline
from asyncrl.train import TrainerConfig
from asyncrl.train.engine import TrainEngine

REPO = Path(__file__).resolve().parent.parent
RECIPES = [p for p in sorted((REPO / "recipes").glob("*.toml")) if "[sft]" not in p.read_text()]
"""The shipped GRPO recipes (SFT recipes, with an ``[sft]`` section, are tests/test_sft.py's)."""

OFFLINE_MODELS = {"smollm2-135m-instruct", TINY_NAME, *TINY_VLMS}
"""Models available without a download; any other ``model.path`` is replaced by the tiny
model of its kind (the model path only: every other key of the recipe is built as
written)."""
SHAPES_SIZE = 1000
"""A shapes task above this many records is built smaller: the held-out prompts it carves
out, plus half this many to train on."""
TINY_OF_FAMILY = {
    "qwen2_vl": QWEN2_VL_NAME,
    "qwen2_5_vl": QWEN2_5_VL_NAME,
    "idefics3": IDEFICS3_NAME,
}
"""The tiny vision-language model that stands in for a hub one of its family."""


def offline(path: Path, tmp_path: Path) -> tuple[Recipe, list[str]]:
    """The shipped recipe at ``path``, with the overrides that keep building it offline and
    off the GPU (returned, so that a test says what it replaced): the tiny model for a
    model that needs a download, a JSONL file of a few rows for a data file a user
    supplies or a hub dataset, a smaller shapes task than a GPU recipe's, the CPU for a
    trainer or engine on a CUDA device this machine lacks."""
    raw = load_recipe_raw(path)
    sets = [f"run.dir={tmp_path}"]
    model = raw.get("model", {}).get("path")
    if model not in OFFLINE_MODELS:
        family = vision_family_offline(model)
        sets.append(f"model.path={TINY_OF_FAMILY[family] if family else TINY_NAME}")
    for key, source in (("data", raw.get("data")), ("eval.data", raw.get("eval", {}).get("data"))):
        if not isinstance(source, dict) or source.get("type") not in ("jsonl", "hf"):
            continue
        if source["type"] == "jsonl" and Path(source["path"]).is_file():
            continue
        rows = tmp_path / f"{key}.jsonl"
        rows.write_text(
            "".join(
                json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                for i in range(600)
            )
        )
        if source["type"] == "hf":
            sets.append(f"{key}.type=jsonl")
        sets.append(f"{key}.path={json.dumps(str(rows))}")
    data = raw.get("data", {})
    if data.get("type") == "shapes" and data.get("size", 0) > SHAPES_SIZE:
        # its images are drawn as the records load, about 3 ms each: 20,000 took a minute
        held_out = raw.get("eval", {}).get("max_prompts", 64)
        sets.append(f"data.size={held_out + SHAPES_SIZE // 2}")
    for key, section in (("trainer", raw.get("trainer", {})), ("rollout.engine", engine(raw))):
        if section.get("device", "auto").startswith("cuda") and not torch.cuda.is_available():
            sets.append(f"{key}.device=cpu")
    return load_recipe(path, sets), sets


def engine(raw: dict[str, Any]) -> dict[str, Any]:
    section: dict[str, Any] = raw.get("rollout", {}).get("engine", {})
    return section


def load_recipe_raw(path: Path) -> dict[str, Any]:
    import tomllib

    return tomllib.loads(path.read_text())


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    with one_torch_thread():
        yield


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_component_builds_from_every_shipped_recipe(path: Path, tmp_path: Path) -> None:
    """Rollout engine (not started: a server engine starts no server), its workflow, the
    reward pool (not started), the prompt and held-out records, and the train engine,
    whose config is the recipe's trainer section itself."""
    from asyncrl.config.workflow import WorkflowParts
    from asyncrl.data import load_eval_records, load_prompt_records
    from asyncrl.engines import build_engine
    from asyncrl.models.resolve import load_tokenizer
    from asyncrl.rewards import build_reward_pool
    from asyncrl.train.engine import build_train_engine

    recipe, replaced = offline(path, tmp_path)
    hub = ["model.path", "data.type", "data.path", "eval.data.type", "eval.data.path"]
    # clevr_count draws its images offline; only its Qwen2.5-VL needs a download
    expected = {"gsm8k": hub, "clevr_count": ["model.path", "data.size"]}.get(
        path.stem.split("_8gpu")[0], []
    )
    assert [s.split("=")[0] for s in replaced[1:] if ".device=" not in s] == expected, (
        "only the gsm8k recipes name a model and data that need a download, clevr a model"
    )

    engine = build_engine(recipe)
    assert engine.config is recipe.rollout.engine  # type: ignore[attr-defined]
    reward = build_reward_pool(recipe)
    assert reward.size == recipe.reward.workers
    # the workflow reads the tokenizer that the engine loads when it starts
    started = SimpleNamespace(tokenizer=load_tokenizer(recipe.model.path))
    r = recipe.rollout
    # as the rollout actor does: offered the pool when the workflow scores inline
    pool = reward if r.workflow.scores_inline(r) else None
    r.workflow.build(r, WorkflowParts(started.tokenizer, r.sampling.params(), r.group_size, pool))
    assert load_prompt_records(recipe)
    if recipe.eval.every:
        assert len(load_eval_records(recipe)) == recipe.eval.max_prompts
    trainer = build_train_engine(recipe)
    assert trainer.config is recipe.trainer and trainer.model_config is recipe.model
    s = recipe.rollout.sampling
    assert (trainer.config.temperature, trainer.config.top_k, trainer.config.top_p) == (
        s.temperature,
        s.top_k,
        s.top_p,
    )
    assert trainer.param_dtype == getattr(torch, resolve_dtype(recipe.model.dtype, "cpu"))


# --- the property: the recipe accepts exactly what the components accept --------------------

KEYS: dict[str, st.SearchStrategy[Any]] = {
    "trainer.loss.eps_clip": st.floats(-0.5, 1.0),
    "trainer.loss.eps_clip_high": st.none() | st.floats(-0.5, 1.0),
    "trainer.loss.c_clip": st.none() | st.floats(0.0, 5.0),
    "trainer.loss.behav_imp_weight_cap": st.none() | st.floats(-1.0, 10.0),
    "trainer.loss.norm_len": st.none() | st.floats(-1.0, 64.0),
    "trainer.loss.kl_coef": st.floats(-0.1, 0.2),
    "trainer.loss.entropy_coef": st.floats(-0.1, 0.1),
    "trainer.loss.loss_agg": st.sampled_from(["token-mean", "seq-mean-token-sum-norm", "sum"]),
    "trainer.loss.proximal": st.sampled_from(["recompute", "behaviour", "old"]),
    "trainer.optim.lr": st.floats(-1e-3, 1e-2),
    "trainer.optim.weight_decay": st.floats(-0.1, 0.1),
    "trainer.optim.warmup_steps": st.integers(-2, 5),
    "trainer.optim.schedule": st.sampled_from(["constant", "cosine", "linear"]),
    "trainer.optim.min_lr_ratio": st.floats(-0.5, 1.5),
    "trainer.optim.grad_clip": st.none() | st.floats(-1.0, 2.0),
    "trainer.optim.betas": st.tuples(st.floats(-0.5, 1.5), st.floats(-0.5, 1.5)),
    "trainer.optim.adam_eps": st.floats(-1e-8, 1e-6),
    "trainer.max_steps": st.integers(-1, 30),
    "trainer.max_tokens_per_microbatch": st.integers(-4, 64),
    "trainer.lm_head_chunk_tokens": st.integers(-4, 64),
    "trainer.ppo_minibatches": st.integers(-1, 4),
    "trainer.device": st.sampled_from(["cpu", "auto", "gpu", "cuda:x"]),
    "trainer.reduce_dtype": st.sampled_from(["float32", "bfloat16", "int8"]),
    "trainer.attn_implementation": st.sampled_from(["asyncrl_varlen", "sdpa", "eager", "flash"]),
    "model.dtype": st.sampled_from(["float32", "bfloat16", "float64"]),
}
ENGINES: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "hf": {
        "max_batch_size": st.integers(-1, 64),
        "max_prefill_tokens": st.integers(-1, 9000),
        "prefix_cache_mb": st.integers(-1, 1024),
        "device": st.sampled_from(["cpu", "auto", "gpu"]),
    },
    "instant": {"response_tokens": st.integers(-1, 32)},
    "vllm": {
        "servers": st.integers(-1, 3),
        "ports": st.tuples(st.integers(0, 70000), st.integers(0, 70000)),
        "urls": st.sampled_from([[], ["http://h:1"], ["h:1"]]),
        "cpu_kvcache_gib": st.integers(-1, 4),
        "max_model_len": st.integers(-1, 4096),
        "retries": st.integers(-1, 3),
        "request_timeout": st.floats(-1.0, 10.0),
    },
    "sglang": {
        "servers": st.integers(-1, 3),
        "mem_fraction_static": st.none() | st.floats(-0.5, 1.5),
        "retry_backoff": st.floats(-1.0, 1.0),
    },
}


@st.composite
def recipe_values(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(sorted(KEYS)), unique=True, max_size=6))
    values = {k: draw(KEYS[k]) for k in keys}
    kind = draw(st.sampled_from(sorted(ENGINES)))
    engine = {"type": kind}
    for key in draw(st.lists(st.sampled_from(sorted(ENGINES[kind])), unique=True, max_size=3)):
        engine[key] = draw(ENGINES[kind][key])
    values["rollout.engine"] = engine
    return values


def as_sets(values: dict[str, Any]) -> list[str]:
    sets = ["model.path=tiny-random-llama"]
    for key, value in values.items():
        if key == "rollout.engine":
            sets += [f"rollout.engine.{k}={json.dumps(v)}" for k, v in value.items()]
        elif value is not None:  # None is TOML's absent key: the default
            sets.append(f"{key}={json.dumps(value)}")
    return sets


def section(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The nested section under ``prefix`` (``trainer``, ``model``) of the drawn values."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key.startswith(prefix + ".") and value is not None:
            *parents, leaf = key[len(prefix) + 1 :].split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
    return out


def components_accept(values: dict[str, Any], tmp_path: Path) -> bool:
    """Whether each component, given its own section as the recipe would, builds: the
    train engine (on random weights of the tiny architecture) and the inference engine
    (not started)."""
    from asyncrl.engines import BACKENDS

    try:
        trainer = TrainerConfig.model_validate(section(values, "trainer"))
        model = ModelConfig.model_validate({"path": TINY_NAME, **section(values, "model")})
        engine_cfg = TypeAdapter(EngineConfig).validate_python(values["rollout.engine"])
    except ValidationError:
        return False
    try:
        TrainEngine(trainer, model, architecture=tiny_config(num_hidden_layers=1))
    except (ValueError, RuntimeError):
        return False
    import importlib

    module, _, name = BACKENDS[engine_cfg.type].partition(":")
    cls = getattr(importlib.import_module(module), name)
    try:
        cls(model, engine_cfg)
    except ValueError:
        return False
    return True


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(values=recipe_values())
def test_the_recipe_accepts_exactly_what_every_component_accepts(
    values: dict[str, Any], tmp_path: Path
) -> None:
    try:
        load_recipe(None, as_sets(values))
        recipe_ok = True
    except RecipeError:
        recipe_ok = False
    assert recipe_ok == components_accept(values, tmp_path), values
    event("accepted" if recipe_ok else "refused")


def test_check_refuses_a_dual_clip_bound_below_one() -> None:
    """What the trainer refuses, ``asyncrl check`` refuses first, naming the key."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.entry.cli",
            "check",
            "--set",
            "trainer.loss.c_clip=0.5",
            str(REPO / "recipes" / "ci.toml"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "trainer.loss.c_clip" in out.stderr and "greater than 1" in out.stderr


def test_derived_trainer_values_are_no_recipe_keys() -> None:
    recipe = load_recipe(None, ["rollout.sampling.temperature=0.7", "rollout.sampling.top_k=5"])
    assert (recipe.trainer.temperature, recipe.trainer.top_k) == (0.7, 5)
    with pytest.raises(RecipeError, match=r"trainer\.temperature .*rollout\.sampling\.temperature"):
        load_recipe(None, ["trainer.temperature=0.5"])
    # the derived values are not written out, so a dumped recipe loads again
    from asyncrl.config.recipe import dump_recipe

    assert "temperature" not in dump_recipe(recipe).split("[trainer]")[1].split("[")[0]
