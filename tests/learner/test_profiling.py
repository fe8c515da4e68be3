"""RLMESH_PROFILE_DIR: the learner's chosen calls are traced with the torch profiler, the others not;
the report's device-idle arithmetic."""

import gzip
import json

import pytest
import torch

from services.learner.profiling import CallProfiler, idle_report, parse_calls


def test_only_the_chosen_calls_are_traced(tmp_path):
    env = {"RLMESH_PROFILE_DIR": str(tmp_path), "RLMESH_PROFILE_CALLS": "logprobs:2,train_actor"}
    profile = CallProfiler(rank=0, environ=env)
    weight = torch.randn(64, 64)
    for name in ("logprobs", "logprobs", "train_actor", "train_actor", "logprobs"):
        with profile(name):
            torch.mm(weight, weight).sum()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "logprobs-2.trace.json.gz", "logprobs-2.txt", "train_actor-1.trace.json.gz", "train_actor-1.txt"]
    trace = json.loads(gzip.decompress((tmp_path / "logprobs-2.trace.json.gz").read_bytes()))
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    report = (tmp_path / "logprobs-2.txt").read_text()
    assert report.startswith("logprobs-2: ") and "aten::mm" in report
    # Other ranks, and a learner without the variable, trace nothing.
    for quiet in (CallProfiler(rank=1, environ=env), CallProfiler(rank=0, environ={})):
        with quiet("logprobs"):
            pass
        assert quiet.counts == {}


def test_calls_are_parsed_and_bad_ones_named():
    assert parse_calls("train_actor:2, logprobs:2:3,push_chunk") == {
        "train_actor": {2}, "logprobs": {2, 3}, "push_chunk": {1}}
    for bad in ("logprobs:x", "logprobs:0", ":2"):
        with pytest.raises(ValueError, match="RLMESH_PROFILE_CALLS"):
            parse_calls(bad)


def test_idle_report_counts_busy_time_and_the_longest_gaps():
    def kernel(ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur}

    events = [kernel(0, 1000), kernel(500, 1000),  # overlapping streams: busy 0..1500
              kernel(4500, 500, "gpu_memcpy"),  # after a 3 ms gap
              kernel(5200, 800),  # after a 0.2 ms gap
              {"ph": "X", "cat": "cpu_op", "name": "aten::nonzero", "ts": 1400, "dur": 3200}]
    lines = idle_report(events, gaps=1)
    assert lines[0].startswith("device busy 2.8 ms of 6.0 ms (47%), 2 idle gaps, 3.2 ms in gaps >= 200 us")
    assert lines[2].startswith("gap    3.00 ms at +     1.5 ms: aten::nonzero 3.00")
    assert idle_report([]) == ["no device activity recorded"]
