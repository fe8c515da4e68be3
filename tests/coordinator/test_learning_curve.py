"""The learning-curve PNG from a run folder's metrics.jsonl: the held-out points with their intervals,
wall-clock minutes from the first record, and a clear error for a run that evaluated nothing."""

import json

import pytest

from services.coordinator.cli.learning_curve import accuracy_points, plot_learning_curve
from services.coordinator.cli.plot import read_metrics


def write_run(run_dir, with_eval=True):
    records = []
    for step in range(0, 7):
        r = {"global_step": step, "unix_time": 1000.0 + 30 * step}
        if step:
            r.update({"reward/mean": 0.1 * step, "kl/mean": 0.01 * step, "response_length/mean": 20 - step,
                      "response_length/truncated_ratio": 0.5 - 0.05 * step, "time/step_s": 30.0})
        if with_eval and step % 3 == 0:
            r.update({"eval/pass@1": 0.4 + 0.05 * step, "eval/pass@1_ci_low": 0.3 + 0.05 * step,
                      "eval/pass@1_ci_high": 0.5 + 0.05 * step})
        records.append(r)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_accuracy_points_are_the_evaluated_steps_in_minutes_from_the_first_record(tmp_path):
    write_run(tmp_path)
    points = accuracy_points(read_metrics(tmp_path))
    assert points["step"] == [0, 3, 6]
    assert points["minutes"] == pytest.approx([0.0, 1.5, 3.0])
    assert points["accuracy"] == pytest.approx([0.4, 0.55, 0.7])
    assert points["low"] == pytest.approx([0.3, 0.45, 0.6]) and points["high"] == pytest.approx([0.5, 0.65, 0.8])


def test_plot_writes_a_png(tmp_path):
    write_run(tmp_path / "run")
    out = plot_learning_curve(tmp_path / "run", tmp_path / "out" / "curve.png", title="t")
    assert out == tmp_path / "out" / "curve.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_a_run_without_held_out_evaluation_is_refused_by_name(tmp_path):
    write_run(tmp_path, with_eval=False)
    with pytest.raises(ValueError, match="--eval_dataset"):
        plot_learning_curve(tmp_path, tmp_path / "curve.png")
