"""The credentials of one run: which token its services and control API require, and what the
coordinator's own channels present.

The token is --auth_token_file / env RLMESH_AUTH_TOKEN (or RLMESH_AUTH_TOKEN_FILE) / --auth_token
when given, else a random one made for this run and written to {run_dir}/auth_token, readable by
this user only; `rlmesh control` and scripts read it there. The control API (Pause, Resume, Stop)
requires it, and so does every mutating RPC of the services the run starts (local and Ray
placement pass it to them in the environment). In static placement the services must have been
started with the same token. TLS: --tls_ca makes every channel of the coordinator use TLS, with
--tls_cert/--tls_key as its client certificate; the services the run starts serve with that same
certificate (services.common.security.launch_settings).
"""

from __future__ import annotations

import pathlib

from services.common.log import get_logger, log_event
from services.common.security import (ClientCredentials, launch_settings, new_token, resolve_token,
                                      set_client_credentials, write_token_file)

_log = get_logger("coordinator")
TOKEN_FILE = "auth_token"


def secure_run(config, run_dir: pathlib.Path) -> str:
    """Resolves the run's token (making one when none is given), sets the coordinator's client
    credentials and checks the TLS flags; returns the token. Raises ConfigError on bad flags."""
    token = resolve_token(config.auth_token, config.auth_token_file)
    if not token:
        token = new_token()
        write_token_file(run_dir / TOKEN_FILE, token)
        log_event(_log, "run.auth_token", file=str(run_dir / TOKEN_FILE),
                  note="control API and services require this token")
    tls = bool(config.tls_ca)
    credentials = ClientCredentials(tls_ca=config.tls_ca, tls_cert=config.tls_cert if tls else "",
                                    tls_key=config.tls_key if tls else "", token=token)
    if config.placement != "static":
        launch_settings(config, credentials)  # the services this run starts must be reachable with these
    set_client_credentials(credentials)
    return token
