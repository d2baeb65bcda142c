"""The built-in tools: ``calculator`` (arithmetic, evaluated safely) and ``python`` (code
run in a sandbox). :data:`BUILTIN_TOOLS` builds them by the name a recipe gives."""

from __future__ import annotations

import ast
import math
import operator
import signal
from collections.abc import Callable
from typing import Any

from asyncrl.tools.base import BadArguments, Tool, ToolError, function_tool
from asyncrl.tools.sandbox import Limits, probe, run_python

MAX_EXPONENT = 4096
MAX_INT_BITS = 4096
"""Bounds on the calculator's integers: ``9**9**9`` would take minutes and gigabytes."""
MAX_EXPRESSION_CHARS = 1000

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **``, unary signs
    and parentheses, nothing else (no names, calls or attributes). Raises ``ValueError``
    for anything outside that or beyond the bounds, ``ZeroDivisionError`` as Python does."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value  # type: ignore[return-value]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):
            raise ValueError("the result is not a real number")
        if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
            raise ValueError("the result is too large")
        return result  # type: ignore[no-any-return]
    raise ValueError(f"{type(node).__name__} is not allowed: only numbers and + - * / // % **")


def _check_power(base: float, exponent: float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"the exponent is larger than {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if exponent * math.log2(abs(base)) > MAX_INT_BITS:
            raise ValueError("the result is too large")


def _format(value: int | float) -> str:
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression and returns its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 3) * 4".
    """
    try:
        return _format(evaluate(expression))
    except ValueError as exc:
        raise BadArguments(str(exc)) from None
    except (ZeroDivisionError, OverflowError) as exc:
        raise ToolError("raised", f"{type(exc).__name__}: {exc}") from None


def calculator_tool(timeout_s: float = 5.0) -> Tool:
    return function_tool(calculator, timeout_s=timeout_s)


def python_tool(limits: Limits | None = None) -> Tool:
    """The ``python`` tool: runs the given code in :mod:`asyncrl.tools.sandbox` and shows
    the model the tail of its output. A non-zero exit is an error with reason
    ``exit_status``, a signal (the CPU or memory limit) ``killed``, the wall clock
    ``timeout``. The description says what this machine contains (separate user,
    network)."""
    limits = limits or Limits()

    async def python(code: str) -> str:
        result = await run_python(code, limits)
        output = result.output.rstrip() or "(no output)"
        if result.timed_out:
            raise ToolError("timeout", f"{output}\n[killed: ran past {limits.wall_s:g} s]")
        if result.signal is not None:
            name = signal.Signals(result.signal).name
            why = " (CPU time limit)" if result.signal == signal.SIGXCPU else ""
            raise ToolError("killed", f"{output}\n[killed by {name}{why}]")
        if result.exit_status:
            raise ToolError("exit_status", f"{output}\n[exit status {result.exit_status}]")
        return output

    python.__doc__ = f"""Runs a Python program and returns what it prints (stdout and stderr).
    It runs {probe().describe()}, limited to {limits.cpu_s} s of CPU,
    {limits.memory_mb} MB of memory and {limits.wall_s:g} s in all; print what you need.

    Args:
        code: the complete program; use print() to show results.
    """
    # The tool's own timeout is a backstop: the sandbox's wall clock ends the run first,
    # with the output so far.
    return function_tool(python, timeout_s=limits.wall_s + 10.0)


BUILTIN_TOOLS: dict[str, Callable[[], Tool]] = {
    "calculator": calculator_tool,
    "python": python_tool,
}
"""Built-in tools by the name a recipe lists them under."""
