"""The recipe's engine union: each engine section holds only its own keys, and the server
engines reach ``build_engine`` with what they need."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config.recipe import RecipeError, dump_recipe, load_recipe
from asyncrl.models.resolve import resolve_dtype

QUICKSTART = "recipes/quickstart.toml"


def test_the_one_line_switch_to_vllm_gives_vllm_defaults() -> None:
    recipe = load_recipe(QUICKSTART, ["rollout.engine.type=vllm"])
    engine = recipe.rollout.engine
    assert engine.type == "vllm"
    assert engine.python == ".venv-vllm/bin/python" and engine.servers == 1
    assert engine.urls == [] and engine.ports == (31000, 31999)


def test_an_engine_key_without_a_type_means_the_default_hf_engine() -> None:
    recipe = load_recipe(QUICKSTART, ["rollout.engine.max_batch_size=4"])
    assert recipe.rollout.engine.type == "hf" and recipe.rollout.engine.max_batch_size == 4


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (["rollout.engine.type=vllm", "rollout.engine.max_batch_size=8"], "max_batch_size"),
        (["rollout.engine.type=sglang", "rollout.engine.cpu_kvcache_gib=4"], "cpu_kvcache_gib"),
        (["rollout.engine.urls=['http://a:1']"], "urls"),  # hf has no servers
        (["rollout.engine.type=vllm", "rollout.engine.ports=[9,3]"], "ports"),
        (["rollout.engine.type=sglang", "rollout.engine.urls=['a:1']"], "urls"),
        (["rollout.engine.type=trt"], "type"),
    ],
)
def test_a_key_of_another_engine_or_a_bad_value_fails_naming_it(sets: list[str], key: str) -> None:
    with pytest.raises(RecipeError, match=key):
        load_recipe(QUICKSTART, sets)


def test_server_engines_are_built_with_model_logs_and_options(tmp_path: Path) -> None:
    from asyncrl.engines import build_engine
    from asyncrl.engines.sglang import SGLangEngine
    from asyncrl.engines.vllm import VLLMEngine

    base = [f"run.dir={tmp_path}", "run.name=r"]
    vllm = build_engine(
        load_recipe(
            QUICKSTART,
            [*base, "rollout.engine.type=vllm", "rollout.engine.urls=['http://h:1/']"],
        )
    )
    assert isinstance(vllm, VLLMEngine)
    assert vllm.urls == ["http://h:1"] and vllm.model_spec == "smollm2-135m-instruct"
    # the quickstart's "auto" resolved for a server started on this machine's CPU
    assert vllm.log_dir == tmp_path / "r" / "logs" and vllm.dtype == resolve_dtype("auto", "cpu")
    sglang = build_engine(
        load_recipe(
            QUICKSTART,
            [
                *base,
                "rollout.engine.type=sglang",
                "rollout.colocate=true",
                "rollout.engine.servers=2",
            ],
        )
    )
    assert isinstance(sglang, SGLangEngine) and sglang.memory_saver and sglang.n_servers == 2
    sglang.model_path = "/m"
    argv = sglang.server_argv(4321)
    assert argv[argv.index("--port") + 1] == "4321" and "--enable-memory-saver" in argv


def test_engine_sections_round_trip(tmp_path: Path) -> None:
    recipe = load_recipe(QUICKSTART, ["rollout.engine.type=vllm", "rollout.engine.args=['--x']"])
    path = tmp_path / "r.toml"
    path.write_text(dump_recipe(recipe))
    assert load_recipe(str(path)).rollout.engine == recipe.rollout.engine
