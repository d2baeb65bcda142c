"""``asyncrl slurm``: one run as one Slurm job, written as an sbatch script.

Placement on the job's N nodes, in the order of ``scontrol show hostnames``, sorted (the
trainer's c10d rendezvous ranks nodes by address, and ``up``'s node must hold global rank
0, see :mod:`asyncrl.train.torchrun`):

- node 0: ``asyncrl up`` with the NATS server open to the job (``--listen``), the buffer,
  the reward actors, the eval actor, and the first trainer node, which hosts the trainer's
  rendezvous at ``<node 0>:RDZV_PORT``;
- nodes 1 … T−1 (T = ``trainer.nodes``): the other trainer nodes, torchrun joining that
  rendezvous;
- nodes T … N−1: the ``rollout.actors`` rollout actors, spread over them, each joining the
  run as ``asyncrl attach`` does, from the run folder's ``nats.json``.

A job of one node (``--nodes 1``, one trainer node) runs the whole run under ``asyncrl up``
there, rollout actors included, each process on the GPUs ``<role>.gpus`` gives it, as
``up`` does on any machine.

Every ``srun`` names its nodes. The run folder must be on a file system every node sees
(the usual home or project file system of a cluster). The processes outside ``up`` are
started again after a death, up to ``run.max_restarts`` times, as ``up`` does for its own.
Imports no torch.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from asyncrl.config.checks import enforce_recipe
from asyncrl.config.recipe import Recipe, RecipeError

RDZV_PORT = 29500
NATS_PORT = 4222


def slurm_job_problems(recipe: Recipe, nodes: int) -> list[str]:
    """Why the recipe cannot be placed on ``nodes`` Slurm nodes (empty: it can)."""
    t, r = recipe.trainer, recipe.rollout
    problems = []
    if nodes < 1:
        problems.append(f"--nodes = {nodes}: a job needs at least one node")
    if one_node(recipe, nodes):
        return problems  # up runs it all there, as on any machine
    rollout_nodes = nodes - t.nodes
    if rollout_nodes < 1:
        problems.append(
            f"trainer.nodes = {t.nodes} with --nodes = {nodes}: the trainer takes the first "
            f"{t.nodes} nodes and the rollout actors need at least one more; ask for "
            f"--nodes {t.nodes + 1} or more, or lower trainer.nodes"
        )
    if r.actors < 1:
        problems.append(
            "rollout.actors = 0: the rollout nodes would have nothing to run; set at least "
            "one rollout actor per rollout node"
        )
    elif 0 < rollout_nodes and r.actors < rollout_nodes:
        problems.append(
            f"rollout.actors = {r.actors} on the {rollout_nodes} rollout nodes (--nodes − "
            f"trainer.nodes): a node would have nothing to run; raise rollout.actors to "
            f"{rollout_nodes} or lower --nodes"
        )
    if r.colocate:
        problems.append(
            "rollout.colocate = true: colocation shares the trainer's machine, while "
            "asyncrl slurm places rollouts on nodes of their own; set it to false"
        )
    if recipe.run.nats_url:
        problems.append(
            "run.nats_url is set: asyncrl slurm starts the run's NATS server on node 0; "
            "leave it empty"
        )
    return problems


def one_node(recipe: Recipe, nodes: int) -> bool:
    """Whether the job is one node that runs the whole run under ``up``."""
    return nodes == 1 and recipe.trainer.nodes == 1


def _nodes(first: int, last: int) -> str:
    return f"node {first}" if first == last else f"nodes {first}-{last}"


def _q(text: str | Path) -> str:
    return shlex.quote(str(text))


def sbatch_script(
    recipe: Recipe,
    recipe_path: str | None,
    overrides: list[str],
    nodes: int,
    *,
    partition: str = "",
    time: str = "",
    gpus_per_node: int = 0,
) -> str:
    """The sbatch script of the run (:func:`slurm_job_problems` must be empty)."""
    t, run = recipe.trainer, recipe.run
    run_dir = run.path.resolve()
    trainer_rest = t.nodes - 1
    alone = one_node(recipe, nodes)
    rollout_nodes = nodes - t.nodes
    per_node = -(-recipe.rollout.actors // rollout_nodes) if rollout_nodes else 1
    # absolute: the job may start anywhere; no rollout actors of up's own unless the job
    # is one node (they run on the rollout nodes)
    sets = [*overrides, f"run.dir={json.dumps(str(run_dir.parent))}"]
    sets += [] if alone else ["rollout.actors=0"]
    up_argv = ["-m", "asyncrl.entry.cli", "up"]
    up_argv += [str(Path(recipe_path).resolve())] if recipe_path else []
    # one node: nothing joins from elsewhere, so NATS stays on loopback
    up_argv += ["--overwrite", "--quiet"]
    up_argv += [] if alone else ["--listen", f"0.0.0.0:{NATS_PORT}"]
    for item in sets:
        up_argv += ["--set", item]
    up_line = " ".join(_q(a) for a in up_argv)
    # the trainer nodes' rendezvous is known only in the job: quoted by hand
    up_line += ' --set "trainer.rendezvous=\\"$RDZV\\""' if t.nodes > 1 else ""
    lines = [
        "#!/bin/bash",
        f"# asyncrl run {run.name!r} as one Slurm job on {nodes} nodes (asyncrl slurm).",
        "# node 0: asyncrl up (NATS server, buffer, reward, eval, trainer node 0"
        f"{', rollout actors' if alone else ''})",
    ]
    if trainer_rest:
        lines.append(f"# {_nodes(1, t.nodes - 1)}: the other trainer nodes (torchrun)")
    if not alone:
        lines.append(
            f"# {_nodes(t.nodes, nodes - 1)}: {recipe.rollout.actors} rollout actors "
            "(asyncrl attach rollout)"
        )
    lines += [
        f"#SBATCH --job-name=asyncrl-{run.name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={max(1, per_node)}",
        f"#SBATCH --output={run_dir.parent / f'{run.name}-slurm-%j.out'}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time:
        lines.append(f"#SBATCH --time={time}")
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    max_restarts, backoff = run.max_restarts, max(1, int(run.restart_backoff))
    lines += [
        "set -uo pipefail",
        "",
        f"PY=${{ASYNCRL_PYTHON:-{sys.executable}}}",
        f"RUN={_q(run_dir)}",
        "# sorted: the rendezvous ranks trainer nodes by address, and node 0 must lead",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST" | LC_ALL=C sort)',
        f"if [ ${{#NODES[@]}} -ne {nodes} ]; then",
        f'  echo "asyncrl: expected {nodes} nodes, got ${{#NODES[@]}}" >&2; exit 1',
        "fi",
        "HEAD=${NODES[0]}",
        f'TRAINER_NODES=$(IFS=,; echo "${{NODES[*]:1:{trainer_rest}}}")',
        f'ROLLOUT_NODES=$(IFS=,; echo "${{NODES[*]:{t.nodes}}}")',
        f"RDZV=$HEAD:{RDZV_PORT}",
        "export PY RUN RDZV",
        "",
        f"# started again after a death, up to run.max_restarts = {max_restarts} times",
        "trainer_node() {",
        "  local i",
        f"  for ((i = 0; i <= {max_restarts}; i++)); do",
        f'    "$PY" -m torch.distributed.run --nnodes={t.nodes} \\',
        f"      --nproc-per-node={t.nproc} --rdzv-backend=c10d \\",
        f'      --rdzv-endpoint="$RDZV" --rdzv-id={_q(run.name)} --rdzv-conf=is_host=false \\',
        '      -m asyncrl.entry.actor trainer --run-dir "$RUN" --actor-id trainer-0 && return 0',
        f"    sleep $(({backoff} << i))",
        "  done",
        "  return 1",
        "}",
        "rollout_actor() {",
        '  local i id="rollout-$SLURM_PROCID"',
        f"  for ((i = 0; i <= {max_restarts}; i++)); do",
        '    "$PY" -m asyncrl.entry.cli attach rollout --run "$RUN" --actor-id "$id" && return 0',
        '    id="rollout-$SLURM_PROCID-r$((i + 1))"  # a new id: the buffer frees the old leases',
        f"    sleep $(({backoff} << i))",
        "  done",
        "  return 1",
        "}",
        "export -f trainer_node rollout_actor",
        "",
        'rm -f "$RUN/nats.json"',
        "# node 0",
        'srun --nodes=1 --ntasks=1 --nodelist="$HEAD" "$PY" ' + up_line + " &",
        "UP=$!",
        "# the other nodes join through the run folder's nats.json, written once NATS is up",
        'until [ -s "$RUN/nats.json" ]; do',
        '  kill -0 "$UP" 2>/dev/null || { wait "$UP"; exit $?; }',
        "  sleep 1",
        "done",
    ]
    if trainer_rest:
        lines += [
            f"# {_nodes(1, trainer_rest)}: the other trainer nodes",
            f"srun --nodes={trainer_rest} --ntasks={trainer_rest} --ntasks-per-node=1 "
            '--nodelist="$TRAINER_NODES" bash -c trainer_node &',
        ]
    if not alone:
        lines += [
            "# rollout nodes",
            f"srun --nodes={rollout_nodes} --ntasks={recipe.rollout.actors} "
            '--nodelist="$ROLLOUT_NODES" bash -c rollout_actor &',
        ]
    lines += [
        "",
        'wait "$UP"',
        "code=$?",
        "# the run is over: whatever still runs on the other nodes goes",
        "kill $(jobs -p) 2>/dev/null",
        "wait",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def write_and_submit(
    recipe: Recipe,
    recipe_path: str | None,
    overrides: list[str],
    nodes: int,
    *,
    partition: str = "",
    time: str = "",
    gpus_per_node: int = 0,
    out: Path | None = None,
    submit: bool = False,
) -> int:
    """``asyncrl slurm``: checks the placement, writes the script (beside the run folder,
    which ``up --overwrite`` replaces), and with ``submit`` hands it to sbatch."""
    problems = slurm_job_problems(recipe, nodes)
    if problems:
        raise RecipeError("placement cannot fit:\n" + "\n".join(f"  {p}" for p in problems))
    for warning in enforce_recipe(recipe):
        print(f"asyncrl: warning: {warning}", file=sys.stderr)
    text = sbatch_script(
        recipe,
        recipe_path,
        overrides,
        nodes,
        partition=partition,
        time=time,
        gpus_per_node=gpus_per_node,
    )
    path = out or recipe.run.path.parent / f"{recipe.run.name}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    print(path)
    if not submit:
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(
            f"asyncrl slurm: --submit: sbatch is not on PATH (no Slurm here); the script is "
            f"at {path}: run sbatch {path} on the cluster's login node",
            file=sys.stderr,
        )
        return 2
    return subprocess.run([sbatch, str(path)], check=False).returncode


__all__ = ["NATS_PORT", "RDZV_PORT", "sbatch_script", "slurm_job_problems", "write_and_submit"]
