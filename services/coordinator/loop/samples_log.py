"""Some of each step's generated samples in the run folder, to read what the model writes.

    {run_dir}/samples/step_000001.jsonl    up to --log_samples lines for step 1, one JSON object each:

    step, prompt (the text the model saw, chat template applied), response, reward (after the reward
    service's normalisation and clipping), score (before), label, datasource, difficulty (the row's,
    "" without one), truncated (cut at --generate_max_len without EOS or a stop), response_tokens,
    weight_version (of the weights that generated it), prompt_uid and sample_index (which group
    and which sample in it), extra (the reward source's per-sample logs: accuracy, boxed, ...).

Which samples: the first sample of each prompt in the step's order, then the second of each, ... so
that a file shows as many prompts as it can. A step that is done again (after a failure rewound the
run) replaces its file. Disk stays bounded by --log_samples x steps lines (0 writes none).
`rlmesh samples RUN_DIR [--step N] [--n K]` prints them (read_samples below).
"""

from __future__ import annotations

import json
import os
import pathlib
import re

from rlmesh.rollout.v1 import rollout_pb2

SAMPLES_DIR = "samples"
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")


def step_file(run_dir: str | os.PathLike, step: int) -> pathlib.Path:
    return pathlib.Path(run_dir) / SAMPLES_DIR / f"step_{step:06d}.jsonl"


def pick(samples: list, count: int) -> list:
    """Up to `count` samples: index 0 of every prompt (in the step's order), then index 1, ..."""
    return sorted(samples, key=lambda s: s.index)[:count]  # a stable sort keeps the prompts' order


def sample_record(step: int, sample) -> dict:
    prompt = sample.prompt
    return {"step": step, "prompt": prompt.text, "response": sample.text, "reward": sample.reward,
            "score": sample.score, "label": prompt.label, "datasource": prompt.datasource,
            "difficulty": prompt.difficulty,
            "truncated": sample.finish_reason == rollout_pb2.FINISH_REASON_LENGTH,
            "response_tokens": len(sample.response_ids), "weight_version": sample.weight_version,
            "prompt_uid": prompt.uid, "sample_index": sample.index, "extra": dict(sample.extra)}


def write_step_samples(run_dir: str | os.PathLike, step: int, samples: list, count: int) -> pathlib.Path | None:
    """Writes step `step`'s file (replacing one a rewound run left); returns its path, None when count is 0."""
    if count <= 0 or not samples:
        return None
    path = step_file(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    lines = (json.dumps(sample_record(step, s), ensure_ascii=False, allow_nan=True) for s in pick(samples, count))
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def logged_steps(run_dir: str | os.PathLike) -> list[int]:
    folder = pathlib.Path(run_dir) / SAMPLES_DIR
    found = (_STEP_FILE.fullmatch(p.name) for p in folder.glob("step_*.jsonl")) if folder.is_dir() else ()
    return sorted(int(m.group(1)) for m in found if m)


def read_samples(run_dir: str | os.PathLike, step: int) -> list[dict]:
    path = step_file(run_dir, step)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
