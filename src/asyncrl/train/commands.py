"""The trainer ranks' protocol: rank 0 sends each collective command (train, export,
gather, save, load, stop) to the other ranks as tensors, and every rank runs it on its own engine.

A command is a header, ``int64 [command, argument bytes]``, broadcast from rank 0, then its
argument: a path as UTF-8 bytes (broadcast), or for ``train`` each rank's own
:class:`~asyncrl.train.shard.TrainShard`, sent point to point (sizes, then its three
tensors). No rank ever receives another rank's sequences, and nothing is pickled. On NCCL
the tensors travel through the rank's CUDA device; on gloo they stay on the CPU.

Without a process group (one rank) the :class:`Leader` runs the commands alone.
"""

from __future__ import annotations

import enum
import os
import threading
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.api.train_engine import TrainEngineProtocol
from asyncrl.train import dcp
from asyncrl.train.batch import Batch
from asyncrl.train.config import TrainerConfig
from asyncrl.train.shard import TrainShard, plan_shards
from asyncrl.weights.wire import Lane

MASTER_DTYPE = "float32"
"""The dtype of the train engine's master weights (it loads every model in float32), in
which their digest is taken: the bits the optimizer updates, whatever ``model.dtype`` the
rollouts get."""


class Command(enum.IntEnum):
    """What rank 0 asks every rank to do next."""

    TRAIN = 1
    EXPORT = 2
    SAVE = 3
    LOAD = 4
    STOP = 5
    GATHER = 6
    OFFLOAD = 7
    ONLOAD = 8


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _device() -> torch.device:
    """Where collective tensors must live: the rank's CUDA device under NCCL."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` from rank 0 on every rank (same shape and dtype everywhere)."""
    on_device = tensor.to(_device())
    dist.broadcast(on_device, src=0)
    return on_device.cpu()


def _send(tensor: torch.Tensor, rank: int) -> None:
    if tensor.numel():
        dist.send(tensor.to(_device()), dst=rank)


