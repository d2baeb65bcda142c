"""``asyncrl plot``: the curves of a run folder as PNG files.

Reads ``metrics.jsonl`` (one record per trainer step), ``eval.jsonl`` (one per
evaluation) and ``trained_samples.jsonl`` (the staleness of every trained sample), and
writes into ``<run>/plots/`` (or ``out``):

- ``reward.png``: training reward and held-out accuracy against step and against wall time;
- ``staleness.png``: the distribution of trained samples' staleness;
- ``throughput.png``: per-step samples/s and tokens/s per role (trainer, each rollout
  actor, eval);
- ``response_length.png``: mean and max response length, and the share clipped;
- ``time_split.png``: per step, the seconds spent waiting for a batch, training, syncing
  weights, and the rollout actors' generation pause.

With ``vs``, a second run goes on the same axes (e.g. η = 0 against η = 2). Every figure
is ``FIGSIZE`` × ``DPI`` pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.observe.audit import read_jsonl

FIGSIZE = (12.0, 5.0)
DPI = 100
PIXELS = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))
"""Width and height of every PNG."""

PLOTS_DIR = "plots"


@dataclass
class RunData:
    """A run folder's records, with wall time in minutes since the run's first record."""

    name: str
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    t0: float = 0.0

    @classmethod
    def load(cls, run_dir: Path) -> RunData:
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        evals = read_jsonl(run_dir / "eval.jsonl")
        samples = read_jsonl(run_dir / "trained_samples.jsonl")
        times = [r["time"] for r in metrics + evals if "time" in r]
        return cls(
            name=run_dir.name,
            metrics=metrics,
            evals=evals,
            staleness=[int(s["staleness"]) for s in samples if "staleness" in s],
            t0=min(times, default=0.0),
        )

    def series(
        self, key: str, rows: str = "metrics", x: str = "step"
    ) -> tuple[list[float], list[float]]:
        """``(xs, ys)`` of the records holding ``key``; ``x`` is ``step`` or ``minutes``."""
        xs, ys = [], []
        for r in self.metrics if rows == "metrics" else self.evals:
            value = r.get(key)
            if not isinstance(value, int | float):
                continue
            xs.append((r["time"] - self.t0) / 60 if x == "minutes" else r.get("step", 0))
            ys.append(float(value))
        return xs, ys

    def keys(self, prefix: str) -> list[str]:
        found: dict[str, None] = {}
        for r in self.metrics:
            for k in r:
                if k.startswith(prefix):
                    found[k] = None
        return list(found)


def _figure(ncols: int = 1) -> tuple[Any, Any]:
    # heavy: matplotlib loads when a plot is drawn, not with every process that records
    import matplotlib  # noqa: PLC0415 - heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - heavy, and after use("Agg")

    fig, axes = plt.subplots(1, ncols, figsize=FIGSIZE, dpi=DPI, squeeze=False)
    return fig, axes[0]


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt  # noqa: PLC0415 - heavy; loaded by _figure already

    fig.tight_layout()
    fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": every PNG has the same size
    plt.close(fig)
    return path


_STYLES = ("-", "--")


def plot_reward(runs: list[RunData], path: Path) -> Path:
    fig, (by_step, by_time) = _figure(2)
    for run, style in zip(runs, _STYLES, strict=False):
        label = f"{run.name}: " if len(runs) > 1 else ""
        for ax, x in ((by_step, "step"), (by_time, "minutes")):
            ax.plot(
                *run.series("reward_mean", x=x), style, color="C0", label=f"{label}train reward"
            )
            for i, key in enumerate(_eval_keys(run)):
                ax.plot(
                    *run.series(key, rows="evals", x=x),
                    style,
                    marker="o",
                    color=f"C{i + 1}",
                    label=f"{label}held-out {key.removeprefix('eval/')}",
                )
    by_step.set_xlabel("trainer step (policy version)")
    by_time.set_xlabel("wall time (minutes)")
    for ax in (by_step, by_time):
        ax.set_ylabel("reward / accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("reward and held-out accuracy")
    return _save(fig, path)


def _eval_keys(run: RunData) -> list[str]:
    keys: dict[str, None] = {}
    for r in run.evals:
        for k in r:
            if k == "eval/accuracy" or k.startswith(("eval/pass@", "eval/mean@")):
                keys[k] = None
    return list(keys)


def plot_staleness(runs: list[RunData], path: Path) -> Path:
    fig, (ax,) = _figure(1)
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        if not run.staleness:
            continue
        top = max(run.staleness)
        counts = [run.staleness.count(s) for s in range(top + 1)]
        shares = [c / len(run.staleness) for c in counts]
        xs = [s + (i - (len(runs) - 1) / 2) * width for s in range(top + 1)]
        ax.bar(xs, shares, width=width, label=f"{run.name} ({len(run.staleness)} samples)")
    ax.set_xlabel("staleness (trained version − oldest token's version)")
    ax.set_ylabel("share of trained samples")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle("staleness distribution")
    return _save(fig, path)


def step_rates(run: RunData, key: str) -> tuple[list[float], list[float]]:
    """Per-step rate of a per-step count (``samples``, ``train/tokens``): the count over the
    wall time since the previous step's record (the first step has no such interval)."""
    xs, ys = [], []
    for prev, cur in zip(run.metrics, run.metrics[1:], strict=False):
        dt = cur.get("time", 0.0) - prev.get("time", 0.0)
        if isinstance(cur.get(key), int | float) and dt > 0:
            xs.append(cur["step"])
            ys.append(float(cur[key]) / dt)
    return xs, ys


