"""Who may call a service: a shared token on every RPC that changes or spends something, and the
credentials (TLS CA, client certificate, token) a process's own client channels present.

Server side: when a service has a token (`--auth_token_file`, env RLMESH_AUTH_TOKEN or
RLMESH_AUTH_TOKEN_FILE, or `--auth_token`), every RPC except the read-only ones in
`OPEN_METHODS` (health, reflection, GetInfo / GetModelInfo / GetRewardInfo, the coordinator's
GetStatus / StreamMetrics) must carry the metadata `authorization: Bearer <token>`; others get
UNAUTHENTICATED with a message saying what to send. Deny by default: a new RPC is protected until
it is listed as open here. Without a token nothing is checked (TLS with a client CA still is), so
a service refuses to start without one on an address other machines can reach unless told
`--allow_unauthenticated` (`check_exposure`), and warns when it serves loopback without one.

Client side: `client_credentials()` is what every channel of this process uses unless the caller
passes its own. It starts from the environment (RLMESH_AUTH_TOKEN / RLMESH_AUTH_TOKEN_FILE,
RLMESH_TLS_CA / _CERT / _KEY); the coordinator replaces it once at start-up from its flags
(`set_client_credentials`) and hands the services it starts the same certificate and token
(`launch_settings`).
Channels to third-party servers (the reward service's remote reward servers) pass their own,
empty, credentials so that the token never leaves the run.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import os
import pathlib
import secrets
import socket

import grpc

from services.common.config import ConfigError

TOKEN_ENV = "RLMESH_AUTH_TOKEN"
TOKEN_FILE_ENV = "RLMESH_AUTH_TOKEN_FILE"
METADATA_KEY = "authorization"
SCHEME = "Bearer "

# Read-only RPCs anyone who can reach the port may call (health probes, dashboards, discovery).
OPEN_METHODS = frozenset({
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/rlmesh.rollout.v1.RolloutService/GetModelInfo",
    "/rlmesh.learner.v1.LearnerService/GetInfo",
    "/rlmesh.reward.v1.RewardService/GetRewardInfo",
    "/rlmesh.coordinator.v1.CoordinatorService/GetStatus",
    "/rlmesh.coordinator.v1.CoordinatorService/StreamMetrics",
})


def read_token_file(path: str, flag: str) -> str:
    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"{flag} {path}: no such file; write the shared token into it (one line)")
    token = file.read_text().strip()
    if not token:
        raise ConfigError(f"{flag} {path} is empty; write the shared token into it (one line)")
    return token


def resolve_token(auth_token: str = "", auth_token_file: str = "") -> str:
    """The shared token: --auth_token, else --auth_token_file, else env RLMESH_AUTH_TOKEN, else the
    file env RLMESH_AUTH_TOKEN_FILE names; "" when none is set (no check)."""
    if auth_token:
        return auth_token.strip()
    if auth_token_file:
        return read_token_file(auth_token_file, "--auth_token_file")
    if os.environ.get(TOKEN_ENV, "").strip():
        return os.environ[TOKEN_ENV].strip()
    if os.environ.get(TOKEN_FILE_ENV):
        return read_token_file(os.environ[TOKEN_FILE_ENV], f"env {TOKEN_FILE_ENV}")
    return ""


def new_token() -> str:
    """A random token for one run (256 bits)."""
    return secrets.token_urlsafe(32)


def write_token_file(path: pathlib.Path, token: str) -> None:
    """Writes the token readable by this user only (created with mode 0600, never world-readable)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


