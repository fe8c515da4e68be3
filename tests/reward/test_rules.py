"""Rule rewards: answer extraction, the math / exact_match / format rules, math-verify time limits."""

import asyncio
import time

import grpc
import numpy as np
import pytest

from services.common.errors import ServiceError
from services.reward.rules import MathScheme, RuleRewardSource, exact_match, extract_answer, last_boxed, last_number, \
    simplerl_answer, simplerl_model_output
from services.reward.source import ScoreBatch


@pytest.mark.parametrize("text, expected", [
    ("The answer is \\boxed{12}", "12"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("nested \\boxed{\\sqrt{x^{2}}} end", "\\sqrt{x^{2}}"),
    ("\\fbox{7}", "7"),
    ("unclosed \\boxed{12", None),
    ("no box here", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("so 3 apples and 1,234 pears.", "1234"),
    ("it is -7", "-7"),
    ("ratio 3/4 then 2.50", "2.50"),
    ("speed 2.5e3 m/s", "2.5e3"),
    ("tiny: -1.5E-3", "-1.5E-3"),
    ("we get 2.5 \\times 10^{3} meters", "2.5 \\times 10^{3}"),
    ("none", None),
])
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_boxed_wins_over_a_later_number():
    assert extract_answer("\\boxed{5}, check: 2+3=5 and 9 more") == "5"
    assert extract_answer("The answer is 42. Step 3") == "42"  # a stated answer beats a later number
    assert extract_answer("nothing") is None


def test_exact_match():
    assert exact_match("so \\boxed{ New  York }", "New York")
    assert exact_match("  Paris \n", "Paris")
    assert not exact_match("Paris, France", "Paris")


def run(source, batch):
    async def go():
        await source.start()
        try:
            return await source.score(batch)
        finally:
            await source.close()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def math_source():
    """One source (one worker pool) for the math tests, with rewards 1 / -0.5 / -1."""
    source = RuleRewardSource(["math"], MathScheme(correct=1.0, wrong=-0.5, no_answer=-1.0), verify_timeout_s=1,
                              workers=1)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(source.start())
    yield source, loop
    loop.run_until_complete(source.close())
    loop.close()


def test_math_scheme_correct_wrong_and_no_answer(math_source):
    source, loop = math_source
    responses = ["The answer is \\boxed{12}", "so it is \\boxed{0.5}", "I think 13", "I do not know",
                 "\\boxed{\\frac{3}{4}}", "x = \\boxed{2} or maybe 3"]
    labels = ["12", "\\frac{1}{2}", "12", "4", "0.75", "2"]
    out = loop.run_until_complete(source.score(ScoreBatch.from_texts([""] * 6, responses, labels)))
    np.testing.assert_array_equal(out.rewards, [1.0, 1.0, -0.5, -1.0, 1.0, 1.0])
    np.testing.assert_array_equal(out.extra["accuracy"], [1, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(out.extra["no_answer"], [0, 0, 0, 1, 0, 0])
    # The format hit: an answer in \boxed{} (a bare last number is an answer, but not in the format).
    np.testing.assert_array_equal(out.extra["boxed"], [1, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(out.scores, out.rewards)


def test_math_verify_time_limit_per_sample(math_source):
    """A tower of powers makes sympy run for ever: that sample is wrong after ~1 s, the others are scored."""
    source, loop = math_source
    responses = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{0.5}"]
    t0 = time.monotonic()
    out = loop.run_until_complete(source.score(ScoreBatch.from_texts(["", ""], responses, ["1", "\\frac{1}{2}"])))
    assert time.monotonic() - t0 < 8
    np.testing.assert_array_equal(out.rewards, [-0.5, 1.0])
    np.testing.assert_array_equal(out.extra["verify_timeout"], [1, 0])


def test_math_without_labels_is_invalid_argument(math_source):
    source, loop = math_source
    with pytest.raises(ServiceError) as err:
        loop.run_until_complete(source.score(
            ScoreBatch.from_texts(["a", "b"], ["\\boxed{1}", "\\boxed{2}"], ["1", ""], sample_ids=["p0", "p1"])))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "samples[1].label" in err.value.message and '"p1"' in err.value.message


def test_format_and_exact_match_add_up():
    source = RuleRewardSource(["exact_match", "format"], format_pattern=r"<think>.+?</think>.*", format_reward=0.5)
    responses = ["<think>hm</think> \\boxed{7}", "\\boxed{7}", "<think>x</think> 8", "8"]
    out = run(source, ScoreBatch.from_texts([""] * 4, responses, ["7", "7", "7", "7"]))
    np.testing.assert_array_equal(out.rewards, [1.5, 1.0, 0.5, 0.0])
    np.testing.assert_array_equal(out.extra["format_ok"], [1, 0, 1, 0])
    np.testing.assert_array_equal(out.extra["exact_match"], [1, 1, 0, 0])
    np.testing.assert_array_equal(out.extra["format_reward"], [0.5, 0, 0.5, 0])


def test_format_rule_needs_no_labels():
    out = run(RuleRewardSource(["format"]), ScoreBatch.from_texts(["q"], ["<think>a</think><answer>b</answer>"]))
    np.testing.assert_array_equal(out.rewards, [1.0])


def test_killed_worker_fails_its_chunk_and_the_pool_is_replaced():
    """A worker killed mid-task (e.g. by the OOM killer) never answers: the chunk's guard fires, the
    caller gets DEADLINE_EXCEEDED, and the next request is scored by a fresh pool."""
    import multiprocessing
    import os
    import signal

    source = RuleRewardSource(["math"], verify_timeout_s=1, workers=1, guard_slack_s=3)

    async def go():
        before = {p.pid for p in multiprocessing.active_children()}
        await source.start()
        workers = [p.pid for p in multiprocessing.active_children() if p.pid not in before]
        try:
            await source.score(ScoreBatch.from_texts([""], ["\\boxed{0.5}"], ["\\frac{1}{2}"]))  # workers are up
            task = asyncio.create_task(source.score(ScoreBatch.from_texts([""], ["\\boxed{9^{9^{9^{9}}}}"], ["1"])))
            await asyncio.sleep(0.3)
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(ServiceError) as err:
                await task
            after = await source.score(ScoreBatch.from_texts([""], ["\\boxed{0.25}"], ["\\frac{1}{4}"]))
            return err.value, after
        finally:
            await source.close()

    t0 = time.monotonic()
    err, after = asyncio.run(go())
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "restarted" in err.message
    assert after.rewards.tolist() == [1.0]
    assert time.monotonic() - t0 < 30


# Every answer form of the table in docs/guides/reward-servers.md ("The math rule"): (response, label) pairs
# the math rule scores as correct.
ANSWER_FORMS = [
    ("so \\boxed{\\frac{3}{4}}", "0.75"),
    ("first \\boxed{1}, then \\boxed{\\sqrt{x^{2}}}", "\\sqrt{x^{2}}"),
    ("The answer is $\\frac{3}{4}$.", "\\frac{3}{4}"),
    ("The answer is $\\frac{3}{4}$. Check: 3 of 4 parts.", "0.75"),
    ("**Answer:** $x = 5$", "5"),
    ("the final answer is \\(\\sqrt{2}\\)", "\\sqrt{2}"),
    ("The answer is\n$$\\frac{1}{2}$$", "0.5"),
    ("Answer: 42 apples, after 3 steps", "42"),
    ("The answer is 3 + 4 = 7 apples", "7"),
    ("The final answer is: 2.5e3", "2500"),
    ("the speed is 2.5e3 m/s", "2500"),
    ("about 1.5E-3 of it", "0.0015"),
    ("we get 2.5 \\times 10^{3} meters", "2500"),
    ("so 3 apples and 1,234 pears", "1234"),
    ("it is -7", "-7"),
    ("the ratio is 3/4", "\\frac{3}{4}"),
    ("\\boxed{[1, 3)}", "[1,3)"),
    ("\\boxed{\\{3, 1, 2\\}}", "\\{1,2,3\\}"),
    ("\\boxed{\u22125}", "-5"),
    ("\\boxed{2.5e3}", "2.5 \\times 10^3"),
]


@pytest.mark.parametrize("response, label", ANSWER_FORMS)
def test_answer_forms_of_the_documented_table(math_source, response, label):
    source, loop = math_source
    out = loop.run_until_complete(source.score(ScoreBatch.from_texts([""], [response], [label])))
    assert out.rewards.tolist() == [1.0], (response, label, extract_answer(response))


def test_prose_and_scientific_notation_do_not_turn_wrong_answers_right(math_source):
    source, loop = math_source
    responses = ["The answer is $\\frac{3}{5}$.", "the speed is 2.5e4 m/s", "The answer is 41. Step 42"]
    out = loop.run_until_complete(source.score(ScoreBatch.from_texts([""] * 3, responses, ["0.75", "2500", "42"])))
    np.testing.assert_array_equal(out.rewards, [-0.5, -0.5, -0.5])


CHATML = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n{q} Put your final answer within " \
         "\\boxed{{}}.<|im_end|>\n<|im_start|>assistant\n{r}<|im_end|>"


def test_simplerl_model_output_and_answer_as_simplerl_reason_cuts_them():
    query = CHATML.format(q="1+1?", r="so \\boxed{2}.") + "<|endoftext|>"
    output = simplerl_model_output(query, "ignored")
    assert output == "<|im_start|>assistant\nso \\boxed{2}."
    assert simplerl_answer(output) == "2"
    # Without a ChatML assistant turn the response alone is read (the prompt's \boxed{} would count).
    assert simplerl_model_output("Put it in \\boxed{}. 1+1=", "2") == "2"
    assert simplerl_answer("\\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert simplerl_answer("so boxed 5$ and more") == "5"  # no brace: up to the next $
    assert simplerl_answer("\\boxed{12.}") == "12"  # a trailing period is dropped
    assert simplerl_answer("The final answer is $7$. I hope it is correct. \\boxed{8}") == "7"  # Minerva first


def test_simplerl_math_levels():
    """1 right and boxed, -0.5 wrong and boxed, -1 without "boxed" even when the answer is right."""
    source = RuleRewardSource(["simplerl_math"], verify_timeout_s=2, workers=1)
    responses = ["so \\boxed{2}.", "so \\boxed{3}.", "The answer is 2.", "nothing", "\\boxed{\\frac{4}{2}}"]
    queries = [CHATML.format(q="1+1?", r=r) for r in responses]
    batch = ScoreBatch.from_texts(["p"] * 5, responses, ["2"] * 5, queries=queries)
    out = run(source, batch)
    np.testing.assert_array_equal(out.rewards, [1.0, -0.5, -1.0, -1.0, 1.0])
    np.testing.assert_array_equal(out.extra["no_boxed"], [0, 0, 1, 1, 0])
    np.testing.assert_array_equal(out.extra["accuracy"], [1, 0, 0, 0, 1])
