"""`[tracking]` is validated like the rest of the job spec: a tracker without where it
lives, or a field nobody knows, is refused before the job reaches a queue."""

from __future__ import annotations

import pytest

from shared.contracts import JobSpec, convert
from shared.errors import ContractError

BASE = {"name": "t", "entry_point": "m:f", "total_steps": 5}


@pytest.mark.parametrize(
    "tracking, error",
    [
        ({"kind": "tensorboard"}, "needs `dir`"),
        ({"kind": "mlflow", "project": "p"}, "needs `uri`"),
        ({"kind": "neptune", "uri": "x"}, "neptune"),
        ({"kind": "wandb", "colour": "red"}, "unknown field `colour`"),
        ({"kind": "wandb", "project": "a/b"}, "regex"),
    ],
)
def test_a_bad_tracking_table_is_refused(tracking: dict[str, str], error: str) -> None:
    with pytest.raises(ContractError) as refused:
        convert({**BASE, "tracking": tracking}, JobSpec)
    said = str(refused.value)
    assert "tracking" in said and (error in said or "one of" in said), said


def test_a_tracking_table_is_kept() -> None:
    spec = convert({**BASE, "tracking": {"kind": "mlflow", "uri": "http://h:5000"}}, JobSpec)
    assert spec.tracking is not None and spec.tracking.project == "baton"
    assert convert({**BASE}, JobSpec).tracking is None
