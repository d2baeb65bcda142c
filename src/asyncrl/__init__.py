"""asyncrl: asynchronous reinforcement learning of language models on an actor runtime."""

__version__ = "0.1.0"
