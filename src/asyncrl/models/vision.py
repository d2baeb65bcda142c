"""Inputs of vision-language models: a chat with images as the model reads it, and the
inputs that score a sampled completion again (the trainer's recomputed logprobs).

What a forward pass needs besides ``input_ids`` and ``attention_mask``:

- Qwen2-VL / Qwen2.5-VL: ``pixel_values`` (all images' patches, flattened: ``[Σ t·h·w,
  3·temporal_patch·patch²]``), ``image_grid_thw`` (``[n_images, 3]``: patches in time,
  height and width), and ``mm_token_type_ids`` (1 on ``<|image_pad|>`` tokens, else 0),
  from which the model computes its 3-D rotary positions (:func:`mrope_position_ids`).
  Each image holds ``t·h·w / merge²`` pad tokens.
- Idefics3: ``pixel_values`` (``[batch, n_images, 3, H, W]``) and
  ``pixel_attention_mask`` (``[batch, n_images, H, W]``); its positions are plain 1-D.

The placeholder tokens are the processor's to place: a completion that samples one
breaks the count of image tokens against image features, so engines must never sample
them (:attr:`VisionProcessor.placeholder_ids`). The hf engine sets their logits to −∞
before it samples (:func:`mask_placeholders`), so its logprobs are those of the masked
distribution; a trainer that recomputes them applies the same mask.

Qwen2-VL's inputs are built here from its tokenizer and PIL image processor, exactly as
its ``Qwen2VLProcessor`` does: transformers cannot build that class without torchvision
(its video processor needs it), which does not load beside this project's CPU torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from asyncrl.models.tiny_vlm import (
    IDEFICS3_IMAGE_TOKENS,
    IDEFICS3_NAME,
    QWEN2_5_VL_NAME,
    QWEN2_VL_NAME,
    QWEN2_VL_TOKENS,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

QWEN_FAMILY = ("qwen2_vl", "qwen2_5_vl")
IDEFICS_FAMILY = ("idefics3",)


def vision_family(source: str | Path | PretrainedConfig) -> str | None:
    """The ``model_type`` of ``source`` (a model directory or hub id, whose config a hub id
    downloads, or a transformers config) when it is a vision-language model known here
    (:data:`QWEN_FAMILY`, :data:`IDEFICS_FAMILY`), else None. ``check``, which must not
    download, asks :func:`vision_family_offline`."""
    from transformers import AutoConfig, PretrainedConfig  # noqa: PLC0415 - heavy: only processes that load a model need it

    config = source if isinstance(source, PretrainedConfig) else AutoConfig.from_pretrained(source)
    model_type = str(config.model_type)
    return model_type if model_type in QWEN_FAMILY + IDEFICS_FAMILY else None


VISION_ATTENTION = "sdpa"
"""The vision tower's attention backend (bidirectional within an image)."""


def load_vision_lm(
    source: str | Path | PretrainedConfig,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    attn_implementation: str | None = None,
    seed: int = 0,
) -> Any:
    """A vision-language model (transformers' image-text-to-text class) in eval mode, its
    parameters in ``dtype`` on ``device``: from the directory or hub id ``source``, or
    random weights of the config ``source`` drawn from ``seed``. The language model
    attends with ``attn_implementation`` (default :data:`VISION_ATTENTION`), the vision
    tower with :data:`VISION_ATTENTION` whatever the language model uses."""
    import torch  # noqa: PLC0415 - heavy: only processes that run a vision model need it
    from transformers import AutoModelForImageTextToText, PretrainedConfig  # noqa: PLC0415 - as above
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 - as above

    attention = {"text_config": attn_implementation or VISION_ATTENTION}
    attention.update({"vision_config": VISION_ATTENTION, "": VISION_ATTENTION})
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "attn_implementation": attention}
    if isinstance(source, PretrainedConfig):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForImageTextToText.from_config(source, **kwargs)
    else:
        hf_logging.disable_progress_bar()
        model = AutoModelForImageTextToText.from_pretrained(source, **kwargs)
    return model.to(device).eval()


def placeholder_mask(
    vocab_size: int, placeholder_ids: Sequence[int], device: Any = None
) -> torch.Tensor:
    """``[vocab_size]`` booleans, true at the image placeholder ids: the entries of the
    logits that generation sets to −∞ (:func:`mask_placeholders`)."""
    import torch  # noqa: PLC0415 - heavy: only processes that run a vision model need it

    mask_V = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask_V[list(placeholder_ids)] = True
    return mask_V


