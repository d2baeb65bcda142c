"""Shared-prefix training (``trainer.share_prefix``): a group's common prefix forwarded once
per micro-batch gives the logprobs, entropies and gradients of forwarding it with every
sample, in float64 to 1e-10 (relative to each tensor's largest value), for groups of 1, 4
and 8 and multi-turn samples that differ after the prompt; and the planner keeps a
sharing set in one micro-batch and shares only where it saves."""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from train_helpers.tiny import (
    assert_within,
    float64_engine,
    group_batch,
    multi_turn_group,
    one_torch_thread,
    per_sample_sampling,
    prefix_batch,
    prefix_config,
    random_batch,
    step_gradients,
    tiny_config,
    train_config,
)

from asyncrl.train import attention
from asyncrl.train.batch import Sample
from asyncrl.train.config import LoraConfig, TrainerConfig
from asyncrl.train.engine import TrainEngine
from asyncrl.train.packing import (
    MIN_SHARED_PREFIX,
    build_micro_batch,
    common_prefix,
    plan_micro_batches,
    sharing_sets,
)
from asyncrl.train.shard import TrainShard, plan_shards
from asyncrl.train.torchrun import torchrun_argv

REL = 1e-10
WORKER = Path(__file__).parent / "train_helpers" / "worker.py"


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def assert_rel(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """``got`` equals ``want`` to :data:`REL` of ``want``'s largest magnitude."""
    assert_within(got, want, REL, what)


def hand_group(prompt: int, answers: list[int], group: int | None = 0) -> list[Sample]:
    """Samples of one prompt of ``prompt`` tokens (ids 1, 2, …) and answers of the given
    lengths (ids from 100 on, a different first id each), the loss on the answers."""
    head = torch.arange(1, prompt + 1)
    out = []
    for k, n in enumerate(answers):
        ids = torch.cat([head, 100 + k * 10 + torch.arange(n)])
        mask = torch.arange(len(ids)) >= prompt
        out.append(Sample(ids, mask, torch.zeros(len(ids)), 1.0, group=group))
    return out


BATCHES = {
    "G1": lambda: group_batch(0, (1, 1, 1)),
    "G4": lambda: group_batch(1, (4, 4)),
    "G8": lambda: group_batch(2, (8,)),
    # two episodes that differ after the prompt; then one episode alone, whose samples
    # share its first answer too, where two of them have loss tokens
    "multi-turn": lambda: multi_turn_group(3, 0) + multi_turn_group(4, 1, episodes=1),
}


def shared_tokens(batch: list[Sample]) -> int:
    """Tokens a micro-batch of the whole ``batch`` computes with sharing."""
    return build_micro_batch(batch, list(range(len(batch))), share_prefix=True).num_input_tokens


# --- finding and planning ------------------------------------------------------------------


def test_the_common_prefix_leaves_every_sample_a_token() -> None:
    a, b, c = (torch.tensor(x) for x in ([1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3, 4, 7]))
    assert common_prefix([a, b]) == 3
    assert common_prefix([a, c]) == 3  # a is a prefix of c: a keeps its last token
    assert common_prefix([c, c]) == 4
    assert common_prefix([torch.tensor([9]), torch.tensor([9, 1])]) == 0


def test_sharing_needs_two_samples_a_long_enough_prefix_and_a_group() -> None:
    long_group = hand_group(MIN_SHARED_PREFIX, [3, 5, 2], group=0)
    alone = hand_group(40, [4], group=1)  # a single-sample group
    short = hand_group(MIN_SHARED_PREFIX - 1, [3, 3], group=2)  # prefix below the minimum
    no_group = hand_group(40, [3, 3], group=None)
    batch = long_group + alone + short + no_group
    assert sharing_sets(batch) == [([0, 1, 2], MIN_SHARED_PREFIX)]
    mb = build_micro_batch(batch, list(range(len(batch))), share_prefix=True)
    assert mb.num_input_tokens == sum(len(s) for s in batch) - 2 * MIN_SHARED_PREFIX
    # without sharing the layout is the plain packed one
    plain = build_micro_batch(batch, list(range(len(batch))))
    assert plain.key_index is None and plain.num_input_tokens == sum(len(s) for s in batch)
    assert torch.equal(plain.source_index, plain.target_index - 1)


def test_a_shared_prefix_is_laid_out_once_and_predicts_each_first_answer_token() -> None:
    p = MIN_SHARED_PREFIX
    batch = hand_group(p, [2, 3])
    mb = build_micro_batch(batch, [0, 1], share_prefix=True)
    row = mb.input_ids[0].tolist()
    assert row == [*range(1, p + 1), 100, 101, 110, 111, 112]
    assert mb.position_ids[0].tolist() == [*range(p), p, p + 1, p, p + 1, p + 2]
    assert mb.cu_seqlens is not None and mb.cu_seqlens.tolist() == [0, p, p + 2, p + 5]
    # each answer attends to the prefix's keys, then to its own
    assert mb.key_index is not None and mb.cu_seqlens_k is not None
    prefix = list(range(p))
    assert mb.key_index.tolist() == [*prefix, *prefix, p, p + 1, *prefix, p + 2, p + 3, p + 4]
    assert mb.cu_seqlens_k.tolist() == [0, p, 2 * p + 2, 3 * p + 5]
    assert (mb.max_len_q, mb.max_len_k) == (p, p + 3)
    # targets: the answers (columns p, p + 1 and p, p + 1, p + 2), each predicted by the
    # token before it in its own sample: the prefix's last for the first answer tokens
    assert mb.target_col.tolist() == [p, p + 1, p, p + 1, p + 2]
    assert mb.target_index.tolist() == [p, p + 1, p + 2, p + 3, p + 4]
    assert mb.source_index.tolist() == [p - 1, p, p - 1, p + 2, p + 3]


def test_loss_tokens_inside_the_prefix_are_predicted_from_it() -> None:
    """A first call's sample is a prefix of its continuation: their common prefix holds
    the first call's answer, a loss span of the one sample and context of the other."""
    first, second = multi_turn_group(0, 0, episodes=1)[:2]
    p = common_prefix([first.input_ids, second.input_ids])
    assert p == len(first) - 1 and bool(first.loss_mask[:p].any())
    mb = build_micro_batch([first, second], [0, 1], share_prefix=True)
    inside = (mb.target_row == 0) & (mb.target_col < p)
    assert int(inside.sum()) == int(first.loss_mask[:p].sum())
    assert torch.equal(mb.target_index[inside], mb.target_col[inside])  # in the prefix
    assert torch.equal(mb.source_index[inside], mb.target_col[inside] - 1)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_plan_keeps_each_sharing_set_in_one_micro_batch(world: int) -> None:
    """Groups of 4, 1, 8 and 3 (prompts of 18-30 tokens, answers of 2-12) in 60-token
    micro-batches: a set is planned whole, costs its prefix once, and one too large for a
    micro-batch is cut into runs that fit; an oversized sequence still goes alone."""
    batch = group_batch(5, (4, 1, 8, 3))
    batch += hand_group(70, [5], group=9)  # 75 tokens: over the budget alone
    lengths = [len(s) for s in batch]
    budget = 60
    sets = sharing_sets(batch, budget)
    assert sorted(i for members, _ in sets for i in members) == [
        i for i in range(len(batch)) if batch[i].group not in (1, 9)
    ]
    eight = [members for members, _ in sets if batch[members[0]].group == 2]
    assert len(eight) > 1, "the group of 8 costs more than a micro-batch: cut in runs"
    plan = plan_micro_batches(lengths, budget, world, shared=sets)
    assert len({len(rank) for rank in plan}) == 1
    where = {i: (r, k) for r, rank in enumerate(plan) for k, mb in enumerate(rank) for i in mb}
    assert sorted(where) == list(range(len(batch)))
    for members, _ in sets:
        assert len({where[i] for i in members}) == 1, members
    for rank in plan:
        for mb in rank:
            samples = [batch[i] for i in mb]
            if len(mb) > 1:
                assert shared_tokens(samples) <= budget
    rank, k = where[len(batch) - 1]
    assert plan[rank][k] == [len(batch) - 1]


@settings(max_examples=100, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.integers(1, 40), st.lists(st.integers(1, 20), min_size=1, max_size=8)),
        min_size=1,
        max_size=8,
    ),
    max_tokens=st.integers(16, 128),
    world=st.integers(1, 3),
)
def test_a_plan_with_sharing_covers_each_sequence_once_within_budget(
    groups: list[tuple[int, list[int]]], max_tokens: int, world: int
) -> None:
    """Random groups (prompt length, answer lengths): every sequence once, as many
    micro-batches on every rank, each set whole, and each micro-batch of several
    sequences within the budget as laid out with sharing."""
    batch = [
        s for k, (prompt, answers) in enumerate(groups) for s in hand_group(prompt, answers, k)
    ]
    sets = sharing_sets(batch, max_tokens)
    plan = plan_micro_batches([len(s) for s in batch], max_tokens, world, shared=sets)
    assert len({len(rank) for rank in plan}) == 1
    where = {i: (r, k) for r, rank in enumerate(plan) for k, mb in enumerate(rank) for i in mb}
    assert sorted(where) == list(range(len(batch)))
    assert sum(len(mb) for rank in plan for mb in rank) == len(batch)
    for members, _ in sets:
        assert len({where[i] for i in members}) == 1
    for rank in plan:
        for mb in rank:
            if len(mb) > 1:
                assert shared_tokens([batch[i] for i in mb]) <= max_tokens


