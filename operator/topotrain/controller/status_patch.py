"""The status write's patch: what the operator sends to turn the status it last wrote into the new one.

Pure (no API client): `Kube.patch_status` sends it. Tested in tests/unit/test_status_patch.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 JSON merge patch turning `old` into `new` (lists are replaced whole)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any], uid: str | None,
                 resource_version: str | None = None) -> list[dict[str, Any]]:
    """A JSON patch (RFC 6902) turning status `old` into `new`, only on the object `uid`, and
    only if the object is still at `resource_version` (the version the pass decided from: the
    API server answers 409 Conflict otherwise, also to a patch that changes nothing).

    The first op tests `metadata.uid`, so a patch meant for a deleted job never lands on a
    namesake re-created meanwhile (a merge patch of the status subresource ignores a
    metadata.uid that differs: measured on the testbed). The next op tests the phase the
    writer started from (`old`'s), so a writer whose view is stale cannot move the job back
    (a second operator replica acting while the leader's peering keep-alive was held up by an
    API server restart rewrote a job the leader had just marked Succeeded as Recovering,
    and the job was stranded: the chaos soak, 2026-12-04). Each top-level status field that
    changed is set whole; a removed one is set to null, which the API server prunes (no CRD
    field is nullable). With no status yet, the whole status is set.
    """
    ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": uid}] if uid else []
    if resource_version:
        ops.append({"op": "replace", "path": "/metadata/resourceVersion", "value": resource_version})
    if old.get("phase") is not None:
        ops.append({"op": "test", "path": "/status/phase", "value": old["phase"]})
    if not old:
        return [*ops, {"op": "add", "path": "/status", "value": dict(new)}]
    changed = merge_patch(old, new)
    return [*ops, *({"op": "add", "path": f"/status/{pointer(key)}", "value": new.get(key)}
                    for key in sorted(changed))]


def pointer(key: str) -> str:
    """`key` as one segment of a JSON pointer (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def tested_patch(label: str, value: str, patch: Mapping[str, Mapping[str, str]]) -> list[dict[str, Any]]:
    """A JSON patch setting `patch`'s metadata maps (labels, annotations) on an object whose
    `label` still holds `value` (the test op fails, 422, otherwise)."""
    test = [{"op": "test", "path": f"/metadata/labels/{pointer(label)}", "value": value}]
    return test + [{"op": "add", "path": f"/metadata/{part}/{pointer(key)}", "value": item}
                   for part, items in patch.items() for key, item in items.items()]
