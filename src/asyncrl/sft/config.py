"""The SFT recipe: the ``run``, ``model`` and ``trainer`` sections of a GRPO recipe, a
``data`` section of worked answers (JSONL or HF, with ``prompt_key``/``answer_key``), and
an ``sft`` section of its own. A TOML recipe is an SFT recipe when it has an ``[sft]``
section (:func:`is_sft_data`); ``asyncrl check`` and ``asyncrl sft`` validate it with
:class:`SftRecipe`, which forbids the GRPO-only sections (``rollout``, ``reward``,
``buffer``, ``eval``) so that a mixed-up recipe fails naming them.

Imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from asyncrl.config.recipe import (
    HFData,
    JsonlData,
    RecipeError,
    RunConfig,
    apply_overrides,
    format_validation_error,
    read_recipe_file,
)
from asyncrl.config.schema import Section
from asyncrl.data.gsm8k import BOXED_INSTRUCTION
from asyncrl.models.resolve import ModelConfig
from asyncrl.train.config import DERIVED_KEYS, TrainerConfig

SftData = Annotated[JsonlData | HFData, Field(discriminator="type")]
"""Where SFT examples come from: a local JSONL file or an HF dataset; ``prompt_key`` names
the question, ``answer_key`` the worked answer the model learns to write."""

GRPO_SECTIONS = ("rollout", "reward", "buffer", "eval")
"""Sections of a GRPO recipe that an SFT run has no use for."""


class SftConfig(Section):
    """How examples become training sequences, and how the run is evaluated."""

    instruction: str = BOXED_INSTRUCTION
    """Appended to each question on a new line (the GRPO recipes' prompts carry the same
    instruction, so the model learns the format the reward reads); empty: none."""
    system_prompt: str | None = None
    """A system message before the question; None: whatever the chat template adds by
    itself (SmolLM2's adds its own default)."""
    answer_format: Literal["as_is", "gsm8k_boxed"] = "as_is"
    """``as_is``: the answer field is the target text. ``gsm8k_boxed``: a GSM8K worked
    solution, its ``<<48/2=24>>`` calculator notes removed and its final ``#### N`` line
    rewritten as ``The final answer is \\boxed{N}.``, the form ``reward.fn = "math"``
    reads."""
    max_length: int = Field(1024, ge=2)
    """Most tokens of one example (prompt + answer + EOS): a longer answer is cut at the
    end; an example whose prompt leaves no answer token is dropped."""
    limit: int | None = Field(None, ge=1)
    """Use only the first ``limit`` rows of ``data`` (a slice for small runs); None: all."""
    batch_size: int = Field(16, ge=1)
    """Examples per optimizer step (the global batch, over all ranks). Each step draws the
    next ones of a shuffled epoch; a new epoch reshuffles (seeded by ``run.seed``)."""
    held_out: int = Field(64, ge=0)
    """Examples set aside from ``data`` (a seeded draw) for the held-out loss and accuracy,
    never trained on; ignored when ``eval_data`` is given."""
    eval_data: SftData | None = None
    """A separate source of held-out examples (its first ``held_out`` rows), e.g. GSM8K's
    test split; None: carved out of ``data``."""
    eval_every: int = Field(0, ge=0)
    """Held-out loss (and accuracy, if ``eval_accuracy``) every k steps, at step 0 and at
    the last step; 0: only at step 0 and the last step."""
    eval_accuracy: bool = True
    """Also decode one greedy answer per held-out prompt and score it with ``reward``."""
    eval_prompts: int | None = Field(None, ge=1)
    """Held-out prompts whose greedy answers are scored (the first ones); None: all of
    ``held_out``."""
    max_new_tokens: int = Field(256, ge=1)
    """Token budget of each greedy answer."""
    reward: str = "math"
    """The reward function that scores greedy answers against the record's final answer,
    as ``reward.fn`` of a GRPO recipe: ``math``, ``math_boxed`` or ``path/file.py:fn``."""


class SftRecipe(Section):
    """A supervised fine-tuning run (``asyncrl sft``)."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Run name, folder and seed (data order, held-out draw, initialisation)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model to fine-tune."""
    data: SftData
    """The training examples."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The train engine: ``max_steps``, ``optim``, micro-batch tokens, packing, ``nproc``,
    ``checkpoint_every`` and the rest; the policy-loss keys (``loss``, ``shaping``,
    ``ppo_minibatches``) are GRPO's and unused here."""
    sft: SftConfig = Field(default_factory=SftConfig)
    """Example rendering and evaluation."""

    @model_validator(mode="before")
    @classmethod
    def _no_grpo_sections(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = [k for k in GRPO_SECTIONS if k in data]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: GRPO sections in an SFT recipe (it has [sft]); an "
                    "SFT run has no rollouts, rewards or buffer: remove them (held-out "
                    "evaluation is sft.eval_every / sft.held_out)"
                )
            trainer = data.get("trainer")
            if isinstance(trainer, dict) and (derived := [k for k in DERIVED_KEYS if k in trainer]):
                raise ValueError(
                    f"trainer.{derived[0]} is no recipe key: SFT scores the model's plain "
                    "distribution (temperature 1)"
                )
        return data

    @model_validator(mode="after")
    def _enough_data(self) -> SftRecipe:
        s = self.sft
        if self.trainer.nodes > 1:
            raise ValueError(
                "trainer.nodes: an SFT run uses one node (its ranks are trainer.nproc); set "
                "trainer.nodes = 1"
            )
        if s.eval_prompts is not None and s.eval_prompts > s.held_out:
            raise ValueError(
                f"sft.eval_prompts ({s.eval_prompts}) exceeds sft.held_out ({s.held_out}): "
                "set it at most held_out"
            )
        if s.limit is not None and s.eval_data is None and s.limit <= s.held_out:
            raise ValueError(
                f"sft.limit={s.limit} rows with sft.held_out={s.held_out} leaves nothing to "
                "train on: raise sft.limit or lower sft.held_out"
            )
        return self


def is_sft_data(data: dict[str, Any]) -> bool:
    """Whether a parsed TOML recipe (overrides applied) is an SFT recipe: it has ``sft``."""
    return isinstance(data.get("sft"), dict)


def read_recipe_data(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The TOML recipe at ``path`` as a dict, ``overrides`` applied (nothing validated)."""
    data = read_recipe_file(path) if path is not None else {}
    return apply_overrides(data, overrides or [])


def load_sft_recipe(path: str | Path | None, overrides: list[str] | None = None) -> SftRecipe:
    """Reads and validates an SFT recipe; raises :class:`RecipeError` naming every bad key
    (and the local files that do not exist)."""
    data = read_recipe_data(path, overrides)
    data.setdefault("sft", {})
    for node in (data.get("data"), data["sft"].get("eval_data")):
        if isinstance(node, dict):
            node.setdefault("type", "jsonl")
    try:
        recipe = SftRecipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(format_validation_error(exc, SftRecipe)) from None
    problems = []
    for key, source in (("data", recipe.data), ("sft.eval_data", recipe.sft.eval_data)):
        if isinstance(source, JsonlData) and not Path(source.path).expanduser().is_file():
            problems.append(f"  {key}.path: file {source.path!r} does not exist")
    model_path = recipe.model.path
    if model_path.startswith((".", "/", "~")) and not Path(model_path).expanduser().is_dir():
        problems.append(f"  model.path: directory {model_path!r} does not exist")
    reward = recipe.sft.reward
    if ":" in reward and reward.split(":", 1)[0].endswith(".py"):
        if not Path(reward.split(":", 1)[0]).is_file():
            problems.append(f"  sft.reward: file {reward.split(':', 1)[0]!r} does not exist")
    if problems:
        raise RecipeError("invalid recipe:\n" + "\n".join(problems))
    return recipe


__all__ = [
    "SftConfig",
    "SftRecipe",
    "is_sft_data",
    "load_sft_recipe",
    "read_recipe_data",
]
