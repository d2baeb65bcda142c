"""The buffer: the one place that knows the policy version and counts episodes.

- :mod:`.leases`: which prompts are out, with whom, and how they come back;
- :mod:`.admission`: scored samples become groups, judged for sense and staleness;
- :mod:`.batching`: the trainer's batches;
- :mod:`.actor`: the :class:`BufferActor` that wires them to NATS.

The capacity and staleness arithmetic is :mod:`asyncrl.runtime.staleness`.
"""

from asyncrl.actors.buffer.actor import BufferActor

__all__ = ["BufferActor"]
