"""A Kubernetes API server on 127.0.0.1 for the subset a run uses, over HTTPS with its own CA.

JobSets (jobset.x-k8s.io/v1alpha2: create, get, list, delete, with 409 and 404 as `Status`
objects), pods (list, get, watch, log), events and nodes (with GKE's TPU labels); a service's
Deployment, Service (and its proxy), PodMonitoring and HorizontalPodAutoscaler (kube_objects.py). The official
`kubernetes` client talks to it exactly as to a GKE control plane: the endpoint and the CA
certificate come from GetCluster. Objects live in the emulated world (gke.py, gke_world.py); every
request is one transaction, after the JobSet controller has brought the world up to now.

Written by hand on the standard library's HTTP server because no library serves the Kubernetes
API from Python; the subset is small and its answers follow the API's conventions (Status
objects, label and field selectors, list kinds).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import re
import ssl
import sys
import tempfile
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

from provision.emulator import kube_objects
from provision.emulator.kube_base import KubeError, field_matches, list_of, not_found, selector_matches
from provision.emulator.gke import (
    JOBSET_LABELS,
    TPU_RESOURCE,
    JobSetRecord,
    PodRecord,
    iso,
    tpu_accelerator,
)
from provision.emulator.gke_world import GkeWorld

if TYPE_CHECKING:
    from provision.emulator.world import World

# fn(world, now) as one transaction (Emulator.world_call).
WorldCall = Callable[[Callable[["World", float], Any]], Any]

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
_JOBSETS = re.compile(rf"^/apis/{GROUP}/{VERSION}(?:/namespaces/([^/]+))?/{PLURAL}(?:/([^/]+))?$")
_PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?(/log)?$")
_EVENTS = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")
_NODES = re.compile(r"^/api/v1/nodes(?:/([^/]+))?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_JOBSET_NAME = 40  # so that pod names and the DNS names JobSet makes for them stay within 63


# --- views ------------------------------------------------------------------------------------

def jobset_view(gke: GkeWorld, rec: JobSetRecord, now: float) -> dict:
    body = json.loads(json.dumps(rec.manifest))
    meta = body.setdefault("metadata", {})
    meta.update(uid=rec.uid, creationTimestamp=iso(rec.create_time), resourceVersion=str(gke.counter),
                generation=1)
    statuses = []
    pods = [p for p in gke.pods.values() if p.namespace == rec.namespace and p.jobset == rec.name
            and p.attempt == rec.restarts]
    for job in rec.jobs():
        mine = [p for p in pods if p.replicated_job == job["name"]]
        phases = [p.phase(now) for p in mine]
        statuses.append({"name": job["name"], "ready": phases.count("Running"), "succeeded": phases.count("Succeeded"),
                         "failed": phases.count("Failed"), "active": phases.count("Running") + phases.count("Pending"),
                         "suspended": 0})
    status: dict[str, Any] = {"restarts": rec.restarts, "replicatedJobsStatus": statuses, "conditions": []}
    if rec.terminal is not None:
        status["terminalState"] = rec.terminal
        status["conditions"].append({"type": rec.terminal, "status": "True", "reason": rec.reason,
                                     "message": rec.message, "lastTransitionTime": iso(rec.terminal_at)})
    body["status"] = status
    return body


def _pod_labels(rec: JobSetRecord, pod: PodRecord, job: dict) -> tuple[dict, dict]:
    template = job["template"]["spec"]["template"].get("metadata", {})
    ids = {f"{JOBSET_LABELS}jobset-name": rec.name, f"{JOBSET_LABELS}replicatedjob-name": pod.replicated_job,
           f"{JOBSET_LABELS}replicatedjob-replicas": str(job.get("replicas", 1)),
           f"{JOBSET_LABELS}job-index": str(pod.job_index), f"{JOBSET_LABELS}restart-attempt": str(pod.attempt),
           "batch.kubernetes.io/job-completion-index": str(pod.pod_index),
           "batch.kubernetes.io/job-name": f"{rec.name}-{pod.replicated_job}-{pod.job_index}"}
    if rec.coordinator():
        ids[f"{JOBSET_LABELS}coordinator"] = rec.coordinator()
    labels = {**template.get("labels", {}), **ids}
    annotations = {**template.get("annotations", {}), **ids}
    return labels, annotations


def _container_status(name: str, pod: PodRecord, now: float) -> dict:
    phase = pod.phase(now)
    if phase == "Pending":
        state = {"waiting": {"reason": "ContainerCreating"}}
    elif phase == "Running":
        state = {"running": {"startedAt": iso(pod.running_at)}}
    else:
        state = {"terminated": {"exitCode": pod.exit_code, "reason": pod.reason or "", "message": pod.message or "",
                                "startedAt": iso(min(pod.running_at, pod.ended_at)), "finishedAt": iso(pod.ended_at)}}
    return {"name": name, "ready": phase == "Running", "restartCount": 0, "image": "", "imageID": "",
            "state": state}


def pod_view(gke: GkeWorld, pod: PodRecord, now: float) -> dict:
    if pod.deployment:
        return kube_objects.deployment_pod_view(gke, pod, now)
    rec = gke.jobsets.get(f"{pod.namespace}/{pod.jobset}")
    job = next((j for j in rec.jobs() if j["name"] == pod.replicated_job), None) if rec else None
    spec = json.loads(json.dumps(job["template"]["spec"]["template"]["spec"])) if job else {"containers": []}
    labels, annotations = _pod_labels(rec, pod, job) if job else ({}, {})
    spec["nodeName"] = pod.node
    spec["hostname"] = f"{pod.jobset}-{pod.replicated_job}-{pod.job_index}-{pod.pod_index}"
    spec["subdomain"] = pod.jobset
    phase = pod.phase(now)
    status: dict[str, Any] = {"phase": phase, "startTime": iso(pod.created_at),
                              "containerStatuses": [_container_status(c["name"], pod, now) for c in spec["containers"]]}
    if phase == "Failed" and pod.reason:
        status.update(reason=pod.reason, message=pod.message or "")
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "uid": f"pod-{pod.name}",
                         "labels": labels, "annotations": annotations, "creationTimestamp": iso(pod.created_at)},
            "spec": spec, "status": status}


def node_view(node: str, pool, now: float) -> dict:
    labels = pool.node_labels(node)
    capacity = {"cpu": "64", "memory": "256Gi", "pods": "110"}
    acc = tpu_accelerator(pool.request)
    if acc is not None:
        capacity.update(cpu="112", memory="192Gi", **{TPU_RESOURCE: str(acc.chips_per_vm)})
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node, "labels": labels, "creationTimestamp": iso(pool.ready_at)},
            "status": {"capacity": capacity, "allocatable": capacity,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}


# --- requests ---------------------------------------------------------------------------------

def check_jobset(body: Any, namespace: str) -> JobSetRecord:
    """What the API server and JobSet's webhook refuse in a new JobSet (422 Invalid, 400 BadRequest)."""
    if not isinstance(body, dict) or body.get("kind") != "JobSet" or body.get("apiVersion") != f"{GROUP}/{VERSION}":
        raise KubeError(400, "BadRequest", f"the body must be a {GROUP}/{VERSION} JobSet")
    meta = body.get("metadata") or {}
    name = meta.get("name", "")
    if meta.get("namespace", namespace) != namespace:
        raise KubeError(400, "BadRequest", "the namespace of the provided object does not match the namespace sent "
                                           "on the request")

    def invalid(field: str, message: str) -> KubeError:
        return KubeError(422, "Invalid", f'JobSet.{GROUP} "{name}" is invalid: {field}: {message}',
                         {"name": name, "group": GROUP, "kind": "JobSet", "causes": [{"field": field,
                                                                                       "message": message}]})

    if not _DNS_LABEL.match(name) or len(name) > MAX_JOBSET_NAME:
        raise invalid("metadata.name", f"Invalid value: {name!r}: must be a DNS label of at most "
                                       f"{MAX_JOBSET_NAME} characters")
    spec = body.get("spec") or {}
    jobs = spec.get("replicatedJobs") or []
    names = [j.get("name") for j in jobs]
    if not jobs:
        raise invalid("spec.replicatedJobs", "Required value")
    if len(set(names)) != len(names):
        raise invalid("spec.replicatedJobs", "Duplicate value: replicated job names must be unique")
    for i, job in enumerate(jobs):
        pod = (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        if not pod.get("containers"):
            raise invalid(f"spec.replicatedJobs[{i}].template.spec.template.spec.containers", "Required value")
    coordinator = (spec.get("coordinator") or {}).get("replicatedJob")
    if coordinator is not None and coordinator not in names:
        raise invalid("spec.coordinator", f"replicatedJob {coordinator!r} does not exist")
    for target in (spec.get("successPolicy") or {}).get("targetReplicatedJobs") or []:
        if target not in names:
            raise invalid("spec.successPolicy.targetReplicatedJobs", f"{target!r} is not a replicated job")
    return JobSetRecord(name=name, namespace=namespace, manifest=body, uid="", create_time=0.0)


def handle(gke: GkeWorld, now: float, method: str, path: str, query: dict[str, str], body: Any):
    """One request: (status code, JSON body or text). Raises KubeError for a Status answer."""
    gke.reconcile(now)
    if match := _JOBSETS.match(path):
        return _jobsets(gke, now, method, match.group(1), match.group(2), query, body)
    if match := _PODS.match(path):
        namespace, name, log = match.groups()
        if method != "GET":
            raise KubeError(405, "MethodNotAllowed", f"the server does not allow this method on pods: {method}")
        if name is None:
            pods = [pod_view(gke, p, now) for p in sorted(gke.pods.values(), key=lambda p: p.created_at)
                    if p.namespace == namespace]
            pods = [p for p in pods if selector_matches(query.get("labelSelector", ""), p["metadata"]["labels"])]
            if query.get("watch", "").lower() in ("true", "1"):
                return 200, [{"type": "ADDED", "object": p} for p in pods]
            return 200, list_of("PodList", pods, gke)
        pod = gke.pods.get(f"{namespace}/{name}")
        if pod is None:
            raise not_found("pods", name)
        return (200, _log(gke, pod, now, query)) if log else (200, pod_view(gke, pod, now))
    if match := _EVENTS.match(path):
        namespace = match.group(1)
        items = [{"apiVersion": "v1", "kind": "Event",
                  "metadata": {"name": f"{e.name}.{i:x}", "namespace": e.namespace},
                  "involvedObject": {"kind": e.kind, "name": e.name, "namespace": e.namespace},
                  "reason": e.reason, "message": e.message, "type": e.type, "count": 1,
                  "firstTimestamp": iso(e.at), "lastTimestamp": iso(e.at)}
                 for i, e in enumerate(gke.events) if e.namespace == namespace and e.at <= now]
        selector = query.get("fieldSelector", "")
        items = [e for e in items if field_matches(selector, {"involvedObject.name": e["involvedObject"]["name"],
                                                               "involvedObject.kind": e["involvedObject"]["kind"]})]
        return 200, list_of("EventList", items, gke)
    if match := _NODES.match(path):
        nodes = [node_view(n, pool, now) for n, pool in gke.nodes(now)]
        if match.group(1):
            found = [n for n in nodes if n["metadata"]["name"] == match.group(1)]
            if not found:
                raise not_found("nodes", match.group(1))
            return 200, found[0]
        return 200, list_of("NodeList", [n for n in nodes if selector_matches(query.get("labelSelector", ""),
                                                                            n["metadata"]["labels"])], gke)
    answer = kube_objects.handle(gke, now, method, path, query, body)
    if answer is not None:
        return answer
    raise KubeError(404, "NotFound", "the server could not find the requested resource")


def _jobsets(gke: GkeWorld, now: float, method: str, namespace: str | None, name: str | None, query, body):
    if method == "POST" and namespace and not name:
        rec = check_jobset(body, namespace)
        key = f"{namespace}/{rec.name}"
        if key in gke.jobsets:
            raise KubeError(409, "AlreadyExists", f'{PLURAL}.{GROUP} "{rec.name}" already exists',
                            {"name": rec.name, "group": GROUP, "kind": PLURAL})
        rec.manifest.setdefault("metadata", {})["namespace"] = namespace
        rec.uid, rec.create_time, rec.attempt_start = f"jobset-{gke.token()}", now, now
        gke.jobsets[key] = rec
        gke.event(namespace, "JobSet", rec.name, "Created", f"JobSet {rec.name} created", now)
        gke.reconcile(now)
        return 201, jobset_view(gke, rec, now)
    if method == "GET" and not name:
        found = [j for k, j in sorted(gke.jobsets.items()) if namespace in (None, j.namespace)]
        items = [jobset_view(gke, j, now) for j in found
                 if selector_matches(query.get("labelSelector", ""), j.manifest.get("metadata", {}).get("labels", {}))]
        return 200, list_of("JobSetList", items, gke, f"{GROUP}/{VERSION}")
    rec = gke.jobsets.get(f"{namespace}/{name}") if namespace and name else None
    if rec is None:
        raise not_found(PLURAL, name or "", GROUP)
    if method == "GET":
        return 200, jobset_view(gke, rec, now)
    if method == "DELETE":
        for key in [k for k, p in gke.pods.items() if p.namespace == namespace and p.jobset == name]:
            del gke.pods[key]
        del gke.jobsets[f"{namespace}/{name}"]
        gke.event(namespace, "JobSet", name, "Deleted", f"JobSet {name} deleted", now)
        return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                     "details": {"name": name, "group": GROUP, "kind": PLURAL, "uid": rec.uid}}
    raise KubeError(405, "MethodNotAllowed", f"the server does not allow this method on {PLURAL}: {method}")


