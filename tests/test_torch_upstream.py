"""torch's own launcher tests, run on aioproc: ``aioproc.torchrun`` and ``LocalElasticAgent``.

torch's ``test/distributed/launcher/test_run.py`` (``torchrun``'s tests) and
``test/distributed/elastic/agent/server/test/local_elastic_agent_test.py``
(its agent's, with the scenarios of several agents meeting in a c10d or an
etcd rendezvous) run unchanged in a pytest of this interpreter, with the
plugin ``tests/torch_upstream/aioproc_torch_shim.py``: it routes torch's
``torch.distributed.run.main``, ``rendezvous.registry.get_rendezvous_handler``
and ``LocalElasticAgent`` to ``aioproc.torchrun.main``, ``aioproc.rendezvous``
and ``aioproc.agent.LocalElasticAgent``.  The ``*_etcd`` scenarios meet in
aioproc's etcd backend (etcd's v3 API), on the etcd server torch's test
starts (its ``EtcdServer`` helper).  Every upstream test runs but those in
``NOT_RUN`` (and the ``*_etcd_v2`` twins, see ``not_run``), each with the
reason; every one that runs must pass.  Each runs in a pytest of its own
(see ``run_one``).

torch's test sources are not part of this project.  Set ``AIOPROC_TORCH_TESTS``
to a directory holding torch's ``test/`` tree (a pytorch checkout, or the
files as laid out under ``test/``: the two files above and the
``launcher/bin/`` scripts ``test_run.py`` launches), and run this file with
an interpreter that has torch (2.13), the ``etcd`` binary (Debian's
``etcd-server``) and aioproc's ``torch-upstream`` extra (torch's test
helpers need ``expecttest``, its ``EtcdServer`` ``python-etcd``)::

    pip install -e '.[test,torch-upstream]'
    AIOPROC_TORCH_TESTS=~/src/pytorch python -m pytest tests/test_torch_upstream.py
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import REPO_ROOT

SHIM_DIR = Path(__file__).parent / "torch_upstream"
TESTS_ENV = "AIOPROC_TORCH_TESTS"
PER_TEST_LIMIT = 300  # seconds; the multi-agent scenarios take tens of seconds each

RUN_FILE = "distributed/launcher/test_run.py"
AGENT_FILE = "distributed/elastic/agent/server/test/local_elastic_agent_test.py"

_MOCKS_LAUNCHER = "mocks the internals of torch's launcher"
_MOCKS_BARRIER = (
    "mocks torch.distributed.elastic.utils.store.barrier, the exit barrier of "
    "torch's agent on its TCP store; aioproc's exit barrier is the rendezvous's"
)
_MOCKS_START = "mocks torch's start_processes and its agent's _monitor_workers"
ETCD_V2 = (
    "torch's etcd-v2 backend: its etcd backend over another client of etcd's v2 API. "
    "aioproc has one etcd backend (etcd's v3 API), which the scenario's *_etcd twin "
    "runs on; run here, this one would be that twin again"
)

# Upstream tests this harness does not run, by "Class::test", with the reason.
NOT_RUN: dict[str, dict[str, str]] = {
    RUN_FILE: {
        "ElasticLaunchTest::test_launch_elastic_worker_raise_exception": (
            "asserts that torch.distributed.elastic.events.record (mocked) is called; "
            "aioproc.torchrun records torch's agent events through --event-log-handler, "
            "not that function"
        ),
        "ElasticLaunchTest::test_launch_elastic_agent_raise_exception": (
            f"{_MOCKS_LAUNCHER}: torch's LocalElasticAgent.run and events.record"
        ),
        "ElasticLaunchTest::test_launch_shutdown": (
            f"{_MOCKS_LAUNCHER}: torch.distributed.launcher.api's agent class and the "
            "rendezvous registry, to see that torch's launch_agent calls the handler's "
            "shutdown()"
        ),
        "ElasticLaunchTest::test_min_max_nodes_parse": (
            "tests torch's parse_min_max_nnodes helper; launches nothing"
        ),
        "ElasticLaunchTest::test_is_not_torchelastic_launched": (
            "runs the script without any launcher; nothing of aioproc's takes part"
        ),
        "ElasticLaunchTest::test_virtual_local_rank": (
            "needs two CUDA or XPU devices and torch.compile (torch skips it without them)"
        ),
    },
    AGENT_FILE: {
        "LocalElasticAgentTest::test_barrier_failed_c10d": _MOCKS_BARRIER,
        "LocalElasticAgentTest::test_barrier_failed_etcd": _MOCKS_BARRIER,
        "LocalElasticAgentTest::test_shutdown_called_c10d": _MOCKS_START,
        "LocalElasticAgentTest::test_shutdown_called_etcd": _MOCKS_START,
        "LocalElasticAgentTest::test_no_exit_barrier_on_failure": (
            "fails on torch 2.13 itself: both agents are given is_host=True for one "
            "endpoint, so the second cannot host the store (EADDRINUSE, "
            "RendezvousConnectionError) and the first waits for it until its join "
            "timeout; aioproc's c10d refuses the second host the same way"
        ),
    },
}


def not_run_of(upstream: str, tests: list[str]) -> dict[str, str]:
    """The tests of ``upstream`` this harness does not run, with the reason.

    ``NOT_RUN``'s, and every ``*_etcd_v2`` scenario whose ``*_etcd`` twin is
    among ``tests`` (``ETCD_V2``).
    """
    skipped = dict(NOT_RUN[upstream])
    for test in tests:
        if test.endswith("_etcd_v2") and test.removesuffix("_v2") in tests:
            skipped.setdefault(test, ETCD_V2)
    return skipped


def _torch_test_tree() -> Path | None:
    """Where torch's test files are: ``$AIOPROC_TORCH_TESTS/test``, or that folder itself."""
    named = os.environ.get(TESTS_ENV)
    if not named:
        return None
    root = Path(named).expanduser()
    for tree in (root / "test", root):
        if (tree / RUN_FILE).is_file() or (tree / AGENT_FILE).is_file():
            return tree
    return None


