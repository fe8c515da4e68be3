"""metrics.jsonl, TensorBoard, Prometheus and `rlmesh plot`."""

import json
import types

import prometheus_client
import pytest

from services.coordinator.loop.metrics import MetricsLog
from services.coordinator.cli.plot import main as plot_main


def fake_config(tmp_path, **kw):
    values = dict(use_tensorboard="", use_wandb="", wandb_project="p", wandb_org="", wandb_group="",
                  wandb_run_name="")
    values.update(kw)
    return types.SimpleNamespace(**values)


def test_jsonl_prometheus_tensorboard_and_plot(tmp_path):
    run = tmp_path / "run"
    log = MetricsLog(run, fake_config(tmp_path, use_tensorboard=str(tmp_path / "tb")))
    for step in (1, 2, 3):
        log.log(step, {"reward/mean": 0.1 * step, "kl/mean": 0.01, "response_length/mean": 5.0 + step,
                       "time/step_s": 2.0, "nan_metric": float("nan")})
    log.close()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records] == [1, 2, 3] and "nan_metric" not in records[0]
    assert prometheus_client.REGISTRY.get_sample_value("rlmesh_coordinator_reward_mean") == pytest.approx(0.3)
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert plot_main([str(run)]) == 0
    assert (run / "plots" / "summary.png").stat().st_size > 1000
    assert (run / "plots" / "reward_mean.png").is_file()


def test_resumed_run_drops_redone_steps(tmp_path):
    run = tmp_path / "run"
    log = MetricsLog(run, fake_config(tmp_path))
    for step in (1, 2, 3):
        log.log(step, {"reward/mean": float(step)})
    log.close()
    resumed = MetricsLog(run, fake_config(tmp_path), resumed_step=2)
    resumed.log(3, {"reward/mean": 30.0})
    resumed.close()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["global_step"], r["reward/mean"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_plot_reports_a_missing_run(tmp_path, capsys):
    assert plot_main([str(tmp_path / "nope")]) == 2
    assert "no metrics file" in capsys.readouterr().err


def test_plot_reads_offline_trainer_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    assert plot_main([str(tmp_path)]) == 0
    assert (tmp_path / "plots" / "loss.png").is_file()


def test_wandb_offline_without_network(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    log = MetricsLog(tmp_path / "run", fake_config(tmp_path, use_wandb="offline", wandb_run_name="t"))
    log.log(1, {"reward/mean": 0.5})
    log.close()
    assert list((tmp_path / "run").rglob("*.wandb")), "no offline W&B run file was written"
    del wandb
