"""aioproc.metrics' exporters: the HTTP server, the ASGI app, the aiohttp handler, attacked.

The server is scraped over real sockets; the leak check around every test
sees that closing it leaves no fd behind.  The attacks are the ones a local
user can make on a supervisor's metrics port: thousands of half-open
connections, a page of thousands of groups scraped while workers exit, a
client that never reads, a close with requests in flight.  The flood and the
close runs are made against servers in child processes, so that their fds,
their limits and their stderr are their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from helpers import REPO_ROOT, loop_name, python

import aioproc
import aioproc.metrics as metrics
from aioproc._metrics import hooks
from aioproc._metrics import server as server_module
from aioproc.metrics import Recorder


@pytest.fixture(autouse=True)
def _process_default_restored() -> Iterator[None]:
    """Every test leaves the process-wide recorder as it found it (off)."""
    before = hooks.current
    yield
    hooks.current = before


def running_groups(n: int, *, recorder: Recorder | None = None) -> Recorder:
    """A recorder with ``n`` groups of two workers each, all running: none expires."""
    rec = Recorder() if recorder is None else recorder
    for i in range(n):
        group = f"job-{i}"
        rec.group_queued(group, "default", 0.0)
        rec.worker_started(group, "default")
        rec.worker_started(group, "default")
        rec.group_started(group, "default", 0.05)
        rec.output(group, "default", "stdout", 10, 400)
        rec.output(group, "default", "stderr", 1, 40)
    return rec


async def _http(
    port: int, request: bytes, *, host: str = "127.0.0.1"
) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 30)  # the server closes
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionResetError:
            pass  # a refusal closes with the request unread: a reset after the answer
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in header_lines)}
    return int(status_line.split()[1]), headers, body


GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


# -- what the server answers --------------------------------------------------


async def test_server_answers_get_metrics_and_404s_the_rest() -> None:
    rec = Recorder()
    rec.worker_started("train", "default")
    server = await metrics.serve("127.0.0.1", 0, recorder=rec)
    try:
        assert server.port > 0 and server.host == "127.0.0.1"
        url = f"http://127.0.0.1:{server.port}/metrics"
        assert repr(server) == f"<MetricsServer {url} serving, 0 connections>"
        status, headers, body = await _http(server.port, GET)
        assert status == 200
        assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert headers["content-length"] == str(len(body))
        assert headers["connection"] == "close"
        assert body.decode() == metrics.render(rec)
        assert b'aioproc_workers_started_total{group="train",role="default"} 1.0\n' in body

        rec.worker_started("train", "default")  # each scrape reads the values of its time
        _, _, body = await _http(server.port, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")
        assert b'aioproc_workers_started_total{group="train",role="default"} 2.0\n' in body

        status, headers, body = await _http(server.port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
        assert (status, body) == (200, b"")
        assert int(headers["content-length"]) == len(metrics.render(rec).encode())
        for path in (b"/", b"/metricsx", b"/favicon.ico"):
            status, _, _ = await _http(server.port, b"GET " + path + b" HTTP/1.1\r\n\r\n")
            assert status == 404, path
        status, headers, _ = await _http(server.port, b"POST /metrics HTTP/1.1\r\n\r\n")
        assert (status, headers["allow"]) == (405, "GET, HEAD")
        status, _, _ = await _http(server.port, b"nonsense\r\n\r\n")
        assert status == 400
        status, _, body = await _http(server.port, b"GET /" + b"x" * 20000 + b" HTTP/1.1\r\n\r\n")
        assert (status, body) == (400, b"request head too long\n")
    finally:
        await server.aclose()
    assert repr(server) == f"<MetricsServer {url} closed, 0 connections>"
    with pytest.raises(ConnectionRefusedError):
        await _http(server.port, GET)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


async def test_serve_on_every_interface_answers_ipv4_and_ipv6_clients() -> None:
    """``serve("")`` listens on every interface of both families: a client of
    127.0.0.1 and one of ::1 (where the machine has IPv6) get the same page."""
    rec = Recorder()
    rec.worker_started("train", "default")
    async with metrics.serve("", 0, recorder=rec) as server:
        hosts = ["127.0.0.1"] + (["::1"] if _has_ipv6_loopback() else [])
        if len(hosts) == 2:
            assert server.host == "::" and server.url == f"http://[::]:{server.port}/metrics"
        for host in hosts:
            status, _, body = await _http(server.port, GET, host=host)
            assert (status, body.decode()) == (200, metrics.render(rec)), host
        with pytest.raises(OSError, match="in use"):  # the port taken: no fallback to IPv4
            async with metrics.serve("", server.port, recorder=rec):
                pass


async def test_server_follows_the_process_wide_recorder() -> None:
    async with metrics.serve() as server:
        _, headers, body = await _http(server.port, GET)
        assert (body, headers["content-length"]) == (b"", "0")  # metrics are off
        metrics.enable().group_started("g", "default", 0.1)
        _, _, body = await _http(server.port, GET)
        assert b'aioproc_groups_started_total{group="g",role="default"} 1.0\n' in body
    assert "closed" in repr(server)


async def test_a_page_of_many_chunks_arrives_whole_and_once_per_concurrent_render() -> None:
    """Requests arriving together share one render; each gets the whole page."""
    rec = running_groups(500)
    async with metrics.serve(recorder=rec) as server:
        pages = await asyncio.gather(*(_http(server.port, GET) for _ in range(8)))
    expected = metrics.render(rec).encode()
    assert len(expected) > 1_000_000  # many chunks, written as the socket takes them
    for status, headers, body in pages:
        assert (status, int(headers["content-length"])) == (200, len(expected))
        assert body == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"recorder": "nope"}, TypeError, r"expected an aioproc\.metrics\.Recorder or Registry"),
        ({"host": None}, TypeError, r"serve\(\) host must be a str, got None"),
        ({"port": "80"}, TypeError, r"serve\(\) port must be an int, got '80'"),
        ({"port": 70000}, ValueError, r"serve\(\) port must be 0-65535, got 70000"),
        ({"max_connections": 0}, ValueError, r"max_connections must be 1 or more, got 0"),
        ({"max_connections": True}, TypeError, r"max_connections must be an int, got True"),
    ],
)
def test_serve_refuses_bad_arguments_before_listening(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        metrics.serve(**kwargs)  # type: ignore[arg-type]


async def test_aclose_refuses_a_bad_grace_period_and_a_second_close_waits() -> None:
    server = await metrics.serve(recorder=Recorder())
    try:
        with pytest.raises(ValueError, match=r"aclose\(grace_period=\.\.\.\) must be"):
            await server.aclose(grace_period=-1)
        assert "serving" in repr(server)
    finally:
        await asyncio.gather(server.aclose(), server.aclose())
    await server.aclose()  # a third does nothing
    assert "closed" in repr(server)


# -- deadlines and the cap ------------------------------------------------------


async def _connected(port: int, data: bytes = b"") -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    if data:
        sock.sendall(data)
    return sock


async def _closed_by_server(sock: socket.socket, limit: float) -> bytes:
    """Read until the server closes: what it sent (a reset counts as closed)."""
    loop = asyncio.get_running_loop()
    received = b""
    try:
        while True:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), limit)
            if not data:
                return received
            received += data
    except ConnectionResetError:
        return received


async def _until(predicate: object, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_silent_or_slow_client_is_cut_off_by_the_deadlines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_module, "IDLE_TIMEOUT", 0.3)
    monkeypatch.setattr(server_module, "HEADER_TIMEOUT", 1.0)
    async with metrics.serve(recorder=Recorder()) as server:
        silent = await _connected(server.port)
        slow = await _connected(server.port, b"G")
        try:
            t0 = time.monotonic()
            # the slow one sends a byte every 0.1 s: never idle, but never done
            trickle = asyncio.ensure_future(
                _trickle(slow, b"ET /metrics HTTP/1.1\r\nX: " + b"y" * 40)
            )
            assert await _closed_by_server(silent, 5) == b""
            silent_after = time.monotonic() - t0
            assert await _closed_by_server(slow, 5) == b""
            slow_after = time.monotonic() - t0
            trickle.cancel()
            await asyncio.wait({trickle})
        finally:
            silent.close()
            slow.close()
        assert 0.25 < silent_after < 0.9, silent_after  # the idle deadline
        assert 0.9 < slow_after < 2.5, slow_after  # the head's deadline
        await _until(lambda: server.connections == 0)


async def _trickle(sock: socket.socket, data: bytes) -> None:
    for i in range(len(data)):
        try:
            sock.send(data[i : i + 1])
        except OSError:
            return
        await asyncio.sleep(0.1)


async def test_a_client_that_never_reads_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the send buffer is full and stays so, the idle deadline drops the connection."""
    monkeypatch.setattr(server_module, "IDLE_TIMEOUT", 0.5)
    rec = running_groups(2000)
    async with metrics.serve(recorder=rec) as server:
        sock = _never_reading()
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
            sock.sendall(GET)
            await _until(lambda: server.connections == 0, 20)
        finally:
            sock.close()