def plot_throughput(runs: list[RunData], path: Path) -> Path:
    fig, (samples_ax, gen_ax, eval_ax) = _figure(3)
    for run, style in zip(runs, _STYLES, strict=False):
        label = f"{run.name}: " if len(runs) > 1 else ""
        samples_ax.plot(*step_rates(run, "samples"), style, label=f"{label}trained samples/s")
        gen_ax.plot(*step_rates(run, "train/tokens"), style, label=f"{label}trainer tokens/s")
        for key in run.keys("rollout/"):
            if key == "rollout/tokens_per_s":
                gen_ax.plot(*run.series(key), style, label=f"{label}rollout (all) tokens/s")
            elif key.endswith("/tokens_per_s"):
                name = key.removeprefix("rollout/").removesuffix("/tokens_per_s")
                gen_ax.plot(*run.series(key), style, alpha=0.6, label=f"{label}{name} tokens/s")
        xs, ys = run.series("eval/tokens_per_s", rows="evals")
        eval_ax.plot(xs, ys, style, marker="o", label=f"{label}eval tokens/s")
    titles = ("trainer", "trainer and rollout actors", "eval actor")
    for ax, title in zip((samples_ax, gen_ax, eval_ax), titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    samples_ax.set_ylabel("samples / s")
    gen_ax.set_ylabel("tokens / s")
    fig.suptitle("throughput per role (average over each step)")
    return _save(fig, path)


def plot_response_length(runs: list[RunData], path: Path) -> Path:
    fig, (length_ax, clip_ax) = _figure(2)
    for run, style in zip(runs, _STYLES, strict=False):
        label = f"{run.name}: " if len(runs) > 1 else ""
        length_ax.plot(*run.series("response_length/mean"), style, color="C0", label=f"{label}mean")
        length_ax.plot(*run.series("response_length/max"), style, color="C1", label=f"{label}max")
        clip_ax.plot(
            *run.series("response_length/clip_ratio"),
            style,
            color="C2",
            label=f"{label}hit max_new_tokens",
        )
    length_ax.set_ylabel("tokens")
    clip_ax.set_ylabel("share of samples")
    for ax in (length_ax, clip_ax):
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("response length")
    return _save(fig, path)


TIME_PARTS = (
    ("time_wait_batch_s", "waiting for a batch"),
    ("time_train_s", "train"),
    ("time_weights_s", "weight sync"),
    ("time_gen_pause_s", "generation pause"),
)


def plot_time_split(runs: list[RunData], path: Path) -> Path:
    fig, (ax,) = _figure(1)
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        steps = [r["step"] for r in run.metrics]
        xs = [s + (i - (len(runs) - 1) / 2) * width for s in steps]
        bottom = [0.0] * len(steps)
        for j, (key, name) in enumerate(TIME_PARTS):
            ys = [float(r.get(key) or 0.0) for r in run.metrics]
            label = f"{run.name}: {name}" if len(runs) > 1 else name
            ax.bar(
                xs, ys, width=width, bottom=bottom, color=f"C{j}", alpha=1.0 - 0.45 * i, label=label
            )
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    ax.set_xlabel("trainer step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, ncols=2)
    fig.suptitle("where a step's time goes")
    return _save(fig, path)


MISMATCH_PANELS = (
    ("train/mismatch/kl", "KL(behaviour ‖ trainer), k3 mean"),
    ("train/mismatch/max_abs_logprob_diff", "max |log π_trainer − log π_behav|"),
    ("train/mismatch/ratio_out_frac", "share of ratios outside [0.5, 2]"),
)
"""The rollout–trainer mismatch per step (:mod:`asyncrl.algo.mismatch`): how far the
trainer's logprobs of the sampled tokens are from the engine's."""


def plot_mismatch(runs: list[RunData], path: Path) -> Path:
    fig, axes = _figure(len(MISMATCH_PANELS))
    for ax, (key, title) in zip(axes, MISMATCH_PANELS, strict=True):
        for run, style in zip(runs, _STYLES, strict=False):
            ax.plot(*run.series(key), style, label=run.name)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("trainer step (policy version)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("rollout–trainer mismatch")
    return _save(fig, path)


PLOTS = {
    "reward.png": plot_reward,
    "staleness.png": plot_staleness,
    "throughput.png": plot_throughput,
    "response_length.png": plot_response_length,
    "time_split.png": plot_time_split,
    "mismatch.png": plot_mismatch,
}


def plot_run(run_dir: Path, vs: Path | None = None, out: Path | None = None) -> list[Path]:
    """Writes every figure of ``run_dir`` (against ``vs`` if given); returns the paths.
    Raises ``FileNotFoundError`` when the folder has no ``metrics.jsonl``."""
    runs = [RunData.load(run_dir)]
    if vs is not None:
        runs.append(RunData.load(vs))
    for path, run in zip([run_dir, vs], runs, strict=False):
        if not run.metrics and path is not None:
            raise FileNotFoundError(f"{path} has no metrics.jsonl records to plot")
    if len(runs) > 1 and runs[0].name == runs[1].name:
        runs[0].name, runs[1].name = str(run_dir), str(vs)
    out = out or run_dir / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    return [draw(runs, out / name) for name, draw in PLOTS.items()]
