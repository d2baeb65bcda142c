"""The parts every recipe section shares: the section base class, the error a recipe that
cannot run raises, the dtype and device types, the one function that turns a device choice
into a device, and the device a rollout engine's section names.

Imports no torch (the device check imports it when it runs), so the recipe schema built
on it parses instantly.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class RecipeError(ValueError):
    """A recipe that cannot run; the message names every offending key."""


class Section(BaseModel):
    """A recipe section: unknown keys are errors, and each field's docstring is its
    description (what ``asyncrl check`` and the recipe reference in docs/recipes.md show)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


CpuList = list[Annotated[int, Field(ge=0)]]
"""CPU ids a role's processes are pinned to (``os.sched_setaffinity`` at process start);
empty: no pinning. Checked against the machine where a run starts
(:func:`asyncrl.config.recipe.load_recipe`)."""

DType = Literal["float32", "bfloat16", "float16"]
"""A parameter or reduction dtype, by its torch name."""

Device = Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")]
"""Where a component runs: ``auto`` (CUDA when a device is visible, else the CPU),
``cpu``, ``cuda`` or ``cuda:N``. See :func:`resolve_device`."""


def resolve_device(choice: str, *, local_rank: int | None = None) -> str:
    """The device a :data:`Device` choice names on this machine: ``auto`` becomes ``cuda``
    when a CUDA device is visible, else ``cpu``. With ``local_rank`` (a torchrun rank), a
    bare ``cuda`` (or ``auto`` on a CUDA machine) becomes ``cuda:<local_rank>``, so that
    each rank takes its own device; an explicit ``cuda:N`` is kept."""
    if choice == "auto":
        import torch  # noqa: PLC0415 - heavy: only "auto" needs it; the schema parses without torch

        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and local_rank is not None:
        return f"cuda:{local_rank}"
    return choice


def engine_device(engine: object) -> str:
    """The :data:`Device` a rollout engine computes on: its ``device`` key, else ``cpu`` for
    the ``instant`` engine and ``auto`` for an inference server started here (it uses CUDA
    where there is one)."""
    default = "cpu" if getattr(engine, "type", "") == "instant" else "auto"
    return str(getattr(engine, "device", default))
