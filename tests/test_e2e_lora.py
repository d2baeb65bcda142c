"""The ci recipe with LoRA adapters, end to end: the trainer trains and checkpoints the
adapters alone and publishes them (over the object store), and the rollout engine
generates with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from e2e_kit import run, up_args

from asyncrl.train.config import LORA_TARGETS
from asyncrl.weights.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter


@pytest.mark.slow
async def test_ci_recipe_with_lora_trains_and_publishes_adapters_only(tmp_path: Path) -> None:
    steps = 4
    code, out = await run(
        up_args(
            tmp_path,
            "lora",
            "trainer.lora.rank=8",
            f"trainer.max_steps={steps}",
            "trainer.checkpoint_every=0",
            "weights.transport=object_store",
        )
    )
    assert code == 0, out
    run_dir = tmp_path / "lora"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))

    latest = Path(json.loads((run_dir / "checkpoints" / "latest.json").read_text())["path"])
    # the checkpoint holds the adapters (and their Adam moments), no base weight
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(latest / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    optim_keys = [k for k in saved if k.startswith("optim.state.")]
    assert optim_keys and all(".lora_A." in k or ".lora_B." in k for k in optim_keys)

    # what the rollouts load: the adapter alone, trained away from B = 0, on the
    # projections only (every other weight is the base model's)
    assert sorted(p.name for p in (latest / "hf").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    adapter = read_adapter(latest / "hf")
    assert {name.split(".")[-2] for name in adapter.factors} == set(LORA_TARGETS)
    assert all(torch.count_nonzero(b) for _, b in adapter.factors.values())

    # the rollout engine took each published adapter: samples of later versions trained
    trained = [
        json.loads(line) for line in (run_dir / "trained_samples.jsonl").read_text().splitlines()
    ]
    assert max(t["head_version"] for t in trained) >= steps - 2
    log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert f"version={steps - 1}" in log or f"version={steps}" in log
