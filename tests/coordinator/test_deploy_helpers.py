"""The coordinator's pieces for deployments: `--run_config` for services, instances behind a service
name, the weight-sync rendezvous in static placement, and the wait for a final metrics scrape."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import prometheus_client
import pytest

from services.common.config import ConfigError
from services.coordinator.config import CoordinatorConfig
from services.coordinator.fleet.final_scrape import ScrapeWatch
from services.coordinator.fleet.placement import DEFAULT_WEIGHT_SYNC_PORT, Endpoints, StaticPlacement, instance_addresses
from services.coordinator.cli.run_config import expand_run_config, split_run_config


def test_split_run_config():
    assert split_run_config(["--run_config", "a.yaml", "--port", "1"]) == ("a.yaml", ["--port", "1"])
    assert split_run_config(["--port", "1", "--run_config=b.yaml"]) == ("b.yaml", ["--port", "1"])
    assert split_run_config(["--port", "1"]) == ("", ["--port", "1"])
    with pytest.raises(ConfigError, match="needs a FILE"):
        split_run_config(["--run_config"])


def test_run_config_gives_services_the_coordinators_options(tiny_model_dir, tiny_data_dir, tmp_path):
    (tmp_path / "run.yaml").write_text(
        f"pretrain: {tiny_model_dir}\nprompt_data: {tiny_data_dir / 'arith_train.jsonl'}\ninput_key: prompt\n"
        "label_key: label\nreward_func: math\nadvantage_estimator: group_norm\nn_samples_per_prompt: 4\n"
        "rollout_batch_size: 8\ntrain_batch_size: 16\nmicro_train_batch_size: 8\nmax_steps: 5\n"
        "actor_learning_rate: 3.0e-5\nprompt_max_len: 64\ngenerate_max_len: 24\ninit_kl_coef: 0.01\n"
        # Placement keys belong to the coordinator; a service ignores them.
        "placement: static\nlearner_address: learner:50051\nrollout_addresses: [rollout:50051]\n")
    learner = expand_run_config("learner", ["--run_config", str(tmp_path / "run.yaml"), "--port", "7"])
    options, flag = {}, ""
    for arg in learner:  # flag -> its value(s), space-joined (--adam_betas takes two)
        if arg.startswith("--"):
            flag, options[arg] = arg, ""
        else:
            options[flag] = f"{options[flag]} {arg}".strip()
    assert options["--adam_betas"] == "0.9 0.95"
    assert options["--train_batch_size"] == "16" and options["--actor_learning_rate"] == "3e-05"
    # 5 global steps x 32 samples / 16 per optimizer step: the schedule spans the run.
    assert options["--max_steps"] == "10" and options["--max_len"] == "88"
    assert learner[-2:] == ["--port", "7"]  # the command line comes last, so it wins
    reward = expand_run_config("reward", ["--run_config", str(tmp_path / "run.yaml")])
    assert "--reward_func" in reward and "--ref_pretrain" in reward  # KL is on: it serves the reference too
    with pytest.raises(ConfigError, match="no such file"):
        expand_run_config("rollout", ["--run_config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match="not coordinator"):
        expand_run_config("coordinator", ["--run_config", str(tmp_path / "run.yaml")])


def test_instance_addresses_expands_names_with_several_records(monkeypatch):
    records = {"rollout": ["10.0.0.3", "10.0.0.2"], "learner": ["10.0.0.9"], "dual": ["10.0.0.5"]}

    def fake_getaddrinfo(host, port, family=0, type=0):  # noqa: A002 - socket's own parameter names
        if host not in records or family == socket.AF_INET6 and host != "dual":
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        if family == socket.AF_INET6:
            return [(socket.AF_INET6, type, 6, "", ("fd00::5", port, 0, 0))]
        return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in records[host]]

    # A DNS server with several records per name cannot be set up in a test; the lookup is faked.
    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    assert instance_addresses(["rollout:50051"]) == ["10.0.0.2:50051", "10.0.0.3:50051"]
    assert instance_addresses(["learner:50051", "dual:1", "nowhere:2"]) == ["learner:50051", "dual:1", "nowhere:2"]


def test_instance_addresses_keeps_a_dual_stack_host_as_one():
    assert instance_addresses(["localhost:50051", "127.0.0.1:50052"]) == ["localhost:50051", "127.0.0.1:50052"]


def test_static_weight_sync_master_defaults():
    cfg = CoordinatorConfig(placement="static")
    placement = StaticPlacement(cfg)
    remote = asyncio.run(placement.weight_sync_master(Endpoints([], [], [], "learner.example:50051")))
    assert remote == ("learner.example", DEFAULT_WEIGHT_SYNC_PORT)
    host, port = asyncio.run(placement.weight_sync_master(Endpoints([], [], [], "127.0.0.1:50051")))
    assert host == "127.0.0.1" and port > 0
    cfg.weight_sync_master = "10.1.2.3:4567"
    assert asyncio.run(placement.weight_sync_master(Endpoints([], [], [], "learner:1"))) == ("10.1.2.3", 4567)


def test_scrape_watch_waits_for_a_scrape_after_the_end():
    registry = prometheus_client.CollectorRegistry()
    watch = ScrapeWatch(registry)
    # Nobody scrapes: no wait at all.
    start = time.monotonic()
    assert asyncio.run(watch.wait_for_scrape_after(time.monotonic(), 30.0)) is False
    assert time.monotonic() - start < 1.0
    # A scrape during the run (the count it exports includes the scrape itself).
    assert "rlmesh_coordinator_scrapes 1.0" in prometheus_client.generate_latest(registry).decode()
    # The next scrape comes 0.5 s after the end: the wait returns then, not at the timeout.
    since = time.monotonic()
    threading.Timer(0.5, prometheus_client.generate_latest, args=(registry,)).start()
    assert asyncio.run(watch.wait_for_scrape_after(since, 30.0)) is True
    assert 0.4 < time.monotonic() - since < 5.0
    # No scrape after the end: bounded by the timeout.
    since = time.monotonic()
    assert asyncio.run(watch.wait_for_scrape_after(since, 0.5)) is False
    assert time.monotonic() - since >= 0.5
    watch.close()
    assert "rlmesh_coordinator_scrapes" not in prometheus_client.generate_latest(registry).decode()