def _log(gke: GkeWorld, pod: PodRecord, now: float, query: dict[str, str]) -> str:
    view = pod_view(gke, pod, now)
    names = [c["name"] for c in view["spec"].get("containers", [])]
    container = query.get("container") or (names[0] if len(names) == 1 else None)
    if container is None:
        raise KubeError(400, "BadRequest", f"a container name must be specified for pod {pod.name}, choose one of: "
                                           f"[{' '.join(names)}]")
    init = [c["name"] for c in view["spec"].get("initContainers", [])]
    if container not in names + init:
        raise KubeError(400, "BadRequest", f"container {container} is not valid for pod {pod.name}")
    if pod.phase(now) == "Pending":
        raise KubeError(400, "BadRequest", f'container "{container}" in pod "{pod.name}" is waiting to start: '
                                           "ContainerCreating")
    if (container == "trainer" or pod.deployment) and pod.log_path:
        try:
            lines = Path(pod.log_path).read_text(errors="replace").splitlines()
        except OSError:
            lines = []
    else:
        lines = [f"[emulator] container {container} of pod {pod.name} runs nothing in a dry run "
                 "(the Pathways runtime and the other processes of a multi-controller run are not emulated)"]
    tail = query.get("tailLines")
    if tail and tail.isdigit():
        lines = lines[-int(tail):] if int(tail) else []
    return "".join(line + "\n" for line in lines)


