"""Final-answer extraction from model text and exact comparison of numeric answers.

Order of preference for the answer in a text: the last ``\\boxed{...}`` (or ``\\fbox``),
else the text after the last ``####`` (GSM8K's marker), else the last number. Numbers are
compared exactly as fractions, so ``72``, ``72.0``, ``$72``, ``1,000``/``1000``,
``0.5``/``1/2``/``\\frac{1}{2}`` compare as one expects; anything else (expressions, sets,
intervals) is left to math-verify.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_HASH = re.compile(r"####\s*(.+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")
_UNITS = re.compile(r"(?<=\d)\s*[A-Za-z%°]+\.?$")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced; None if there is none."""
    start = max(text.rfind(opener) for opener in _BOX_OPENERS)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced: a truncated generation


def extract_answer(text: str) -> str | None:
    """The final answer in ``text`` as a string (see the module docstring), or None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    marks = _HASH.findall(text)
    if marks:
        return marks[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def to_number(answer: str) -> Fraction | None:
    """``answer`` as an exact fraction if it is plainly one number, else None.

    Accepts signs, thousands separators, decimals, ``a/b``, ``\\frac{a}{b}``, a leading
    currency sign, a trailing unit word or percent sign, and a trailing full stop.
    """
    s = _TEXT.sub(r"\1", answer).strip()
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "%").replace("\\!", "")
    s = s.replace("\\,", "").replace("{,}", ",").strip().rstrip(".").strip()
    frac = _FRAC.match(s)
    if frac:
        sign, num, den = frac.groups()
        s = f"{sign}{num.strip()}/{den.strip()}"
    s = _UNITS.sub("", s).strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)(\s*/\s*-?\d+(\.\d*)?)?", s):
        return None
    try:
        if "/" in s:
            num, den = (part.strip() for part in s.split("/"))
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
