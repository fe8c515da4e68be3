"""Math answer grading with the rules of OpenRLHF's reward helpers (`openrlhf.utils.extract_boxed_answer`
and `grade_answer`), so reward files written for OpenRLHF (ProRL v2's math_reward_func.py) score the
same here. services/common/openrlhf_compat.py serves these functions under OpenRLHF's module names.

    extract_boxed_answer(text)  the content of the last \\boxed{...} (balanced braces), else None
    grade_answer(given, truth)  True when the two agree after either of two normalisations:
      - the MATH data set's string normalisation (grade_answer_mathd): units, \\left / \\right,
        degrees, dollars and percents removed, fractions and square roots written out in full
        (\\frac12 -> \\frac{1}{2}, 0.5 -> \\frac{1}{2}, 3/4 -> \\frac{3}{4}), "x = 5" -> 5;
      - a symbolic comparison (grade_answer_sympy): both answers reduced to plain text (LaTeX read
        by pylatexenc, units and thousands separators dropped, mixed numbers "1 1/2" -> 1+1/2),
        compared element by element for tuples and intervals (same brackets), and equal when sympy
        simplifies their difference to 0 (within `timeout` seconds where a signal can bound it).

These are pure string and sympy functions: no I/O. sympy and pylatexenc are imported when a
symbolic comparison first needs them.
"""

from __future__ import annotations

import re
import signal
import threading

# ----------------------------------------------------------------------------------------------
# The last \boxed{...}


def last_boxed_only_string(text: str) -> str | None:
    """`\\boxed{...}` (or `\\fbox{...}`) as it stands last in `text`, braces balanced; None if none closes."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[start:end + 1]
    return None


def remove_boxed(boxed: str) -> str | None:
    """The content of a `\\boxed{...}` string; None when it is not one (an \\fbox included)."""
    prefix = "\\boxed{"
    if boxed.startswith(prefix) and boxed.endswith("}"):
        return boxed[len(prefix):-1]
    return None


def extract_boxed_answer(solution: str) -> str | None:
    """The answer inside the last \\boxed{} of a solution, or None."""
    boxed = last_boxed_only_string(solution)
    return remove_boxed(boxed) if boxed is not None else None


# ----------------------------------------------------------------------------------------------
# The MATH data set's normalisation (string rules)

_MATHD_REMOVALS = (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                   ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""))
_TEXT_ONLY = re.compile(r"^\\text\{(?P<text>.+?)\}$")


def _braced_sqrt(text: str) -> str:
    """\\sqrt2 -> \\sqrt{2} (an argument of one character gets its braces)."""
    head, *parts = text.split("\\sqrt")
    out = [head]
    for part in parts:
        out.append("\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:]))
    return "".join(out)


def _braced_fracs(text: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}; a \\frac with fewer than two characters after
    it leaves the text as it was."""
    head, *parts = text.split("\\frac")
    out = [head]
    for part in parts:
        if part[0] == "{":
            out.append("\\frac" + part)
            continue
        if len(part) < 2:
            return text
        numerator, second, rest = part[0], part[1], part[2:]
        out.append("\\frac{" + numerator + "}" + (second + rest if second == "{" else "{" + second + "}" + rest))
    return "".join(out)


def _slash_to_frac(text: str) -> str:
    """3/4 -> \\frac{3}{4} when both sides are plain integers."""
    sides = text.split("/")
    if len(sides) != 2:
        return text
    try:
        numerator, denominator = int(sides[0]), int(sides[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _mathd_strip(text: str) -> str:
    """The MATH normalisation of one answer; raises on shapes it cannot take (the caller keeps the answer)."""
    for old, new in _MATHD_REMOVALS:
        text = text.replace(old, new)
    if "\\text{ " in text:  # "5\\text{ cm}": the unit goes
        before, after = text.split("\\text{ ")  # more than one: ValueError, the answer stays as it is
        text = before
    text = text.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5" -> " 5"
        text = sides[1]
    text = _braced_fracs(_braced_sqrt(text).replace(" ", ""))
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_to_frac(text)


def mathd_normalize_answer(answer: str | None) -> str | None:
    if answer is None:
        return None
    answer = answer.strip()
    try:
        only_text = _TEXT_ONLY.search(answer)
        if only_text is not None:
            answer = only_text.group("text").strip()
        return _mathd_strip(answer)
    except Exception:  # noqa: BLE001 - an answer the rules cannot take is compared as it is
        return answer


def grade_answer_mathd(given_answer: str, ground_truth: str) -> bool:
    return mathd_normalize_answer(ground_truth) == mathd_normalize_answer(given_answer)


# ----------------------------------------------------------------------------------------------
# Plain-text normalisation and the symbolic comparison

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
          "foot", "feet", "inch", "yard")
_WORDS = (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "), ("million", "*10^6"),
          ("billion", "*10^9"), ("trillion", "*10^12"))
_UNICODE = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))
_THOUSANDS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_TOO_HARD = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))  # towers and big powers: not evaluated
_BRACKETS = "()[]"


