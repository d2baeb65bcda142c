"""Images in a recipe: which models count as vision models (without a download), what
``check`` refuses for image prompts (each line naming its keys), the recipes that ship
(ci_vlm, clevr_count), and the prompt records' images as the rlvr workflow reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config.checks import recipe_problems, vision_problems
from asyncrl.config.recipe import image_field, load_recipe, path_problems
from asyncrl.models.resolve import resolve_model_path
from asyncrl.models.vision import record_images, vision_family_offline, with_images

REPO = Path(__file__).resolve().parent.parent
CI_VLM = REPO / "recipes" / "ci_vlm.toml"
CLEVR = REPO / "recipes" / "clevr_count.toml"


@pytest.mark.parametrize(
    ("spec", "family"),
    [
        ("tiny-random-qwen2-vl", "qwen2_vl"),
        ("tiny-random-qwen2.5-vl", "qwen2_5_vl"),
        ("tiny-random-idefics3", "idefics3"),
        ("Qwen/Qwen2.5-VL-3B-Instruct", "qwen2_5_vl"),
        ("Qwen/Qwen2-VL-2B-Instruct", "qwen2_vl"),
        ("HuggingFaceTB/SmolVLM-256M-Instruct", "idefics3"),
        ("Qwen/Qwen2.5-1.5B-Instruct", None),
        ("tiny-random-llama", None),
        ("smollm2-135m-instruct", None),
    ],
)
def test_vision_family_offline_by_name(spec: str, family: str | None) -> None:
    assert vision_family_offline(spec) == family


def test_vision_family_offline_of_a_local_folder_reads_its_config(tmp_path: Path) -> None:
    assert vision_family_offline(resolve_model_path("tiny-random-qwen2-vl")) == "qwen2_vl"
    assert vision_family_offline(resolve_model_path("tiny-random-llama")) is None
    folder = tmp_path / "my-model"  # a name that says nothing: the config decides
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "idefics3"}))
    assert vision_family_offline(str(folder)) == "idefics3"


def test_vision_model_type_of_a_hub_id_reads_its_cached_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fine-tune whose name says nothing is known by its config in the hub cache, where
    a run that downloaded it left it; nothing is fetched."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert vision_family_offline("org/clevr-grpo") is None  # not cached: by its name
    repo = tmp_path / "models--org--clevr-grpo"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    config = {"model_type": "qwen2_5_vl"}
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(config))
    assert vision_family_offline("org/clevr-grpo") == "qwen2_5_vl"


def test_record_images_and_the_chat_that_holds_them() -> None:
    assert record_images({"prompt": "x"}, "image") == []
    assert record_images({"prompt": "x", "image": "/a.png"}, None) == []
    assert record_images({"image": "/a.png"}, "image") == ["/a.png"]
    assert record_images({"img": ["/a.png", "/b.png"]}, "img") == ["/a.png", "/b.png"]
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "How many?"}]
    assert with_images(chat, 2) == [
        {"role": "system", "content": "s"},
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "image"},
                {"type": "text", "text": "How many?"},
            ],
        },
    ]
    assert chat[1]["content"] == "How many?"  # the record's chat is left as it was
    with pytest.raises(ValueError, match="user turn"):
        with_images([{"role": "system", "content": "s"}], 1)


def test_the_ci_vlm_recipe_passes_and_what_check_refuses_for_images() -> None:
    recipe = load_recipe(CI_VLM)
    assert image_field(recipe.data) == "image"
    assert vision_problems(recipe) == []
    errors, _ = recipe_problems(recipe)
    assert errors == []
    text = load_recipe(CI_VLM, ["model.path=tiny-random-llama"])
    (line,) = vision_problems(text)
    assert "model.path = 'tiny-random-llama' is not a vision model" in line
    assert line.startswith("data (field 'image') names images")
    for engine, why in (("sglang", "SGLang's CPU server"), ("vllm", "without their images")):
        (line,) = vision_problems(load_recipe(CI_VLM, [f"rollout.engine.type={engine}"]))
        assert f'rollout.engine.type = "{engine}"' in line and why in line
    (line,) = vision_problems(load_recipe(CI_VLM, ["rollout.workflow=multi_turn"]))
    assert "rollout.workflow = 'multi_turn'" in line
    (line,) = vision_problems(load_recipe(CI_VLM, ["trainer.nproc=2"]))
    assert "trainer.nproc × trainer.nodes = 2 ranks" in line
    (line,) = vision_problems(load_recipe(CI_VLM, ["trainer.share_prefix=true"]))
    assert "trainer.share_prefix = true" in line
    assert vision_problems(load_recipe(CI_VLM, ["rollout.engine.type=instant"])) == []
    # a vision model may train on text prompts: nothing names images, nothing to refuse
    assert vision_problems(load_recipe(CI_VLM, ["data.type=arithmetic"])) == []


def test_check_of_the_clevr_count_recipe_passes_without_a_gpu_or_the_model(
    tmp_path: Path,
) -> None:
    recipe = load_recipe(CLEVR)
    assert vision_family_offline(recipe.model.path) == "qwen2_5_vl"
    assert recipe.rollout.engine.type == "hf" and image_field(recipe.data) == "image"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.entry.cli", "check", str(CLEVR)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # its model path overridden: another hub checkpoint, or a local fine-tune known by its
    # config (the rest of check is the same as above, so only the vision checks are asked)
    local = tmp_path / "checkpoints" / "step-500"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    for model in ("Qwen/Qwen2-VL-2B-Instruct", str(local)):
        overridden = load_recipe(CLEVR, [f"model.path={model}"])
        assert vision_problems(overridden) == [] and path_problems(overridden) == []
