"""Recipe combinations across sections that `asyncrl check` and `asyncrl up` refuse or
warn about, naming the keys; and the Dr.GRPO divisor the trainer resolves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.checks import enforce_recipe, generation_budget, recipe_problems
from asyncrl.config import RecipeError, load_recipe

REPO = Path(__file__).resolve().parent.parent


def problems(*sets: str) -> tuple[list[str], list[str]]:
    return recipe_problems(load_recipe(None, list(sets)))


def test_defaults_and_shipped_recipes_have_no_problems() -> None:
    assert problems() == ([], [])
    for path in sorted((REPO / "recipes").glob("*.toml")):
        if path.name != "gsm8k.toml":  # names a GSM8K path that a user supplies
            assert recipe_problems(load_recipe(path)) == ([], []), path.name


@pytest.mark.parametrize(
    ("sets", "keys"),
    [
        (["trainer.loss.adv_std_level=group"], ["trainer.loss.adv_std_level"]),
        (
            ["trainer.loss.adv_std_level=none", "trainer.loss.leave_one_out=true"],
            ["trainer.loss.leave_one_out"],
        ),
        (
            ["trainer.loss.adv_std_level=batch", "buffer.dynamic_filter=true"],
            ["buffer.dynamic_filter"],
        ),
        (["trainer.loss.adv_std_level=none"], ["advantage 0"]),
    ],
    ids=["group-std", "rloo", "dynamic-filter", "dr-grpo"],
)
def test_group_size_one_is_refused_with_the_reason(sets: list[str], keys: list[str]) -> None:
    errors, _ = problems("rollout.group_size=1", *sets)
    assert len(errors) == 1
    assert "rollout.group_size = 1" in errors[0]
    assert all(k in errors[0] for k in keys), errors


def test_norm_len_below_the_budget_is_refused_and_ignored_is_warned() -> None:
    agg = "trainer.loss.loss_agg=seq-mean-token-sum-norm"
    errors, _ = problems(agg, "rollout.sampling.max_new_tokens=64", "trainer.loss.norm_len=32")
    assert len(errors) == 1
    assert "trainer.loss.norm_len" in errors[0] and "max_new_tokens" in errors[0]
    assert problems(agg, "rollout.sampling.max_new_tokens=64", "trainer.loss.norm_len=64") == (
        [],
        [],
    )
    # multi_turn generates up to max_new_tokens per turn
    errors, _ = problems(
        agg,
        "rollout.workflow=multi_turn",
        "rollout.max_turns=3",
        "rollout.sampling.max_new_tokens=64",
        "trainer.loss.norm_len=100",
    )
    assert errors and "192" in errors[0]
    errors, warnings = problems("trainer.loss.norm_len=500")
    assert errors == [] and len(warnings) == 1
    assert "trainer.loss.norm_len" in warnings[0] and "token-mean" in warnings[0]


def test_other_combinations() -> None:
    errors, _ = problems("buffer.batch_size=2", "rollout.group_size=4", "trainer.ppo_minibatches=9")
    assert len(errors) == 1 and "trainer.ppo_minibatches" in errors[0]
    errors, _ = problems("rollout.sampling.max_new_tokens=16", "trainer.shaping.overlong_buffer=17")
    assert len(errors) == 1 and "trainer.shaping.overlong_buffer" in errors[0]
    _, warnings = problems("rollout.actors=0", "reward.actors=0")
    assert len(warnings) == 2
    assert "rollout.actors = 0" in warnings[0] and "asyncrl attach rollout" in warnings[0]
    assert "reward.actors = 0" in warnings[1] and "asyncrl attach reward" in warnings[1]
    for sampling in ("rollout.sampling.top_p=0.9", "rollout.sampling.top_k=20"):
        errors, warnings = problems(sampling)
        assert errors == [] and len(warnings) == 1
        assert "top_p" in warnings[0] and "untruncated" in warnings[0]


def test_colocation_needs_an_engine_that_can_release_its_memory() -> None:
    errors, _ = problems("rollout.colocate=true", "rollout.engine.type=vllm")
    assert len(errors) == 1 and "rollout.colocate" in errors[0] and "vllm" in errors[0]
    for engine in ("hf", "sglang"):
        assert problems("rollout.colocate=true", f"rollout.engine.type={engine}") == ([], [])


def test_check_and_up_refuse_before_anything_starts(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "asyncrl.cli", "check", "--set", "rollout.group_size=1"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 2
    assert "rollout.group_size = 1" in out.stderr and "adv_std_level" in out.stderr
    warn = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "check", "--set", "rollout.actors=0"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "warning: rollout.actors = 0" in warn.stderr and "[rollout]" in warn.stdout

    from asyncrl.up import up

    recipe = load_recipe(None, [f"run.dir={tmp_path}", "run.name=bad", "rollout.group_size=1"])
    with pytest.raises(RecipeError, match=r"rollout\.group_size"):
        up(recipe)
    assert not (tmp_path / "bad").exists(), "a run folder was created for a bad recipe"
    with pytest.raises(RecipeError, match=r"buffer\.dynamic_filter"):
        enforce_recipe(load_recipe(None, ["rollout.group_size=1", "buffer.dynamic_filter=true"]))


def test_dr_grpo_divides_by_the_generation_budget() -> None:
    from asyncrl.actors.common import build_train_engine

    sets = [
        "model.path=tiny-random-llama",
        "trainer.device=cpu",
        "trainer.loss.loss_agg=seq-mean-token-sum-norm",
        "rollout.sampling.max_new_tokens=48",
    ]
    recipe = load_recipe(None, sets)
    assert generation_budget(recipe) == 48
    engine = build_train_engine(recipe)
    assert engine.config.loss.norm_len == 48.0
    assert engine.ref_module is None
    recipe = load_recipe(
        None,
        [*sets, "trainer.loss.norm_len=64", "trainer.loss.kl_coef=0.05", "trainer.loss.kl_type=k2"],
    )
    engine = build_train_engine(recipe)
    assert engine.config.loss.norm_len == 64.0
    assert (engine.config.loss.kl_coef, engine.config.loss.kl_type) == (0.05, "k2")
    assert engine.ref_module is not None
    token_mean = build_train_engine(load_recipe(None, sets[:2]))
    assert token_mean.config.loss.norm_len is None
