"""The verifier of job L (bench/gpu/learn_peers.py): one file that every framework trains with and the
evaluator scores with, so that a reward of 1 means the same thing everywhere.

    rlmesh, OpenRLHF   --remote_rm_url / --reward.remote_url learn_reward.py    -> reward_func
    veRL               reward.custom_reward_function.path=learn_reward.py,
                       reward.custom_reward_function.name=compute_score           -> compute_score
    TRL                reward_funcs=[learn_reward.trl_reward] (learn_trl.py)      -> trl_reward
    the evaluator      learn_eval.py                                               -> is_correct

A response is correct (1.0, else 0.0) when its final answer equals the label as a number. The final
answer is found as rlmesh's `math` rule finds it: the last \\boxed{...}; else what follows the last
"the answer is" / "answer:" (the first number of that sentence, after its last "="); else the last
number of the response. Numbers may carry thousands commas, decimals, a sign, a fraction a/b or
\\frac{a}{b}, and $...$ around them. Only the standard library is imported at module level (torch only
inside reward_func, whose callers have it), so that the file loads in any framework's process.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?")
_ANSWER_PHRASE = re.compile(r"\b(?:final\s+)?answer\s*(?:is|:|=)\s*:?[\s*]*", re.IGNORECASE)
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
# What a chat template leaves around a decoded response (OpenRLHF decodes with special tokens).
_SPECIAL = re.compile(r"<\|[^|>]*\|>|</s>")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None without one."""
    for start in reversed([m.end() for m in _BOXED.finditer(text)]):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def stated_answer(text: str) -> str | None:
    """The first number of the sentence after the last "the answer is" / "answer:" (after its last
    "="); None without such a phrase or number."""
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if not phrases:
        return None
    sentence = re.split(r"\n|\.(?:\s|$)", text[phrases[-1].end():], maxsplit=1)[0]
    number = _NUMBER.search(_FRAC.sub(r"\1/\2", sentence.split("=")[-1]))
    return number.group(0) if number else None


def final_answer(response: str) -> str | None:
    """The response's final answer (boxed, else stated, else its last number), or None."""
    response = _SPECIAL.sub(" ", response)
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    stated = stated_answer(response)
    if stated is not None:
        return stated
    numbers = _NUMBER.findall(_FRAC.sub(r"\1/\2", response))
    return numbers[-1] if numbers else None


def as_number(text: str) -> Fraction | None:
    """"1,234" -> 1234, "-3/4", "\\frac{3}{4}", "$2.50$", "12." -> a Fraction; None when not one number."""
    cleaned = _FRAC.sub(r"\1/\2", str(text))
    cleaned = re.sub(r"[\s$]|\\[!,;: ]|\\(?:text|mathrm)\{[^}]*\}", "", cleaned).replace(",", "").rstrip(".")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?(?:/\d+)?", cleaned):
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def is_correct(response: str, label) -> bool:
    """Whether the response's final answer equals the label (as numbers; as text when either is not one)."""
    answer = final_answer(response)
    if answer is None:
        return False
    expected, got = as_number(str(label)), as_number(answer)
    if expected is not None and got is not None:
        return expected == got
    return " ".join(answer.split()) == " ".join(str(label).split())


def response_of(query: str, prompt: str) -> str:
    """The response part of OpenRLHF's query (the prompt and response decoded together)."""
    if query.startswith(prompt):
        return query[len(prompt):]
    marker = query.rfind("assistant")  # a template whose decoding differs from the prompt text
    return query[marker + len("assistant"):] if marker >= 0 else query


def reward_func(queries, prompts, labels, **kwargs):
    """OpenRLHF's and rlmesh's convention; rlmesh also passes the responses themselves."""
    import torch

    responses = kwargs.get("responses") or [response_of(q, p) for q, p in zip(queries, prompts)]
    rewards = torch.tensor([1.0 if is_correct(r, label) else 0.0 for r, label in zip(responses, labels)])
    # OpenRLHF reads a dict (a plain list counts as no reward there); rlmesh takes either.
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """veRL's convention: one response, its label as ground_truth."""
    return 1.0 if is_correct(solution_str, ground_truth) else 0.0


def trl_reward(completions, label, **kwargs) -> list[float]:
    """TRL's convention: completions as chat messages (or text), the dataset's label column."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if is_correct(text, lab) else 0.0 for text, lab in zip(texts, label)]
