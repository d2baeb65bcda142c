"""A step's compute floor: the matmul FLOPs it cannot avoid, over the matmul FLOP/s this
machine reaches in the step's dtype, measured in the same run (bench/trainer.py,
bench/vs_trl.py).

What is counted, for a decoder of the llama / qwen2 kind (d = hidden size, f = MLP size,
h and k = query and key/value heads of size e, ℓ = layers, V = vocabulary), a
multiply-add being 2 FLOPs:

- **linear layers**, per token computed: ``2·ℓ·(d·h·e + 2·d·k·e + h·e·d + 3·d·f)``
  (q, k and v, o; gate, up and down);
- **attention**, per token at position i (from 0) of its sequence: it attends to i + 1
  keys, causal with itself, for ``2·ℓ·h·e·(i + 1)`` in the scores Q·Kᵀ and as much in the
  values P·V; a run of positions ``a..b-1`` costs ``4·ℓ·h·e·Σ_{i=a}^{b-1} (i + 1)``, so a
  whole sequence of L tokens ``2·ℓ·h·e·L·(L + 1)``;
- **LM head**: ``2·d·V`` per logit row that is needed, one per scored token (a loss token
  in training, a generated token in generation), not per position.

Not counted: the embedding lookup, norms, activations, softmax, rotary embeddings,
residual adds and biases (elementwise work, no matmul), the loss, the optimizer step and
LoRA adapters.

What a step computes, for GRPO groups whose samples share their first ``prompt`` tokens
(a group of one where nothing is shared):

- **one forward** over a group: its prompt once, then each completion's tokens attending
  to the prompt and to themselves; the LM head at the loss tokens;
- **training** = forward + backward = 3 × forward (backward counted as twice its forward,
  for the attention too);
- **a proximal or reference forward** (a no-grad forward run apart from the training
  one: ``ppo_minibatches`` > 1, a KL reference) = 1 × forward each;
- **generation** of a group: the prompt prefilled once, each completion decoded with a KV
  cache: every position but the last is computed once (the last token is sampled, never
  fed back), the LM head at each generated token.

The prompt is counted once per group even where a system computes it once per sample:
the floor is what the step must compute, so it is a lower bound of its time for every
system held against it, whatever it shares.

A decode step has a second floor: the bytes it must read (every weight once for all its
rows, each row's keys and values) over the read bandwidth measured on the machine
(:func:`decode_step_bytes`, :func:`read_bandwidth`; bench/decode_floor.py prints both).
At few rows it is the larger.

The floor is ``FLOPs / peak``, where the peak is the best FLOP/s of a few timed
``torch.matmul`` calls in the step's dtype at the shapes of the model's MLP on a
micro-batch of rows, on the threads the step uses (:func:`matmul_peak`). The share of the
floor a step reached is ``floor / step time``: 100% would be every core multiplying at
its best the whole step.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Dims:
    """The matmul dimensions of a decoder (see the module docstring for the letters)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> Dims:
        """From a transformers config (``LlamaConfig``, ``Qwen2Config``, ...)."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
        )

    @property
    def linear_per_token(self) -> int:
        d, q, kv, f = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        return 2 * self.layers * (d * q + 2 * d * kv + q * d + 3 * d * f)

    @property
    def head_per_token(self) -> int:
        return 2 * self.hidden * self.vocab

    def attention(self, start: int, end: int) -> int:
        """FLOPs of the attention of positions ``start..end-1`` to the keys before them
        and their own: ``4·ℓ·h·e·Σ_{i=start}^{end-1} (i + 1)``."""
        if end <= start:
            return 0
        keys = (end * (end + 1) - start * (start + 1)) // 2
        return 4 * self.layers * self.heads * self.head_dim * keys


@dataclass(frozen=True)
class Group:
    """Samples sharing their first ``prompt`` tokens: each completion's tokens after the
    prompt, and how many of them are scored (generated: the loss tokens; all of them
    unless given, less where a multi-turn completion holds tool output)."""

    prompt: int
    completions: tuple[int, ...]
    scored: tuple[int, ...] | None = None

    def scored_tokens(self) -> tuple[int, ...]:
        return self.completions if self.scored is None else self.scored


def forward_flops(dims: Dims, groups: Sequence[Group]) -> int:
    """One forward over ``groups``: each prompt once, each completion attending to its
    prompt and itself, the LM head at the scored tokens."""
    total = 0
    for g in groups:
        total += dims.linear_per_token * g.prompt + dims.attention(0, g.prompt)
        for n, scored in zip(g.completions, g.scored_tokens(), strict=True):
            total += dims.linear_per_token * n + dims.attention(g.prompt, g.prompt + n)
            total += dims.head_per_token * scored
    return total


def generation_flops(dims: Dims, groups: Sequence[Group]) -> int:
    """Generating ``groups`` with a KV cache: the prompt prefilled once, every completion
    position but the last computed once, the LM head at each scored (generated) token."""
    total = 0
    for g in groups:
        total += dims.linear_per_token * g.prompt + dims.attention(0, g.prompt)
        for n, scored in zip(g.completions, g.scored_tokens(), strict=True):
            fed = max(0, n - 1)
            total += dims.linear_per_token * fed + dims.attention(g.prompt, g.prompt + fed)
            total += dims.head_per_token * scored
    return total


def step_flops(
    dims: Dims, groups: Sequence[Group], *, generate: bool = False, extra_forwards: int = 0
) -> dict[str, int]:
    """A step's FLOPs by part: ``train`` (3 × forward), ``forwards`` (``extra_forwards``
    no-grad forwards: proximal, reference), ``generate`` (where the step generates its
    batch) and their ``total``."""
    forward = forward_flops(dims, groups)
    parts = {
        "train": 3 * forward,
        "forwards": extra_forwards * forward,
        "generate": generation_flops(dims, groups) if generate else 0,
    }
    parts["total"] = sum(parts.values())
    return parts


def matmul_shapes(dims: Dims, rows: int) -> list[tuple[int, int, int]]:
    """The (m, k, n) of the model's MLP matmuls on ``rows`` tokens, up and down: most of a
    step's FLOPs, at shapes the peak should be measured at."""
    return [(rows, dims.hidden, dims.intermediate), (rows, dims.intermediate, dims.hidden)]


