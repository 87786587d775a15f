"""uvicorn serving an app on a free loopback port in a daemon thread: the real server for HTTP tests."""
from __future__ import annotations

import socket
import threading
import time


class ServerThread:
    """uvicorn serving `app` on a free loopback port, in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
