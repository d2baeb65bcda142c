"""The prompt records a recipe's ``data`` section names, from whichever source it names:
a synthetic task, a JSONL file or an HF dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.data.gsm8k import BOXED_INSTRUCTION, gsm8k_final_answer
from asyncrl.data.loaders import (
    Record,
    read_hf_dataset,
    read_jsonl,
    resolve_images,
    to_prompt_records,
)
from asyncrl.data.shapes import ShapesSettings, shapes_records
from asyncrl.data.synthetic import arithmetic_records, products_records


def _final_answer(text: str) -> str:
    """GSM8K-style worked solutions (``... #### 72``) keep only their final number."""
    return gsm8k_final_answer(text) if "####" in text else text.strip()


def load_records(cfg: Any, seed: int = 0) -> list[Record]:
    """The prompt records a recipe's ``data`` section names (``type`` = ``arithmetic``,
    ``products``, ``shapes``, ``jsonl`` or ``hf``; see :mod:`asyncrl.config.recipe`)."""
    kind = cfg.type
    if kind == "arithmetic":
        return arithmetic_records(
            cfg.size,
            seed=seed,
            max_operand=cfg.max_operand,
            ops=cfg.ops,
            instruction=cfg.instruction,
        )
    if kind == "products":
        return products_records(
            cfg.size,
            seed=seed,
            digits=tuple(cfg.digits),
            instruction=cfg.instruction,
            example=cfg.example,
        )
    if kind == "shapes":
        settings = ShapesSettings(
            image_size=cfg.image_size,
            min_shapes=cfg.min_shapes,
            max_shapes=cfg.max_shapes,
            colors=tuple(cfg.colors),
            kinds=tuple(cfg.kinds),
        )
        return shapes_records(
            cfg.size,
            seed=seed,
            settings=settings,
            questions=cfg.questions,
            questions_per_image=cfg.questions_per_image,
            instruction=cfg.instruction,
            cache_dir=cfg.cache_dir,
        )
    if kind == "jsonl":
        rows = read_jsonl(cfg.path)
        source = str(cfg.path)
        if cfg.image_key:
            resolve_images(rows, Path(cfg.path).expanduser().parent, cfg.image_key, source)
    elif kind == "hf":
        rows = read_hf_dataset(cfg.name, cfg.subset, cfg.split)
        source = f"dataset {cfg.name} ({cfg.split})"
        if cfg.image_key:
            resolve_images(rows, Path.cwd(), cfg.image_key, source)
    else:
        raise ValueError(
            f"data type {kind!r} is not one of arithmetic, products, shapes, jsonl, hf"
        )
    records = to_prompt_records(
        rows,
        cfg.prompt_key,
        cfg.answer_key,
        instruction=BOXED_INSTRUCTION,
        transform=_final_answer,
        source=source,
    )
    for rec, row in zip(records, rows, strict=True):
        rec.setdefault("solution", row[cfg.answer_key])
    return records
