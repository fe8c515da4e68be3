"""OpenRLHF's answer grading (openrlhf.utils.extract_boxed_answer / grade_answer), as rlmesh provides
it to reward files: each value below is what OpenRLHF 0.11's own functions return for the input."""

import pytest

from services.common.math_grading import extract_boxed_answer, grade_answer, mathd_normalize_answer

# (given answer, ground truth) -> OpenRLHF 0.11's grade_answer
GRADES = [
    ("\\frac{1}{2}", "0.5", True), ("0.5", "\\frac{1}{2}", True), ("1/2", "\\frac12", True),
    ("\\dfrac{3}{4}", "3/4", True), ("2", "2.0", True), ("1,000", "1000", True), ("\\text{(B)}", "B", True),
    ("5\\%", "5", True), ("\\$5", "5", True), ("x=3", "3", True), ("3", "x = 3", True), ("10^{\\circ}", "10", True),
    ("\\sqrt{2}", "\\sqrt2", True), ("2\\sqrt{2}", "\\sqrt{8}", True), ("(1,2)", "(1, 2)", True),
    ("[1,2]", "(1,2)", False), ("(1,2)", "(2,1)", False), ("\\pi", "3.14159", False), ("2\\pi", "\\pi \\cdot 2", True),
    ("x^2+2x+1", "(x+1)^2", True), ("5 cm", "5", True), ("3 hours", "3", True), ("1 1/2", "3/2", True),
    ("0.333", "1/3", False), ("-3", "- 3", True), ("", "1", False), (None, "1", False), ("12", None, False),
    ("2 million", "2000000", False), ("\\left( 1, 2 \\right)", "(1,2)", True), ("{5}", "5", True),
    ("\\boxed{5}", "5", True), ("a", "A", True), ("3.0", "3", True), ("7 and 8", "7, 8", True), ("1e3", "1000", True),
    ("2^{10}", "1024", False), ("\\frac{10}{4}", "\\frac{5}{2}", False), (".5", "0.5", True), ("\\mbox{5}", "5", False),
    ("5\\text{ cm}", "5", True), ("-\\frac{1}{2}", "-0.5", True), ("(-\\infty, 3)", "(-\\infty,3)", True),
    ("x \\in [0,1]", "[0,1]", False), ("3!", "6", False), ("12 \\text{ and } 14", "12, 14", True), ("4/8", "1/2", False),
]
EXTRACTS = [("The answer is \\boxed{5}.", "5"), ("\\boxed{\\frac{1}{2}} and \\boxed{3}", "3"), ("no box here", None),
            ("\\fbox{7}", None), ("\\boxed{a{b}c}", "a{b}c"), ("\\boxed{unclosed", None), ("\\boxed 5", None),
            ("x \\boxed{} y", "")]
MATHD = [("\\text{5}", "5"), ("0.5", "\\frac{1}{2}"), (" \\frac12 ", "\\frac{1}{2}"), ("1/2", "\\frac{1}{2}"),
         ("x = 5", "5"), ("\\$3.50", "3.50"), (".5", "\\frac{1}{2}"), ("\\sqrt2", "\\sqrt{2}"), ("5\\%", "5")]


@pytest.mark.parametrize("given, truth, expected", GRADES)
def test_grade_answer_matches_openrlhf(given, truth, expected):
    assert grade_answer(given, truth) is expected


def test_extract_and_normalise_match_openrlhf():
    assert [extract_boxed_answer(text) for text, _ in EXTRACTS] == [want for _, want in EXTRACTS]
    assert [mathd_normalize_answer(text) for text, _ in MATHD] == [want for _, want in MATHD]
