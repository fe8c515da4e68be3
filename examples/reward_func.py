"""A reward function file: `python -m services.reward --remote_rm_url examples/reward_func.py`.

The service imports this file in worker processes and calls reward_func there, in their main thread
(so libraries that use SIGALRM, such as math-verify, work), on batches of --remote_rm_batch_size
samples with a time limit per batch (--reward_func_timeout_s). Return one number per sample (a list,
numpy array or torch tensor), or a dict with "rewards" and optionally "scores" (raw scores, e.g.
for filtering) and "extra_logs" (name -> one number per sample, reported as metrics).
"""

import re

_ANSWER = re.compile(r"\\boxed\{([^{}]*)\}")


def reward_func(queries, prompts, labels, **kwargs):
    """queries: full texts (prompt + response); prompts: the prompts; labels: reference answers.

    kwargs also holds `responses`, `sample_ids`, `data_sources` and `extra_infos` (lists like the
    others; extra_infos holds each row's extra_info dict, {} for a row without one).
    """
    responses = kwargs["responses"]
    rewards, boxed = [], []
    for response, label in zip(responses, labels):
        answers = _ANSWER.findall(response)
        boxed.append(1.0 if answers else 0.0)
        rewards.append(1.0 if answers and answers[-1].strip() == label.strip() else 0.0)
    # A small penalty for rambling keeps answers short.
    lengths = [len(r) for r in responses]
    rewards = [r - 0.001 * max(0, n - 200) for r, n in zip(rewards, lengths)]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"has_boxed": boxed}}
