"""Vision-language training end to end: ``asyncrl up recipes/ci_vlm.toml`` (a tiny random
Qwen2-VL-shaped model counting shapes in generated images) runs to its last step, and the
raw trajectories, read from a mirror of the run's stream as test_e2e_staleness does, show
that what was trained is what the engine generated from each image: every trained
sample's token ids are a published sample's, whose prompt ids are the processor's for
that sample's record and image, and the staleness bound holds; the run's replay gives
its checkpoint back bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_kit import REPO, cli, run
from test_e2e import read_jsonl
from test_e2e_staleness import mirrored_run

from asyncrl.models.resolve import resolve_model_path
from asyncrl.models.vision import VisionProcessor, open_image, record_images, with_images
from asyncrl.observe.records import token_digest
from asyncrl.train.replay_log import read_record
from asyncrl.workflows.base import chat_messages

pytestmark = pytest.mark.slow

RECIPE = REPO / "recipes" / "ci_vlm.toml"
STEPS = 4
ETA = 1  # recipes/ci_vlm.toml's buffer.max_head_offpolicyness


@pytest.mark.timeout(600)
async def test_ci_vlm_trains_on_what_the_engine_generated_from_each_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one model: the Idefics3 shape takes the same path through the run (the engine's and
    # trainer's own tests cover both), and its run costs CI another ten seconds
    model = "tiny-random-qwen2-vl"
    name = "vlm"
    raw = await mirrored_run(
        tmp_path,
        name,
        monkeypatch,
        f"trainer.max_steps={STEPS}",
        f"trainer.checkpoint_every={STEPS}",
        f"model.path={model}",
        recipe=RECIPE,
    )

    run_dir = tmp_path / name
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    processor = VisionProcessor(resolve_model_path(model))
    published: dict[str, set[str]] = {}
    for t in raw:
        images = record_images(t.data, "image")
        assert len(images) == 1 and t.images == images, t.uid
        prompt = processor(with_images(chat_messages(t.data), 1), [open_image(images[0])])
        prompt_ids = prompt["input_ids"][0].tolist()
        ids = t.input_ids.numpy().tolist()
        assert ids[: len(prompt_ids)] == prompt_ids, f"{t.uid}: prompt ids are not the processor's"
        assert processor.image_token_id in prompt_ids
        generated = ids[len(prompt_ids) :]
        assert generated and not set(generated) & set(processor.placeholder_ids), t.uid
        published.setdefault(t.uid, set()).add(token_digest(ids))

    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    recipe = json.loads((run_dir / "recipe.json").read_text())
    assert len(trained) == STEPS * recipe["buffer"]["batch_size"] * recipe["rollout"]["group_size"]
    for record in trained:
        assert record["tokens_sha1"] in published.get(record["uid"], set()), record["uid"]
        assert record["trained_version"] - record["head_version"] <= ETA, record
    # the replay record keeps each trained sample's image by reference
    batch = read_record(run_dir, 1)
    assert batch is not None
    samples = [s for g in batch.groups for s in g.samples]
    assert samples and all(len(s.images) == 1 for s in samples)
    assert {s.images[0] for s in samples} <= {t.images[0] for t in raw}  # the files read above
    # the replay reads the images again from their paths: every checkpoint bit for bit
    code, out = await run(cli("replay", str(run_dir)))
    assert code == 0, out
    assert "replay: 1 of 1 checkpoints identical" in out, out
