"""Tiny random vision-language models, made offline: a Qwen2-VL-shaped one and an
Idefics3 (SmolVLM)-shaped one.

Each is a full HF model directory (config, safetensors, the character-level tokenizer of
:mod:`asyncrl.models.tiny` grown by the image tokens its architecture needs, a chat
template that renders image parts, and the image processor's settings) in a few hundred
kilobytes, built deterministically from a seed: the vision paths of engines and trainer
(image placeholders, pixel values, Qwen's 3-D rotary positions) run for real in seconds.

The image processors are the PIL ones (``...ImageProcessorPil``): transformers' default
ones need torchvision, which does not load beside this project's CPU torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.models.tiny import build_once, build_tokenizer

QWEN2_VL_NAME = "tiny-random-qwen2-vl"
QWEN2_5_VL_NAME = "tiny-random-qwen2.5-vl"
IDEFICS3_NAME = "tiny-random-idefics3"

QWEN2_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""Qwen2-VL's vision tokens: an image is ``<|vision_start|>`` + one ``<|image_pad|>`` per
merged patch + ``<|vision_end|>``."""
IDEFICS3_IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>"]
"""Idefics3's image tokens: an unsplit image is ``<fake_token_around_image><global-img>``
+ ``image_seq_len`` × ``<image>`` + ``<fake_token_around_image>``."""
IDEFICS3_TOKENS = [*IDEFICS3_IMAGE_TOKENS, "<end_of_utterance>"]
"""The special tokens the tiny Idefics3 adds to its vocabulary: the image tokens and the
end of a turn (SmolVLM's stop token, which the model must stay free to sample)."""


def chat_template(image_part: str) -> str:
    """The tiny model's chat template, extended to content lists: a part of type
    ``image`` becomes ``image_part``, a part of type ``text`` its text."""
    return (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for part in m['content'] %}"
        f"{{% if part['type'] == 'image' %}}{image_part}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        # a newline right after a block tag would be dropped (templates render with
        # trim_blocks): written as an expression it stays, as in the text template
        "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


def _vision_tokenizer(tokens: list[str], image_part: str) -> Any:
    tok = build_tokenizer()
    tok.add_tokens(tokens, special_tokens=True)
    tok.chat_template = chat_template(image_part)
    return tok


def _text_config(tok: Any) -> dict[str, Any]:
    """The language model: the tiny Llama's sizes (see :mod:`asyncrl.models.tiny`)."""
    return {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "bos_token_id": None,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def build_qwen2_vl(out: Path, seed: int = 0, *, v2_5: bool = False) -> None:
    """Writes a tiny Qwen2-VL into ``out``: one vision block of width 32 on 14-pixel
    patches merged 2×2, and images resized to at most 224×224 pixels (at most 64
    ``<|image_pad|>`` tokens each). ``v2_5``: the Qwen2.5-VL architecture instead (its
    vision tower's SwiGLU blocks, RMS norms and windowed attention: two blocks, the second
    attending over the whole image, with 56-pixel windows), the same tokens and
    processor."""
    import torch  # noqa: PLC0415 - on every process's path through models.resolve; only building the model needs it
    from transformers import (  # noqa: PLC0415 - as above
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: PLC0415 - as above
        Qwen2VLImageProcessorPil,
    )

    tok = _vision_tokenizer(QWEN2_VL_TOKENS, "<|vision_start|><|image_pad|><|vision_end|>")
    start, end, image, video = tok.convert_tokens_to_ids(QWEN2_VL_TOKENS)
    text = _text_config(tok)
    # head_dim 16: rotary frequencies split 2 + 3 + 3 over time, height and width
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
    }
    patches = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    tokens = {
        "vision_start_token_id": start,
        "vision_end_token_id": end,
        "image_token_id": image,
        "video_token_id": video,
    }
    config: Any
    if v2_5:
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": text["hidden_size"],
            "num_heads": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            **patches,
        }
        config = Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=True, **tokens
        )
    else:
        vision = {
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": text["hidden_size"],
            "num_heads": 2,
            "mlp_ratio": 2,
            **patches,
        }
        config = Qwen2VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=True, **tokens
        )
    torch.manual_seed(seed)
    model_class = Qwen2_5_VLForConditionalGeneration if v2_5 else Qwen2VLForConditionalGeneration
    model = model_class(config)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    processor = Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28)
    processor.save_pretrained(out)
    _note_processor_class(out, "Qwen2VLProcessor")


def build_idefics3(out: Path, seed: int = 0) -> None:
    """Writes a tiny Idefics3 into ``out``: one vision layer of width 32 on 8-pixel patches
    of 64×64 images, pixel-shuffled by 2 into 16 ``<image>`` tokens, without splitting
    images into tiles."""
    import torch  # noqa: PLC0415 - on every process's path through models.resolve; only building the model needs it
    from transformers import (  # noqa: PLC0415 - as above
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (  # noqa: PLC0415 - as above
        Idefics3ImageProcessorPil,
    )

    image_size, patch, scale = 64, 8, 2
    tok = _vision_tokenizer(IDEFICS3_TOKENS, "<image>")
    config = Idefics3Config(
        text_config={"model_type": "llama", **_text_config(tok)},
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": image_size,
            "patch_size": patch,
        },
        scale_factor=scale,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_len=(image_size // patch) ** 2 // scale**2,
        chat_template=tok.chat_template,
    )
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)


def _note_processor_class(out: Path, name: str) -> None:
    """Names the processor class in ``preprocessor_config.json``, as published Qwen2-VL
    checkpoints do (``AutoProcessor`` reads it). Written by hand: transformers cannot
    build a ``Qwen2VLProcessor`` without torchvision, which its video processor needs."""
    path = out / "preprocessor_config.json"
    settings = json.loads(path.read_text())
    settings["processor_class"] = name
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def build_qwen2_5_vl(out: Path, seed: int = 0) -> None:
    """Writes a tiny Qwen2.5-VL into ``out`` (:func:`build_qwen2_vl`)."""
    build_qwen2_vl(out, seed, v2_5=True)


TINY_VLMS: dict[str, Callable[[Path, int], None]] = {
    QWEN2_VL_NAME: build_qwen2_vl,
    QWEN2_5_VL_NAME: build_qwen2_5_vl,
    IDEFICS3_NAME: build_idefics3,
}
"""The tiny vision-language models by the ``model.path`` name that builds them."""


def tiny_vlm_dir(name: str, cache_dir: Path, seed: int = 0) -> Path:
    """Builds (once) and returns the directory of the tiny VLM ``name`` (a key of
    :data:`TINY_VLMS`) under ``cache_dir``. Safe under concurrent processes: it is written
    to a temporary directory and renamed into place."""
    if name not in TINY_VLMS:
        raise ValueError(f"no tiny vision model {name!r}: known are {', '.join(TINY_VLMS)}")
    target = cache_dir / f"{name}-s{seed}"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    return build_once(target, lambda folder: TINY_VLMS[name](folder, seed))
