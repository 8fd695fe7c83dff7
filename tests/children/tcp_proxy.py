"""A TCP proxy that a test can cut: ``tcp_proxy.py LISTEN_HOST TARGET_PORT``.

Prints its port and forwards every connection to 127.0.0.1:TARGET_PORT.
On SIGUSR1 it closes every connection and its listening socket: the client
sees its peer reset.  On SIGUSR2 it keeps every connection open but forwards
nothing more, and accepts nothing new: the client's bytes vanish, as packets
do when a partition drops them.
"""

from __future__ import annotations

import asyncio
import signal
import sys


async def main() -> None:
    listen_host, target_port = sys.argv[1], int(sys.argv[2])
    writers: set[asyncio.StreamWriter] = set()
    cut = asyncio.Event()
    blackhole = asyncio.Event()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if blackhole.is_set():
                    continue  # dropped on the floor
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if blackhole.is_set():
            await asyncio.sleep(3600)  # a new connection hangs, unanswered
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            writer.close()
            return
        writers.update((writer, up_writer))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, listen_host, 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, cut.set)

    def drop() -> None:
        blackhole.set()
        print("blackhole", flush=True)

    loop.add_signal_handler(signal.SIGUSR2, drop)
    await cut.wait()
    server.close()
    for w in writers:
        w.transport.abort()
    print("cut", flush=True)
    await asyncio.sleep(3600)  # until the test kills it


asyncio.run(main())