def _never_reading() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.setblocking(False)
    return sock


async def test_a_slow_reader_is_cut_off_by_the_write_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that keeps taking a little (never idle) still gets WRITE_TIMEOUT in all."""
    monkeypatch.setattr(server_module, "WRITE_TIMEOUT", 1.0)
    rec = running_groups(2000)
    page = len(metrics.render(rec).encode())
    loop = asyncio.get_running_loop()
    async with metrics.serve(recorder=rec) as server:
        sock = _never_reading()
        try:
            await loop.sock_connect(sock, ("127.0.0.1", server.port))
            sock.sendall(GET)
            t0 = time.monotonic()
            received = 0
            while True:
                try:
                    data = await asyncio.wait_for(loop.sock_recv(sock, 4096), 10)
                except ConnectionResetError:
                    break
                if not data:
                    break
                received += len(data)
                await asyncio.sleep(0.02)  # about 200 KB/s: the page would take 30 s
            took = time.monotonic() - t0
        finally:
            sock.close()
    assert 0.9 < took < 5, took
    assert 0 < received < page / 2, (received, page)


async def test_at_the_cap_a_new_connection_replaces_the_oldest_half_open_one() -> None:
    async with metrics.serve(recorder=Recorder(), max_connections=4) as server:
        socks = [await _connected(server.port, b"GET /met") for _ in range(4)]
        try:
            await _until(lambda: server.connections == 4)
            newest = await _connected(server.port, GET)
            # the oldest half-open connection made room; the newest is answered
            assert await _closed_by_server(socks[0], 5) == b""
            assert (await _closed_by_server(newest, 5)).startswith(b"HTTP/1.1 200 OK\r\n")
            await _until(lambda: server.connections == 3)
            newest.close()
        finally:
            for sock in socks:
                sock.close()


async def test_at_the_cap_with_every_connection_answered_a_new_one_gets_503() -> None:
    rec = running_groups(2000)
    async with metrics.serve(recorder=rec, max_connections=2) as server:
        readers = [_never_reading() for _ in range(2)]
        try:
            for sock in readers:
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
                sock.sendall(GET)
            # both wait for the page or for room in their windows: no slot is free
            await _until(lambda: not server._reading and server.connections == 2)
            status, _, body = await _http(server.port, GET)
            assert (status, body) == (503, b"too many connections, try again\n")
            assert server.connections == 2
        finally:
            for sock in readers:
                sock.close()


# -- attacks ------------------------------------------------------------------

SUPERVISOR = """
import asyncio, json, os, resource, sys, time
import aioproc, aioproc.metrics
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

