"""``hf``: in-process transformers generation with continuous batching.

One model thread does all model work (loading, prefill, decode, weight loads); one
scheduler task on the event loop feeds it. Each scheduler turn takes every request that
waits (within a prefill token budget and the batch size), hands them with the running
batch to the model thread for one step (prefill of the newcomers, then one decode token
for every row: see :mod:`asyncrl.engines.hf_batch`), and resolves the futures of the
sequences that finished. Concurrent ``agenerate`` calls therefore share decode steps; the
sizes of the batches actually run are counted in :attr:`HFEngine.stats`. Requests that
join together with the same prompt (a GRPO group) share one prefill, and a prompt that
extends a finished sequence (an agent's next turn) reuses its keys and values from the
prefix cache (:mod:`asyncrl.engines.hf_prefix`, ``prefix_cache_mb``), which every weight
load and memory release empties.

Logprobs follow :mod:`asyncrl.engines.sampling`: by default (``logprob_mode="processed"``)
the logprob of the sampled token under the distribution that sampled it (temperature,
then the top-k/top-p cut, renormalised), as vLLM reports and the trainer recomputes — at
T = 1 without a cut, exactly a teacher-forced forward pass of the same tokens.

A weight update is full weights (every parameter, HF names) or a LoRA adapter (a peft
adapter directory, :mod:`asyncrl.weights.lora`). The engine keeps a float32 copy of the
base weights of the layers adapters adapt, made when the first adapter arrives, and
merges each adapter into it, rounding once to the engine's dtype::

    W_engine = to_dtype(W_base_fp32 + (lora_alpha / r) · B @ A)

so each adapter replaces the one before rather than adding to it, and an update far below
the dtype's resolution (bf16 keeps 8 significant bits: |ΔW| ≲ 2⁻⁹·|W| would round away
if added to the bf16 weight) still moves the weights it should, as the float32 rounding
point crosses bf16's grid. The float32 base is read from the checkpoint the engine loaded
(its safetensors, at their stored precision), or is the last full update's tensors for
layers adapted before it; where neither exists (a hub id, a layer first adapted after an
in-memory full update) it is the live weight upcast. Memory: 4 bytes per entry of the
adapted layers, on the engine's device (the engine's own copy is 2 in bf16), e.g. 7 linear
layers of every decoder layer of a 0.5B model ≈ 1.4 GiB. In a float32 engine the copy is
the live weight, as before. The merge is staged like a download, while generation goes
on; the pause only copies the merged weights in.

Deterministic (``deterministic=True``, the recipe's ``rollout.deterministic``): each
sequence runs alone, from an empty batch to its end (a decode batch of one, no prefix
cache, so no shared prefill and no cross-row copy), so a request's numbers never depend on
which other requests were in flight or when they came: each shape it computes is a
function of its own tokens. With a ``seed`` its tokens and logprobs are then a function of
the weights, the request and the seed alone. Concurrent requests queue and run one after
the other, in the order they came: throughput falls to that of one sequence.

Images: a vision-language model (Qwen2-VL / Qwen2.5-VL, Idefics3:
:mod:`asyncrl.models.vision`) loads with transformers' image-text-to-text class beside a
:class:`~asyncrl.models.vision.VisionProcessor`. A request's ``images`` (file paths, one
per image in ``input_ids``, whose placeholders are already expanded) are decoded and
processed off the model thread (:mod:`asyncrl.engines.hf_images`); the processor's
expansion of those images must give the same runs of image tokens as the request holds,
else the request fails with a ``ValueError`` naming it (the engine serves on). An image
request is prefilled alone with its pixel inputs (Qwen2-VL: with its 3-D rotary
positions, the rope delta carried into decode) and then decodes in the shared batch; it
never enters the prefix cache and shares a prefill only with identical prompts of
identical images (:mod:`asyncrl.engines.hf_batch`). A vision model never samples an image
placeholder: their logits are set to −∞ before sampling
(:func:`~asyncrl.models.vision.mask_placeholders`), so the reported logprobs are those of
the masked distribution, which the trainer must score the same way. Text-only requests to
a vision model run as on a text model.

On the CPU in float32 the linear layers' products of a few rows (a decode step's) go to a
kernel of asyncrl's own (:mod:`asyncrl.engines.cpu_linear`, ``cpu_kernel``): the weights
stay as loaded, and the kernel reads a packed copy of each. Where that kernel cannot run,
and in other dtypes, the engine keeps its linear layers' weights column-major
(:func:`column_major_linears`: torch's products of a few rows run faster so) and weight
updates keep that layout.

Full weight updates may name a parameter as the model has it or as its checkpoint stores
it (Qwen2-VL's ``model.layers.…`` for ``model.language_model.layers.…``): transformers'
own checkpoint renamings translate the latter.

Pausing takes effect between two steps: the running sequences end as ``abort`` with their
partial tokens and the KV cache is dropped; :class:`~asyncrl.api.inference.InferenceEngine`
resubmits them after ``resume()`` (with their images), so their continuation is prefilled
from the partial tokens, and the same pixel inputs, under whatever weights are loaded then.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
from collections import Counter, deque
from collections.abc import AsyncIterable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from asyncrl.api.inference import (
    EngineStopped,
    GenerateRequest,
    GenerateResponse,
    InferenceEngine,
    WeightSource,
)
from asyncrl.config.schema import resolve_device
from asyncrl.engines import cpu_linear
from asyncrl.engines.config import HFEngineConfig
from asyncrl.engines.hf_batch import DecodeBatch, Sequence, StepResult
from asyncrl.engines.hf_images import RequestPixels
from asyncrl.engines.hf_prefix import BLOCK_TOKENS, common_blocks
from asyncrl.engines.sampling import LogprobMode
from asyncrl.models.resolve import (
    ModelConfig,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from asyncrl.models.vision import VisionProcessor, load_vision_lm, vision_family
from asyncrl.runtime.log import get_logger
from asyncrl.weights.lora import LoraAdapter, is_adapter_dir, merged, read_adapter

log = get_logger(part="hf-engine")

MEMORY_TAG = "asyncrl-hf-weights"
"""The torch-memory-saver region of the hf engine's weights."""


