"""torch.distributed rendezvous that stays on loopback when the ranks are on one machine.

torch's TCPStore server listens on every interface whatever host it is given, and gloo listens
on the address the machine's host name resolves to: a learner's rendezvous or a weight-sync group
meant for one machine would be reachable from others. When the rendezvous host is a loopback
address, the store here listens on that address alone and gloo on the loopback interface; any
other host keeps torch's behaviour (the ranks are on several machines and must reach each other).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a store or group is made: the Ray actors read NODE_ADDRESS_ENV only
    import torch.distributed as dist


# The address of this process's node, set by whoever placed it there (a Ray actor sets its node's
# address): what a gloo group here listens on and gives the other members.
NODE_ADDRESS_ENV = "RLMESH_NODE_ADDRESS"


def node_address() -> str:
    """This process's node address: RLMESH_NODE_ADDRESS, else 127.0.0.1."""
    return os.environ.get(NODE_ADDRESS_ENV) or "127.0.0.1"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 ("lo" on Linux, "lo0" on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return "lo"


@contextlib.contextmanager
def gloo_on_loopback(host: str):
    """While process groups are made through torch.distributed (which builds each gloo group's
    sockets from GLOO_SOCKET_IFNAME when it is created): on loopback when host is a loopback address
    and the user set no interface. Scoped, not process-wide: a learner whose own ranks share one
    machine still opens its weight-sync group to engines on other machines."""
    if not is_loopback(host) or "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def store(host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore at host:port (no waiting for the workers); its master listens on host alone when
    host is a loopback address."""
    import torch.distributed as dist

    if not (is_master and is_loopback(host)):
        return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timeout, wait_for_workers=False)
    address = "127.0.0.1" if host == "localhost" else host
    listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address, port))
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    bound = listener.getsockname()[1]
    # The store's server owns the descriptor from here on.
    return dist.TCPStore(host, bound, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def gloo_group(prefixed_store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta,
               host: str) -> dist.ProcessGroupGloo:
    """A gloo group whose sockets listen on loopback when the rendezvous host is a loopback address
    (this node's own one: node_address())."""
    import torch.distributed as dist

    if not is_loopback(host):
        return dist.ProcessGroupGloo(prefixed_store, rank, world_size, timeout)
    options = dist.ProcessGroupGloo._Options()
    # This node's own loopback address (127.0.0.2, ... on a cluster of one machine), not 127.0.0.1.
    local = node_address()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local if is_loopback(local) else "127.0.0.1")]
    options._timeout = timeout
    return dist.ProcessGroupGloo(prefixed_store, rank, world_size, options)