def matmul_peak(
    dtype: Any, shapes: Sequence[tuple[int, int, int]], reps: int = 5, min_s: float = 0.25
) -> float:
    """The best FLOP/s of timed ``torch.matmul`` calls at each (m, k, n) of ``shapes`` in
    ``dtype``, on torch's current threads: the matmul peak of this machine for such
    shapes. Each shape is timed ``reps`` times and for at least ``min_s`` seconds, after
    untimed calls for as long: on a loaded machine the pool's threads sleep between
    short calls, and the first calls after a wake-up wait for all of them."""
    import torch  # here: vs_trl.py imports this module before it parses its arguments

    g = torch.Generator().manual_seed(0)
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=g).to(dtype)
        b = torch.randn(k, n, generator=g).to(dtype)
        out = torch.empty(m, n, dtype=dtype)
        start = time.perf_counter()
        while time.perf_counter() - start < min_s:
            torch.matmul(a, b, out=out)
        fastest, calls, start = math.inf, 0, time.perf_counter()
        while calls < reps or time.perf_counter() - start < min_s:
            t0 = time.perf_counter()
            torch.matmul(a, b, out=out)
            fastest = min(fastest, time.perf_counter() - t0)
            calls += 1
        best = max(best, 2.0 * m * k * n / fastest)
    return best


def floor_columns(flops: float, peak: float, step_s: float) -> str:
    """``floor X s (N% reached)``: the step's floor at ``peak`` FLOP/s and the share of
    it a step of ``step_s`` seconds reached."""
    floor = flops / peak
    return f"floor {floor:.2f} s ({floor / step_s:.0%} reached)"


