"""Answer checking with math-verify, run in worker processes.

math-verify limits its parsing and comparison time with SIGALRM, which works only in a process's
main thread. The service's threads cannot use it, so the math rule sends answers here: a pool of
spawned processes whose tasks run in their main thread, where the per-sample time limit works.
math-verify (with sympy, ~1 s to import) is imported inside the functions, so that only the workers
load it and not every service process that imports the rule code.
"""


def answers_match(answer: str, label: str, timeout_s: int) -> tuple[bool, bool]:
    """(correct, timed_out) for one answer against its label, both as LaTeX or plain text.

    Both are wrapped in \\boxed{} so that math-verify reads them whole instead of searching them.
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold = parse("\\boxed{" + label + "}", parsing_timeout=timeout_s, raise_on_error=True)
        pred = parse("\\boxed{" + answer + "}", parsing_timeout=timeout_s, raise_on_error=True)
        return bool(verify(gold, pred, timeout_seconds=timeout_s, raise_on_error=True)), False
    except TimeoutException:
        return False, True
    except Exception:  # noqa: BLE001 - unparsable LaTeX is simply not a match
        return False, False


def check_answers(pairs: list[tuple[str, str]], timeout_s: int) -> list[tuple[bool, bool]]:
    """answers_match over (answer, label) pairs."""
    return [answers_match(answer, label, timeout_s) for answer, label in pairs]


def warm_up() -> None:
    """Pool initializer: loads sympy and the LaTeX parser before the first real task."""
    answers_match("\\frac{1}{2}", "0.5", 5)
