"""What every handler of the emulated Kubernetes API shares: its error answers (`Status` objects), label
and field selectors, and list documents."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from provision.emulator.gke_world import GkeWorld


class KubeError(Exception):
    """An answer other than 2xx, as a Kubernetes Status object."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "details": self.details, "code": self.code}


def not_found(kind: str, name: str, group: str = "") -> KubeError:
    resource = f"{kind}.{group}" if group else kind
    return KubeError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "group": group, "kind": kind})


# --- selectors --------------------------------------------------------------------------------

def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """A label selector's equality and existence terms (k=v, k==v, k!=v, k, !k), comma-joined."""
    for term in (t.strip() for t in selector.split(",") if t.strip()):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_matches(selector: str, fields: dict[str, str]) -> bool:
    """A field selector's equality terms over the fields an object offers (400 for another field)."""
    for term in (t.strip() for t in selector.split(",") if t.strip()):
        key, _, value = term.replace("==", "=").partition("=")
        if key not in fields:
            raise KubeError(400, "BadRequest", f'"{key}" is not a known field selector: only '
                                               f'"{", ".join(sorted(fields))}"')
        if fields[key] != value:
            return False
    return True


def list_of(kind: str, items: list[dict], gke: GkeWorld, api_version: str = "v1") -> dict:
    return {"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": str(gke.counter)},
            "items": items}