def _recv(numel: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(numel, dtype=dtype, device=_device())
    if numel:
        dist.recv(out, src=0)
    return out.cpu()


class Leader:
    """Rank 0's side: each method sends its command to the other ranks, then runs it on
    ``engine``; the other ranks run :func:`follow`. Methods block until the command is
    done (call them from a worker thread in async code), one command at a time: a call
    from another thread waits for the command in flight (a stop asked for while a step
    runs in its thread must not put its collective between the step's)."""

    def __init__(self, engine: TrainEngineProtocol) -> None:
        self.engine = engine
        self.world_size = _world()
        self._one_at_a_time = threading.Lock()

    def train(self, batch: Batch) -> dict[str, float]:
        """One train step on the global ``batch`` (:func:`lead_train`)."""
        with self._one_at_a_time:
            return self.engine.train_shard(lead_train(batch, self.engine.config, self.world_size))

    def export(self, path: str | os.PathLike[str]) -> None:
        """The weights a rollout engine loads, at ``path`` (rank 0 writes): an HF directory,
        or a LoRA adapter (:meth:`~asyncrl.train.engine.TrainEngine.export_weights`)."""
        with self._one_at_a_time:
            self._path_command(Command.EXPORT, path)
            self.engine.export_weights(path)

    def gather(self, dtype: str) -> list[tuple[str, torch.Tensor]]:
        """The full weights as ``(HF name, CPU tensor)`` in ``dtype`` on rank 0 (LoRA:
        merged into the base weights), for a transport that sends tensors, not files.
        Every rank takes part in the all-gathers; only rank 0 keeps the result. A tensor
        that needs no cast or gather is the live parameter itself: use the result before
        the next step."""
        with self._one_at_a_time:
            self._path_command(Command.GATHER, dtype)
            buckets = self.engine.iter_weights(dtype=dtype, copy=False)
            return [pair for bucket in buckets for pair in bucket]

    def weights_sha256(self) -> str:
        """The SHA-256 of the full weights (:func:`~asyncrl.train.dcp.weights_sha256`), on
        rank 0: what a run's checkpoint records and ``asyncrl replay`` compares. The
        weights in float32, the dtype the engine keeps its master weights in, gathered
        bucket by bucket as :meth:`gather` does (the other ranks run that command) and
        hashed as they come."""
        with self._one_at_a_time:
            self._path_command(Command.GATHER, MASTER_DTYPE)
            buckets = self.engine.iter_weights(dtype=MASTER_DTYPE, copy=False)
            return dcp.weights_sha256(pair for bucket in buckets for pair in bucket)

    def offload(self) -> tuple[int, float]:
        """Every rank moves its parameters and optimizer state to host memory
        (colocation); rank 0's (device bytes freed, seconds)."""
        with self._one_at_a_time:
            if self.world_size > 1:
                self._header(Command.OFFLOAD)
            return self.engine.offload()

    def onload(self) -> tuple[int, float]:
        """Brings back what :meth:`offload` moved; rank 0's (bytes taken, seconds)."""
        with self._one_at_a_time:
            if self.world_size > 1:
                self._header(Command.ONLOAD)
            return self.engine.onload()

    def save(self, path: str | os.PathLike[str], extra_state: dict[str, Any] | None = None) -> None:
        """A resumable checkpoint (model, optimizer, RNG, step, version) at ``path``, with
        ``extra_state`` in its state file (rank 0 writes that file: the other ranks need
        none)."""
        with self._one_at_a_time:
            self._path_command(Command.SAVE, path)
            self.engine.save_checkpoint(path, extra_state)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restores the checkpoint at ``path`` on every rank."""
        with self._one_at_a_time:
            self._path_command(Command.LOAD, path)
            self.engine.load_checkpoint(path)

    def stop(self, within: float | None = None) -> bool:
        """Ends :func:`follow` on the other ranks. ``within``: the seconds they get to take
        it (None: the collective's own timeout). Returns False if they had not all taken it
        by then: a gloo broadcast waits for every receiver, and a rank that is alive but
        no longer following (stopping on a signal of its own) never receives. The command
        is then left to a daemon thread, which cannot hold the process at its exit
        (:func:`~asyncrl.train.torchrun.exit_rank`), and the group is not used again."""
        if self.world_size == 1:
            return True

        def send() -> None:
            with self._one_at_a_time:
                self._header(Command.STOP)

        try:
            Lane("trainer-stop").submit(send).result(timeout=within)  # None: until done
        except TimeoutError:
            return False
        return True

    def _header(self, command: Command, argument_bytes: int = 0) -> None:
        _broadcast(torch.tensor([int(command), argument_bytes], dtype=torch.int64))

    def _path_command(self, command: Command, path: str | os.PathLike[str]) -> None:
        if self.world_size > 1:
            data = os.fsencode(path)
            self._header(command, len(data))
            _broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def lead_train(batch: Batch, config: TrainerConfig, world_size: int) -> TrainShard:
    """Rank 0's side of ``train``: plans the shards of the global ``batch`` (a bad batch
    fails here, before any rank hears of it), sends every other rank its own, and returns
    rank 0's."""
    shards = plan_shards(batch, config, world_size)
    if world_size > 1:
        _broadcast(torch.tensor([int(Command.TRAIN), 0], dtype=torch.int64))
        for rank in range(1, world_size):
            tensors = shards[rank].to_tensors()
            _send(torch.tensor([t.numel() for t in tensors], dtype=torch.int64), rank)
            for t in tensors:
                _send(t, rank)
    return shards[0]


def next_command() -> tuple[Command, TrainShard | str | None]:
    """Ranks > 0: waits for rank 0's next command; returns it with its argument (this
    rank's shard for ``train``, a path for ``export``/``save``/``load``, the dtype for
    ``gather``)."""
    header = _broadcast(torch.zeros(2, dtype=torch.int64))
    command, argument_bytes = Command(int(header[0])), int(header[1])
    if command in (Command.STOP, Command.OFFLOAD, Command.ONLOAD):
        return command, None
    if command is Command.TRAIN:
        sizes = _recv(3, torch.int64).tolist()
        ints = _recv(sizes[0], torch.int64)
        mask = _recv(sizes[1], torch.uint8)
        floats = _recv(sizes[2], torch.float32)
        return command, TrainShard.from_tensors(ints, mask, floats)
    data = _broadcast(torch.zeros(argument_bytes, dtype=torch.uint8))
    return command, os.fsdecode(data.numpy().tobytes())


def follow(engine: TrainEngineProtocol) -> int:
    """Ranks > 0: runs rank 0's commands on ``engine`` until ``stop``; returns 0."""
    while True:
        command, arg = next_command()
        if command is Command.STOP:
            return 0
        if isinstance(arg, TrainShard):
            engine.train_shard(arg)
        elif command is Command.OFFLOAD:
            engine.offload()
        elif command is Command.ONLOAD:
            engine.onload()
        elif arg is None:
            raise RuntimeError(f"rank 0 sent {command.name} without its argument")
        elif command is Command.EXPORT:
            engine.export_weights(arg)
        elif command is Command.GATHER:
            for _ in engine.iter_weights(dtype=arg):
                pass  # rank 0 keeps the weights; this rank only takes part in the gathers
        elif command is Command.SAVE:
            engine.save_checkpoint(arg)
        elif command is Command.LOAD:
            engine.load_checkpoint(arg)


__all__ = ["Command", "Leader", "follow", "lead_train", "next_command"]
