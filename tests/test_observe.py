"""Observability pieces without a run: sinks, held-out split, eval scoring math, batch
statistics, entropy, the tracer, the dashboard (driven by recorded metrics) and plots."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from asyncrl.actors.eval import mean_at_k, pass_at_k
from asyncrl.config import recipe as config_module
from asyncrl.config import run as run_section
from asyncrl.config.recipe import RecipeError, load_recipe
from asyncrl.data import held_out_indices, load_eval_records, load_prompt_records
from asyncrl.observe import fleet as fleet_module
from asyncrl.observe.dashboard import DashboardState
from asyncrl.observe.records import batch_stats
from asyncrl.observe.sinks import open_sinks
from asyncrl.runtime.trace import Tracer, merge_traces
from asyncrl.weights.version import Wanted
from asyncrl.wire.messages import ActorInfo, Array, Group, Metrics, Trajectory

RECORDED = Path(__file__).parent / "data" / "recorded_metrics.jsonl"


def recipe_with(tmp_path: Path, *sets: str) -> config_module.Recipe:
    return load_recipe(None, [f"run.dir={tmp_path}", *sets])


# -- config ------------------------------------------------------------------------------------


def test_eval_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"eval\.max_prompts"):
        recipe_with(tmp_path, "eval.every=2", "data.size=10", "eval.max_prompts=10")
    with pytest.raises(RecipeError, match="nothing would be scored"):
        recipe_with(tmp_path, "eval.every=2", "eval.greedy=false")
    with pytest.raises(RecipeError, match="trace_steps"):
        recipe_with(tmp_path, "run.trace_steps=6:2")


def test_missing_optional_sink_packages_fail_at_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_section, "_importable", lambda name: False)
    with pytest.raises(RecipeError, match=r"run\.wandb.*pip install wandb"):
        recipe_with(tmp_path, "run.tensorboard=false", 'run.wandb.project="p"')
    with pytest.raises(RecipeError, match=r"run\.tensorboard"):
        recipe_with(tmp_path, "run.tensorboard=true")
    # the default follows what is installed
    assert recipe_with(tmp_path).run.tensorboard is False


# -- held-out split ------------------------------------------------------------------------------


def test_held_out_split_is_deterministic_and_never_trained_on(tmp_path: Path) -> None:
    recipe = recipe_with(tmp_path, "data.size=50", "eval.every=4", "eval.max_prompts=8")
    train, held = load_prompt_records(recipe), load_eval_records(recipe)
    assert len(held) == 8 and len(train) == 42
    train_prompts = {r["prompt"] + r["answer"] for r in train}
    assert not any(r["prompt"] + r["answer"] in train_prompts for r in held)
    assert held_out_indices(recipe, 50) == held_out_indices(recipe, 50)
    assert load_eval_records(recipe) == held
    # evaluation off, or on its own data: the training data is whole
    assert len(load_prompt_records(recipe_with(tmp_path, "data.size=50"))) == 50
    own = recipe_with(
        tmp_path,
        "data.size=50",
        "eval.every=4",
        "eval.max_prompts=5",
        'eval.data.type="arithmetic"',
        "eval.data.size=20",
    )
    assert len(load_prompt_records(own)) == 50
    assert len(load_eval_records(own)) == 5


# -- eval and batch statistics -------------------------------------------------------------------


def test_pass_and_mean_at_k_by_hand() -> None:
    rewards = [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
    assert pass_at_k(rewards) == pytest.approx(2 / 3)
    assert mean_at_k(rewards) == pytest.approx((0.25 + 0.0 + 0.75) / 3)
    assert [v for v in range(11) if Wanted(every=4, last=10)(v)] == [0, 4, 8, 10]


def _traj(
    reward: float, n_generated: int, finish: str, mask: list[int] | None = None
) -> Trajectory:
    mask = mask if mask is not None else [0, 0] + [1] * n_generated
    return Trajectory(
        uid=f"p/{reward}",
        prompt_uid="p",
        group_index=0,
        group_size=2,
        input_ids=Array.of([1] * len(mask), "int32"),
        loss_mask=Array.of(mask, "bool"),
        logprobs=Array.of([0.0] * len(mask), "float32"),
        versions=Array.of([0] * len(mask), "int32"),
        reward=reward,
        finish_reason=finish,
    )


def _groups(*trajectories: Trajectory) -> list[Group]:
    """The batch's groups of two, in order."""
    samples = [t.to_train_sample() for t in trajectories]
    return [
        Group(prompt_uid="p", samples=pair, shaped_rewards=[t.reward for t in pair])
        for pair in (samples[i : i + 2] for i in range(0, len(samples), 2))
    ]


