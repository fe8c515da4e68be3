"""bench/gpu/plot_timeline.py draws vs_peers.py's GPU trace with rlmesh's phases as vs_peers places them."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import plot_timeline  # noqa: E402
import vs_peers  # noqa: E402


def _rlmesh_run():
    # three steps of 10 s; every step: generate 4 s, sleep 0.1, reload 0.2, score 1, train 3, push 0.1, offload 0.2
    metrics = {"time/generate_s": 4.1, "time/rollout_sleep_s": 0.1, "time/learner_reload_s": 0.2, "time/score_s": 1.2,
               "time/train_s": 3.0, "time/push_s": 0.1, "time/learner_offload_s": 0.2}
    steps = [{"step": i + 1, "t_end": 20.0 + 10 * i, **metrics} for i in range(3)]
    samples = [(0.2 * k, 50.0, 30_000.0 + k) for k in range(int(45 / 0.2))]
    timeline = vs_peers.rlmesh_timeline(steps, samples)
    trace = [(round(t, 2), u, round(m / 1024, 2)) for t, u, m in samples]
    return {"framework": "rlmesh", "job": "A", "steps": steps, "gpu_trace": trace, "gpu_busy": 0.5,
            "step_median_s": 10.0, "rlmesh_timeline": timeline}


def test_the_phases_are_placed_between_the_step_ends_and_drawn(tmp_path):
    run = _rlmesh_run()
    windows = run["rlmesh_timeline"]["windows"]
    # steps 2 and 3, each: the nine phases and "between", laid end to end from the step before's end
    assert len(windows) == 2 * 10
    assert windows[0] == ("generate", 20.0, 24.0)
    assert [w[0] for w in windows[:10]][-2:] == ["learner_offload", "between"]
    assert windows[9][2] == 30.0 and windows[10][1] == 30.0
    peer = {"framework": "trl", "job": "A", "steps": [{"t_end": 15.0}], "gpu_trace": [(0.0, 10.0, 1.0), (1.0, 90.0, 2.0)]}
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"results": [run, peer, {"framework": "verl", "job": "A", "error": "failed"}]}))
    out = tmp_path / "t.png"
    assert plot_timeline.main([str(results), "--job", "A", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = plot_timeline.plot(json.loads(results.read_text()), "A", tmp_path / "u.png")
    assert drawn == ["generate", "rollout_sleep", "learner_reload", "score", "train", "push", "learner_offload",
                     "between"]  # zero-length phases (logprobs, advantages) are not drawn


def test_a_trace_without_memory_or_a_job_without_runs_is_refused_by_name(tmp_path):
    old = {"framework": "rlmesh", "job": "B", "gpu_trace": [(0.0, 50.0)]}
    with pytest.raises(SystemExit, match="no memory column"):
        plot_timeline.plot({"results": [old]}, "B", tmp_path / "x.png")
    with pytest.raises(SystemExit, match="no run of job A"):
        plot_timeline.plot({"results": [old]}, "A", tmp_path / "x.png")
