"""The emulated Kubernetes API's time per request, with and without Nagle's algorithm on its answers,
measured side by side in one run.

    python benchmarks/kube_api_latency.py [--requests 50] [--repeat 5] [--json]

Starts a bare emulator, makes examples/serve-gke.yaml's cluster there, and times `--requests` reads of a
Deployment through the real kubernetes client (each a 404 answered as a Status object), alternating
between the server as shipped (TCP_NODELAY on each connection) and the same server with Nagle's algorithm
left on, `--repeat` times each. Prints the median milliseconds per request of each and their ratio. Every
GKE dry run and test pays this per request: the server writes an answer's headers and body in two
writes, and with Nagle's algorithm the body waits for the client's delayed acknowledgement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()

    from provision.clock import SimClock
    from provision.cloud import Endpoint, Session
    from provision.config import load_config
    from provision.console import Console
    from provision.context import RunContext
    from provision.emulator import Emulator
    from provision.emulator.kube_server import _Handler
    from provision.kinds.gke.gke import cluster_of, ensure_cluster

    cfg = load_config(ROOT / "examples" / "serve-gke.yaml")
    emulator = Emulator(clock=SimClock())
    emulator.start()
    session = Session(Endpoint(clock=emulator.clock, address=emulator.address), [], Console())
    try:
        ensure_cluster(RunContext.on(cfg, session, Console(output="json")))
        shipped = _Handler.disable_nagle_algorithm
        samples: dict[str, list[float]] = {"nodelay": [], "nagle": []}
        for _ in range(args.repeat):  # interleaved, so load on the machine hits both alike
            for name, nodelay in (("nodelay", True), ("nagle", False)):
                _Handler.disable_nagle_algorithm = nodelay
                fresh = Session(Endpoint(clock=emulator.clock, address=emulator.address), [], Console())
                try:  # a session of its own: a new client, whose connections take the setting
                    kube = fresh.kube(cluster_of(cfg, fresh))
                    start = time.perf_counter()
                    for _ in range(args.requests):
                        kube.get_object("Deployment", cfg.gke.namespace, "absent")
                    samples[name].append((time.perf_counter() - start) * 1000 / args.requests)
                finally:
                    fresh.close()
        _Handler.disable_nagle_algorithm = shipped
    finally:
        session.close()
        emulator.stop()
    med = {k: statistics.median(v) for k, v in samples.items()}
    result = {"requests": args.requests, "repeat": args.repeat, "nodelay_ms": round(med["nodelay"], 2),
              "nagle_ms": round(med["nagle"], 2), "nagle_over_nodelay": round(med["nagle"] / med["nodelay"], 1)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"ms per request: {result['nodelay_ms']} without Nagle's algorithm (as shipped), {result['nagle_ms']} "
              f"with it: {result['nagle_over_nodelay']}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
