"""The benches' summaries over repeats and seeds, on hand-made figures: the placements
bench compares medians, and vs_trl's verdict is the speedup of the mean completions/s at a
mean held-out accuracy no lower than TRL's. No bench runs here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


def pair(
    workload: str, seed: int, a_cps: float, t_cps: float, acc: tuple[float, float, float]
) -> dict[str, Any]:
    before, a_acc, t_acc = acc
    return {
        "workload": workload,
        "seed": seed,
        "asyncrl": {"completions_per_s": a_cps},
        "trl": {"completions_per_s": t_cps},
        "heldout_accuracy": {"before": before, "asyncrl": a_acc, "trl": t_acc},
    }


def test_the_speedup_is_of_the_means_and_the_verdict_needs_both_halves() -> None:
    vs_trl = load("vs_trl")
    pairs = [
        pair("quick", 1, 3.0, 1.0, (0.2, 0.5, 0.4)),  # 3.0x on its own
        pair("quick", 2, 1.0, 1.0, (0.3, 0.4, 0.4)),  # 1.0x on its own
        pair("long", 1, 2.0, 1.0, (0.2, 0.3, 0.6)),
    ]
    quick, long = vs_trl.summary_table(pairs)
    # means 2.0 vs 1.0 = 2.00x
    assert "quick (2 seed(s)): asyncrl 2.00 vs TRL 1.00 completions/s = 2.00x" in quick
    assert "held-out mean 0.250 -> asyncrl 0.450, TRL 0.400" in quick
    # the goal is 2x at TRL's accuracy or better: 2.00x meets it
    assert quick.split("[")[0].endswith("goal (>= 2x at >= TRL's accuracy) met  ")
    # fast enough, but less accurate than TRL: not met
    assert "= 2.00x" in long and "asyncrl 0.300, TRL 0.600" in long
    assert "NOT met" in long


def test_a_speedup_of_means_differs_from_a_mean_of_speedups() -> None:
    vs_trl = load("vs_trl")
    # 4/1 and 1/4: mean of ratios 2.125, ratio of means (2.5 / 2.5) 1.00
    line = vs_trl.summary_table(
        [pair("quick", 1, 4.0, 1.0, (0, 1, 1)), pair("quick", 2, 1.0, 4.0, (0, 1, 1))]
    )[0]
    assert "= 1.00x" in line and "NOT met" in line


def test_summarize_reads_the_kept_pairs_and_names_the_missing_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    vs_trl = load("vs_trl")
    monkeypatch.setattr(vs_trl, "WORK", tmp_path)
    for seed, a_cps in ((1, 2.0), (3, 1.0)):
        folder = tmp_path / f"long-s{seed}"
        folder.mkdir()
        result = pair("long", seed, a_cps, 1.0, (0.1, 0.5, 0.5))
        (folder / "result.json").write_text(json.dumps(result))
    vs_trl.summarize(["long", "quick"], [1, 2, 3])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "not run (no result.json): long seed 2, quick seed 1, quick seed 2, quick seed 3"
    )
    assert out[1].startswith("summary long (2 seed(s)): asyncrl 1.50 vs TRL 1.00")
    assert "= 1.50x" in out[1] and "NOT met" in out[1]
    assert len(out) == 2


def run(steps_per_hour: float, train_s: float | None, acc: float | None) -> dict[str, Any]:
    return {
        "steps_per_hour": steps_per_hour,
        "train_s_mean": train_s,
        "trainer_idle_frac": 0.0,
        "gen_idle_frac": None,
        "accuracy_final": acc,
        "eta": 2,
    }


def test_repeats_are_summarised_by_their_medians() -> None:
    bench = load("async_vs_sync")
    runs = [run(121.0, 29.0, 0.5), run(115.0, None, None), run(130.0, 31.0, 0.6)]
    out = bench.summarise_repeats(runs)
    assert out["steps_per_hour"] == 121.0  # median of 115, 121, 130
    assert out["train_s_mean"] == 30.0  # median of the two known: (29 + 31) / 2
    assert out["gen_idle_frac"] is None  # no run knew it
    assert out["accuracy_final"] == pytest.approx(0.55)  # mean of the known accuracies
    assert out["steps_per_hour_runs"] == [121.0, 115.0, 130.0]
    assert out["repeats"] == runs
    assert bench.median([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_a_finished_run_is_resumed_only_with_the_same_overrides(tmp_path: Path) -> None:
    bench = load("async_vs_sync")
    assert bench.finished_run(tmp_path, ["a=1"]) is None  # never finished
    (tmp_path / bench.FINISHED).write_text(json.dumps({"process_s": 61.5, "sets": ["a=1"]}))
    assert bench.finished_run(tmp_path, ["a=1"]) == 61.5
    assert bench.finished_run(tmp_path, ["a=2"]) is None  # other overrides: run it again
    (tmp_path / bench.FINISHED).write_text("{cut short")
    assert bench.finished_run(tmp_path, ["a=1"]) is None


def test_a_stopped_run_counts_the_steps_it_finished(tmp_path: Path) -> None:
    bench = load("async_vs_sync")
    (tmp_path / "recipe.json").write_text(
        json.dumps({"buffer": {"max_head_offpolicyness": 2, "max_concurrent": 32, "batch_size": 8}})
    )
    (tmp_path / bench.STOPPED).write_text(json.dumps({"after_s": 180.0, "exit": 130}))

    def steps(*times: float) -> None:
        rows = [
            {"time": t, "time_wait_batch_s": 1.0, "time_train_s": 40.0 + i, "time_weights_s": 0.5,
             "reward_mean": 0.25, "staleness_mean": 1.0}
            for i, t in enumerate(times)
        ]  # fmt: skip
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    steps(1000.0)  # one step: no window to measure a rate over
    one = bench.summarise_run(tmp_path, 180.0)
    assert (one["steps_per_hour"], one["train_s_mean"], one["stopped"]) == (0.0, 40.0, 180.0)
    steps(1000.0, 1050.0, 1150.0)  # steps 2..3 took 150 s: 2 steps in 150 s
    three = bench.summarise_run(tmp_path, 180.0)
    assert three["steps_per_hour"] == pytest.approx(48.0)
    assert three["train_s_mean"] == pytest.approx(41.5)  # steps 2 and 3
    assert three["stopped"] == 180.0 and three["accuracy_final"] is None
