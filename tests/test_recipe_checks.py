"""Recipe combinations across sections that `asyncrl check` and `asyncrl up` refuse or
warn about, naming the keys; and the Dr.GRPO divisor the trainer resolves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config.checks import enforce_recipe, generation_budget, recipe_problems
from asyncrl.config.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parent.parent


def problems(*sets: str) -> tuple[list[str], list[str]]:
    return recipe_problems(load_recipe(None, list(sets)))


def test_defaults_and_shipped_recipes_have_no_problems() -> None:
    assert problems() == ([], [])
    for path in sorted((REPO / "recipes").glob("*.toml")):
        if "[sft]" not in path.read_text():  # SFT recipes: test_sft.py
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


def test_a_top_k_top_p_cut_is_fine_where_engine_and_trainer_agree_and_refused_on_sglang() -> None:
    for sampling in ("rollout.sampling.top_p=0.9", "rollout.sampling.top_k=20"):
        for engine in ("hf", "vllm"):
            assert problems(sampling, f"rollout.engine.type={engine}") == ([], [])
        errors, _ = problems(sampling, "rollout.engine.type=sglang")
        assert len(errors) == 1
        for key in ("rollout.engine.type", "top_p", "top_k", "before the cut"):
            assert key in errors[0], errors[0]


@pytest.mark.parametrize(
    ("kl_type", "kl_in", "refused"),
    [
        ("k1", "loss", True),
        ("k2", "loss", False),
        ("k3", "loss", False),
        ("k1", "reward", False),
        ("k2", "reward", True),
        ("k3", "reward", True),
    ],
)
def test_kl_placements_without_a_kl_gradient_are_refused(
    kl_type: str, kl_in: str, refused: bool
) -> None:
    sets = ["trainer.loss.kl_coef=0.1", f"trainer.loss.kl_type={kl_type}"]
    errors, _ = problems(*sets, f"trainer.loss.kl_in={kl_in}")
    if not refused:
        assert errors == []
        return
    assert len(errors) == 1
    assert "trainer.loss.kl_type" in errors[0] and "trainer.loss.kl_in" in errors[0]
    assert ('kl_in = "reward"' if kl_type == "k1" else 'kl_type = "k1"') in errors[0]
    # refused with the penalty off too: raising kl_coef later must not be the surprise
    assert len(problems(f"trainer.loss.kl_type={kl_type}", f"trainer.loss.kl_in={kl_in}")[0]) == 1


def test_k3_in_the_loss_warns_that_its_gradient_is_the_reverse_kl() -> None:
    errors, warnings = problems("trainer.loss.kl_coef=0.1", "trainer.loss.kl_type=k3")
    assert errors == [] and any("KL(π_ref ‖ π)" in w for w in warnings)
    assert problems("trainer.loss.kl_coef=0.1") == ([], [])  # the default, k2 in the loss


def test_check_refuses_k1_in_the_loss_naming_both_keys_and_the_fix() -> None:
    cmd = [sys.executable, "-m", "asyncrl.entry.cli", "check"]
    for key in ("kl_type=k1", "kl_in=loss"):
        cmd += ["--set", f"trainer.loss.{key}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 2
    assert "trainer.loss.kl_type" in out.stderr and "trainer.loss.kl_in" in out.stderr
    assert 'set kl_in = "reward"' in out.stderr


def test_update_every_prints_the_effective_staleness_bound() -> None:
    assert problems("trainer.update_every=1") == ([], [])
    errors, warnings = problems("buffer.max_head_offpolicyness=2", "trainer.update_every=3")
    assert errors == [] and len(warnings) == 1
    assert "trainer.update_every = 3" in warnings[0]
    assert "buffer.max_head_offpolicyness = 2" in warnings[0]
    assert "η + k − 1 = 4" in warnings[0]


def test_colocation_needs_an_engine_that_can_release_its_memory() -> None:
    errors, _ = problems("rollout.colocate=true", "rollout.engine.type=vllm")
    assert len(errors) == 1 and "rollout.colocate" in errors[0] and "vllm" in errors[0]
    for engine in ("hf", "sglang"):
        assert problems("rollout.colocate=true", f"rollout.engine.type={engine}") == ([], [])


def test_deterministic_rollouts_are_refused_where_they_cannot_hold(tmp_path: Path) -> None:
    det, sync = "rollout.deterministic=true", "buffer.max_head_offpolicyness=0"
    assert problems(det, sync) == ([], [])
    assert problems(det, sync, "rollout.engine.type=instant")[0] == []
    for engine in ("vllm", "sglang"):
        (error,), _ = problems(det, sync, f"rollout.engine.type={engine}")
        assert f'rollout.deterministic = true with rollout.engine.type = "{engine}"' in error
        assert "batch" in error and 'use "hf"' in error
    code = tmp_path / "wf.py"
    code.write_text(
        "async def agent(client, data):\n    return 0.0\n\n\n"
        "async def episode(engine, item):\n    return None\n"
    )
    (error,), _ = problems(det, sync, f"rollout.workflow={code}:agent")
    assert "rollout.deterministic = true with rollout.workflow" in error
    assert "cannot be seeded" in error
    errors, (warning,) = problems(det, sync, f"rollout.workflow={code}:episode")
    assert errors == [] and "sample_seed" in warning
    errors, (warning,) = problems(det)  # η = 2 by default
    assert errors == [] and "buffer.max_head_offpolicyness = 2" in warning
    assert "only η = 0" in warning
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.entry.cli", "check", "--set", det, "--set",
         "rollout.engine.type=vllm"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and "rollout.deterministic = true" in out.stderr


def test_check_and_up_refuse_before_anything_starts(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "asyncrl.entry.cli", "check", "--set", "rollout.group_size=1"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 2
    assert "rollout.group_size = 1" in out.stderr and "adv_std_level" in out.stderr
    warn = subprocess.run(
        [sys.executable, "-m", "asyncrl.entry.cli", "check", "--set", "rollout.actors=0"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "warning: rollout.actors = 0" in warn.stderr and "[rollout]" in warn.stdout

    from asyncrl.launch.up import up

    recipe = load_recipe(None, [f"run.dir={tmp_path}", "run.name=bad", "rollout.group_size=1"])
    with pytest.raises(RecipeError, match=r"rollout\.group_size"):
        up(recipe)
    assert not (tmp_path / "bad").exists(), "a run folder was created for a bad recipe"
    with pytest.raises(RecipeError, match=r"buffer\.dynamic_filter"):
        enforce_recipe(load_recipe(None, ["rollout.group_size=1", "buffer.dynamic_filter=true"]))


def test_dr_grpo_divides_by_the_generation_budget() -> None:
    from asyncrl.train.engine import build_train_engine

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


def test_new_loss_and_sampling_keys_reach_the_train_engine() -> None:
    from asyncrl.train.engine import build_train_engine

    recipe = load_recipe(
        None,
        [
            "model.path=tiny-random-llama",
            "trainer.device=cpu",
            "trainer.loss.kl_coef=0.05",
            "trainer.loss.kl_type=k1",
            "trainer.loss.kl_in=reward",
            "trainer.loss.entropy_coef=0.01",
            "rollout.sampling.top_k=20",
            "rollout.sampling.top_p=0.95",
        ],
    )
    assert recipe_problems(recipe) == ([], [])
    config = build_train_engine(recipe).config
    assert config is recipe.trainer  # one truth: the engine's config is the trainer section
    assert (config.loss.kl_in, config.loss.entropy_coef) == ("reward", 0.01)
    assert (config.top_k, config.top_p) == (20, 0.95)


def test_one_gpu_for_several_trainer_ranks_is_refused() -> None:
    errors, _ = problems("trainer.nproc=2", "trainer.device=cuda:1")
    assert any("trainer.device" in e and "trainer.nproc" in e for e in errors)
    assert problems("trainer.nproc=2", "trainer.device=cuda") == ([], [])


def test_trainer_nodes_that_cannot_start_are_refused() -> None:
    errors, _ = problems('trainer.rendezvous="h:29500"')
    assert any("trainer.rendezvous" in e and "trainer.nodes = 1" in e for e in errors)
    errors, _ = problems("trainer.nodes=2", "trainer.device=cuda")
    assert any("same GPUs" in e and "trainer.nproc" in e for e in errors)
    errors, _ = problems("trainer.nodes=2", 'trainer.rendezvous="h:29500"', "trainer.device=cuda:0")
    assert any("cuda:LOCAL_RANK" in e for e in errors)
    assert problems("trainer.nodes=2", 'trainer.rendezvous="h:29500"', "trainer.device=cuda") == (
        [],
        [],
    )
    assert problems("trainer.nodes=2", "trainer.device=cpu") == ([], [])
    with pytest.raises(RecipeError, match=r"trainer\.rendezvous"):
        load_recipe(None, ['trainer.rendezvous="h"'])


def test_a_gguf_file_the_rollout_engines_do_not_read_is_warned_about() -> None:
    _, warnings = problems("model.gguf_file=m.gguf")
    assert any("model.gguf_file" in w and "trainer only" in w for w in warnings)


def test_a_tf32_head_on_the_cpu_is_warned_about() -> None:
    _, warnings = problems('trainer.lm_head_precision="tf32"', "trainer.device=cpu")
    assert any("trainer.lm_head_precision" in w and "float32" in w for w in warnings)
    for sets in (['trainer.lm_head_precision="tf32"'], ["trainer.device=cpu"]):
        assert not any("lm_head_precision" in w for w in problems(*sets)[1])


def test_roles_whose_thread_pools_share_cores_are_warned_about() -> None:
    both = ("rollout.cpus=[0,1]", "trainer.cpus=[0,1]", "trainer.device=cpu")
    _, warnings = problems(*both, "rollout.threads=2")
    (w,) = warnings
    assert w.startswith("rollout.cpus and trainer.cpus share cores [0, 1], where rollout runs 2")
    assert "rollout.threads = 1" in w
    # threads unset: a pinned process's torch default is a thread per core
    assert len(problems(*both)[1]) == 1
    # one side single-threaded (the 2-core default: generation's one thread), or disjoint
    assert problems(*both, "rollout.threads=1")[1] == []
    assert problems("rollout.cpus=[0]", "trainer.cpus=[1]", "trainer.device=cpu")[1] == []
    # an eval pool beside the rollout actor's: the advice is for eval, the occasional one
    _, warnings = problems("rollout.cpus=[0,1]", "eval.cpus=[0,1]", "eval.every=4")
    assert len(warnings) == 1 and "eval.threads = 1" in warnings[0], warnings
    assert problems("rollout.cpus=[0,1]", "eval.cpus=[0,1]", "eval.every=0")[1] == []
    # a trainer on a GPU shares no CPU thread pool
    assert problems(*both[:2], "trainer.device=cuda", "rollout.threads=2")[1] == []