def test_batch_stats_by_hand() -> None:
    batch = [
        _traj(0.0, 3, "stop"),
        _traj(0.0, 5, "stop"),  # group 1: all zero
        _traj(1.0, 8, "length"),
        _traj(0.0, 2, "stop"),  # group 2: std 0.5
        _traj(1.0, 4, "stop"),
        _traj(1.0, 8, "stop"),  # group 3: all one; 8 tokens is the budget
    ]
    stats = batch_stats(_groups(*batch), max_new_tokens=8)
    assert stats["response_length/mean"] == pytest.approx(30 / 6)
    assert stats["response_length/max"] == 8
    assert stats["response_length/clip_ratio"] == pytest.approx(2 / 6)
    assert stats["reward_groups/all_zero"] == pytest.approx(1 / 3)
    assert stats["reward_groups/all_one"] == pytest.approx(1 / 3)
    assert stats["reward_groups/std_mean"] == pytest.approx(0.5 / 3)
    assert stats["versions/mixed_samples"] == 0
    # an update landed mid-sequence: the prompt's -1s do not count as a version
    mixed = batch[0].model_copy(update={"versions": Array.of([-1, -1, 3, 3, 4], "int32")})
    assert mixed.versions_spanned == 2 and batch[0].versions_spanned == 1
    stats = batch_stats(_groups(mixed, *batch[1:]), max_new_tokens=8)
    assert stats["versions/mixed_samples"] == 1
    # two replies of 6 (12 generated tokens, over one reply's budget of 8) that stopped on
    # their own are not cut; the same sample ending on the budget is
    two = _traj(1.0, 0, "stop", mask=[0] * 3 + [1] * 6 + [0] * 4 + [1] * 6)
    assert batch_stats(_groups(two, two), 8)["response_length/clip_ratio"] == 0
    cut = two.model_copy(update={"finish_reason": "length"})
    assert batch_stats(_groups(two, cut), 8)["response_length/clip_ratio"] == 0.5


def test_chunk_entropy_by_hand() -> None:
    import torch

    from asyncrl.train.models import chunk_logprobs

    def entropy(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
        return chunk_logprobs(hidden, weight, None, torch.zeros(2, dtype=torch.long), temperature)[
            1
        ]

    hidden = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])  # V = 3
    h = entropy(hidden, weight, 1.0)
    assert h[0].item() == pytest.approx(math.log(3))  # uniform
    p = torch.softmax(torch.tensor([1.0, 0.0, 0.0]), 0)
    assert h[1].item() == pytest.approx(float(-(p * p.log()).sum()), rel=1e-6)
    # temperature 2 halves the logits
    p2 = torch.softmax(torch.tensor([0.5, 0.0, 0.0]), 0)
    assert entropy(hidden, weight, 2.0)[1].item() == pytest.approx(
        float(-(p2 * p2.log()).sum()), rel=1e-6
    )


# -- sinks ------------------------------------------------------------------------------------------


def test_tensorboard_holds_the_jsonl_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = recipe_with(tmp_path, "run.tensorboard=true")
    sinks = open_sinks(recipe, tmp_path, jsonl="m.jsonl", job="trainer")
    records = [
        {
            "step": s,
            "reward_mean": 0.1 * s,
            "eval/accuracy": s / 4,
            "note": "x",
            "loss": None,
            "time": 1000.0 + s,
        }
        for s in (1, 2, 3)
    ]
    for r in records:
        sinks.log(r, r["step"])
    sinks.close()
    assert [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()] == records
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward_mean", "eval/accuracy"}
    got = [(e.step, e.wall_time, e.value) for e in acc.Scalars("reward_mean")]
    assert got == [(s, 1000.0 + s, pytest.approx(0.1 * s)) for s in (1, 2, 3)]


