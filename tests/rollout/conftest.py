"""Rollout service processes for the tests: one vLLM engine and one transformers engine per session.

Each is the real `python -m services.rollout` on loopback with the tiny model in float32 (so that
vLLM, the hf engine and a transformers forward pass can be compared tightly), taking adapter pushes
too (--enable_lora, tests/rollout/test_lora_push.py). Their logs go to
files under the session's temp dir and are printed when a start-up fails.
"""

from __future__ import annotations

import pytest

from tests.rollout.helpers import ENGINE_ARGS, VLLM_ARGS, start_rollout, stop_rollout


@pytest.fixture(scope="session")
def vllm_rollout(tiny_model_dir, tmp_path_factory):
    service = start_rollout(tiny_model_dir, tmp_path_factory.mktemp("rollout_vllm"), *VLLM_ARGS,
                            # Token streaming, for the partial-push test; coordinator runs without
                            # --partial_rollout cover the whole-sample outputs.
                            "--partial_rollout", "--enable_lora")
    yield service
    stop_rollout(service.proc)


@pytest.fixture(scope="session")
def hf_rollout(tiny_model_dir, tmp_path_factory):
    service = start_rollout(tiny_model_dir, tmp_path_factory.mktemp("rollout_hf"), *ENGINE_ARGS, "--engine", "hf",
                            "--hf_device", "cpu", "--enable_lora")
    yield service
    stop_rollout(service.proc)
