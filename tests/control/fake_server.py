"""A stand-in for `python -m trainer.serve` in tests of the dry run's server runner: the same --port and
--host flags, /health, and a completions route that echoes the request (streamed as server-sent events
when asked); `--fail` exits at once with last words, as a server given another model's checkpoint does."""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv: list[str]) -> None:
    port = int(argv[argv.index("--port") + 1])
    host = argv[argv.index("--host") + 1]
    if "--fail" in argv:
        print("serve: loading the checkpoint")
        print("serve: the checkpoint is of another model (d_model 64, the config says 32)", flush=True)
        sys.exit(2)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if body.get("stream"):
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for word in str(body["prompt"]).split():
                    self.wfile.write(f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                return
            out = json.dumps({"choices": [{"text": body["prompt"]}], "path": self.path}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv)
