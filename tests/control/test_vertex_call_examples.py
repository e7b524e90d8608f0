"""The lines `deploy` prints for calling a Vertex AI endpoint work as printed: run in a shell against a stand-in
for the endpoint's rawPredict URL (a local HTTP server that answers only POSTs to `...:rawPredict` carrying a
completions body and a bearer token), with a stand-in `gcloud` on PATH for the access token."""

import http.server
import json
import os
import shutil
import subprocess
import threading

import pytest

from provision.kinds.vertex.endpoints import Endpoint

BODY = '{"prompt": "1 2 3", "max_tokens": 32}'


@pytest.fixture()
def raw_predict():
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append((self.path, self.headers["authorization"], body))
            ok = self.path.endswith(":rawPredict") and body == json.loads(BODY)
            answer = json.dumps({"choices": [{"text": " 4 5 6", "index": 0}]} if ok else {"error": "no route"})
            self.send_response(200 if ok else 404)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(answer.encode())

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1/projects/p/locations/us-west4/endpoints/42:rawPredict"
        yield url, seen
    finally:
        server.shutdown()


def test_the_printed_calls_reach_raw_predict_with_a_completions_body(raw_predict, tmp_path):
    url, seen = raw_predict
    gcloud = tmp_path / "gcloud"
    gcloud.write_text("#!/bin/sh\necho token-123\n")
    gcloud.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    lines = Endpoint.examples(None, url, BODY)
    runnable = [line for line in lines if shutil.which(line.split()[0])]
    assert any(line.strip().startswith("python3 -c") for line in runnable)
    for line in runnable:
        done = subprocess.run(line, shell=True, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (line, done.stderr)
        assert "4 5 6" in done.stdout
    assert all(path.endswith(":rawPredict") and auth == "Bearer token-123" for path, auth, _ in seen)
    assert len(seen) == len(runnable)
