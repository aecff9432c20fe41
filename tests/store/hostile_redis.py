"""A TCP proxy on loopback in front of a real redis-server that misbehaves when told to.

`HostileProxy(upstream_port)`: `.port` to connect to; `.drip_s` (set it to answer one byte every
that many seconds, None: at once); `.inject(data)` (send `data`, e.g. one extra reply, ahead of
the next bytes the server sends); `.close()` drops every connection. Commands pass unchanged.
"""

from __future__ import annotations

import socket
import threading
import time


class HostileProxy:
    def __init__(self, upstream_port: int, drip_s: float | None = None):
        self.upstream = upstream_port
        self.drip_s = drip_s
        self._inject: bytes | None = None
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def inject(self, data: bytes) -> None:
        with self._lock:
            self._inject = data

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if replies:
                    with self._lock:
                        extra, self._inject = self._inject, None
                    if extra:
                        dst.sendall(extra)
                while data:
                    drip = self.drip_s if replies else None
                    if drip is None:
                        dst.sendall(data)
                        break
                    dst.sendall(data[:1])
                    data = data[1:]
                    time.sleep(drip)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
