"""SFT examples: rows of worked answers become prompt records and training sequences.

A *record* here is a prompt record as the rest of asyncrl knows it (``prompt``: the
question plus the instruction; ``answer``: the final answer a reward compares with) plus
``target``, the text the model learns to write. A record becomes a
:class:`~asyncrl.train.batch.Sample` by :func:`render_example`:

    input_ids = chat_template(system?, user: prompt, generation prompt) + target + EOS
    loss_mask = False on the chat part, True on target + EOS

The chat part is exactly what the rollout and eval paths feed the model
(:func:`asyncrl.workflows.base.encode_chat`), and the target is tokenized on its own, as
the model's generated tokens would be, so what SFT teaches is what generation sees.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.data.gsm8k import gsm8k_final_answer
from asyncrl.data.loaders import Record, read_hf_dataset, read_jsonl, to_prompt_records
from asyncrl.train.batch import Sample
from asyncrl.workflows.base import chat_messages, encode_chat, encode_text

if TYPE_CHECKING:
    from asyncrl.config.recipe import HFData, JsonlData
    from asyncrl.sft.config import SftConfig, SftRecipe
    from asyncrl.train.batch import Sample

_CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")
_FINAL_LINE = re.compile(r"\n?####\s*(.+?)\s*$", re.S)


def gsm8k_boxed(solution: str) -> str:
    """A GSM8K worked solution in the form the math reward reads: the calculator notes
    (``<<48/2=24>>``) removed, the final ``#### 72`` line replaced by ``The final answer
    is \\boxed{72}.`` (thousands commas dropped, as :func:`gsm8k_final_answer` does)."""
    final = gsm8k_final_answer(solution)
    body = _FINAL_LINE.sub("", _CALCULATOR_NOTE.sub("", solution)).rstrip()
    ending = f"The final answer is \\boxed{{{final}}}."
    return f"{body}\n{ending}" if body else ending


def _final_answer(text: str) -> str:
    return gsm8k_final_answer(text) if "####" in text else text.strip()


def read_rows(source: JsonlData | HFData, limit: int | None = None) -> tuple[list[Record], str]:
    """The rows of a data section (its first ``limit``), and a name for messages."""
    if source.type == "jsonl":
        return read_jsonl(source.path, limit=limit), str(source.path)
    rows = read_hf_dataset(source.name, source.subset, source.split, limit=limit)
    return rows, f"dataset {source.name} ({source.split})"


def sft_records(
    rows: list[Record], source: JsonlData | HFData, cfg: SftConfig, name: str
) -> list[Record]:
    """Rows as SFT records (see the module docstring); a row without ``prompt_key`` or
    ``answer_key`` raises naming the file, the row and the key."""
    records = to_prompt_records(
        rows,
        source.prompt_key,
        source.answer_key,
        instruction=cfg.instruction,
        transform=_final_answer,
        source=name,
    )
    for rec, row in zip(records, rows, strict=True):
        worked = str(row[source.answer_key])
        rec["target"] = gsm8k_boxed(worked) if cfg.answer_format == "gsm8k_boxed" else worked
    return records


def split_records(recipe: SftRecipe) -> tuple[list[Record], list[Record]]:
    """``(train, held_out)``: the records of ``data`` (its first ``sft.limit`` rows) and
    the held-out ones, ``sft.held_out`` of them: the first rows of ``sft.eval_data``, or
    a seeded draw from ``data`` that is then never trained on."""
    cfg = recipe.sft
    rows, name = read_rows(recipe.data, cfg.limit)
    records = sft_records(rows, recipe.data, cfg, name)
    if cfg.eval_data is not None:
        eval_rows, eval_name = read_rows(cfg.eval_data, cfg.held_out)
        return records, sft_records(eval_rows, cfg.eval_data, cfg, eval_name)
    if cfg.held_out >= len(records):
        raise ValueError(
            f"sft.held_out={cfg.held_out} would hold out all {len(records)} examples of "
            f"{name}: lower it or give sft.eval_data"
        )
    order = list(range(len(records)))
    random.Random(f"sft-heldout/{recipe.run.seed}").shuffle(order)
    held = set(order[: cfg.held_out])
    train = [r for i, r in enumerate(records) if i not in held]
    return train, [records[i] for i in sorted(held)]


@dataclass
class Rendered:
    """The sequences of some records: ``samples[i]`` renders ``records[i]``; ``dropped``
    counts the records whose prompt alone reached ``sft.max_length``, ``truncated`` those
    whose answer was cut."""

    samples: list[Sample]
    records: list[Record]
    dropped: int = 0
    truncated: int = 0


def render_example(tokenizer: Any, record: Record, cfg: SftConfig) -> tuple[Sample | None, bool]:
    """The training sequence of ``record`` (see the module docstring), cut at
    ``cfg.max_length`` tokens, and whether it was cut; None when the prompt leaves no
    room for an answer token."""

    prompt_ids = encode_chat(tokenizer, chat_messages(record, cfg.system_prompt))
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token: an answer could never end")
    answer_ids = [*encode_text(tokenizer, str(record["target"])), int(tokenizer.eos_token_id)]
    room = cfg.max_length - len(prompt_ids)
    if room < 1:
        return None, False
    cut = len(answer_ids) > room
    ids = prompt_ids + answer_ids[:room]
    mask = [False] * len(prompt_ids) + [True] * min(room, len(answer_ids))
    n = len(ids)
    sample = Sample(
        input_ids=torch.tensor(ids),
        loss_mask=torch.tensor(mask),
        behav_logprobs=torch.zeros(n),
        advantages=0.0,
    )
    return sample, cut


def render_records(tokenizer: Any, records: list[Record], cfg: SftConfig) -> Rendered:
    """Every record that fits, rendered (:func:`render_example`), with the counts."""
    out = Rendered(samples=[], records=[])
    for rec in records:
        sample, cut = render_example(tokenizer, rec, cfg)
        if sample is None:
            out.dropped += 1
            continue
        out.samples.append(sample)
        out.records.append(rec)
        out.truncated += cut
    return out


__all__ = [
    "Rendered",
    "gsm8k_boxed",
    "read_rows",
    "render_example",
    "render_records",
    "sft_records",
    "split_records",
]
