"""User errors through the real command lines: the message on stderr, no traceback (exit 2, or 1
for a run that had started), and the traceback back with RLMESH_DEBUG=1 or --debug. A bug keeps
its traceback. services/common/user_errors.py is the one place that decides."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import ConfigError
from services.common.datasets import DatasetError
from services.common.security import TOKEN_ENV, TOKEN_FILE_ENV
from services.common.user_errors import DEBUG_ENV, ServiceUnreachable, run_command
from tests.conftest import get_free_port

ROOT = Path(__file__).resolve().parents[1]
EMPTY_FILE = "no usable rows: the file is empty"


def start(argv: list[str], debug: bool = False) -> subprocess.Popen:
    # No shared token from the environment: a service on a non-loopback address must then refuse to start.
    env = {k: v for k, v in os.environ.items() if k not in (DEBUG_ENV, TOKEN_ENV, TOKEN_FILE_ENV)}
    env.update(GRPC_VERBOSITY="ERROR", **({DEBUG_ENV: "1"} if debug else {}))
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def test_run_command_prints_user_errors_and_lets_bugs_through(monkeypatch, capsys):
    # "0" is off; monkeypatch restores the variable's absence afterwards, also after --debug set it
    # to "1" below (left set, every later test's commands would print tracebacks).
    monkeypatch.setenv(DEBUG_ENV, "0")

    def fails_with(exc):
        return lambda argv: (_ for _ in ()).throw(exc)

    assert run_command(fails_with(DatasetError("d.jsonl: no usable rows; fix it")), []) == 2
    err = capsys.readouterr().err
    assert err == "data error: d.jsonl: no usable rows; fix it\n"
    assert run_command(fails_with(ServiceUnreachable("--learner_address: h:1 did not answer")), []) == 2
    assert capsys.readouterr().err == "error: --learner_address: h:1 did not answer\n"
    with pytest.raises(KeyError):  # a bug: the traceback stays
        run_command(fails_with(KeyError("x")), [])
    # --debug leaves the command line, turns debugging on (children inherit it), prints the traceback.
    seen = []
    assert run_command(lambda argv: seen.append(argv) or 0, ["--a", "--debug", "b"]) == 0
    assert seen == [["--a", "b"]] and os.environ[DEBUG_ENV] == "1"
    assert run_command(fails_with(ConfigError("--x 1 must be > 2")), []) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.endswith("config error: --x 1 must be > 2\n")


def test_train_ppo_ray_user_errors(tiny_model_dir, tiny_data_dir, tmp_path):
    """An empty data file, a bad value and unreachable static addresses: each a message alone."""
    (tmp_path / "empty.jsonl").write_text("")
    base = ["-m", "services.coordinator.train_ppo_ray", "--pretrain", str(tiny_model_dir), "--reward_func", "math",
            "--input_key", "prompt", "--label_key", "label", "--port", "0", "--metrics_port", "-1"]
    empty = base + ["--prompt_data", str(tmp_path / "empty.jsonl"), "--run_dir", str(tmp_path / "run_empty")]
    data = ["--prompt_data", str(tiny_data_dir / "arith_train.jsonl")]
    bad_value = base + data + ["--run_dir", str(tmp_path / "run_bad"), "--temperature", "-1"]
    learner = f"127.0.0.1:{get_free_port()}"  # nothing listens there
    static = base + data + ["--run_dir", str(tmp_path / "run_static"), "--placement", "static",
                            "--rollout_addresses", f"127.0.0.1:{get_free_port()}",
                            "--reward_addresses", f"127.0.0.1:{get_free_port()}",
                            "--learner_address", learner, "--service_start_timeout_s", "2"]
    procs = {"empty": start(empty), "empty_debug": start(empty, debug=True), "bad": start(bad_value),
             "bad_debug": start(bad_value, debug=True), "static": start(static),
             "static_debug": start(static + ["--debug"])}
    results = {name: finish(proc) for name, proc in procs.items()}

    code, err = results["empty"]
    assert code == 2 and f"data error: {tmp_path / 'empty.jsonl'}: {EMPTY_FILE}" in err, err
    assert "Traceback" not in err, err
    code, err = results["bad"]
    assert code == 2 and "config error: --temperature -1.0 must be >= 0" in err and "Traceback" not in err, err
    # The run had started (control API up) when the services were looked for: exit 1, still no traceback.
    code, err = results["static"]
    assert code == 1 and "\nerror: " in err and f"--learner_address: {learner} did not report SERVING within 2 s" in err
    assert "--service_start_timeout_s" in err and "Traceback" not in err, err
    for name in ("empty_debug", "bad_debug", "static_debug"):
        code, err = results[name]
        assert "Traceback (most recent call last)" in err and code == results[name.removesuffix("_debug")][0], err


def test_offline_trainer_empty_data_file(tiny_model_dir, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    argv = ["-m", "services.learner.train_sft", "--pretrain", str(tiny_model_dir), "--dataset",
            str(tmp_path / "empty.jsonl"), "--input_key", "prompt", "--output_key", "response",
            "--save_path", str(tmp_path / "out")]
    plain, debug = start(argv), start(argv, debug=True)
    code, err = finish(plain)
    assert code == 2 and f"data error: {tmp_path / 'empty.jsonl'}: {EMPTY_FILE}" in err, err
    assert "Traceback" not in err, err
    code, err = finish(debug)
    assert code == 2 and "Traceback (most recent call last)" in err and EMPTY_FILE in err, err


def test_rlmesh_serve_reward_and_learner_on_a_port_in_use(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["-m", "services.cli", "serve", "reward", "--reward_func", "math", "--port", str(port),
                "--metrics_port", "-1"]
        # The learner finds the port taken after its model is up: the same line and exit code.
        learner = start(["-m", "services.learner", "--pretrain", str(tiny_model_dir), "--port", str(port),
                         "--metrics_port", "-1"])
        plain, debug = start(argv), start(argv, debug=True)
        (code, err), (debug_code, debug_err) = finish(plain), finish(debug)
        learner_code, learner_err = finish(learner)
    assert code == 2 and f"config error: could not bind 127.0.0.1:{port}" in err and "Choose another --port" in err, err
    assert "Traceback" not in err, err
    assert debug_code == 2 and "Traceback (most recent call last)" in debug_err, debug_err
    assert learner_code == 2 and "Traceback" not in learner_err, learner_err
    last = learner_err.rstrip().splitlines()[-1]  # the last line is the error, no stray exit code after it
    assert last.startswith(f"config error: could not bind 127.0.0.1:{port}"), learner_err


def test_every_service_refuses_an_open_address_without_a_token_alike(tiny_model_dir):
    """--host 0.0.0.0 without a token: the same one line and exit 2 from the learner (started by hand
    either way) as from the other services, before anything heavy starts (no store, no ranks)."""
    open_host = ["--host", "0.0.0.0", "--port", "0", "--metrics_port", "-1"]
    commands = {
        "learner": ["-m", "services.learner", "--pretrain", str(tiny_model_dir), *open_host],
        "serve learner": ["-m", "services.cli", "serve", "learner", "--pretrain", str(tiny_model_dir), *open_host],
        "reward": ["-m", "services.cli", "serve", "reward", "--reward_func", "math", *open_host],
    }
    procs = {name: start(argv) for name, argv in commands.items()}
    debug = start(commands["learner"], debug=True)
    results = {name: finish(proc) for name, proc in procs.items()}
    for name, (code, err) in results.items():
        service = name.split()[-1]
        assert code == 2, (name, code, err)
        # One line, nothing after it (the learner used to add a stray "2" and exit 1).
        assert err.splitlines() == [err.strip()] and err.startswith(
            f"config error: the {service} service would serve --host 0.0.0.0 without a token"), (name, err)
        assert "--auth_token_file" in err and "--allow_unauthenticated" in err, (name, err)
    debug_code, debug_err = finish(debug)
    assert debug_code == 2 and "Traceback (most recent call last)" in debug_err, debug_err
    assert debug_err.rstrip().endswith(results["learner"][1].rstrip()), debug_err
