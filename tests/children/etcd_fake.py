"""Something that is not etcd at an etcd endpoint: ``etcd_fake.py MODE``.

Listens on a free loopback port, prints it, and serves until killed:

- ``silent``: accepts connections and never answers (a wedged server, a
  port that a firewall lets through to nothing);
- ``http1``: an HTTP/1.1 server answering every request 404 (a web server
  at the wrong port);
- ``h2-404``: an HTTP/2 server answering every stream ``:status 404`` (a
  proxy or ingress with no route to etcd's gRPC service);
- ``close``: accepts connections and closes them at once, unread (a
  service that refuses clients it does not know);
- ``garbage``: answers whatever it reads with bytes of no protocol, and
  keeps the connection open.

Standard library only.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading

# HTTP/2 frame types and flags (RFC 9113)
DATA, HEADERS, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x4, 0x6, 0x7, 0x8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# HPACK: index 13 of the static table is ":status: 404"
STATUS_404 = bytes([0x80 | 13])


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def serve_h2(conn: socket.socket) -> None:
    if read_exactly(conn, len(PREFACE)) != PREFACE:
        return
    conn.sendall(frame(SETTINGS, 0, 0))
    answered: set[int] = set()
    while True:
        header = read_exactly(conn, 9)
        length = int.from_bytes(header[:3], "big")
        kind, flags = header[3], header[4]
        stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
        payload = read_exactly(conn, length)
        if kind == SETTINGS and not flags & ACK:
            conn.sendall(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            conn.sendall(frame(PING, ACK, 0, payload))
        elif kind in (HEADERS, DATA) and stream and stream not in answered:
            answered.add(stream)
            conn.sendall(frame(HEADERS, END_HEADERS | END_STREAM, stream, STATUS_404))


def serve_http1(conn: socket.socket) -> None:
    conn.recv(65536)
    body = b"404 page not found\n"
    conn.sendall(
        b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )


def handle(conn: socket.socket, mode: str) -> None:
    with conn:
        try:
            if mode == "silent":
                while conn.recv(65536):
                    pass  # read and drop everything, answer nothing
            elif mode == "close":
                pass  # closed by the with block, unread
            elif mode == "garbage":
                while conn.recv(65536):
                    conn.sendall(b"\x7f\x00garbage\xff\xfe of no protocol\n")
            elif mode == "http1":
                serve_http1(conn)
            else:
                serve_h2(conn)
        except (OSError, EOFError):
            pass


def main() -> None:
    mode = sys.argv[1]
    if mode not in ("silent", "http1", "h2-404", "close", "garbage"):
        raise SystemExit(f"unknown mode {mode!r}")
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=handle, args=(conn, mode), daemon=True).start()


if __name__ == "__main__":
    main()
