"""A fake Cloud Storage server for tests: gcp-storage-emulator on a free loopback port, in memory, with
create-only uploads (tests/gcs_emulator.py).

The real google-cloud-storage client (and gcsfs) talk to it through STORAGE_EMULATOR_HOST, with
anonymous credentials; nothing leaves this machine."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


@contextlib.contextmanager
def fake_gcs_server(default_bucket: str):
    """Yields the server's URL once it answers; the server is killed on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("gcs_emulator.py")), "start",
                               "--host", "127.0.0.1", "--port", str(port), "--in-memory",
                               "--default-bucket", default_bucket, "-q"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the fake GCS server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        server.kill()
        server.wait()
