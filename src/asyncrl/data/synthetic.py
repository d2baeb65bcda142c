"""An offline arithmetic task for the quickstart: ``What is 7 + 12?`` → ``19``.

Small enough that a 135M model gets some right from the start (a GRPO signal exists),
and checkable by the math reward. Deterministic in ``seed``.
"""

from __future__ import annotations

import operator
import random

from asyncrl.data.gsm8k import BOXED_INSTRUCTION
from asyncrl.data.loaders import Record

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
"""The operators a task may draw; division is left out so every answer is an integer."""


def arithmetic_records(
    size: int,
    seed: int = 0,
    max_operand: int = 20,
    ops: str = "+-",
    operands: int = 2,
    instruction: str = BOXED_INSTRUCTION,
) -> list[Record]:
    """``size`` prompt records ``a op b [op c ...]`` with operands in ``[0, max_operand]``,
    evaluated left to right (no precedence: each question shows the order in brackets)."""
    unknown = set(ops) - set(OPERATORS)
    if unknown or not ops:
        raise ValueError(f"ops {ops!r}: each must be one of {''.join(OPERATORS)}")
    if operands < 2:
        raise ValueError("operands must be >= 2")
    rng = random.Random(seed)
    records: list[Record] = []
    for _ in range(size):
        value = rng.randint(0, max_operand)
        expr = str(value)
        for k in range(operands - 1):
            op = rng.choice(ops)
            b = rng.randint(0, max_operand)
            value = OPERATORS[op](value, b)
            expr = f"({expr} {op} {b})" if k < operands - 2 else f"{expr} {op} {b}"
        question = f"What is {expr}?"
        records.append(
            {"question": question, "prompt": f"{question}\n{instruction}", "answer": str(value)}
        )
    return records