def _latex_to_text(expr: str) -> str:
    from pylatexenc import latex2text

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for old, new in _UNICODE:
        expr = expr.replace(old, new)
    return expr.strip()


def _is_whole(value: float) -> bool:
    try:
        return abs(value - int(round(value))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _drop_thousands_commas(expr: str) -> str:
    while True:
        changed = _THOUSANDS.sub(r"\1\3\4", expr)
        if changed == expr:
            return expr
        expr = changed


def _whole_number_text(expr: str) -> bool:
    try:
        return _is_whole(float(_drop_thousands_commas(expr)))
    except ValueError:
        return False


def _plain(expr: str | None) -> str | None:
    """An answer as plain lower-case text for the symbolic comparison."""
    if expr is None:
        return None
    only_text = _TEXT_ONLY.search(expr)
    if only_text is not None:
        expr = only_text.group("text")
    for old, new in _WORDS:
        expr = expr.replace(old, new)
    for unit in _UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    try:
        if _is_whole(float(expr)):
            expr = str(int(round(float(expr))))
    except ValueError:
        pass
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        except Exception:  # noqa: BLE001 - LaTeX pylatexenc cannot read stays as it is
            pass
    expr = re.sub(r"- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: 1 1/2 -> 1+1/2
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _whole_number_text(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _worth_evaluating(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    return not any(pattern.search(expr) for pattern in _TOO_HARD)


class _Timeout(Exception):
    pass


def _raise_timeout(signum, frame):
    raise _Timeout()


def are_equal_under_sympy(ground_truth_normalized: str, given_normalized: str, timeout: int = 120) -> bool:
    """Whether sympy simplifies the difference of the two plain-text answers to 0. SIGALRM bounds the
    simplification in a main thread (a reward worker's); elsewhere it runs unbounded."""
    expr = f"({ground_truth_normalized})-({given_normalized})"
    if not _worth_evaluating(expr):
        return False
    try:
        import sympy
        from sympy.parsing import sympy_parser

        difference = sympy_parser.parse_expr(expr.replace("^", "**"), transformations=(
            sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)))
        bounded = threading.current_thread() is threading.main_thread()
        if bounded:
            previous = signal.signal(signal.SIGALRM, _raise_timeout)
            signal.alarm(timeout)
        try:
            return sympy.simplify(difference) == 0
        except _Timeout:
            return False
        finally:
            if bounded:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)
    except Exception:  # noqa: BLE001 - what sympy cannot parse or simplify is not equal
        return False


def split_tuple(expr: str) -> list[str]:
    """(1,2) / [1,2] -> their elements (one level of brackets only); anything else -> [expr]."""
    expr = _drop_thousands_commas(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if len(expr) > 2 and expr[0] in _BRACKETS and expr[-1] in _BRACKETS and not any(c in inner for c in _BRACKETS):
        return [element.strip() for element in inner.split(",")]
    return [expr]


def _elements_equal(truth: str, given: str) -> bool:
    if _FRACTION.search(truth) and _FRACTION.search(given):
        return truth == given  # fractions must be written alike (2/4 is not 1/2)
    if _whole_number_text(truth) != _whole_number_text(given):
        return False
    return are_equal_under_sympy(truth, given)


def grade_answer_sympy(given_answer: str, ground_truth: str) -> bool:
    truth, given = _plain(ground_truth), _plain(given_answer)
    if truth is None:
        return False
    if truth == given:
        return True
    if not given:
        return False
    truth_elements, given_elements = split_tuple(truth), split_tuple(given)
    if len(truth_elements) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]):
        return False  # a tuple or interval in other brackets
    if len(truth_elements) != len(given_elements):
        return False
    return all(_elements_equal(t, g) for t, g in zip(truth_elements, given_elements))


def grade_answer(given_answer: str | None, ground_truth: str | None) -> bool:
    """Whether the extracted answer matches the ground truth (either normalisation)."""
    if given_answer is None or ground_truth is None:
        return False
    given_answer, ground_truth = str(given_answer), str(ground_truth)
    return grade_answer_mathd(given_answer, ground_truth) or grade_answer_sympy(given_answer, ground_truth)
