"""A reward worker process: ``python -m asyncrl.entry.reward_worker SPEC``.

It loads the reward function once, says ``ready`` (or ``load_error``), then answers one
scoring request at a time until its stdin closes. Messages are length-prefixed pickles on
stdin/stdout; the process's own stdout is pointed at stderr first, so a reward that
prints cannot corrupt the protocol.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
import traceback
from typing import IO, Any

from asyncrl.rewards.pool import HEADER
from asyncrl.workflows.loader import load_callable


def write_message(stream: IO[bytes], message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    """The next message, or None at end of input."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    return pickle.loads(stream.read(size))


def describe(exc: BaseException) -> str:
    """``Type: message at file:line`` of where the reward raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def serve(spec: str, requests: IO[bytes], replies: IO[bytes]) -> None:
    try:
        fn = load_callable(spec)
    except BaseException as exc:
        write_message(replies, ("load_error", describe(exc)))
        return
    write_message(replies, ("ready", None))
    while (request := read_message(requests)) is not None:
        completion, data = request
        try:
            value = fn(completion, data)
            if asyncio.iscoroutine(value):
                value = asyncio.run(value)
        except Exception as exc:
            write_message(replies, ("error", describe(exc)))
            continue
        try:
            write_message(replies, ("ok", value))
        except Exception:  # unpicklable: nothing was written; the pool calls it a bad value
            write_message(replies, ("ok", f"<unpicklable {type(value).__name__}>"))


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        serve(sys.argv[1], sys.stdin.buffer, replies)
    except BrokenPipeError:
        # the pool closed its end (its actor stopping while this worker started or
        # scored): nobody is left to answer, and a traceback would only say so
        os._exit(0)


if __name__ == "__main__":
    main()
