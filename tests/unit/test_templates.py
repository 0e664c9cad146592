"""TrainingJobTemplate (issue 36): the merge rule as a table, then which generation a pass plans
from (core/templates.py), pure."""

from __future__ import annotations

from typing import Any

import pytest
from topotrain.api.job_template import merge, template_problems
from topotrain.api.status import JobTemplateStatus, Reason
from topotrain.core.templates import resolve_job, to_read

# What the API server stores for a job that wrote only image and parallelism (its defaults).
STORED_DEFAULTS: dict[str, Any] = {
    "rankOrder": "tp-pp-dp", "env": [], "worker": {"gpusPerPod": 8, "gpuTypes": [], "tolerations": []},
    "topology": {"tensor": "Required", "pipeline": "Preferred", "data": "Preferred"},
    "failurePolicy": {"maxRestarts": 20, "nonRetryableExitCodes": [78], "rules": []},
    "training": {}, "suspend": False,
}


@pytest.mark.parametrize(("template", "job", "merged"), [
    # a field only the template sets
    ({"image": "platform:1"}, {}, {"image": "platform:1"}),
    # the job wins a field both set
    ({"image": "platform:1"}, {"image": "mine:2"}, {"image": "mine:2"}),
    # objects merge field by field, at any depth
    ({"worker": {"gpusPerPod": 4, "resources": {"requests": {"cpu": "8", "memory": "64Gi"}}}},
     {"worker": {"resources": {"requests": {"cpu": "16"}}}},
     {"worker": {"gpusPerPod": 4, "resources": {"requests": {"cpu": "16", "memory": "64Gi"}}}}),
    # maps (labels, nodeSelector, training) merge key by key
    ({"worker": {"labels": {"team": "platform", "tier": "gold"}}}, {"worker": {"labels": {"team": "llm"}}},
     {"worker": {"labels": {"team": "llm", "tier": "gold"}}}),
    ({"training": {"model": "tiny", "steps": 100}}, {"training": {"steps": 500}},
     {"training": {"model": "tiny", "steps": 500}}),
    # a list is one value: the job's whole list, never merged item by item
    ({"worker": {"tolerations": [{"key": "a", "operator": "Exists"}]}},
     {"worker": {"tolerations": [{"key": "b", "operator": "Exists"}]}},
     {"worker": {"tolerations": [{"key": "b", "operator": "Exists"}]}}),
    ({"command": ["python", "-m", "train"]}, {"command": ["bash"]}, {"command": ["bash"]}),
    # a job field at the CRD's default counts as unset (the API server stores what a job left out)
    ({"worker": {"gpusPerPod": 4, "tolerations": [{"key": "a", "operator": "Exists"}]}},
     {"worker": {"gpusPerPod": 8, "tolerations": []}},
     {"worker": {"gpusPerPod": 4, "tolerations": [{"key": "a", "operator": "Exists"}]}}),
    ({"failurePolicy": {"maxRestarts": 3, "nonRetryableExitCodes": [78, 3]}},
     {"failurePolicy": {"maxRestarts": 20, "nonRetryableExitCodes": [78], "backoffSeconds": 1}},
     {"failurePolicy": {"maxRestarts": 3, "nonRetryableExitCodes": [78, 3], "backoffSeconds": 1}}),
    # ... and a job value other than the default wins
    ({"failurePolicy": {"maxRestarts": 3}}, {"failurePolicy": {"maxRestarts": 5}}, {"failurePolicy": {"maxRestarts": 5}}),
    # fields without a default: the job's value wins even when it is a "zero"
    ({"checkpoint": {"uri": "s3://platform/runs", "keep": 5}}, {"checkpoint": {"keep": 1}},
     {"checkpoint": {"uri": "s3://platform/runs", "keep": 1}}),
])
def test_the_job_wins_field_by_field(template: dict[str, Any], job: dict[str, Any],
                                     merged: dict[str, Any]) -> None:
    assert merge(template, job) == merged


def test_a_stored_job_takes_every_platform_setting_it_left_out() -> None:
    template = {"image": "platform:1", "worker": {"gpusPerPod": 4, "gpuTypes": ["H100-80GB"]},
                "topology": {"pipeline": "Required"}, "failurePolicy": {"maxRestarts": 3}}
    job = {**STORED_DEFAULTS, "parallelism": {"tensor": 4, "data": 2}, "templateRef": {"name": "t"}}
    out = merge(template, job)
    assert out["image"] == "platform:1" and out["worker"]["gpusPerPod"] == 4
    assert out["worker"]["gpuTypes"] == ["H100-80GB"] and out["topology"]["pipeline"] == "Required"
    assert out["failurePolicy"]["maxRestarts"] == 3 and out["parallelism"] == {"tensor": 4, "data": 2}