def fds():
    names = os.listdir("/proc/self/fd")
    sockets = 0
    for name in names:
        try:
            sockets += os.readlink(f"/proc/self/fd/{name}").startswith("socket:")
        except OSError:
            pass
    return len(names), sockets

async def main():
    aioproc.metrics.enable()
    async with aioproc.metrics.serve() as server:
        base = fds()
        print(json.dumps({"port": server.port, "base": base}), flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)  # "go"
        peak = list(base)
        sampling = True

        async def sample():
            while sampling:
                total, sockets = fds()
                peak[0], peak[1] = max(peak[0], total), max(peak[1], sockets)
                await asyncio.sleep(0.002)

        sampler = asyncio.ensure_future(sample())
        stop = loop.run_in_executor(None, sys.stdin.readline)  # "stop"
        started = failed = 0
        errors = []
        while not stop.done() or started < 10:
            try:
                result = await aioproc.run(
                    "/bin/true", 8, logs_specs=aioproc.DefaultLogsSpecs(os.devnull)
                )
                started += 1
                failed += result.is_failed()
            except Exception as e:
                errors.append(repr(e))
                break
        sampling = False
        await sampler
        await stop
        print(json.dumps({"started": started, "failed": failed, "errors": errors,
                          "peak": peak, "connections": server.connections}), flush=True)

