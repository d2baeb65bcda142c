"""Placement in the recipe: which nodes each role's processes go on, and what each takes.

Every role section has the same keys (:class:`Placement`): ``node`` (the nodes its
processes go on), ``gpus`` (GPUs per process; for the trainer, per rank) and ``ray_cpus``
(CPUs Ray reserves per process); the rollout section adds ``actors_per_node``. The
recipe's ``[nodes.<name>]`` tables declare what each node has (``gpus``, ``cpus``), so that
``asyncrl check`` refuses a placement that cannot fit before anything starts.

Who honours it: ``asyncrl up --ray`` places every process by these keys
(:mod:`asyncrl.ray_launch`). The local launcher (one machine) and the Slurm script (one
``srun`` per role on the allocated nodes) ignore ``node``, ``gpus`` and ``ray_cpus``; they
start ``rollout.actors`` rollout actors as always, which ``check`` keeps equal to
``actors_per_node`` × the nodes named. The checks below run for every launcher.

This module imports neither torch nor ray: the recipe schema and ``check`` stay instant.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from asyncrl.schema import Section

ROLES = ("buffer", "reward", "rollout", "trainer", "eval")
"""The roles ``up`` starts, in the order it starts them."""


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


NodeList = Annotated[list[Annotated[str, Field(min_length=1)]], BeforeValidator(_as_list)]
"""One node name or a list of them."""


class Placement(Section):
    """Where a role's processes run (honoured by ``asyncrl up --ray``; see the module)."""

    node: NodeList = Field(default_factory=list)
    """The node(s) this role's processes go on: a Ray custom resource that the node
    declares (``ray start --resources '{"gpu-a": 1}'``), a Ray node label value, the
    node's hostname or its IP. Several: the role's processes are spread over them in
    order (the trainer: node k runs trainer node k). Empty: any node. A preference, not a
    fence: when a named node is gone (dead), a replacement runs on another node that fits."""
    gpus: float = Field(0.0, ge=0)
    """GPUs each process of the role takes (the trainer: each rank, so a trainer node
    takes ``nproc × gpus``)."""
    ray_cpus: float = Field(1.0, ge=0)
    """Logical CPUs Ray reserves for each process of the role (Ray's accounting only:
    ``cpus`` pins cores)."""


class NodeSpec(Section):
    """What one node of the cluster has, for ``asyncrl check`` (``[nodes.<name>]``)."""

    gpus: float = Field(0.0, ge=0)
    """GPUs on the node."""
    cpus: float | None = Field(None, ge=0)
    """Logical CPUs on the node; None: not checked."""


def role_placements(recipe: Any) -> dict[str, Placement]:
    """Each role's placement section (the role's recipe section itself)."""
    return {role: getattr(recipe, role) for role in ROLES}


def role_processes(recipe: Any) -> dict[str, int]:
    """How many processes ``up`` starts per role (the trainer: one per trainer node)."""
    return {
        "buffer": 1,
        "reward": recipe.reward.actors,
        "rollout": recipe.rollout.actors,
        "trainer": recipe.trainer.nodes,
        "eval": 1 if recipe.eval.every else 0,
    }


def process_gpus(recipe: Any, role: str) -> float:
    """GPUs one process of ``role`` takes (a trainer node: every rank's)."""
    p: Placement = getattr(recipe, role)
    return p.gpus * (recipe.trainer.nproc if role == "trainer" else 1)


def node_for(recipe: Any, role: str, index: int) -> str:
    """The node that process ``index`` of ``role`` goes on ('' for any): the rollout's
    ``actors_per_node`` fill each node in turn, every other role takes the named nodes
    round robin (the trainer's node k is ``trainer.node[k]``)."""
    nodes = getattr(recipe, role).node
    if not nodes:
        return ""
    per_node = recipe.rollout.actors_per_node if role == "rollout" else 0
    return nodes[index // per_node % len(nodes)] if per_node else nodes[index % len(nodes)]


def placement_problems(recipe: Any) -> list[str]:
    """Placements that cannot fit, each naming its keys: more rollout actors per node than
    ``rollout.actors`` allows, a trainer gang larger than its nodes, a node no
    ``[nodes.*]`` table declares, more GPUs or CPUs on a node than it has."""
    errors: list[str] = []
    r, t = recipe.rollout, recipe.trainer
    if r.actors_per_node:
        if not r.node:
            errors.append(
                f"rollout.actors_per_node = {r.actors_per_node} with rollout.node empty: "
                "name the nodes (rollout.node = [...]) or leave actors_per_node at 0"
            )
        # 0: up starts none, they attach from elsewhere (the Slurm script's up does that)
        elif r.actors and r.actors != r.actors_per_node * len(r.node):
            errors.append(
                f"rollout.actors = {r.actors} but rollout.actors_per_node = "
                f"{r.actors_per_node} on {len(r.node)} node(s) of rollout.node makes "
                f"{r.actors_per_node * len(r.node)}; set rollout.actors = "
                f"{r.actors_per_node * len(r.node)}"
            )
    if t.node and t.nodes > len(t.node):
        errors.append(
            f"trainer.nodes = {t.nodes} but trainer.node names {len(t.node)} node(s): "
            "each trainer node needs a node of its own; name as many or lower trainer.nodes"
        )
    if len(set(t.node)) != len(t.node):
        errors.append(f"trainer.node = {t.node} names a node twice: one trainer node per node")
    declared: dict[str, NodeSpec] = recipe.nodes
    if not declared:
        return errors
    counts = role_processes(recipe)
    gpus: dict[str, float] = dict.fromkeys(declared, 0.0)
    cpus: dict[str, float] = dict.fromkeys(declared, 0.0)
    takers: dict[str, list[str]] = {n: [] for n in declared}
    for role, p in role_placements(recipe).items():
        for name in p.node:
            if name not in declared:
                errors.append(
                    f"{role}.node: {name!r} is not a declared node (declared: "
                    f"{', '.join(sorted(declared))}); add [nodes.{name}] or fix the name"
                )
        if not p.node:
            if p.gpus and counts[role]:
                errors.append(
                    f"{role}.gpus = {p.gpus:g} with {role}.node empty and [nodes] declared: "
                    f"name the node(s) whose GPUs the {role} takes"
                )
            continue
        for i in range(counts[role]):
            name = node_for(recipe, role, i)
            if name in declared:
                gpus[name] += process_gpus(recipe, role)
                cpus[name] += p.ray_cpus
                takers[name].append(role)
    for name, spec in declared.items():
        roles = ", ".join(sorted(set(takers[name])))
        if gpus[name] > spec.gpus:
            errors.append(
                f"nodes.{name}.gpus = {spec.gpus:g} but {roles} placed there take "
                f"{gpus[name]:g} GPUs (<role>.gpus per process, × trainer.nproc for the "
                "trainer); lower <role>.gpus, move a role (<role>.node), or declare more"
            )
        if spec.cpus is not None and cpus[name] > spec.cpus:
            errors.append(
                f"nodes.{name}.cpus = {spec.cpus:g} but {roles} placed there reserve "
                f"{cpus[name]:g} CPUs (<role>.ray_cpus per process); lower <role>.ray_cpus "
                "or move a role (<role>.node)"
            )
    return errors