def mask_placeholders(logits_NV: torch.Tensor, placeholder_ids: Sequence[int]) -> torch.Tensor:
    """``logits_NV`` (any leading dims, vocabulary last) with the placeholder ids at −∞, a
    new tensor. The hf engine samples a vision model's tokens from these, so its logprobs
    (temperature, top-k/top-p, renormalisation: :mod:`asyncrl.engines.sampling`) are of the
    distribution without the image tokens; a trainer scoring them masks the same way before
    its log-softmax, or its logprobs exceed the sampled ones by ``-log(1 - p_placeholders)``."""
    mask_V = placeholder_mask(logits_NV.shape[-1], placeholder_ids, logits_NV.device)
    return logits_NV.masked_fill(mask_V, float("-inf"))


def image_token_runs(input_ids: Sequence[int], image_token_id: int) -> list[int]:
    """The lengths of the runs of ``image_token_id`` in ``input_ids``, in order: one run per
    image for Qwen2-VL and unsplit Idefics3 images (one per tile where images are split)."""
    runs: list[int] = []
    previous = None
    for token in input_ids:
        if token == image_token_id:
            if previous == image_token_id:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = token
    return runs


def record_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A prompt record with an ``image`` (a path) as one user turn: the image, then the
    prompt text."""
    return [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": str(record["prompt"])}],
        }
    ]


def open_image(path: str | Path) -> Image.Image:
    """An image file as RGB (a processor normalises three channels)."""
    with Image.open(path) as image:
        return image.convert("RGB")


class VisionProcessor:
    """Turns a chat with images into one model's inputs (a batch of one), built from the
    processor files of the model directory ``path``."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer  # noqa: PLC0415 - heavy: only processes that feed a vision model need it

        self.model_type: str = AutoConfig.from_pretrained(path).model_type
        if self.model_type in QWEN_FAMILY:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.image_processor = AutoImageProcessor.from_pretrained(path)
            self.processor = None
            self.image_token = "<|image_pad|>"
            names = QWEN2_VL_TOKENS
        elif self.model_type in IDEFICS_FAMILY:
            self.processor = AutoProcessor.from_pretrained(path)
            self.tokenizer = self.processor.tokenizer
            self.image_processor = self.processor.image_processor
            self.image_token = "<image>"
            names = IDEFICS3_IMAGE_TOKENS
        else:
            known = ", ".join(QWEN_FAMILY + IDEFICS_FAMILY)
            raise ValueError(
                f"model.path: {self.model_type!r} is not a vision model known here ({known})"
            )
        tokenizer: Any = self.tokenizer
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self.placeholder_ids = [
            int(i) for i in tokenizer.convert_tokens_to_ids(names) if i != tokenizer.unk_token_id
        ]
        """The image tokens: placed by the processor only, never to be sampled."""

    def chat_text(self, messages: list[dict[str, Any]]) -> str:
        """The prompt as text, one placeholder per image, ready for generation."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return str(text)

    def __call__(
        self, messages: list[dict[str, Any]], images: Sequence[Image.Image]
    ) -> dict[str, torch.Tensor]:
        """The model's inputs for ``messages`` (with one ``{"type": "image"}`` part per
        image of ``images``, in order) as tensors with a batch dimension of one."""
        text = self.chat_text(messages)
        if self.processor is not None:
            inputs = self.processor(text=[text], images=[list(images)], return_tensors="pt")
            return dict(inputs)
        pixels = self.image_processor(images=list(images), return_tensors="pt")
        merge = int(self.image_processor.merge_size) ** 2
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the chat has {len(pieces) - 1} images, but {len(images)} were given")
        counts = [int(thw.prod()) // merge for thw in pixels["image_grid_thw"]]
        expanded = pieces[0] + "".join(
            self.image_token * n + piece for n, piece in zip(counts, pieces[1:], strict=True)
        )
        inputs = dict(self.tokenizer([expanded], return_tensors="pt"))
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.image_token_id).long()
        return {**inputs, **dict(pixels)}

    def pixel_inputs(
        self, input_ids: Sequence[int], images: Sequence[Image.Image]
    ) -> dict[str, torch.Tensor]:
        """The image inputs (``pixel_values`` and ``image_grid_thw``, or ``pixel_values`` and
        ``pixel_attention_mask``; a batch of one) of a prompt whose ``input_ids`` hold the
        placeholders of ``images``, expanded. Raises ``ValueError`` unless the processor
        expands ``images`` into the same runs of image tokens as ``input_ids`` hold (a
        prompt built for other images, sizes or another processor)."""
        given = image_token_runs(input_ids, self.image_token_id)
        if not images:
            if given:
                raise ValueError(
                    f"the prompt holds {len(given)} runs of image tokens but no image is given"
                )
            return {}
        chat = [{"role": "user", "content": [{"type": "image"}] * len(images)}]
        inputs = self(chat, images)
        expected = image_token_runs(inputs["input_ids"][0].tolist(), self.image_token_id)
        if given != expected:
            raise ValueError(
                f"the prompt's image tokens do not match its {len(images)} images: runs of "
                f"{given} image tokens in the prompt, the processor expands the images into "
                f"{expected}"
            )
        text_keys = ("input_ids", "attention_mask", "mm_token_type_ids")
        return {k: v for k, v in inputs.items() if k not in text_keys}


def scoring_inputs(
    prompt: dict[str, torch.Tensor], completion_ids: torch.Tensor, image_token_id: int
) -> dict[str, torch.Tensor]:
    """The inputs of one forward over prompt + completion (``completion_ids``: ``[1,
    T_completion]``) that scores the completion: the prompt's image inputs unchanged,
    ``mm_token_type_ids`` (where the model has them) extended with text zeros."""
    import torch  # noqa: PLC0415 - heavy: only processes that run a vision model need it

    input_ids = torch.cat([prompt["input_ids"], completion_ids], dim=1)
    inputs = {**prompt, "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if "mm_token_type_ids" in prompt:
        inputs["mm_token_type_ids"] = (input_ids == image_token_id).long()
        if bool(inputs["mm_token_type_ids"][:, prompt["input_ids"].shape[1] :].any()):
            raise ValueError("the completion holds image placeholder tokens")
    return inputs


def mrope_position_ids(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Qwen2-VL's rotary positions of ``inputs`` (a batch), ``[3, B, T]``: time, height and
    width. Text tokens count up by one on all three; an image's tokens share the time
    position and walk its grid; the text after it resumes past the grid's largest side.
    Positions are a function of the sequence alone: a packed row takes each sequence's
    own (:func:`packed_position_ids`)."""
    position_ids, _ = model.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        attention_mask=inputs.get("attention_mask"),
    )
    return position_ids


