"""The trainer's side of vision-language models: loading one, telling its vision part from
its language model, and adding the image inputs to a micro-batch.

A vision sample (:attr:`~asyncrl.train.batch.Sample.images`) carries its token ids with
the image placeholders already expanded, and the paths of its images; the pixels are
decoded here, per micro-batch, and handed to the model beside the ids:

- Qwen2-VL / Qwen2.5-VL: the images' ``pixel_values`` concatenated along their first
  dimension and ``image_grid_thw`` stacked, in the order the placeholders appear in the
  row (sample after sample); the 3-D rotary positions are each sequence's own
  (:func:`~asyncrl.models.vision.packed_position_ids`, ``[4, 1, ΣT]`` packed with the text
  positions in front, ``[3, B, T]`` padded).
- Idefics3: ``pixel_values [B, n, 3, H, W]`` and ``pixel_attention_mask [B, n, H, W]``,
  with ``B = 1`` and every sample's images in a row when packed, one row per sample padded
  (all-zero images fill a row up; the model drops them). Positions stay 1-D.

The vision tower attends with ``sdpa`` whatever ``trainer.attn_implementation`` names:
its attention is bidirectional over each image, which ``asyncrl_varlen`` (causal) is not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from asyncrl.models.vision import (
    QWEN_FAMILY,
    VisionProcessor,
    open_image,
    packed_position_ids,
)
from asyncrl.train.batch import Sample
from asyncrl.train.models import hf_model
from asyncrl.train.packing import MicroBatch

IMAGE_CACHE_BYTES = 256 * 2**20
"""Bytes of processed images kept per engine, the oldest dropped first: a group's samples
share their prompt's images, and a step scores them more than once (proximal, reference,
training forwards); a later step's samples rarely come back to an image, so the cache
needs to hold about one step's (a 224-pixel image is about 1.2 MB for Qwen2.5-VL)."""


def vision_module_names(lm: nn.Module) -> list[str]:
    """Names (in ``lm``) of the modules of the vision part: the base model's children
    other than its language model (Qwen2-VL's ``visual`` with its merger; Idefics3's
    ``vision_model`` and ``connector``)."""
    hf = hf_model(lm)
    decoder = hf.get_decoder()
    prefix = {id(m): n for n, m in lm.named_modules()}
    return [prefix[id(child)] for child in hf.model.children() if child is not decoder]


def vision_parameters(lm: nn.Module) -> list[nn.Parameter]:
    """The parameters of the vision part (:func:`vision_module_names`)."""
    modules = dict(lm.named_modules())
    return [p for name in vision_module_names(lm) for p in modules[name].parameters()]


def vision_linear_names(lm: nn.Module) -> list[str]:
    """Full names of the linear layers of the vision part: what LoRA must leave alone."""
    return [
        f"{root}.{name}" if name else root
        for root in vision_module_names(lm)
        for name, module in dict(lm.named_modules())[root].named_modules()
        if isinstance(module, nn.Linear)
    ]