def test_wandb_offline_sink_writes_a_local_run(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    recipe = recipe_with(
        tmp_path,
        "run.tensorboard=false",
        'run.wandb.mode="offline"',
        'run.wandb.project="asyncrl-test"',
    )
    sinks = open_sinks(recipe, tmp_path, jsonl="m.jsonl", job="trainer")
    sinks.log({"step": 1, "reward_mean": 0.5, "time": 1.0}, 1)
    sinks.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb"))


# -- trace ------------------------------------------------------------------------------------------


def test_tracer_window_lanes_and_merge(tmp_path: Path) -> None:
    version = {"v": 0}
    off = Tracer(None, "x", "rollout", None)
    with off.span("generate"):
        pass
    roll = Tracer(tmp_path, "rollout-0", "rollout", (1, 2), lambda: version["v"])
    with roll.span("generate"):
        pass  # version 0: outside the window
    version["v"] = 1
    with roll.span("generate", prompt="a"), roll.span("generate", prompt="b"):
        pass  # overlapping: two lanes
    version["v"] = 3
    with roll.span("generate"):
        pass
    roll.close()
    train = Tracer(tmp_path, "trainer-0", "trainer", (1, 2), lambda: 2)
    with train.span("train"):
        pass
    train.close()
    trace = json.loads(merge_traces(tmp_path).read_text())  # type: ignore[union-attr]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["cat"], e["tid"]) for e in spans) == [
        ("rollout", 0),
        ("rollout", 1),
        ("trainer", 0),
    ]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rollout-0 (rollout)", "trainer-0 (trainer)"}
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)


# -- dashboard --------------------------------------------------------------------------------------


def _recorded() -> list[Metrics]:
    rows = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    out = []
    for r in rows:
        role, actor, step, t = r.pop("role"), r.pop("actor_id"), r["step"], r["time"]
        values = {k: float(v) for k, v in r.items() if isinstance(v, int | float)}
        out.append(Metrics(role=role, actor_id=actor, step=step, time=t, values=values))
    return out


def _text(state: DashboardState, now: float) -> str:
    console = Console(record=True, width=160, color_system=None)
    console.print(state.render(now))
    return console.export_text()


def test_dashboard_renders_recorded_metrics() -> None:
    recorded = _recorded()
    t0 = recorded[0].time
    state = DashboardState(run="ci", max_steps=16, batch_size=8, started=t0 - 10)
    for role, actor in (("buffer", "buffer-0"), ("rollout", "rollout-0"), ("reward", "reward-0")):
        state.on_heartbeat(ActorInfo(role=role, actor_id=actor, pid=1, host="h"), now=t0)
    rollout = {"episodes": 5, "leased": 9, "gen_tokens_per_s": 41.5, "samples_per_s": 3.0}
    state.on_metrics(
        Metrics(role="rollout", actor_id="rollout-0", time=t0, values={**rollout, "version": 0})
    )
    before = _text(state, t0)
    assert "generating: 5/8 groups" in before
    assert "(9 leased)" in before
    assert "actors alive: buffer 1, reward 1, rollout 1" in before
    assert "41.5" in before  # the rollout actor's tokens/s

    for m in recorded:
        state.on_metrics(m)
    after = _text(state, t0 + 1)
    last = [m for m in recorded if m.role == "trainer"][-1].values
    assert f"step {int(last['step'])}/16" in after
    assert f"{last['reward_mean']:.3f}" in after
    assert "generating" not in after
    last_eval = [m for m in recorded if m.role == "eval"][-1].values
    assert f"accuracy {last_eval['eval/accuracy']:.3f}" in after
    assert f"@v{int(last_eval['version'])}" in after
    assert "staleness of trained samples" in after and "█" in after
    assert f"{last['accepted']:.0f} / {last['rejected']:.0f}" in after
    # heartbeats older than the window no longer count
    assert "actors alive: -" in _text(state, t0 + 60)
    assert state.plain_line().startswith(f"step {int(last['step'])}/16")


