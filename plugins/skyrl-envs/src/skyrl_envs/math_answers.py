"""Final-answer extraction and equivalence for math word problems (GSM8K, MATH).

Extraction: ``#### 72`` (GSM8K's format), the last ``\\boxed{...}`` (balanced braces, MATH's
format), or the last number in the text. Equivalence (``answers_match``) first compares
normalised strings and exact numbers (``1,000`` = ``1000.0``, ``3/4`` = ``0.75``), then asks
math-verify (when installed) or, failing that, sympy whether two expressions are equal
(``\\frac{1}{2}`` = ``0.5``, ``2\\sqrt{2}`` = ``\\sqrt{8}``).
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

_HASH = re.compile(r"####\s*(.+)")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_MAX_SYMBOLIC_CHARS = 200  # longer strings are only compared textually (sympy can take forever)
# A power is compared symbolically only with a small literal exponent: 9^{9^{9}} would not finish.
_POWER = re.compile(r"(\^|\*\*)\s*(?:\{\s*\d{1,2}\s*\}|\(\s*\d{1,2}\s*\)|\d{1,2}(?![\d.]))")
_SYMPY_NAMES = {"sqrt", "pi", "e", "i"}


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces kept), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    if text[start:brace].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for index in range(brace, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:index].strip()
    return None


def hash_answer(text: str) -> str | None:
    """The text after the last ``####`` (to the end of its line), or None."""
    matches = _HASH.findall(text)
    return matches[-1].strip() if matches else None


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (integers, decimals, ``a/b``, thousands commas), or None."""
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str, formats: tuple[str, ...]) -> str | None:
    """The first answer found by the extractors named in ``formats``, in that order.

    Extractors: ``"hash"`` (``#### x``), ``"boxed"`` (``\\boxed{x}``), ``"last_number"``.
    """
    extractors = {"hash": hash_answer, "boxed": last_boxed, "last_number": last_number}
    for name in formats:
        found = extractors[name](text)
        if found:
            return found
    return None


def gold_answer(ground_truth: object) -> str:
    """The reference answer from a ground truth: a bare answer or a worked solution."""
    text = str(ground_truth).strip()
    return hash_answer(text) or last_boxed(text) or text


def normalize(answer: str) -> str:
    """Drop what does not change the value: ``$``, ``\\$``, units text, spacing, ``\\text{}``, trailing dot."""
    text = answer.strip()
    text = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\(?:left|right|!|,|;|:)", "", text)
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\s+", "", text).rstrip(".").lower()
    return text


def as_number(answer: str) -> Fraction | None:
    """``answer`` as an exact number when it is one (``1,000``, ``-2.5``, ``3/4``, ``\\frac{3}{4}``)."""
    text = normalize(answer).replace(",", "")
    match = re.fullmatch(r"\\frac\{(-?\d+)\}\{(-?\d+)\}", text)
    if match:
        text = f"{match.group(1)}/{match.group(2)}"
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, gold: str, *, checker: str = "auto") -> bool:
    """Whether ``predicted`` equals ``gold`` mathematically.

    ``checker``: ``"auto"`` (math-verify when importable, else sympy), ``"math_verify"``, or
    ``"sympy"``. A missing prediction never matches.
    """
    if predicted is None or not predicted.strip():
        return False
    if normalize(predicted) == normalize(gold):
        return True
    predicted_number, gold_number = as_number(predicted), as_number(gold)
    if predicted_number is not None and gold_number is not None:
        return predicted_number == gold_number
    if not (_safe_for_symbolic(predicted) and _safe_for_symbolic(gold)):
        return False
    if checker == "auto":
        checker = "math_verify" if _math_verify_available() else "sympy"
    if checker == "math_verify":
        return _math_verify_equal(predicted, gold)
    if checker == "sympy":
        return _sympy_equal(predicted, gold)
    raise ValueError(f"unknown answer checker {checker!r}; allowed: auto, math_verify, sympy")


def _safe_for_symbolic(answer: str) -> bool:
    """Short, no huge numbers, no factorials, no powers with non-literal or large exponents."""
    if len(answer) > _MAX_SYMBOLIC_CHARS or "!" in answer or re.search(r"\d{16}", answer):
        return False
    return "^" not in _POWER.sub("", answer) and "**" not in _POWER.sub("", answer)


def _math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def _math_verify_equal(predicted: str, gold: str) -> bool:
    from math_verify import parse, verify

    # math-verify's time limits use SIGALRM, which exists only in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
        predicted_parsed = parse(f"${predicted}$", parsing_timeout=timeout)
        return bool(gold_parsed and predicted_parsed and verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))
    except Exception:  # an unparsable answer is a wrong answer
        return False


def _latex_to_sympy_text(answer: str) -> str:
    text = normalize(answer).replace(",", "")
    for _ in range(3):  # nested fractions and roots
        text = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", text)
        text = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", text)
    text = re.sub(r"\\sqrt(\d+)", r"sqrt(\1)", text)
    text = text.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("^", "**")
    text = text.replace("{", "(").replace("}", ")")
    return text


def _sympy_readable(text: str) -> bool:
    """Only arithmetic, parentheses and known names: ``parse_expr`` evaluates Python code."""
    if not re.fullmatch(r"[0-9a-z+\-*/(). ]*", text):
        return False
    return all(len(name) == 1 or name in _SYMPY_NAMES for name in re.findall(r"[a-z]+", text))


def _sympy_equal(predicted: str, gold: str) -> bool:
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

    transformations = standard_transformations + (implicit_multiplication_application,)
    texts = (_latex_to_sympy_text(predicted), _latex_to_sympy_text(gold))
    if not all(_sympy_readable(text) for text in texts):
        return False
    try:
        left, right = (parse_expr(text, transformations=transformations, evaluate=True) for text in texts)
        return bool(sympy.simplify(left - right) == 0)
    except Exception:  # anything sympy cannot read is not equal
        return False
