"""Data: JSONL and HF loaders, GSM8K formatting, the arithmetic and products tasks,
shuffling/sharding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config.recipe import (
    ArithmeticData,
    HFData,
    JsonlData,
    ProductsData,
    RecipeError,
    load_recipe,
)
from asyncrl.data import (
    BOXED_INSTRUCTION,
    ShardSampler,
    arithmetic_records,
    gsm8k_final_answer,
    gsm8k_records,
    load_records,
    products_records,
    read_hf_dataset,
    read_jsonl,
)
from asyncrl.rewards import math_reward

GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
needs_gsm8k = pytest.mark.skipif(not GSM8K_TEST.is_file(), reason="offline GSM8K copy absent")


def write_jsonl(path: Path, rows: list[dict], extra: str = "") -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + extra)
    return path


def test_read_jsonl_skips_blank_lines_and_names_bad_ones(tmp_path: Path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"q": 1}, {"q": 2}], extra="\n\n")
    assert read_jsonl(path) == [{"q": 1}, {"q": 2}]
    assert read_jsonl(path, limit=1) == [{"q": 1}]
    bad = write_jsonl(tmp_path / "b.jsonl", [{"q": 1}], extra="{oops\n")
    with pytest.raises(ValueError, match=r"b\.jsonl:2: not JSON"):
        read_jsonl(bad)
    (tmp_path / "c.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="not an object"):
        read_jsonl(tmp_path / "c.jsonl")


@needs_gsm8k
def test_gsm8k_records_from_the_offline_copy():
    records = gsm8k_records(read_jsonl(GSM8K_TEST, limit=3))
    first = records[0]
    assert first["question"].startswith("Janet")
    assert first["answer"] == "18"
    assert first["solution"].endswith("#### 18")
    assert first["prompt"] == f"{first['question']}\n{BOXED_INSTRUCTION}"
    # the reference answer and a right completion agree under the math reward
    assert math_reward("She makes \\boxed{18} dollars.", first) == 1.0


def test_gsm8k_final_answer():
    assert gsm8k_final_answer("so 1,000 + 5\n#### 1,005") == "1005"
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_final_answer("just text")


def test_arithmetic_records_are_deterministic_and_correct():
    a = arithmetic_records(50, seed=7, max_operand=12, ops="+-*")
    assert a == arithmetic_records(50, seed=7, max_operand=12, ops="+-*")
    assert a != arithmetic_records(50, seed=8, max_operand=12, ops="+-*")
    for rec in a:
        expr = rec["question"].removeprefix("What is ").removesuffix("?")
        assert int(rec["answer"]) == eval(expr)  # the operators are Python's own
        assert rec["prompt"].endswith(BOXED_INSTRUCTION)
    three = arithmetic_records(5, seed=1, operands=3)
    assert all(eval(r["question"][8:-1]) == int(r["answer"]) for r in three)
    with pytest.raises(ValueError, match="each must be one of"):
        arithmetic_records(1, ops="/")


def test_products_records_are_deterministic_with_the_digits_asked():
    recs = products_records(200, seed=5, digits=(3, 4))
    assert recs == products_records(200, seed=5, digits=(3, 4))
    assert recs != products_records(200, seed=6, digits=(3, 4))
    for rec in recs:
        a, b = rec["question"].removeprefix("What is ").removesuffix("?").split(" * ")
        assert (len(a), len(b)) == (3, 4)  # no leading zeros: 100..999 and 1000..9999
        assert int(rec["answer"]) == int(a) * int(b)
        assert rec["prompt"] == f"{rec['question']}\n{ProductsData().instruction}"
        assert "messages" not in rec
    small = [r["question"][8:-1].split(" * ") for r in products_records(20, digits=(2, 1))]
    assert {(len(a), len(b)) for a, b in small} == {(2, 1)}
    with pytest.raises(ValueError, match="two numbers of digits"):
        products_records(1, digits=(0, 3))


def test_products_with_a_worked_example_start_from_a_solved_exchange():
    (rec,) = products_records(1, seed=2, instruction="Use it.", example=True)
    roles = [m["role"] for m in rec["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant", "user"]
    assert rec["messages"][-1]["content"] == rec["prompt"] == f"{rec['question']}\nUse it."
    shown = rec["messages"]
    assert shown[0]["content"] == "What is 123 * 4567?\nUse it."
    assert '"expression": "123 * 4567"' in shown[1]["content"]
    assert shown[2]["content"] == str(123 * 4567)
    # the example's own answer scores 1 under the math reward, as the task's answers do
    assert math_reward(shown[3]["content"], {"answer": str(123 * 4567)}) == 1.0
    assert math_reward("The answer is \\boxed{561,741}.", {"answer": "561741"}) == 1.0
    assert math_reward("The result is 561741.", {"answer": "561741"}) == 1.0


def test_a_products_recipe_loads_and_bad_digits_name_the_key(tmp_path: Path):
    recipe = load_recipe(None, ["data.type=products", "data.size=30", "data.digits=[2, 3]"])
    assert isinstance(recipe.data, ProductsData) and recipe.data.digits == (2, 3)
    recs = load_records(recipe.data, seed=recipe.run.seed)
    assert len(recs) == 30 and recs == products_records(30, seed=recipe.run.seed, digits=(2, 3))
    with pytest.raises(RecipeError, match=r"data\.products\.digits"):
        load_recipe(None, ["data.type=products", "data.digits=[3, 0]"])
    with pytest.raises(RecipeError, match=r"eval\.max_prompts"):
        load_recipe(None, ["data.type=products", "data.size=50", "eval.every=4"])


@needs_gsm8k
def test_load_records_for_each_recipe_data_type(tmp_path: Path):
    arith = load_records(ArithmeticData(size=10, max_operand=5), seed=3)
    assert len(arith) == 10 and arith == load_records(ArithmeticData(size=10, max_operand=5), 3)
    gsm = load_records(JsonlData(path=str(GSM8K_TEST)))
    assert len(gsm) == len(GSM8K_TEST.read_text().splitlines())
    assert gsm[0]["answer"] == "18" and "#### 18" in gsm[0]["solution"]
    custom = write_jsonl(tmp_path / "qa.jsonl", [{"problem": "1+1?", "final": "2"}])
    rec = load_records(JsonlData(path=str(custom), prompt_key="problem", answer_key="final"))
    assert rec[0]["answer"] == "2" and rec[0]["prompt"].startswith("1+1?")
    with pytest.raises(KeyError, match="lacks 'question'"):
        load_records(JsonlData(path=str(custom)))


def test_hf_datasets_loader_reads_local_data_files(tmp_path: Path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    rows = [{"question": f"q{i}", "answer": f"work\n#### {i}"} for i in range(4)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    assert read_hf_dataset(str(path), limit=2) == rows[:2]
    recs = load_records(HFData(name=str(path)))
    assert [r["answer"] for r in recs] == ["0", "1", "2", "3"]


def test_sampler_is_deterministic_and_epochs_differ():
    a, b = ShardSampler(10, seed=5), ShardSampler(10, seed=5)
    first = a.take(10)
    assert first == b.take(10)
    assert sorted(i for _, i in first) == list(range(10))
    assert {e for e, _ in first} == {0}
    second = a.take(10)
    assert {e for e, _ in second} == {1}
    assert [i for _, i in second] != [i for _, i in first]
    assert [i for _, i in ShardSampler(10, shuffle=False).take(10)] == list(range(10))


def test_shards_are_disjoint_and_cover_the_epoch():
    shards = [ShardSampler(11, seed=1, shard=k, num_shards=3) for k in range(3)]
    seen = [{i for _, i in s.take(s.per_epoch)} for s in shards]
    assert all(len(s) == 3 for s in seen)  # 11 // 3, the tail of 2 dropped
    assert not (seen[0] & seen[1] or seen[1] & seen[2] or seen[0] & seen[2])
    with pytest.raises(ValueError, match="does not exist"):
        ShardSampler(10, shard=3, num_shards=3)


def test_sampler_resumes_exactly_where_it_stopped():
    original = ShardSampler(7, seed=9, shard=1, num_shards=2)
    original.take(5)  # into the second epoch
    state = json.loads(json.dumps(original.state()))  # as it would go through a checkpoint
    restored = ShardSampler(7, seed=9, shard=1, num_shards=2)
    restored.restore(state)
    assert restored.take(8) == original.take(8)
    with pytest.raises(ValueError, match="seed=9, not 10"):
        ShardSampler(7, seed=10, shard=1, num_shards=2).restore(state)
