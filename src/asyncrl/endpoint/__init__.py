"""An OpenAI-compatible endpoint backed by an inference engine, recording the engine's
tokens of every call of an episode, and the workflows that train agent code and
``verifiers`` environments through it."""

from asyncrl.endpoint.recording import Call, EpisodeRecorder, EpisodeSample, episode_samples
from asyncrl.endpoint.server import OpenAIEndpoint
from asyncrl.endpoint.verifiers_env import (
    VerifiersWorkflow,
    load_verifiers_env,
    verifiers_records,
    verifiers_workflow,
)
from asyncrl.endpoint.workflow import OpenAIAgentWorkflow, load_agent

__all__ = [
    "Call",
    "EpisodeRecorder",
    "EpisodeSample",
    "OpenAIAgentWorkflow",
    "OpenAIEndpoint",
    "VerifiersWorkflow",
    "episode_samples",
    "load_agent",
    "load_verifiers_env",
    "verifiers_records",
    "verifiers_workflow",
]
