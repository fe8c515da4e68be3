"""Step-time spread: vs_peers.py keeps every measured step and reports mean, median and range (per
phase too); bench/gpu/spread.py compares the same job and framework across leases' results files."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import spread  # noqa: E402
import vs_peers  # noqa: E402


def test_spread_of_fixed_values():
    assert spread.spread([4.0, 1.0, 2.0, 3.0]) == {"n": 4, "mean": 2.5, "median": 2.5, "min": 1.0, "max": 4.0}
    assert spread.spread([]) == {}


def _rlmesh_steps(ends, generate):
    return [{"t_end": t, "response_length/mean": 100.0, "time/step_s": 1.0, "time/generate_s": g, "time/train_s": 1.0}
            for t, g in zip(ends, generate)]


def test_summary_keeps_every_step_and_phase_with_mean_median_and_range():
    # step ends at 10, 16, 20, 29 s: steps 2..4 took 6, 4 and 9 s
    summary = vs_peers.summarize("rlmesh", _rlmesh_steps([10.0, 16.0, 20.0, 29.0], [5.0, 3.0, 2.0, 6.0]), 512)
    assert summary["step_s"] == [6.0, 4.0, 9.0]
    assert summary["step_stats"] == {"n": 3, "mean": pytest.approx(19 / 3), "median": 6.0, "min": 4.0, "max": 9.0}
    assert (summary["step_median_s"], summary["step_min_s"], summary["step_max_s"]) == (6.0, 4.0, 9.0)
    assert summary["step_mean_s"] == pytest.approx(19 / 3)
    assert summary["phases_s"]["generate"] == [3.0, 2.0, 6.0]  # step 1 is left out, as for the step time
    assert summary["phases_stats"]["generate"] == {"n": 3, "mean": pytest.approx(11 / 3), "median": 3.0, "min": 2.0,
                                                   "max": 6.0}
    run = {"framework": "rlmesh", "job": "A", "peak_memory_gib": 1.0, **summary}
    text = vs_peers.table([run], "A")
    assert "6.00   6.33   4.00-9.00" in text and "generate=3.0(2.0-6.0)" in text, text


def test_across_leases_reads_vs_peers_and_run_items_files(tmp_path, capsys):
    lease1 = {"date_utc": "2026-12-04 10:00", "commit": "0a89ad5", "results": [
        {"framework": "rlmesh", "job": "A", "step_s": [7.0, 6.0, 8.0]},
        {"framework": "trl", "job": "A", "error": "failed"}]}
    lease2 = {"date_utc": "2026-12-05 10:00", "commit": "abc1234", "items": [
        {"item": "A:rlmesh", "results": [{"framework": "rlmesh", "job": "A", "step_s": [5.0, 5.5, 6.0]}]}]}
    table = spread.across_leases([lease1, lease2])
    assert set(table) == {("A", "rlmesh")}
    entry = table[("A", "rlmesh")]
    assert [lease["median"] for lease in entry["leases"]] == [7.0, 5.5]
    assert entry["medians"] == {"n": 2, "mean": 6.25, "median": 6.25, "min": 5.5, "max": 7.0}
    files = []
    for i, data in enumerate((lease1, lease2)):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(data))
    assert spread.main([str(f) for f in files]) == 0
    out = capsys.readouterr().out
    assert "across 2 leases: median of medians 6.25 s, range 5.50-7.00 (24% of the median)" in out, out
    assert spread.main([str(files[0]), "--framework", "verl"]) == 1
    assert spread.main([str(tmp_path / "missing.json")]) == 2
