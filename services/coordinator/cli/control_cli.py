"""`rlmesh control`: the coordinator's control API from a shell.

    rlmesh control status --run_dir runs/tiny_grpo              # address and token from the run folder
    rlmesh control pause  --address 127.0.0.1:50050 --run_dir runs/tiny_grpo
    rlmesh control stop   --address HOST:50050 --tls_ca ca.pem --tls_cert me.pem --tls_key me.key --wait

Pause, Resume and Stop need the run's token: --auth_token_file, env RLMESH_AUTH_TOKEN(_FILE), or
{run_dir}/auth_token (written by `rlmesh train` when it made the token itself). With --run_dir
and no --address, the address is read from the coordinator's --ready_file if it was
{run_dir}/control.json. TLS: --tls_ca (and --tls_cert/--tls_key for mutual TLS), or env
RLMESH_TLS_CA / RLMESH_TLS_CERT / RLMESH_TLS_KEY.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import grpc
from google.protobuf import json_format

from rlmesh.coordinator.v1 import coordinator_pb2 as pb
from rlmesh.coordinator.v1 import coordinator_pb2_grpc
from services.common.client import make_sync_channel
from services.common.config import ConfigError
from services.common.security import client_credentials, read_token_file, resolve_token
from services.coordinator.fleet.security import TOKEN_FILE

ACTIONS = ("status", "pause", "resume", "stop")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlmesh control", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("action", choices=ACTIONS, help="what to ask the coordinator")
    p.add_argument("--address", default="", help="host:port of the coordinator's control API (its --port)")
    p.add_argument("--run_dir", default="", help="the run's folder: its auth_token (and control.json) are read")
    p.add_argument("--auth_token_file", default="", help="file holding the run's token (default: env "
                   "RLMESH_AUTH_TOKEN / RLMESH_AUTH_TOKEN_FILE, else {run_dir}/auth_token)")
    p.add_argument("--tls_ca", default="", help="PEM CA that signed the coordinator's certificate; enables TLS")
    p.add_argument("--tls_cert", default="", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls_key", default="", help="PEM key of --tls_cert")
    p.add_argument("--wait", action="store_true", help="stop: return once the run has ended")
    p.add_argument("--skip_checkpoint", action="store_true", help="stop: without the final checkpoint")
    p.add_argument("--timeout_s", type=float, default=None,
                   help="deadline of the call in seconds (default: 10; stop --wait: 3600, the run's end)")
    return p


def resolve(args) -> tuple[str, str]:
    """(address, token) from the flags, the environment and the run folder."""
    run_dir = pathlib.Path(args.run_dir) if args.run_dir else None
    address = args.address
    if not address and run_dir is not None and (run_dir / "control.json").is_file():
        address = json.loads((run_dir / "control.json").read_text())["address"]
    if not address:
        raise ConfigError("give --address HOST:PORT of the coordinator's control API (or --run_dir of a run "
                          "started with --ready_file {run_dir}/control.json)")
    token = resolve_token("", args.auth_token_file)
    if not token and run_dir is not None and (run_dir / TOKEN_FILE).is_file():
        token = read_token_file(str(run_dir / TOKEN_FILE), "--run_dir")
    return address, token


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        address, token = resolve(args)
    except ConfigError as exc:
        print(f"rlmesh control: {exc}", file=sys.stderr)
        return 2
    credentials = dataclasses.replace(client_credentials(), token=token)
    if args.tls_ca or args.tls_cert or args.tls_key:
        credentials = dataclasses.replace(credentials, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                                          tls_key=args.tls_key)
    timeout = args.timeout_s or (3600.0 if args.action == "stop" and args.wait else 10.0)
    with make_sync_channel(address, credentials=credentials, default_timeout_s=timeout) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        calls = {"status": lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=timeout),
                 "pause": lambda: stub.Pause(pb.PauseRequest(), timeout=timeout),
                 "resume": lambda: stub.Resume(pb.ResumeRequest(), timeout=timeout),
                 "stop": lambda: stub.Stop(pb.StopRequest(skip_checkpoint=args.skip_checkpoint, wait=args.wait),
                                           timeout=timeout)}
        try:
            reply = calls[args.action]()
        except grpc.RpcError as exc:
            print(f"rlmesh control {args.action} {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json.dumps(json_format.MessageToDict(reply, preserving_proto_field_name=True), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
