"""What `baton rollback` and `baton fork` do over NATS and the store, apart from how they
print. Each checks first what the services would refuse — a run that is over, a step with no
committed checkpoint, a damaged one, a run not the user's — and says why at once: a request
the services refuse is only a dead letter."""

from __future__ import annotations

import asyncio
import json
import tomllib
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client

from baton.client import calls as client
from baton.client.errors import CliError
from shared import auth
from shared.checkpoint import lineage
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunRecord, RunState, convert
from shared.contracts.control import Rollback
from shared.errors import ContractError, IntegrityError

POLL_S = 0.2


async def ask_rollback(nc: Client, url: str, run_id: str, step: int, reason: str) -> RunRecord:
    """Ask the dispatcher to take the run back to its committed checkpoint at `step`, once
    the run and the store say it can; the record as it was."""
    before = await client.record(nc, run_id)
    if before.state in (RunState.COMPLETED, RunState.CANCELLED):
        raise CliError(
            f"run {run_id} is {before.state.value}: a run that is over does not go back; fork "
            f"it instead: baton fork {run_id} --step {step}",
            2,
        )
    await _usable(url, run_id, step, anywhere=False, resumable=True)
    await client.steer(nc, Rollback(run_id=run_id, step=step, reason=reason))
    return before


async def rolled_back(
    nc: Client, run_id: str, step: int, before: RunRecord, wait_s: float
) -> tuple[str, RunRecord]:
    """How the rollback went, by the run record, within `wait_s`: `done` (its lineage has
    the rollback), `ordered` (asked, not done yet: a PAUSED run goes back when resumed),
    `refused` (ordered, then dropped: its checkpoint went meanwhile), `not taken` (never
    ordered: the dispatcher refused it, `baton dlq list` says why)."""
    loop = asyncio.get_running_loop()
    last = before.rewinds[-1] if before.rewinds else None
    deadline = loop.time() + wait_s
    seen = False
    while True:
        now = await client.record(nc, run_id)
        if now.rewinds and now.rewinds[-1] != last and now.rewinds[-1].to_step == step:
            return "done", now
        if now.rollback_to == step:
            seen = True
            if now.state is RunState.PAUSED:
                return "ordered", now
        elif seen:
            return "refused", now
        if loop.time() >= deadline:
            return ("ordered" if seen else "not taken"), now
        await asyncio.sleep(POLL_S)


def fork_spec(
    parent: RunRecord, step: int, sets: list[str], job: JobSpec | None, key: str | None
) -> JobSpec:
    """The fork's spec: the parent's (or `job`'s, which replaces it) with each `path=value`
    of `sets` applied, starting from the parent's checkpoint at `step`, under its own
    idempotency key (`key`, else a new one at submission)."""
    tree: dict[str, Any] = msgspec.to_builtins(job if job is not None else parent.spec)
    for item in sets:
        path, value = parse_set(item)
        _put(tree, path, value)
    tree["fork"] = {"run_id": parent.run_id, "step": step}
    tree["idempotency_key"] = key
    try:
        spec = convert(tree, JobSpec)
    except ContractError as exc:
        raise CliError(f"the fork's job spec is invalid: {exc}", 2) from None
    if step >= spec.total_steps:
        raise CliError(
            f"the fork starts at step {step}, and its total_steps is {spec.total_steps}: "
            "nothing is left to train (--set total_steps=...)",
            2,
        )
    return spec


def parse_set(item: str) -> tuple[list[str], Any]:
    """`config.lr=0.01` → (["config", "lr"], 0.01): the value a TOML or JSON scalar (or an
    array or table) where it parses as one, else the text as it is."""
    path, sep, raw = item.partition("=")
    keys = path.strip().split(".")
    if not sep or not all(keys):
        raise CliError(f"--set {item!r}: use a dotted path and a value, e.g. config.lr=0.01", 2)
    try:
        return keys, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return keys, json.loads(raw)
    except ValueError:
        return keys, raw


def _put(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        inner = tree.setdefault(key, {})
        if not isinstance(inner, dict):
            raise CliError(f"--set {'.'.join(path)}: {key} is not a table", 2)
        tree = inner
    tree[path[-1]] = value


async def check_fork(nc: Client, url: str, parent: RunRecord, step: int) -> lineage.Stored:
    """The parent's checkpoint the fork starts from, once the store and the user's rights
    say it can (a submitter forks only its own runs)."""
    owner = auth.owner_of(nc.options.get("user") or "")
    if owner and not parent.run_id.startswith(f"{owner}."):
        raise CliError(f"run {parent.run_id} is not yours to fork", 2)
    return await _usable(url, parent.run_id, step, anywhere=True)


async def _usable(
    url: str, run_id: str, step: int, *, anywhere: bool, resumable: bool = False
) -> lineage.Stored:
    async with open_store(url) as store:
        try:
            return await lineage.find(store, run_id, step, anywhere=anywhere, resumable=resumable)
        except IntegrityError as exc:
            raise CliError(str(exc), 3) from None


def load_job(path: Path | None) -> JobSpec | None:
    return client.load_spec(path) if path is not None else None
