"""An engine removed by a scale request while its last Generate call is still open (every sample
received, the call's status not yet): the removal waits for the call to end instead of cancelling
it, which would cancel the whole generation and end the run as interrupted. Against a real rollout
service (hf engine, tiny model) held by a hold point between its last sample and the end of the call."""

import asyncio
import time

from rlmesh.rollout.v1 import rollout_pb2
from services.coordinator.loop.data import Prompt
from services.coordinator.loop.members import Members
from services.coordinator.loop.rollout_pool import RolloutPool
from tests.rollout.helpers import start_rollout, stop_rollout

HOLD = "rollout.generate.finished:step1"


def test_an_engine_removed_after_its_last_sample_lets_the_call_end(tiny_model_dir, tmp_path, monkeypatch):
    holds = tmp_path / "holds"
    holds.mkdir()
    monkeypatch.setenv("RLMESH_HOLD_AT", HOLD)
    monkeypatch.setenv("RLMESH_HOLD_DIR", str(holds))
    service = start_rollout(tiny_model_dir, tmp_path / "rollout", "--engine", "hf", "--hf_device", "cpu",
                            "--max_model_len", "128", "--seed", "0")
    held, released = holds / f"held-{HOLD}", holds / f"release-{HOLD}"
    try:
        async def scenario() -> tuple[int, float, str]:
            pool = RolloutPool([service.address], timeout_s=120.0)
            members = Members(pool, None, None, None, None)
            engine = pool.engine(0)
            prompts = [Prompt(f"p{i}", "", (3, 4, 5 + i), "", "") for i in range(2)]
            samples = []
            sampling = rollout_pb2.SamplingOptions(max_tokens=4, temperature=1.0)
            generation = asyncio.ensure_future(pool.generate(
                prompts, 2, sampling, None, seed=0, step=1, round_index=0,
                on_sample=lambda prompt, sample: samples.append(prompt.uid)))
            while not held.exists():  # every sample was sent; the call is held open
                assert not generation.done(), generation.exception()
                await asyncio.sleep(0.05)
            while engine.outstanding:
                await asyncio.sleep(0.05)
            members.drain_engine(0)
            removal = asyncio.ensure_future(members.remove_instance("rollout", 0, service.address))
            await asyncio.sleep(1.5)
            state = f"removal done: {removal.done()}, generation done: {generation.done()}"
            released.write_text("")
            started = time.monotonic()
            await generation  # raises CancelledError where the removal cancelled the call
            await removal
            return len(samples), time.monotonic() - started, state

        received, ended_after_s, state_while_held = asyncio.run(scenario())
        # Held: the removal waits for the open call, and the call is not cancelled.
        assert state_while_held == "removal done: False, generation done: False"
        assert received == 4
        assert ended_after_s < 30
        assert "generate.done" in service.log_tail()
    finally:
        released.write_text("")
        stop_rollout(service.proc)