def test_the_shards_plan_groups_together_and_carry_each_sample_s_group() -> None:
    batch = group_batch(6, (4, 1, 8))
    config = train_config(max_tokens_per_microbatch=80, ppo_minibatches=2)
    for shard in plan_shards(batch, config, 2):
        back = TrainShard.from_tensors(*shard.to_tensors())
        assert [s.group for s in back.samples] == [s.group for s in shard.samples]
        assert back.minibatches == shard.minibatches
    (alone,) = plan_shards(batch, train_config(max_tokens_per_microbatch=10_000), 1)
    (micro,) = alone.minibatches
    assert len(micro) == 1  # one micro-batch, every group in it, sharing its prompt


def test_share_prefix_true_is_refused_where_it_cannot_apply() -> None:
    assert TrainerConfig().shares_prefix
    assert not TrainerConfig(packing=False).shares_prefix
    assert not TrainerConfig(attn_implementation="sdpa").shares_prefix
    assert not TrainerConfig(share_prefix=False).shares_prefix
    for bad in ({"packing": False}, {"attn_implementation": "sdpa"}):
        with pytest.raises(ValueError, match=r"trainer\.share_prefix"):
            TrainerConfig(share_prefix=True, **bad)  # type: ignore[arg-type]


# --- exactness ------------------------------------------------------------------------------