TEMPLATE = {"metadata": {"name": "t", "generation": 3},
            "spec": {"image": "platform:1", "worker": {"gpusPerPod": 4}}}
JOB = {**STORED_DEFAULTS, "parallelism": {"tensor": 4, "data": 2}, "templateRef": {"name": "t"}}
RECORD = JobTemplateStatus(name="t", generation=2, spec={"image": "platform:0", "worker": {"gpusPerPod": 4}})


def test_a_job_resolves_its_template_once_and_keeps_that_generation() -> None:
    assert to_read(JOB, None) == "t"
    first = resolve_job(JOB, None, TEMPLATE)
    assert first.spec is not None and first.spec.image == "platform:1" and first.spec.pods == 2
    assert first.record is not None and (first.record.name, first.record.generation) == ("t", 3)
    # later passes read nothing: the record is the template (its later edits are not seen)
    assert to_read(JOB, RECORD) is None
    later = resolve_job(JOB, RECORD, None)
    assert later.spec is not None and later.spec.image == "platform:0" and later.record == RECORD


def test_a_job_following_updates_takes_each_new_generation() -> None:
    following = {**JOB, "templateRef": {"name": "t", "followUpdates": True}}
    assert to_read(following, RECORD) == "t"
    out = resolve_job(following, RECORD, TEMPLATE)
    assert out.spec is not None and out.spec.image == "platform:1" and out.record.generation == 3  # type: ignore[union-attr]
    gone = resolve_job(following, RECORD, None)  # deleted since: the record stays in use
    assert gone.spec is not None and gone.spec.image == "platform:0"


def test_a_job_naming_another_template_reads_it() -> None:
    assert to_read({**JOB, "templateRef": {"name": "other"}}, RECORD) == "other"


def test_a_missing_template_stops_the_job_naming_the_field() -> None:
    out = resolve_job(JOB, None, None)
    assert out.spec is None and out.reason == Reason.TEMPLATE_NOT_FOUND
    assert out.message.startswith("spec.templateRef.name: TrainingJobTemplate 't' does not exist")


@pytest.mark.parametrize(("template_spec", "job_image", "field"), [
    ({"worker": {"gpusPerPod": 3}}, True, "spec.worker.gpusPerPod (3) must divide"),  # 8 ranks
    ({"checkpoint": {"uri": "gs://bucket"}}, True, "spec.checkpoint.uri"),
    ({"worker": {"gpusPerPod": 4}}, False, "spec.image: Field required"),  # neither sets the image
])
def test_an_invalid_merge_stops_the_job_naming_the_field(template_spec: dict[str, Any], job_image: bool,
                                                         field: str) -> None:
    job = {**JOB, "image": "mine:1"} if job_image else JOB
    out = resolve_job(job, None, {"metadata": {"generation": 1}, "spec": template_spec})
    assert out.spec is None and out.reason == Reason.TEMPLATE_INVALID
    assert field in out.message and "merged over TrainingJobTemplate t generation 1" in out.message


def test_a_job_without_a_template_is_its_own_spec() -> None:
    plain = {k: v for k, v in JOB.items() if k != "templateRef"}
    assert to_read(plain, None) is None
    out = resolve_job({**plain, "image": "mine:1", "worker": {"gpusPerPod": 4}}, None, None)
    assert out.spec is not None and out.record is None
    bad = resolve_job(plain, None, None)  # no image
    assert bad.spec is None and bad.reason == Reason.INVALID_SPEC and "image" in bad.message


@pytest.mark.parametrize(("spec", "field"), [
    ({"image": "platform:1", "worker": {"gpusPerPod": 4, "gpuTypes": ["H100-80GB"]}}, None),
    ({"failurePolicy": {"rules": [{"name": "oom", "action": "Fail", "onTerminationReasons": ["OOMKilled"]}]}}, None),
    ({"worker": {"gpusPerPod": 0}}, "spec.worker.gpusPerPod"),
    ({"failurePolicy": {"maxRestarts": -1}}, "spec.failurePolicy.maxRestarts"),
    ({"templateRef": {"name": "t"}}, "spec.templateRef"),
])
def test_a_template_is_checked_on_its_own_naming_the_field(spec: dict[str, Any], field: str | None) -> None:
    found = template_problems(spec)
    assert (found == []) if field is None else (found and found[0].startswith(field)), found
