"""Placement in the recipe: which nodes each role's processes go on, and what each takes.

Every role section has the same keys (:class:`Placement`): ``node`` (the nodes its
processes go on), ``gpus`` (GPUs per process; for the trainer, per rank) and ``ray_cpus``
(CPUs Ray reserves per process); the rollout section adds ``actors_per_node``. The
recipe's ``[nodes.<name>]`` tables declare what each node has (``gpus``, ``cpus``), so that
``asyncrl check`` refuses a placement that cannot fit before anything starts.

Who honours it: ``asyncrl up --ray`` places every process by these keys
(:mod:`asyncrl.launch.ray_cluster`). The local launcher (one machine, ``asyncrl up``) honours
``gpus`` as Ray does: each process it starts gets ``CUDA_VISIBLE_DEVICES`` naming GPUs of
its own (:func:`assign_gpus`), and a role with ``gpus = 0`` inherits the machine's. It
and the Slurm script (one ``srun`` per role on the allocated nodes) ignore ``node`` and
``ray_cpus``; they start ``rollout.actors`` rollout actors as always, which ``check`` keeps
equal to ``actors_per_node`` × the nodes named. The checks below run for every launcher.

This module imports neither torch nor ray: the recipe schema and ``check`` stay instant.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator

from asyncrl.config.schema import Section, engine_device

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
    takes ``nproc × gpus``): a whole number, or a share of one below 1 (processes then
    share a GPU). Each process sees only its own (``CUDA_VISIBLE_DEVICES``, set by Ray or
    by ``asyncrl up``, :func:`assign_gpus`); 0: it takes none and sees every GPU of its
    node."""
    ray_cpus: float = Field(1.0, ge=0)
    """Logical CPUs Ray reserves for each process of the role (Ray's accounting only:
    ``cpus`` pins cores)."""

    @field_validator("gpus")
    @classmethod
    def _whole_or_a_share(cls, gpus: float) -> float:
        if gpus > 1 and gpus != int(gpus):
            raise ValueError(
                "a share of one GPU (below 1: processes share it, as Ray packs them) or a "
                f"whole number of GPUs, not {gpus:g}"
            )
        return gpus


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


def node_placement_problems(recipe: Any) -> list[str]:
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


# --- GPUs on one node: what the local launcher hands each process ------------------------

GpuSets = dict[str, list[tuple[int, ...]]]
"""Per role, per process the local launcher starts (in its order), the GPUs the process
takes as positions in the node's GPU list (:func:`asyncrl.runtime.cores.node_gpus`); ``()`` for a
process that takes none and so sees every GPU of the node."""


def local_processes(recipe: Any) -> dict[str, int]:
    """How many processes of each role ``asyncrl up`` starts on its own machine: as
    :func:`role_processes`, but with ``trainer.rendezvous`` only the first trainer node
    (the others join from their machines)."""
    counts = role_processes(recipe)
    if recipe.trainer.rendezvous:
        counts["trainer"] = 1
    return counts


def assign_gpus(recipe: Any) -> GpuSets:
    """The GPUs of the node each process of the local launcher takes, handed out as Ray
    does: role after role (:data:`ROLES`), each process the next ``<role>.gpus`` GPUs
    nobody took (a trainer node: ``trainer.gpus × trainer.nproc``); a process of less than
    one GPU shares the GPU the share before it opened while room is left on it (Ray packs
    fractions alike); a process of ``gpus = 0`` takes none and sees the node's. A colocated
    rollout (``rollout.colocate``, with a trainer that has GPUs) takes none of its own:
    rollout actor i shares the trainer's GPUs i·g … i·g + g − 1 (g = ``rollout.gpus``
    rounded up, wrapping round), or all of them with ``rollout.gpus = 0``. Pure: whether
    the node has that many is :func:`gpus_needed` against its count."""
    counts = local_processes(recipe)
    colocated = recipe.rollout.colocate and recipe.trainer.gpus > 0
    sets: GpuSets = {}
    taken = 0  # GPUs handed out whole or opened for shares
    room = 0.0  # what is left of the last GPU opened for shares
    for role in ROLES:
        need = process_gpus(recipe, role)
        sets[role] = []
        for _ in range(counts[role]):
            if need == 0 or (role == "rollout" and colocated):
                sets[role].append(())
            elif need < 1:
                if need > room + 1e-9:
                    taken, room = taken + 1, 1.0
                room -= need
                sets[role].append((taken - 1,))
            else:
                whole = math.ceil(need)
                sets[role].append(tuple(range(taken, taken + whole)))
                taken, room = taken + whole, 0.0
    if colocated and sets["trainer"]:
        shared, g = sets["trainer"][0], math.ceil(recipe.rollout.gpus)
        sets["rollout"] = [
            tuple(dict.fromkeys(shared[(i * g + j) % len(shared)] for j in range(g)))
            if g
            else shared
            for i in range(counts["rollout"])
        ]
    return sets


