"""How far a vision-language model's generation logprobs are from one forward's over
prompt + completion, on shapes images (the tiny random models, fp32, transformers alone).

    python bench/vision_gap.py                       # both tiny models, 8 images × 64 tokens
    python bench/vision_gap.py --models tiny-random-qwen2-vl --prompts 32 --new 128

    python bench/vision_gap.py --engine hf           # the hf engine generates instead
    python bench/vision_gap.py --engine hf --scorer trainer   # ... and the trainer scores

Each model samples ``--new`` tokens (T = 1, image tokens suppressed) for ``--prompts``
shapes questions; one forward over prompt + completion with the same image inputs
(:func:`asyncrl.models.vision.scoring_inputs`) then scores the completion. Printed per
model: the prompt lengths, the mean and maximum |generation − forward| over all sampled
tokens. By default transformers' ``generate`` samples, one prompt at a time: the floor.
With ``--engine hf`` the hf engine samples all prompts concurrently (continuous batching,
each image prompt prefilled alone with its pixel inputs), and the forward masks the image
tokens' logits as the engine does (:func:`asyncrl.models.vision.mask_placeholders`).
With ``--scorer trainer`` the trainer scores the engine's samples instead of that forward:
``TrainEngine.compute_logprobs`` with the recipe defaults (all samples packed into one
micro-batch with their images, ``asyncrl_varlen`` attention, the float32 LM head): the gap
between the logprobs a run's samples carry and those the trainer recomputes for them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["tiny-random-qwen2-vl", "tiny-random-idefics3"]
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--engine", choices=["generate", "hf"], default="generate")
    parser.add_argument("--scorer", choices=["forward", "trainer"], default="forward")
    args = parser.parse_args()
    if args.scorer == "trainer" and args.engine != "hf":
        parser.error("--scorer trainer scores the hf engine's samples: add --engine hf")

    import asyncio

    import torch
    from transformers import AutoModelForImageTextToText

    from asyncrl.api.inference import GenerateRequest, SamplingParams
    from asyncrl.data.shapes import shapes_records
    from asyncrl.engines.config import HFEngineConfig
    from asyncrl.engines.hf import HFEngine
    from asyncrl.models.resolve import ModelConfig
    from asyncrl.models.tiny_vlm import tiny_vlm_dir
    from asyncrl.models.vision import (
        VisionProcessor,
        mask_placeholders,
        open_image,
        record_messages,
        scoring_inputs,
    )
    from asyncrl.train.batch import Sample
    from asyncrl.train.config import TrainerConfig
    from asyncrl.train.engine import TrainEngine

    root = Path(tempfile.mkdtemp(prefix="vision-gap-"))
    records = shapes_records(args.prompts, seed=0, cache_dir=root / "shapes")
    for name in args.models:
        path = tiny_vlm_dir(name, root)
        proc = VisionProcessor(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        gaps, lengths = [], []
        start = time.perf_counter()
        if args.engine == "hf":
            prompts = [proc(record_messages(rec), [open_image(rec["image"])]) for rec in records]
            requests = [
                GenerateRequest(
                    input_ids=prompt["input_ids"][0].tolist(),
                    images=[rec["image"]],
                    sampling=SamplingParams(max_new_tokens=args.new, stop_token_ids=(), seed=i),
                )
                for i, (rec, prompt) in enumerate(zip(records, prompts, strict=True))
            ]

            async def run(requests=requests, path=path):
                config = HFEngineConfig(max_batch_size=len(requests))
                async with HFEngine(ModelConfig(path=str(path), dtype="float32"), config) as eng:
                    return await asyncio.gather(*(eng.agenerate(r) for r in requests))

            responses = asyncio.run(run())
            if args.scorer == "trainer":
                trainer = TrainEngine(TrainerConfig(), ModelConfig(path=str(path), dtype="float32"))
                batch = []
                for rec, prompt, resp in zip(records, prompts, responses, strict=True):
                    n = prompt["input_ids"].shape[1]
                    lengths.append(n)
                    ids = prompt["input_ids"][0].tolist() + resp.output_ids
                    mask = torch.arange(len(ids)) >= n
                    batch.append(
                        Sample(ids, mask, torch.zeros(len(ids)), 0.0, images=(rec["image"],))
                    )
                for sample, resp, lp in zip(
                    batch, responses, trainer.compute_logprobs(batch), strict=True
                ):
                    gaps.append((torch.tensor(resp.output_logprobs) - lp[sample.loss_mask]).abs())
                responses = []
            for prompt, resp in zip(prompts, responses, strict=False):
                n = prompt["input_ids"].shape[1]
                lengths.append(n)
                completion = torch.tensor([resp.output_ids])
                with torch.no_grad():
                    inputs = scoring_inputs(prompt, completion, proc.image_token_id)
                    logits = mask_placeholders(model(**inputs).logits, proc.placeholder_ids)
                scored = torch.log_softmax(logits[0, n - 1 : -1].float(), -1)
                scored = scored.gather(-1, completion[0, :, None])[:, 0]
                gaps.append((torch.tensor(resp.output_logprobs) - scored).abs())
        for i, rec in enumerate(records if args.engine == "generate" else []):
            prompt = proc(record_messages(rec), [open_image(rec["image"])])
            torch.manual_seed(i)
            with torch.no_grad():
                out = model.generate(
                    **prompt,
                    max_new_tokens=args.new,
                    min_new_tokens=args.new,
                    do_sample=True,
                    suppress_tokens=proc.placeholder_ids,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            n = prompt["input_ids"].shape[1]
            lengths.append(n)
            completion = out.sequences[:, n:]

            def logprobs(logits_BTV: torch.Tensor, ids: torch.Tensor = completion) -> torch.Tensor:
                return torch.log_softmax(logits_BTV.float(), -1).gather(-1, ids[..., None])[..., 0]

            sampled = logprobs(torch.stack(out.logits, dim=1))
            with torch.no_grad():
                logits = model(**scoring_inputs(prompt, completion, proc.image_token_id)).logits
            gaps.append((sampled - logprobs(logits[:, n - 1 : -1])).abs().flatten())
        gap = torch.cat(gaps)
        print(
            f"{name}: prompts of {min(lengths)}-{max(lengths)} tokens, {gap.numel()} sampled tokens, "
            f"mean |gap| {gap.mean():.1e}, max {gap.max():.1e} ({time.perf_counter() - start:.1f} s)"
        )


if __name__ == "__main__":
    main()