if sys.argv[1] == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""

ATTACKER = """
import json, resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if hard != resource.RLIM_INFINITY and hard < 2200:
    print(json.dumps({"skip": f"fd hard limit {hard}"}), flush=True); sys.exit(0)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2200), hard))
port = int(sys.argv[1])
held, failed = [], 0
for i in range(2000):
    s = socket.socket()
    s.settimeout(10)
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\nX-Slow: ")  # the head never ends
    except OSError:
        failed += 1
        s.close()
        continue
    held.append(s)
print(json.dumps({"connected": len(held), "failed": failed}), flush=True)
sys.stdin.readline()
"""


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*python(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )


async def _line(proc: subprocess.Popen[str], limit: float = 60) -> dict[str, object]:
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), limit)
    assert line, f"the child exited: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}"
    result: dict[str, object] = json.loads(line)
    return result


def _end(*procs: subprocess.Popen[str]) -> list[str]:
    errors = []
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.close()
        proc.stdout.close()
        errors.append(proc.stderr.read())
        proc.stderr.close()
    return errors


@pytest.mark.timeout(120)
async def test_2000_half_open_connections_while_groups_start() -> None:
    """No group start fails, and the supervisor's sockets stay within the cap.

    The supervisor runs with 1,024 fds, as many hosts give a service; 2,000
    connections each sending a request head that never ends used to take
    them all, and group starts failed with "Too many open files".
    """
    supervisor = _child(SUPERVISOR, loop_name())
    attacker: subprocess.Popen[str] | None = None
    try:
        ready = await _line(supervisor)
        assert supervisor.stdin is not None
        supervisor.stdin.write("go\n")
        supervisor.stdin.flush()
        attacker = _child(ATTACKER, str(ready["port"]))
        attack = await _line(attacker, 90)
        if "skip" in attack:
            pytest.skip(str(attack["skip"]))
        supervisor.stdin.write("stop\n")
        supervisor.stdin.flush()
        report = await _line(supervisor, 90)
    finally:
        errors = _end(*([supervisor] if attacker is None else [supervisor, attacker]))
    assert attack["connected"] == 2000, attack
    assert report["errors"] == [] and report["failed"] == 0, report
    assert isinstance(report["started"], int) and report["started"] >= 10
    base_sockets = ready["base"][1]  # type: ignore[index]
    peak_sockets = report["peak"][1]  # type: ignore[index]
    # the cap's connections, those being replaced, and a few
    bound = base_sockets + server_module.MAX_CONNECTIONS + server_module.EVICTING + 8
    assert peak_sockets <= bound, (report, ready)
    assert report["peak"][0] < 1024 - 100, report  # type: ignore[index]
    assert errors[0] == "", errors[0]


SCRAPER = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"GET /metrics HTTP/1.1\\r\\nConnection: close\\r\\n\\r\\n")
print("sent", flush=True)
data = bytearray()
while True:
    chunk = s.recv(1 << 20)
    if not chunk:
        break
    data += chunk
