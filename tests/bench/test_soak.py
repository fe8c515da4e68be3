"""bench/soak.py in a small setting: 12 GRPO steps of the tiny model over the real services (local
placement, CPU), a fault-free run and the same run with a random service killed (`kill -9`) at
steps 4 and 8, sampled from /proc every second.

The soak run has every step once and the baseline's per-step metrics and final model, leaves no
process behind, keeps no more checkpoints than --max_ckpt_num, and the results file holds each
process's memory, file descriptors and listening ports over time. (Memory growth is judged on the
long run only: 12 steps have no warm-up worth the name.)
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.chaos.harness import REPO, service_env

SERVICES = {"coordinator", "learner", "reward-ref-0", "rollout-0", "rollout-1"}


def test_soak_small(tmp_path):
    out = tmp_path / "soak"
    proc = subprocess.run([sys.executable, "bench/soak.py", "--steps", "12", "--kill_every", "4", "--sample_s", "1",
                           "--warmup_steps", "3", "--settle_s", "3", "--out", str(out)], cwd=REPO, env=service_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    checks = results["checks"]
    for check in ("finished", "every_step_once", "every_kill_landed", "equal_to_fault_free", "pruning_holds",
                  "no_leftovers"):
        assert checks[check], (check, proc.stdout[-4000:])
    assert results["steps"]["missing"] == [] and results["steps"]["duplicates"] == []
    assert results["kills_landed"] == 2 and sum(results["restarts"].values()) == 2, results["restarts"]
    assert results["differences"] == [] and results["model_max_abs_difference"] < 1e-6
    assert results["leftovers"] == []
    # The report: every process of the run, sampled over time (memory, fds, listening ports) ...
    assert set(results["memory_mb"]) == SERVICES, results["memory_mb"].keys()
    for name in SERVICES:
        memory, fds, ports = results["memory_mb"][name], results["fds"][name], results["listening_ports"][name]
        assert 50 < memory["after_warmup"] <= memory["max"] < 4000, (name, memory)
        assert fds["after_warmup"] > 3 and ports["after_warmup"] >= 1, (name, fds, ports)
    assert len(results["samples"]) >= 10
    # ... and the checkpoint folder, pruned to --max_ckpt_num (2) complete checkpoints.
    disk = results["checkpoint_disk"]
    assert disk["end"] > 0 and disk["max_complete_checkpoints"] <= 3 and disk["final_folders"] <= 2, disk
    assert "left behind: none" in proc.stdout and "checks:" in proc.stdout
