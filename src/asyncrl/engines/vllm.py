"""``vllm``: generation on vLLM servers over their OpenAI-compatible and RL endpoints.

Each server is started as ``<python> entry/vllm_server.py serve <model dir> ...`` with
``VLLM_SERVER_DEV_MODE=1`` (which enables ``/collective_rpc`` and ``/reset_prefix_cache``)
and ``--logprobs-mode processed_logprobs``. The endpoints used:

- ``POST /v1/completions`` with the prompt as token ids, ``return_token_ids`` and
  ``logprobs: 0`` (the sampled token's logprob only);
- ``POST /pause?mode=abort`` (running requests return ``finish_reason: "abort"`` with their
  partial tokens and logprobs; requests that arrive while paused are queued),
  ``POST /abort_requests`` (aborts queued ones too) and ``POST /resume``;
- ``POST /collective_rpc`` with ``{"method": "reload_weights", "kwargs": {"weights_path":
  DIR}}`` (a directory of safetensors files in the HF naming), then
  ``POST /reset_prefix_cache`` — cached KV computed by the old weights must not serve new
  samples — and ``POST /update_weight_version``;
- LoRA (``lora_rank`` > 0: ``--enable-lora``, and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``):
  an adapter directory is loaded with ``POST /v1/load_lora_adapter`` ``{"lora_name":
  "policy-v<version>", "lora_path": DIR}``, the adapter before it is dropped with ``POST
  /v1/unload_lora_adapter`` ``{"lora_name": ...}``, and requests name the loaded adapter
  as their ``model``. The base weights stay those the server started with.

**Logprobs.** vLLM's ``processed_logprobs`` are ``log_softmax`` of the logits after the
sampling transforms: divided by the temperature and, when ``top_k``/``top_p`` cut the
vocabulary, restricted to the kept tokens and renormalised: the distribution that sampled,
the run's one definition of a behaviour logprob (the hf engine's default ``"processed"``
mode of :mod:`asyncrl.engines.sampling`, and what the trainer scores with the same cut).
Greedy requests (T = 0) report ``log_softmax(logits)``. The default (``raw_logprobs``)
would ignore the temperature and the cut.

**The weight broadcast** (``weights.transport = "collective"``, protocol ``"asyncrl"``).
Servers start with asyncrl's worker extension (``--worker-extension-cls
asyncrl_vllm_worker.WeightBroadcast``, its folder :data:`WORKER_DIR` on ``PYTHONPATH``),
and the server itself joins the trainer's group and receives each version through
``POST /collective_rpc``: ``asyncrl_join``, ``asyncrl_receive`` (into a staging area of
the worker; vLLM runs it between two steps, so generation waits while the bytes arrive),
then ``asyncrl_load`` during the pause, followed by ``/reset_prefix_cache`` and
``/update_weight_version`` as for a directory.
One server of one worker only: each server (and each tensor-parallel worker) would be a
member of its own, so ``asyncrl check`` refuses ``rollout.engine.servers`` > 1, ``urls``
and tensor/pipeline/data parallel flags with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from asyncrl.api.inference import (
    BroadcastJoin,
    BroadcastStaged,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    TensorSpec,
    WeightSource,
)
from asyncrl.engines.config import VLLMEngineConfig
from asyncrl.engines.remote import RemoteEngine, Server
from asyncrl.engines.server import ServerError, resolve_interpreter
from asyncrl.models.resolve import ModelConfig
from asyncrl.weights.lora import is_adapter_dir

LAUNCHER = Path(__file__).parents[1] / "entry" / "vllm_server.py"

WORKER_DIR = Path(__file__).with_name("vllm_worker")
"""The folder put on the servers' ``PYTHONPATH``: it holds the worker extension alone."""

WORKER_EXTENSION = "asyncrl_vllm_worker.WeightBroadcast"

RPC_MARGIN_S = 30.0
"""Seconds a broadcast call to a server may take beyond the collectives' own bound (the
server's loop may first finish a step)."""

FINISH_REASONS = set(get_args(FinishReason))

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``--max-lora-rank``."""


def max_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` value that holds adapters of ``rank``."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"vLLM serves LoRA ranks up to {LORA_RANKS[-1]}, not {rank}")


def completion_payload(
    model: str, request: GenerateRequest, max_tokens: int, request_id: str
) -> dict[str, Any]:
    """The ``/v1/completions`` body for ``request`` with a budget of ``max_tokens``."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.input_ids),
        "max_tokens": max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,  # 0 disables the cut in vLLM as here
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "request_id": request_id,
    }
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop_token_ids is not None:
        # Only the given ids stop (none: only the length does), not the model's EOS.
        body["stop_token_ids"] = list(s.stop_token_ids)
        body["ignore_eos"] = True
    return body