head, _, body = bytes(data).partition(b"\\r\\n\\r\\n")
print(head.split()[1].decode(), len(body), flush=True)
"""


@pytest.mark.timeout(120)
async def test_a_10000_group_page_scraped_while_workers_exit() -> None:
    """Each exit is noticed within 50 ms while the page is rendered and sent.

    The figure is the test's own: a worker writes ``time.monotonic()`` (one
    clock for every process on the host) as its last act, and the group's
    ``"exited"`` event takes the time again; the difference is how late the
    loop noticed.  The page (31 MB, 10,000 running groups) takes the loop
    half a second or more to render, so the six exits, one after another,
    all fall inside one scrape (checked: the scrape ends after the last).
    """
    rec = running_groups(10_000)
    worker = (
        "import os, signal, sys, time\n"
        "def leave(*_):\n"
        "    os.write(1, b'%r\\n' % time.monotonic())\n"
        "    os._exit(0)\n"
        "signal.signal(signal.SIGUSR1, leave)\n"
        "print('ready', flush=True)\n"
        "while True: signal.pause()\n"
    )
    exited: dict[int, float] = {}
    ready = asyncio.Event()
    lines = aioproc.OutputStream()
    n = 6

    def on_event(event: aioproc.WorkerEvent) -> None:
        if event.kind == "exited":
            exited[event.local_rank] = time.monotonic()

    specs = aioproc.DefaultLogsSpecs(os.devnull, tee=aioproc.Std.OUT)
    async with metrics.serve(recorder=rec) as server, aioproc.start_processes(
        "exits", sys.executable, {r: ("-c", worker) for r in range(n)}, {r: {} for r in range(n)},
        specs, sinks=[lines], on_event=on_event,
    ) as pc:  # fmt: skip
        said: dict[int, float] = {}

        async def read() -> None:
            readies = 0
            async for record in lines:
                if record.line == "ready":
                    readies += 1
                    if readies == n:
                        ready.set()
                else:
                    said[record.rank] = float(record.line)

        reader = asyncio.ensure_future(read())
        await asyncio.wait_for(ready.wait(), 30)
        # the scraper is a process of its own: reading 31 MB on this loop
        # would be the test's load, not the server's
        scraper = await asyncio.create_subprocess_exec(
            *python(SCRAPER), str(server.port), stdout=asyncio.subprocess.PIPE
        )
        try:
            assert scraper.stdout is not None
            assert await asyncio.wait_for(scraper.stdout.readline(), 30) == b"sent\n"
            await _until(lambda: server._render is not None)  # the render has begun
            pids = pc.pids()
            for rank in range(n):
                os.kill(pids[rank], signal.SIGUSR1)
                await _until(lambda rank=rank: rank in exited, 10)
            last_exit_seen = time.monotonic()
            got = await asyncio.wait_for(scraper.stdout.readline(), 60)
            scrape_done = time.monotonic()
        finally:
            if scraper.returncode is None:
                scraper.kill()
            await scraper.wait()
        result = await pc.wait()
        await reader
    assert not result.is_failed()
    status, size = got.split()
    assert status == b"200" and int(size) == len(metrics.render(rec).encode()) > 25_000_000
    assert scrape_done > last_exit_seen, "the exits were not all during the scrape"
    lags = sorted(exited[r] - said[r] for r in range(n))
    shown = [f"{lag * 1e3:.1f} ms" for lag in lags]
    # The median is held to 50 ms.  Each exit gets 200 ms: on a loaded 2-core
    # machine (load 20 while this was written) the kernel alone sometimes
    # leaves the supervisor unscheduled for tens of ms; a render on the loop
    # made every exit wait for the whole page (a second or more).
    assert statistics.median(lags) < 0.05, shown
    assert max(lags) < 0.2, shown


@pytest.mark.timeout(60)
async def test_a_never_reading_client_does_not_hold_aclose() -> None:
    rec = running_groups(2000)  # 6 MB: far past the socket buffers
    server = await metrics.serve(recorder=rec)
    sock = _never_reading()
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        sock.sendall(GET)
        head = await asyncio.get_running_loop().sock_recv(sock, 100)  # then never again
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        t0 = time.monotonic()
        await asyncio.wait_for(server.aclose(grace_period=0.5), 10)
        took = time.monotonic() - t0
    finally:
        await server.aclose()
        sock.close()
    assert 0.4 < took < 2.5, took  # the grace period, then the connection is dropped
    assert server.connections == 0


CLOSER = """
import asyncio, socket, sys, time
import aioproc.metrics as metrics
from aioproc.metrics import Recorder