# ----------------------------------------------------------------------------------------------
# Server side


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only: 127.0.0.0/8, ::1, or a
    name that resolves to loopback addresses only. Every interface ("", 0.0.0.0, ::), any other
    address and a name that does not resolve count as reachable from elsewhere."""
    host = host.strip().removeprefix("[").removesuffix("]")
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in socket.getaddrinfo(host, None)]
        except OSError:
            return False
    mapped = [getattr(a, "ipv4_mapped", None) or a for a in addresses]  # ::ffff:127.0.0.1 is loopback too
    return bool(mapped) and all(a.is_loopback for a in mapped)


def check_exposure(service: str, host: str, token: str, mutual_tls: bool, allow_unauthenticated: bool) -> str:
    """Secure by default: raises ConfigError when `service` would serve a non-loopback `host` with
    neither a token nor mutual TLS (anyone reaching the port could train, push weights, export),
    unless `allow_unauthenticated`. Returns a warning to log when it serves without either (on
    loopback, or allowed explicitly), "" when callers must authenticate."""
    if token or mutual_tls:
        return ""
    if not is_loopback(host):
        if not allow_unauthenticated:
            raise ConfigError(
                f"the {service} service would serve --host {host or '(every interface)'} without a token: anyone who "
                f"reaches the port could call its mutating RPCs (train, push weights, save, export). Give it the "
                f"run's shared token (--auth_token_file FILE, or env {TOKEN_ENV} / {TOKEN_FILE_ENV}; the "
                f"coordinator needs the same), require client certificates (--tls_client_ca), bind loopback "
                f"(--host 127.0.0.1), or pass --allow_unauthenticated to serve this network without a check")
        return (f"--allow_unauthenticated: serving {host or '(every interface)'} without a token; anyone who reaches "
                f"the port may call every RPC")
    return (f"serving {host} without a token: every local user and process may call every RPC; set "
            f"--auth_token_file or env {TOKEN_ENV} (the coordinator's own launches always do)")


def _denied_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only aborts with code/message."""

    async def unary_response(request_or_iterator, context):
        await context.abort(code, message)

    async def stream_response(request_or_iterator, context):
        await context.abort(code, message)
        yield  # never reached; makes this an async generator like the handler it stands in for

    kind = (handler.request_streaming, handler.response_streaming)
    factory = {(False, False): grpc.unary_unary_rpc_method_handler,
               (False, True): grpc.unary_stream_rpc_method_handler,
               (True, False): grpc.stream_unary_rpc_method_handler,
               (True, True): grpc.stream_stream_rpc_method_handler}[kind]
    behaviour = stream_response if handler.response_streaming else unary_response
    return factory(behaviour, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC outside OPEN_METHODS that does not carry the shared token."""

    def __init__(self, token: str, service_name: str):
        self._expected = (SCHEME + token).encode()
        self.service_name = service_name

    def check(self, method: str, metadata) -> str:
        """"" when the call may proceed, else the reason it may not."""
        if method in OPEN_METHODS:
            return ""
        sent = next((value for key, value in metadata or () if key == METADATA_KEY), None)
        if sent is None:
            return (f"{method} on the {self.service_name} service needs the run's shared token: send the metadata "
                    f"'{METADATA_KEY}: {SCHEME}<token>' (rlmesh clients do when started with the same "
                    f"--auth_token_file or env {TOKEN_ENV} as this service)")
        value = sent.encode() if isinstance(sent, str) else sent
        if not hmac.compare_digest(value, self._expected):
            return (f"{method} on the {self.service_name} service: the token sent is not this service's; give the "
                    f"client the same --auth_token_file / env {TOKEN_ENV} the service was started with")
        return ""

    async def intercept_service(self, continuation, handler_call_details):
        reason = self.check(handler_call_details.method, handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if not reason or handler is None:
            return handler
        return _denied_handler(handler, grpc.StatusCode.UNAUTHENTICATED, reason)


# ----------------------------------------------------------------------------------------------
# Client side


@dataclasses.dataclass(frozen=True)
class ClientCredentials:
    """What this process's channels to rlmesh services present."""

    tls_ca: str = ""  # PEM CA bundle that signed the services' certificates; "" = plaintext
    tls_cert: str = ""  # PEM client certificate for mutual TLS (with tls_key); "" = none
    tls_key: str = ""
    token: str = ""  # shared token sent on every call; "" = none

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, SCHEME + self.token),) if self.token else ()


_client_credentials: ClientCredentials | None = None


def client_credentials() -> ClientCredentials:
    """This process's client credentials: what set_client_credentials set, else the environment's
    (token: RLMESH_AUTH_TOKEN / RLMESH_AUTH_TOKEN_FILE; TLS: RLMESH_TLS_CA, RLMESH_TLS_CERT,
    RLMESH_TLS_KEY; none of them: plaintext without a token)."""
    global _client_credentials
    if _client_credentials is None:
        _client_credentials = dataclasses.replace(credentials_from_env(os.environ), token=resolve_token())
    return _client_credentials


def set_client_credentials(credentials: ClientCredentials) -> None:
    """Sets what every channel of this process presents from now on (called once at start-up)."""
    global _client_credentials
    _client_credentials = credentials


TLS_ENV = {"tls_ca": "RLMESH_TLS_CA", "tls_cert": "RLMESH_TLS_CERT", "tls_key": "RLMESH_TLS_KEY"}


def credentials_from_env(env) -> ClientCredentials:
    """The client credentials a launch environment (launch_settings' env) carries."""
    return ClientCredentials(token=env.get(TOKEN_ENV, ""), **{f: env.get(v, "") for f, v in TLS_ENV.items()})


def launch_settings(server, credentials: ClientCredentials) -> tuple[list[str], dict[str, str]]:
    """Flags and environment for a service this process starts (local or Ray placement), so that it
    serves the way this process calls it: TLS with this process's certificate (`server`: its
    ServerConfig; the same identity on every service of the run), mutual TLS when this process
    requires client certificates, and the shared token. The token goes into the environment, never
    the command line, which `ps` shows to every user of the machine. The client TLS files go into
    the environment too, for whoever checks the service's health on the launching side (a Ray actor).
    """
    if server.tls_cert and not credentials.tls_ca:
        raise ConfigError("--tls_cert makes the services this run starts serve TLS; give --tls_ca (the CA that "
                          "signed --tls_cert) so that the coordinator can verify them")
    absolute = lambda path: str(pathlib.Path(path).resolve())  # noqa: E731 - services run in another folder
    argv: list[str] = []
    if server.tls_cert:
        argv += ["--tls_cert", absolute(server.tls_cert), "--tls_key", absolute(server.tls_key)]
    if server.tls_client_ca:
        argv += ["--tls_client_ca", absolute(server.tls_client_ca)]
    env = {TOKEN_ENV: credentials.token} if credentials.token else {}
    env.update({var: absolute(getattr(credentials, f)) for f, var in TLS_ENV.items() if getattr(credentials, f)})
    return argv, env
