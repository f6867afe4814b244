"""The round log of a replicated run: its replicas' changes and the manifests that commit
its outer rounds, in the store every site reaches (docs/diloco.md).

    runs/<run>/rounds/start.safetensors                   the outer state of round 0 (write-once)
    runs/<run>/rounds/changes/<base>/<replica>-<token>-<step>.safetensors
                                                          a replica's change (write-once)
    runs/<run>/rounds/means/<round>-<closer>-<token>.safetensors
                                                          the mean of its changes (write-once)
    runs/<run>/rounds/manifests/<round>.json              round <round>, committed once
    runs/<run>/rounds/done/<replica>.json                 a replica that finished its steps

A round is committed by writing its manifest with `put_once`: of replicas racing to close
it, exactly one wins and the others read its manifest. The manifest names exactly the
changes it averaged and their mean (`mean_of`: summed in replica order, one IEEE operation
at a time, no fused multiply-add, stored in the run's `precision`); its result is
`outer_step`, a pure function of the previous outer state and that mean, so every replica
that applies it gets the same bits on any hardware, which each checks against the
manifest's digest. A replica reads the mean, one object, not every other replica's
change; `replay`, from the start, makes each mean again from the changes and checks it is
the same bytes.

Which changes a round takes (`Log.candidates`): per replica, its newest change not already
in a round, if made from a round no more than `max_staleness` behind. A replica's change
of a given base is in at most one round: each (replica, base) is taken once, and a replica
moves to a newer base only once it has seen the round its change went into (or learnt it
was discarded).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Mapping
from typing import Literal

import msgspec
import torch
from safetensors.torch import load as tensors_from_bytes
from safetensors.torch import save as tensors_to_bytes

from shared.checkpoint.digest import weights_digest
from shared.checkpoint.store import Store
from shared.contracts import decode, encode
from shared.contracts.jobs import Outer
from shared.contracts.rounds import Change, Mean, ReplicaDone, RoundManifest
from shared.errors import AlreadyExists, IntegrityError, NotFound

Weights = dict[str, torch.Tensor]
LIST_EACH = 4
"""Up to this many bases a round may take changes from are listed one by one; more, at once."""
Precision = Literal["fp32", "bf16", "fp16"]
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
}  # fmt: skip


def prefix(run_id: str) -> str:
    return f"runs/{run_id}/rounds/"


def start_key(run_id: str) -> str:
    return prefix(run_id) + "start.safetensors"


def change_key(run_id: str, base: int, replica: int, token: int, step: int) -> str:
    name = f"{replica:04d}-{token:012d}-{step:012d}.safetensors"
    return prefix(run_id) + f"changes/{base:012d}/{name}"


def mean_key(run_id: str, round_: int, closer: int, token: int) -> str:
    return prefix(run_id) + f"means/{round_:012d}-{closer:04d}-{token:012d}.safetensors"


def manifest_key(run_id: str, round_: int) -> str:
    return prefix(run_id) + f"manifests/{round_:012d}.json"


def done_key(run_id: str, replica: int) -> str:
    return prefix(run_id) + f"done/{replica:04d}.json"


def parse_change(key: str) -> tuple[int, int, int, int]:
    """(base, replica, token, step) of a change's key."""
    base = int(key.rsplit("/", 2)[1])
    replica, token, step = key.rsplit("/", 1)[1].removesuffix(".safetensors").split("-")
    return base, int(replica), int(token), int(step)


# -- the outer step ------------------------------------------------------------------------


def mean_of(changes: list[Weights]) -> Weights:
    """The mean of `changes`, summed in the order given, in fp32 on the CPU. One rounding
    per operation: `add_` and `div_` without `alpha`, so no fused multiply-add can change a
    bit, whatever the hardware."""
    if not changes:
        raise ValueError("an outer round needs at least one change")
    mean = {}
    for name, first in changes[0].items():
        g = first.to(torch.float32).clone()
        for c in changes[1:]:
            g.add_(c[name].to(torch.float32))
        mean[name] = g.div_(float(len(changes)))
    return mean


