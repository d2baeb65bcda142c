"""Core placement: where the processes of a one-machine CPU run go when the recipe pins
none of them.

On a CPU, generation and training compete for the same cores, and torch's thread pools
oversubscribe them: two pools of threads on the same cores spin and wait on each other.
So when every role runs on this machine's CPU and no ``<role>.cpus`` is set, ``asyncrl up``
places them:

- **generation** (rollout, reward, eval and the buffer): pinned to the first
  ``max(1, round(N / 4))`` cores; each rollout actor gets a torch thread per core of its
  share, the eval actor **one** thread;
- **training** (every trainer process): the **other** cores, a thread per core; on a
  2-core machine (:data:`OVERLAP_MAX_CORES`) every core, generation's included.

Measured on the quickstart (SmolLM2-135M) with ``bench/async_vs_sync.py --placements``
on 2 cores, and on 16 with ``asyncrl up`` given that bench's hand-placement overrides:

- on **16 cores** (an Intel Xeon with AMX, bf16), disjoint sets win by far: the trainer on
  the 12 cores generation does not use took 4.0-4.3 s a step; on all 16, four of them
  shared with generation's 4-thread pool, 24-144 s. Generation on 4 cores kept a
  12-core trainer fed (763 and 840 steps/h), on 2 it did not (614), and 8 cores for each
  made 630. An eval actor with 4 threads beside the rollout actor's 4 on the same 4
  cores slowed both about 12-fold (4.6 against 56 tokens/s), hence its one thread.
- on **2 cores** the overlap wins instead: generation runs one thread on one core and
  idles most of the time (about 70%), and the trainer takes that core back whenever it
  waits: 125 steps/h against 104 for one core each (fp32), 118 against 109-112 for the
  best hand placements over three rounds. On disjoint cores there it would lose half the
  machine.

Each process gets torch threads equal to its share of its set (the rollout actors divide
the generation cores among them; trainer processes divide the training cores). A role's
explicit ``threads`` key still wins. Where the trainer's pool overlaps generation's cores
(2 cores), its OpenMP workers sleep when a parallel region ends (``OMP_WAIT_POLICY=PASSIVE``)
instead of spinning for the next one on the core generation needs: see
:data:`WAIT_POLICY_ENV`. The choice travels to the processes ``up`` starts as
environment variables (:data:`CPUS_ENV`, :data:`THREADS_ENV`), never into the run's
recipe: an actor attached from another machine must not inherit this machine's core ids.
``run.placement = "none"`` turns the rule off.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from asyncrl.config.recipe import Recipe, role_cpus
from asyncrl.config.schema import engine_device, resolve_device
from asyncrl.runtime.cores import CPUS_ENV, THREADS_ENV, gpu_visible

GEN_SHARE = 0.25
"""Share of the cores generation gets (at least one)."""

OVERLAP_MAX_CORES = 2
"""Up to this many cores the trainer runs on generation's cores too (measured on 2 cores:
it then loses no core to a generation that mostly idles); above it the two are
disjoint (measured on 16: a trainer sharing cores with generation's threads stalls)."""


WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
"""Set to ``PASSIVE`` for a trainer whose threads share cores with generation. By default
GNU OpenMP (torch's CPU pool) keeps each worker spinning for some 300,000 turns after a
parallel region, on the core the rollout actor needs. Measured on the quickstart
(SmolLM2-135M, 8 steps, eval off) on a 2-core Intel Xeon with AMX, runs in turns: 217 and
300 steps/h spinning (``GOMP_SPINCOUNT=300000``, libgomp's default), 333 and 447 sleeping;
the trainer's step 14.9 and 11.7 s against 10.6 and 7.7 s, generation 86 and 70 tokens/s
against 107 and 95. A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is kept."""


def user_sets_wait_policy() -> bool:
    """Whether this environment already tells OpenMP how to wait."""
    return WAIT_POLICY_ENV in os.environ or "GOMP_SPINCOUNT" in os.environ


@dataclass(frozen=True)
class CorePlacement:
    """Cores and torch threads per role, as chosen by :func:`auto_placement`."""

    generation: list[int]
    training: list[int]
    threads: dict[str, int] = field(default_factory=dict)
    passive: tuple[str, ...] = ()
    """Roles whose OpenMP workers sleep when idle (:data:`WAIT_POLICY_ENV`)."""

    def cpus(self, role: str) -> list[int]:
        return self.training if role == "trainer" else self.generation

    def sleeps(self, role: str) -> bool:
        """Whether ``role``'s process is started with :data:`WAIT_POLICY_ENV` set: the rule
        chose it, and the user's environment does not decide itself."""
        return role in self.passive and not user_sets_wait_policy()

    def env(self, role: str) -> dict[str, str]:
        """The environment a process of ``role`` is started with."""
        env = {CPUS_ENV: ",".join(map(str, self.cpus(role)))}
        if role in self.threads:
            env[THREADS_ENV] = str(self.threads[role])
        if self.sleeps(role):
            env[WAIT_POLICY_ENV] = "PASSIVE"
        return env

    def to_json(self) -> str:
        return json.dumps(
            {
                "generation": self.generation,
                "training": self.training,
                "threads": self.threads,
                "passive": list(self.passive),
            }
        )

    def describe(self) -> str:
        def ids(cores: list[int]) -> str:
            return ",".join(map(str, cores))

        n = len(set(self.generation) | set(self.training))
        shared = " (generation's included)" if set(self.generation) & set(self.training) else ""
        sleep = ", sleeping when idle" if self.sleeps("trainer") else ""
        return (
            f"placement: {n} cores; generation (rollout, reward, eval, buffer) on "
            f"[{ids(self.generation)}], {self.threads.get('rollout', 1)} thread(s) per "
            f"rollout actor; training on [{ids(self.training)}]{shared}, "
            f"{self.threads.get('trainer', 1)} thread(s) per trainer process{sleep} "
            f'(run.placement = "none" turns this off)'
        )


def split_cores(cores: list[int]) -> tuple[list[int], list[int]]:
    """(generation, training) cores: the first ``max(1, round(N · GEN_SHARE))`` for
    generation, the rest for training (all of them up to :data:`OVERLAP_MAX_CORES`).
    Needs at least 2 cores."""
    if len(cores) < 2:
        raise ValueError(f"cannot place generation and training on {len(cores)} core(s)")
    ordered = sorted(cores)
    gen = max(1, round(len(ordered) * GEN_SHARE))
    if len(ordered) <= OVERLAP_MAX_CORES:
        return ordered[:gen], ordered
    return ordered[:gen], ordered[gen:]


def why_not_placed(recipe: Recipe, cores: list[int], *, cuda: bool) -> str | None:
    """Why :func:`auto_placement` leaves this run's processes where the OS puts them, or
    None when it places them."""
    if recipe.run.placement == "none":
        return 'run.placement is "none"'
    pinned = [role for role, ids in role_cpus(recipe).items() if ids]
    if pinned:
        return f"the recipe pins {', '.join(f'{r}.cpus' for r in pinned)} itself"
    if cuda:
        return "a CUDA device runs the model"
    if len(cores) < 2:
        return f"this process may use {len(cores)} core"
    return None


def auto_placement(
    recipe: Recipe, cores: list[int] | None = None, *, cuda: bool | None = None
) -> CorePlacement | None:
    """The placement of a run whose roles all run here on the CPU, or None (see
    :func:`why_not_placed`). ``cores``: the CPUs this process may use (default: its
    affinity); ``cuda``: whether a CUDA device runs the trainer or the rollout engines
    (default: resolved from the recipe's devices on this machine)."""
    if cores is None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cuda is None:
        cuda = uses_cuda(recipe)
    if why_not_placed(recipe, cores, cuda=cuda) is not None:
        return None
    gen, train = split_cores(cores)
    t = recipe.trainer
    # trainer nodes on loopback all run here; with a rendezvous elsewhere only the first
    trainer_procs = t.nproc * (1 if t.rendezvous else t.nodes)
    threads = {
        "rollout": max(1, len(gen) // max(1, recipe.rollout.actors)),
        # one: it runs beside the rollout actors, on their cores (see the module's text)
        "eval": 1,
        "trainer": max(1, len(train) // trainer_procs),
    }
    # a trainer pool on generation's cores must not spin on them between its regions
    passive = ("trainer",) if set(gen) & set(train) and threads["trainer"] > 1 else ()
    return CorePlacement(gen, train, threads, passive)


def uses_cuda(recipe: Recipe) -> bool:
    """Whether the trainer or the rollout engines resolve to a CUDA device here (an
    inference server started here uses CUDA where there is one)."""
    devices = [recipe.trainer.device, engine_device(recipe.rollout.engine)]
    if all(d == "cpu" for d in devices) or not gpu_visible():
        return False  # without importing torch into up, which never needs it otherwise
    return any(resolve_device(d).startswith("cuda") for d in devices)
