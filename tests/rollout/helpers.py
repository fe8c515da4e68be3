"""Request builders and transformers references shared by the rollout tests."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import torch

from rlmesh.rollout.v1 import rollout_pb2
from services.common.logprobs import sequence_logprobs
from services.common.tensors import from_proto, to_proto
from tests.rollout.conftest import ROOT


def token_prompt(prompt_id: str, ids) -> rollout_pb2.Prompt:
    return rollout_pb2.Prompt(prompt_id=prompt_id, token_ids=to_proto(torch.tensor(ids, dtype=torch.int64)))


def text_prompt(prompt_id: str, text: str) -> rollout_pb2.Prompt:
    return rollout_pb2.Prompt(prompt_id=prompt_id, text=text)


def chat_prompt(prompt_id: str, user: str) -> rollout_pb2.Prompt:
    return rollout_pb2.Prompt(prompt_id=prompt_id, chat=rollout_pb2.ChatMessages(
        messages=[rollout_pb2.ChatMessage(role="user", content=user)]))


def generate(stub, prompts, n=1, timeout=120, **sampling) -> list[rollout_pb2.GenerateResponse]:
    request = rollout_pb2.GenerateRequest(request_id="test", prompts=prompts, n=n,
                                          sampling=rollout_pb2.SamplingOptions(**sampling))
    return list(stub.Generate(request, timeout=timeout))


def by_key(responses) -> dict[tuple[str, int], rollout_pb2.GenerateResponse]:
    return {(r.prompt_id, r.sample_index): r for r in responses}


def tokens(response) -> list[int]:
    return from_proto(response.response_token_ids).tolist()


def logprobs(response) -> list[float]:
    return from_proto(response.logprobs).tolist()


def greedy_ids(stub, prompt_ids: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    responses = by_key(generate(stub, [token_prompt(str(i), p) for i, p in enumerate(prompt_ids)],
                                temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [tokens(responses[(str(i), 0)]) for i in range(len(prompt_ids))]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation by full forward passes (no cache): the plainest reference."""
    ids = list(prompt)
    for _ in range(new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def hf_response_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response token t | prompt, response < t) from one transformers forward pass."""
    ids = torch.tensor([prompt + response])
    logp = sequence_logprobs(model, ids, torch.ones_like(ids))  # (1, T-1)
    return logp[0, len(prompt) - 1:].tolist()


def rpc_error(call) -> grpc.RpcError:
    """Runs call(); returns the RpcError it raised (fails the test if it succeeded)."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded but should have failed")


def push_checkpoint(address: str, checkpoint, version: int, bucket_mb: int = 1) -> dict:
    """Pushes a checkpoint from a separate process (the pusher CLI, as a learner would push)."""
    proc = subprocess.run([sys.executable, "-m", "services.rollout.pusher", "--rollout_addresses", address,
                           "--checkpoint", str(checkpoint), "--version", str(version), "--backend", "gloo",
                           "--bucket_mb", str(bucket_mb), "--timeout_s", "60"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"push failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