def outer_step(params: Weights, momentum: Weights, mean: Weights, outer: Outer) -> None:
    """Apply one outer round in place (fp32, CPU): `mean` (of the round's changes) as the
    outer gradient, SGD with (Nesterov) momentum, one rounding per operation."""
    for name, p in params.items():
        g = mean[name]
        m = momentum[name]
        m.mul_(outer.momentum).add_(g)
        update = torch.mul(m, outer.momentum).add_(g) if outer.nesterov else m.clone()
        p.sub_(update.mul_(outer.lr))


def encode_weights(tensors: Mapping[str, torch.Tensor], precision: Precision = "fp32") -> bytes:
    dtype = DTYPES[precision]
    return tensors_to_bytes({n: t.to(dtype).contiguous() for n, t in tensors.items()})


def decode_weights(data: bytes) -> Weights:
    return {n: t.to(torch.float32) for n, t in tensors_from_bytes(data).items()}


# -- the log -------------------------------------------------------------------------------


async def put_start(store: Store, run_id: str, params: Weights) -> Weights:
    """The run's start: `params` if this call wrote it first, else the one already there
    (every replica starts from the same bits, whatever its own initialisation was)."""
    try:
        await store.put_once(start_key(run_id), encode_weights(params))
        return {n: t.to(torch.float32).clone() for n, t in params.items()}
    except AlreadyExists:
        return decode_weights(await store.get(start_key(run_id)))


