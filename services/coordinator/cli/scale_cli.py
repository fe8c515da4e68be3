"""`rlmesh scale`: add or remove rollout / reward instances of a running coordinator (its Scale RPC).

    rlmesh scale rollout 3 --run_dir runs/tiny_grpo           # local / Ray: three engines from now on
    rlmesh scale reward 2 --address 127.0.0.1:50050 --run_dir runs/tiny_grpo
    rlmesh scale rollout --add 10.0.0.7:50051 --remove 10.0.0.5:50051 --address HOST:50050   # static

A new engine gets the current weights before its first prompt (at the next step start); a removed
instance finishes its in-flight work first. The call needs the run's token: --auth_token_file,
env RLMESH_AUTH_TOKEN(_FILE), or {run_dir}/auth_token. Without --address the address is read from
{run_dir}/control.json (the coordinator's --ready_file). TLS settings come from env RLMESH_TLS_CA /
RLMESH_TLS_CERT / RLMESH_TLS_KEY.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import grpc
from google.protobuf import json_format

from rlmesh.coordinator.v1 import coordinator_pb2 as pb
from rlmesh.coordinator.v1 import coordinator_pb2_grpc
from services.common.client import make_sync_channel
from services.common.config import ConfigError
from services.common.security import client_credentials
from services.coordinator.cli.control_cli import resolve


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlmesh scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("role", choices=("rollout", "reward"), help="which instances to scale")
    p.add_argument("replicas", type=int, nargs="?", default=0,
                   help="local / Ray placement: the number of instances wanted (>= 1)")
    p.add_argument("--add", nargs="*", default=[], metavar="HOST:PORT",
                   help="static placement: instances started by the deployment to add (they must serve)")
    p.add_argument("--remove", nargs="*", default=[], metavar="HOST:PORT",
                   help="static placement: instances to drain and remove from the run")
    p.add_argument("--address", default="", help="host:port of the coordinator's control API (its --port)")
    p.add_argument("--run_dir", default="", help="the run's folder: its auth_token (and control.json) are read")
    p.add_argument("--auth_token_file", default="", help="file holding the run's token")
    p.add_argument("--timeout_s", type=float, default=1200.0,
                   help="deadline of the call: new instances must start within it")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        address, token = resolve(args)
    except ConfigError as exc:
        print(f"rlmesh scale: {exc}", file=sys.stderr)
        return 2
    credentials = dataclasses.replace(client_credentials(), token=token)
    request = pb.ScaleRequest(role=args.role, replicas=args.replicas, add_addresses=args.add,
                              remove_addresses=args.remove)
    with make_sync_channel(address, credentials=credentials, default_timeout_s=args.timeout_s) as channel:
        try:
            reply = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Scale(request, timeout=args.timeout_s)
        except grpc.RpcError as exc:
            print(f"rlmesh scale {args.role} {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json.dumps(json_format.MessageToDict(reply, preserving_proto_field_name=True), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