TREE = _torch_test_tree()
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="torch is not installed here"
    ),
    pytest.mark.skipif(
        TREE is None,
        reason=f"{TESTS_ENV} does not name a directory holding torch's test/ tree "
        f"(it needs test/{RUN_FILE} and test/{AGENT_FILE})",
    ),
]


def _pytest(path: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A pytest of this interpreter in ``path``'s folder, with the shim, on ``args``."""
    own_tmp = tmp / "tmp"  # torch's tests and workers leave files in $TMPDIR
    own_tmp.mkdir(exist_ok=True)
    env = dict(os.environ)
    env["TMPDIR"] = str(own_tmp)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SHIM_DIR), REPO_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(SHIM_DIR / "pytest.ini"),
        "--rootdir",
        str(path.parent),
        "-p",
        "aioproc_torch_shim",
        *args,
    ]
    return subprocess.run(
        command,
        cwd=path.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=PER_TEST_LIMIT + 60,
        check=False,
    )


def collect(path: Path, tmp: Path) -> list[str]:
    """The tests of torch's file ``path``, as ``"Class::test"``."""
    proc = _pytest(path, tmp, "--collect-only", "-q", path.name)
    prefix = f"{path.name}::"
    found = [line[len(prefix) :] for line in proc.stdout.splitlines() if line.startswith(prefix)]
    assert found, f"pytest collected no test of {path}:\n{proc.stdout}{proc.stderr}"
    return found


def outcomes(root: ET.Element) -> dict[str, tuple[str, str]]:
    """Each test of a junit report: ``"Class::test"`` -> (outcome, its message)."""
    found: dict[str, tuple[str, str]] = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = kind
                message = (element.get("message") or "") + "\n" + (element.text or "")
                break
        found[name] = (outcome, message.strip())
    return found


def run_one(path: Path, test: str, tmp: Path) -> tuple[str, str]:
    """Run the upstream test ``test`` of ``path`` on aioproc: (outcome, what pytest said).

    Each test runs in a pytest of its own, as each torchrun is a process
    of its own: an agent that ran in the test process (aioproc's etcd
    client, gRPC, does not survive ``fork()``) and anything a failed test
    leaves running never reach the next test's forked agents.
    """
    report = tmp / f"{re.sub(r'[^A-Za-z0-9_]', '_', test)}.xml"
    proc = _pytest(
        path,
        tmp,
        "-q",
        "-rA",
        f"--junitxml={report}",
        f"--timeout={PER_TEST_LIMIT}",
        f"{path.name}::{test}",
    )
    output = proc.stdout + proc.stderr
    if not report.is_file():
        return "error", f"pytest wrote no report (status {proc.returncode}):\n{output}"
    results = outcomes(ET.parse(report).getroot())
    if list(results) != [test]:
        return "error", f"expected a result for {test}, got {sorted(results)}:\n{output}"
    outcome, message = results[test]
    return outcome, message or output


@pytest.mark.timeout(3 * 3600)
@pytest.mark.parametrize(
    "upstream", [RUN_FILE, AGENT_FILE], ids=["test_run", "local_elastic_agent"]
)
def test_torch_upstream_tests_pass_on_aioproc(
    upstream: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert TREE is not None
    path = TREE / upstream
    if not path.is_file():
        pytest.skip(f"{path} is not there")
    tests = collect(path, tmp_path)
    assert not set(NOT_RUN[upstream]) - set(tests), (
        "NOT_RUN names tests the upstream file does not have"
    )
    not_run = not_run_of(upstream, tests)
    results = {test: run_one(path, test, tmp_path) for test in tests if test not in not_run}
    assert results, f"every test of {upstream} is in NOT_RUN"
    bad = {test: r for test, r in results.items() if r[0] != "passed"}
    with capsys.disabled():  # the counts, for the reader of the run
        print(
            f"\n{upstream}: {len(results) - len(bad)} passed, {len(not_run)} not run, "
            f"{len(bad)} did not pass"
        )
    summary = "\n\n".join(
        f"{test}: {outcome}\n{message[-3000:]}" for test, (outcome, message) in sorted(bad.items())
    )
    assert not bad, (
        f"{len(bad)} of {len(results)} upstream tests of {upstream} did not pass on aioproc "
        f"({len(not_run)} not run, see NOT_RUN):\n\n{summary}"
    )
