"""This node's address as other hosts reach it (``metrics.bind: node``).

The node's name is what workers already use to reach the controller (``BATON_CONTROLLER_HOST``
under Slurm, else the host name; a local run's loopback contact address is not a name). The
address is what that name resolves to, a routable one first. Debian-style hosts map their
own name to 127.0.1.1: when the name gives only loopback and the job came from another host
(``SLURM_SUBMIT_HOST``, where a login-node Prometheus runs), the address of the interface
that routes there is taken instead (a UDP ``connect`` sends nothing). Loopback stays when
every other host is this one: then it is what they reach.
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from core.errors import UserError


@dataclass(frozen=True)
class NodeAddress:
    name: str  # the node's name (what scrapers may also use)
    ip: str  # the address to listen on and publish


def node_name(environ: Mapping[str, str]) -> str:
    """The name other hosts know this node by."""
    contact = environ.get("BATON_CONTROLLER_HOST", "")
    if contact and not _is_ip(contact):
        return contact
    return socket.gethostname()


def node_address(environ: Mapping[str, str]) -> NodeAddress:
    """This node's routable address (see the module's docstring); a one-line UserError when
    its name does not resolve."""
    name = node_name(environ)
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise UserError(f"metrics.bind: node: this node's name {name!r} does not resolve ({exc}); set "
                        "metrics.bind to one of its IP addresses, or 0.0.0.0 (all interfaces)") from None
    ips = list(dict.fromkeys(str(info[4][0]) for info in infos))
    ips.sort(key=lambda ip: (ipaddress.ip_address(ip).is_loopback, ":" in ip))  # routable, then IPv4, first
    routable = [ip for ip in ips if not ipaddress.ip_address(ip).is_loopback]
    if routable:
        return NodeAddress(name, routable[0])
    toward = _route_to(environ.get("SLURM_SUBMIT_HOST", ""))
    return NodeAddress(name, toward if toward is not None else ips[0])


def _route_to(host: str) -> str | None:
    """The local address of the interface that routes to ``host``; None when unknown."""
    if not host:
        return None
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # UDP: chooses the route, sends nothing
            return str(s.getsockname()[0])
    except (OSError, IndexError):
        return None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def url_host(ip: str) -> str:
    """``ip`` as it goes into a URL or a ``host:port`` target (IPv6 in brackets)."""
    return f"[{ip}]" if ":" in ip else ip
