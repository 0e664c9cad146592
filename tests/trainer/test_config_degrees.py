"""The bundled trainer accepts exactly the data degrees the operator plans with.

Pure: the trainer's config check (what makes it exit 78) against the operator's rule
(topotrain.degrees), over every degree 1..32 for a table of batch settings.
"""

from __future__ import annotations

from typing import Any

import pytest
from topotrain import degrees
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.validation import degree_rule
from topotrain_trainer.config import ConfigError, TrainingConfig

pytestmark = pytest.mark.trainer


def test_the_trainer_defaults_are_the_rules_defaults() -> None:
    config = TrainingConfig()
    assert (config.global_batch, config.micro_batch, config.schedule) == (
        degrees.DEFAULT_GLOBAL_BATCH, degrees.DEFAULT_MICRO_BATCH, degrees.DEFAULT_SCHEDULE,
    )


@pytest.mark.parametrize(
    ("training", "pipeline"),
    [
        ({"globalBatch": 64}, 2),  # examples/elastic-two-pools.yaml
        ({"globalBatch": 16}, 4),
        ({"globalBatch": 16, "schedule": "gpipe"}, 4),
        ({"microBatch": 1}, 1),  # globalBatch at the trainer's default
        ({"globalBatch": 48, "microBatch": 3}, 1),
        ({"global_batch": 24, "micro_batch": 2}, 3),  # snake_case, as the trainer accepts it
    ],
)
def test_trainer_refuses_exactly_what_the_operator_never_plans(
    training: dict[str, Any], pipeline: int
) -> None:
    config = TrainingConfig.from_mapping({"model": "tiny", **training})
    spec = TrainingJobSpec.model_validate({
        "image": "trainer:1", "worker": {"gpusPerPod": 1}, "training": training,
        "parallelism": {"tensor": 1, "pipeline": pipeline, "data": 32},
    })
    rule = degree_rule(spec)
    for data in range(1, 33):
        try:
            config.check_mesh(1, pipeline, data)
            refused = None
        except ConfigError as err:
            refused = str(err)
        assert refused == rule.problem(data), f"data={data}"
    assert rule.degrees(1, 32), "every table row allows some degree"
