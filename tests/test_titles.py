"""What ``ps`` shows for aioproc's processes: a short title for each, the binaries' own argv.

Function workers (spawned or forked), the forked workers that run a Python
script, persistent workers, the guardian and the warm-start template each
read ``/proc/<pid>/cmdline`` as their title, well within 200 characters;
a binary worker keeps its own command line.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cmdline
from proc_utils import Fifo

import aioproc
from aioproc._proc import lifeline as _lifeline

METHODS = pytest.mark.parametrize("method", ["spawn", "forkserver"])


def seen_by_ps(pid: int) -> str | None:
    """``ps -o args`` for ``pid``, or None where there is no ``ps``."""
    if shutil.which("ps") is None:
        return None
    out = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True)
    return out.stdout.strip()


def own_command_line() -> tuple[bytes, list[str], str | None]:
    """In a worker: its ``/proc/self/cmdline``, ``sys.argv`` and what ``ps`` shows for it."""
    with open("/proc/self/cmdline", "rb") as f:
        return f.read(), list(sys.argv), seen_by_ps(os.getpid())


@METHODS
async def test_a_function_worker_is_shown_as_its_group_and_rank(method: str) -> None:
    result = await aioproc.run(own_command_line, 2, name="trainer", start_method=method, sinks=[])
    for rank in (0, 1):
        title = f"aioproc: trainer[{rank}]"
        command, argv, ps = result.return_values[rank]
        assert command == f"{title}\0".encode()
        assert argv == ["-c"]  # as before: the title is not in sys.argv
        assert ps in (title, None)


@METHODS
async def test_a_persistent_worker_is_shown_by_its_name(method: str) -> None:
    async with aioproc.open_worker(name="ckpt", start_method=method) as worker:
        command, _, ps = await worker.call(own_command_line)
    assert (command, ps) in ((b"aioproc: ckpt\0", "aioproc: ckpt"), (b"aioproc: ckpt\0", None))
    async with aioproc.open_pool(2, start_method=method) as pool:
        seen = sorted(c for c, _, _ in await pool.run(own_command_line))
    assert seen == [b"aioproc: pool[0]\0", b"aioproc: pool[1]\0"]


SCRIPT = """\
import sys
with open("/proc/self/cmdline", "rb") as f:
    command = f.read()
with open(sys.argv[1], "wb") as out:
    out.write(command + b"|" + " ".join(sys.argv[1:]).encode())
"""


async def test_a_forked_script_worker_is_shown_as_its_group_and_rank(tmp_path: Path) -> None:
    """``aioproc run --start-method forkserver script.py``: the template runs the script
    in its fork, whose command line was the template's."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    outs = [tmp_path / f"out{rank}" for rank in (0, 1)]
    result = await aioproc.run(
        sys.executable,
        2,
        {rank: (str(script), str(outs[rank]), "--lr", "0.1") for rank in (0, 1)},
        name="train",
        start_method="forkserver",
        sinks=[],
    )
    assert not result.is_failed()
    for rank, out in enumerate(outs):
        command, _, argv = out.read_bytes().partition(b"|")
        assert command == f"aioproc: train[{rank}]\0".encode()
        assert argv == f"{out} --lr 0.1".encode()  # the script's own arguments


async def test_a_binary_worker_keeps_its_own_command_line(tmp_path: Path) -> None:
    # read once the program runs: during its execve the kernel shows an empty line
    code = "import sys, time; open(sys.argv[1], 'w').write('up\\n'); time.sleep(30)"
    async with Fifo(tmp_path / "fifo") as fifo:
        args = ("-c", code, fifo.path)
        async with aioproc.start_processes(
            "tool", sys.executable, {0: args}, {0: {}}, sinks=[]
        ) as pc:
            await fifo.lines(1)
            expected = "\0".join([sys.executable, *args, ""]).encode()
            assert cmdline(pc.pids()[0]) == expected
            await pc.close(timeout=5)


async def test_the_guardian_and_the_template_are_shown_with_their_supervisors_pid() -> None:
    async with aioproc.open_forkserver():
        async with aioproc.start_processes(
            "g", "sleep", {0: ("30",)}, {0: {}}, sinks=[], start_method="forkserver"
        ) as pc:
            guardian = _lifeline.current_pid()
            assert guardian is not None
            ours = os.getpid()
            assert cmdline(guardian) == f"aioproc-guardian {ours}\0".encode()
            assert seen_by_ps(guardian) in (f"aioproc-guardian {ours}", None)
            templates = [
                int(p)
                for p in os.listdir("/proc")
                if p.isdigit() and cmdline(int(p)) == f"aioproc-template {ours}\0".encode()
            ]
            assert len(templates) == 1
            assert seen_by_ps(templates[0]) in (f"aioproc-template {ours}", None)
            await pc.close(timeout=5)


async def test_a_long_group_name_is_cut_and_every_title_stays_short() -> None:
    name = "x" * 500
    async with aioproc.start_processes(name, own_command_line, {0: ()}, {0: {}}, sinks=[]) as pc:
        result = await pc.wait()
    assert result is not None
    command = result.return_values[0][0]
    assert command.startswith(b"aioproc: xxx") and command.endswith(b"\0")
    assert len(command) <= 200


async def test_a_name_a_title_cannot_show_is_shown_with_question_marks() -> None:
    """A NUL cannot be in an argument, a tab or a lone surrogate not in a title: the
    worker starts all the same."""
    async with aioproc.open_worker(name="ck\tpt é\x00\udc80") as worker:
        command, _, _ = await worker.call(own_command_line)
    assert command == "aioproc: ck?pt é??\0".encode()


async def test_a_worker_booting_shows_a_short_command_line_with_its_title() -> None:
    """Before its boot code arrives (the supervisor has not sent it yet), a spawned
    function worker is a short stub and its title, not a page of code."""
    from aioproc._func.boot import STUB, boot_argv

    argv = boot_argv(5, "aioproc: trainer[3]")
    assert argv[-3:] == [STUB, "5", "aioproc: trainer[3]"]
    assert len("\0".join(argv[1:])) < 200  # and the interpreter's path before it
    # a worker that gets nothing and then EOF ends at once, running nothing
    proc = await asyncio.create_subprocess_exec(
        *argv[:-2], "0", "aioproc: t[0]", stdin=asyncio.subprocess.DEVNULL
    )
    assert await asyncio.wait_for(proc.wait(), 30) == 1
