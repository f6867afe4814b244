"""One behavioural suite for every store backend: file:// and S3 (a real SeaweedFS)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ReadTimeoutError

from shared.checkpoint.store import Store, open_store
from shared.checkpoint.store.file import FileStore
from shared.checkpoint.store.s3 import S3Store
from shared.errors import (
    AlreadyExists,
    ConfigError,
    ContractError,
    IntegrityError,
    NotFound,
    PreconditionFailed,
    StoreUnavailable,
)
from tests.support.seaweed import SeaweedS3


@pytest.fixture(params=["file", "s3"])
def store_url(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    seaweed: SeaweedS3 = request.getfixturevalue("seaweed")
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    return seaweed.url(f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    async with open_store(store_url) as s:
        yield s


@pytest.fixture
async def s3(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[S3Store]:
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    async with S3Store.from_url(seaweed.url(f"t-{uuid.uuid4().hex[:12]}")) as s:
        yield s


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- write-once objects --------------------------------------------------------------------


async def test_put_once_refuses_a_second_write_and_keeps_the_first(store: Store) -> None:
    await store.put_once("runs/r1/manifest.json", b"first")
    with pytest.raises(AlreadyExists):
        await store.put_once("runs/r1/manifest.json", b"second")
    with pytest.raises(AlreadyExists):
        await store.put_once("runs/r1/manifest.json", b"first")
    assert await store.get("runs/r1/manifest.json") == b"first"


async def test_put_file_is_write_once(store: Store, tmp_path: Path) -> None:
    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    first.write_bytes(b"tensor bytes")
    second.write_bytes(b"other tensor bytes")
    await store.put_file("runs/r1/step-1/model.safetensors", first)
    with pytest.raises(AlreadyExists):
        await store.put_file("runs/r1/step-1/model.safetensors", second)
    assert await store.get("runs/r1/step-1/model.safetensors") == b"tensor bytes"


async def test_get_download_and_stat_of_a_multi_chunk_object(store: Store, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # several CHUNKs plus a ragged tail
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    await store.put_file("big/blob.bin", src)
    assert await store.get("big/blob.bin") == data
    dest = tmp_path / "dest.bin"
    dest.write_bytes(b"stale content longer than nothing")
    await store.download("big/blob.bin", dest)
    assert dest.read_bytes() == data
    assert await store.stat("big/blob.bin") == (len(data), sha(data))
    await store.put_once("empty", b"")
    assert await store.stat("empty") == (0, sha(b""))
    assert await store.get("empty") == b""


async def test_get_range_reads_exactly_the_bytes_asked(store: Store) -> None:
    data = os.urandom(2 * 1024 * 1024 + 5)
    await store.put_once("ranged/blob", data)
    assert await store.get_range("ranged/blob", 0, 8) == data[:8]
    assert await store.get_range("ranged/blob", 1_000_003, 2_000_001) == data[1_000_003:2_000_001]
    assert await store.get_range("ranged/blob", len(data) - 1, len(data)) == data[-1:]
    with pytest.raises(IntegrityError):  # past the end: less than asked is never returned
        await store.get_range("ranged/blob", len(data) - 4, len(data) + 4)
    with pytest.raises(ContractError):
        await store.get_range("ranged/blob", 5, 5)
    with pytest.raises(NotFound):
        await store.get_range("no/such/key", 0, 1)


async def test_missing_keys(store: Store, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        await store.get("no/such/key")
    with pytest.raises(NotFound):
        await store.download("no/such/key", tmp_path / "out")
    with pytest.raises(NotFound):
        await store.stat("no/such/key")
    assert await store.read_pointer("no/such/pointer") is None
    assert await store.list("no/such/") == []


async def test_list_is_sorted_and_filtered_by_prefix(store: Store) -> None:
    keys = ["runs/b/2", "runs/a/10", "runs/a/1", "runs/a/sub/x", "other/x", "top"]
    for key in keys:
        await store.put_once(key, key.encode())
    assert await store.list("runs/a/") == ["runs/a/1", "runs/a/10", "runs/a/sub/x"]
    assert await store.list("runs/") == sorted(k for k in keys if k.startswith("runs/"))
    assert await store.list("") == sorted(keys)
    assert await store.list("runs/b/2") == ["runs/b/2"]


async def test_delete_is_idempotent_and_frees_the_key(store: Store) -> None:
    await store.put_once("gc/old", b"v1")
    await store.delete("gc/old")
    with pytest.raises(NotFound):
        await store.get("gc/old")
    await store.delete("gc/old")
    await store.delete("gc/never-written")
    assert await store.list("gc/") == []
    await store.put_once("gc/old", b"v2")
    assert await store.get("gc/old") == b"v2"


# Last-modified times are whole seconds on S3, and SeaweedFS runs on this host's clock.
CLOCK_SLACK_S = 2.0


async def test_list_info_names_what_list_does_with_sizes_and_times(store: Store) -> None:
    keys = {"runs/a/1": b"", "runs/a/10": b"ten bytes!", "runs/ab/x": b"xx", "other/y": b"y"}
    before = time.time()
    for key, data in keys.items():
        await store.put_once(key, data)
    after = time.time()
    for prefix in ("runs/a/", "runs/a", "runs/", "", "runs/a/10", "none/"):
        infos = await store.list_info(prefix)
        assert [i.key for i in infos] == await store.list(prefix), prefix
    for info in await store.list_info(""):
        assert info.size == len(keys[info.key]), info
        assert before - CLOCK_SLACK_S <= info.modified <= after + CLOCK_SLACK_S, (info, before)


async def test_list_info_dates_an_uploaded_file_by_its_upload(store: Store, tmp_path: Path) -> None:
    # Garbage collection judges age by this time: a file that sat on the trainer's disk
    # for a day before its upload is still a fresh object.
    src = tmp_path / "model.safetensors"
    src.write_bytes(b"weights")
    day_ago = time.time() - 86400
    os.utime(src, (day_ago, day_ago))
    before = time.time()
    await store.put_file("runs/r/data/model.safetensors", src)
    [info] = await store.list_info("runs/r/")
    assert info.key == "runs/r/data/model.safetensors" and info.size == 7, info
    assert info.modified >= before - CLOCK_SLACK_S, (info, before)


async def test_list_info_skips_a_deleted_key(store: Store) -> None:
    await store.put_once("gc/a", b"a")
    await store.put_once("gc/b", b"b")
    await store.delete("gc/a")
    assert [i.key for i in await store.list_info("gc/")] == ["gc/b"]


async def test_file_list_info_skips_unpublished_temporaries(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    await store.put_once("runs/r/data/x", b"x")
    (tmp_path / "runs/r/data/.tmp-0123").write_bytes(b"half an upload")
    assert [i.key for i in await store.list_info("runs/")] == ["runs/r/data/x"]


BAD_KEYS = ["../escape", "/absolute", "a/../../b", "a//b", "./a", "a/.", ""]


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_keys_that_climb_out_are_rejected(store: Store, key: str, tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"x")
    with pytest.raises(ContractError):
        await store.put_once(key, b"x")
    with pytest.raises(ContractError):
        await store.put_file(key, src)
    with pytest.raises(ContractError):
        await store.get(key)
    with pytest.raises(ContractError):
        await store.stat(key)
    with pytest.raises(ContractError):
        await store.delete(key)
    assert src.exists()


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_pointer_keys_that_climb_out_are_rejected(store: Store, key: str) -> None:
    with pytest.raises(ContractError):
        await store.write_pointer(key, b"x", None)
    with pytest.raises(ContractError):
        await store.read_pointer(key)


# -- the pointer ---------------------------------------------------------------------------


async def test_pointer_compare_and_swap(store: Store) -> None:
    assert await store.read_pointer("runs/r1/latest") is None
    v1 = await store.write_pointer("runs/r1/latest", b"step 1", None)
    assert await store.read_pointer("runs/r1/latest") == (b"step 1", v1)
    with pytest.raises(PreconditionFailed):
        await store.write_pointer("runs/r1/latest", b"rival", None)
    v2 = await store.write_pointer("runs/r1/latest", b"step 2", v1)
    assert v2 != v1
    with pytest.raises(PreconditionFailed):
        await store.write_pointer("runs/r1/latest", b"stale", v1)
    assert await store.read_pointer("runs/r1/latest") == (b"step 2", v2)


async def test_racers_reading_the_same_version_have_exactly_one_winner(store: Store) -> None:
    await store.write_pointer("race/latest", b"round 0", None)
    # Three rounds: SeaweedFS queues conditional writes to one key behind a lock it polls
    # once a second, so each contended round costs it up to ~3 s.
    for rnd in range(1, 4):
        read_all = asyncio.Barrier(8)

        async def racer(i: int, rnd: int = rnd, read_all: asyncio.Barrier = read_all) -> bool:
            current = await store.read_pointer("race/latest")
            assert current is not None
            await read_all.wait()  # every racer holds the same version before anyone writes
            try:
                await store.write_pointer("race/latest", f"round {rnd} by {i}".encode(), current[1])
            except PreconditionFailed:
                return False
            return True

        won = await asyncio.gather(*(racer(i) for i in range(8)))
        assert won.count(True) == 1, won
        winner = won.index(True)
        now = await store.read_pointer("race/latest")
        assert now is not None and now[0] == f"round {rnd} by {winner}".encode()


async def test_read_modify_cas_loop_loses_no_update(store: Store) -> None:
    await store.write_pointer("counter", json.dumps([]).encode(), None)

    async def racer(name: str) -> int:
        lost = 0
        for i in range(10):
            while True:
                current = await store.read_pointer("counter")
                assert current is not None
                applied = json.loads(current[0])
                try:
                    await store.write_pointer(
                        "counter", json.dumps([*applied, f"{name}.{i}"]).encode(), current[1]
                    )
                    break
                except PreconditionFailed:
                    lost += 1
        return lost

    lost = await asyncio.gather(*(racer(f"r{n}") for n in range(4)))
    final = await store.read_pointer("counter")
    assert final is not None
    applied = json.loads(final[0])
    assert len(applied) == 40 and len(set(applied)) == 40
    assert sum(lost) > 0, "the racers never collided; the test proved nothing"


# -- S3 only: URLs, lost replies, outages ------------------------------------------------


def test_s3_url_takes_endpoint_and_region_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BATON_S3_ENDPOINT", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    s = S3Store.from_url("s3://my-bucket/some/prefix/")
    assert (s.bucket, s.prefix, s.url) == ("my-bucket", "some/prefix", "s3://my-bucket/some/prefix")
    assert (s.endpoint, s.region) == ("http://127.0.0.1:9", "eu-west-3")
    monkeypatch.setenv("BATON_S3_ENDPOINT", "http://127.0.0.1:10")
    assert S3Store.from_url("s3://my-bucket").endpoint == "http://127.0.0.1:10"


@pytest.mark.parametrize(
    "url", ["s3://AKIAXX:hunter2@bucket/p", "s3://b", "s3://bucket/../x", "s3://bucket?x=1"]
)
def test_s3_url_rejects_credentials_and_bad_names(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        S3Store.from_url(url)
    assert "hunter2" not in str(err.value) and "AKIAXX" not in str(err.value)


def lose_first_reply(client: Any) -> None:
    """The next PutObject reaches the store but its reply is lost, as when a link drops
    mid-request; later calls behave normally."""
    real = client.put_object

    async def put_object(**kw: Any) -> Any:
        client.put_object = real
        await real(**kw)
        raise ReadTimeoutError(endpoint_url="lost reply")

    client.put_object = put_object


async def test_s3_lost_reply_of_a_landed_write_counts_as_success(s3: S3Store) -> None:
    client = await s3._client()
    lose_first_reply(client)
    await s3.put_once("obj", b"ours")
    assert await s3.get("obj") == b"ours"

    v1 = await s3.write_pointer("ptr", b"one", None)
    lose_first_reply(client)
    v2 = await s3.write_pointer("ptr", b"two", v1)
    assert await s3.read_pointer("ptr") == (b"two", v2)


async def test_s3_lost_reply_when_a_rival_won_is_refused(s3: S3Store) -> None:
    client = await s3._client()
    real = client.put_object

    async def rival_then_timeout(**kw: Any) -> Any:
        client.put_object = real
        await s3.put_once("obj", b"theirs")
        raise ReadTimeoutError(endpoint_url="lost reply")

    client.put_object = rival_then_timeout
    with pytest.raises(AlreadyExists):
        await s3.put_once("obj", b"ours")
    assert await s3.get("obj") == b"theirs"

    v1 = await s3.write_pointer("ptr", b"one", None)
    rival = await s3.write_pointer("ptr", b"rival", v1)

    async def timeout_once(**kw: Any) -> Any:
        client.put_object = real
        raise ReadTimeoutError(endpoint_url="lost reply")

    client.put_object = timeout_once
    with pytest.raises(PreconditionFailed):
        await s3.write_pointer("ptr", b"mine", v1)
    assert await s3.read_pointer("ptr") == (b"rival", rival)


async def test_s3_if_match_on_a_deleted_pointer_is_a_precondition_failure(s3: S3Store) -> None:
    v1 = await s3.write_pointer("latest", b"one", None)
    await s3.delete("latest")
    with pytest.raises(PreconditionFailed):
        await s3.write_pointer("latest", b"two", v1)


async def test_s3_list_follows_pages_across_nested_keys(s3: S3Store) -> None:
    keys = [f"runs/r{r}/step-{i:03d}/{f}" for r in range(2) for i in range(3) for f in "ab"]
    await asyncio.gather(*(s3.put_once(k, b"x") for k in keys))
    s3.list_page_size = 2
    assert await s3.list("runs/") == sorted(keys)
    assert await s3.list("runs/r1/step-00") == sorted(k for k in keys if "r1/step-00" in k)
    infos = await s3.list_info("runs/")
    assert [i.key for i in infos] == sorted(keys) and {i.size for i in infos} == {1}


async def test_s3_unreachable_store_raises_store_unavailable(
    seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    s = S3Store(seaweed.bucket, "x", endpoint="http://127.0.0.1:9", attempts=3, backoff_s=0.01)
    async with s:
        with pytest.raises(StoreUnavailable):
            await s.put_once("k", b"v")
        with pytest.raises(StoreUnavailable):
            await s.read_pointer("p")


async def test_s3_store_survives_a_restart_of_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    with SeaweedS3() as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        async with S3Store.from_url(server.url("restart")) as s:
            v1 = await s.write_pointer("latest", b"before", None)
            await asyncio.to_thread(server.stop)
            with pytest.raises(StoreUnavailable):
                await s.write_pointer("latest", b"during", v1)
            await asyncio.to_thread(server.start)
            assert await s.read_pointer("latest") == (b"before", v1)
            v2 = await s.write_pointer("latest", b"after", v1)
            assert await s.read_pointer("latest") == (b"after", v2)


# -- copies (a fork's graft) ------------------------------------------------------------------


async def test_copy_is_write_once_and_outlives_its_source(store: Store) -> None:
    await store.put_once("runs/p/data/1/model.safetensors", b"parent bytes")
    await store.put_once("runs/f/data/2/other", b"already there")
    await store.copy("runs/p/data/1/model.safetensors", "runs/f/data/7/model.safetensors")
    assert await store.get("runs/f/data/7/model.safetensors") == b"parent bytes"
    with pytest.raises(AlreadyExists):
        await store.copy("runs/p/data/1/model.safetensors", "runs/f/data/2/other")
    assert await store.get("runs/f/data/2/other") == b"already there"
    await store.delete("runs/p/data/1/model.safetensors")
    assert await store.stat("runs/f/data/7/model.safetensors") == (12, sha(b"parent bytes"))
    with pytest.raises(NotFound):
        await store.copy("runs/p/data/1/model.safetensors", "runs/f/data/8/model.safetensors")
    assert await store.list("runs/f/data/8/") == []


async def test_s3_lost_reply_of_a_landed_copy_counts_as_success(s3: S3Store) -> None:
    await s3.put_once("src", b"bytes")
    client = await s3._client()
    real = client.copy_object

    async def copy_object(**kw: Any) -> Any:
        client.copy_object = real
        await real(**kw)
        raise ReadTimeoutError(endpoint_url="lost reply")

    client.copy_object = copy_object
    await s3.copy("src", "dst")
    assert await s3.get("dst") == b"bytes"
    await s3.put_once("other", b"theirs")
    client.copy_object = copy_object
    with pytest.raises(AlreadyExists):
        await s3.copy("src", "other")
