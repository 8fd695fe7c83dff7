"""Workers for tests/test_watchdog.py: stdlib and aioproc.timer only.

argv: <mode> <dir>.  Modes:

- hang: rank 0 starts `sleep 1000` in its process group, writes its pid to
  <dir>/grandchild, prints an unflushed line to stdout and hangs in
  hang_in_step() inside expires(after=0.5, scope="step"); the other ranks
  wait inside a 60 s scope until they are stopped.
- forge: sends forged and malformed requests through the watchdog fd, then
  uses a real scope and exits 0.
- quick: many short scopes (sequential, nested, in threads, in a forked
  child), then waits 1.5 s outside any scope and exits 0.
- crash: on the first attempt, exits 3 inside expires(after=0.3); on later
  attempts exits 0.
- descendant: a forked child (same process group) hangs in child_hangs()
  inside expires(after=0.3, scope="child-step"); the worker waits for it.
- c-stuck: hangs in stuck_in_c() inside expires(after=0.3, scope="c"),
  with the main thread blocked in pthread_cond_wait (C code that signals do
  not interrupt), so no Python-level signal handler can run.
"""

import ctypes
import json
import os
import signal
import sys
import threading
import time

from aioproc.timer import expires

mode, out_dir = sys.argv[1], sys.argv[2]
rank = int(os.environ["LOCAL_RANK"])


def hang_in_step() -> None:
    time.sleep(60)


def child_hangs() -> None:
    time.sleep(60)


def stuck_in_c() -> None:
    # pthread_cond_wait never returns for a signal, so Python never regains
    # control to run a Python-level handler (zeroed memory is glibc's static
    # initializer for both objects; 64 bytes cover their sizes)
    libc = ctypes.CDLL(None)
    mutex, cond = ctypes.create_string_buffer(64), ctypes.create_string_buffer(64)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_cond_wait(cond, mutex)


def send(data: bytes) -> None:
    os.write(int(os.environ["AIOPROC_WATCHDOG_FD"]), data)


def request(**fields: object) -> bytes:
    return json.dumps(fields).encode()


if mode == "hang":
    if rank == 0:
        import subprocess

        sleeper = subprocess.Popen(["sleep", "1000"])
        with open(os.path.join(out_dir, "grandchild"), "w") as f:
            f.write(str(sleeper.pid))
        print("entering step")  # stays in the stdout buffer unless flushed
        with expires(after=0.5, scope="step"):
            hang_in_step()
    else:
        with expires(after=60, scope="other"):
            signal.pause()

elif mode == "forge":
    me = os.getpid()
    # claims of other pids: long timers, so even if accepted nothing would fire
    send(request(op="acquire", pid=os.getppid(), id=1, scope="forged", after=30))
    send(request(op="acquire", pid=1, id=2, scope="forged", after=30))
    send(request(op="acquire", pid=-5, id=3, scope="forged", after=30))
    send(b"not json{")
    send(b"[1, 2]")
    send(request(op="explode", pid=me))
    send(request(op="acquire", pid=me))
    send(request(op="acquire", pid=me, id=4, scope="x" * 5000, after=30))
    send(b'{"op": "acquire", "pid": %d, "id": 5, "scope": "s", "after": NaN}' % me)
    send(b"\xff\xfe")
    with expires(after=30, scope="fine"):
        pass

elif mode == "quick":
    for _ in range(50):
        with expires(after=1.0):
            pass
    with expires(after=1.0, scope="outer"), expires(after=1.0, scope="inner"):
        pass

    def many() -> None:
        for _ in range(10):
            with expires(after=1.0, scope="thread"):
                pass

    threads = [threading.Thread(target=many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    child = os.fork()
    if child == 0:
        for _ in range(10):
            with expires(after=1.0, scope="forked"):
                pass
        os._exit(0)
    os.waitpid(child, 0)
    time.sleep(1.5)  # past every deadline: released timers must not fire

elif mode == "crash":
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        with expires(after=0.3, scope="crash"):
            os._exit(3)

elif mode == "descendant":
    child = os.fork()
    if child == 0:
        with expires(after=0.3, scope="child-step"):
            child_hangs()
        os._exit(0)
    os.waitpid(child, 0)

elif mode == "c-stuck":
    with expires(after=0.3, scope="c"):
        stuck_in_c()

else:
    sys.exit(f"unknown mode {mode!r}")
