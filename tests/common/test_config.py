import dataclasses
import subprocess
import sys

import pytest

from services.common.config import ConfigError, opt, parse_config, to_argv
from services.common.server import ServerConfig


@dataclasses.dataclass
class DemoConfig(ServerConfig):
    """Demo service."""

    pretrain: str = opt("", "model folder")
    temperature: float = opt(1.0, "sampling temperature")
    enable_prefix_caching: bool = opt(True, "reuse KV cache of shared prefixes")
    urls: list[str] = opt([], "reward URLs")
    derived_value: int = opt(0, "computed in validate()", derived=True)

    def validate(self):
        self.validate_server()
        if self.temperature < 0:
            raise ConfigError(f"--temperature {self.temperature} must be >= 0; use 0 for greedy")
        self.derived_value = len(self.urls)


def test_cli_yaml_and_precedence(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("pretrain: /m\ntemperature: 0.5\nurls: [a, b]\nenable_prefix_caching: false\n")
    cfg = parse_config(DemoConfig, ["--config", str(cfg_file), "--temperature", "0.7"])
    assert (cfg.pretrain, cfg.temperature, cfg.urls, cfg.enable_prefix_caching) == ("/m", 0.7, ["a", "b"], False)
    assert cfg.derived_value == 2
    assert parse_config(DemoConfig, ["--no-enable_prefix_caching"]).enable_prefix_caching is False


def test_to_argv_round_trips():
    cfg = parse_config(DemoConfig, ["--pretrain", "/x", "--urls", "u1", "--no-enable_prefix_caching", "--port", "5"])
    assert parse_config(DemoConfig, to_argv(cfg)) == cfg


def test_validation_and_unknown_yaml_keys_fail_with_a_fix(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, ["--temperature", "-1"])
    assert "config error: --temperature -1.0 must be >= 0; use 0 for greedy" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("temprature: 1\n")
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, ["--config", str(bad)])
    assert "unknown option(s) ['temprature']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, ["--tls_cert", "/nonexistent.pem"])
    assert "--tls_cert and --tls_key must be given together" in capsys.readouterr().err


def test_help_lists_every_option_with_help():
    out = subprocess.run([sys.executable, "-m", "tests.common.echo_server", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for f in dataclasses.fields(ServerConfig):
        assert f"--{f.name}" in out
    assert "how long in-flight calls may run" in out