def parse_completion(request: GenerateRequest, body: Any) -> GenerateResponse:
    """The tokens, logprobs and finish reason of a ``/v1/completions`` answer."""
    try:
        choice = body["choices"][0]
        ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs = choice.get("logprobs") or {}
        values = [float(x) for x in logprobs.get("token_logprobs") or []]
        finish = choice.get("finish_reason")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"malformed completion from vLLM ({exc!r}): {str(body)[:2000]}") from exc
    if len(values) != len(ids):
        raise ServerError(
            f"vLLM returned {len(ids)} tokens but {len(values)} logprobs: {str(body)[:2000]}"
        )
    if finish not in FINISH_REASONS:
        raise ServerError(f"vLLM finish_reason {finish!r} is not one of {sorted(FINISH_REASONS)}")
    return GenerateResponse(
        rid=request.rid,
        input_ids=list(request.input_ids),
        output_ids=ids,
        output_logprobs=values,
        finish_reason=finish,
    )


class VLLMEngine(RemoteEngine):
    """vLLM servers behind :class:`~asyncrl.api.inference.InferenceEngine`.

    Built from the recipe's ``rollout.engine`` section (:class:`VLLMEngineConfig`): its
    ``python`` is the interpreter of the virtualenv holding vLLM (``make vllm`` makes
    ``.venv-vllm``); it runs the launcher unless ``command`` replaces it. ``cpu_kvcache_gib``
    and ``cpu_threads_bind`` set vLLM's CPU backend (``VLLM_CPU_KVCACHE_SPACE``,
    ``VLLM_CPU_OMP_THREADS_BIND``); ``max_model_len`` caps the context (0: the model's).
    ``lora_rank`` > 0 starts the servers with LoRA on, for adapters up to that rank
    (``trainer.lora.rank``).
    """

    kind = "vllm"
    served_name = "policy"
    broadcast_protocol = "asyncrl"

    config: VLLMEngineConfig

    def __init__(
        self,
        model: ModelConfig | str,
        config: VLLMEngineConfig | None = None,
        *,
        log_dir: str | Path | None = None,
        version: int = 0,
        lora_rank: int = 0,
    ) -> None:
        super().__init__(model, config or VLLMEngineConfig(), log_dir=log_dir, version=version)
        self.lora_rank = lora_rank
        self._broadcast_timeout_s = 60.0  # the grant's, once joined

    def server_command(self) -> list[str]:
        if self.config.command:
            return self.config.command
        return [resolve_interpreter(self.config.python, "vLLM", "vllm"), str(LAUNCHER)]

    def server_argv(self, port: int) -> list[str]:
        argv = [
            *self.server_command(),
            "serve",
            self.model_path,
            "--host",
            self.config.host,
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--served-model-name",
            self.served_name,
            "--logprobs-mode",
            "processed_logprobs",
            "--disable-uvicorn-access-log",
            "--worker-extension-cls",
            WORKER_EXTENSION,
        ]
        if self.config.max_model_len:
            argv += ["--max-model-len", str(self.config.max_model_len)]
        if self.lora_rank:
            # one adapter at a time: each update replaces the one before
            argv += ["--enable-lora", "--max-loras", "1"]
            argv += ["--max-lora-rank", str(max_lora_rank(self.lora_rank))]
        return argv + self.config.args

    def server_env(self) -> dict[str, str]:
        lora = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if self.lora_rank else {}
        inherited = self.config.env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        return {
            "VLLM_SERVER_DEV_MODE": "1",
            **lora,
            "VLLM_CPU_KVCACHE_SPACE": str(self.config.cpu_kvcache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": self.config.cpu_threads_bind,
            **self.config.env,
            "PYTHONPATH": os.pathsep.join(p for p in (str(WORKER_DIR), inherited) if p),
        }

    async def _server_ready(self, server: Server) -> None:
        models = await self._call(server, "/v1/models", method="GET")
        card = models["data"][0]
        server.info["model"] = card["id"]
        server.info["max_model_len"] = int(card.get("max_model_len") or 0)

    async def _complete(self, server: Server, request: GenerateRequest) -> GenerateResponse:
        budget = request.sampling.max_new_tokens
        limit = server.info.get("max_model_len", 0)
        if limit:
            budget = min(budget, limit - len(request.input_ids))
        if budget <= 0:  # the context is full: nothing more can be generated
            return GenerateResponse(
                rid=request.rid, input_ids=list(request.input_ids), finish_reason="length"
            )
        payload = completion_payload(
            server.info.get("lora") or server.info.get("model", self.served_name),
            request,
            budget,
            self.new_request_id(request.rid),
        )
        return parse_completion(request, await self._call(server, "/v1/completions", payload))

    async def _server_pause(self, server: Server) -> None:
        await self._call(server, "/pause", params={"mode": "abort"})

    async def _server_abort_all(self, server: Server) -> None:
        await self._call(server, "/abort_requests", {})

    async def _server_resume(self, server: Server) -> None:
        await self._call(server, "/resume")

    async def _server_load(self, server: Server, path: Path, version: int) -> None:
        if is_adapter_dir(path):
            await self._load_adapter(server, path, version)
            return
        await self._swap_base_weights(
            server, {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}, version
        )

    async def _swap_base_weights(
        self, server: Server, rpc: dict[str, Any], version: int, limit_s: float | None = None
    ) -> None:
        """New base weights through the ``/collective_rpc`` call ``rpc``; the adapter and
        the prefix cache belonged to the old ones."""
        if server.info.get("lora"):
            await self._call(server, "/v1/unload_lora_adapter", {"lora_name": server.info["lora"]})
            server.info["lora"] = None
        await self._call(server, "/collective_rpc", rpc, limit_s=limit_s)
        await self._call(server, "/reset_prefix_cache")
        await self._call(server, "/update_weight_version", {"new_version": str(version)})

    # --- the weight broadcast (see the module docstring) -----------------------------------

    def _broadcast_server(self) -> Server:
        if len(self.servers) != 1:
            raise ServerError(
                f"the weight broadcast reaches one vLLM server per rollout actor, this one "
                f"has {len(self.servers)} (rollout.engine.servers / urls)"
            )
        return self.servers[0]

    async def _rpc(self, server: Server, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """One worker method through ``/collective_rpc``: the answer of the one worker."""
        body = await self._call(
            server,
            "/collective_rpc",
            {"method": method, "kwargs": kwargs},
            limit_s=self._broadcast_timeout_s * 2 + RPC_MARGIN_S,
        )
        try:
            (result,) = body["results"]
            return dict(result)
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerError(f"{method}: unexpected answer from vLLM: {str(body)[:2000]}") from exc

    async def join_broadcast(self, where: BroadcastJoin) -> None:
        server = self._broadcast_server()
        self._broadcast_timeout_s = where.timeout_s
        spec = {
            "host": where.host,
            "port": where.port,
            "prefix": where.prefix,
            "backend": where.backend,
            "timeout_s": where.timeout_s,
        }
        await self._rpc(server, "asyncrl_join", {"where": json.dumps(spec)})

    async def receive_broadcast(
        self, version: int, epoch: int, tensors: Sequence[TensorSpec] = ()
    ) -> BroadcastStaged:
        # asyncrl's protocol carries its manifest: ``tensors`` is not needed
        got = await self._rpc(self._broadcast_server(), "asyncrl_receive", {})
        return BroadcastStaged(version=int(got["version"]), epoch=int(got["epoch"]))

    async def _load_weights(self, source: WeightSource) -> None:
        if not isinstance(source, BroadcastStaged):
            await super()._load_weights(source)
            return
        version = self._loading_version if self._loading_version is not None else self._version
        rpc = {
            "method": "asyncrl_load",
            "kwargs": {"epoch": source.epoch, "version": source.version},
        }
        await self._swap_base_weights(
            self._broadcast_server(), rpc, version, self._broadcast_timeout_s + RPC_MARGIN_S
        )

    async def _load_adapter(self, server: Server, path: Path, version: int) -> None:
        """Loads the adapter in ``path`` as ``policy-v<version>`` and drops the one before
        (after: the load may fail, and then the old one still serves)."""
        if not self.lora_rank:
            raise ServerError(
                f"{path} is a LoRA adapter, but the vLLM servers were started without "
                '--enable-lora; publish merged weights (trainer.lora.publish = "merged")'
            )
        name = f"{self.served_name}-v{version}"
        old = server.info.get("lora")
        if old == name:  # the same version again (a restarted trainer): reload it
            await self._call(server, "/v1/unload_lora_adapter", {"lora_name": old})
            old = None
        await self._call(
            server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
        )
        server.info["lora"] = name
        if old:
            await self._call(server, "/v1/unload_lora_adapter", {"lora_name": old})
        await self._call(server, "/update_weight_version", {"new_version": str(version)})
