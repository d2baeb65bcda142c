"""Prompt data: loaders (JSONL, HF datasets), GSM8K formatting, the synthetic arithmetic,
products and shapes (image counting) tasks, and deterministic shuffling/sharding with a resumable position."""

from __future__ import annotations

from asyncrl.data.gsm8k import (
    BOXED_INSTRUCTION,
    gsm8k_final_answer,
    gsm8k_records,
)
from asyncrl.data.loaders import (
    MissingFieldError,
    Record,
    missing_fields,
    read_hf_dataset,
    read_jsonl,
    resolve_images,
    to_prompt_records,
)
from asyncrl.data.sampler import ShardSampler, epoch_permutation
from asyncrl.data.shapes import ShapesSettings, shapes_records
from asyncrl.data.sources import load_records
from asyncrl.data.splits import held_out_indices, load_eval_records, load_prompt_records
from asyncrl.data.synthetic import arithmetic_records, products_records

__all__ = [
    "BOXED_INSTRUCTION",
    "MissingFieldError",
    "Record",
    "ShapesSettings",
    "ShardSampler",
    "arithmetic_records",
    "epoch_permutation",
    "gsm8k_final_answer",
    "gsm8k_records",
    "held_out_indices",
    "load_eval_records",
    "load_prompt_records",
    "load_records",
    "missing_fields",
    "products_records",
    "read_hf_dataset",
    "read_jsonl",
    "resolve_images",
    "shapes_records",
    "to_prompt_records",
]