rec = Recorder()
for i in range(2000):
    rec.worker_started(f"job-{i}", "default")
    rec.group_started(f"job-{i}", "default", 0.1)

async def main():
    server = await metrics.serve(recorder=rec)
    loop = asyncio.get_running_loop()
    socks = []
    for i in range(24):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        await loop.sock_connect(s, ("127.0.0.1", server.port))
        if i % 3 == 0:
            s.send(b"GET /metr")  # half a head
        elif i % 3 == 1:
            s.send(b"GET /metrics HTTP/1.1\\r\\n\\r\\n")  # a response it never reads
        socks.append(s)
    for _ in range(50):
        await asyncio.sleep(0.01)  # the responses under way fill their windows
    busy = server.connections
    s = socket.socket(); s.setblocking(False)
    await loop.sock_connect(s, ("127.0.0.1", server.port))
    s.send(b"GET /metrics HTTP/1.1\\r\\n\\r\\n")  # in flight as the close begins
    socks.append(s)
    t0 = time.monotonic()
    await server.aclose(grace_period=0.2)
    print(f"closed {busy} connections in {time.monotonic() - t0:.2f} s", flush=True)
    for s in socks:
        s.close()

if sys.argv[1] == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


@pytest.mark.timeout(60)
async def test_aclose_with_requests_in_flight_prints_nothing() -> None:
    """Python 3.10 and 3.11 printed a traceback per connection a close cancelled."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-W", "default", "-c", CLOSER, loop_name(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO_ROOT,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 50)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert err.decode() == ""
    assert proc.returncode == 0
    words = out.decode().split()
    assert words[:1] == ["closed"] and int(words[1]) >= 16, out
    assert float(words[4]) < 2.0, out


# -- the same page on the service's own server -----------------------------------


@pytest.fixture
async def asgi_port() -> AsyncIterator[int]:
    """``make_asgi_app()`` routed at /metrics of a Starlette app, served by uvicorn.

    (FastAPI's ``app.add_route`` is Starlette's; a ``Mount`` at /metrics
    answers at /metrics/ and redirects /metrics there.)
    """
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Route

    app = Starlette(routes=[Route("/metrics", metrics.make_asgi_app())])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))

    class Server(uvicorn.Server):
        # uvicorn takes SIGINT and SIGTERM while it serves, and gives them back
        # when it stops: here in the fixture's teardown, another run of the
        # loop than the one whose handler it took, which would stay installed
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    config = uvicorn.Config(app, log_level="error", lifespan="off")
    server = Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await _until(lambda: server.started, 20)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture
async def aiohttp_port() -> AsyncIterator[int]:
    """``make_aiohttp_handler()`` routed at /metrics of an aiohttp application."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/metrics", metrics.make_aiohttp_handler())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        assert runner.addresses
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def test_the_asgi_app_and_the_aiohttp_handler_serve_the_servers_page(
    asgi_port: int, aiohttp_port: int
) -> None:
    rec = metrics.enable(running_groups(300))  # a page of many chunks
    rec.pool_call("pool", "succeeded", 0.002)
    async with metrics.serve() as server:
        pages = {
            name: await _http(port, GET)
            for name, port in (
                ("server", server.port),
                ("asgi", asgi_port),
                ("aiohttp", aiohttp_port),
            )
        }
    expected = metrics.render().encode()
    for name, (status, headers, body) in pages.items():
        assert status == 200, name
        assert headers["content-type"] == metrics.CONTENT_TYPE, name
        assert int(headers["content-length"]) == len(expected), name
        assert body == expected, name
    for port in (asgi_port, aiohttp_port):
        status, headers, body = await _http(
            port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert (status, body) == (200, b"")
        assert int(headers["content-length"]) == len(expected)
        status, headers, _ = await _http(
            port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert status == 405 and "GET" in headers["allow"]


def test_the_aiohttp_handler_imports_aiohttp_only_when_made() -> None:
    code = (
        "import sys, aioproc.metrics as m\n"
        "app = m.make_asgi_app()\n"
        "assert 'aiohttp' not in sys.modules, 'imported by aioproc.metrics'\n"
        "m.make_aiohttp_handler()\n"
        "assert 'aiohttp' in sys.modules\n"
    )
    subprocess.run(python(code), check=True, timeout=60)


def test_the_apps_refuse_what_is_no_recorder() -> None:
    with pytest.raises(TypeError, match=r"expected an aioproc\.metrics\.Recorder"):
        metrics.make_asgi_app(recorder=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected an aioproc\.metrics\.Recorder"):
        metrics.make_aiohttp_handler(recorder=object())  # type: ignore[arg-type]


# -- cancellation and failures ----------------------------------------------------


async def test_cancelled_opens_and_closes_leave_nothing_behind() -> None:
    """Cancelled at every point of ``serve()`` and of ``aclose()``: no socket stays open."""
    rec = running_groups(300)
    for turns in range(12):
        opening = asyncio.ensure_future(metrics.serve(recorder=rec).__aenter__())
        for _ in range(turns % 4):
            await asyncio.sleep(0)
        opening.cancel()
        try:
            server = await opening
        except asyncio.CancelledError:
            continue  # cancelled before it listened: nothing to close
        await server.aclose()
    for turns in range(12):
        server = await metrics.serve(recorder=rec)
        port = server.port
        scrape = asyncio.ensure_future(_http(port, GET))
        half_open = await _connected(port, b"GET /met")
        try:
            # The scrape may be served whole before the half-open client is accepted.
            await _until(
                lambda server=server, scrape=scrape: (
                    server.connections == (1 if scrape.done() else 2)
                )
            )
            closing = asyncio.ensure_future(server.aclose(grace_period=0.1))
            for _ in range(turns + 1):  # at least one: a task cancelled unstarted never runs
                await asyncio.sleep(0)
            if closing.cancel():
                with pytest.raises(asyncio.CancelledError):
                    await closing  # the close ran to its end first (shielded), then re-raised
            else:
                await closing  # it had ended before the cancel (a scrape already served)
            assert server.connections == 0 and "closed" in repr(server)
            await asyncio.gather(scrape, return_exceptions=True)  # a page, or cut off
            assert await _closed_by_server(half_open, 5) == b""
        finally:
            half_open.close()
            scrape.cancel()
            await asyncio.gather(scrape, return_exceptions=True)
            await server.aclose()
        with pytest.raises(ConnectionRefusedError):
            await _http(port, GET)


async def test_a_render_that_fails_is_a_500_and_the_server_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from aioproc._metrics import text

    def broken(metrics: object) -> Iterator[str]:
        yield "# HELP half a page\n"
        raise RuntimeError("a metric that cannot be written")

    rec = Recorder()
    async with metrics.serve(recorder=rec) as server:
        with monkeypatch.context() as patch:
            patch.setattr(text, "pieces", broken)
            status, _, body = await _http(server.port, GET)
        assert (status, body) == (500, b"rendering the metrics failed; see the aioproc log\n")
        assert "rendering the metrics failed" in caplog.text
        assert "a metric that cannot be written" in caplog.text
        status, _, body = await _http(server.port, GET)
        assert status == 200 and body.decode() == metrics.render(rec)
