"""``asyncrl``: the command line.

Only argparse, the config schema and the launchers that need neither torch nor NATS load
at start; what runs a run (``up``, an actor, the NATS clients of ``metrics`` and
``status``) and what reads its step records (``replay``, ``audit``, ``plot``: the wire
codec, numpy) is imported by the command that needs it, so ``asyncrl --help`` and
``asyncrl check`` are instant (``tests/test_config.py`` holds the CLI to that).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asyncrl import __version__
from asyncrl.config.checks import check_report, enforce_recipe
from asyncrl.config.recipe import RecipeError, dump_recipe, load_recipe, path_problems
from asyncrl.launch.slurm import slurm_job_problems, write_and_submit
from asyncrl.sft.config import is_sft_data, load_sft_recipe, read_recipe_data
from asyncrl.sft.run import sft
from asyncrl.train.torchrun import rank_main
from asyncrl.weights.choose import choose as choose_transport


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="TOML recipe (defaults when omitted)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set trainer.optim.lr=1e-6 (repeatable)",
    )


def add_replay_args(p: argparse.ArgumentParser) -> None:
    """``asyncrl replay``'s arguments, which the ranks of a replay under torchrun
    (:mod:`asyncrl.entry.replay`) parse too."""
    p.add_argument("run", type=Path, help="the run folder")
    p.add_argument(
        "--from",
        dest="start_from",
        metavar="CKPT",
        default=None,
        help="start from this checkpoint (its folder, or its step) instead of the initial weights",
    )
    p.add_argument("--until", type=int, default=None, metavar="STEP", help="stop after this step")
    p.add_argument(
        "--export",
        metavar="DIR",
        default=None,
        help="write the replayed weights of the last step there (HF, as the run published)",
    )


ATTACH_REFUSED = {
    "buffer": "a second buffer would answer the same lease and batch subjects with a separate "
    "state (its own version, budget and dataset position), so leases and admission would "
    "disagree",
    "trainer": "a second trainer would ask for the same steps, be served the same batches "
    "(the buffer answers each step once, for retries) and train them twice, publishing "
    "weights of its own; for more devices, set trainer.nproc (torchrun ranks per node) and "
    "trainer.nodes in the recipe",
}
"""Roles a run has exactly one of, and why one more cannot join it."""

ATTACHABLE = ("rollout", "reward", "eval")


def attach_refusal(role: str) -> str | None:
    """Why ``asyncrl attach ROLE`` must not start, or None when it may."""
    if role in ATTACH_REFUSED:
        return f"cannot attach a {role}: {ATTACH_REFUSED[role]}"
    if role not in ATTACHABLE:
        return f"cannot attach {role!r}: the roles that can join a run are {', '.join(ATTACHABLE)}"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous RL for language models: rollout, reward, buffer and "
        "trainer actors over NATS.",
    )
    parser.add_argument("--version", action="version", version=f"asyncrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a recipe: embedded NATS, every actor, progress")
    _add_recipe_args(up)
    up.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    up.add_argument(
        "--overwrite", action="store_true", help="replace an existing run folder of that name"
    )
    up.add_argument("--quiet", action="store_true", help="no progress lines")
    up.add_argument(
        "--trace",
        action="store_true",
        help="record every actor's spans and write <run>/trace.json (Chrome trace, Perfetto)",
    )
    up.add_argument(
        "--trace-steps",
        default="2:6",
        metavar="A:B",
        help="policy versions whose spans --trace records (default 2:6)",
    )
    up.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="open the embedded NATS server to other machines (run.listen), e.g. "
        "0.0.0.0:4222; clients need the credentials in <run>/nats.json",
    )
    up.add_argument("--tls-cert", metavar="PEM", help="server certificate: TLS only (run.tls_cert)")
    up.add_argument("--tls-key", metavar="PEM", help="its private key (run.tls_key)")
    up.add_argument(
        "--tls-ca", metavar="PEM", help="what clients trust for the certificate (run.tls_ca)"
    )
    up.add_argument(
        "--ray",
        metavar="ADDRESS",
        default="",
        help="place every actor on a Ray cluster (its address, or auto; the ray extra)",
    )

    sft = sub.add_parser("sft", help="supervised fine-tuning: a recipe with an [sft] section")
    _add_recipe_args(sft)
    sft.add_argument(
        "--overwrite", action="store_true", help="replace an existing run folder of that name"
    )
    sft.add_argument("--quiet", action="store_true", help="no progress lines")

    check = sub.add_parser("check", help="validate a recipe and print the resolved config")
    _add_recipe_args(check)
    check.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="also check the placement on this many Slurm nodes (as asyncrl slurm does)",
    )

    slurm = sub.add_parser("slurm", help="write (and submit) an sbatch script for a recipe")
    _add_recipe_args(slurm)
    slurm.add_argument("--nodes", type=int, required=True, help="nodes of the job")
    slurm.add_argument("--partition", default="", help="sbatch --partition")
    slurm.add_argument("--time", default="", help="sbatch --time, e.g. 04:00:00")
    slurm.add_argument("--gpus-per-node", type=int, default=0, help="sbatch --gpus-per-node")
    slurm.add_argument(
        "--out", type=Path, default=None, help="script path (default <run.dir>/<name>.sbatch)"
    )
    slurm.add_argument("--submit", action="store_true", help="run sbatch on the script")

    attach = sub.add_parser("attach", help="join a live run with one more actor process")
    attach.add_argument(
        "role", help="rollout, reward or eval (a run has one buffer and one trainer)"
    )
    attach.add_argument("--run", type=Path, required=True, help="the run folder")
    attach.add_argument("--actor-id", default="", help="defaults to <role>-<random>")
    attach.add_argument(
        "--nats",
        type=Path,
        default=None,
        help="the run's nats.json (default <run>/nats.json): on another machine, a copy of it",
    )

    metrics = sub.add_parser("metrics", help="stream a run's metrics from NATS")
    metrics.add_argument("--run", type=Path, required=True, help="the run folder")
    metrics.add_argument("--json", action="store_true", help="one JSON object per line")
    metrics.add_argument("--role", default="*", help="only this role's metrics")
    metrics.add_argument("--count", type=int, default=0, help="stop after N records")
    metrics.add_argument(
        "--lines", action="store_true", help="plain lines even on a terminal (no dashboard)"
    )

    plot = sub.add_parser("plot", help="draw a run's curves as PNG files")
    plot.add_argument("--run", type=Path, required=True, help="the run folder")
    plot.add_argument("--vs", type=Path, default=None, help="a second run on the same axes")
    plot.add_argument("--out", type=Path, default=None, help="folder for the PNGs (<run>/plots)")

    replay_cmd = sub.add_parser(
        "replay",
        help="train a run again from its step records; check its checkpoints' weights bit for bit",
    )
    add_replay_args(replay_cmd)

    audit_cmd = sub.add_parser(
        "audit",
        help="check a finished run lost nothing, trained nothing twice and kept its staleness bound",
    )
    audit_cmd.add_argument("run", type=Path, help="the run folder")

    status = sub.add_parser("status", help="list a run's live actors from their heartbeats")
    status.add_argument("--run", type=Path, required=True, help="the run folder")
    status.add_argument("--wait", type=float, default=2.5, help="seconds to listen")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "sft" or (
            args.command == "check" and is_sft_data(read_recipe_data(args.recipe, args.overrides))
        ):
            sft_recipe = load_sft_recipe(args.recipe, args.overrides)
            if args.command == "check":
                print(dump_recipe(sft_recipe), end="")
                return 0
            return sft(sft_recipe, overwrite=args.overwrite, quiet=args.quiet)
        if args.command == "check":
            # with --nodes the run starts on the cluster: this machine's paths and GPUs
            # are reported, not required
            recipe = load_recipe(args.recipe, args.overrides, here=args.nodes is None)
            if args.nodes is not None:
                if problems := slurm_job_problems(recipe, args.nodes):
                    raise RecipeError(
                        "placement cannot fit:\n" + "\n".join(f"  {p}" for p in problems)
                    )
            for warning in enforce_recipe(recipe):
                print(f"asyncrl: warning: {warning}", file=sys.stderr)
            verified, unverified = check_report(recipe, args.nodes)
            print(f"asyncrl check: verified: {'; '.join(verified)}", file=sys.stderr)
            for line in unverified:
                print(f"asyncrl check: not verified here: {line}", file=sys.stderr)
            print(dump_recipe(recipe), end="")
            kind, why = choose_transport(recipe)
            print(f"# weights travel by {kind}: {why}")
            return 0
        if args.command == "slurm":
            # the job reads its files on the cluster: missing here is no reason to stop
            recipe = load_recipe(args.recipe, args.overrides, here=False)
            for line in path_problems(recipe):
                print(
                    f"asyncrl: warning: {line} here; it must exist on the cluster's nodes",
                    file=sys.stderr,
                )
            return write_and_submit(
                recipe,
                args.recipe,
                args.overrides,
                args.nodes,
                partition=args.partition,
                time=args.time,
                gpus_per_node=args.gpus_per_node,
                out=args.out,
                submit=args.submit,
            )
        if args.command == "up":
            if is_sft_data(read_recipe_data(args.recipe, args.overrides)):
                raise RecipeError(
                    f"{args.recipe} has an [sft] section: it is a supervised fine-tuning "
                    f"recipe, run it with asyncrl sft {args.recipe}"
                )
            if args.trace:
                args.overrides.append(f"run.trace_steps={args.trace_steps}")
            for key in ("listen", "tls_cert", "tls_key", "tls_ca"):
                if getattr(args, key) is not None:
                    # quoted: an address is no TOML literal, and a path may look like one
                    args.overrides.append(f"run.{key}={json.dumps(getattr(args, key))}")
            recipe = load_recipe(args.recipe, args.overrides)
            from asyncrl.launch.up import up  # noqa: PLC0415 - loads NATS, the runtime

            return up(
                recipe,
                resume=args.resume,
                overwrite=args.overwrite,
                quiet=args.quiet,
                ray=args.ray,
            )
        if args.command == "attach":
            # refused before anything connects: nothing of the run is touched
            if (refusal := attach_refusal(args.role)) is not None:
                print(f"asyncrl: {refusal}", file=sys.stderr)
                return 2
            from asyncrl.entry.actor import run_actor  # noqa: PLC0415 - loads NATS, the runtime

            # an engine that joined the weight broadcast holds gloo threads, which the
            # interpreter's finalization can abort on: leave as every actor process does,
            # however the actor ends (an exception too, which would otherwise finalize)
            rank_main(lambda: run_actor(args.role, args.run, args.actor_id, nats_file=args.nats))
        if args.command == "metrics":
            from asyncrl.observe.watch import stream_metrics  # noqa: PLC0415 - loads NATS

            return stream_metrics(
                args.run, as_json=args.json, role=args.role, count=args.count, lines=args.lines
            )
        if args.command == "plot":
            from asyncrl.observe.plot import plot_run  # noqa: PLC0415 - heavy: reads step records (the wire codec, numpy)

            try:
                paths = plot_run(args.run, vs=args.vs, out=args.out)
            except FileNotFoundError as exc:
                print(f"asyncrl plot: {exc}", file=sys.stderr)
                return 1
            for path in paths:
                print(path)
            return 0
        if args.command == "replay":
            from asyncrl.entry.replay import replay  # noqa: PLC0415 - heavy: reads step records (the wire codec, numpy)

            return replay(args.run, args.start_from, args.until, args.export)
        if args.command == "audit":
            from asyncrl.observe.audit import audit  # noqa: PLC0415 - heavy: reads step records (the wire codec, numpy)

            return audit(args.run)
        if args.command == "status":
            from asyncrl.observe.watch import show_status  # noqa: PLC0415 - loads NATS

            return show_status(args.run, wait=args.wait)
    except RecipeError as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
