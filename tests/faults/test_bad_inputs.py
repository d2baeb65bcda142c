"""Bad inputs a user gives: a dataset row without the answer field, a model path that does
not exist. Each is a clear error that names the file, the row and the key, before anything
starts (``asyncrl up`` creates no run folder); and an actor that meets a bad row anyway
(a hub dataset, a file changed after the check) fails with the same message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_e2e import cli, run

from asyncrl.config.checks import enforce_recipe
from asyncrl.config.recipe import RecipeError, load_recipe
from asyncrl.data import MissingFieldError, load_eval_records, load_prompt_records


def gsm8k_like(path: Path, rows: int, without_answer: set[int]) -> Path:
    """A JSONL of ``rows`` question/answer rows; the rows (from 1) in ``without_answer``
    have a typo'd answer field instead."""
    with path.open("w") as f:
        for i in range(1, rows + 1):
            row = {
                "question": f"{i} + 1?",
                "answer" if i not in without_answer else "anwser": f"#### {i + 1}",
            }
            f.write(json.dumps(row) + "\n")
    return path


def data_sets(path: Path) -> list[str]:
    return ["data.type=jsonl", f"data.path={path}"]


def test_a_row_without_the_answer_fails_the_check_naming_file_rows_and_key(tmp_path: Path) -> None:
    data = gsm8k_like(tmp_path / "train.jsonl", 30, without_answer={3, 17})
    recipe = load_recipe(None, [*data_sets(data), "eval.every=0"])
    with pytest.raises(RecipeError) as err:
        enforce_recipe(recipe)
    text = str(err.value)
    assert "data.answer_key = 'answer'" in text
    assert f"2 of the 30 rows of {data} lack it (rows 3, 17)" in text
    # eval.data is checked the same way
    good = gsm8k_like(tmp_path / "good.jsonl", 30, without_answer=set())
    recipe = load_recipe(None, [*data_sets(good), "eval.data.type=jsonl", f"eval.data.path={data}"])
    with pytest.raises(RecipeError, match=r"eval\.data\.answer_key = 'answer': 2 of the 30"):
        enforce_recipe(recipe)


def test_an_actor_that_meets_a_row_without_the_answer_names_it(tmp_path: Path) -> None:
    """What the buffer and the eval actor load: the same rows, the same clear error."""
    data = gsm8k_like(tmp_path / "train.jsonl", 30, without_answer={5})
    recipe = load_recipe(None, [*data_sets(data), "eval.max_prompts=4"])
    for load in (load_prompt_records, load_eval_records):
        with pytest.raises(MissingFieldError) as err:
            load(recipe)
        assert str(err.value) == (
            f"{data}: row 5 lacks 'answer' (the recipe's answer_key); "
            "its fields are ['anwser', 'question']"
        )


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ("data", "data.answer_key = 'answer': 1 of the 30 rows of"),
        ("model", "model.path: directory './no/such/model' does not exist"),
    ],
)
async def test_up_refuses_before_anything_starts(tmp_path: Path, bad: str, expected: str) -> None:
    data = gsm8k_like(tmp_path / "train.jsonl", 30, without_answer={30} if bad == "data" else set())
    sets = [*data_sets(data), "eval.max_prompts=4"]
    if bad == "model":
        sets.append("model.path=./no/such/model")
    sets += [f"run.dir={tmp_path}", "run.name=bad"]
    code, out = await run(cli("up", *(x for s in sets for x in ("--set", s)), "--quiet"), limit=120)
    assert code == 2, out
    assert expected in out
    assert not (tmp_path / "bad").exists(), "a run folder was created for bad input"
