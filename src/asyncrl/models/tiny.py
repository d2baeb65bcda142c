"""``tiny-random-llama``: a character-level tokenizer and a tiny random Llama, made offline.

For tests and the CI recipe: a full HF model directory (config, safetensors, tokenizer
with a chat template) in a few hundred kilobytes, built deterministically from a seed, so
every part of the system (generation, packing, FSDP, weight transfer, chat templates) runs
for real in seconds without any download.
"""

from __future__ import annotations

import os
import shutil
import string
import tempfile
from collections.abc import Callable
from pathlib import Path

TINY_NAME = "tiny-random-llama"
SPECIAL_TOKENS = ["<pad>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer():  # type: ignore[no-untyped-def]
    """A character-level fast tokenizer: printable ASCII plus chat special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 - on every process's path through models.resolve; only building the model needs it
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - on every process's path through models.resolve; only building the model needs it

    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="?",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model_dir(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Builds (once) and returns the directory of the tiny model. Safe under concurrent
    processes: it is written to a temporary directory and renamed into place."""
    root = cache_dir or Path(os.environ.get("ASYNCRL_CACHE", Path.home() / ".cache" / "asyncrl"))
    target = root / f"{TINY_NAME}-s{seed}"
    if (target / "config.json").is_file():
        return target
    import torch  # noqa: PLC0415 - on every process's path through models.resolve; only building the model needs it
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - on every process's path through models.resolve; only building the model needs it

    root.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)

    return build_once(target, write)


def build_once(target: Path, write: Callable[[Path], None]) -> Path:
    """``target`` as ``write`` fills it, written into a temporary folder beside it and
    renamed into place, so that concurrent builders never see half a model: the first
    rename wins and the others' identical copies are dropped."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