def packed_position_ids(model: Any, samples: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Qwen2-VL's positions for ``samples`` (each a batch of one) packed into one row,
    ``[4, 1, ΣT]``: each sequence's text positions (``0..T-1``) in front of its own
    rotary ones. From the first row the model finds where sequences start and masks
    attention to each; it does so only without an attention mask and without a KV cache,
    so the packed forward takes ``use_cache=False`` and no ``attention_mask``. The other
    inputs are concatenated: ``input_ids`` and ``mm_token_type_ids`` along the sequence,
    ``pixel_values`` and ``image_grid_thw`` along their first dimension, in order."""
    import torch  # noqa: PLC0415 - heavy: only processes that run a vision model need it

    rows = []
    for sample in samples:
        length = sample["input_ids"].shape[1]
        text = torch.arange(length).view(1, 1, length)
        rows.append(torch.cat([text, mrope_position_ids(model, sample)], dim=0))
    return torch.cat(rows, dim=2)


def vision_family_offline(spec: str) -> str | None:
    """The vision family of the ``model.path`` ``spec`` (a ``model_type`` of
    :data:`QWEN_FAMILY` or :data:`IDEFICS_FAMILY`), or None for a text model, found
    without downloading or building anything: the tiny models by name, a local folder by
    its ``config.json``, a hub id by its config where the local hub cache holds it, else
    by its name (``Qwen2-VL``, ``Qwen2.5-VL``, ``SmolVLM``, ``Idefics3``)."""
    named = {QWEN2_VL_NAME: "qwen2_vl", QWEN2_5_VL_NAME: "qwen2_5_vl", IDEFICS3_NAME: "idefics3"}
    if spec in named:
        return named[spec]
    config = Path(spec).expanduser() / "config.json"
    if not config.is_file() and spec.count("/") == 1:  # a hub id: its config if cached
        from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415 - hub ids only

        cached = try_to_load_from_cache(spec, "config.json")
        config = Path(cached) if isinstance(cached, str) else config
    if config.is_file():
        model_type = json.loads(config.read_text()).get("model_type")
        return model_type if model_type in QWEN_FAMILY + IDEFICS_FAMILY else None
    name = spec.rsplit("/", 1)[-1].lower()
    if "qwen2.5-vl" in name or "qwen2_5_vl" in name:
        return "qwen2_5_vl"
    if "qwen2-vl" in name or "qwen2_vl" in name:
        return "qwen2_vl"
    if "smolvlm" in name or "idefics3" in name:
        return "idefics3"
    return None


def record_images(record: dict[str, Any], image_key: str | None) -> list[str]:
    """The image files a prompt record names under ``image_key`` (one path, or a list of
    them); none without the key or the field."""
    if not image_key or record.get(image_key) is None:
        return []
    value = record[image_key]
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def with_images(messages: list[dict[str, Any]], n_images: int) -> list[dict[str, Any]]:
    """``messages`` with ``n_images`` image parts in front of the text of the first user
    turn (where a chat template renders each as the model's image placeholder)."""
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("role") == "user":
            text = m.get("content", "")
            parts = text if isinstance(text, list) else [{"type": "text", "text": str(text)}]
            m["content"] = [{"type": "image"} for _ in range(n_images)] + parts
            return out
    raise ValueError("a chat with images needs a user turn to hold them")
