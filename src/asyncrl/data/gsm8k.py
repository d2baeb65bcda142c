"""GSM8K: prompt formatting and the reference answer (the number after ``####``)."""

from __future__ import annotations

from asyncrl.data.loaders import Record, to_prompt_records

BOXED_INSTRUCTION = "Solve the problem step by step, then put the final answer in \\boxed{}."
"""The instruction appended to each question: the final answer in ``\\boxed{}``, as the
``math`` reward reads it (the default of ``data.instruction``)."""


def gsm8k_final_answer(solution: str) -> str:
    """The number after the last ``####`` of a GSM8K solution, without thousands commas."""
    marker = solution.rfind("####")
    if marker < 0:
        raise ValueError(f"not a GSM8K solution (no '####'): {solution[-80:]!r}")
    return solution[marker + 4 :].strip().replace(",", "")


def gsm8k_records(rows: list[Record], instruction: str = BOXED_INSTRUCTION) -> list[Record]:
    """GSM8K rows (``question``, ``answer``) as prompt records: ``prompt`` is the question
    plus ``instruction``, ``answer`` the final number, ``solution`` the worked solution."""
    with_solution = [{**row, "solution": row["answer"]} for row in rows]
    return to_prompt_records(
        with_solution, "question", "answer", instruction=instruction, transform=gsm8k_final_answer
    )
