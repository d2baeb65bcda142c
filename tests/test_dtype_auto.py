"""``model.dtype = "auto"``: bf16 where the device computes it natively, fp32 elsewhere,
decided by each component for its own device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers.tiny import TINY_NAME, tiny_config, train_config

from asyncrl.config.recipe import RecipeError, load_recipe
from asyncrl.engines.hf import HFEngine
from asyncrl.models import resolve as models
from asyncrl.models.resolve import ModelConfig, cpu_has_native_bf16, resolve_dtype
from asyncrl.train.engine import TrainEngine

REPO = Path(__file__).resolve().parents[1]

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
AVX512_BF16 = "flags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n"
AMX = "flags\t\t: fpu avx2 avx512f amx_tile amx_bf16 amx_int8\n"


@pytest.mark.parametrize(
    ("cpuinfo", "native"), [(AVX2, False), (AVX512_BF16, True), (AMX, True), ("", False)]
)
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo: str, native: bool) -> None:
    assert cpu_has_native_bf16(cpuinfo) is native


@pytest.mark.parametrize("native", [False, True])
def test_auto_is_bf16_on_cuda_and_on_bf16_cpus_only(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    # a dtype the recipe names is kept whatever the device
    assert resolve_dtype("float32", "cuda") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64", "cpu")


def test_the_recipe_takes_auto_and_names_the_key_of_a_bad_dtype() -> None:
    assert (
        load_recipe(REPO / "recipes" / "quickstart.toml", ["model.dtype=auto"]).model.dtype
        == "auto"
    )
    with pytest.raises(RecipeError, match=r"model\.dtype"):
        load_recipe(REPO / "recipes" / "ci.toml", ["model.dtype=float64"])


@pytest.mark.parametrize("native", [False, True])
def test_the_trainer_and_the_hf_engine_resolve_auto_for_their_device(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: native)
    want = torch.bfloat16 if native else torch.float32
    engine = TrainEngine(
        train_config(), ModelConfig(path=TINY_NAME, dtype="auto"), architecture=tiny_config()
    )
    assert engine.param_dtype == want
    # master weights stay fp32; the published weights are in the compute dtype
    assert all(p.dtype == torch.float32 for p in engine.lm.parameters())
    bucket = next(iter(engine.iter_weights(1 << 20)))
    assert {t.dtype for _, t in bucket} == {want}
    hf = HFEngine(ModelConfig(path=TINY_NAME, dtype="auto"))
    assert hf.dtype == ("bfloat16" if native else "float32")
