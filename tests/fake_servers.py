"""Small HTTP servers speaking vLLM's and SGLang's documented RL payloads, for engine tests.

They generate deterministic tokens one step at a time (``step_s`` apart): token ``t`` is
followed by ``(t + 1) % VOCAB``, and each token's logprob is ``-(1 + weights)`` where
``weights`` counts the weight loads so far, so a test can tell which weights made a token.
A loaded LoRA adapter counts as a weight load too. Pausing follows the real servers: running requests return ``abort`` with their partial
tokens, requests arriving while paused wait (queued) until resumed or aborted.

Run one as a process (the engines' ``command``):
``python tests/fake_servers.py vllm|sglang ... --port N [--never-healthy] [--die-at-start]``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

VOCAB = 50
EOS = 2


@dataclass(eq=False)
class _Job:
    prompt: list[int]
    budget: int
    stops: set[int]
    abort: asyncio.Event = field(default_factory=asyncio.Event)
    running: bool = False


class FakeModel:
    """The generation core shared by both fakes."""

    def __init__(self, step_s: float = 0.01) -> None:
        self.step_s = step_s
        self.weights = 0
        self.paused = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.jobs: set[_Job] = set()
        self.prompts: list[list[int]] = []  # every prompt received, in order
        self.calls: list[tuple[str, Any]] = []  # control calls, in order
        self.drop_connections = 0  # the next n requests lose their connection
        self.healthy = True
        self.adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> path
        self.models: list[str] = []  # the model each generation request named, in order
        self.tokens = 0  # generated so far, all requests together
        self.job_arrived = asyncio.Event()
        self._watch: list[tuple[int, asyncio.Event]] = []

    def after_tokens(self, n: int) -> asyncio.Event:
        """An event set once ``n`` tokens have been generated in all."""
        event = asyncio.Event()
        self._watch.append((n, event))
        if self.tokens >= n:
            event.set()
        return event

    async def generate(self, job: _Job) -> tuple[list[int], list[float], str]:
        self.prompts.append(list(job.prompt))
        self.jobs.add(job)
        self.job_arrived.set()
        try:
            # queued while paused, as the real servers do
            waiter = asyncio.ensure_future(self.resumed.wait())
            aborted = asyncio.ensure_future(job.abort.wait())
            await asyncio.wait({waiter, aborted}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            aborted.cancel()
            job.running = True
            ids: list[int] = []
            logprobs: list[float] = []
            last = job.prompt[-1]
            while True:
                if job.abort.is_set():
                    return ids, logprobs, "abort"
                if len(ids) >= job.budget:
                    return ids, logprobs, "length"
                await asyncio.sleep(self.step_s)
                if job.abort.is_set():
                    return ids, logprobs, "abort"
                last = (last + 1) % VOCAB
                ids.append(last)
                logprobs.append(-(1.0 + self.weights))
                self.tokens += 1
                for n, event in self._watch:
                    if self.tokens >= n:
                        event.set()
                if last in job.stops:
                    return ids, logprobs, "stop"
        finally:
            self.jobs.discard(job)

    def pause(self) -> None:
        """Abort mode: running requests end; queued ones stay queued, as in vLLM."""
        self.paused = True
        self.resumed.clear()
        for job in self.jobs:
            if job.running:
                job.abort.set()

    def abort_all(self) -> None:
        for job in self.jobs:
            job.abort.set()

    def resume(self) -> None:
        self.paused = False
        self.resumed.set()


def _maybe_drop(model: FakeModel, request: web.Request) -> bool:
    if model.drop_connections > 0:
        model.drop_connections -= 1
        assert request.transport is not None
        request.transport.close()
        return True
    return False


def vllm_app(model: FakeModel, max_model_len: int = 4096) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200 if model.healthy else 503)

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "policy", "max_model_len": max_model_len}]}
        )

    async def completions(request: web.Request) -> web.StreamResponse:
        if _maybe_drop(model, request):
            return web.Response()
        body = await request.json()
        prompt = body["prompt"]
        model.models.append(body["model"])
        if body["model"] != "policy" and body["model"] not in model.adapters:
            return web.json_response(
                {
                    "error": {
                        "message": f"The model `{body['model']}` does not exist.",
                        "type": "NotFoundError",
                        "code": 404,
                    }
                },
                status=404,
            )
        if len(prompt) + body["max_tokens"] > max_model_len:
            return web.json_response(
                {
                    "error": {
                        "message": f"max_tokens={body['max_tokens']} cannot be greater than "
                        f"max_model_len={max_model_len}",
                        "type": "BadRequestError",
                        "code": 400,
                    }
                },
                status=400,
            )
        stops = set(body.get("stop_token_ids") or [])
        if not body.get("ignore_eos"):
            stops.add(EOS)
        ids, lps, finish = await model.generate(_Job(prompt, body["max_tokens"], stops))
        choice = {
            "index": 0,
            "text": "".join(chr(65 + t % 26) for t in ids),
            "logprobs": {"token_logprobs": lps, "tokens": [str(t) for t in ids]} if ids else None,
            "finish_reason": finish,
            "token_ids": ids,
            "prompt_token_ids": prompt,
        }
        return web.json_response({"id": body.get("request_id"), "choices": [choice]})

    async def pause(request: web.Request) -> web.Response:
        model.calls.append(("pause", request.query.get("mode")))
        model.pause()
        return web.json_response({"status": "paused"})

    async def abort_requests(_: web.Request) -> web.Response:
        model.calls.append(("abort_requests", None))
        n = len(model.jobs)
        model.abort_all()
        return web.json_response({"status": "aborted", "aborted": n})

    async def resume(_: web.Request) -> web.Response:
        model.calls.append(("resume", None))
        model.resume()
        return web.json_response({"status": "resumed"})

    async def collective_rpc(request: web.Request) -> web.Response:
        body = await request.json()
        model.calls.append(("collective_rpc", body))
        path = body.get("kwargs", {}).get("weights_path", "")
        if body.get("method") != "reload_weights" or not os.path.isdir(path):  # noqa: ASYNC240
            return web.json_response(
                {"error": f"reload_weights: {path} is not a directory"}, status=500
            )
        model.weights += 1
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(_: web.Request) -> web.Response:
        model.calls.append(("reset_prefix_cache", None))
        return web.json_response({"success": True})

    async def update_weight_version(request: web.Request) -> web.Response:
        body = await request.json()
        model.calls.append(("update_weight_version", body["new_version"]))
        return web.json_response({"success": True, "new_version": body["new_version"]})

    async def load_lora_adapter(request: web.Request) -> web.Response:
        # vLLM's LoadLoRAAdapterRequest: lora_name, lora_path
        body = await request.json()
        model.calls.append(("load_lora_adapter", body))
        name, path = body["lora_name"], body["lora_path"]
        if name in model.adapters:
            message = f"The lora adapter '{name}' has already been loaded."
            return web.json_response({"error": {"message": message, "code": 400}}, status=400)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):  # noqa: ASYNC240
            message = f"No adapter found for {path}"
            return web.json_response({"error": {"message": message, "code": 404}}, status=404)
        model.adapters[name] = path
        model.weights += 1
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(request: web.Request) -> web.Response:
        body = await request.json()
        model.calls.append(("unload_lora_adapter", body))
        if model.adapters.pop(body["lora_name"], None) is None:
            message = f"The lora adapter '{body['lora_name']}' cannot be found."
            return web.json_response({"error": {"message": message, "code": 404}}, status=404)
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed.")

    app = web.Application()
    app.add_routes(
        [
            web.get("/health", health),
            web.get("/v1/models", models),
            web.post("/v1/load_lora_adapter", load_lora_adapter),
            web.post("/v1/unload_lora_adapter", unload_lora_adapter),
            web.post("/v1/completions", completions),
            web.post("/pause", pause),
            web.post("/abort_requests", abort_requests),
            web.post("/resume", resume),
            web.post("/collective_rpc", collective_rpc),
            web.post("/reset_prefix_cache", reset_prefix_cache),
            web.post("/update_weight_version", update_weight_version),
        ]
    )
    return app


def sglang_app(model: FakeModel) -> web.Application:
    """SGLang's native API as documented: ``/generate`` answers ``{"text", "output_ids",
    "meta_info": {"id", "finish_reason": {"type", ...}, "prompt_tokens",
    "completion_tokens", "output_token_logprobs": [[logprob, id, text], ...],
    "weight_version"}}``."""
    state: dict[str, Any] = {"weight_version": "default", "released": False}

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200 if model.healthy else 503)

    async def generate(request: web.Request) -> web.StreamResponse:
        if _maybe_drop(model, request):
            return web.Response()
        body = await request.json()
        if state["released"]:
            return web.json_response(
                {"object": "error", "message": "memory is released", "code": 400}, status=400
            )
        model.models.append(body.get("lora_path") or "")
        if body.get("lora_path") and body["lora_path"] not in model.adapters:
            message = f"LoRA adapter {body['lora_path']!r} is not loaded"
            return web.json_response({"object": "error", "message": message}, status=400)
        sp = body["sampling_params"]
        stops = set(sp.get("stop_token_ids") or [])
        if not sp.get("ignore_eos"):
            stops.add(EOS)
        ids, lps, finish = await model.generate(
            _Job(body["input_ids"], sp["max_new_tokens"], stops)
        )
        reason: dict[str, Any] = {"type": finish}
        if finish == "stop":
            reason["matched"] = ids[-1]
        elif finish == "length":
            reason["length"] = len(ids)
        else:
            reason["message"] = "Abort before prefill" if not ids else "Abort in waiting queue"
        meta = {
            "id": body.get("rid"),
            "finish_reason": reason,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": state["weight_version"],
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
        }
        text = "".join(chr(65 + t % 26) for t in ids)
        return web.json_response({"text": text, "output_ids": ids, "meta_info": meta})

    async def pause_generation(request: web.Request) -> web.Response:
        body = await request.json()
        model.calls.append(("pause_generation", body.get("mode")))
        model.pause()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(_: web.Request) -> web.Response:
        model.calls.append(("continue_generation", None))
        model.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(request: web.Request) -> web.Response:
        body = await request.json()
        model.calls.append(("abort_request", body))
        model.abort_all()
        return web.Response(status=200)

    async def update_weights_from_disk(request: web.Request) -> web.Response:
        body = await request.json()
        model.calls.append(("update_weights_from_disk", body))
        path = body["model_path"]
        if not os.path.isfile(os.path.join(path, "config.json")):  # noqa: ASYNC240
            return web.json_response(
                {
                    "success": False,
                    "message": f"Failed to get weights iterator: {path}/config.json not found",
                    "num_paused_requests": 0,
                },
                status=400,
            )
        model.weights += 1
        if body.get("weight_version") is not None:
            state["weight_version"] = body["weight_version"]
        return web.json_response(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }
        )

    async def flush_cache(_: web.Request) -> web.Response:
        model.calls.append(("flush_cache", None))
        return web.Response(text="Cache flushed.\n")

    async def release_memory(request: web.Request) -> web.Response:
        model.calls.append(("release_memory_occupation", await request.json()))
        state["released"] = True
        return web.Response(status=200)

    async def resume_memory(request: web.Request) -> web.Response:
        model.calls.append(("resume_memory_occupation", await request.json()))
        state["released"] = False
        return web.Response(status=200)

    async def load_lora_adapter(request: web.Request) -> web.Response:
        # SGLang's LoadLoRAAdapterReqInput: lora_name, lora_path (pinned: optional)
        body = await request.json()
        model.calls.append(("load_lora_adapter", body))
        name, path = body["lora_name"], body["lora_path"]
        if name in model.adapters:
            message = f"LoRA adapter {name!r} is already loaded"
            return web.json_response({"success": False, "error_message": message}, status=400)
        model.adapters[name] = path
        model.weights += 1
        return web.json_response({"success": True, "loaded_adapters": dict(model.adapters)})

    async def unload_lora_adapter(request: web.Request) -> web.Response:
        body = await request.json()
        model.calls.append(("unload_lora_adapter", body))
        model.adapters.pop(body["lora_name"], None)
        return web.json_response({"success": True, "loaded_adapters": dict(model.adapters)})

    app = web.Application()
    app.add_routes(
        [
            web.get("/health", health),
            web.post("/generate", generate),
            web.post("/load_lora_adapter", load_lora_adapter),
            web.post("/unload_lora_adapter", unload_lora_adapter),
            web.post("/pause_generation", pause_generation),
            web.post("/continue_generation", continue_generation),
            web.post("/abort_request", abort_request),
            web.post("/update_weights_from_disk", update_weights_from_disk),
            web.post("/flush_cache", flush_cache),
            web.post("/release_memory_occupation", release_memory),
            web.post("/resume_memory_occupation", resume_memory),
        ]
    )
    return app


class RunningServer:
    """A fake served on 127.0.0.1 on a free port inside the test's event loop."""

    def __init__(self, app: web.Application, model: FakeModel) -> None:
        self.app = app
        self.model = model
        self.url = ""
        self._runner = web.AppRunner(app)

    async def __aenter__(self) -> RunningServer:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


def _main(argv: list[str]) -> None:
    kind = argv[0]
    port = int(argv[argv.index("--port") + 1])
    print(f"fake {kind} server pid {os.getpid()} on port {port}", flush=True)
    if "--die-at-start" in argv:
        print("fatal: the fake server was told to die at start", flush=True)
        sys.exit(3)
    model = FakeModel(step_s=0.01)
    model.healthy = "--never-healthy" not in argv
    app = vllm_app(model) if kind == "vllm" else sglang_app(model)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


if __name__ == "__main__":
    _main(sys.argv[1:])
