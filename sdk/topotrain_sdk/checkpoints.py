"""The checkpoint layout in S3, shared by the trainer (writes) and the operator (reads).

    <uri>/<namespace>/<name>/step-0000000042/attempt-3-9f2c41d0/  DCP shard files + .metadata
    <uri>/<namespace>/<name>/step-0000000042/COMMITTED  JSON {step, mesh, bytes, time, shards, request?,
                                                     attempt?}, written last
    <uri>/<namespace>/<name>/progress.json           JSON {step, time, attempt, start?, checkpointRequest?}
    <uri>/<namespace>/<name>/owner.json              JSON {uid, created}: whose run this is
    <uri>/<namespace>/<name>/failure.json            JSON {attempt, nodeRank, exitCode, time, pod}: a
                                                     pod's trainer rank failed and its supervisor stays up

Each save writes its shards under an attempt directory of its own,
`step-0000000042/attempt-<K>-<token>/` (K: TOPOTRAIN_ATTEMPT; token: random per
trainer run), and COMMITTED names it (`"shards"`); readers load only that one.
So a previous attempt still shutting down, or an earlier job of the same name,
writing the same step can never mix its shards into a committed checkpoint.
Checkpoints of the older layout (shards in the step directory, no `"shards"`)
stay readable.

A checkpoint exists only once its COMMITTED marker exists; everything else
under a step directory is a partial upload. boto3 only (no torch), so the
operator image stays small. URIs stay strings (`s3://bucket/key/prefix`).
The layout's paths (`job_prefix`, `step_dir`, ...) and records (`CommittedCheckpoint`,
`Progress`, `AttemptStart`, ...) live in `records.py`, exported from here too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from topotrain_sdk.records import (
    STEP_PREFIX,
    AttemptStart,
    CommittedCheckpoint,
    PrefixOwner,
    Progress,
    ServedRequest,
    WorkerFailure,
    attempt_dir,
    format_time,
    job_prefix,
    parse_time,
    split_uri,
    step_dir,
    utc_now,
)
from topotrain_sdk.s3client import OPERATOR_TIMEOUTS, make_client

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import ObjectIdentifierTypeDef

# The layout's paths and records are this module's names too: the trainer and the operator
# import them from here.
__all__ = [
    "COMMITTED", "FAILURE", "OWNER", "PROGRESS", "SCAN_PAGES", "SCAN_READS", "STEP_PREFIX",
    "AttemptStart", "CheckpointError",
    "CheckpointStore", "CommittedCheckpoint", "PrefixOwner", "Progress", "ServedRequest",
    "WorkerFailure", "attempt_dir", "job_prefix", "operator_store", "split_uri", "step_dir",
]  # fmt: skip

COMMITTED = "COMMITTED"
PROGRESS = "progress.json"
OWNER = "owner.json"  # the TrainingJob (by UID) whose checkpoints these are; the operator writes it
FAILURE = "failure.json"  # a supervisor's report of its own rank's failure (it waits for a restart)
_STEP_RE = re.compile(r"^step-(\d{10})$")
SCAN_PAGES, SCAN_READS = 20, 32  # the operator's bounds on one scan of a (user's) bucket


class CheckpointError(RuntimeError):
    """The checkpoint store holds something that does not follow the layout."""


class CheckpointStore:
    """One job's checkpoint directory in an S3-compatible store.

    Build it from endpoint and credentials, or hand it a ready boto3 client
    (tests pass the testbed's; a unit test may pass a fake):

        CheckpointStore("s3://ckpt/ns/job", "http://s3:9000", "key", "secret")
        CheckpointStore("s3://ckpt/ns/job", client=boto3.client("s3"))
    """

    def __init__(
        self,
        prefix_uri: str,
        endpoint: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        *,
        client: S3Client | None = None,
    ) -> None:
        self.uri = prefix_uri.rstrip("/")
        self.bucket, self.key_prefix = split_uri(self.uri)
        self.client: S3Client = client or make_client(endpoint, access_key, secret_key)

    # --- keys -------------------------------------------------------------

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.key_prefix, *parts) if p)

    def step_key(self, step: int) -> str:
        """The key prefix of a step directory (no trailing slash)."""
        return self._key(f"{STEP_PREFIX}{step:010d}")

    def step_uri(self, step: int) -> str:
        return step_dir(self.uri, step)

    # --- listing ----------------------------------------------------------

    def _list(self, prefix: str, delimiter: str = "") -> Iterator[dict[str, Any]]:
        """Every page of list_objects_v2 under `prefix`."""
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                args["Delimiter"] = delimiter
            if token:
                args["ContinuationToken"] = token
            page: dict[str, Any] = dict(self.client.list_objects_v2(**args))
            yield page
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def step_dirs(self, pages: int = 0) -> list[int]:
        """Every step directory present, committed or not, ascending (from at most `pages` pages
        of listing, 0: all; more is a CheckpointError)."""
        root = self._key("") + "/" if self.key_prefix else ""
        steps: list[int] = []
        for count, page in enumerate(self._list(root, delimiter="/")):
            if pages and count >= pages:
                raise CheckpointError(f"{self.uri}: over {pages} pages of step directories; not read")
            for common in page.get("CommonPrefixes", []):
                name = str(common["Prefix"])[len(root) :].rstrip("/")
                match = _STEP_RE.match(name)
                if match:
                    steps.append(int(match.group(1)))
        return sorted(steps)

    def step_objects(self, step: int) -> dict[str, int]:
        """Object names (relative to the step directory) and sizes."""
        root = self.step_key(step) + "/"
        objects: dict[str, int] = {}
        for page in self._list(root):
            for obj in page.get("Contents", []):
                objects[str(obj["Key"])[len(root) :]] = int(obj.get("Size", 0))
        return objects

    # --- commits ----------------------------------------------------------

    def _read_json(self, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        loaded = json.loads(body)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"s3://{self.bucket}/{key} is not a JSON object")
        return loaded

    def _write_json(self, key: str, document: Mapping[str, Any]) -> None:
        body = json.dumps(document, sort_keys=True).encode()
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body, ContentType="application/json")

    def read_commit(self, step: int) -> CommittedCheckpoint | None:
        """The COMMITTED marker of `step`, or None while the checkpoint is partial."""
        doc = self._read_json(f"{self.step_key(step)}/{COMMITTED}")
        if doc is None:
            return None
        try:
            return CommittedCheckpoint(
                step=int(doc["step"]),
                uri=self.step_uri(step),
                time=parse_time(str(doc["time"])),
                mesh={str(k): int(v) for k, v in dict(doc.get("mesh", {})).items()},
                bytes=int(doc.get("bytes", 0)),
                shards=str(doc.get("shards", "")),
                request=str(doc.get("request", "")),
                saved_by=None if doc.get("attempt") is None else int(doc["attempt"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{self.step_uri(step)}/{COMMITTED} is malformed: {err}") from err

    def list_committed(self) -> list[CommittedCheckpoint]:
        """Every complete checkpoint, ascending by step."""
        found = (self.read_commit(step) for step in self.step_dirs())
        return [c for c in found if c is not None]

    def latest_committed(self) -> CommittedCheckpoint | None:
        """The highest step with a COMMITTED marker; partial checkpoints never count."""
        return self.newest_resumable(reads=0, pages=0)[0]

    def newest_resumable(
        self, admits: Callable[[CommittedCheckpoint], bool] | None = None,
        reads: int = SCAN_READS, pages: int = SCAN_PAGES,
    ) -> tuple[CommittedCheckpoint | None, CommittedCheckpoint | None]:
        """(the highest commit `admits` accepts, the highest one it refused above that), reading
        at most `pages` pages of listing and `reads` COMMITTED markers (0: no bound; beyond them a
        CheckpointError): the operator's cost is not left to the contents of a user's bucket."""
        steps, skipped = self.step_dirs(pages), None
        for count, step in enumerate(reversed(steps)):
            if reads and count >= reads:
                raise CheckpointError(f"{self.uri}: no usable COMMITTED among the newest {reads} "
                                      f"step directories (of {len(steps)}); not read further")
            commit = self.read_commit(step)
            if commit is not None and (admits is None or admits(commit)):
                return commit, skipped
            skipped = skipped or commit
        return None, skipped

    def write_commit(
        self, step: int, mesh: Mapping[str, int], bytes: int, time: datetime | None = None,
        *, shards: str = "", request: str = "", attempt: int | None = None,
    ) -> CommittedCheckpoint:
        """Mark `step` complete with the shards in `shards`. Call only after every one of
        them is uploaded. `request`: the checkpoint request this save served; `attempt`: whose."""
        moment = time or utc_now()
        doc: dict[str, Any] = {"step": step, "mesh": dict(mesh), "bytes": bytes, "time": format_time(moment)}
        if shards:
            doc["shards"] = shards
        if request:
            doc["request"] = request
        doc.update({} if attempt is None else {"attempt": attempt})
        self._write_json(f"{self.step_key(step)}/{COMMITTED}", doc)
        return CommittedCheckpoint(step, self.step_uri(step), moment, dict(mesh), bytes, shards,
                                   request, attempt)

    # --- progress heartbeat -------------------------------------------------

    def read_progress(self) -> Progress | None:
        doc = self._read_json(self._key(PROGRESS))
        if doc is None:
            return None
        try:
            contract = doc.get("contract")
            return Progress(int(doc["step"]), parse_time(str(doc["time"])), int(doc["attempt"]),
                            AttemptStart.from_json(doc.get("start")),
                            ServedRequest.from_json(doc.get("checkpointRequest")),
                            None if contract is None else int(contract))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{self.uri}/{PROGRESS} is malformed: {err}") from err

    def write_progress(
        self, step: int, attempt: int, time: datetime | None = None,
        start: AttemptStart | None = None, request: ServedRequest | None = None,
        contract: int | None = None,
    ) -> Progress:
        """`contract`: the contract version the writing SDK speaks (the SDK's heartbeat sets it)."""
        moment = time or utc_now()
        doc: dict[str, object] = {"step": step, "time": format_time(moment), "attempt": attempt}
        if contract is not None:
            doc["contract"] = contract
        if start is not None:
            doc["start"] = start.to_json()
        if request is not None:
            doc["checkpointRequest"] = request.to_json()
        self._write_json(self._key(PROGRESS), doc)
        return Progress(step, moment, attempt, start, request, contract)

    # --- a supervisor's failure report --------------------------------------

    def read_failure(self) -> WorkerFailure | None:
        """The last failure report; None when there is none or it is malformed (the pod's own
        failure, seen later, still restarts the gang)."""
        try:
            doc = self._read_json(self._key(FAILURE))
        except (CheckpointError, ValueError):
            return None
        if doc is None:
            return None
        try:
            return WorkerFailure(int(doc["attempt"]), int(doc["nodeRank"]), int(doc["exitCode"]),
                                 parse_time(str(doc["time"])), str(doc.get("pod", "")))
        except (KeyError, TypeError, ValueError):
            return None

    def write_failure(self, failure: WorkerFailure) -> None:
        self._write_json(self._key(FAILURE), failure.to_json())

    # --- owner record (written by the operator, never by the trainer) -------

    def read_owner(self) -> PrefixOwner | None:
        doc = self._read_json(self._key(OWNER))
        if doc is None:
            return None
        try:
            step = doc.get("resumedStep")
            return PrefixOwner(
                uid=str(doc["uid"]), created=parse_time(str(doc["created"])),
                resumed_uid=None if doc.get("resumedUid") is None else str(doc["resumedUid"]),
                resumed_step=None if step is None else int(step),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{self.uri}/{OWNER} is malformed: {err}") from err

    def write_owner(self, owner: PrefixOwner) -> None:
        doc: dict[str, Any] = {"uid": owner.uid, "created": format_time(owner.created)}
        if owner.resumed_step is not None:
            doc.update(resumedUid=owner.resumed_uid or "", resumedStep=owner.resumed_step)
        self._write_json(self._key(OWNER), doc)

    # --- shard files --------------------------------------------------------

    def shard_key(self, step: int, name: str, *, shards: str = "") -> str:
        """The key of one file in the attempt directory `shards` of a step ("": old layout)."""
        return "/".join(p for p in (self.step_key(step), shards, name) if p)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes of object `key` from offset `start` (one ranged GET)."""
        if length <= 0:
            return b""
        response = self.client.get_object(Bucket=self.bucket, Key=key,
                                          Range=f"bytes={start}-{start + length - 1}")  # fmt: skip
        body: bytes = response["Body"].read()
        if len(body) != length:
            raise CheckpointError(f"s3://{self.bucket}/{key}: asked {length} bytes at {start}, got {len(body)}")
        return body

    def upload_file(self, step: int, name: str, path: Path | str, *, shards: str = "") -> None:
        """Upload one shard file into the attempt directory `shards` of a step (multipart
        when large); "" writes the old layout, into the step directory itself."""
        self.client.upload_file(str(path), self.bucket, self.shard_key(step, name, shards=shards))

    def download_step(self, step: int, dest: Path | str) -> list[str]:
        """Download the shards COMMITTED names (old layout: the step directory's own files)
        into `dest`; returns the names."""
        commit = self.read_commit(step)
        shards = commit.shards if commit is not None else ""
        inside = f"{shards}/" if shards else ""
        names = sorted(n[len(inside):] for n in self.step_objects(step)
                       if n.startswith(inside) and "/" not in n[len(inside):])  # fmt: skip
        for name in names:
            target = Path(dest) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            key = "/".join(p for p in (self.step_key(step), shards, name) if p)
            self.client.download_file(self.bucket, key, str(target))
        return names

    # --- retention ----------------------------------------------------------

    def delete_step(self, step: int) -> None:
        """Delete a step directory, its COMMITTED marker first (so it never looks complete)."""
        self._delete(step, sorted(self.step_objects(step), key=lambda n: n != COMMITTED))

    def _delete(self, step: int, names: list[str]) -> None:
        keys = [f"{self.step_key(step)}/{name}" for name in names]
        for start in range(0, len(keys), 1000):
            chunk: list[ObjectIdentifierTypeDef] = [{"Key": k} for k in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True})

    def apply_retention(self, keep: int) -> list[int]:
        """Keep the newest `keep` committed checkpoints, and the one that served the newest
        checkpoint request; delete older committed ones and
        uncommitted leftovers older than the newest commit. Newer uncommitted directories
        may be uploads in flight and stay. Returns the deleted steps, ascending."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        commits = {c.step: c for c in self.list_committed()}
        if not commits:
            return []
        kept = set(sorted(commits)[-keep:])
        newest = max(commits)
        # The step that served the newest checkpoint request is where the operator resumes the
        # gang after a planned change; the old gang commits on (its periodic and its SIGTERM
        # saves) until it is stopped, and must not delete the step its successor loads.
        if request := commits[newest].request:
            kept.add(min(s for s, c in commits.items() if c.request == request))
        doomed = [s for s in self.step_dirs() if s not in kept and s < newest]
        for step in doomed:
            self.delete_step(step)
        # Other attempts' shards in a kept step: garbage, except in the newest step, where a
        # slower attempt may still be writing (and may yet commit its own, complete, copy).
        for step in kept - {newest}:
            if shards := commits[step].shards:
                self._delete(step, [n for n in self.step_objects(step)
                                    if n != COMMITTED and not n.startswith(f"{shards}/")])  # fmt: skip
        return doomed


def operator_store(
    prefix_uri: str, endpoint: str | None, credentials: tuple[str, str] | None
) -> CheckpointStore:
    """The operator's client for one job's store, with OPERATOR_TIMEOUTS.

    Signed with the job's Secret (`credentials`), else unsigned: the operator
    never lends its own identity (environment, IRSA, instance role) to the
    endpoint a job names.
    """
    access, secret = credentials or (None, None)
    client = make_client(endpoint, access, secret, unsigned=credentials is None,
                         timeouts=OPERATOR_TIMEOUTS)  # fmt: skip
    return CheckpointStore(prefix_uri, client=client)
