"""A TCP proxy on 127.0.0.1 that can be taken down and brought back (a store outage)."""

from __future__ import annotations

import socket
import threading
import time

from producer.localfleet import free_port


class TcpProxy:
    """Forwards 127.0.0.1:port to a target; ``down()`` refuses and cuts every connection."""

    def __init__(self, target_port: int, latency_s: float = 0.0) -> None:
        self.target_port = target_port
        # Every chunk the server sends back is held this long (a store far away).
        self.latency_s = latency_s
        self.port = free_port()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.up()

    @property
    def url(self) -> str:
        """HTTP URL of the proxy."""
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        """Listen again on the same port."""
        lst = socket.socket()
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", self.port))
        lst.listen(64)
        self._listener = lst
        threading.Thread(target=self._accept, args=(lst,), daemon=True).start()

    def down(self) -> None:
        """Stop listening and cut every open connection."""
        lst, self._listener = self._listener, None
        if lst is not None:
            lst.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, lst: socket.socket) -> None:
        while True:
            try:
                client, _ = lst.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b, delay in ((client, upstream, 0.0), (upstream, client, self.latency_s)):
                threading.Thread(target=self._pipe, args=(a, b, delay), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        try:
            while data := src.recv(65536):
                if delay_s:
                    time.sleep(delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
