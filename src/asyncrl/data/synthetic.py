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


PRODUCTS_INSTRUCTION = "Use the calculator, then give the final answer in \\boxed{}."

EXAMPLE_QUESTION = "What is 123 * 4567?"
EXAMPLE_CALL = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 4567"}}\n</tool_call>'
)
EXAMPLE_RESULT = "561741"
EXAMPLE_ANSWER = "The answer is \\boxed{561741}."


def worked_example(instruction: str) -> list[dict[str, str]]:
    """One solved exchange in chat form: the question, the calculator call, the tool's
    result (in the ``tool`` role) and the boxed answer. A 135M model copies a format it
    has seen in the chat far more reliably than one described in a system prompt."""
    question = f"{EXAMPLE_QUESTION}\n{instruction}" if instruction else EXAMPLE_QUESTION
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": EXAMPLE_CALL},
        {"role": "tool", "content": EXAMPLE_RESULT},
        {"role": "assistant", "content": EXAMPLE_ANSWER},
    ]


def products_records(
    size: int,
    seed: int = 0,
    digits: tuple[int, int] = (3, 4),
    instruction: str = PRODUCTS_INSTRUCTION,
    example: bool = False,
) -> list[Record]:
    """``size`` prompt records ``What is a * b?`` where ``a`` has ``digits[0]`` digits and
    ``b`` has ``digits[1]`` (no leading zeros): products a 135M model cannot work out in
    its head but can with a calculator. ``answer`` is the exact product. Deterministic in
    ``seed``.

    With ``example``, each record carries ``messages``: :func:`worked_example` followed
    by the question (the chat template must render the ``tool`` role); ``prompt`` stays
    the question alone."""
    if len(digits) != 2 or min(digits) < 1:
        raise ValueError(f"digits {digits!r}: two numbers of digits, each >= 1")
    rng = random.Random(f"products/{seed}")
    shown = worked_example(instruction) if example else []
    records: list[Record] = []
    for _ in range(size):
        a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for d in digits)
        question = f"What is {a} * {b}?"
        prompt = f"{question}\n{instruction}" if instruction else question
        record: Record = {"question": question, "prompt": prompt, "answer": str(a * b)}
        if example:
            record["messages"] = [*shown, {"role": "user", "content": prompt}]
        records.append(record)
    return records
