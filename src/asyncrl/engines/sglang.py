"""``sglang``: generation on SGLang servers over SGLang's native HTTP API.

Tested against a real SGLang 0.5.23 server on the CPU (``rollout.engine.cpu``; ``make
sglang``, ``make test-sglang``, ``tests/test_engine_sglang_real.py``) and against an in-test
server speaking the same payloads (``tests/test_engine_sglang.py``).

Endpoints used:

- ``POST /generate`` with ``input_ids``, ``sampling_params`` and ``return_logprob``; the
  answer has ``output_ids`` and ``meta_info`` with ``output_token_logprobs`` (one
  ``[logprob, token id, text]`` per generated token) and ``finish_reason`` (an object whose
  ``type`` is ``stop``, ``length`` or ``abort``);
- ``POST /pause_generation`` with ``{"mode": "abort"}`` (running requests return with their
  partial output; new ones wait), ``POST /abort_request`` with ``{"abort_all": true}`` and
  ``POST /continue_generation``;
- ``POST /update_weights_from_disk`` with ``model_path`` (a directory holding the new
  safetensors and the model's config files) and ``weight_version``, then ``POST /flush_cache``;
- LoRA (``lora_rank`` > 0: ``--enable-lora``): an adapter directory is loaded with
  ``POST /load_lora_adapter`` ``{"lora_name": "policy-v<version>", "lora_path": DIR}``,
  the one before it dropped with ``POST /unload_lora_adapter``, and each ``/generate``
  names the loaded adapter in ``lora_path``;
- the ``collective`` weight broadcast (:mod:`asyncrl.weights.sglang_wire`): ``POST
  /init_weights_update_group`` with ``master_address``/``master_port`` (the trainer's
  rendezvous store, which SGLang's ``tcp://`` rendezvous joins as a client),
  ``rank_offset`` 1, ``world_size`` 2, ``group_name`` (the grant's prefix) and ``backend``;
  then per version ``POST /begin_weight_update``, ``POST /update_weights_from_distributed``
  with the version's ``names``, ``dtypes`` and ``shapes`` in sending order (the server
  receives one broadcast per tensor and loads them), ``weight_version`` and
  ``flush_cache``, and ``POST /end_weight_update``;
- ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation`` for
  ``rollout.colocate`` (the server must run with ``--enable-memory-saver``, which this
  engine adds when ``memory_saver`` is set); never sent to a CPU server (nothing to free,
  and the call kills it).

**Logprobs.** SGLang reports ``log_softmax(logits / T)`` of the sampled token, before any
top-k/top-p cut, unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set (then
without the temperature; leave it unset). Without a cut that is the distribution that
sampled, which the trainer scores; with a top-k/top-p cut it is not, and no SGLang option
reports the cut one, so ``asyncrl check`` refuses a cut with this engine.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from asyncrl.api.inference import (
    BroadcastJoin,
    BroadcastStaged,
    GenerateRequest,
    GenerateResponse,
    TensorSpec,
    WeightSource,
)
from asyncrl.engines.config import SGLangEngineConfig
from asyncrl.engines.remote import RemoteEngine, Server
from asyncrl.engines.server import ServerError, resolve_interpreter
from asyncrl.models.resolve import ModelConfig
from asyncrl.weights.lora import is_adapter_dir

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
"""Files SGLang reads beside the weights when it loads a directory; a weights update from
the trainer carries only safetensors, so they are copied in from the model directory."""


CPU_ARGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-overlap-schedule",
    "--grammar-backend",
    "none",
]
"""Flags of a CPU server (``rollout.engine.cpu``), with ``SGLANG_USE_CPU_ENGINE=1``: the
torch-native attention and sampling need no compiled kernels; the overlap scheduler and
the grammar backends do."""


def generate_payload(request: GenerateRequest, request_id: str) -> dict[str, Any]:
    """The ``/generate`` body for ``request``."""
    s = request.sampling
    params: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,  # SGLang's "no cut" is -1
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    if s.stop_token_ids is not None:
        params["stop_token_ids"] = list(s.stop_token_ids)
        params["ignore_eos"] = True
    return {
        "rid": request_id,
        "input_ids": list(request.input_ids),
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,  # no prompt logprobs
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
        "stream": False,
    }


def parse_generate(request: GenerateRequest, body: Any) -> GenerateResponse:
    """The tokens, logprobs and finish reason of a ``/generate`` answer."""
    try:
        meta = body["meta_info"]
        ids = [int(t) for t in body.get("output_ids") or []]
        entries = meta.get("output_token_logprobs") or []
        values = [float(e[0]) for e in entries]
        entry_ids = [int(e[1]) for e in entries]
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else finish
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"malformed answer from SGLang ({exc!r}): {str(body)[:2000]}") from exc
    if not ids:
        ids = entry_ids
    if entry_ids != ids:
        raise ServerError(
            f"SGLang's output_ids and output_token_logprobs disagree: {str(body)[:2000]}"
        )
    if kind not in ("stop", "length", "abort"):
        raise ServerError(f"SGLang finish_reason {finish!r} is not stop, length or abort")
    return GenerateResponse(
        rid=request.rid,
        input_ids=list(request.input_ids),
        output_ids=ids,
        output_logprobs=values,
        finish_reason=kind,
    )


class SGLangEngine(RemoteEngine):
    """SGLang servers behind :class:`~asyncrl.api.inference.InferenceEngine`.

    ``memory_saver`` starts the servers with ``--enable-memory-saver`` so that
    :meth:`release_memory` can free their weights and KV cache while a trainer steps on
    the same GPU. ``lora_rank`` > 0 starts them with LoRA on, for adapters up to that
    rank (``trainer.lora.rank``).

    **The broadcast** (``weights.transport = "collective"``) reaches one server, not tensor-
    or data-parallel (``asyncrl check`` refuses the rest). SGLang loads the weights while
    it receives them, so receiving and swapping in cannot be separated: generation is
    paused for the whole receive (SGLang also flushes its cache then, which it refuses
    while requests run), and :meth:`update_weights` of the staged version has nothing
    left to load. Tokens generated between the two carry the version received
    (:meth:`_generate_segment`), not the one before.
    """

    kind = "sglang"
    broadcast_protocol: ClassVar[str] = "sglang"

    config: SGLangEngineConfig

    def __init__(
        self,
        model: ModelConfig | str,
        config: SGLangEngineConfig | None = None,
        *,
        memory_saver: bool = False,
        log_dir: str | Path | None = None,
        version: int = 0,
        lora_rank: int = 0,
    ) -> None:
        super().__init__(model, config or SGLangEngineConfig(), log_dir=log_dir, version=version)
        self.memory_saver = memory_saver
        self.lora_rank = lora_rank
        self._received_version: int | None = None
        """The version the server holds from a broadcast until :meth:`update_weights` takes
        it (new tokens carry it)."""

    def server_command(self) -> list[str]:
        if self.config.command:
            return self.config.command
        python = self.config.python
        python = resolve_interpreter(python, "SGLang", "sglang") if python else sys.executable
        return [python, "-m", "sglang.launch_server"]

    def server_argv(self, port: int) -> list[str]:
        argv = [
            *self.server_command(),
            "--model-path",
            self.model_path,
            "--host",
            self.config.host,
            "--port",
            str(port),
            "--dtype",
            self.dtype,
        ]
        if self.memory_saver:
            argv.append("--enable-memory-saver")
        if self.config.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(self.config.mem_fraction_static)]
        if self.lora_rank:
            argv += ["--enable-lora", "--max-lora-rank", str(self.lora_rank)]
            argv += ["--lora-target-modules", "all", "--max-loras-per-batch", "1"]
        if self.config.max_total_tokens:
            argv += ["--max-total-tokens", str(self.config.max_total_tokens)]
        if self.config.cpu:
            argv += CPU_ARGS
        return argv + self.config.args

    def server_env(self) -> dict[str, str]:
        env = {"SGLANG_USE_CPU_ENGINE": "1"} if self.config.cpu else {}
        return {**env, **self.config.env}

    async def _complete(self, server: Server, request: GenerateRequest) -> GenerateResponse:
        if request.sampling.max_new_tokens <= 0:
            return GenerateResponse(
                rid=request.rid, input_ids=list(request.input_ids), finish_reason="length"
            )
        payload = generate_payload(request, self.new_request_id(request.rid))
        if server.info.get("lora"):
            payload["lora_path"] = server.info["lora"]
        return parse_generate(request, await self._call(server, "/generate", payload))

    async def _generate_segment(self, request: GenerateRequest) -> GenerateResponse:
        response = await super()._generate_segment(request)
        if self._received_version is not None:
            response.output_versions = [self._received_version] * len(response.output_ids)
        return response

    async def _server_pause(self, server: Server) -> None:
        await self._call(server, "/pause_generation", {"mode": "abort"})

    async def _server_abort_all(self, server: Server) -> None:
        await self._call(server, "/abort_request", {"abort_all": True})

    async def _server_resume(self, server: Server) -> None:
        await self._call(server, "/continue_generation", {})

    async def stage_weights(self, source: WeightSource) -> WeightSource:
        """Completes a directory of safetensors with the model's config and tokenizer
        files (SGLang loads a directory as a model), while generation goes on."""
        if isinstance(source, str | Path) and self.model_path and not is_adapter_dir(source):
            directory = Path(source)
            for name in MODEL_FILES:
                src = Path(self.model_path) / name
                if src.is_file() and not (directory / name).exists():
                    shutil.copyfile(src, directory / name)
        return source

    async def _server_load(self, server: Server, path: Path, version: int) -> None:
        if is_adapter_dir(path):
            await self._load_adapter(server, path, version)
            return
        answer = await self._call(
            server,
            "/update_weights_from_disk",
            {"model_path": str(path), "weight_version": str(version)},
        )
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ServerError(f"{server.url}/update_weights_from_disk: {answer.get('message')}")
        await self._call(server, "/flush_cache")

    async def _load_weights(self, source: WeightSource | BroadcastStaged) -> None:
        if isinstance(source, BroadcastStaged):
            # loaded as it was received (receive_broadcast); a newer one received since
            # keeps stamping its own version
            if self._received_version == source.version:
                self._received_version = None
            return
        await super()._load_weights(source)
        self._received_version = None

    async def join_broadcast(self, where: BroadcastJoin) -> None:
        if len(self.servers) != 1:
            raise ServerError(f"the weight broadcast reaches one SGLang server, not {self.servers}")
        server = self.servers[0]
        payload = {
            "master_address": where.host,
            "master_port": where.port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": where.prefix,
            "backend": where.backend,
        }
        async with asyncio.timeout(where.timeout_s + 10):
            await self._call(server, "/init_weights_update_group", payload)
        server.info["broadcast"] = where

    async def receive_broadcast(
        self, version: int, epoch: int, tensors: Sequence[TensorSpec] = ()
    ) -> BroadcastStaged:
        server = self.servers[0]
        where: BroadcastJoin | None = server.info.get("broadcast")
        if where is None or not tensors:
            raise ServerError("receive_broadcast needs a joined group and the tensor list")
        async with self._paused_for_weights():
            await self._receive_into(server, where, version, tensors)
            self._received_version = version
        return BroadcastStaged(version, epoch)

    async def _receive_into(
        self, server: Server, where: BroadcastJoin, version: int, tensors: Sequence[TensorSpec]
    ) -> None:
        """One version inside SGLang's weight-update session (which it requires; a session
        left open by a failed update is closed first)."""
        payload = {
            "names": [t.name for t in tensors],
            "dtypes": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": where.prefix,
            "flush_cache": True,
            "weight_version": str(version),
        }
        try:
            await self._call(server, "/begin_weight_update", {})
        except ServerError as exc:
            if "already open" not in str(exc):
                raise
            await self._call(server, "/end_weight_update", {})
            await self._call(server, "/begin_weight_update", {})
        try:
            async with asyncio.timeout(where.timeout_s + 30):
                await self._call(server, "/update_weights_from_distributed", payload)
        finally:
            async with asyncio.timeout(30):
                await self._call(server, "/end_weight_update", {})

    async def _load_adapter(self, server: Server, path: Path, version: int) -> None:
        """Loads the adapter in ``path`` as ``policy-v<version>``, then drops the one
        before (a failed load leaves the old one serving)."""
        if not self.lora_rank:
            raise ServerError(
                f"{path} is a LoRA adapter, but the SGLang servers were started without "
                '--enable-lora; publish merged weights (trainer.lora.publish = "merged")'
            )
        name = f"policy-v{version}"
        old = server.info.get("lora")
        if old == name:  # the same version again (a restarted trainer): reload it
            await self._call(server, "/unload_lora_adapter", {"lora_name": old})
            old = None
        answer = await self._call(
            server, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
        )
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ServerError(f"{server.url}/load_lora_adapter: {answer.get('error_message')}")
        server.info["lora"] = name
        if old:
            await self._call(server, "/unload_lora_adapter", {"lora_name": old})

    async def _release_memory(self) -> int:
        if self.config.cpu:
            return 0  # see _resume_memory
        await self._each(lambda s: self._call(s, "/release_memory_occupation", {}))
        return 0  # SGLang does not say how much it freed

    async def _resume_memory(self) -> None:
        # On the CPU there is no device memory to hand to a trainer, and SGLang 0.5.23's
        # release synchronizes CUDA (weight_updater.release_memory_occupation calls
        # torch.get_device_module().synchronize()), which kills a CPU server's scheduler:
        # release and resume are no-ops there, the server never hears of them.
        if self.config.cpu:
            return
        await self._each(lambda s: self._call(s, "/resume_memory_occupation", {}))
