"""The service examples of docs/guides/async-services.md, run as a user runs them.

The aiohttp example runs as a script, the FastAPI one under uvicorn; both are
taken from the page as written (only the port changes).  Each streams a
job's lines to an HTTP client, lists its workers' pids, and stops them when
the client goes away.  They need aiohttp, FastAPI and uvicorn (the ``docs``
extra, which CI installs on the newest Python) and skip without them.
"""

from __future__ import annotations

import asyncio
import http.client
import importlib.util
import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_readme as readme
from helpers import free_port
from proc_utils import still_alive_after

PAGE = Path(__file__).parent.parent / "docs" / "guides" / "async-services.md"
# an empty working dir and a private TMPDIR, removed afterwards (test_readme's)
sandbox = readme.sandbox
TAB = re.compile(r'^=== "(\w+)"\n\n    ```python\n(.*?)\n    ```$', re.M | re.S)


def example(tab: str) -> str:
    """The code of one tab of the page's first tabbed block, dedented."""
    for name, code in TAB.findall(PAGE.read_text()):
        if name == tab:
            return "\n".join(line[4:] for line in code.splitlines()) + "\n"
    raise AssertionError(f"no {tab!r} tab in {PAGE}")


def start_aiohttp(
    work: Path, env: dict[str, str], port: int, *, cancel: bool = True
) -> subprocess.Popen[str]:
    """The aiohttp tab; ``cancel=False`` runs it with aiohttp's default, where a
    disconnect does not cancel the handler (the page says what happens then)."""
    code = example("aiohttp")
    assert "port=8080, handler_cancellation=True" in code
    arguments = f"port={port}" + (", handler_cancellation=True" if cancel else "")
    (work / "service.py").write_text(
        code.replace("port=8080, handler_cancellation=True", arguments)
    )
    return serve([sys.executable, "service.py"], work, env, "Running on")


def start_aiohttp_default(work: Path, env: dict[str, str], port: int) -> subprocess.Popen[str]:
    return start_aiohttp(work, env, port, cancel=False)


def start_fastapi(work: Path, env: dict[str, str], port: int) -> subprocess.Popen[str]:
    (work / "service.py").write_text(example("FastAPI"))
    argv = [sys.executable, "-m", "uvicorn", "service:app", "--host", "127.0.0.1"]
    return serve([*argv, "--port", str(port)], work, env, "Uvicorn running on")


def serve(argv: list[str], work: Path, env: dict[str, str], ready: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if ready in line:
            return proc
    proc.wait()
    raise AssertionError(f"the service exited {proc.returncode} before serving:\n{''.join(seen)}")


STARTS = {
    "aiohttp": start_aiohttp,
    "aiohttp-default-cancellation": start_aiohttp_default,
    "FastAPI": start_fastapi,
}


@pytest.fixture(params=list(STARTS))
def service(request: pytest.FixtureRequest, sandbox: tuple[Path, dict[str, str]]) -> Iterator[int]:
    """The tab's service, running on a free port; stopped with SIGINT afterwards."""
    aiohttp = request.param.startswith("aiohttp")
    modules = ("aiohttp",) if aiohttp else ("fastapi", "uvicorn")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install -e '.[docs]')")
    port = free_port()
    start = STARTS[request.param]
    work, env = sandbox
    proc = start(work, env, port)
    try:
        yield port
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        finally:
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    assert not list(Path(env["TMPDIR"]).iterdir()), "the service left temp files"


def get(port: int, path: str) -> tuple[int, bytes]:
    """The status and whole body of ``GET path``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_job_streams_every_line_then_its_outcome(service: int) -> None:
    status, body = get(service, "/train/a?steps=3")
    assert status == 200
    lines = body.decode().splitlines()
    # the two ranks' lines interleave; each rank's come in order
    for rank in (0, 1):
        assert [x for x in lines if x.startswith(f"[a{rank}]:")] == [
            f"[a{rank}]:step {s}" for s in range(3)
        ]
    assert len(lines) == 7
    assert lines[-1] == "failed: False"


def test_a_client_that_goes_away_stops_the_workers(service: int) -> None:
    with socket.create_connection(("127.0.0.1", service), timeout=60) as sock:
        sock.sendall(b"GET /train/b?steps=1000 HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while b"step 0" not in received:
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        jobs = json.loads(get(service, "/jobs")[1])
        assert list(jobs) == ["b"]
        pids = [int(p) for p in jobs["b"].values()]
        assert len(pids) == 2
    assert asyncio.run(still_alive_after(pids, 30)) == set()
    assert json.loads(get(service, "/jobs")[1]) == {}
