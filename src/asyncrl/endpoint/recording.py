"""What the endpoint records of an episode's calls, and how the calls become samples.

An episode is the stretch of agent code run for one prompt; every call it makes through
its episode URL is a :class:`Call` holding the exact token ids the engine saw and made,
and the sampling it was served with. :func:`episode_samples` turns the calls into
training sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.api.inference import GenerateResponse, SamplingParams
from asyncrl.wire.messages import SampledWith
from asyncrl.workflows.base import TokenTrace

Drawn = tuple[float, int, float]
"""``(temperature, top_k, top_p)``: the settings that make a call's distribution."""


@dataclass
class Call:
    """One completion request of an episode, as the engine served it.

    ``messages``/``tools`` are the normalized chat request (None for ``/v1/completions``),
    ``reply`` the assistant message returned (normalized), ``continued_from`` the index of
    the call whose tokens this prompt extends (None: rendered fresh). ``handling_s`` is the
    request's time in the endpoint, ``engine_s`` the part spent in the engine.
    ``temperature``, ``top_k`` and ``top_p`` are the sampling the engine served it with
    (the endpoint's, or the call's own in ``per_call`` mode); 0 is greedy."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    reply: dict[str, Any] | None = None
    continued_from: int | None = None
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    handling_s: float = 0.0
    engine_s: float = 0.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def drawn(self) -> Drawn:
        return (self.temperature, self.top_k, self.top_p)

    @property
    def added_latency_s(self) -> float:
        """What the endpoint added to the engine's time: parsing, templating, encoding."""
        return max(self.handling_s - self.engine_s, 0.0)

    @property
    def response(self) -> GenerateResponse:
        return GenerateResponse(
            input_ids=self.prompt_ids,
            output_ids=self.completion_ids,
            output_logprobs=self.logprobs,
            output_versions=self.versions,
            finish_reason="stop" if self.finish_reason == "stop" else "length",
        )


@dataclass
class EpisodeRecorder:
    """The calls of one episode, in the order their generations finished.

    ``base_url`` is what an OpenAI client of this episode is given; ``aborted`` is set
    when the engine stopped during one of its calls (the episode is then incomplete)."""

    episode_id: str
    base_url: str
    calls: list[Call] = field(default_factory=list)
    aborted: bool = False

    def add(self, call: Call) -> None:
        self.calls.append(call)

    def metrics(self) -> dict[str, float]:
        """Per-episode counts for ``reward_info``: calls, tool calls, malformed tool calls,
        continued prompts, and the endpoint's added latency per call (mean and max)."""
        added = [c.added_latency_s for c in self.calls]
        return {
            "calls": len(self.calls),
            "tool_calls": sum(c.tool_calls for c in self.calls),
            "malformed_tool_calls": sum(c.malformed_tool_calls for c in self.calls),
            "continued_calls": sum(c.continued_from is not None for c in self.calls),
            "endpoint_added_latency_s_mean": sum(added) / len(added) if added else 0.0,
            "endpoint_added_latency_s_max": max(added, default=0.0),
        }


@dataclass
class EpisodeSample:
    """One training sequence of an episode: ``calls`` are the indices it covers;
    ``calls_to_go`` is how many of the episode's calls came after its last one (0 for the
    sample that holds the final call). ``sampled_with`` is the sampling its generated
    tokens were drawn with where its calls chose their own; None where that is the
    endpoint's (or it has no generated token)."""

    trace: TokenTrace
    reward: float
    calls: list[int]
    finish_reason: str
    calls_to_go: int = 0
    sampled_with: SampledWith | None = None


def _extends(ids: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(ids) >= len(prefix) and list(ids[: len(prefix)]) == list(prefix)


def episode_samples(
    calls: Sequence[Call], reward: float, default: SamplingParams | None = None
) -> list[EpisodeSample]:
    """The episode's calls as token sequences, each with its reward.

    Calls are taken in order. A call whose prompt ids start with the previous call's
    prompt + completion ids joins that call's sample: the new prompt tokens are context
    (mask 0, logprob 0, version -1), its completion tokens are generated (mask 1, with the
    engine's logprobs and versions). Any other call starts a new sample. The check is on
    token ids, so it holds whatever way the prompt was built.

    Sampling (``default`` is the endpoint's; None: :class:`SamplingParams`'s defaults): a
    call served with its own sampling (``per_call`` mode) is either greedy (temperature 0),
    and then never trained: its completion tokens join the sample as context, like
    environment text, since a greedy token is no sample of the policy that an importance
    weight could correct; or it sampled, and a sample's generated tokens must all come
    from one distribution, the one the trainer scores them with: a continuing call whose
    ``(temperature, top_k, top_p)`` differs from that of the sample's generated tokens
    starts a new sample instead of joining (its whole prompt is that sample's context). A sample's ``sampled_with`` is its
    calls' sampling, or None where it is ``default``'s, so that calls that send no sampling
    give the very samples they did before there was a choice. A call served with
    ``default`` is generated even when greedy (an eval's greedy endpoint).

    Every sample gets the episode's ``reward`` undiscounted, and ``calls_to_go = n − 1 − e``
    (``n`` calls, ``e`` the index of the sample's last call): the trainer discounts the
    episode's advantage by ``γ^calls_to_go``, never the reward, which would make the
    advantages depend on a constant shift of the reward
    (:func:`~asyncrl.algo.advantages.episode_advantages`).
    """
    d = default or SamplingParams()
    own: Drawn = (d.temperature, d.top_k, d.top_p)
    samples: list[EpisodeSample] = []
    drawn: list[Drawn | None] = []  # per sample, the sampling of its generated tokens
    previous: list[int] = []
    for index, call in enumerate(calls):
        greedy = call.temperature == 0 and call.drawn != own
        if (
            samples
            and _extends(call.prompt_ids, previous)
            and (greedy or drawn[-1] in (None, call.drawn))
        ):
            sample = samples[-1]
            sample.trace.add_context(call.prompt_ids[len(previous) :])
            sample.calls.append(index)
        else:
            sample = EpisodeSample(TokenTrace(), reward, [index], call.finish_reason)
            sample.trace.add_context(call.prompt_ids)
            samples.append(sample)
            drawn.append(None)
        if greedy:
            sample.trace.add_context(call.completion_ids)
        else:
            sample.trace.add_generated(call.response)
            drawn[-1] = call.drawn
        sample.finish_reason = call.finish_reason
        previous = call.prompt_ids + call.completion_ids
    last = len(calls) - 1
    for sample, chosen in zip(samples, drawn, strict=True):
        sample.calls_to_go = last - sample.calls[-1]
        if chosen is not None and chosen != own:
            temperature, top_k, top_p = chosen
            sample.sampled_with = SampledWith(temperature=temperature, top_k=top_k, top_p=top_p)
    return samples