@dataclass
class EngineStats:
    """Counters of the work the engine ran. ``decode_batch_sizes[n]`` counts decode steps
    that advanced ``n`` sequences together; ``prefill_batch_sizes`` likewise for joins;
    ``prefill_tokens`` counts prompt tokens actually computed (a prompt shared by several
    requests joining together is computed once); ``prefix_cache_hit_tokens`` the prompt
    tokens taken from the prefix cache instead; ``prefix_cache_bytes`` is what the cache
    holds after the last step; ``shared_prefix_rows`` counts decoded rows whose attention
    read a prefix shared with other rows once (cascade attention, :mod:`.hf_cascade`)."""

    steps: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_bytes: int = 0
    relayouts: int = 0
    shared_prefix_rows: int = 0
    decode_batch_sizes: Counter[int] = field(default_factory=Counter)
    prefill_batch_sizes: Counter[int] = field(default_factory=Counter)

    @property
    def max_decode_batch(self) -> int:
        return max(self.decode_batch_sizes, default=0)

    def totals(self) -> dict[str, float]:
        """The counters as the rollout actor's ``engine/...`` metrics."""
        return {
            "generated_tokens": float(self.generated_tokens),
            "prefill_tokens": float(self.prefill_tokens),
            "prefix_cache_hit_tokens": float(self.prefix_cache_hit_tokens),
            "prefix_cache_bytes": float(self.prefix_cache_bytes),
            "decode_steps": float(self.steps),
            "shared_prefix_rows": float(self.shared_prefix_rows),
        }


class _MergedAdapter(list[tuple[str, torch.Tensor]]):
    """The weights of the layers an adapter adapts (and of those an earlier one adapted,
    back at their base), merged by :meth:`HFEngine.stage_weights`: a partial update."""


@dataclass
class _Pending:
    seq: Sequence
    future: asyncio.Future[GenerateResponse]
    request: GenerateRequest


