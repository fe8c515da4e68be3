"""A worker process that runs the agent file's code, one episode at a time.

Started by services/coordinator/loop/agent.py (multiprocessing, spawn) with one end of a pipe. It
registers services.coordinator.loop.agent_api as `openrlhf.utils.agent`, loads --agent_func_path, and
then serves episodes:

    coordinator -> ("episode", prompt, label, sampling dict, max_length)
    worker      -> ("generate", (token ids, sampling dict))    one per model turn
    coordinator -> ("generated", GeneratedTurn fields)          the rollout service's answer
    worker      -> ("done", result dict) | ("error", traceback text)

The coordinator owns the time limit: agent code that hangs (or a worker that dies) fails only the
episode in this worker, which the coordinator then replaces.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import traceback
import types
from multiprocessing.connection import Connection

from services.common import openrlhf_compat
from services.coordinator.loop import agent_api


class _Logprob:
    __slots__ = ("logprob",)

    def __init__(self, logprob: float):
        self.logprob = logprob


class RemoteEngine:
    """`llm_engine` of the agent code: generate() asks the coordinator, which calls the rollout service."""

    def __init__(self, conn: Connection, max_turns: int):
        self.conn, self.max_turns = conn, max_turns
        self.turns: list[dict] = []  # per call: prompt length, weight version

    async def generate(self, prompt_token_ids, sampling_params):
        if len(self.turns) >= self.max_turns:
            raise RuntimeError(f"the agent asked for model turn {len(self.turns) + 1}, past --agent_max_turns "
                               f"{self.max_turns}")
        params = {f.name: getattr(sampling_params, f.name, f.default) for f in
                  agent_api.SamplingParams.__dataclass_fields__.values() if hasattr(sampling_params, f.name)}
        self.conn.send(("generate", ([int(t) for t in prompt_token_ids], params)))
        kind, turn = self.conn.recv()
        if kind != "generated":
            raise RuntimeError(f"the coordinator answered {kind!r} to a generate request")
        self.turns.append({"start": len(prompt_token_ids), "version": turn["weight_version"]})
        ids = turn["token_ids"]
        output = types.SimpleNamespace(
            token_ids=ids, text=turn["text"], finish_reason=turn["finish_reason"],
            logprobs=[{t: _Logprob(lp)} for t, lp in zip(ids, turn["logprobs"])])
        return types.SimpleNamespace(prompt_token_ids=list(prompt_token_ids), outputs=[output])


def load_agent_file(path: str):
    """Imports the agent file with this module's API under `openrlhf.utils.agent`; returns its executor class
    (AgentExecutor, or MultiTurnAgentExecutor over its AgentInstance)."""
    openrlhf_compat.install(agent_api)  # openrlhf.utils.agent, and the grading helpers agent files use too
    spec = importlib.util.spec_from_file_location("rlmesh_agent_func", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # the file's own helper modules
    spec.loader.exec_module(module)
    executor = getattr(module, "AgentExecutor", None)
    if executor is not None:
        return executor
    instance = getattr(module, "AgentInstance", None)
    if instance is None:
        raise RuntimeError(f"{path} defines neither AgentExecutor nor AgentInstance (OpenRLHF's agent API)")
    return lambda: agent_api.MultiTurnAgentExecutor(instance)


def main(conn: Connection, agent_path: str, tokenizer_dir: str, max_turns: int) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers import AutoTokenizer

        agent_api.MultiTurnAgentExecutor.max_turns = max_turns
        executor = load_agent_file(agent_path)()
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except BaseException:  # noqa: BLE001 - reported to the coordinator, which stops the run
        conn.send(("failed_to_start", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        _, prompt, label, sampling, max_length = message
        engine = RemoteEngine(conn, max_turns)
        try:
            params = agent_api.SamplingParams(**sampling)
            result = asyncio.run(executor.execute(prompt, label, params, max_length, tokenizer, engine))
            result = dict(result)
            result["turn_versions"] = engine.turns
            for key in ("reward", "scores"):
                if result.get(key) is not None:
                    result[key] = agent_api._as_float(result[key])
            result["extra_logs"] = {k: agent_api._as_float(v) for k, v in (result.get("extra_logs") or {}).items()}
            conn.send(("done", result))
        except BaseException:  # noqa: BLE001 - this episode fails, the worker serves the next one
            conn.send(("error", traceback.format_exc()))
