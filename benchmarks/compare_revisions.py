"""Compare this checkout against an earlier revision, row by row, in one run.

    python benchmarks/compare_revisions.py REV [--now REV2] [--only p1,p2,p7,worker] [--repeat 3]

Checks REV out into a temporary git worktree (removed afterwards), then runs
``run_all.py --only ...`` from each tree in turn, alternating (this
checkout, REV, this checkout, ...) ``--repeat`` times, so both see the same
machine load over the run.  ``--now REV2`` compares REV2 (also checked out
apart) instead of this checkout's working tree, which may hold edits.
Each ``run_all`` row is already a ratio against a baseline measured in the
same process (a raw spawn, a socketpair ping-pong); the table gives, per
row and loop, the median of those ratios for each tree and their quotient
(this checkout / REV): about 1.00x means "within noise", below 1 means
faster now.  Rows whose unit is not a time (memory, counts) are compared
the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)
ROW = re.compile(
    r"^\| (?P<bench>[^|]+) \| (?P<loop>asyncio|uvloop) \| [^|]+ \| [^|]+ \| (?P<ratio>[0-9.]+)x \|"
)


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[str]:
    """``rev`` checked out in a temporary directory, removed on exit."""
    top = tempfile.mkdtemp(prefix="aioproc-compare-")
    path = os.path.join(top, "tree")
    subprocess.run(
        ["git", "-C", CHECKOUT, "worktree", "add", "--detach", path, rev],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", CHECKOUT, "worktree", "remove", "--force", path], capture_output=True
        )
        os.rmdir(top)


def run_once(tree: str, args: list[str]) -> dict[tuple[str, str], float]:
    """One ``run_all.py`` from ``tree``: ratio per (benchmark, loop)."""
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(
        [sys.executable, os.path.join(tree, "benchmarks", "run_all.py"), *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            rows[(m["bench"].strip(), m["loop"])] = float(m["ratio"])
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the earlier revision (a commit, tag or branch)")
    p.add_argument("--now", default=None, help="compare this revision instead of the checkout")
    p.add_argument("--only", default="p1,p2,p7,worker", help="run_all.py's --only")
    p.add_argument("--repeat", type=int, default=3, help="run_all.py runs per tree")
    p.add_argument("--rounds", type=int, default=None, help="run_all.py's --rounds")
    p.add_argument("--quick", action="store_true", help="run_all.py's --quick")
    ns = p.parse_args(argv)
    args = ["--only", ns.only]
    if ns.rounds is not None:
        args += ["--rounds", str(ns.rounds)]
    if ns.quick:
        args.append("--quick")
    now: dict[tuple[str, str], list[float]] = {}
    then: dict[tuple[str, str], list[float]] = {}
    with contextlib.ExitStack() as stack:
        old = stack.enter_context(worktree(ns.rev))
        new = CHECKOUT if ns.now is None else stack.enter_context(worktree(ns.now))
        for i in range(ns.repeat):
            for tree, into in ((new, now), (old, then)):
                print(f"run {i + 1}/{ns.repeat}: {tree}", file=sys.stderr, flush=True)
                for key, ratio in run_once(tree, args).items():
                    into.setdefault(key, []).append(ratio)
    head = (
        ns.now
        or subprocess.run(
            ["git", "-C", CHECKOUT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    print(f"{head} against {ns.rev}: median ratio over {ns.repeat} runs each\n")
    print("| benchmark | loop | now | then | now / then |")
    print("|---|---|---|---|---|")
    for key in now:
        if key not in then:
            continue
        a, b = statistics.median(now[key]), statistics.median(then[key])
        print(f"| {key[0]} | {key[1]} | {a:.2f}x | {b:.2f}x | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
