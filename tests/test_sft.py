"""Supervised fine-tuning: the masked cross-entropy against hand-computed values and a
plain transformers forward, example rendering with the chat template, the SFT recipe's
checks, and an ``asyncrl sft`` run of the tiny model on two gloo ranks (as users run it)
whose loss drops and whose export loads as ``model.path``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers.tiny import VOCAB, one_torch_thread, tiny_config, train_config

from asyncrl.config.recipe import RecipeError, load_recipe
from asyncrl.models.resolve import TINY_NAME, ModelConfig
from asyncrl.sft.config import SftConfig, SftRecipe, load_sft_recipe
from asyncrl.sft.data import gsm8k_boxed, render_example, sft_records, split_records
from asyncrl.sft.loss import masked_ce
from asyncrl.train.batch import Sample

REPO = Path(__file__).resolve().parent.parent
CI_SFT = REPO / "recipes" / "ci_sft.toml"
GSM8K_SFT = REPO / "recipes" / "gsm8k_sft.toml"


def test_masked_ce_is_the_token_mean_over_the_whole_batch() -> None:
    lp_BT = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -7.0]])
    mask_BT = torch.tensor([[False, True, True], [False, True, False]])
    # three answer tokens: (1 + 2 + 0.5) / 3; the unmasked -7 never counts
    assert masked_ce(lp_BT, mask_BT, 3).item() == pytest.approx(3.5 / 3)
    # parts of a batch (ranks, micro-batches) divide by the batch's count and add up
    parts = masked_ce(lp_BT[:1], mask_BT[:1], 3) + masked_ce(lp_BT[1:], mask_BT[1:], 3)
    assert parts.item() == pytest.approx(3.5 / 3)
    with pytest.raises(ValueError, match="no answer tokens"):
        masked_ce(lp_BT, mask_BT, 0)


def _sft_engine(max_tokens: int):  # type: ignore[no-untyped-def]
    from asyncrl.sft.engine import SFTEngine

    cfg = train_config(max_tokens_per_microbatch=max_tokens)
    return SFTEngine(cfg, ModelConfig(path=TINY_NAME), architecture=tiny_config(), seed=3)


def test_sft_step_loss_is_the_cross_entropy_of_a_plain_forward() -> None:
    """The engine's loss (packed micro-batches, fused LM head) equals the cross-entropy of
    transformers' own logits over the answer tokens, whatever the micro-batch split; and
    so do the weights after the step."""
    g = torch.Generator().manual_seed(0)
    batch = []
    for n, prompt in ((9, 4), (14, 10), (6, 2), (11, 5)):
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        mask = torch.arange(n) >= prompt
        batch.append(Sample(ids, mask, torch.zeros(n), 0.0))
    with one_torch_thread():
        one, split = _sft_engine(4096), _sft_engine(16)
        nll, count = 0.0, 0
        with torch.no_grad():
            for s in batch:
                logits = one.lm(s.input_ids[None]).logits[0].float()
                logp = torch.log_softmax(logits[:-1], dim=-1)
                token_lp = logp.gather(-1, s.input_ids[1:, None]).squeeze(-1)
                nll -= float(token_lp[s.loss_mask[1:]].sum())
                count += s.num_loss_tokens
        assert one.eval_loss(batch) == pytest.approx(nll / count, rel=1e-5)
        a, b = one.sft_step(batch), split.sft_step(batch)
    assert a["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert a["loss_tokens"] == count
    for (name, p), q in zip(one.lm.named_parameters(), split.lm.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_gsm8k_solution_ends_in_the_boxed_answer_the_reward_reads() -> None:
    from asyncrl.rewards import math_reward

    solution = "Half is 48/2 = <<48/2=24>>24.\nIn all 48+24 = <<48+24=72>>72.\n#### 1,072"
    text = gsm8k_boxed(solution)
    assert text == "Half is 48/2 = 24.\nIn all 48+24 = 72.\nThe final answer is \\boxed{1072}."
    assert math_reward(text, {"answer": "#### 1,072"}) == 1.0


def _tiny_tokenizer():  # type: ignore[no-untyped-def]
    from asyncrl.models.tiny import build_tokenizer

    return build_tokenizer()


def test_rendering_masks_the_chat_prompt_and_trains_answer_and_eos() -> None:
    from asyncrl.config.recipe import JsonlData
    from asyncrl.workflows.base import chat_messages, encode_chat

    tok = _tiny_tokenizer()
    source = JsonlData(path="unused.jsonl")
    cfg = SftConfig(instruction="Be brief.", system_prompt="sys", answer_format="gsm8k_boxed")
    rows = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}]
    (rec,) = sft_records(rows, source, cfg, "rows")
    assert rec["prompt"] == "What is 2 + 3?\nBe brief." and rec["answer"] == "5"
    sample, cut = render_example(tok, rec, cfg)
    assert sample is not None and not cut
    prompt_ids = encode_chat(tok, chat_messages(rec, "sys"))
    n_prompt = len(prompt_ids)
    assert sample.input_ids[:n_prompt].tolist() == prompt_ids
    assert tok.decode(prompt_ids).startswith("<|system|>sys\n<|user|>What is 2 + 3?")
    assert not sample.loss_mask[:n_prompt].any() and sample.loss_mask[n_prompt:].all()
    answer = sample.input_ids[n_prompt:].tolist()
    assert answer[-1] == tok.eos_token_id
    assert tok.decode(answer[:-1]) == "2 + 3 = 5\nThe final answer is \\boxed{5}."

    short = cfg.model_copy(update={"max_length": n_prompt + 3})
    cut_sample, was_cut = render_example(tok, rec, short)
    assert cut_sample is not None and was_cut and len(cut_sample) == n_prompt + 3
    assert int(cut_sample.loss_mask.sum()) == 3
    assert render_example(tok, rec, cfg.model_copy(update={"max_length": n_prompt})) == (
        None,
        False,
    )


def test_held_out_split_is_seeded_and_never_trained_on() -> None:
    recipe = load_sft_recipe(CI_SFT, [_data_set()])
    train, held = split_records(recipe)
    assert len(held) == recipe.sft.held_out and len(train) + len(held) == 48
    assert not {id(r) for r in held} & {id(r) for r in train}
    again_train, again_held = split_records(recipe)
    assert again_held == held and again_train == train
    other = recipe.model_copy(update={"run": recipe.run.model_copy(update={"seed": 2})})
    assert split_records(other)[1] != held


def _data_set(rel: str = "tests/data/sft_arithmetic.jsonl") -> str:
    return f"data.path={json.dumps(str(REPO / rel))}"


@pytest.mark.parametrize(
    ("sets", "names"),
    [
        (["sft.batch_sise=4"], ["sft.batch_sise", "unknown key", "batch_size"]),
        (["sft.max_length=1"], ["sft.max_length"]),
        (["rollout.group_size=4"], ["rollout", "remove them"]),
        (["trainer.temperature=0.5"], ["trainer.temperature"]),
        (["trainer.nodes=2"], ["trainer.nodes"]),
        (["sft.eval_prompts=20"], ["sft.eval_prompts", "held_out"]),
        (["data.path=missing.jsonl"], ["data.path", "missing.jsonl"]),
    ],
    ids=["typo", "too-short", "grpo-section", "derived", "nodes", "eval-prompts", "no-file"],
)
def test_a_bad_sft_recipe_fails_naming_the_key(sets: list[str], names: list[str]) -> None:
    with pytest.raises(RecipeError) as err:
        load_sft_recipe(CI_SFT, [_data_set(), *sets])
    assert all(n in str(err.value) for n in names), str(err.value)


def test_up_refuses_an_sft_recipe_naming_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncrl.entry.cli import main

    assert main(["up", str(CI_SFT)]) == 2
    assert "asyncrl sft" in capsys.readouterr().err


def test_every_sft_recipe_key_has_a_description() -> None:
    def walk(model: type) -> list[str]:
        missing = []
        for name, f in model.model_fields.items():  # type: ignore[attr-defined]
            if not f.description:
                missing.append(f"{model.__name__}.{name}")
            if isinstance(f.annotation, type) and hasattr(f.annotation, "model_fields"):
                missing += walk(f.annotation)
        return missing

    assert walk(SftRecipe) == []


def test_check_accepts_the_gsm8k_sft_recipe_as_written(tmp_path: Path) -> None:
    """From a checkout beside the offline GSM8K copy (``../shared/data/gsm8k``), as the
    recipe's paths name it; the command line dispatches on the ``[sft]`` section."""
    data = tmp_path / "shared" / "data" / "gsm8k"
    data.mkdir(parents=True)
    row = json.dumps({"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n"
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(row * 3)
    checkout = tmp_path / "repo"
    checkout.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "asyncrl.entry.cli", "check", str(GSM8K_SFT)]
    ok = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert 'answer_format = "gsm8k_boxed"' in ok.stdout
    bad = subprocess.run(
        [*cmd, "--set", "sft.held_outt=3"], cwd=checkout, capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2 and "sft.held_outt" in bad.stderr


@pytest.mark.slow
def test_asyncrl_sft_on_two_ranks_lowers_the_loss_and_exports_a_model_path(
    tmp_path: Path,
) -> None:
    """``asyncrl sft recipes/ci_sft.toml`` with ``trainer.nproc=2`` (torchrun, gloo, FSDP):
    the training loss of the last steps is below that of the first ones, the held-out loss
    drops, the held-out accuracy is recorded, and ``<run>/hf`` is a ``model.path`` that a
    GRPO recipe accepts and transformers loads."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [
            sys.executable, "-m", "asyncrl.entry.cli", "sft", str(CI_SFT), "--quiet",
            "--set", f"run.dir={json.dumps(str(tmp_path))}", "--set", _data_set(),
            "--set", "trainer.nproc=2", "--set", "sft.eval_every=0",
        ],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "ci_sft"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 9))
    first = sum(s["loss"] for s in steps[:2]) / 2
    last = sum(s["loss"] for s in steps[-2:]) / 2
    assert last < first - 0.5, (first, last)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 8]
    assert evals[1]["eval/loss"] < evals[0]["eval/loss"]
    assert all(0.0 <= e["eval/accuracy"] <= 1.0 and e["eval/prompts"] == 8 for e in evals)

    export = run / "hf"
    assert export.resolve() == (run / "checkpoints" / "step_000008" / "hf").resolve()
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["path"].endswith(
        "step_000008"
    )
    grpo = load_recipe(REPO / "recipes" / "ci.toml", [f"model.path={json.dumps(str(export))}"])
    from asyncrl.models.resolve import load_causal_lm, load_tokenizer

    lm = load_causal_lm(grpo.model.path)
    tok = load_tokenizer(grpo.model.path)
    assert tok.chat_template and lm.config.vocab_size == len(tok)
    assert math.isfinite(float(next(lm.parameters()).detach().sum()))
