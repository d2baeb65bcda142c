"""Prompt records from a local JSONL file or an HF dataset.

A *prompt record* is a plain dict that travels in ``Prompt.data`` and
``Trajectory.data``: ``prompt`` (the user turn as text) or ``messages`` (a whole chat),
``answer`` (the reference the reward compares with), plus whatever fields the source had.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def read_jsonl(path: str | Path, limit: int | None = None) -> list[Record]:
    """The JSON objects of a JSONL file, in order; blank lines are skipped.

    A malformed line raises ``ValueError`` naming the file and the line number."""
    path = Path(path).expanduser()
    records: list[Record] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: a JSON {type(obj).__name__}, not an object")
            records.append(obj)
    return records


def read_hf_dataset(
    name: str, subset: str | None = None, split: str = "train", limit: int | None = None
) -> list[Record]:
    """The rows of an HF dataset split (from the hub or the local HF cache), as dicts.

    Needs the ``datasets`` package; a local ``name`` of a data file (``.json``,
    ``.jsonl``, ``.csv``, ``.parquet``) is read with its matching builder."""
    try:
        import datasets  # noqa: PLC0415 - heavy (pyarrow, pandas): data.type = "hf" only
    except ImportError as exc:
        raise ImportError("HF datasets need the 'datasets' package: pip install datasets") from exc
    builders = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    suffix = Path(name).suffix
    if suffix in builders and Path(name).expanduser().is_file():
        ds = datasets.load_dataset(
            builders[suffix], data_files=str(Path(name).expanduser()), split=split
        )
    else:
        ds = datasets.load_dataset(name, subset, split=split)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return [dict(row) for row in ds]


class MissingFieldError(KeyError):
    """A data row without a field the recipe names (``prompt_key``, ``answer_key``)."""

    def __str__(self) -> str:  # KeyError's own quotes the whole message
        return str(self.args[0])


def missing_fields(rows: Iterable[Record], keys: Iterable[str]) -> list[tuple[int, str]]:
    """``(row number from 1, key)`` for every row that lacks one of ``keys``, in order."""
    wanted = list(keys)
    return [(i, k) for i, row in enumerate(rows, 1) for k in wanted if k not in row]


def to_prompt_records(
    rows: Iterable[Record],
    prompt_key: str = "question",
    answer_key: str = "answer",
    instruction: str = "",
    transform: Callable[[str], str] | None = None,
    source: str = "data",
) -> list[Record]:
    """Rows with ``prompt`` (the text under ``prompt_key`` plus ``instruction``) and
    ``answer`` (``transform`` of the text under ``answer_key``) added; other fields kept.

    A row without either key raises :class:`MissingFieldError` naming ``source`` (the
    file or dataset), the row and the key: a reward cannot score without the answer."""
    out: list[Record] = []
    for i, row in enumerate(rows):
        for key, name in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
            if key not in row:
                raise MissingFieldError(
                    f"{source}: row {i + 1} lacks {key!r} (the recipe's {name}); "
                    f"its fields are {sorted(row)}"
                )
        question = str(row[prompt_key])
        answer = str(row[answer_key])
        out.append(
            {
                **row,
                "prompt": f"{question}\n{instruction}" if instruction else question,
                "answer": transform(answer) if transform else answer,
            }
        )
    return out


def resolve_images(rows: Iterable[Record], base: Path, image_key: str, source: str) -> None:
    """Makes the image file each row names under ``image_key`` (a path relative to
    ``base``, the JSONL file's folder, or absolute) an absolute path, in place; rows
    without the key stay text-only. A file that does not exist raises
    ``FileNotFoundError`` naming ``source``, the row and the key: a missing image would
    otherwise surface only when a rollout actor opens it, mid-run."""
    for i, row in enumerate(rows, 1):
        if row.get(image_key) is None:
            continue
        name = row[image_key]
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"{source}: row {i}: {image_key!r} (the recipe's image_key) must name an "
                f"image file, got {name!r}"
            )
        path = (base / name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"{source}: row {i}: image {name!r} under {image_key!r} (the recipe's "
                f"image_key) does not exist: {path}"
            )
        row[image_key] = str(path.resolve())