def _forward_and_grads(
    engine: TrainEngine, batch: list[Sample], *, share: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int]:
    """Logprobs and entropies ``[B, T]`` of one micro-batch of ``batch``, the gradient of
    a fixed random weighting of both, and the tokens computed."""
    mb = build_micro_batch(batch, list(range(len(batch))), share_prefix=share).to(engine.device)
    g = torch.Generator().manual_seed(0)
    weights_BT = torch.randn(mb.loss_mask_BT.shape, generator=g, dtype=torch.float64)
    engine.module.zero_grad(set_to_none=True)
    lp_BT, ent_BT = engine._forward_BT(mb)
    (lp_BT * weights_BT + ent_BT * weights_BT.flip(1)).sum().backward()
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
    return lp_BT.detach(), ent_BT.detach(), grads, mb.num_input_tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_a_shared_forward_gives_the_logprobs_and_gradients_of_forwarding_each(
    name: str, kind: str
) -> None:
    batch = per_sample_sampling(BATCHES[name]())
    engine = float64_engine(
        train_config(temperature=0.9, lm_head_chunk_tokens=16),
        architecture=tiny_config(kind, tie_word_embeddings=kind == "qwen2"),
    )
    lp, ent, grads, tokens = _forward_and_grads(engine, batch, share=False)
    lp_s, ent_s, grads_s, tokens_s = _forward_and_grads(engine, batch, share=True)
    assert tokens == sum(len(s) for s in batch)
    assert (tokens_s < tokens) == (name != "G1")
    assert_rel(lp_s, lp, "logprobs")
    assert_rel(ent_s, ent, "entropies")
    assert grads_s.keys() == grads.keys()
    for key, grad in grads.items():
        assert_rel(grads_s[key], grad, key)


