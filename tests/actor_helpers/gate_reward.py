"""A reward function for reward-actor tests, loaded by the reward workers from this file.

``data["behaviour"]`` picks what it does:

- ``gate`` (default): connects to the Unix socket ``data["gate"]``, sends the completion
  and blocks until the test's gate answers; the gate answers only once ``n`` calls are
  waiting at the same time, so the call proves that ``n`` trajectories were being scored
  at once. Scores 1.0; if the gate never opens within ``data["wait_s"]`` it raises.
- ``raise``, ``nan``, ``inf``, ``text``, ``hang``: a reward that fails in each way the
  actor must survive.
- ``one``: scores 1.0 at once.
"""

from __future__ import annotations

import socket
import time
from typing import Any


def gate_reward(completion: str, data: dict[str, Any]) -> float:
    behaviour = data.get("behaviour", "gate")
    if behaviour == "raise":
        raise ValueError(f"cannot score {completion!r}")
    if behaviour == "nan":
        return float("nan")
    if behaviour == "inf":
        return float("-inf")
    if behaviour == "text":
        return "1.0"  # type: ignore[return-value]  # a number's text is still not a number
    if behaviour == "one":
        return 1.0
    if behaviour == "hang":
        time.sleep(3600)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(float(data["wait_s"]))
        conn.connect(data["gate"])
        conn.sendall(completion.encode() + b"\n")
        reply = conn.recv(1)
    if reply != b"1":
        raise RuntimeError(f"the gate closed without opening: {reply!r}")
    return 1.0
