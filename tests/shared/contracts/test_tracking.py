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


def test_a_spec_without_tracking_keeps_its_hash() -> None:
    """Checkpoints written before `[tracking]` existed carry their spec's hash: a run
    without one hashes as it did then (the value from before the field was added)."""
    from shared.contracts import spec_hash

    assert spec_hash(convert(BASE, JobSpec)) == "26b5b94d0e7b6992"
    tracked = convert({**BASE, "tracking": {"kind": "wandb"}}, JobSpec)
    assert spec_hash(tracked) != "26b5b94d0e7b6992"
