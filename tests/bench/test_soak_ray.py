"""bench/soak_ray.py: the soak in Ray placement, service kills and node losses in one run.

The plan (which step, which service or node, which phase) is checked without Ray; the whole script
runs on a local Ray cluster in a small setting (`slow`: a cluster of 7 nodes and two runs take a few
minutes on 2 cores; `make test-all` runs it). The long run's figures are on
docs/benchmarks/2026-12-06-soak-ray.md.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.chaos.harness import REPO, service_env


def _soak_ray():
    spec = importlib.util.spec_from_file_location("soak_ray", REPO / "bench" / "soak_ray.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_ray"] = module  # its dataclasses look their module up
    sys.path.insert(0, str(REPO / "bench"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "bench"))
    return module


def test_the_plan_kills_a_service_every_few_steps_and_two_nodes_on_steps_of_their_own():
    soak_ray = _soak_ray()
    faults = soak_ray.plan(300, 5, 2, seed=0)
    services = [f for f in faults if f.kind == "service"]
    nodes = [f for f in faults if f.kind == "node"]
    assert [f.step for f in services] == list(range(5, 300, 5))
    assert {f.target for f in services} == set(soak_ray.SERVICES)
    assert {f.phase for f in services} <= {"generate", "score", "train"}
    assert [(f.target, f.phase) for f in nodes] == [("rollout-0", "generate"), ("learner", "train")]
    assert [f.step for f in nodes] == [101, 201]  # 100 and 200 hold a service kill: the next step
    assert [f.step for f in faults] == sorted(f.step for f in faults)
    assert soak_ray.plan(300, 5, 2, seed=0) == faults and soak_ray.plan(300, 5, 2, seed=1) != faults


@pytest.mark.slow
def test_soak_ray_small(tmp_path):
    out = tmp_path / "soak-ray"
    proc = subprocess.run([sys.executable, "bench/soak_ray.py", "--steps", "10", "--kill_every", "3",
                           "--node_kills", "2", "--sample_s", "1", "--warmup_steps", "3", "--settle_s", "3",
                           "--out", str(out)], cwd=REPO, env=service_env(), capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode in (0, 1), proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    for check in ("finished", "every_step_once", "every_kill_landed", "equal_to_fault_free", "pruning_holds",
                  "no_leftovers"):
        assert results["checks"][check], (check, proc.stdout[-4000:])
    kinds = [k["kind"] for k in results["kills"]]
    assert kinds.count("node") == 2 and kinds.count("service") == 3, results["kills"]
    assert all(k["to_next_step_s"] is not None for k in results["kills"])
    assert {"coordinator", "learner", "rollout-0", "rollout-1", "reward-0"} <= set(results["memory_mb"])
