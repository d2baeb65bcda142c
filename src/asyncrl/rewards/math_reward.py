"""The math reward (GSM8K, MATH-style ``\\boxed{}`` answers), verified with math-verify.

    reward(completion, data) = 1  if answer(completion) ≡ answer(data["answer"])  else 0

``answer`` is :func:`asyncrl.rewards.extract.extract_answer` for ``math`` (a boxed answer,
else a ``####`` one, else the last number), and the last ``\\boxed{}`` only for
``math_boxed``, where an answer outside the format scores 0 however right it is. Two plain numbers are
compared exactly (as fractions); anything else goes to math-verify's symbolic check.
math-verify guards itself with ``signal.alarm``, which only works in a main thread: it
is meant to run in :class:`asyncrl.rewards.pool.RewardPool` worker processes, which add
their own hard timeout on top. Called from another thread, it runs without its alarms.
"""

from __future__ import annotations

import threading
from typing import Any

from asyncrl.rewards.extract import extract_answer, last_boxed, to_number

ANSWER_KEYS = ("answer", "solution", "ground_truth")
"""Where the reference answer may sit in a prompt record, in order of preference."""


def reference_answer(data: dict[str, Any]) -> str:
    """The reference answer of a prompt record (extracted from a worked solution)."""
    for key in ANSWER_KEYS:
        if key in data and data[key] is not None:
            text = str(data[key]).strip()
            # A boxed or '####' answer is cut out of a worked solution; any other text is
            # the answer itself (the last number of '\frac{1}{\sqrt{2}}' is not its value).
            if last_boxed(text) is not None or "####" in text:
                return extract_answer(text) or text
            return text
    raise KeyError(f"the prompt record has none of {ANSWER_KEYS}: keys {sorted(data)}")


def answers_match(reference: str, predicted: str) -> bool:
    """Exact numeric equality when both are numbers, else math-verify equivalence."""
    ref_num, pred_num = to_number(reference), to_number(predicted)
    if ref_num is not None and pred_num is not None:
        return ref_num == pred_num
    from math_verify import parse, verify  # noqa: PLC0415 - loads sympy (seconds): only a reward worker scoring needs it

    in_main = threading.current_thread() is threading.main_thread()
    limit = 5 if in_main else None  # signal.alarm exists only in the main thread
    gold = parse(f"${reference}$", parsing_timeout=limit)  # type: ignore[arg-type]
    pred = parse(f"${predicted}$", parsing_timeout=limit)  # type: ignore[arg-type]
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=limit))


def math_reward(completion: str, data: dict[str, Any]) -> float:
    """1.0 if the completion's final answer equals the record's reference answer, else 0.0."""
    reference = reference_answer(data)
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(reference, predicted) else 0.0


def boxed_math_reward(completion: str, data: dict[str, Any]) -> float:
    """1.0 if the completion's last ``\\boxed{}`` holds the reference answer, else 0.0: the
    format the prompt asks for is part of the task (no fallback to the last number)."""
    predicted = last_boxed(completion)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(reference_answer(data), predicted) else 0.0
