"""A threaded HTTP server on 127.0.0.1 for download tests: serves fixture bytes and injects faults on request.

`FixtureServer` is a context manager: it binds an ephemeral port, serves from a daemon thread and shuts down on exit,
so no test leaves a server behind. Faults are per path and listed in `Route`:
- drop_first:       the first response sends the headers (full Content-Length) and half the body, then closes the
                    socket; later requests are served normally (honouring Range);
- fail_first:       the first `fail_first` requests answer HTTP 500;
- stall_first:      the first response waits `stall_first` seconds before sending anything (read timeout);
- ignore_range:     every request gets 200 and the whole body, whatever Range says;
- hold:             a threading.Event each request waits for (up to a minute) before it is answered: a download
                    that stays in progress until the test lets it finish;
- changed_body:     from the second request on, this body (with changed_etag as ETag) is served instead: the file
                    changed on the server between a dropped request and its resume.
Replies carry `etag` / `last_modified` as ETag / Last-Modified when set, and honour If-Range: a Range whose If-Range
names neither gets the whole (current) body with 200.
Unknown paths answer 404. Every request's path and Range header are recorded in `server.requests`.
"""
from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Route:
    body: bytes
    drop_first: bool = False
    fail_first: int = 0
    stall_first: float = 0.0
    ignore_range: bool = False
    etag: str | None = None
    last_modified: str | None = None
    changed_body: bytes | None = None
    changed_etag: str | None = None
    hold: threading.Event | None = None
    served: int = field(default=0)  # requests answered so far on this path
    if_ranges: list = field(default_factory=list)  # the If-Range header of each request (None when absent)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        route = self.server.routes.get(self.path)
        range_header = self.headers.get("Range")
        with self.server.lock:
            self.server.requests.append((self.path, range_header))
            attempt = route.served if route else 0
            if route:
                route.served += 1
                route.if_ranges.append(self.headers.get("If-Range"))
        if route is None:
            return self._reply(404, b"not found")
        if attempt < route.fail_first:
            return self._reply(500, b"injected failure")
        if attempt == 0 and route.stall_first:
            time.sleep(route.stall_first)
        if route.hold is not None:
            route.hold.wait(60)
        body, etag = route.body, route.etag
        if attempt >= 1 and route.changed_body is not None:
            body, etag = route.changed_body, route.changed_etag
        status = 200
        extra = {key: value for key, value in (("ETag", etag), ("Last-Modified", route.last_modified)) if value}
        if_range = self.headers.get("If-Range")
        current = if_range is None or if_range in (etag, route.last_modified)
        match = re.fullmatch(r"bytes=(\d+)-", range_header or "")
        if match and current and not route.ignore_range:
            start = int(match.group(1))
            if start >= len(body):
                return self._reply(416, b"", {"Content-Range": f"bytes */{len(body)}"})
            status = 206
            extra["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
            body = body[start:]
        if attempt == 0 and route.drop_first:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            for key, value in extra.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # the client sees a short body
            self.close_connection = True
            return None
        return self._reply(status, body, extra)

    def _reply(self, status: int, body: bytes, extra: dict | None = None):
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            for key, value in (extra or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (e.g. after a read timeout)
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # dropped connections are the point of some tests
        pass


class FixtureServer:
    """`with FixtureServer({"/a.txt": Route(b"...")}) as server: server.url("/a.txt")`."""

    def __init__(self, routes: dict[str, Route]):
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.routes = routes
        self.httpd.requests = []
        self.httpd.lock = threading.Lock()
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def requests(self) -> list[tuple[str, str | None]]:
        return self.httpd.requests

    def url(self, path: str) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}{path}"

    def __enter__(self) -> FixtureServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