class Log:
    """What one reader knows of a run's round log; manifests are read once each."""

    def __init__(self, store: Store, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.manifests: list[RoundManifest] = []
        self.taken: dict[tuple[int, int], int] = {}
        """(replica, base) → the round its change went into."""
        self.cache: dict[str, bytes] = {}
        """Changes this reader wrote or read, by key, until a round applies them."""
        self.received = 0
        """Bytes of changes and means read from the store."""
        self.sent = 0
        """Bytes of means this reader stored (closing rounds)."""
        self._done: dict[str, int] = {}

    @property
    def head(self) -> int:
        """The newest committed round (0: none yet)."""
        return len(self.manifests)

    async def refresh(self) -> list[RoundManifest]:
        """Read the rounds committed since; returns them in order."""
        found: list[RoundManifest] = []
        while True:
            try:
                data = await self.store.get(manifest_key(self.run_id, self.head + 1))
            except NotFound:
                return found
            manifest = decode(data, RoundManifest)
            self.manifests.append(manifest)
            for c in manifest.changes:
                self.taken[(c.replica, c.base)] = manifest.round
            found.append(manifest)

    async def done(self) -> set[int]:
        """The replicas that finished their steps (each marker read once: it never changes)."""
        for key in await self.store.list(prefix(self.run_id) + "done/"):
            if key not in self._done:
                self._done[key] = decode(await self.store.get(key), ReplicaDone).replica
        return set(self._done.values())

    def live(self, done: set[int], replicas: int) -> set[int]:
        """The replicas a round waits for: those still training that were in the last
        round (all of them before the first). One that missed a round is waited for again
        once a change of it is there."""
        last = {c.replica for c in self.manifests[-1].changes} if self.manifests else None
        return {r for r in range(replicas) if r not in done and (last is None or r in last)}

    async def candidates(self, max_staleness: int) -> list[str]:
        """The changes the next round would take: per replica its newest not in a round,
        made from a round at most `max_staleness` behind the head; in replica order."""
        best: dict[int, tuple[tuple[int, int, int], str]] = {}
        low = max(0, self.head - max_staleness)
        changes = prefix(self.run_id) + "changes/"
        keys = []
        if self.head - low < LIST_EACH:  # a listing per base that may hold a candidate
            for b in range(low, self.head + 1):
                keys += await self.store.list(f"{changes}{b:012d}/")
        else:  # one listing of them all, however many bases the staleness allows
            keys = await self.store.list(changes)
        for key in keys:
            b, replica, token, step = parse_change(key)
            if b < low or (replica, b) in self.taken:
                continue
            rank = (b, token, step)
            if replica not in best or rank > best[replica][0]:
                best[replica] = (rank, key)
        return [best[r][1] for r in sorted(best)]

    async def change(self, key: str) -> bytes:
        if key not in self.cache:
            self.cache[key] = await self.store.get(key)
            self.received += len(self.cache[key])
        return self.cache[key]

    async def apply(self, manifest: RoundManifest, params: Weights, momentum: Weights,
                    outer: Outer, *, replay: bool = False) -> None:  # fmt: skip
        """Step `params`/`momentum` (the outer state of the round before) by `manifest`'s
        mean, checking its bytes and the result's digest; with `replay`, the mean is made
        again from the changes it names, and must be the same bytes."""
        data = await self._checked(manifest.round, manifest.mean)
        if replay:
            changes = [decode_weights(await self._checked(manifest.round, c))
                       for c in manifest.changes]  # fmt: skip
            again = encode_weights(mean_of(changes), manifest.mean.precision)
            if again != data:
                raise IntegrityError(f"round {manifest.round}: its mean is not the mean of"
                                     " the changes it names")  # fmt: skip
        outer_step(params, momentum, decode_weights(data), outer)
        got = weights_digest(params)
        if got != manifest.result:
            raise IntegrityError(
                f"round {manifest.round}: the outer step gave {got[:12]}…, its manifest says"
                f" {manifest.result[:12]}…: replicas computed different bits"
            )
        for key in (manifest.mean.key, *(c.key for c in manifest.changes)):
            self.cache.pop(key, None)

    async def _checked(self, round_: int, ref: Change | Mean) -> bytes:
        data = await self.change(ref.key)
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise IntegrityError(f"round {round_}: {ref.key} is not what its manifest named")
        return data

    async def close(
        self, keys: list[str], params: Weights, momentum: Weights, outer: Outer, *,
        closer: int, token: int, stragglers: list[int], deadline: bool, waited_s: float,
    ) -> RoundManifest | None:  # fmt: skip
        """Commit round `head + 1` of the changes `keys` (their replicas' order), from the
        outer state of the head. None: another replica committed it first."""
        changes, tensors = [], []
        for key in keys:
            data = await self.change(key)
            base, replica, tok, step = parse_change(key)
            precision = _precision_of(data)
            changes.append(Change(
                replica=replica, base=base, step=step, token=tok, key=key, size=len(data),
                sha256=hashlib.sha256(data).hexdigest(), precision=precision,
            ))  # fmt: skip
            tensors.append(decode_weights(data))
        data = encode_weights(mean_of(tensors), outer.precision)
        key = mean_key(self.run_id, self.head + 1, closer, token)
        with contextlib.suppress(AlreadyExists):  # this closer's, before a lost reply
            await self.store.put_once(key, data)
        self.cache[key] = data
        self.sent += len(data)
        mean = Mean(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                    precision=outer.precision)  # fmt: skip
        trial_p = {n: t.clone() for n, t in params.items()}
        trial_m = {n: t.clone() for n, t in momentum.items()}
        outer_step(trial_p, trial_m, decode_weights(data), outer)
        manifest = RoundManifest(
            run_id=self.run_id, round=self.head + 1, changes=changes, mean=mean,
            result=weights_digest(trial_p), closed_by=closer, token=token,
            stragglers=stragglers, deadline=deadline, waited_s=waited_s, closed_at=time.time(),
        )  # fmt: skip
        try:
            await self.store.put_once(manifest_key(self.run_id, manifest.round), encode(manifest))
        except AlreadyExists:
            return None
        return manifest


def _precision_of(data: bytes) -> Precision:
    header = msgspec.json.decode(data[8 : 8 + int.from_bytes(data[:8], "little")])
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    names = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
    if len(dtypes) != 1 or (found := names.get(dtypes.pop())) is None:
        raise IntegrityError("a change holds tensors of other or mixed dtypes")
    return found  # type: ignore[return-value]


async def replay(store: Store, run_id: str, outer: Outer) -> tuple[Weights, int]:
    """The outer weights after every committed round, recomputed from the start, and how
    many rounds that was. Raises `IntegrityError` where a round's result differs."""
    params = decode_weights(await store.get(start_key(run_id)))
    momentum = {n: torch.zeros_like(t) for n, t in params.items()}
    log = Log(store, run_id)
    for manifest in await log.refresh():
        await log.apply(manifest, params, momentum, outer, replay=True)
    return params, log.head
