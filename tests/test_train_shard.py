"""Per-rank shards of a train step: every sequence trained once over the ranks, the global
numbers of the loss in every shard, and the tensor layout read back to the same shard."""

from __future__ import annotations

import pytest
import torch
from train_helpers.tiny import random_batch, train_config

from asyncrl.train import LossConfig
from asyncrl.train.batch import Sample
from asyncrl.train.shard import TrainShard, plan_shards
from asyncrl.wire.messages import SampledWith


def hand_batch() -> list[Sample]:
    """Three sequences with 2, 0 and 3 loss tokens."""
    masks = [[0, 0, 1, 1], [0, 0, 0], [0, 1, 1, 1, 0]]
    return [
        Sample(torch.arange(len(m)), torch.tensor(m, dtype=torch.bool), torch.zeros(len(m)), 1.0)
        for m in masks
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_every_sequence_is_on_exactly_one_rank(world: int, minibatches: int) -> None:
    batch = random_batch(0, lengths=(7, 12, 5, 16, 9, 3, 20, 4))
    shards = plan_shards(batch, train_config(ppo_minibatches=minibatches), world)
    assert len(shards) == world
    trained = [id(s) for shard in shards for s in shard.samples]
    assert sorted(trained) == sorted(id(s) for s in batch)
    for shard in shards:
        # each rank runs as many micro-batches per minibatch as the others (FSDP lockstep)
        assert [len(m) for m in shard.minibatches] == [len(m) for m in shards[0].minibatches]
        assert len(shard.minibatches) == minibatches
        local = sorted(i for micro in shard.minibatches for mb in micro for i in mb)
        assert local == list(range(len(shard.samples)))
        assert (shard.sequences, shard.tokens) == (8, sum(len(s) for s in batch))


def test_global_numbers_are_the_whole_batch() -> None:
    batch = hand_batch()
    token = plan_shards(batch, train_config(), 2)
    # token-mean: 2 + 0 + 3 loss tokens; norm_len: the longest loss span, 3
    assert [s.units_total for s in token] == [[5], [5]]
    assert {s.norm_len for s in token} == {3.0} and {s.loss_tokens for s in token} == {5}
    seq = plan_shards(batch, train_config(loss=LossConfig(loss_agg="seq-mean-token-mean")), 2)
    assert [s.units_total for s in seq] == [[2], [2]]  # sequences with a loss token
    fixed = plan_shards(batch, train_config(loss=LossConfig(norm_len=512.0)), 1)
    assert fixed[0].norm_len == 512.0


def test_episode_counts_span_ranks_and_stay_within_a_minibatch() -> None:
    """Loss spans 4, 6, 3, 8 (lengths 7, 12, 5, 16); samples 0 and 2 are episode 5, 1 and 3
    episode 9. One minibatch over 2 ranks: every sample carries its episode's 4 + 3 = 7
    or 6 + 8 = 14 tokens wherever it lands, and the minibatch counts 2 episodes (for
    token-mean still 21 tokens). Four minibatches of one sample: an episode's count is
    only its samples' in that minibatch, each minibatch 1 episode."""
    batch = random_batch(0, lengths=(7, 12, 5, 16))
    for s, e in zip(batch, (5, 9, 5, 9), strict=True):
        s.episode = e
    spans = {len(s): s.num_loss_tokens for s in batch}
    assert spans == {7: 4, 12: 6, 5: 3, 16: 8}
    seq_mean = LossConfig(loss_agg="seq-mean-token-mean")
    shards = plan_shards(batch, train_config(loss=seq_mean), 2)
    assert all(shard.samples for shard in shards)
    got = {
        len(s): n
        for shard in shards
        for s, n in zip(shard.samples, shard.episode_tokens, strict=True)
    }
    assert got == {7: 7, 5: 7, 12: 14, 16: 14}
    assert [s.units_total for s in shards] == [[2], [2]]
    assert [s.units_total for s in plan_shards(batch, train_config(), 2)] == [[21], [21]]
    (alone,) = plan_shards(batch, train_config(loss=seq_mean, ppo_minibatches=4), 1)
    assert alone.episode_tokens == [4, 6, 3, 8] and alone.units_total == [1, 1, 1, 1]
    for shard in shards:
        assert TrainShard.from_tensors(*shard.to_tensors()).episode_tokens == shard.episode_tokens


def test_tensor_layout_reads_back_the_same_shard() -> None:
    batch = random_batch(3, lengths=(6, 9, 4, 11), per_token_adv=True)
    batch[1].old_logprobs = torch.randn(9)
    batch[2].ref_logprobs = torch.randn(4)
    batch[3].advantages = torch.tensor(0.25)  # a per-sequence scalar travels per token
    batch[0].sampled_with = SampledWith(temperature=0.1 + 0.2, top_k=7, top_p=1 / 3)
    # image references travel by path, any characters a path may hold; text samples none
    batch[1].images = ("/cache/shapes/0.png", "/data/bilder/größe 2.png")
    batch[3].images = ("/cache/shapes/7.png",)
    config = train_config(ppo_minibatches=2, loss=LossConfig(norm_len=1 / 3))
    for shard in plan_shards(batch, config, 2):
        back = TrainShard.from_tensors(*shard.to_tensors())
        assert back.minibatches == shard.minibatches
        assert back.units_total == shard.units_total
        assert back.norm_len == 1 / 3  # all 64 bits of it
        assert (back.mode, back.fill_proximal, back.fill_ref) == (
            shard.mode,
            shard.fill_proximal,
            shard.fill_ref,
        )
        assert (back.sequences, back.tokens, back.loss_tokens) == (4, 30, shard.loss_tokens)
        for a, b in zip(shard.samples, back.samples, strict=True):
            assert torch.equal(a.input_ids, b.input_ids)
            assert torch.equal(a.loss_mask, b.loss_mask)
            assert torch.equal(a.behav_logprobs, b.behav_logprobs)
            assert torch.equal(a.advantages_per_token(), b.advantages_per_token())
            assert a.sampled_with == b.sampled_with  # every bit of 0.1 + 0.2 and 1 / 3
            assert a.images == b.images
            for name in ("old_logprobs", "ref_logprobs"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None and y is None) or torch.equal(x, y)


def test_an_empty_rank_reads_back_empty() -> None:
    shards = plan_shards(random_batch(0, lengths=(5,)), train_config(), 2)
    idle = next(s for s in shards if not s.samples)
    back = TrainShard.from_tensors(*idle.to_tensors())
    assert back.samples == [] and back.minibatches == [[[]]]
    # a rank whose samples name no image sends no image bytes
    busy = next(s for s in shards if s.samples)
    assert int(busy.to_tensors()[0][9]) == 0


def test_a_batch_the_step_cannot_take_fails_before_any_send() -> None:
    batch = random_batch(0)
    batch[0].old_logprobs = torch.zeros(len(batch[0]))
    no_recompute = train_config(loss=LossConfig(proximal="behaviour"))
    with pytest.raises(ValueError, match="all samples or none"):
        plan_shards(batch, no_recompute, 2)
    with pytest.raises(ValueError, match="exceeds"):
        plan_shards(batch[:1], train_config(ppo_minibatches=2), 2)
    with pytest.raises(ValueError, match="empty"):
        plan_shards([], train_config(), 2)
