"""Run every aioproc benchmark and print one markdown table.

    python benchmarks/run_all.py [--quick] [--loop asyncio|uvloop|both] [--rounds N]

Each benchmark lives in its own module (``bench_*.py``); ``_util`` holds the
timing, medians and the table; ``_workers`` the code the workers run.  Every
figure is a median over rounds, measured interleaved with a baseline in the
same run (see ``_util.interleaved``); the table gives candidate, baseline,
their ratio, the target and PASS/FAIL, per loop, then says which loop is
faster.  ``--quick`` is CI's smoke test (smaller N, fewer rounds, < 60 s).

Exits non-zero only when a benchmark could not run (an exception, a wrong
result), never because a row missed its target.

Top-level imports stay minimal: torch's spawn workers re-import this file.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI smoke test: small N, few rounds")
    p.add_argument("--loop", choices=("asyncio", "uvloop", "both"), default="both")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds per benchmark")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated subset: p1,p2,p1b,memory,p3,p5,p6,p4,worker,p9,leak,rss,stall,"
        "p7,mem1024,cluster,cold,rdzv,coro,p1t,torch (default: all), "
        "and p1t-fork (P1t's forkserver rows only)",
    )
    p.add_argument("--no-torch", action="store_true", help="skip the torch comparison and P1t")
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def _revision() -> str:
    """The checkout's commit and how many tracked files differ from it (read-only git)."""
    import subprocess

    root = os.path.dirname(HERE)
    try:
        sha = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "aioproc"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision (no git)"
    changed = [line[3:] for line in dirty if line.strip()]
    return f"git {sha}" + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


def _header(argv: list[str]) -> list[str]:
    import _util

    uv = "not installed"
    if _util.uvloop_available():
        import uvloop

        uv = uvloop.__version__
    return [
        f"command: `{shlex.join([sys.executable, *argv])}`",
        f"aioproc: {_revision()}",
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S %z')}",
        f"machine: nproc={os.cpu_count()} ({len(os.sched_getaffinity(0))} usable), "
        f"{platform.machine()} Linux {platform.release()}",
        f"python: {platform.python_version()} ({sys.executable}); uvloop {uv}",
        f"temp dir (log trees without log_dir): {_temp_fs()}",
    ]


def _temp_fs() -> str:
    """The temp dir, and the file system and mount options it is on.

    P2 and P6 make and remove a directory per rank there; what that costs
    depends on both (``benchmarks/RESULTS.md``: ``discard`` makes each
    ``rmdir`` wait on the disk).
    """
    import tempfile

    tmp = os.path.realpath(tempfile.gettempdir())
    best = ("?", "?", "")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                _, point, fstype, options, *_ = line.split()
                inside = tmp == point or tmp.startswith(point.rstrip("/") + "/")
                if inside and len(point) > len(best[2]):
                    best = (fstype, options, point)
    except OSError:
        pass
    return f"{tmp} ({best[0]}, {best[1]})"


def main(argv: list[str]) -> int:
    sys.path.insert(0, HERE)
    sys.path.insert(1, os.path.dirname(HERE))  # the aioproc checkout, if not installed
    import _util

    args = _parse(argv[1:])
    loops: tuple[str, ...] = _util.LOOPS if args.loop == "both" else (args.loop,)
    notes: list[str] = []
    if "uvloop" in loops and not _util.uvloop_available():
        loops = tuple(x for x in loops if x != "uvloop")
        notes.append("uvloop not installed: uvloop rows skipped")
    if not loops:
        print("no event loop to run on", file=sys.stderr)
        return 2
    if args.quick:
        cfg = _util.Config.quick_mode(loops, args.rounds)
    else:
        cfg = _util.Config.full(loops, args.rounds)

    for line in _header(argv):
        print(f"- {line}")
    print(
        f"- mode: {'quick' if cfg.quick else 'full'}, loops: {', '.join(loops)}, "
        f"rounds: {cfg.rounds} (+{cfg.warmup} warm-up; torch function workloads: "
        f"{cfg.torch_rounds})",
        flush=True,
    )

    import _workers

    note = _workers.precompile()
    if note:
        notes.append(note)

    import bench_close
    import bench_cluster
    import bench_cold
    import bench_core
    import bench_coro
    import bench_failure
    import bench_forkserver
    import bench_leak
    import bench_oob
    import bench_output
    import bench_p1t
    import bench_p7
    import bench_rendezvous
    import bench_rss
    import bench_rss_workers
    import bench_stall
    import bench_threads
    import bench_torch
    import bench_worker

    benches = {
        "p1": bench_core.p1,
        "p2": bench_core.p2,
        "p1b": bench_forkserver.p1b,
        "memory": bench_forkserver.memory,
        "p3": bench_failure.p3,
        "p5": bench_threads.p5,
        "p6": bench_close.p6,
        "p4": bench_output.p4,
        "worker": bench_worker.worker_rows,
        "p9": bench_oob.oob_rows,
        "leak": bench_leak.leak,
        "rss": bench_rss.rss,
        "stall": bench_stall.stall,
        "p7": bench_p7.p7,
        "cluster": bench_cluster.cluster_rows,
        "mem1024": bench_rss_workers.rss_workers,
        "cold": bench_cold.cold,  # fresh interpreters: the first start's loop hold
        "rdzv": bench_rendezvous.rdzv_rows,  # skipped with a message where etcd is missing
        # after leak: aiomultiprocess's spawn leaves multiprocessing's resource tracker
        "coro": bench_coro.coro_rows,
        # P1t and torch start torch's launchers: its stdlib forkserver (stopped
        # again by P1t), its resource tracker and signal handlers
        "p1t": bench_p1t.p1t,
        "p1t-fork": bench_p1t.p1t_fork,  # only when asked: p1t has these rows
        # last: torch's spawn context starts a resource-tracker child and
        # installs signal handlers; nothing measured after it
        "torch": bench_torch.torch_rows,
    }
    only = [s.strip() for s in args.only.split(",") if s.strip()] or [
        k for k in benches if k != "p1t-fork"
    ]
    unknown = set(only) - set(benches)
    if unknown:
        print(f"unknown benchmark(s): {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.no_torch and {"p1t", "p1t-fork", "torch"} & set(only):
        only = [k for k in only if k not in ("p1t", "p1t-fork", "torch")]
        notes.append("torch comparison and P1t skipped (--no-torch)")

    rows: list[_util.Row] = []
    errors = 0
    t_all = time.perf_counter()
    for key in only:
        t0 = time.perf_counter()
        print(f"... {key}", file=sys.stderr, flush=True)
        try:
            out = benches[key](cfg)
        except Exception as e:
            errors += 1
            traceback.print_exc()
            rows.append(_util.error_row(key, e))
            continue
        if isinstance(out, str):
            notes.append(out)
        else:
            rows += out
        print(f"    {key}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    print()
    print(_util.format_table(rows))
    print()
    for note in notes:
        print(f"- {note}")
    print(f"- {_util.loop_verdict(rows)}")
    print(f"- total time: {time.perf_counter() - t_all:.0f} s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