def test_plots_of_a_recorded_run_and_a_comparison(tmp_path: Path) -> None:
    from PIL import Image

    from asyncrl.observe.plot import PIXELS, plot_run

    runs = []
    for name, shift in (("eta0", 0.0), ("eta2", 0.1)):
        run = tmp_path / name
        run.mkdir()
        recorded = [json.loads(line) for line in RECORDED.read_text().splitlines()]
        with open(run / "metrics.jsonl", "w") as m, open(run / "eval.jsonl", "w") as e:
            for r in recorded:
                r["reward_mean"] = r.get("reward_mean", 0.0) + shift
                (m if r["role"] == "trainer" else e).write(json.dumps(r) + "\n")
        (run / "trained_samples.jsonl").write_text(
            "".join(json.dumps({"staleness": s % 3}) + "\n" for s in range(10))
        )
        runs.append(run)
    paths = plot_run(runs[0], vs=runs[1])
    assert {p.name for p in paths} == {
        "reward.png",
        "staleness.png",
        "throughput.png",
        "response_length.png",
        "time_split.png",
        "mismatch.png",
    }
    for p in paths:
        assert p.stat().st_size > 10_000
        assert Image.open(p).size == PIXELS
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl"):
        plot_run(tmp_path / "nothing")


def test_fleet_counts_a_role_whose_actors_went_silent_as_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A role heard from earlier reads 0 live actors when its heartbeats stop (a loaded
    machine can delay them past the window): the key stays in every step's record."""
    clock = [100.0]
    # the fleet module's clock only: asyncio.run below reads time.monotonic too
    monkeypatch.setattr(fleet_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    view = fleet_module.FleetView(trainer_ranks=2)
    info = ActorInfo(role="rollout", actor_id="rollout-a", pid=1, host="h")
    assert view.fleet_stats()["actors/rollout"] == 0.0  # before the first heartbeat
    asyncio.run(view.on_heartbeat(info))
    assert view.fleet_stats()["actors/rollout"] == 1.0
    assert view.fleet_stats()["actors/trainer"] == 2.0
    clock[0] += fleet_module.ALIVE_WINDOW + 0.5
    stats = view.fleet_stats()
    assert stats["actors/rollout"] == 0.0
    assert stats["actors/buffer"] == 0.0 and "actors/reward" not in stats
    asyncio.run(view.on_heartbeat(info))
    assert view.fleet_stats()["actors/rollout"] == 1.0


def test_fleet_sums_the_cores_the_rollout_actors_kept_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cores/rollout`` by hand: before a second view of an actor, its own average since
    it started (``cores_total``); then its CPU seconds over the seconds between two views,
    summed over the live actors; with no record since the last view, the average again.
    Actor a: 0.9 on average, then 6 s of CPU in 8 s (0.75); actor b: 0.25, then 2 s in
    8 s (0.25): 1.15, then 1.0."""
    clock = [100.0]
    monkeypatch.setattr(fleet_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    view = fleet_module.FleetView(trainer_ranks=1)

    def report(actor: str, t: float, cpu: float, total: float) -> None:
        asyncio.run(view.on_heartbeat(ActorInfo(role="rollout", actor_id=actor, pid=1, host="h")))
        values = {"tokens": 0.0, "cpu_s": cpu, "cores_total": total}
        metrics = Metrics(actor_id=actor, role="rollout", step=0, time=t, values=values)
        asyncio.run(view.on_rollout_metrics(metrics))

    report("a", 10.0, 9.0, 0.9)
    report("b", 10.0, 2.5, 0.25)
    assert view.fleet_stats()["cores/rollout"] == pytest.approx(1.15)
    report("a", 18.0, 15.0, 0.83)
    report("b", 18.0, 4.5, 0.25)
    assert view.fleet_stats()["cores/rollout"] == pytest.approx(1.0)
    # no record since the last view: each actor's average since it started, 0.83 + 0.25
    assert view.fleet_stats()["cores/rollout"] == pytest.approx(1.08)


async def test_the_trainer_can_wait_for_a_roles_first_heartbeat() -> None:
    view = fleet_module.FleetView(trainer_ranks=1)
    assert not await view.wait_for("eval", 0.01)  # none yet: False at the limit
    waiter = asyncio.create_task(view.wait_for("eval", 30))
    await asyncio.sleep(0.01)
    await view.on_heartbeat(ActorInfo(role="rollout", actor_id="rollout-0", pid=1, host="h"))
    await asyncio.sleep(0.01)
    assert not waiter.done()  # another role's heartbeat is not the eval actor's
    await view.on_heartbeat(ActorInfo(role="eval", actor_id="eval-0", pid=2, host="h"))
    assert await asyncio.wait_for(waiter, 5)
    assert await view.wait_for("eval", 0)  # heard from already: at once, even with no time
