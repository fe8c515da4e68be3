"""Prometheus metrics over HTTP on a per-service port.

Names follow `rlmesh_<service>_<what>_<unit>`: counters end in `_total`, durations in `_seconds`,
sizes in `_bytes`. Each service defines its metrics with prometheus_client in its own module.
"""

import platform
import socket
from importlib import metadata

import prometheus_client


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


_build_info_created: set[str] = set()


def metric_name(service: str, what: str, unit: str = "") -> str:
    return "_".join(p for p in ("rlmesh", service, what, unit) if p)


def start_metrics_server(service: str, port: int, host: str = "127.0.0.1") -> int:
    """Serves the default registry on host:port (0 = a free port); returns the real port."""
    if service not in _build_info_created:
        info = prometheus_client.Info(metric_name(service, "build"), f"rlmesh {service} build information")
        info.info({"version": _version("rlmesh"), "python": platform.python_version(),
                   "torch": _version("torch"), "grpcio": _version("grpcio")})
        _build_info_created.add(service)
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    prometheus_client.start_http_server(port, addr=host)
    return port
