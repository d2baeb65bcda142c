"""An OpenAI-compatible endpoint backed by an inference engine, recording the engine's
tokens of every call of an episode, and the workflow that trains agent code through it."""

from asyncrl.endpoint.recording import Call, EpisodeRecorder, EpisodeSample, episode_samples
from asyncrl.endpoint.server import OpenAIEndpoint
from asyncrl.endpoint.workflow import OpenAIAgentWorkflow, load_agent

__all__ = [
    "Call",
    "EpisodeRecorder",
    "EpisodeSample",
    "OpenAIAgentWorkflow",
    "OpenAIEndpoint",
    "episode_samples",
    "load_agent",
]
