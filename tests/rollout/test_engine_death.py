"""A dead engine core is a dead service: kill vLLM's engine-core process (a child of the rollout
service, not the service itself) and the service must say so and exit, so a supervisor restarts it.

The service here is its own (the test kills its engine), not the session's shared one.
"""

from __future__ import annotations

import threading
import time

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.rollout.server import ENGINE_DEAD_EXIT_CODE
from tests.rollout.helpers import VLLM_ARGS, generate, start_rollout, stop_rollout, token_prompt


def engine_core_process(service_pid: int) -> psutil.Process:
    children = psutil.Process(service_pid).children(recursive=True)
    found = [p for p in children if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]
    assert len(found) == 1, f"expected one engine-core process among {[(p.pid, p.name()) for p in children]}"
    return found[0]


def test_a_killed_engine_core_makes_the_service_not_serving_and_exit(tiny_model_dir, tmp_path):
    service = start_rollout(tiny_model_dir, tmp_path / "rollout", *VLLM_ARGS)
    try:
        channel = service.channel(timeout_s=60)
        stub, health = service.stub(channel), health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        in_flight: dict[str, grpc.RpcError] = {}

        def long_generation():
            try:
                generate(stub, [token_prompt(f"p{i}", [5 + i, 6]) for i in range(8)], n=4, max_tokens=200,
                         ignore_eos=True, timeout=60)
            except grpc.RpcError as exc:
                in_flight["error"] = exc

        thread = threading.Thread(target=long_generation)
        thread.start()
        deadline = time.monotonic() + 60
        while service.metrics().get("rlmesh_rollout_running_samples", 0) == 0:
            assert time.monotonic() < deadline, "the Generate call never started"
            time.sleep(0.05)

        engine_core_process(service.proc.pid).kill()
        killed_at = time.monotonic()
        # Health leaves SERVING at once (NOT_SERVING, or no answer once the process is gone).
        while True:
            try:
                serving = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError:
                break
            if serving == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            assert time.monotonic() - killed_at < 10, "health still SERVING 10 s after the engine core died"
            time.sleep(0.05)
        not_serving_after = time.monotonic() - killed_at

        exit_code = service.proc.wait(timeout=60)
        exited_after = time.monotonic() - killed_at
        thread.join(timeout=30)
        log = service.log_tail(20000)
        assert exit_code == ENGINE_DEAD_EXIT_CODE, f"exit code {exit_code} after the engine core died:\n{log[-4000:]}"
        assert not_serving_after < 10 and exited_after < 30, (not_serving_after, exited_after)
        print(f"NOT_SERVING {not_serving_after:.1f} s and exit {exited_after:.1f} s after the kill")
        assert "engine.dead" in log and "supervisor restarts it" in log, log[-4000:]
        # The call that was generating when the engine died hears why, not a bare cancellation.
        error = in_flight.get("error")
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "died" in error.details() and "restart" in error.details(), error.details()
    finally:
        stop_rollout(service.proc)
