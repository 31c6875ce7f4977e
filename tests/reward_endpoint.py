"""A reward endpoint on 127.0.0.1 for tests of `http:` reward stages (tests/unit/stages/test_reward_verdicts_http.py,
tests/integration/test_reward_models.py): a real server whose replies the test scripts."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Endpoint:
    """A reward server on 127.0.0.1 whose replies a test scripts: `plan` is a list of ("status", code) / ("sleep", s) /
    ("ok", reward) popped per request (then "ok": exact match of the stripped completion); it counts requests and the most in flight at once."""

    def __init__(self, plan=(), hold_s: float = 0.0):
        self.plan, self.hold_s, self.lock = list(plan), hold_s, threading.Lock()
        self.requests, self.in_flight, self.peak, self.bodies = 0, 0, 0, []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint.lock:
                    endpoint.requests += 1
                    endpoint.in_flight += 1
                    endpoint.peak = max(endpoint.peak, endpoint.in_flight)
                    endpoint.bodies.append(body)
                    step = endpoint.plan.pop(0) if endpoint.plan else ("ok", None)
                try:
                    time.sleep(endpoint.hold_s)
                    if step[0] == "sleep":
                        time.sleep(step[1])
                    if step[0] == "status":
                        self.send_response(step[1])
                        self.end_headers()
                        return
                    reward = step[1] if step[1] is not None else float(body["completion"].strip() == body["answer"])
                    data = json.dumps({"reward": reward}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    with endpoint.lock:
                        endpoint.in_flight -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
