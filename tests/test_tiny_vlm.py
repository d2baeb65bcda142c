"""The tiny random vision-language models (Qwen2-VL- and Idefics3-shaped): their
processors place the image tokens, they generate on a CPU, and a second forward over
prompt + completion gives back the logprobs the generation sampled with (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from asyncrl.data.shapes import ShapesSettings, shapes_records
from asyncrl.models.resolve import resolve_model_path
from asyncrl.models.tiny_vlm import IDEFICS3_NAME, QWEN2_VL_NAME, tiny_vlm_dir
from asyncrl.models.vision import (
    VisionProcessor,
    mrope_position_ids,
    open_image,
    packed_position_ids,
    record_messages,
    scoring_inputs,
)

NAMES = [QWEN2_VL_NAME, IDEFICS3_NAME]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return shapes_records(3, seed=0, cache_dir=tmp_path_factory.mktemp("shapes"))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: tiny_vlm_dir(name, root) for name in NAMES}


def load(path: Path) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def completion_logprobs(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_BTV.float(), -1).gather(-1, ids_BT[..., None])[..., 0]


def test_dirs_are_small_deterministic_and_named_by_model_path(model_dirs, tmp_path: Path):
    for name, path in model_dirs.items():
        size = sum(f.stat().st_size for f in path.iterdir())
        assert size < 1_000_000, (name, size)
        again = tiny_vlm_dir(name, tmp_path)
        a, b = (p / "model.safetensors" for p in (path, again))
        assert a.read_bytes() == b.read_bytes()
    with pytest.raises(ValueError, match="no tiny vision model 'tiny-random-x'"):
        tiny_vlm_dir("tiny-random-x", tmp_path)


def test_model_path_names_build_into_the_cache(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    path = Path(resolve_model_path(IDEFICS3_NAME))
    assert path.parent == tmp_path and (path / "config.json").is_file()


def test_qwen2_vl_processor_places_one_pad_per_merged_patch(model_dirs, shapes):
    proc = VisionProcessor(model_dirs[QWEN2_VL_NAME])
    rec = shapes[0]
    inputs = proc(record_messages(rec), [open_image(rec["image"])])
    ids = inputs["input_ids"][0].tolist()
    # 128×128 pixels → smart resize to 140×140 → 10×10 patches of 14 → 25 merged tokens
    assert inputs["image_grid_thw"].tolist() == [[1, 10, 10]]
    assert inputs["pixel_values"].shape == (100, 3 * 2 * 14 * 14)
    start, end, pad = proc.tokenizer.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    )
    first = ids.index(start)
    assert ids[first + 1 : first + 27] == [pad] * 25 + [end]
    assert inputs["mm_token_type_ids"][0].tolist() == [int(i == pad) for i in ids]
    assert proc.tokenizer.decode(ids[first + 27 :]) == f"{rec['prompt']}\n<|assistant|>"
    assert set(proc.placeholder_ids) == {
        start,
        end,
        pad,
        proc.tokenizer.convert_tokens_to_ids("<|video_pad|>"),
    }
    with pytest.raises(ValueError, match="the chat has 1 images, but 2 were given"):
        proc(record_messages(rec), [open_image(rec["image"])] * 2)


def test_idefics3_processor_places_the_image_sequence(model_dirs, shapes):
    proc = VisionProcessor(model_dirs[IDEFICS3_NAME])
    rec = shapes[0]
    inputs = proc(record_messages(rec), [open_image(rec["image"])])
    assert inputs["pixel_values"].shape == (1, 1, 3, 64, 64)
    assert inputs["pixel_attention_mask"].shape == (1, 1, 64, 64)
    text = proc.tokenizer.decode(inputs["input_ids"][0])
    image = "<fake_token_around_image><global-img>" + "<image>" * 16 + "<fake_token_around_image>"
    assert text == f"<|user|>{image}{rec['prompt']}\n<|assistant|>"
    # what sampling never draws: the image tokens, never the end of a turn or of the text
    tok = proc.tokenizer
    names = tok.convert_ids_to_tokens(proc.placeholder_ids)
    assert sorted(names) == sorted(["<fake_token_around_image>", "<image>", "<global-img>"])
    assert tok.convert_tokens_to_ids("<end_of_utterance>") not in proc.placeholder_ids
    assert tok.eos_token_id not in proc.placeholder_ids


@pytest.mark.parametrize("name", NAMES)
def test_recomputed_logprobs_equal_the_sampled_ones(model_dirs, shapes, name):
    """The fact the trainer rests on: generation's logprobs (with a KV cache, and for
    Qwen2-VL its rope deltas) equal a second full forward's, given the same pixel values
    and grid sizes."""
    proc = VisionProcessor(model_dirs[name])
    model = load(model_dirs[name])
    gaps = []
    for rec in shapes[:1]:
        prompt = proc(record_messages(rec), [open_image(rec["image"])])
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(
                **prompt,
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=True,
                suppress_tokens=proc.placeholder_ids,
                output_logits=True,
                return_dict_in_generate=True,
            )
        n_prompt = prompt["input_ids"].shape[1]
        completion = out.sequences[:, n_prompt:]
        assert completion.shape == (1, 16)
        assert not set(completion[0].tolist()) & set(proc.placeholder_ids)
        sampled = completion_logprobs(torch.stack(out.logits, dim=1), completion)
        inputs = scoring_inputs(prompt, completion, proc.image_token_id)
        with torch.no_grad():
            logits = model(**inputs).logits
        recomputed = completion_logprobs(logits[:, n_prompt - 1 : -1], completion)
        gaps.append((sampled - recomputed).abs().max().item())
    assert max(gaps) < 1e-4, gaps


def test_qwen2_vl_rotary_positions_walk_the_image_grid(model_dirs, shapes):
    proc = VisionProcessor(model_dirs[QWEN2_VL_NAME])
    model = load(model_dirs[QWEN2_VL_NAME])
    rec = shapes[0]
    inputs = proc(record_messages(rec), [open_image(rec["image"])])
    pos = mrope_position_ids(model, inputs)
    # text turns render as in the text-only template
    text_only = [{"role": "user", "content": rec["prompt"]}]
    assert proc.chat_text(text_only) == f"<|user|>{rec['prompt']}\n<|assistant|>"
    ids = inputs["input_ids"][0]
    first = int((ids == proc.image_token_id).nonzero()[0])
    n = ids.shape[0]
    assert pos.shape == (3, 1, n)
    # text before the image counts up on all three axes
    assert (pos[:, 0, :first] == torch.arange(first)).all()
    # 25 pads: a 5×5 grid after merging, at time `first`, rows and columns from `first`
    grid = pos[:, 0, first : first + 25]
    assert (grid[0] == first).all()
    assert grid[1].tolist() == [first + r for r in range(5) for _ in range(5)]
    assert grid[2].tolist() == [first + c for _ in range(5) for c in range(5)]
    # the text after resumes past the grid's largest side
    after = pos[:, 0, first + 25 :]
    assert (after == first + 5 + torch.arange(n - first - 25)).all()
    # given explicitly, they give the logits the model computes itself
    with torch.no_grad():
        own = model(**inputs).logits
        given = model(**inputs, position_ids=pos).logits
    assert torch.equal(own, given)


def test_qwen2_vl_packed_sequences_score_as_apart(model_dirs, shapes, tmp_path: Path):
    """Two image prompts of different grid sizes with completions, packed into one row
    with their own positions, give each the logits it has alone."""
    proc = VisionProcessor(model_dirs[QWEN2_VL_NAME])
    model = load(model_dirs[QWEN2_VL_NAME])
    larger = shapes_records(1, settings=ShapesSettings(image_size=200), cache_dir=tmp_path)
    samples = []
    for rec, completion in ((shapes[0], "It is \\boxed{3}."), (larger[0], "\\boxed{1}")):
        prompt = proc(record_messages(rec), [open_image(rec["image"])])
        ids = proc.tokenizer(completion, return_tensors="pt")["input_ids"]
        samples.append(scoring_inputs(prompt, ids, proc.image_token_id))
    assert [s["image_grid_thw"].tolist() for s in samples] == [[[1, 10, 10]], [[1, 14, 14]]]
    with torch.no_grad():
        apart = [model(**s).logits for s in samples]
        packed = model(
            input_ids=torch.cat([s["input_ids"] for s in samples], dim=1),
            mm_token_type_ids=torch.cat([s["mm_token_type_ids"] for s in samples], dim=1),
            pixel_values=torch.cat([s["pixel_values"] for s in samples]),
            image_grid_thw=torch.cat([s["image_grid_thw"] for s in samples]),
            position_ids=packed_position_ids(model, samples),
            use_cache=False,
        ).logits
    together = torch.split(packed, [s["input_ids"].shape[1] for s in samples], dim=1)
    for alone, inside in zip(apart, together, strict=True):
        assert (alone - inside).abs().max().item() < 1e-5
