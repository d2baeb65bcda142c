"""The CI recipe's reward, and an example of a reward in a user's own file.

A tiny random model cannot do arithmetic, but it can learn, in a few dozen steps, to
start its answer with a digit: enough to prove that every part of the loop works and
that reward rises."""

from typing import Any


def starts_with_digit(completion: str, data: dict[str, Any]) -> float:
    text = completion.lstrip()
    return 1.0 if text[:1].isdigit() else 0.0
