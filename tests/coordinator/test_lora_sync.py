"""GRPO with --lora_rank end to end (local placement, hf engine): every push carries the adapter
alone, and a rollout engine that dies mid-run gets the --pretrain weights (its own start) and the
current adapter, verified, before its first prompt."""

from __future__ import annotations

from transformers import AutoModelForCausalLM

from services.learner.lora import LoraOptions, adapter_state, apply_lora
from tests.chaos.harness import grpo_argv, run_trial

STEPS = 2


def test_lora_run_pushes_adapters_and_readmits_a_restarted_engine(tiny_model_dir, tiny_data_dir, tmp_path):
    argv = grpo_argv(tiny_model_dir, tiny_data_dir, tmp_path, 1, STEPS, "hf", "--lora_rank", "8", "--lora_alpha", "16",
                     "--max_restarts", "4")
    # The engine dies right after taking step 1's push; its restart must be admitted with the adapter.
    trial = run_trial(argv, tmp_path, crash_at=["rollout.push.version_committed@rollout-0#1"], timeout_s=600)
    assert trial.returncode == 0, trial.log[-8000:]
    assert trial.crashed_at == ["rollout.push.version_committed@rollout-0#1"]
    assert trial.steps == [1, 2]
    assert trial.count("rollout.admitted") == 1, trial.events

    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraOptions(rank=8, alpha=16))
    adapter_bytes = sum(p.numel() * 4 for _, p in adapter_state(model))  # float32, as the engines hold it
    full_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert adapter_bytes < full_bytes / 4
    assert [r["weights/bytes"] for r in trial.records] == [adapter_bytes] * STEPS

    # The engine's log (both of its processes): every push it took was an adapter push of those
    # bytes, and the restarted process took the current one (version and checksum of the push it
    # died after) before its first Generate.
    lines = [parse(line) for line in (tmp_path / "run" / "logs" / "rollout-0.log").read_text().splitlines()]
    lines = [r for r in lines if r]
    starts = [i for i, r in enumerate(lines) if r["event"] == "engine.ready"]
    assert len(starts) == 2, "the engine did not restart"
    pushes = [r for r in lines if r["event"] == "weights.update.start"]
    assert len(pushes) == STEPS + 1 and all(int(r["bytes"]) < 2 * adapter_bytes for r in pushes)
    before, after = lines[:starts[1]], lines[starts[1]:]
    events = [r["event"] for r in after]
    first_push = after[events.index("weights.update.done")]
    assert events.index("weights.update.done") < events.index("generate.start")
    died_after = [r for r in before if r["event"] == "weights.update.done"][-1]
    assert (first_push["version"], first_push["checksum"]) == (died_after["version"], died_after["checksum"])


def parse(line: str) -> dict[str, str] | None:
    """A rollout log line "<time> INFO rollout <event> key=value ..." as {"event": ..., key: value}."""
    parts = line.split()
    if len(parts) < 4 or parts[2] != "rollout":
        return None
    return {"event": parts[3], **dict(p.split("=", 1) for p in parts[4:] if "=" in p)}
