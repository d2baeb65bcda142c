"""The train engine: a causal LM under FSDP2 (or plain, in one process), stepped with the
clipped policy loss on packed micro-batches.

Distributed contract: under ``torchrun`` (a process group already initialised, gloo on
CPU, NCCL on CUDA) every rank builds a ``TrainEngine`` with the same config and calls each
method in the same order: with the *same global batch*, which the engine splits across
ranks and micro-batches itself, or, for :meth:`TrainEngine.train_shard`, with its own
shard of a split planned once (:mod:`asyncrl.train.shard`). Without a process group the engine runs the model unsharded
in this process, with the same numerics up to float summation order.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from transformers import AutoTokenizer

from asyncrl.algo.loss import agg_count, policy_loss
from asyncrl.algo.mismatch import mismatch_stats
from asyncrl.config.schema import resolve_device
from asyncrl.models.resolve import (
    ModelConfig,
    dequantized_gguf,
    load_causal_lm,
    resolve_dtype,
    resolve_model_path,
    torch_dtype,
)
from asyncrl.models.vision import VisionProcessor, load_vision_lm, vision_family
from asyncrl.runtime.log import get_logger
from asyncrl.train import cpu_fused, dcp, trainer_threads
from asyncrl.train.attention import register as register_attention
from asyncrl.train.batch import Batch
from asyncrl.train.config import TrainerConfig
from asyncrl.train.lora import apply_lora, export_adapter, iter_merged_weights
from asyncrl.train.models import (
    HeadPrecision,
    Setting,
    TokenLogprobs,
    apply_fsdp,
    choose_head_precision,
    decoder_layers,
)
from asyncrl.train.packing import (
    MicroBatch,
    build_micro_batch,
    plan_micro_batches,
    sharing_sets,
)
from asyncrl.train.schedule import lr_at
from asyncrl.train.shard import TrainShard, plan_shards
from asyncrl.train.step_stats import StepTotals
from asyncrl.train.vision import (
    ImageInputs,
    save_processor,
    vision_linear_names,
    vision_parameters,
)

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe
    from asyncrl.sft.config import SftRecipe

log = get_logger(part="train-engine")


def _field(name: str, value: torch.Tensor) -> dict[str, Any]:
    # Any: replace() type-checks keyword values against every field of Sample.
    return {name: value}


def _fill(batch: Batch, field: str, values: list[torch.Tensor]) -> Batch:
    """``batch`` with ``field`` set to ``values`` on the samples where it is None."""
    return [
        s if getattr(s, field) is not None else dataclasses.replace(s, **_field(field, v))
        for s, v in zip(batch, values, strict=True)
    ]


class TrainEngine:
    """Owns the model, optimizer and schedule of one trainer rank.

    Built from the recipe's sections themselves: ``config`` is the ``trainer`` section,
    ``model`` the ``model`` section (its path is loaded, or with ``architecture``, a
    transformers ``PretrainedConfig``, random weights of that architecture are initialised
    instead: tests and benches), ``seed`` the run's seed (random init and the torch RNG of
    every rank).

    A vision-language model (Qwen2-VL, Qwen2.5-VL, Idefics3: :mod:`asyncrl.train.vision`)
    is loaded with transformers' image-text-to-text class and trains on samples with
    :attr:`~asyncrl.train.batch.Sample.images`: each micro-batch carries its samples'
    processed images, the logprobs exclude the image placeholder ids as the engines'
    sampling does, its vision part is frozen unless ``trainer.freeze_vision`` is false,
    LoRA adapts its language model only, and prefix sharing is off.

    Attributes:
        lm: the transformers model (its parameters are DTensor shards under FSDP); use it
            directly only outside the engine's collectives, e.g. for sampling in one process.
        module: the FSDP root, :class:`~asyncrl.train.models.TokenLogprobs` around ``lm``.
        ref_module: the frozen reference policy (initial weights), or None when
            ``loss.kl_coef`` is 0 or with LoRA (whose reference is the base model: ``lm``
            with its adapters disabled, no second copy).
        lora: whether ``trainer.lora`` put adapters on the model: then ``lm`` is a peft
            model, only the adapters train and have optimizer state, and checkpoints hold
            only them (the base is reloaded from ``model.path``).
        step: train steps (batches) taken, skipped non-finite steps included.
        version: policy version of the current weights; starts at 0 and is bumped by every
            ``train_step`` (a skipped step too: the buffer counts batches consumed).
        skipped_nonfinite: optimizer steps skipped for a non-finite gradient norm.
    """

    def __init__(
        self,
        config: TrainerConfig,
        model: ModelConfig,
        *,
        seed: int = 0,
        architecture: Any = None,
    ) -> None:
        self.config = config
        self.model_config = model
        self.seed = seed
        # what load_causal_lm builds: a model directory or hub id, or an architecture
        self._source: Any = (
            architecture if architecture is not None else resolve_model_path(model.path)
        )
        # model.gguf_file: loaded from its dequantized copy in the cache where it is a
        # local file (read once per machine), else by transformers from the file
        self._gguf = model.gguf_file
        if self._gguf and architecture is None:
            dequantized = dequantized_gguf(self._source, self._gguf)
            if dequantized is not None:
                self._source, self._gguf = str(dequantized), None
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.device = torch.device(
            resolve_device(config.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype_name = resolve_dtype(model.dtype, self.device.type)
        self.param_dtype = torch_dtype(self.dtype_name)
        # what FSDP sums gradients over ranks in (trainer.reduce_dtype)
        self.reduce_dtype = torch_dtype(config.reduce_dtype)
        self.step = 0
        self.version = 0
        self.skipped_nonfinite = 0
        torch.manual_seed(seed + self.rank)
        # a vision-language model: its processor (from model.path's files) and image inputs
        self.vision_processor: VisionProcessor | None = None
        # (a GGUF file holds a text model: its folder has no config to ask)
        if not model.gguf_file and vision_family(self._source) is not None:
            if config.share_prefix is True:
                raise ValueError(
                    "trainer.share_prefix = true: a vision-language model's samples share no "
                    'prefix (positions and image features are per sequence); set "auto" or false'
                )
            if self.world_size > 1:
                raise ValueError(
                    f"trainer.nproc × trainer.nodes = {self.world_size} ranks: a vision-language "
                    "model trains on one rank for now (a rank whose micro-batch holds no image "
                    "would skip the vision tower's collectives)"
                )
            self.vision_processor = VisionProcessor(resolve_model_path(model.path))
        self.shares_prefix = config.shares_prefix and self.vision_processor is None

        lm = self._load_lm()
        if self.vision_processor is not None and config.freeze_vision:
            for param in vision_parameters(lm):
                param.requires_grad_(False)
        if config.gradient_checkpointing:
            # Non-reentrant: the only kind that composes with FSDP2's hooks. transformers 5
            # renamed the method; the old name still works there but warns.
            kwargs = {"use_reentrant": False}
            hf: Any = lm
            if hasattr(hf, "activation_checkpointing_enable"):
                hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if config.compile:
            for layer in decoder_layers(lm):
                layer.compile(dynamic=True)
        self.fused_layers = self._fuse(lm)
        self.lora = config.lora.enabled
        if self.lora:
            # before FSDP, which shards them too; a vision tower gets none
            exclude = vision_linear_names(lm) if self.vision_processor is not None else []
            lm = apply_lora(lm, config.lora, seed=seed, exclude=exclude)
        self.lm = lm
        self.images: ImageInputs | None = None
        if self.vision_processor is not None:
            self.images = ImageInputs(self.vision_processor, lm)
        self.module: nn.Module = self._wrap(lm)
        # The reference policy of the KL penalty: the initial weights, frozen, laid out
        # like the policy (same device, dtype and sharding). A restore never touches it, so
        # a resumed run keeps penalising the distance to where training began.
        self.ref_module: nn.Module | None = None
        if config.loss.kl_coef > 0 and not self.lora:
            ref_lm = self._load_lm()
            self._fuse(ref_lm)
            ref_lm.requires_grad_(False)
            self.ref_module = self._wrap(ref_lm).eval()
        self.optimizer = torch.optim.AdamW(
            self._param_groups(),
            lr=config.optim.lr,
            betas=config.optim.betas,
            eps=config.optim.adam_eps,
            # one kernel over all parameters: torch's default is a loop of per-tensor ops on
            # the CPU (4-7x slower for SmolLM2's, bench/optimizer.py) and on CUDA a
            # multi-tensor form that still reads and writes each state several times
            fused=self.device.type in ("cpu", "cuda"),
        )
        self._tokenizer: Any = None
        self._tokenizer_looked_up = False
        self._offloaded = False  # parameters and optimizer state in host memory (colocation)

    # --- setup ------------------------------------------------------------------------------

    def _load_lm(self) -> nn.Module:
        """The model in float32 (the master weights) on the CPU, without a KV cache (a
        training forward sees whole sequences)."""
        register_attention()  # trainer.attn_implementation may name asyncrl_varlen
        if self.vision_processor is not None:
            vlm: Any = load_vision_lm(
                self._source, attn_implementation=self.config.attn_implementation, seed=self.seed
            )
            vlm.config.use_cache = False
            return vlm  # type: ignore[no-any-return]
        lm = load_causal_lm(
            self._source,
            attn_implementation=self.config.attn_implementation,
            seed=self.seed,
            gguf_file=self._gguf,
        )
        lm.config.use_cache = False
        return lm  # type: ignore[no-any-return]

    def _fuse(self, lm: nn.Module) -> int:
        """``trainer.cpu_fused``: the elementwise parts of ``lm``'s decoder layers in C
        where the engine computes in float32 on the CPU without compiling them; the layers
        done (0 elsewhere, or where :func:`~asyncrl.train.cpu_fused.unsupported` says why
        not, logged)."""
        if not (
            self.config.cpu_fused
            and not self.config.compile
            and self.device.type == "cpu"
            and self.param_dtype == torch.float32
            and self.vision_processor is None
        ):
            return 0
        why = cpu_fused.unsupported(lm)
        if why is not None:
            log.info("trainer.cpu_fused: the layers run as transformers writes them", reason=why)
            return 0
        return cpu_fused.install(lm)

    def _wrap(self, lm: nn.Module) -> nn.Module:
        """``lm`` as a :class:`TokenLogprobs` root on the engine's device, FSDP-sharded
        when distributed."""
        processor = self.vision_processor
        module = TokenLogprobs(
            lm,
            chunk_tokens=self.config.lm_head_chunk_tokens,
            recompute_head=self.config.lm_head_recompute,
            vision=processor is not None,
            never_sampled=processor.placeholder_ids if processor is not None else (),
            head_precision=self.head_precision,
        )
        module.to(self.device)
        if self.distributed:
            mesh = init_device_mesh(self.device.type, (self.world_size,))
            apply_fsdp(
                module,
                mesh,
                param_dtype=self.param_dtype,
                reduce_dtype=self.reduce_dtype,
                reshard_after_forward=self.config.reshard_after_forward,
            )
        return module

    def _param_groups(self) -> list[dict[str, Any]]:
        # Weight decay on matrices only: decaying norms' gains and biases towards 0 only
        # fights the model (the usual AdamW recipe).
        decay = [p for p in self.module.parameters() if p.requires_grad and p.ndim >= 2]
        rest = [p for p in self.module.parameters() if p.requires_grad and p.ndim < 2]
        return [
            {"params": decay, "weight_decay": self.config.optim.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ]

    @property
    def head_precision(self) -> HeadPrecision:
        """``trainer.lm_head_precision``, ``auto`` decided for this device and dtype."""
        return choose_head_precision(self.config.lm_head_precision, self.param_dtype, self.device)

    def _autocast(self) -> AbstractContextManager[Any]:
        # Under FSDP the mixed-precision policy casts; unsharded, autocast does the same job.
        if self.distributed or self.param_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.param_dtype)

    def _reshard(self, root: nn.Module | None = None) -> None:
        """Frees gathered weights and re-registers the shards of ``root`` (default: the
        policy). The FSDP root keeps its weights gathered after forward, expecting a
        backward; after a no-grad forward nothing else would free them, and the module would
        expose plain full-size views of a buffer that the next collective reuses."""
        if not self.distributed:
            return

        for module in (root or self.module).modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    # --- colocation -------------------------------------------------------------------------

    def offload(self) -> tuple[int, float]:
        """Moves the parameters (the policy's and the KL reference's) and the optimizer
        state to host memory, so that an engine on the same GPU can generate
        (``rollout.colocate``); returns (device bytes freed, seconds). On the CPU there is
        nothing to move: (0, 0.0)."""
        if self.device.type != "cuda" or self._offloaded:
            return 0, 0.0
        return self._move("cpu", offloaded=True)

    def onload(self) -> tuple[int, float]:
        """Brings back what :meth:`offload` moved; returns (device bytes taken, seconds)."""
        if self.device.type != "cuda" or not self._offloaded:
            return 0, 0.0
        return self._move(self.device, offloaded=False)

    def _move(self, device: torch.device | str, *, offloaded: bool) -> tuple[int, float]:
        t0 = time.perf_counter()
        self._reshard()
        self._sync()
        before = torch.cuda.memory_allocated(self.device)
        for module in (self.module, self.ref_module):
            if module is not None:
                module.to(device)  # in place: the optimizer's keys stay these parameters
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = value.to(device, non_blocking=True)
        self._sync()
        if offloaded:
            torch.cuda.empty_cache()
        self._offloaded = offloaded
        moved = abs(before - torch.cuda.memory_allocated(self.device))
        return moved, time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- forward ----------------------------------------------------------------------------

    def _plan(self, batch: Batch) -> list[list[int]]:
        max_tokens = self.config.max_tokens_per_microbatch
        plan = plan_micro_batches(
            [len(s) for s in batch],
            max_tokens,
            self.world_size,
            padded=not self.config.packing,
            shared=sharing_sets(batch, max_tokens) if self.shares_prefix else (),
        )
        return plan[self.rank]

    def _micro_batches(self, batch: Batch, *, all_positions: bool = False) -> Iterator[MicroBatch]:
        for idx in self._plan(batch):
            yield self._shard_micro_batch(batch, idx, all_positions=all_positions)

    def _logprobs_BT(self, mb: MicroBatch, module: nn.Module | None = None) -> torch.Tensor:
        """``[B, T]`` float32 logprobs of the micro-batch's targets under ``module``
        (default: the policy), 0 elsewhere."""
        lp_BT, _ = self._forward_BT(mb, module, with_entropy=False)
        return lp_BT

    def _forward_BT(
        self, mb: MicroBatch, module: nn.Module | None = None, *, with_entropy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` float32 logprobs and entropies (0 without ``with_entropy``) of the
        sampled distribution (temperature, then the top-k/top-p cut) at the micro-batch's
        targets, 0 elsewhere; one LM-head pass gives both. (float64 for a float64 model,
        as the LM head computes them: :func:`~asyncrl.train.models.head_dtype`.)"""
        temperature, top_k, top_p = self._sampling_M(mb)
        with self._autocast():
            lp_M, ent_M = (module or self.module)(
                mb.input_ids,
                mb.position_ids,
                mb.attention_mask,
                mb.target_index,
                temperature,
                mb.cu_seqlens,
                mb.max_len_q,
                top_k,
                top_p,
                with_entropy,
                source_index=mb.source_index,
                key_index=mb.key_index,
                cu_seqlens_k=mb.cu_seqlens_k,
                max_len_k=mb.max_len_k,
                image_inputs=mb.image_inputs,
            )
        dtype = torch.promote_types(lp_M.dtype, torch.float32)
        out = torch.zeros(mb.loss_mask_BT.shape, dtype=dtype, device=self.device)
        index = (mb.target_row, mb.target_col)
        return out.index_put(index, lp_M.to(dtype)), out.index_put(index, ent_M.to(dtype))

    def _sampling_M(self, mb: MicroBatch) -> tuple[Setting, Setting, Setting]:
        """The temperature, top_k and top_p the micro-batch's targets were sampled with:
        the trainer's own (``rollout.sampling``) as scalars, or ``[M]`` tensors, one value
        per target, when some sequence's calls chose their own (``Sample.sampled_with``)."""
        cfg = self.config
        if not mb.sampled_with:
            return cfg.temperature, cfg.top_k, cfg.top_p
        own = (cfg.temperature, cfg.top_k, cfg.top_p)
        rows = [own if s is None else (s.temperature, s.top_k, s.top_p) for s in mb.sampled_with]
        temperature_B, top_k_B, top_p_B = zip(*rows, strict=True)
        row_M = mb.target_row
        return (
            torch.tensor(temperature_B, dtype=torch.float32, device=self.device)[row_M],
            torch.tensor(top_k_B, dtype=torch.int64, device=self.device)[row_M],
            torch.tensor(top_p_B, dtype=torch.float64, device=self.device)[row_M],
        )

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, *, all_positions: bool = False) -> list[torch.Tensor]:
        """Logprobs of every sequence under the current weights, in the :mod:`batch
        <asyncrl.train.batch>` alignment: ``[L]`` float32 (float64 for a float64 model) on
        the CPU, value at ``t`` = ``log p(token_t | tokens_<t)`` of the temperature-scaled
        distribution, at the ``loss_mask`` positions (every position but 0 with
        ``all_positions``), 0 elsewhere.

        These are the proximal logprobs of decoupled PPO. Collective; every rank returns the
        whole batch's logprobs.
        """
        self.module.eval()
        return self._score(batch, self.module, all_positions=all_positions)

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: Batch) -> list[torch.Tensor]:
        """Like :meth:`compute_logprobs`, under the frozen reference weights (the initial
        ones). Only when ``loss.kl_coef > 0``; collective."""
        module, scope = self._reference()
        with scope:
            return self._score(batch, module, all_positions=False)

    def _reference(self) -> tuple[nn.Module, AbstractContextManager[Any]]:
        """The reference policy's root, and the context to score under: the frozen copy,
        or with LoRA the policy itself with its adapters disabled (the base model)."""
        if self.lora:
            peft_lm: Any = self.lm
            return self.module, peft_lm.disable_adapter()
        if self.ref_module is None:
            raise ValueError("no reference model: loss.kl_coef is 0")
        return self.ref_module, nullcontext()

    def _score(self, batch: Batch, module: nn.Module, *, all_positions: bool) -> list[torch.Tensor]:
        if not batch:
            raise ValueError("empty batch")
        lengths = [len(s) for s in batch]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        flat: torch.Tensor | None = None
        for mb in self._micro_batches(batch, all_positions=all_positions):
            lp_BT = self._logprobs_BT(mb, module)
            if flat is None:  # float32, or float64 for a float64 model
                flat = torch.zeros(offsets[-1], dtype=lp_BT.dtype, device=self.device)
            for row, i in enumerate(mb.seq_index):
                flat[offsets[i] : offsets[i + 1]] = lp_BT[row, : lengths[i]]
        self._reshard(module)
        assert flat is not None, "every rank runs at least one micro-batch"
        if self.distributed:
            # Each sequence was computed on exactly one rank and is 0 on the others.
            dist.all_reduce(flat)
        flat = flat.cpu()
        return [flat[offsets[i] : offsets[i + 1]].clone() for i in range(len(batch))]

    # --- training ---------------------------------------------------------------------------

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One train step on the global ``batch``, which every rank passes: each takes its
        own shard of :func:`~asyncrl.train.shard.plan_shards` and runs :meth:`train_shard`.
        Collective."""
        return self.train_shard(plan_shards(batch, self.config, self.world_size)[self.rank])

    def train_shard(self, shard: TrainShard) -> dict[str, float]:
        """One train step on this rank's ``shard`` of a global batch (every rank passes its
        own, planned together by :func:`~asyncrl.train.shard.plan_shards`):
        ``ppo_minibatches`` optimizer steps, one per minibatch of whole sequences
        (:func:`~asyncrl.train.packing.split_minibatches`), then version + 1. Returns its
        statistics.

        Each minibatch's loss is the :func:`~asyncrl.algo.policy_loss` of that minibatch,
        whatever its split into ranks and micro-batches: each micro-batch's loss is weighted
        by its share of the minibatch's aggregation units. ``seq-mean-token-sum-norm``
        without ``loss.norm_len`` uses the longest loss span of the whole batch. The lr
        schedule advances once per train step, not per minibatch.

        The proximal policy of decoupled PPO, when no sample carries ``old_logprobs`` and
        ``loss.proximal = "recompute"``, is the current weights: with one minibatch, the
        training forward's own logprobs, detached (the values a separate no-grad forward
        would give, without its cost; the ratio is then exactly 1, and the clip can only act
        from a second optimizer step on); with several minibatches, one no-grad forward over
        the whole batch before the first, so that each later minibatch measures, and clips,
        how far the earlier ones moved the policy. Samples that carry ``old_logprobs`` are
        decoupled against them (all or none; with recompute on, missing ones are filled by
        a forward); with recompute off and none given, the loss is plain PPO against
        ``behav_logprobs``. (Under dropout, free proximal logprobs share the training
        forward's mask.) With ``loss.kl_coef > 0``, samples without ``ref_logprobs`` are
        first scored by the frozen reference model.

        An optimizer step whose gradient norm is not finite changes no weight and is counted
        in ``skipped_nonfinite``. Collective.

        Statistics: ``loss``, ``pg_loss`` and ``grad_norm`` are means over the minibatches;
        clip fractions, ratio, KLs and importance weights are means over the batch's loss
        tokens; ``optimizer_steps`` counts the steps taken, ``minibatches`` those planned.
        ``mismatch/*`` (:func:`~asyncrl.algo.mismatch.mismatch_stats`) compare the
        behaviour logprobs with the proximal ones (plain PPO: with each minibatch's training
        forward); on a batch sampled at the engine's version, before any update, they
        measure how far the trainer's view of the sampling policy is from the engine's.
        """
        t_start = time.perf_counter()
        stats: dict[str, float] = {}
        samples: Batch = shard.samples
        if shard.fill_proximal:
            self.module.eval()
            samples = _fill(samples, "old_logprobs", self._score_shard(shard, self.module))
            stats["time/proximal_s"] = time.perf_counter() - t_start
        if shard.fill_ref:
            t_ref = time.perf_counter()
            module, scope = self._reference()
            module.eval()
            with scope:
                ref_logprobs = self._score_shard(shard, module)
            samples = _fill(samples, "ref_logprobs", ref_logprobs)
            stats["time/ref_s"] = time.perf_counter() - t_ref
        lr = self._apply_lr()

        self.module.train()
        totals = StepTotals(device=self.device)
        grad_norms = []
        for micro, units_total in zip(shard.minibatches, shard.units_total, strict=True):
            grad_norm = self._minibatch_step(
                samples,
                micro,
                units_total,
                totals,
                mode=shard.mode,
                norm_len=shard.norm_len,
                episode_tokens=shard.episode_tokens,
            )
            grad_norms.append(grad_norm)
            if not math.isfinite(grad_norm):
                self.skipped_nonfinite += 1
        self.step += 1
        self.version += 1
        self._sync()
        t_end = time.perf_counter()

        stats.update(totals.reduce(loss_tokens=shard.loss_tokens, minibatches=len(grad_norms)))
        finite_steps = sum(math.isfinite(g) for g in grad_norms)
        stats.update(
            {
                "grad_norm": sum(grad_norms) / len(grad_norms),
                "lr": lr,
                "step": float(self.step),
                "version": float(self.version),
                "minibatches": float(len(grad_norms)),
                "optimizer_steps": float(finite_steps),
                "step_skipped": 0.0 if finite_steps == len(grad_norms) else 1.0,
                "skipped_nonfinite": float(self.skipped_nonfinite),
                "sequences": float(shard.sequences),
                "tokens": float(shard.tokens),
                "loss_tokens": float(shard.loss_tokens),
                "time/step_s": t_end - t_start,
                "tokens_per_s": shard.tokens / max(1e-9, t_end - t_start),
            }
        )
        return stats

    def _shard_micro_batch(
        self, samples: Batch, idx: list[int], *, all_positions: bool = False
    ) -> MicroBatch:
        """The micro-batch of ``samples[i]`` for ``i`` in ``idx``, on the engine's device,
        with its image inputs for a vision model."""
        chosen = [samples[i] for i in idx]
        if self.images is None and any(s.images for s in chosen):
            raise ValueError("samples with images need a vision-language model.path")
        mb = build_micro_batch(
            chosen,
            idx,
            packed=self.config.packing,
            all_positions=all_positions,
            share_prefix=self.shares_prefix,
        )
        if self.images is not None:
            mb = self.images.attach(mb, chosen, packed=self.config.packing)
        return mb.to(self.device)

    @torch.no_grad()
    def _score_shard(self, shard: TrainShard, module: nn.Module) -> list[torch.Tensor]:
        """Logprobs of the shard's sequences under ``module`` (as :meth:`compute_logprobs`
        gives them), over the shard's own micro-batches: every rank runs as many forwards
        as the others, and each scores only its own sequences."""
        out: list[torch.Tensor] = [torch.zeros(0)] * len(shard.samples)
        for micro in shard.minibatches:
            for idx in micro:
                mb = self._shard_micro_batch(shard.samples, idx)
                lp_BT = self._logprobs_BT(mb, module)
                for row, i in enumerate(mb.seq_index):
                    out[i] = lp_BT[row, : mb.lengths[row]].cpu()
        self._reshard(module)
        return out

    def _minibatch_step(
        self,
        samples: Batch,
        micro: list[list[int]],
        total_units: int,
        totals: StepTotals,
        *,
        mode: str,
        norm_len: float,
        episode_tokens: list[int],
    ) -> float:
        """Forward and backward over this rank's micro-batches of one minibatch (``micro``:
        indices into ``samples``; ``total_units``: the minibatch's aggregation units over
        all ranks; ``episode_tokens``: per sample, its episode's loss tokens in the
        minibatch over all ranks, empty for one episode per sample), then one optimizer
        step (none if the gradient norm is not finite).
        ``mode``: where the proximal logprobs come from (``free``: this forward, detached;
        ``given``: the samples; ``behaviour``: none, plain PPO). Adds to ``totals``;
        returns the gradient norm."""
        loss_cfg = self.config.loss
        # Aggregation units per sample, counted on the CPU (no device sync per micro-batch):
        # an episode split over micro-batches or ranks counts once in all.
        ep_tokens = episode_tokens or [s.num_loss_tokens for s in samples]
        units = {
            i: agg_count(
                samples[i].loss_mask[None], loss_cfg.loss_agg, torch.tensor([ep_tokens[i]])
            )
            for mb in micro
            for i in mb
        }
        self.optimizer.zero_grad(set_to_none=True)
        t_fb = time.perf_counter()
        entropy_sum = torch.zeros((), device=self.device)
        for idx in micro:
            mb = self._shard_micro_batch(samples, idx)
            lp_BT, entropy_BT = self._forward_BT(mb)
            behav_BT = mb.behav_logprobs_BT
            # (A dummy micro-batch of an idle rank has no old logprobs; its mask is empty.)
            old_BT = mb.old_logprobs_BT if mode == "given" else None
            if mode == "free":
                old_BT = lp_BT.detach()
            loss, mb_stats = policy_loss(
                lp_BT,
                behav_BT if old_BT is None else old_BT,
                mb.advantages_BT,
                mb.loss_mask_BT,
                loss_cfg,
                behav_logprobs=None if mode == "behaviour" else behav_BT,
                norm_len=norm_len,
                ref_logprobs=mb.ref_logprobs_BT,
                entropy=entropy_BT,
                episode_tokens=torch.tensor(
                    [ep_tokens[i] for i in mb.seq_index] if mb.seq_index else [0],
                    device=self.device,
                ),
            )
            # the trainer's view of the policy the loss starts from: the proximal logprobs,
            # or without them (plain PPO) this forward's
            mb_stats.update(
                mismatch_stats(lp_BT if old_BT is None else old_BT, behav_BT, mb.loss_mask_BT)
            )
            entropy_sum = entropy_sum + entropy_BT.detach().sum()
            share = sum(units[i] for i in mb.seq_index) / total_units
            # FSDP averages gradients over ranks; the world-size factor turns that average
            # back into the sum over the minibatch's parts.
            (loss * (share * self.world_size)).backward()
            totals.add_micro_batch(
                loss,
                mb_stats,
                share=share,
                loss_tokens=mb.loss_mask_BT.sum(),
                input_tokens=mb.num_input_tokens if mb.seq_index else 0,
            )
        totals.add_entropy(entropy_sum)
        self._sync()
        t_opt = time.perf_counter()
        grad_norm = self._clip_and_step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        totals.forward_backward_s += t_opt - t_fb
        totals.optimizer_s += time.perf_counter() - t_opt
        return grad_norm

    def _apply_lr(self) -> float:
        """Sets every parameter group's learning rate to the schedule's value at this step
        (``trainer.optim``, over ``trainer.max_steps``) and returns it."""
        optim = self.config.optim
        lr = lr_at(
            self.step,
            lr=optim.lr,
            warmup_steps=optim.warmup_steps,
            schedule=optim.schedule,
            total_steps=self.config.max_steps,
            min_lr_ratio=optim.min_lr_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _clip_and_step(self) -> float:
        """The gradients' global norm (all ranks); where it is finite, one optimizer step on
        the gradients clipped to ``optim.grad_clip`` (where set). Returns the norm.

        In one process on the CPU with float32 parameters the clip's factor goes into the
        fused AdamW's ``grad_scale`` (each gradient divided by it as the kernel reads it)
        instead of a pass of its own over every gradient: ~30 ms a step of SmolLM2-135M on
        two threads, ~1% of its step. The gradients themselves are then left unclipped."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.config.optim.grad_clip or math.inf
        fold = (
            not self.distributed
            and self.device.type == "cpu"
            and all(p.dtype == torch.float32 for p in params)
        )
        if not fold:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            full: Any = norm
            if hasattr(full, "full_tensor"):
                full = full.full_tensor()
            if math.isfinite(float(full)):
                self.optimizer.step()
            return float(full)
        total = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        if math.isfinite(total):
            # clip_grad_norm_'s factor, min(max_norm / (norm + 1e-6), 1)
            factor = max_norm / (total + 1e-6)
            self.optimizer.grad_scale = None if factor >= 1.0 else torch.tensor(1.0 / factor)  # type: ignore[attr-defined]
            try:
                self.optimizer.step()
            finally:
                self.optimizer.grad_scale = None  # type: ignore[attr-defined]
        return total

    # --- state ------------------------------------------------------------------------------

    def save_checkpoint(
        self, path: str | os.PathLike[str], extra_state: dict[str, Any] | None = None
    ) -> None:
        """Saves model, optimizer, RNG, step, version and ``extra_state`` (JSON-serialisable)
        to the directory ``path``. Collective. The step and version saved here are the
        training's progress: a resumed trainer takes them from the engine it restored."""
        state = {
            "step": self.step,
            "version": self.version,
            "skipped_nonfinite": self.skipped_nonfinite,
            "extra_state": extra_state or {},
        }
        self._reshard()
        dcp.save_checkpoint(path, self.module, self.optimizer, state, trainable_only=self.lora)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restores everything :meth:`save_checkpoint` saved; returns ``extra_state``.
        Collective; the world size may differ from the saving run's."""
        self._reshard()
        state = dcp.load_checkpoint(path, self.module, self.optimizer, trainable_only=self.lora)
        self.step = int(state["step"])
        self.version = int(state["version"])
        self.skipped_nonfinite = int(state.get("skipped_nonfinite", 0))
        return dict(state["extra_state"])

    def export_weights(self, path: str | os.PathLike[str]) -> None:
        """Writes what a weight update publishes: with ``trainer.lora.publish =
        "adapter"`` the adapter alone (:func:`~asyncrl.train.lora.export_adapter`), else
        the full HF directory (:meth:`export_hf`). Collective; rank 0 writes."""
        if self.config.lora.publishes_adapter:
            self._reshard()
            export_adapter(path, self.lm, dtype=torch_dtype(self.dtype_name))
        else:
            self.export_hf(path)

    def export_hf(self, path: str | os.PathLike[str], *, dtype: str | None = None) -> None:
        """Writes an HF directory (safetensors, config, tokenizer when one is known) in
        ``dtype`` (default: ``model.dtype``); with LoRA, of the merged weights, under the
        base model's names. Collective; rank 0 writes."""
        self._reshard()
        torch_type = torch_dtype(dtype or self.dtype_name)
        lm: Any = self.lm
        buckets = None
        if self.lora:

            def buckets(size: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
                return iter_merged_weights(self.lm, size, dtype=torch_type)

            lm = lm.get_base_model()  # its config and generation config
        dcp.export_hf(
            path,
            lm,
            dtype=torch_type,
            tokenizer=self.tokenizer if self.rank == 0 else None,  # only rank 0 writes
            buckets=buckets,
        )
        if self.vision_processor is not None and self.rank == 0:
            save_processor(self.vision_processor, str(path))

    def iter_weights(
        self, bucket_bytes: int = 256 << 20, *, dtype: str | None = None, copy: bool = True
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights as buckets of ``(HF name, CPU tensor)`` in ``dtype`` (default:
        ``model.dtype``); rank 0 gets them, other ranks get empty buckets. ``copy=False``:
        tensors that need no cast or gather are the live parameters themselves (for a
        caller done with them before the next step). Collective: every rank must exhaust
        the iterator. See :func:`asyncrl.train.dcp.iter_full_weights`.
        """
        self._reshard()
        torch_type = torch_dtype(dtype or self.dtype_name)
        if self.lora:
            return iter_merged_weights(self.lm, bucket_bytes, dtype=torch_type)
        return dcp.iter_full_weights(self.lm, bucket_bytes, dtype=torch_type, copy=copy)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of ``model.tokenizer`` (or of the model directory), None if none."""
        if not self._tokenizer_looked_up:
            self._tokenizer_looked_up = True
            source = self.model_config.tokenizer
            implicit = source is None and isinstance(self._source, str)
            if implicit:
                source = self._source
            if source is not None:
                kwargs = {"gguf_file": self._gguf} if self._gguf else {}
                try:
                    self._tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
                except (OSError, ValueError):
                    if not implicit:
                        raise
                    # A model directory without a tokenizer: exports carry weights only.
        return self._tokenizer

    def num_params(self, *, exclude_embeddings: bool = False) -> int:
        """Parameter count of the full (unsharded) model (adapters included)."""
        total = sum(p.numel() for p in self.lm.parameters())
        if exclude_embeddings:
            emb: Any = self.lm.get_input_embeddings()  # type: ignore[operator]
            total -= emb.weight.numel()
        return total


Engine = TypeVar("Engine", bound=TrainEngine)


@overload
def build_train_engine(recipe: Recipe | SftRecipe) -> TrainEngine: ...
@overload
def build_train_engine(recipe: Recipe | SftRecipe, engine: type[Engine]) -> Engine: ...
def build_train_engine(recipe: Recipe | SftRecipe, engine: type[TrainEngine] | None = None) -> Any:
    """The recipe's train engine, an ``engine`` (default :class:`TrainEngine`; the SFT run
    gives :class:`asyncrl.sft.engine.SFTEngine`) built from its ``trainer`` and ``model``
    sections and ``run.seed``; joins the torchrun process group first when there is one
    (NCCL when the trainer's device is CUDA, else gloo). Sets torch's intra-op threads to
    :func:`trainer_threads`."""
    torch.set_num_threads(trainer_threads(recipe.trainer.threads))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        cuda = resolve_device(recipe.trainer.device).startswith("cuda")
        dist.init_process_group("nccl" if cuda else "gloo")
    return (engine or TrainEngine)(recipe.trainer, recipe.model, seed=recipe.run.seed)