def gpus_needed(sets: GpuSets) -> int:
    """How many GPUs the node needs for ``sets``: one past the highest position taken."""
    return 1 + max((i for per_role in sets.values() for s in per_role for i in s), default=-1)


def describe_gpus(sets: GpuSets, ids: list[str] | None = None) -> str:
    """``rollout-0: 0, rollout-1: 1, trainer-0: 2,3``: each process that takes GPUs with
    its positions, or with ``ids`` the node's ``CUDA_VISIBLE_DEVICES`` entries."""

    def name(i: int) -> str:
        return ids[i] if ids is not None and i < len(ids) else str(i)

    return ", ".join(
        f"{role}-{k}: {','.join(map(name, s))}"
        for role, per_role in sets.items()
        for k, s in enumerate(per_role)
        if s
    )


def gpu_device(recipe: Any, role: str) -> tuple[str, str] | None:
    """``(key, device)`` for what a process of ``role`` computes on where that may be a
    GPU (``auto`` included: a GPU where the node has one); None for a role on the CPU: the
    buffer, the reward, a device of ``cpu``, the ``instant`` engine, SGLang with
    ``cpu = true``. The eval actor runs the rollout's engine."""
    if role == "trainer":
        key, device = "trainer.device", recipe.trainer.device
    elif role in ("rollout", "eval"):
        engine = recipe.rollout.engine
        if getattr(engine, "cpu", False) is True:
            return None
        key = "rollout.engine.device" if hasattr(engine, "device") else "rollout.engine.type"
        device = engine_device(engine)
    else:
        return None
    return None if device == "cpu" else (key, device)


def _inherited_gpus(recipe: Any, role: str, device: str) -> set[int]:
    """The node's GPUs a process that sees all of them computes on: ``cuda:N`` the N-th,
    else the first (a trainer node's ranks one each: ``cuda:LOCAL_RANK``)."""
    if ":" in device:
        return {int(device.split(":", 1)[1])}
    return set(range(recipe.trainer.nproc)) if role == "trainer" else {0}


def gpu_problems(recipe: Any) -> list[str]:
    """GPU assignments on one node that cannot work, each naming its keys: a role that
    sees every GPU (``<role>.gpus = 0``) computing on one that ``<role>.gpus`` hands to
    another role (two roles on one GPU, unless the rollout is colocated with the trainer),
    a ``cuda:N`` beyond the GPUs a role is given, and a share of a GPU per trainer rank
    (each rank takes a device of its own). Whether the node has enough GPUs is checked
    where its size is known (:func:`gpus_needed`). Roles placed on several nodes
    (``<role>.node``) are Ray's to place: only the last check applies to them."""
    sets, t, errors = assign_gpus(recipe), recipe.trainer, []
    if 0 < t.gpus < 1 and t.nproc > 1 and gpu_device(recipe, "trainer"):
        errors.append(
            f"trainer.gpus = {t.gpus:g} with trainer.nproc = {t.nproc}: each rank computes "
            "on a device of its own (cuda:LOCAL_RANK); give each rank a whole GPU "
            "(trainer.gpus = 1)"
        )
    if len({n for p in role_placements(recipe).values() for n in p.node}) > 1:
        return errors
    for role in ROLES:
        found = gpu_device(recipe, role)
        if found is None or not sets[role]:
            continue
        key, device = found
        own = sets[role][0]
        if own:
            if ":" in device and int(device.split(":", 1)[1]) >= len(own):
                errors.append(
                    f'{key} = "{device}" but each {role} process sees only the {len(own)} '
                    f"GPU(s) {role}.gpus gives it, cuda:0 to cuda:{len(own) - 1}; use "
                    '"cuda"'
                )
            continue
        used = _inherited_gpus(recipe, role, device)
        for other in ROLES:
            colocated = {role, other} == {"rollout", "trainer"} and recipe.rollout.colocate
            hit = sorted(used & {i for s in sets[other] for i in s})
            if other == role or colocated or not hit:
                continue
            hint = (
                ", or colocate it with the trainer (rollout.colocate = true)"
                if {role, other} == {"rollout", "trainer"}
                else ""
            )
            errors.append(
                f"{role} computes on GPU {','.join(map(str, hit))} of the node ({key} = "
                f'"{device}" with {role}.gpus = 0: it sees every GPU), which {other}.gpus '
                f"gives to {other}: two roles on one GPU; give {role} GPUs of its own "
                f"({role}.gpus = 1){hint}"
            )
    return errors
