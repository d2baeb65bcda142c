"""End to end: what a finished ``asyncrl up recipes/ci.toml --trace`` leaves to look at
(held-out evaluation, plots, TensorBoard events, the timeline), and an eval actor
attached to a live run."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
from e2e_kit import CI_RECIPE, REPO, cli, running_up
from test_e2e import RUN_TIMEOUT, read_jsonl, run

from asyncrl.wire.messages import Metrics
from asyncrl.wire.subjects import Subjects

pytestmark = pytest.mark.slow

ROLES = {"trainer", "buffer", "rollout", "reward", "eval"}


def ci_up(parent: Path, name: str, *sets: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The ci recipe with its evaluation on (it is off there): versions 0, 4, 8, ..."""
    sets = (f"run.dir={parent}", f"run.name={name}", "eval.every=4", *sets)
    flags = [x for s in sets for x in ("--set", s)]
    return cli("up", str(CI_RECIPE), *flags, *extra)


async def test_a_finished_ci_run_has_eval_plots_tensorboard_and_a_trace(tmp_path: Path) -> None:
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from asyncrl.observe.plot import PIXELS

    code, out = await run(
        ci_up(tmp_path, "ci", "rollout.cpus=[0]", extra=("--trace", "--trace-steps", "2:6"))
    )
    assert code == 0, out
    run_dir = tmp_path / "ci"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")

    # held-out evaluation at versions 0, every 4, and the last, greedy and k = 4
    assert [e["version"] for e in evals] == [0, 4, 8, 12, 16]
    for e in evals:
        assert 0 <= e["eval/accuracy"] <= 1 and 0 <= e["eval/mean@4"] <= e["eval/pass@4"] <= 1
        assert e["eval/prompts"] == 16

    # the metrics a researcher expects, in every trainer record
    for key in (
        "response_length/mean",
        "response_length/max",
        "response_length/clip_ratio",
        "reward_groups/all_zero",
        "reward_groups/all_one",
        "reward_groups/std_mean",
        "train/entropy",
        "time_wait_batch_s",
        "time_train_s",
        "time_weights_s",
        "time_gen_pause_s",
        "rollout/tokens_per_s",
        "actors/rollout",
    ):
        assert all(key in m for m in metrics), key
    assert metrics[-1]["actors/rollout"] == 1 and metrics[-1]["actors/reward"] == 1
    # the rollout actor's idle time (no episode running) reaches the trainer's records
    assert 0 <= metrics[-1]["rollout/idle_frac"] <= 1 and metrics[-1]["rollout/idle_s"] >= 0
    # where the cores went: every record has both, and both processes did some work
    assert all(m["cores/trainer"] > 0 and m["cores/rollout"] >= 0 for m in metrics)
    assert metrics[-1]["cores/rollout"] > 0
    assert all(m["train/entropy"] > 0 for m in metrics)
    assert (
        sum(v for k, v in metrics[-1].items() if k.startswith("staleness/"))
        == metrics[-1]["samples"]
    )

    # every plot, of the documented size
    for name in ("reward", "staleness", "throughput", "response_length", "time_split"):
        png = run_dir / "plots" / f"{name}.png"
        assert png.stat().st_size > 10_000, name
        assert Image.open(png).size == PIXELS, name

    # TensorBoard holds the same scalars as the JSONL files, read by TensorBoard's reader
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for rows in (metrics, evals):
        numeric = {k for r in rows for k, v in r.items() if isinstance(v, int | float)}
        for key in numeric - {"time", "step"}:  # the events' wall time and step
            assert key in tags, key
            logged = {e.step: e.value for e in acc.Scalars(key)}
            expected = {
                r["step"]: float(r[key]) for r in rows if isinstance(r.get(key), int | float)
            }
            # "version" is logged by both writers: every record's value must be there
            got = {s: logged.get(s) for s in expected}
            assert got == pytest.approx(expected, rel=1e-6, abs=1e-6), key
    assert {e.step for e in acc.Scalars("reward_mean")} == {m["step"] for m in metrics}

    # the timeline: valid Chrome-trace JSON with spans of every role
    trace = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == ROLES
    names = {e["name"] for e in spans}
    assert {"generate", "score", "lease", "train", "load weights"} <= names
    for e in spans:
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["dur"] >= 0
        assert 2 <= e["args"]["version"] <= 6 or e["cat"] == "reward"

    # the plot command, two runs on the same axes
    code, out = await run(
        cli("plot", "--run", str(run_dir), "--vs", str(run_dir), "--out", str(tmp_path / "vs"))
    )
    assert code == 0, out
    assert Image.open(tmp_path / "vs" / "reward.png").size == PIXELS


async def test_an_eval_actor_attaches_to_a_live_run(tmp_path: Path) -> None:
    from asyncrl.runtime.bus import Bus
    from asyncrl.runtime.nats_server import nats_info_for_run

    seen: list[Metrics] = []
    got = asyncio.Event()

    async def on_eval(m: Metrics) -> None:
        if m.actor_id == "eval-extra":
            seen.append(m)
            got.set()

    # no step budget worth the name: the run is stopped (SIGTERM, as Ctrl-C) once the
    # attached actor has scored a version, however fast this machine steps
    argv = ci_up(tmp_path, "attach-eval", "trainer.max_steps=100000", extra=("--quiet",))
    async with running_up(tmp_path, "attach-eval", argv=argv) as up:
        run_dir = up.run_dir
        bus = await Bus.connect(nats_info_for_run(run_dir), name="test")
        try:
            await bus.subscribe(Subjects("attach-eval").metrics("eval"), Metrics, on_eval)
            attached = await asyncio.create_subprocess_exec(
                *cli("attach", "eval", "--run", str(run_dir), "--actor-id", "eval-extra"),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                cwd=REPO,
            )
            await asyncio.wait_for(got.wait(), RUN_TIMEOUT)
            up.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(up.proc.wait(), 120) == 0
            assert await asyncio.wait_for(attached.wait(), 60) == 0
        finally:
            await bus.close()
    assert "eval/accuracy" in seen[0].values
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert any(e["version"] == seen[0].step for e in evals)