def flash_like_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """What torch's flash varlen kernel computes (``[T, H, D]`` rows), on the CPU: each
    segment's queries against its keys, causal (window ``(-1, 0)``) from the bottom-right
    corner, as flash attention aligns the mask when keys outnumber queries."""
    assert window_size == (-1, 0)
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    assert max_q == max(b - a for a, b in itertools.pairwise(bounds_q))
    assert max_k == max(b - a for a, b in itertools.pairwise(bounds_k))
    out = []
    for (q0, q1), (k0, k1) in zip(
        itertools.pairwise(bounds_q), itertools.pairwise(bounds_k), strict=True
    ):
        q, k, v = (t.transpose(0, 1) for t in (query[q0:q1], key[k0:k1], value[k0:k1]))
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(k1 - k0 - (q1 - q0))
        o = F.scaled_dot_product_attention(q, k, v, mask, scale=scale, enable_gqa=enable_gqa)
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def test_the_flash_path_is_given_each_segment_s_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch (one flash varlen call over the gathered keys), run on the CPU
    against a stand-in of the kernel: the shared forward equals the unshared one."""
    batch = prefix_batch()
    engine = float64_engine(train_config())
    lp, ent, grads, tokens = _forward_and_grads(engine, batch, share=False)
    monkeypatch.setattr(attention, "_VARLEN", flash_like_varlen)
    monkeypatch.setattr(attention, "_flash_applies", lambda query, dtype, dropout_p: True)
    lp_s, ent_s, grads_s, tokens_s = _forward_and_grads(engine, batch, share=True)
    assert tokens_s < tokens
    assert_rel(lp_s, lp, "logprobs")
    assert_rel(ent_s, ent, "entropies")
    for key, grad in grads.items():
        assert_rel(grads_s[key], grad, key)


Step = tuple[dict[str, float], list[dict[str, torch.Tensor]], list[torch.Tensor]]
"""A train step's stats, gradients per minibatch, and the batch's logprobs after it."""


def _step(config: TrainerConfig, batch: list[Sample], *, share: bool) -> Step:
    engine = float64_engine(config.model_copy(update={"share_prefix": share}))
    stats, grads = step_gradients(engine, lambda: engine.train_step(batch))
    return stats, grads, engine.compute_logprobs(batch)


def _assert_same_step(shared_step: Step, plain_step: Step) -> None:
    (shared, shared_grads, shared_lp), (plain, plain_grads, plain_lp) = shared_step, plain_step
    assert plain["micro_batches"] > 2 and shared["micro_batches"] > 1
    assert shared["input_tokens"] < plain["input_tokens"] == plain["tokens"]
    for key in ("loss", "pg_loss", "kl_ref", "entropy", "approx_kl"):
        # the step's statistics are summed over micro-batches and ranks in float32
        assert shared[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-9), key
    assert len(shared_grads) == len(plain_grads) == 2
    for got, want in zip(shared_grads, plain_grads, strict=True):
        assert got.keys() == want.keys() and want
        for key, grad in want.items():
            assert_rel(got[key], grad, key)
    for got_lp, want_lp in zip(shared_lp, plain_lp, strict=True):
        assert got_lp.dtype == torch.float64
        assert_rel(got_lp, want_lp, "compute_logprobs")


def test_a_shared_train_step_gives_the_gradients_of_an_unshared_one() -> None:
    """Packed micro-batches, several of them, two minibatches, the proximal and reference
    forwards, entropy and per-episode weights: gradients, losses and logprobs to 1e-10."""
    config, batch = prefix_config(), prefix_batch()
    _assert_same_step(_step(config, batch, share=True), _step(config, batch, share=False))


def test_a_shared_lora_step_gives_the_gradients_of_an_unshared_one() -> None:
    """The same with LoRA adapters, whose reference forward is the base model (the
    adapters disabled), and with each decoder layer recomputed in backward."""
    lora = LoraConfig(rank=4, alpha=8)
    config, batch = prefix_config(lora=lora, gradient_checkpointing=True), prefix_batch()
    _assert_same_step(_step(config, batch, share=True), _step(config, batch, share=False))


@pytest.mark.slow
def test_two_gloo_ranks_share_exactly(tmp_path: Path) -> None:
    """Two FSDP ranks (gloo) through the command protocol, each given its shard as
    tensors: with and without sharing, and against one unsharded process, the same
    gradients and logprobs to 1e-10."""
    out = tmp_path / "out.pt"
    target = [str(WORKER), "prefix", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(torchrun_argv(target, nproc=2), check=True, timeout=240, env=env)
    runs = torch.load(out, weights_only=True)

    def two_ranks(share: bool) -> Step:
        run = runs[share]
        return run["stats"], run["grads"], run["logprobs"]

    _assert_same_step(two_ranks(True), two_ranks(False))
    config, batch = prefix_config(), prefix_batch()
    _assert_same_step(two_ranks(True), _step(config, batch, share=False))


def test_samples_without_groups_train_as_before() -> None:
    """No group, nothing shared: the layout, and so the step, of a plain packed batch."""
    batch = random_batch(3)
    mb = build_micro_batch(batch, list(range(len(batch))), share_prefix=True)
    plain = build_micro_batch(batch, list(range(len(batch))))
    for field in ("input_ids", "position_ids", "cu_seqlens", "target_index", "source_index"):
        assert torch.equal(getattr(mb, field), getattr(plain, field)), field
    assert mb.key_index is None
