"""A job's experiment tracker (`[tracking]`): one tracker run per Baton run, whatever its
attempts. Which tracker, where it lives and under what project; the tracker run's identity
is never the submitter's to give — it is derived from the run id (`baton.tracking.identity`),
so every attempt of a run, on any trainer, lands in the same tracker run."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

Kind = Literal["tensorboard", "mlflow", "wandb"]


class Tracking(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the run's metrics go (docs/tracking.md)."""

    kind: Kind
    project: Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f/]+$")] = (
        "baton"
    )
    """The MLflow experiment, the W&B project; a TensorBoard log dir's folder under `dir`."""
    uri: (
        Annotated[str, Meta(min_length=1, max_length=1024, pattern=r"^[^\x00-\x1f\x7f]+$")] | None
    ) = None
    """MLflow's tracking URI (`http://host:5000`, `sqlite:///…`, `file:///…`); W&B's base
    URL (`WANDB_BASE_URL`), unset for its cloud. Required for MLflow; unused by
    TensorBoard."""
    dir: (
        Annotated[str, Meta(min_length=1, max_length=1024, pattern=r"^[^\x00-\x1f\x7f]+$")] | None
    ) = None
    """TensorBoard's root log dir, a path every trainer of the pool can reach (a shared
    file system): each run writes `<dir>/<project>/<run id>`. W&B's local dir
    (`WANDB_DIR`). Required for TensorBoard."""
    mode: Literal["online", "offline"] = "online"
    """W&B only (`WANDB_MODE`): `offline` keeps the run in `dir`, for `wandb sync`."""

    def __post_init__(self) -> None:
        if self.kind == "tensorboard" and self.dir is None:
            raise ValueError("tracking: a TensorBoard tracker needs `dir`, its root log dir")
        if self.kind == "mlflow" and self.uri is None:
            raise ValueError("tracking: an MLflow tracker needs `uri`, its tracking URI")
