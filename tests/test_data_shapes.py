"""The shapes counting task: deterministic scenes, answers that match both the scene and
the drawn pixels, image paths in records, JSONL records naming image files, and bad
settings named by their recipe key."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from asyncrl.config.recipe import (
    HFData,
    JsonlData,
    RecipeError,
    ShapesData,
    image_field,
    load_recipe,
)
from asyncrl.data import load_records
from asyncrl.data.shapes import (
    BACKGROUND,
    COLORS,
    ShapesSettings,
    draw_scene,
    render_scene,
    shapes_records,
)
from asyncrl.rewards import math_reward


def regions(pixels: np.ndarray) -> list[tuple[tuple[int, int, int], float]]:
    """Each 4-connected region of one non-background colour: its colour and how much of
    its bounding box it fills (circle π/4, square 1, triangle 1/2)."""
    h, w, _ = pixels.shape
    seen = np.zeros((h, w), dtype=bool)
    seen[(pixels == BACKGROUND).all(axis=-1)] = True
    found = []
    for y0 in range(h):
        for x0 in range(w):
            if seen[y0, x0]:
                continue
            color = tuple(int(c) for c in pixels[y0, x0])
            seen[y0, x0] = True
            stack, cells = [(y0, x0)], []
            while stack:
                y, x = stack.pop()
                cells.append((y, x))
                for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx]:
                        if tuple(pixels[ny, nx]) == color:
                            seen[ny, nx] = True
                            stack.append((ny, nx))
            ys, xs = zip(*cells, strict=True)
            box = (max(ys) - min(ys) + 1) * (max(xs) - min(xs) + 1)
            found.append((color, len(cells) / box))
    return found


def kind_of(fill: float) -> str:
    return "square" if fill > 0.9 else "circle" if fill > 0.65 else "triangle"


def test_records_are_deterministic_per_seed_and_index(tmp_path: Path):
    a = shapes_records(12, seed=3, cache_dir=tmp_path)
    assert a == shapes_records(12, seed=3, cache_dir=tmp_path)
    assert shapes_records(5, seed=3, cache_dir=tmp_path) == a[:5]  # i does not depend on size
    # rendered afresh elsewhere (another machine's cache), the same questions and pixels
    for x, y in zip(a, shapes_records(12, seed=3, cache_dir=tmp_path / "again"), strict=True):
        assert (x["question"], x["answer"]) == (y["question"], y["answer"])
        assert Image.open(x["image"]).tobytes() == Image.open(y["image"]).tobytes()
    other = shapes_records(12, seed=4, cache_dir=tmp_path)
    assert [r["image"] for r in other] != [r["image"] for r in a]
    assert draw_scene(ShapesSettings(), 3, 0) == draw_scene(ShapesSettings(), 3, 0)
    assert draw_scene(ShapesSettings(), 3, 0) != draw_scene(ShapesSettings(), 4, 0)


def test_records_carry_an_image_path_and_an_answer_the_math_reward_reads(tmp_path: Path):
    records = shapes_records(8, seed=1, cache_dir=tmp_path)
    for rec in records:
        path = Path(rec["image"])
        assert path.is_absolute() and path.is_file() and path.suffix == ".png"
        assert path.is_relative_to(tmp_path)
        assert rec["prompt"].startswith(rec["question"]) and "\\boxed{}" in rec["prompt"]
        assert math_reward(f"I count \\boxed{{{rec['answer']}}}.", rec) == 1.0
        assert math_reward(f"\\boxed{{{int(rec['answer']) + 1}}}", rec) == 0.0
    assert Image.open(records[0]["image"]).size == (128, 128)
    # other settings get their own folder: no image of theirs stands in for these
    bigger = shapes_records(1, seed=1, settings=ShapesSettings(image_size=64), cache_dir=tmp_path)
    assert Path(bigger[0]["image"]).parent != Path(records[0]["image"]).parent


def test_answers_equal_the_count_in_the_scene(tmp_path: Path):
    settings = ShapesSettings(max_shapes=8)
    records = shapes_records(60, seed=5, settings=settings, cache_dir=tmp_path)
    asked = Counter()
    for index, rec in enumerate(records):
        scene = draw_scene(settings, 5, index)
        words = rec["question"].removeprefix("How many ").removesuffix(" are there?").split()
        color = words[0] if words[0] in COLORS else None
        noun = words[-1]
        kind = None if noun == "shapes" else noun.removesuffix("s")
        want = sum(
            (color is None or s.color == color) and (kind is None or s.kind == kind) for s in scene
        )
        assert rec["answer"] == str(want), rec
        asked[(color is not None, kind is not None)] += 1
    assert len(asked) == 4  # colour, kind, both and total questions all occur


def test_the_drawn_pixels_show_the_scene(tmp_path: Path):
    """Counted off the rendered image alone, by region colour and shape, the shapes are
    those of the scene: no overlap merged two, none fell off the canvas."""
    settings = ShapesSettings(image_size=96, min_shapes=5, max_shapes=8)
    for index in range(3):
        scene = draw_scene(settings, 2, index)
        pixels = np.asarray(render_scene(scene, settings.image_size))
        palette = {rgb: name for name, rgb in COLORS.items()}
        drawn = Counter((palette[c], kind_of(fill)) for c, fill in regions(pixels))
        assert drawn == Counter((s.color, s.kind) for s in scene)
    # and the file a record names holds those pixels
    rec = shapes_records(1, seed=2, settings=settings, cache_dir=tmp_path)[0]
    from_file = np.asarray(Image.open(rec["image"]).convert("RGB"))
    assert (from_file == np.asarray(render_scene(draw_scene(settings, 2, 0), 96))).all()


def test_questions_per_image_share_the_image(tmp_path: Path):
    recs = shapes_records(5, seed=0, questions_per_image=2, cache_dir=tmp_path)
    assert len(recs) == 5
    assert recs[0]["image"] == recs[1]["image"] != recs[2]["image"] == recs[3]["image"]


def test_bad_settings_say_what_to_change(tmp_path: Path):
    with pytest.raises(ValueError, match=r"data\.colors: \['pink'\] not among red"):
        ShapesSettings(colors=("red", "pink"))
    with pytest.raises(ValueError, match=r"data\.kinds: empty: give some of"):
        ShapesSettings(kinds=())
    with pytest.raises(ValueError, match=r"data\.min_shapes \(4\) must be >= 1 and <= "):
        ShapesSettings(min_shapes=4, max_shapes=2)
    with pytest.raises(ValueError, match=r"data\.questions: \['size'\] not among color"):
        shapes_records(2, questions=["size"], cache_dir=tmp_path)
    crowded = ShapesSettings(image_size=32, min_shapes=30, max_shapes=30)
    with pytest.raises(ValueError, match=r"data\.max_shapes=30 shapes do not fit"):
        shapes_records(1, settings=crowded, cache_dir=tmp_path)


def test_a_shapes_recipe_loads_and_bad_keys_are_named(tmp_path: Path):
    recipe = load_recipe(
        None,
        ["data.type=shapes", "data.size=6", f"data.cache_dir={tmp_path}", "data.colors=['red']"],
    )
    assert isinstance(recipe.data, ShapesData)
    recs = load_records(recipe.data, seed=recipe.run.seed)
    assert len(recs) == 6 and all(Path(r["image"]).is_relative_to(tmp_path) for r in recs)
    assert not any(c in r["question"] for r in recs for c in COLORS if c != "red")
    assert recs == load_records(recipe.data, seed=recipe.run.seed)
    for bad, key in (
        ("data.colors=['red', 'pink']", r"data\.shapes\.colors"),
        ("data.kinds=[]", r"data\.shapes\.kinds"),
        ("data.questions=['size']", r"data\.shapes\.questions"),
        ("data.image_size=8", r"data\.shapes\.image_size"),
        ("data.min_shapes=9", r"min_shapes \(9\) is above max_shapes \(6\)"),
    ):
        with pytest.raises(RecipeError, match=key):
            load_recipe(None, ["data.type=shapes", bad])
    with pytest.raises(RecipeError, match=r"eval\.max_prompts"):
        load_recipe(None, ["data.type=shapes", "data.size=50", "eval.every=4"])


def test_jsonl_records_name_image_files_beside_them(tmp_path: Path):
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "a.png")
    rows = [
        {"question": "How many?", "answer": "2", "image": "imgs/a.png"},
        {"question": "No image", "answer": "1"},
    ]
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    recs = load_records(JsonlData(path=str(path), image_key="image"))
    assert recs[0]["image"] == str((tmp_path / "imgs" / "a.png").resolve())
    assert "image" not in recs[1]
    # no image_key (the default) reads the field as plain data
    assert load_records(JsonlData(path=str(path)))[0]["image"] == "imgs/a.png"
    rows.append({"question": "Gone", "answer": "0", "picture": "imgs/missing.png"})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(FileNotFoundError, match=r"row 3: image 'imgs/missing\.png' under "):
        load_records(JsonlData(path=str(path), image_key="picture"))
    path.write_text(json.dumps({"question": "q", "answer": "1", "image": 7}) + "\n")
    with pytest.raises(ValueError, match=r"row 1: 'image' \(the recipe's image_key\) must name"):
        load_records(JsonlData(path=str(path), image_key="image"))


def test_hf_dataset_records_name_image_files_from_the_run_s_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A dataset read with data.type = "hf" (here a local JSON Lines file, which its
    builder reads offline) names images relative to where the run starts."""
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "a.png")
    rows = [{"question": "How many?", "answer": "2", "image": "imgs/a.png"}] * 2
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.chdir(tmp_path)
    recs = load_records(HFData(name=str(path), image_key="image"))
    assert [r["image"] for r in recs] == [str((tmp_path / "imgs" / "a.png").resolve())] * 2
    assert image_field(HFData(name=str(path), image_key="image")) == "image"
    assert image_field(HFData(name=str(path))) is None
    monkeypatch.chdir(tmp_path / "imgs")  # elsewhere the relative name is missing, and said
    with pytest.raises(FileNotFoundError, match=r"row 1: image 'imgs/a\.png' under 'image'"):
        load_records(HFData(name=str(path), image_key="image"))


def test_the_docs_image_is_the_one_the_generator_draws(tmp_path: Path):
    """docs/vision.md and the README show image 1 of seed 1 at 160 pixels with 5 to 7
    shapes, and its questions; they stay true to the generator."""
    settings = ShapesSettings(image_size=160, min_shapes=5, max_shapes=7)
    docs = Path(__file__).resolve().parents[1] / "docs" / "shapes.png"
    asked = {}
    for kind in ("color", "kind", "color_kind", "total"):
        rec = shapes_records(2, seed=1, settings=settings, questions=[kind], cache_dir=tmp_path)[1]
        asked[rec["question"]] = rec["answer"]
    assert asked == {
        "How many red shapes are there?": "3",
        "How many circles are there?": "2",
        "How many red circles are there?": "1",
        "How many shapes are there?": "5",
    }
    drawn = np.asarray(render_scene(draw_scene(settings, 1, 1), 160))
    assert (np.asarray(Image.open(docs).convert("RGB")) == drawn).all()
