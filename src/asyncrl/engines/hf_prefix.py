"""The hf engine's prefix cache: keys and values of finished sequences, kept by token ids,
so that a prompt which extends one is prefilled only past what they share.

The case it is for: an agent episode sends its whole history back at every turn (the
previous prompt, the reply, the tool's answer, the next turn's template), and a GRPO
group's samples share their prompt; without the cache every turn computes the episode
again from its first token.

**What a finished sequence leaves.** Keys and values of its prompt and of every generated
token but the last: the last token was sampled from the final step's logits and never fed
back, so no layer computed its keys. A later prompt that repeats it (as the next turn
does) computes it as part of its tail.

**Blocks.** Tokens are cut into blocks of :data:`BLOCK_TOKENS`; a block is stored once,
under ``(id of its parent block, its tokens)``, so a key names the whole prefix up to the
block's end (a trie flattened into one dict) and every sequence sharing a prefix shares
its blocks: one copy of a system prompt serves every episode. The dict compares keys by
value, so a lookup can never return a block of another prefix. A sequence's last partial
block is not kept (at most ``BLOCK_TOKENS - 1`` tokens a sequence are computed again).

**Lookup.** A prompt's blocks are looked up from the first until one is missing; the
prefix reused is those blocks' tokens, cut to leave at least the prompt's last token to
compute, since its logits sample the first new token.

**Eviction.** Least recently used block first, within ``capacity_bytes``. A lookup or an
insert touches a chain from its deepest block to its first, so a block is always more
recent than its descendants: the least recently used block is always a leaf, and no block
is ever kept behind an evicted parent.

**Whole prompts.** A prompt the batch prefilled is kept whole as well, with the logits of
its last position (:meth:`PrefixCache.keep_prompt`): a request for the same prompt that
joins later (a GRPO group's sample that found the batch full when its siblings joined) takes
its keys and values and samples its first token from those logits, with no forward pass at
all. They take at most a quarter of ``capacity_bytes``, and never room the blocks need:
the least recently used go first, when a prompt is kept or a block needs their bytes.

**Versions.** Keys and values belong to the weights that computed them. The engine clears
the cache at every weight load and memory release, and :meth:`PrefixCache.at_version`
clears it when a step runs under another policy version than the one it was filled under.

Tensors live on the model's device; everything runs in the engine's model thread.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK_TOKENS = 16
"""Tokens per cached block: the granularity of sharing and of eviction (vLLM's default)."""

_ROOT = 0
"""The parent id of a sequence's first block."""


def common_blocks(a: list[int], b: list[int]) -> int:
    """Tokens of the whole blocks that ``a`` and ``b`` begin with in common."""
    n = 0
    while (
        n + BLOCK_TOKENS <= min(len(a), len(b))
        and a[n : n + BLOCK_TOKENS] == b[n : n + BLOCK_TOKENS]
    ):
        n += BLOCK_TOKENS
    return n


@dataclass(eq=False)
class _Block:
    id: int
    kv: torch.Tensor
    """``[layers, 2 (keys, values), kv heads, BLOCK_TOKENS, head dim]``."""


BlockKey = tuple[int, tuple[int, ...]]
"""``(parent block id, the block's tokens)``."""


@dataclass(eq=False)
class Prefilled:
    """A prompt as the batch prefilled it: all its keys and values, the logits its last
    position gave, and the chain of block ids its row was given (its shared columns, for
    cascade attention)."""

    kv: torch.Tensor
    """``[layers, 2 (keys, values), kv heads, prompt tokens, head dim]``."""
    logits: torch.Tensor
    """``[vocab]``."""
    chain: tuple[int, ...]
    chain_tokens: int

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.logits.nbytes


class PrefixCache:
    """Blocks of keys and values by token prefix, least recently used first out.

    ``block_bytes`` is the size of one block's ``kv``; ``capacity_bytes`` 0 turns the cache
    off (every lookup misses, nothing is kept)."""

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self.max_blocks = capacity_bytes // block_bytes
        self.blocks: OrderedDict[BlockKey, _Block] = OrderedDict()
        self.prompts: OrderedDict[tuple[int, ...], Prefilled] = OrderedDict()
        self.max_prompt_bytes = capacity_bytes // 4
        self.prompt_bytes = 0
        self.version: int | None = None
        self.evicted_blocks = 0
        self._ids = itertools.count(_ROOT + 1)

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_bytes + self.prompt_bytes

    def clear(self) -> None:
        self.blocks.clear()
        self.prompts.clear()
        self.prompt_bytes = 0

    def at_version(self, version: int) -> None:
        """Clears the cache if it was filled under another policy version than ``version``."""
        if version != self.version:
            self.clear()
            self.version = version

    def _held(self, tokens: list[int]) -> list[BlockKey]:
        """Keys of the held blocks that make up the longest cached prefix of ``tokens``."""
        keys: list[BlockKey] = []
        parent = _ROOT
        for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            key = (parent, tuple(tokens[start : start + BLOCK_TOKENS]))
            block = self.blocks.get(key)
            if block is None:
                break
            keys.append(key)
            parent = block.id
        return keys

    def _touch(self, keys: list[BlockKey]) -> None:
        """Marks a chain most recently used, its first block last (see Eviction)."""
        for key in reversed(keys):
            self.blocks.move_to_end(key)

    def held_tokens(self, prompt: list[int]) -> int:
        """How many leading tokens of ``prompt`` :meth:`lookup` would give now (all of them
        for a prompt kept whole, which needs no prefill); changes nothing (no recency), so
        that a scheduler may size a prefill with it."""
        if not self.enabled:
            return 0
        if tuple(prompt) in self.prompts:
            return len(prompt)
        return max(0, min(len(self._held(prompt)) * BLOCK_TOKENS, len(prompt) - 1))

    def lookup(self, prompt: list[int]) -> tuple[int, torch.Tensor | None]:
        """``(n, kv)``: the first ``n`` tokens of ``prompt`` are cached, ``kv`` their keys and
        values ``[layers, 2, kv heads, n, head dim]`` (a copy). ``n < len(prompt)``: the
        last prompt token is always left to compute. ``(0, None)`` on a miss."""
        n, kv, _ = self.lookup_blocks(prompt)
        return n, kv

    def lookup_blocks(self, prompt: list[int]) -> tuple[int, torch.Tensor | None, tuple[int, ...]]:
        """:meth:`lookup`, and the ids of the blocks ``kv`` was copied from (empty on a
        miss)."""
        if not self.enabled:
            return 0, None, ()
        keys = self._held(prompt)
        n = min(len(keys) * BLOCK_TOKENS, len(prompt) - 1)
        if n <= 0:
            return 0, None, ()
        self._touch(keys)
        blocks = [self.blocks[k] for k in keys]
        kv = torch.cat([b.kv for b in blocks], dim=3)
        return n, kv[:, :, :, :n], tuple(b.id for b in blocks)

    def chain(self, tokens: list[int], n: int) -> tuple[int, ...]:
        """Ids of the held blocks that cover the first ``n`` tokens of ``tokens``; changes
        nothing."""
        keys = self._held(tokens)[: -(-n // BLOCK_TOKENS)]
        return tuple(self.blocks[k].id for k in keys)

    def keep_prompt(self, tokens: list[int], prefilled: Prefilled) -> None:
        """Keeps ``prefilled``, a prompt of ``tokens`` computed whole (see Whole prompts),
        evicting the least recently used prompts past a quarter of the capacity; one larger
        than that is not kept."""
        room = min(self.max_prompt_bytes, self.capacity_bytes - len(self.blocks) * self.block_bytes)
        if not self.enabled or prefilled.nbytes > room:
            return
        key = tuple(tokens)
        old = self.prompts.pop(key, None)
        if old is not None:
            self.prompt_bytes -= old.nbytes
        self._shed_prompts(room - prefilled.nbytes)
        self.prompts[key] = prefilled
        self.prompt_bytes += prefilled.nbytes

    def _shed_prompts(self, limit: int) -> None:
        """Evicts prompts kept whole, least recently used first, to at most ``limit``
        bytes."""
        while self.prompts and self.prompt_bytes > limit:
            self.prompt_bytes -= self.prompts.popitem(last=False)[1].nbytes

    def prompt(self, tokens: list[int]) -> Prefilled | None:
        """The prompt of exactly ``tokens`` as kept whole (made the most recent), or None."""
        key = tuple(tokens)
        prefilled = self.prompts.get(key)
        if prefilled is not None:
            self.prompts.move_to_end(key)
        return prefilled

    def insert(self, tokens: list[int], read: Callable[[int, int], torch.Tensor]) -> list[int]:
        """Keeps the full blocks of ``tokens``, a sequence whose keys and values are all
        computed; ``read(a, b)`` gives those of its tokens ``a:b`` as ``[layers, 2, kv
        heads, b - a, head dim]`` and is called once, for the blocks not held yet. Makes
        room by evicting; keeps only the first blocks of a sequence longer than the cap.
        Returns the ids of the blocks it added."""
        if not self.enabled:
            return []
        held = self._held(tokens)
        self._touch(held)
        new = min(len(tokens) // BLOCK_TOKENS, self.max_blocks) - len(held)
        if new <= 0:
            return []
        self._shed_prompts(self.capacity_bytes - (len(self.blocks) + new) * self.block_bytes)
        # The held chain is the most recent, so evicting from the old end spares it.
        for _ in range(len(self.blocks) + new - self.max_blocks):
            self.blocks.popitem(last=False)
            self.evicted_blocks += 1
        first = len(held) * BLOCK_TOKENS
        kv = read(first, first + new * BLOCK_TOKENS)
        parent = self.blocks[held[-1]].id if held else _ROOT
        added: list[BlockKey] = []
        for i in range(new):
            start = first + i * BLOCK_TOKENS
            key = (parent, tuple(tokens[start : start + BLOCK_TOKENS]))
            # a clone: a block owns its storage, so evicting it frees its bytes
            block_kv = kv[:, :, :, i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS].clone()
            block = _Block(next(self._ids), block_kv)
            self.blocks[key] = block
            added.append(key)
            parent = block.id
        self._touch(held + added)
        return [self.blocks[k].id for k in added]