def decode_step_flops(dims: Dims, keys: Sequence[int]) -> int:
    """One decode step of ``len(keys)`` rows, row ``r``'s token attending to ``keys[r]``
    keys (itself included): each row's linear layers, its LM head and its attention."""
    per_key = 4 * dims.layers * dims.heads * dims.head_dim
    return len(keys) * (dims.linear_per_token + dims.head_per_token) + per_key * sum(keys)


def decode_step_bytes(dims: Dims, keys: Sequence[int], element: int) -> int:
    """The bytes one decode step of those rows cannot avoid reading, ``element`` bytes a
    number: every matmul weight once (all rows multiply together) and each row's own keys
    and values at every layer. A row's activations (kilobytes) are left out."""
    weights = (dims.linear_per_token + dims.head_per_token) // 2
    cache = 2 * dims.layers * dims.kv_heads * dims.head_dim * sum(keys)
    return element * (weights + cache)


def read_bandwidth(megabytes: int = 512, reps: int = 5) -> float:
    """The best bytes/s of summing a float32 tensor of ``megabytes`` (far past the
    caches) on torch's current threads: how fast this machine streams memory into its
    cores, the ceiling of a step that must read more bytes than it can multiply."""
    import torch  # here: as in matmul_peak

    data = torch.ones(megabytes << 18)
    data.sum()
    fastest = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        data.sum()
        fastest = min(fastest, time.perf_counter() - t0)
    return data.numel() * data.element_size() / fastest


def cpu_line() -> str:
    """This machine's CPU as figures quote it: its model name, family and model, and the
    matmul extensions it has of AVX-512, AVX512-BF16 and AMX (from /proc/cpuinfo)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.machine() or "unknown CPU"
    flags = set(fields.get("flags", "").split())
    has = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags] or ["no AVX-512"]
    return (
        f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')},"
        f" model {fields.get('model', '?')}; {' '.join(has)})"
    )


MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "dot"}
"""aten ops that multiply matrices (where the floor's FLOPs are)."""
VIEW_OPS = {
    "view", "reshape", "_unsafe_view", "as_strided", "transpose", "t", "permute", "expand",
    "slice", "select", "unsqueeze", "squeeze", "detach", "alias", "empty", "empty_like",
    "empty_strided", "resize_", "split", "split_with_sizes", "chunk", "unbind", "narrow",
    "lift_fresh", "result_type",
}  # fmt: skip
"""aten ops that move no data: they make a new view or an empty buffer."""


def time_sink(op: str) -> str:
    """The kind of time an op of a profile (``aten::mm``, ...) is: ``matmul``,
    ``attention`` (the fused attention kernels, forward and backward), ``optimizer``
    (``_foreach_*``, or any op named ``optimizer::<op>``: one the optimizer's step ran),
    ``views`` (no data moved) or ``elementwise`` (all else: pointwise work and reductions,
    copies, casts, concatenations, the LM head's softmax, the embedding)."""
    if op.startswith("optimizer::"):
        return "optimizer"
    name = op.removeprefix("aten::")
    if "scaled_dot_product" in name or "attention" in name:
        return "attention"
    if name.removesuffix("_") in MATMUL_OPS or (name.startswith("_mkldnn") and "mm" in name):
        return "matmul"
    if name.startswith("_foreach"):
        return "optimizer"
    if name in VIEW_OPS:
        return "views"
    return "elementwise"


def time_sinks(self_seconds: Iterable[tuple[str, float]], wall_s: float) -> dict[str, float]:
    """Seconds by :func:`time_sink` of a profile's aten ops (``self_seconds``: each op's
    name, ``aten::…`` or ``optimizer::aten::…``, and self time), and ``other``: the wall
    time they leave (Python, the autograd engine's own work, waiting). Ops run one after
    the other on the stepping thread (on the CPU, backward too), so their self times add
    up to wall time whatever the threads inside each."""
    sinks: dict[str, float] = {}
    for op, seconds in self_seconds:
        if op.startswith(("aten::", "optimizer::aten::")):
            kind = time_sink(op)
            sinks[kind] = sinks.get(kind, 0.0) + seconds
    sinks["other"] = max(0.0, wall_s - sum(sinks.values()))
    return sinks
