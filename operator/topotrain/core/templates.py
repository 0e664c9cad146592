"""spec.templateRef: which TrainingJobTemplate generation a pass plans from, pure.

A job resolves its template once and records it in status.jobTemplate (name, generation and
the template's spec): every later pass merges the job's spec over that record, so an edit of
the template never touches a running job, nor survives an operator restart as a surprise. A
job with `followUpdates: true` reads the template each pass and takes a new generation (a
changed pod template then rolls the gang, as a spec edit does). A job naming another template
(its templateRef edited) reads the new one. The merge is api/job_template.py's.

What stops a pass: the named template does not exist (TemplateNotFound, before the job first
resolved it; later, its record is used), or the merged spec is invalid (TemplateMergeInvalid,
naming the field). Either way the job waits with ConfigValid=False and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from topotrain.api.job_template import resolve
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import JobTemplateStatus, Reason


@dataclass(frozen=True)
class Resolved:
    """The spec a pass plans from, the template record behind it, or why there is none."""

    spec: TrainingJobSpec | None
    record: JobTemplateStatus | None = None
    reason: str = ""
    message: str = ""


def _ref(job: Mapping[str, Any]) -> Mapping[str, Any] | None:
    ref = job.get("templateRef")
    return ref if isinstance(ref, Mapping) and ref.get("name") else None


def to_read(job: Mapping[str, Any], recorded: JobTemplateStatus | None) -> str | None:
    """The template this pass must read from the API server, or None (no template, or the
    recorded generation is the one to keep)."""
    ref = _ref(job)
    if ref is None:
        return None
    name = str(ref["name"])
    if recorded is not None and recorded.name == name and not ref.get("followUpdates"):
        return None
    return name


def resolve_job(job: Mapping[str, Any], recorded: JobTemplateStatus | None,
                live: Mapping[str, Any] | None) -> Resolved:
    """The job's spec (merged over its template when it names one). `live`: the template as
    read this pass (to_read named it), None when it was not read or does not exist."""
    ref = _ref(job)
    if ref is None:
        try:
            return Resolved(TrainingJobSpec.model_validate(dict(job)))
        except ValidationError as exc:
            return Resolved(None, reason=Reason.INVALID_SPEC, message=" ".join(str(exc).splitlines()[0:3]))
    name = str(ref["name"])
    record = recorded if recorded is not None and recorded.name == name else None
    if live is not None:
        meta = live.get("metadata") or {}
        record = JobTemplateStatus(name=name, generation=int(meta.get("generation") or 0),
                                   spec=dict(live.get("spec") or {}))
    elif record is None:
        return Resolved(None, reason=Reason.TEMPLATE_NOT_FOUND,
                        message=f"spec.templateRef.name: TrainingJobTemplate {name!r} does not "
                        "exist; the job waits for it")
    spec, problem = resolve(job, record.spec, name, record.generation)
    if spec is None:
        return Resolved(None, record, Reason.TEMPLATE_INVALID, problem)
    return Resolved(spec, record)
