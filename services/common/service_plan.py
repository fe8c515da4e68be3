"""--dry_run of a service started by hand (`rlmesh serve rollout|reward|learner`, `python -m services.X`).

The flags are parsed and validated as for a start; then what the start would read is checked
(model folders, tokenizer, reward source files, ranks, whether the address may be served without a
token) and what it would start is printed: the service's own plan (services/rollout/dry_run.py,
services/reward/dry_run.py, services/learner/dry_run.py) with the address it would serve. No model is
loaded, no port is bound, no process or worker is started. A problem is a ConfigError naming the flag
(one line, exit 2), as at a real start.
"""

from __future__ import annotations

import pathlib
import sys

from services.common.config_error import ConfigError
from services.common.memory_estimate import parameter_count
from services.common.security import check_exposure, resolve_token

# Files that hold a tokenizer's vocabulary (fast, SentencePiece, byte-level BPE).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
DRY_RUN_HELP = ("check the flags and what the start would read (model folders, tokenizer, reward source), print "
                "what would be started and where it would serve, and exit; nothing is started")


def checked_model_folder(flag: str, path: str, tokenizer: bool = True, trust_remote_code: bool = False) -> int:
    """The parameters of the model a service would load from `path` (--flag), after checking that its
    weights (and, with `tokenizer`, a tokenizer that loads) are there; ConfigError naming the flag if not.
    The config already checked config.json."""
    params = parameter_count(path)
    if params is None:
        raise ConfigError(f"{flag} {path}: no weight files (*.safetensors, *.bin) there; give the folder of a saved "
                          "Hugging Face model")
    if tokenizer:
        if not any((pathlib.Path(path) / name).is_file() for name in TOKENIZER_FILES):
            raise ConfigError(f"{flag} {path}: no tokenizer there ({', '.join(TOKENIZER_FILES)}); save the "
                              "tokenizer beside the model")
        from transformers import AutoTokenizer

        try:
            AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{flag} {path}: its tokenizer does not load ({exc})") from None
    return params


def serving_line(name: str, config) -> str:
    """Where a service would serve, checked as ServiceRunner checks it (a non-loopback --host without a
    token or mutual TLS is a ConfigError). config: the service's ServerConfig."""
    token = resolve_token(config.auth_token, config.auth_token_file)
    warning = check_exposure(name, config.host, token, bool(config.tls_client_ca), bool(config.allow_unauthenticated))
    where = f"{config.host}:{config.port or '(a free port, reported on stdout and in --ready_file)'}"
    security = ("TLS" + (" with client certificates" if config.tls_client_ca else "") if config.tls_cert
                else "plaintext") + (", token required" if token else ", no token")
    metrics = ("" if config.metrics_port < 0 else
               f"; metrics on port {config.metrics_port or '(a free one)'}")
    return f"serves   gRPC on {where} ({security}){metrics}" + (f"\nnote     {warning}" if warning else "")


def print_service_plan(name: str, config, lines: list[str], out=None) -> int:
    """Prints the plan of service `name`: its own lines, then where it would serve. Returns 0."""
    text = "\n".join([f"dry run ({name}): nothing was started", *lines, serving_line(name, config)])
    print(text, file=out or sys.stdout, flush=True)
    return 0