class HFEngine(InferenceEngine):
    """A transformers causal LM behind :class:`InferenceEngine`, batching concurrent calls.

    ``model`` is the recipe's model section (or its ``path`` alone: anything
    :func:`asyncrl.models.resolve.resolve_model_path` accepts), ``config`` its ``rollout.engine``
    section. ``memory_saver`` (a colocated run) keeps the weights in a region that
    :meth:`release_memory` can free, when ``torch_memory_saver`` is installed and the
    device is CUDA. ``on_step`` (if given) is called on the event loop after every step
    with its :class:`StepResult`. ``deterministic`` runs one sequence at a time (see the
    module docstring), whatever ``config.max_batch_size`` and ``prefix_cache_mb`` say.
    """

    takes_images = True

    def __init__(
        self,
        model: ModelConfig | str,
        config: HFEngineConfig | None = None,
        *,
        memory_saver: bool = False,
        logprob_mode: LogprobMode = "processed",
        version: int = 0,
        on_step: Callable[[StepResult], None] | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__(version)
        model = model if isinstance(model, ModelConfig) else ModelConfig(path=model)
        self.config = config or HFEngineConfig()
        self.deterministic = deterministic
        self.max_batch_size = 1 if deterministic else self.config.max_batch_size
        """Most sequences decoded together: one when deterministic."""
        self._warned_unseeded = False
        self.model_spec = model.path
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(model.dtype, self.device)
        self.logprob_mode: LogprobMode = logprob_mode
        self.on_step = on_step
        # torch-memory-saver keeps the weights' virtual addresses while their physical
        # memory is released; without it (or off CUDA) releasing moves them to the host.
        self.colocated = memory_saver
        self.memory_saver = (
            memory_saver
            and self.device.startswith("cuda")
            and importlib.util.find_spec("torch_memory_saver") is not None
        )
        self.stats = EngineStats()
        self.model: Any = None
        self._tokenizer: Any = None
        self.vision: VisionProcessor | None = None
        """The processor of a vision-language model; None for a text model."""
        self._images = RequestPixels(None, self.model_spec)
        self._batch: DecodeBatch | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._max_positions = 0
        self._executor: ThreadPoolExecutor | None = None
        self._scheduler: asyncio.Task[None] | None = None
        # Waiting requests are bounded by the callers: each caller holds one entry while
        # it awaits its future, and the rollout runner bounds the callers.
        self._waiting: deque[_Pending] = deque()
        self._running: dict[int, _Pending] = {}
        self._keys = itertools.count()
        self._wake = asyncio.Event()
        self._hold = False
        self._interrupt_requested = False
        self._interrupted = asyncio.Event()
        self._failure: BaseException | None = None
        self._lora_base: dict[str, torch.Tensor] = {}
        """The base weights of the layers that adapters adapt (name -> a float32 copy)."""
        self._base_dir: Path | None = None
        """The checkpoint whose safetensors hold the base weights at full precision (the
        loaded model's directory); None once an in-memory full update replaced them."""

    # --- lifecycle --------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        return self.stats.totals()

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def start(self) -> None:
        if self._scheduler is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncrl-hf")
        await self._in_model_thread(self._load)
        self._scheduler = asyncio.create_task(self._schedule(), name="hf-engine-scheduler")

    async def stop(self) -> None:
        """Aborts what runs, ends the scheduler and the model thread; re-raises a failure
        of the scheduler."""
        self._stopping = True
        self._resumed.set()
        self._wake.set()
        task, self._scheduler = self._scheduler, None
        try:
            if task is not None:
                await task
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _load(self) -> None:
        local = Path(resolve_model_path(self.model_spec))
        if vision_family(local) is not None:
            self.vision = VisionProcessor(local)
            self._images = RequestPixels(self.vision, self.model_spec)
        if self.memory_saver:
            try:
                from torch_memory_saver import torch_memory_saver  # noqa: PLC0415 - optional: torch-memory-saver (the gpu extra)

                torch_memory_saver.hook_mode = "torch"  # no LD_PRELOAD needed
                with torch_memory_saver.region(tag=MEMORY_TAG, enable_cpu_backup=True):
                    self.model = self._load_model(local)
            except Exception as exc:  # a wheel built for another torch or CUDA
                self.memory_saver = False
                log.warning(
                    "torch-memory-saver cannot load: releasing by moving the weights to the "
                    "host and emptying the cache instead (the freed bytes are in "
                    "rollout_freed_bytes)",
                    error=f"{type(exc).__name__}: {exc}"[:300],
                )
                self.model = self._load_model(local)
        else:
            if self.colocated and self.device.startswith("cuda"):
                log.warning(
                    "torch-memory-saver is not installed: releasing by moving the weights to "
                    "the host and emptying the cache instead"
                )
            self.model = self._load_model(local)
        kernel = False
        if self.device == "cpu":
            # decode steps of more rows than the kernel takes run faster on column-major
            # weights (torch's products); a batch that never has more runs on the kernel
            kernel = self.config.cpu_kernel and self.max_batch_size <= cpu_linear.MAX_ROWS
            kernel = cpu_linears(self.model, kernel=kernel) == "kernel"
        self._base_dir = local if local.is_dir() else None
        self._tokenizer = load_tokenizer(self.model_spec)
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        self._eos_ids = frozenset(eos_ids)
        cfg = self.model.config.get_text_config()
        self._max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 20))
        self._batch = DecodeBatch(
            self.model,
            max_positions=self._max_positions,
            logprob_mode=self.logprob_mode,
            # a cached prefix's keys were computed in another sequence's prefill, whose
            # shape was not this one's
            prefix_cache_bytes=0 if self.deterministic else self.config.prefix_cache_mb << 20,
            placeholder_ids=self.vision.placeholder_ids if self.vision is not None else None,
            shared_prefix_attention=self.config.shared_prefix_attention,
            decode_layers=kernel and self.config.cpu_decode_layers,
        )

    def _load_model(self, local: Path) -> Any:
        if self.vision is not None:
            return load_vision_lm(local, dtype=self.dtype, device=self.device)
        return load_causal_lm(self.model_spec, self.dtype, self.device)

    async def _in_model_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._executor is None:
            raise EngineStopped("the engine is not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # --- generation -------------------------------------------------------------------------

    async def _generate_segment(self, request: GenerateRequest) -> GenerateResponse:
        if self._failure is not None or self._scheduler is None or self._stopping:
            raise EngineStopped("the hf engine is not running") from self._failure
        sp = request.sampling
        if len(request.input_ids) >= self._max_positions:
            raise ValueError(
                f"prompt of {len(request.input_ids)} tokens does not fit the model's "
                f"{self._max_positions} positions"
            )
        if sp.max_new_tokens == 0:
            return GenerateResponse(rid=request.rid, input_ids=list(request.input_ids))
        pixels = await self._images.get(request) if self._images.needed(request) else None
        generator = None
        if sp.seed is not None:
            generator = torch.Generator().manual_seed(sp.seed)  # CPU: sampling draws there
        elif self.deterministic and sp.temperature > 0 and not self._warned_unseeded:
            self._warned_unseeded = True
            log.warning(
                "deterministic engine: a request samples without a seed, from torch's "
                "global generator, so its tokens depend on what ran before it; give every "
                "request a seed (asyncrl.workflows.rlvr.sample_seed)",
                rid=request.rid,
            )
        seq = Sequence(
            key=next(self._keys),
            prompt=list(request.input_ids),
            sampling=sp,
            stop_ids=self._eos_ids if sp.stop_token_ids is None else frozenset(sp.stop_token_ids),
            max_new=sp.max_new_tokens,
            generator=generator,
            images=tuple(request.images),
            pixels=pixels,
        )
        future: asyncio.Future[GenerateResponse] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Pending(seq, future, request))
        self._wake.set()
        return await future

    async def _schedule(self) -> None:
        try:
            while not self._stopping:
                if self._interrupt_requested:
                    assert self._batch is not None
                    self._finish(await self._in_model_thread(self._batch.abort_all))
                    self._interrupt_requested = False
                    self._interrupted.set()
                    continue
                if self._hold or not (self._waiting or self._running):
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._step()
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._abandon()

    async def _step(self) -> None:
        assert self._batch is not None
        drop = {k for k, p in self._running.items() if p.future.done()}
        for k in drop:
            del self._running[k]
        admit = self._take_waiting()
        result: StepResult = await self._in_model_thread(
            self._batch.step, [p.seq for p in admit], drop, self._version
        )
        self._finish(result.finished)
        st = self.stats
        st.steps += 1
        st.generated_tokens += result.tokens
        st.prefill_tokens += result.prefill_tokens
        st.prefix_cache_hit_tokens += result.prefix_hit_tokens
        st.prefix_cache_bytes = self._batch.prefix.nbytes
        st.relayouts += result.relayouts
        st.shared_prefix_rows += result.shared_rows
        if result.decode_rows:
            st.decode_batch_sizes[result.decode_rows] += 1
        if result.prefill_rows:
            st.prefill_batch_sizes[result.prefill_rows] += 1
        if self.on_step is not None:
            self.on_step(result)

    def _take_waiting(self) -> list[_Pending]:
        """Waiting requests that join now: up to the free batch slots, and up to the prefill
        token budget (always at least one, however long). A prompt costs the tokens it will
        compute: not those the prefix cache holds, nor those an earlier prompt of the same
        join shares with it (the batch prefills those once). The cache is read here, on the
        event loop, only between two steps, when the model thread (which alone changes it)
        is idle."""
        assert self._batch is not None
        admit: list[_Pending] = []
        budget = self.config.max_prefill_tokens
        firsts: dict[tuple[int, ...], list[int]] = {}
        while self._waiting and len(self._running) < self.max_batch_size:
            p = self._waiting[0]
            if p.future.done():  # its caller went away before it started
                self._waiting.popleft()
                continue
            prompt = p.seq.prompt
            held = 0 if p.seq.pixels is not None else self._batch.prefix.held_tokens(prompt)
            if p.seq.pixels is None and self._batch.prefix.enabled and len(prompt) > BLOCK_TOKENS:
                earlier = firsts.setdefault(tuple(prompt[:BLOCK_TOKENS]), prompt)
                if earlier is not prompt:
                    held = max(held, min(common_blocks(prompt, earlier), len(prompt) - 1))
            cost = len(prompt) - held
            if admit and cost > budget:
                break
            budget -= cost
            admit.append(self._waiting.popleft())
            self._running[p.seq.key] = p
        return admit

    def _finish(self, finished: list[Sequence]) -> None:
        for seq in finished:
            p = self._running.pop(seq.key, None)
            if p is None or p.future.done():
                continue
            p.future.set_result(
                GenerateResponse(
                    rid=p.request.rid,
                    input_ids=seq.prompt,
                    output_ids=seq.out_ids,
                    output_logprobs=seq.out_logprobs,
                    output_versions=seq.out_versions,
                    finish_reason=seq.finish or "abort",  # type: ignore[arg-type]
                )
            )

    def _abandon(self) -> None:
        """On the scheduler's exit: callers get ``abort`` (stop) or the failure."""
        pending = list(self._running.values()) + list(self._waiting)
        self._running.clear()
        self._waiting.clear()
        for p in pending:
            if p.future.done():
                continue
            if self._failure is not None and not isinstance(self._failure, asyncio.CancelledError):
                err = EngineStopped(f"the hf engine failed: {self._failure!r}")
                err.__cause__ = self._failure
                p.future.set_exception(err)
            else:
                p.future.set_result(
                    GenerateResponse(
                        rid=p.request.rid,
                        input_ids=p.seq.prompt,
                        output_ids=p.seq.out_ids,
                        output_logprobs=p.seq.out_logprobs,
                        output_versions=p.seq.out_versions,
                        finish_reason="abort",
                    )
                )
        self._interrupted.set()  # nobody may wait for an interrupt that will never come

    # --- pause and weights ------------------------------------------------------------------

    async def _interrupt(self) -> None:
        self._hold = True
        if self._scheduler is None or self._scheduler.done():
            return
        self._interrupted.clear()
        self._interrupt_requested = True
        self._wake.set()
        await self._interrupted.wait()

    async def _continue(self) -> None:
        self._hold = False
        self._wake.set()

    async def _release_memory(self) -> int:
        return int(await self._in_model_thread(self._free_memory))

    async def _resume_memory(self) -> None:
        await self._in_model_thread(self._take_memory)

    def _free_memory(self) -> int:
        """The KV cache is gone already (the pause dropped it); empties the prefix cache,
        frees the weights' device memory and returns the bytes the CUDA allocator gave back
        (0 on the CPU, where there is nothing to share)."""
        self._forget_prefixes()
        if not self.device.startswith("cuda"):
            return 0
        before = torch.cuda.memory_reserved(self.device)
        if self.memory_saver:
            from torch_memory_saver import torch_memory_saver  # noqa: PLC0415 - optional: torch-memory-saver (the gpu extra)

            torch_memory_saver.pause(MEMORY_TAG)
        else:
            self.model.to("cpu")
        torch.cuda.empty_cache()
        return max(0, before - torch.cuda.memory_reserved(self.device))

    def _take_memory(self) -> None:
        if not self.device.startswith("cuda"):
            return
        if self.memory_saver:
            from torch_memory_saver import torch_memory_saver  # noqa: PLC0415 - optional: torch-memory-saver (the gpu extra)

            torch_memory_saver.resume(MEMORY_TAG)
        else:
            self.model.to(self.device)

    async def stage_weights(self, source: WeightSource) -> WeightSource:
        """Reads a directory's safetensors into host memory off the model thread, so that
        generation goes on meanwhile and the pause only copies tensors; an adapter is read
        and merged into the base weights here too."""
        if isinstance(source, str | Path):
            if is_adapter_dir(source):
                return await asyncio.to_thread(self._merge_adapter, read_adapter(source))
            return await asyncio.to_thread(lambda: list(_read_safetensors_dir(Path(source))))
        return source

    async def _load_weights(self, source: WeightSource) -> None:
        if isinstance(source, str | Path) and is_adapter_dir(source):
            source = await self.stage_weights(source)
        if isinstance(source, _MergedAdapter):
            await self._in_model_thread(self._copy_merged, source)
        elif isinstance(source, AsyncIterable):
            pairs = [pair async for pair in source]
            await self._in_model_thread(self._copy_weights, pairs)
        elif isinstance(source, str | Path):
            await self._in_model_thread(self._copy_weights, _read_safetensors_dir(Path(source)))
        else:
            await self._in_model_thread(self._copy_weights, source)

    @torch.no_grad()
    def _copy_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies named tensors into the model's parameters (cast to their dtype/device).

        Every parameter must be given (tied ones once, under either name); an unknown name
        or a shape mismatch raises before anything is copied, so a bad update never leaves
        a half-loaded model. A name the model lacks is looked up again as a checkpoint name
        (:func:`_checkpoint_renamer`)."""
        targets = dict(self.model.state_dict(keep_vars=True))
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        covered: set[int] = set()
        rename: Callable[[str], str] | None = None
        for name, tensor in pairs:
            target = targets.get(name)
            if target is None:
                rename = rename or _checkpoint_renamer(self.model)
                target = targets.get(rename(name))
            if target is None:
                raise KeyError(f"weight update names {name!r}, which the model does not have")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            staged.append((target, tensor))
            covered.add(id(target))
        missing = [n for n, p in self.model.named_parameters() if id(p) not in covered]
        if missing:
            raise KeyError(f"weight update lacks {len(missing)} parameters, e.g. {missing[:3]}")
        self._forget_prefixes()
        for target, tensor in staged:
            copy_param(target, tensor)
        # These are the base weights now: the adapted layers' float32 bases are taken from
        # the update at its own precision, not from the engine's rounded copy.
        by_target = {id(target): tensor for target, tensor in staged}
        for name in self._lora_base:
            target = targets[name]
            self._lora_base[name] = _float32_copy(by_target[id(target)], target.device)
        self._base_dir = None

    @torch.no_grad()
    def _copy_merged(self, weights: _MergedAdapter) -> None:
        params = dict(self.model.named_parameters())
        self._forget_prefixes()
        for name, tensor in weights:
            copy_param(params[name], tensor)

    def _forget_prefixes(self) -> None:
        """Empties the prefix cache: its keys and values belong to the weights before."""
        if self._batch is not None:
            self._batch.prefix.clear()
        self.stats.prefix_cache_bytes = 0

    @torch.no_grad()
    def _merge_adapter(self, adapter: LoraAdapter) -> _MergedAdapter:
        """Each adapted weight as its base weight merged with ``adapter``, and a layer an
        earlier adapter adapted but this one does not back at its base weight. Checks every
        name and shape first. Reads the model's weights while it generates: they change
        only in a load, and loads and their staging come one after the other."""
        params = dict(self.model.named_parameters())
        for name, (a, b) in adapter.factors.items():
            target = params.get(name)
            if target is None:
                raise KeyError(f"the adapter adapts {name!r}, which the model does not have")
            if (b.shape[0], a.shape[1]) != tuple(target.shape) or a.shape[0] != b.shape[1]:
                raise ValueError(
                    f"adapter of {name!r}: B {tuple(b.shape)} @ A {tuple(a.shape)} does not "
                    f"give the model's {tuple(target.shape)}"
                )
        new = [name for name in adapter.factors if name not in self._lora_base]
        self._lora_base.update(self._float32_bases(new, params))
        out = _MergedAdapter()
        for name, base in self._lora_base.items():
            dtype = params[name].dtype
            if name in adapter.factors:
                a, b = adapter.factors[name]
                out.append((name, merged(base, a, b, adapter.scale).to(dtype)))
            else:
                out.append((name, base.to(dtype, copy=True)))
        return out

    def _float32_bases(
        self, names: list[str], params: dict[str, torch.nn.Parameter]
    ) -> dict[str, torch.Tensor]:
        """Float32 copies of the base weights ``names`` (not yet adapted, so the live
        weights are the base rounded to the engine's dtype), on their parameters' device:
        from the loaded checkpoint's safetensors where it holds them with the same shape,
        else the live weight upcast (exact in a float32 engine)."""
        found: dict[str, torch.Tensor] = {}
        wanted = {n for n in names if params[n].dtype != torch.float32}
        if wanted and self._base_dir is not None:
            for file in sorted(self._base_dir.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    for name in wanted.intersection(f.keys()) - found.keys():
                        tensor = f.get_tensor(name)
                        if tuple(tensor.shape) == tuple(params[name].shape):
                            found[name] = _float32_copy(tensor, params[name].device)
        for name in names:
            if name not in found:
                found[name] = _float32_copy(params[name].detach(), params[name].device)
        return found


def _checkpoint_renamer(model: Any) -> Callable[[str], str]:
    """Maps a checkpoint's parameter name to the loaded model's, by the renamings
    transformers applies when it loads that checkpoint (Qwen2-VL stores
    ``model.layers.…`` and ``visual.…`` for its ``model.language_model.layers.…`` and
    ``model.visual.…``); the model's own names map to themselves."""
    from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: PLC0415 - heavy: only an update naming what the model lacks needs it
    from transformers.core_model_loading import (  # noqa: PLC0415 - as above
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return lambda name: rename_source_key(name, renamings, converters)[0]


def _float32_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new float32 tensor on ``device`` holding ``tensor``'s values."""
    return tensor.detach().to(device=device, dtype=torch.float32, copy=True)


def cpu_linears(model: Any, kernel: bool = True) -> str:
    """Readies ``model``'s linear layers for decoding on the CPU: in float32 (with
    ``kernel``) products of a few rows by :mod:`~asyncrl.engines.cpu_linear`'s kernel on
    the weights as loaded; otherwise, or where that kernel cannot run, torch's products on
    column-major weights (:func:`column_major_linears`). Says which: ``"kernel"`` or
    ``"column-major"``."""
    if kernel and cpu_linear.install(model):
        return "kernel"
    column_major_linears(model)
    return "column-major"


def column_major_linears(model: Any) -> None:
    """Stores the weight of every linear layer of ``model`` column-major: the same
    ``[out, in]`` tensor, its elements laid out as its transpose's, so that a layer's
    product ``x @ W.T`` hands MKL a row-major ``W.T``. A decode step's products of a few
    dozen rows then read the weights faster: SmolLM2-135M's fp32 decode step of 32 rows on
    one Xeon core 1.07–1.12× faster, bf16's no slower (bench/README, "The compute floor").
    For the CPU only (cuBLAS takes either layout at one speed). A weight that is also an
    embedding's (a tied LM head) stays as it is: a row lookup in a column-major table reads
    scattered numbers, and every weight update would transpose SmolLM2's 28M-entry head.
    Weight updates keep the layout (:func:`copy_param`)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in embedded:
            if module.weight.is_contiguous():
                module.weight.data = module.weight.data.t().contiguous().t()


def copy_param(target: torch.Tensor, tensor: torch.Tensor) -> None:
    """``target.copy_(tensor)``, where a column-major ``target`` (:func:`column_major_linears`)
    is filled from a row-major ``tensor`` as one transpose into the other: torch's blocked
    transposing copy, 1.3–2.5× faster than its element-wise strided one."""
    if (
        target.dim() == 2
        and not target.is_contiguous()
        and target.t().is_contiguous()
        and tensor.is_contiguous()
    ):
        target.t().copy_(tensor.t())
    else:
        target.copy_(tensor)


def _read_safetensors_dir(path: Path) -> Iterable[tuple[str, torch.Tensor]]:

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