def _pad_images(
    pixels: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], shape: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Idefics3's images of one row, ``[n, 3, H, W]`` pieces and their ``[n, H, W]``
    masks, as ``[slots, 3, height, width]`` and ``[slots, height, width]`` (``shape``):
    each zero-padded to the height and width (masked out), all-zero images after them up
    to ``slots`` (which the model drops)."""
    slots, height, width = shape
    out = torch.zeros(slots, 3, height, width)
    mask = torch.zeros(slots, height, width, dtype=torch.bool)
    at = 0
    for p, m in zip(pixels, masks, strict=True):
        n, _, h, w = p.shape
        out[at : at + n, :, :h, :w] = p
        mask[at : at + n, :h, :w] = m.bool()
        at += n
    return out, mask


class ImageInputs:
    """Adds the image inputs of a micro-batch's samples to its :class:`MicroBatch`, from
    the processor files of the model directory (``processor``); images are processed once
    per path (a cache bounded in bytes, :data:`IMAGE_CACHE_BYTES`). ``lm`` gives Qwen2-VL's rotary
    index (its weights play no part)."""

    def __init__(self, processor: VisionProcessor, lm: nn.Module) -> None:
        self.processor = processor
        self.lm = lm
        self.qwen = processor.model_type in QWEN_FAMILY
        self._cache: dict[str, dict[str, torch.Tensor]] = {}
        self._cached_bytes = 0

    def image(self, path: str) -> dict[str, torch.Tensor]:
        """One image's processed inputs: Qwen2-VL's ``pixel_values [P, D]`` and
        ``image_grid_thw [1, 3]``, or Idefics3's ``pixel_values [n, 3, H, W]`` and
        ``pixel_attention_mask [n, H, W]`` (``n`` tiles)."""
        hit = self._cache.get(path)
        if hit is not None:
            return hit
        image = open_image(path)
        if self.qwen:
            out = dict(self.processor.image_processor(images=[image], return_tensors="pt"))
        else:
            raw = self.processor.image_processor(images=[[image]], return_tensors="pt")
            out = {
                "pixel_values": raw["pixel_values"][0],
                "pixel_attention_mask": raw["pixel_attention_mask"][0],
            }
        size = sum(t.nbytes for t in out.values())
        while self._cache and self._cached_bytes + size > IMAGE_CACHE_BYTES:
            oldest = self._cache.pop(next(iter(self._cache)))
            self._cached_bytes -= sum(t.nbytes for t in oldest.values())
        self._cache[path] = out
        self._cached_bytes += size
        return out

    def attach(self, mb: MicroBatch, samples: Sequence[Sample], *, packed: bool) -> MicroBatch:
        """``mb`` (laid out from ``samples`` by
        :func:`~asyncrl.train.packing.build_micro_batch`) with the model's image inputs
        and, for Qwen2-VL, its 3-D rotary positions."""
        per_sample = [[self.image(p) for p in s.images] for s in samples]
        if self.qwen and not samples:  # an idle rank's two-token dummy: text positions
            n = mb.input_ids.shape[1]
            mb.position_ids = torch.arange(n).expand(4 if packed else 3, 1, n).clone()
            return mb
        if self.qwen:
            images = [img for imgs in per_sample for img in imgs]
            if images:
                mb.image_inputs = {
                    "pixel_values": torch.cat([i["pixel_values"] for i in images]),
                    "image_grid_thw": torch.cat([i["image_grid_thw"] for i in images]),
                }
            mb.position_ids = self._rope_positions(samples, per_sample, mb, packed=packed)
            return mb
        if not any(per_sample):
            return mb
        rows = [[img for imgs in per_sample for img in imgs]] if packed else per_sample
        every = [img["pixel_values"] for imgs in per_sample for img in imgs]
        shape = (
            max(sum(i["pixel_values"].shape[0] for i in row) for row in rows),
            max(p.shape[-2] for p in every),
            max(p.shape[-1] for p in every),
        )
        pixels, masks = zip(
            *(
                _pad_images(
                    [i["pixel_values"] for i in row],
                    [i["pixel_attention_mask"] for i in row],
                    shape,
                )
                for row in rows
            ),
            strict=True,
        )
        mb.image_inputs = {
            "pixel_values": torch.stack(pixels),
            "pixel_attention_mask": torch.stack(masks),
        }
        return mb

    def _rope_positions(
        self,
        samples: Sequence[Sample],
        per_sample: list[list[dict[str, torch.Tensor]]],
        mb: MicroBatch,
        *,
        packed: bool,
    ) -> torch.Tensor:
        """Qwen2-VL's positions of the micro-batch: ``[4, 1, ΣT]`` packed, ``[3, B, T]``
        padded (0 on padding, which no real token reads)."""
        image_token_id = self.processor.image_token_id
        inputs = []
        for s, imgs in zip(samples, per_sample, strict=True):
            ids = s.input_ids[None]
            one: dict[str, torch.Tensor] = {
                "input_ids": ids,
                "mm_token_type_ids": (ids == image_token_id).long(),
            }
            if imgs:
                one["image_grid_thw"] = torch.cat([i["image_grid_thw"] for i in imgs])
            inputs.append(one)
        model = hf_model(self.lm)
        if packed:
            return packed_position_ids(model, inputs)
        width = mb.input_ids.shape[1]
        out = torch.zeros(3, len(samples), width, dtype=torch.int64)
        for b, one in enumerate(inputs):
            rows = packed_position_ids(model, [one])[1:, 0]
            out[:, b, : rows.shape[1]] = rows
        return out


def save_processor(processor: VisionProcessor, path: str) -> None:
    """Writes the image processor's files (and Idefics3's processor's) beside exported
    weights, so that the directory is a vision model directory of its own."""
    if processor.processor is not None:
        processor.processor.save_pretrained(path)
    else:
        processor.image_processor.save_pretrained(path)