# --- the server -----------------------------------------------------------------------------------

class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that went away before its answer (it timed out, or was killed) is not the server's error:
        the answer is dropped, as an API server does, without a traceback."""
        if isinstance(sys.exc_info()[1], (ConnectionError, ssl.SSLEOFError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class KubeServer:
    """The HTTPS server, started on 127.0.0.1 on a free port; its CA certificate for clients."""

    def __init__(self, world_call: WorldCall) -> None:
        self.ca_pem, cert_pem, key_pem = _certificates()
        self._dir = tempfile.TemporaryDirectory(prefix="moe-tpu-kube-")
        cert, key = Path(self._dir.name) / "server.pem", Path(self._dir.name) / "server.key"
        cert.write_bytes(cert_pem)
        key.write_bytes(key_pem)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self._server = _Server(("127.0.0.1", 0), _handler(world_call))
        # The TLS handshake happens on a connection's first read, in its own thread: done in accept(), a
        # client that connects and sends nothing would stop the server taking any other connection.
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                  do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._server.serve_forever, name="emulator-kube", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._dir.cleanup()


def _handler(world_call: WorldCall):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
            pass

        def _serve(self, method: str) -> None:
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if match := kube_objects.PROXY.match(url.path):
                return self._proxy(method, match, url.query, raw)
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                return self._send(400, KubeError(400, "BadRequest", "the body is not JSON").status())
            try:
                code, answer = world_call(lambda world, now: handle(world.gke, now, method, url.path, query, body))
            except KubeError as error:
                return self._send(error.code, error.status())
            self._send(code, answer)

        def _proxy(self, method: str, match, query: str, raw: bytes) -> None:
            """The Service's proxy: the request forwarded to a Ready pod's local server (outside the world's
            transaction: a completion takes seconds), its answer streamed back as it comes."""
            namespace, service, path = match.group(1), match.group(2), match.group(3) or "/"
            try:
                servers, key = world_call(lambda world, now: (
                    world.gke.servers, kube_objects.proxy_target(world.gke, now, namespace, service)))
                if servers is None:
                    raise KubeError(503, "ServiceUnavailable", "error trying to reach service: this emulator runs "
                                                               "no server (a dry run's does)")
                try:
                    stream = bool(json.loads(raw).get("stream")) if raw else False
                except (ValueError, AttributeError):
                    stream = False
                try:
                    code, kind, body = servers.forward(key, method, path + (f"?{query}" if query else ""), raw,
                                                       stream)
                except OSError as exc:
                    raise KubeError(503, "ServiceUnavailable", f"error trying to reach service: {exc}") from None
            except KubeError as error:
                return self._send(error.code, error.status())
            self.send_response(code)
            self.send_header("Content-Type", kind)
            if isinstance(body, bytes):
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in body:
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def _send(self, code: int, answer: Any) -> None:
            if isinstance(answer, str):
                data, kind = answer.encode(), "text/plain; charset=utf-8"
            elif isinstance(answer, list):  # a watch: one event per line
                data, kind = "".join(json.dumps(e) + "\n" for e in answer).encode(), "application/json"
            else:
                data, kind = json.dumps(answer).encode(), "application/json"
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's names
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

        def do_DELETE(self) -> None:  # noqa: N802
            self._serve("DELETE")

        def do_PUT(self) -> None:  # noqa: N802
            self._serve("PUT")

        def do_PATCH(self) -> None:  # noqa: N802
            self._serve("PATCH")

    return Handler


def _certificates() -> tuple[bytes, bytes, bytes]:
    """A CA and a server certificate for 127.0.0.1 signed by it, as a cluster's control plane has:
    (CA PEM, server certificate PEM, server key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "moe-tpu emulator cluster CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(ca_ski, critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem
