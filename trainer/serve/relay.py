"""A deployed model as lm-evaluation-harness's `local-completions` sees a server: a relay on 127.0.0.1 that carries
each completions body through the platform's own prediction call and answers the tokenizer routes itself.

Why a relay rather than an lm-eval model class of our own: `local-completions` is the client the local evaluation
already runs (its batches, its reading of echoed log-probabilities, its cutting of contexts to the model's
length), so an endpoint's results come from the same harness code as the local engine's, and the relay adds
nothing but transport. `forward` is the platform's call (`moe-tpu eval --endpoint` passes the kind's
ServiceTarget.predict: Vertex AI's RawPredict, a GKE Service's proxy), which reaches the server's
/v1/completions alone: RawPredict hands its body to the container's predict route and to no other. So
`/tokenize`, `/detokenize` and `/tokenizer_info` are answered here, in vLLM's shapes as the server answers them
(trainer.serve.tokenizer_routes), by the codec of the run whose checkpoint the endpoint serves.

Hand-written on http.server rather than the server's FastAPI app: four routes that validate nothing (the deployed
server validates the completions; lm-eval sends the tokenizer routes well-formed bodies), one request at a time
(lm-eval's client sends them one by one; the platform's client is called from one thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer


@dataclasses.dataclass
class Tokenizer:
    """The tokenizer routes' answers: the run's codec, its end-of-document token and the model's sizes; the
    model's name, which the server checks each request's `model` against."""

    model_name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    kind: str
    eos_id: int | None
    eos_token: str | None
    vocab_size: int
    max_len: int

    def info(self) -> dict:
        # No chat template: the endpoint is evaluated on completions (lm-eval's chat tasks render theirs locally).
        return {"tokenizer_class": self.kind, "eos_token": self.eos_token, "eos_token_id": self.eos_id,
                "bos_token": None, "pad_token": None, "model_max_length": self.max_len,
                "vocab_size": self.vocab_size, "chat_template": None}


def run_tokenizer(directory: str, tokenizer_path: str | None, max_len: int) -> Tokenizer:
    """The tokenizer of the run in `directory`, as the server loads it (trainer.serve.startup.load), without its
    weights."""
    from trainer.run_loader import Codec, find_run, load_run_config
    from trainer.serve.startup import end_of_document
    from trainer.sidefiles import tokenizer_file

    run = find_run(directory)
    cfg = load_run_config(run.config)
    codec = Codec(cfg, tokenizer_path or tokenizer_file(run))
    eos_id, eos_token = end_of_document(cfg, codec, run)
    return Tokenizer(cfg.name, codec.encode, codec.decode, codec.kind, eos_id, eos_token, cfg.model.vocab_size, max_len)


class Relay:
    """The relay's state: `forward` (a completions body -> the answer's JSON) and the first error it raised,
    which the caller raises in place of the harness's own (an HTTP 502 that names nothing)."""

    def __init__(self, forward: Callable[[dict], dict], tokenizer: Tokenizer) -> None:
        self.forward, self.tokenizer = forward, tokenizer
        self.error: BaseException | None = None
        self.requests = 0

    def answer(self, method: str, path: str, body: dict) -> tuple[int, dict]:
        tok = self.tokenizer
        if method == "GET" and path == "/tokenizer_info":
            return 200, tok.info()
        if method == "POST" and path == "/tokenize":
            tokens = tok.encode(body["prompt"])
            return 200, {"count": len(tokens), "max_model_len": tok.max_len, "tokens": tokens, "token_strs": None}
        if method == "POST" and path == "/detokenize":
            return 200, {"prompt": tok.decode(body["tokens"])}
        if method == "POST" and path in ("/v1/completions", "/completions"):
            self.requests += 1
            return 200, self.forward({**body, "stream": False})
        return 404, {"error": {"message": f"{method} {path}: not a route of the relay", "type": "not_found_error"}}


def _handler(relay: Relay):
    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            try:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if method == "POST" else {}
                status, document = relay.answer(method, self.path.split("?", 1)[0], body)
            except Exception as e:  # noqa: BLE001 - kept for the caller to raise; the harness sees a 502
                relay.error = relay.error or e
                status, document = 502, {"error": {"message": str(e), "type": "bad_gateway"}}
            data = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's name
            self._serve("GET")

        def do_POST(self):  # noqa: N802
            self._serve("POST")

        def log_message(self, *args) -> None:  # quiet: lm-eval logs its own progress
            pass

    return Handler


@contextlib.contextmanager
def relayed(relay: Relay, host: str = "127.0.0.1"):
    """The relay listening on a free port of `host`, in a thread: yields its completions URL; stops it on exit."""
    server = HTTPServer((host, 0), _handler(relay))
    thread = threading.Thread(target=server.serve_forever, name="moe-tpu-eval-relay", daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}/v1/completions"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)
