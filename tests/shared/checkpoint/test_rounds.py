"""The round log (`shared.checkpoint.rounds`) on a real file store: the outer step, closing
a round once, which changes a round takes, replay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.checkpoint import rounds
from shared.checkpoint.digest import weights_digest
from shared.checkpoint.store import Store
from shared.checkpoint.store.file import FileStore
from shared.contracts.jobs import Outer
from shared.errors import IntegrityError

RUN = "rtest"
OUTER = Outer(inner_steps=5, lr=0.7, momentum=0.9)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return FileStore(tmp_path / "store")


def weights(seed: int, n: int = 4) -> rounds.Weights:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, 3, generator=g), "b": torch.randn(3, generator=g)}


def test_the_outer_step_is_nesterov_sgd_on_the_mean_change() -> None:
    params, momentum = weights(1), {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    changes = [weights(2), weights(3)]
    want = {}
    for n, p in params.items():
        g = (changes[0][n].double() + changes[1][n].double()) / 2
        m = 0.9 * 0 + g
        want[n] = p.double() - 0.7 * (g + 0.9 * m)
    rounds.outer_step(params, momentum, rounds.mean_of(changes), OUTER)
    for n in params:
        assert torch.allclose(params[n].double(), want[n], atol=1e-6)
        assert torch.equal(momentum[n], (changes[0][n] + changes[1][n]) / 2)


def test_the_outer_step_gives_the_same_bits_every_time() -> None:
    digests = set()
    for _ in range(3):
        params, momentum = weights(1), {n: torch.ones_like(t) for n, t in weights(1).items()}
        mean = rounds.mean_of([weights(2), weights(3), weights(4)])
        rounds.outer_step(params, momentum, mean, OUTER)
        digests.add(weights_digest(params) + weights_digest(momentum))
    assert len(digests) == 1


async def close(log: rounds.Log, keys: list[str], p: rounds.Weights, m: rounds.Weights,
                closer: int = 0, token: int = 1, stragglers: tuple[int, ...] = (),
                ) -> rounds.RoundManifest | None:  # fmt: skip
    """Commit the log's next round; at the deadline if it leaves `stragglers` out."""
    return await log.close(keys, p, m, OUTER, closer=closer, token=token,
                           stragglers=list(stragglers), deadline=bool(stragglers),
                           waited_s=0.0)  # fmt: skip


async def put_change(store: Store, replica: int, base: int, token: int, step: int,
                     precision: rounds.Precision = "fp32", n: int = 4) -> str:  # fmt: skip
    key = rounds.change_key(RUN, base, replica, token, step)
    await store.put_once(key, rounds.encode_weights(weights(replica + 10 * base, n), precision))
    return key


async def test_a_round_is_committed_once_and_replays_bitwise(store: Store) -> None:
    start = await rounds.put_start(store, RUN, weights(0))
    assert torch.equal((await rounds.put_start(store, RUN, weights(9)))["w"], start["w"])
    params, momentum = start, {n: torch.zeros_like(t) for n, t in start.items()}
    for k in range(2):
        for r in range(3):
            await put_change(store, r, k, token=1, step=5 * (k + 1))
        a, b = rounds.Log(store, RUN), rounds.Log(store, RUN)
        await a.refresh()
        await b.refresh()
        keys = await a.candidates(max_staleness=2)
        assert [rounds.parse_change(key)[1] for key in keys] == [0, 1, 2]
        won = await close(a, keys, params, momentum, closer=0, token=1)
        lost = await close(b, keys, params, momentum, closer=1, token=1)
        assert won is not None and lost is None and not won.deadline
        await a.refresh()
        await a.apply(a.manifests[-1], params, momentum, OUTER)
    final, count = await rounds.replay(store, RUN, OUTER)
    assert count == 2 and weights_digest(final) == weights_digest(params)


async def test_a_round_takes_each_replicas_newest_change_once(store: Store) -> None:
    await rounds.put_start(store, RUN, weights(0))
    await put_change(store, 0, 0, token=1, step=5)
    await put_change(store, 0, 0, token=2, step=5)  # a later attempt's: it wins
    await put_change(store, 1, 0, token=1, step=5)
    log = rounds.Log(store, RUN)
    await log.refresh()
    keys = await log.candidates(max_staleness=4)
    assert [rounds.parse_change(k)[:3] for k in keys] == [(0, 0, 2), (0, 1, 1)]
    p, m = weights(0), {n: torch.zeros_like(t) for n, t in weights(0).items()}
    manifest = await close(log, keys, p, m, closer=0, token=2, stragglers=(2,))
    assert manifest is not None and manifest.deadline  # two of three, at the deadline
    await log.refresh()
    # Neither replica's change of base 0 is a candidate again, whichever attempt sent it.
    await put_change(store, 1, 0, token=3, step=10)
    assert await log.candidates(max_staleness=4) == []


async def test_a_change_staler_than_allowed_is_no_candidate(store: Store) -> None:
    await rounds.put_start(store, RUN, weights(0))
    p, m = weights(0), {n: torch.zeros_like(t) for n, t in weights(0).items()}
    log = rounds.Log(store, RUN)
    for k in range(3):  # three rounds of replica 0 alone
        key = await put_change(store, 0, k, token=1, step=5 * (k + 1))
        await close(log, [key], p, m, closer=0, token=1)
        await log.refresh()
        await log.apply(log.manifests[-1], p, m, OUTER)
    await put_change(store, 1, 0, token=1, step=15)  # replica 1, cut off since round 0
    assert await log.candidates(max_staleness=2) == []
    assert len(await log.candidates(max_staleness=3)) == 1


async def test_a_change_in_lower_precision_is_half_the_bytes_and_recorded(store: Store) -> None:
    await rounds.put_start(store, RUN, weights(0, 256))
    full = await put_change(store, 0, 0, token=1, step=5, n=256)
    half = await put_change(store, 1, 0, token=1, step=5, precision="bf16", n=256)
    sizes = [len(await store.get(k)) for k in (full, half)]
    assert sizes[1] < 0.6 * sizes[0], sizes
    log = rounds.Log(store, RUN)
    p, m = weights(0, 256), {n: torch.zeros_like(t) for n, t in weights(0, 256).items()}
    manifest = await close(log, [full, half], p, m)
    assert manifest is not None
    assert [c.precision for c in manifest.changes] == ["fp32", "bf16"]


async def test_a_tampered_mean_or_change_is_refused(store: Store, tmp_path: Path) -> None:
    """A replica applying a round checks the mean it reads; a replay also makes each mean
    again from the changes and refuses one that is not theirs."""
    await rounds.put_start(store, RUN, weights(0))
    key = await put_change(store, 0, 0, token=1, step=5)
    log = rounds.Log(store, RUN)
    p, m = weights(0), {n: torch.zeros_like(t) for n, t in weights(0).items()}
    manifest = await close(log, [key], p, m, closer=0, token=1)
    assert manifest is not None
    _, rounds_done = await rounds.replay(store, RUN, OUTER)
    assert rounds_done == 1
    (tmp_path / "store" / key).write_bytes(rounds.encode_weights(weights(7)))
    with pytest.raises(IntegrityError, match="is not what its manifest named"):
        await rounds.replay(store, RUN, OUTER)
    (tmp_path / "store" / manifest.mean.key).write_bytes(rounds.encode_weights(weights(7)))
    reader = rounds.Log(store, RUN)
    await reader.refresh()
    with pytest.raises(IntegrityError, match="is not what its manifest named"):
        await reader.apply(reader.manifests[0], p, m, OUTER)
