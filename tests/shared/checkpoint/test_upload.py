"""Checkpoint uploads over a slow, cut link: the upload cap holds, a cut costs at most the
part in flight, and write-once holds for uploads in parts as for single PUTs.

A real SeaweedFS behind a `Link` (tests/support/link.py) that counts every byte it carries
towards the store and can be cut after a given number of them. Time bounds are lower
bounds only (an upload takes at least size/cap), which a loaded machine cannot break.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ReadTimeoutError

from shared import config
from shared.checkpoint.store.multipart import MIN_PART_BYTES, digests
from shared.checkpoint.store.pace import Pace, PacedFile
from shared.checkpoint.store.s3 import S3Store
from shared.errors import AlreadyExists, ConfigError, StoreUnavailable
from tests.support.link import Link
from tests.support.seaweed import SeaweedS3

PART = MIN_PART_BYTES
HEADERS = 8192
"""More than the HTTP requests' own bytes (headers, the completion's XML) on the link."""


@pytest.fixture
async def link(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Link]:
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    async with Link("127.0.0.1", seaweed.ports["s3"]) as lk:
        yield lk


def store_behind(link: Link, seaweed: SeaweedS3, **kw: Any) -> S3Store:
    return S3Store(seaweed.bucket, f"up-{uuid.uuid4().hex[:12]}", endpoint=link.endpoint, **kw)


def random_file(path: Path, size: int) -> tuple[int, str]:
    data = os.urandom(size)
    path.write_bytes(data)
    return size, hashlib.sha256(data).hexdigest()


async def pending_uploads(seaweed: SeaweedS3, store: S3Store) -> list[str]:
    def listed() -> list[str]:
        found = seaweed.client().list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
        return [u["Key"] for u in found.get("Uploads", [])]

    return await asyncio.to_thread(listed)


def test_the_setting_reads_bytes_per_second_with_decimal_suffixes() -> None:
    assert config.upload_bps({}) == 0.0
    assert config.upload_bps({"BATON_UPLOAD_BPS": "187500"}) == 187_500
    assert config.upload_bps({"BATON_UPLOAD_BPS": "250k"}) == 250_000
    assert config.upload_bps({"BATON_UPLOAD_BPS": "1.5M"}) == 1_500_000
    assert config.load({"BATON_UPLOAD_BPS": "2G"}).upload_bps == 2e9
    for bad in ("fast", "-5", "1.5 Mbit"):
        with pytest.raises(ConfigError, match="BATON_UPLOAD_BPS"):
            config.load({"BATON_UPLOAD_BPS": bad})


def test_the_store_takes_the_cap_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_UPLOAD_BPS", "300k")
    store = S3Store.from_url("s3://bucket/prefix")
    assert store.pace is not None and store.pace.rate == 300_000
    monkeypatch.delenv("BATON_UPLOAD_BPS")
    assert S3Store.from_url("s3://bucket/prefix").pace is None
    with pytest.raises(ConfigError, match="at least"):
        S3Store("bucket", part_bytes=PART - 1)


def test_a_paced_file_is_its_range_and_holds_the_rate(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 1000)
    pace = Pace(100_000)
    with PacedFile(path, 1000, 50_000, pace) as f:
        assert f.seek(0, os.SEEK_END) == 50_000 and f.seek(0) == 0
        started = time.monotonic()
        got = b"".join(iter(lambda: f.read(8192), b""))
        elapsed = time.monotonic() - started
    assert got == path.read_bytes()[1000:51_000]
    assert len(got) <= pace.rate * elapsed + pace.burst, f"{len(got) / elapsed:.0f} B/s"


async def test_an_upload_never_exceeds_the_cap(
    link: Link, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    rate, size = 400_000.0, 1_200_000  # 3.2 Mbit/s; about 3 s
    async with store_behind(link, seaweed, upload_bps=rate) as store:
        assert store.pace is not None
        size, digest = random_file(tmp_path / "ckpt", size)
        started = time.monotonic()
        await store.put_file("runs/r/model.safetensors", tmp_path / "ckpt")
        elapsed = time.monotonic() - started
        sent = link.delivered[True]
        assert await store.stat("runs/r/model.safetensors") == (size, digest)
    # What crossed the link, headers and all, against what the cap allows in that time.
    assert size <= sent <= rate * elapsed + store.pace.burst + HEADERS, (
        f"{sent} bytes in {elapsed:.2f} s: {sent / elapsed:.0f} B/s, cap {rate:.0f}"
    )


async def test_two_uploads_of_one_process_share_the_cap(
    link: Link, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    rate, size = 500_000.0, 600_000
    a = store_behind(link, seaweed, upload_bps=rate)
    b = store_behind(link, seaweed, upload_bps=rate)
    assert a.pace is not None and a.pace is b.pace, "one bucket per process, whatever the store"
    async with a, b:
        random_file(tmp_path / "a", size)
        random_file(tmp_path / "b", size)
        started = time.monotonic()
        await asyncio.gather(a.put_file("a", tmp_path / "a"), b.put_file("b", tmp_path / "b"))
        elapsed = time.monotonic() - started
    sent = link.delivered[True]
    assert 2 * size <= sent <= rate * elapsed + a.pace.burst + 2 * HEADERS, sent / elapsed


async def test_a_cut_mid_upload_costs_only_the_part_in_flight(
    link: Link, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    size, digest = random_file(tmp_path / "big", 2 * PART + 300_000)  # parts 5+5+0.3 MiB
    store = store_behind(link, seaweed, part_bytes=PART, attempts=2, backoff_s=0.01)
    async with store:
        link.sever_after(PART + PART // 2)  # the first part is in, the second half sent
        with pytest.raises(StoreUnavailable):
            await store.put_file("runs/r/big.safetensors", tmp_path / "big")
        assert link.refused >= 1, "the store client must have tried again while cut"
        kept = store.uploads["runs/r/big.safetensors"]
        assert sorted(kept.parts) == [1], kept.parts
        assert (tmp_path / "big").exists(), "the spool file stays until the upload is done"

        link.restore()
        # What the checkpoint writer does next: the same call again.
        await store.put_file("runs/r/big.safetensors", tmp_path / "big")
        assert await store.stat("runs/r/big.safetensors") == (size, digest)
        assert not store.uploads and not (tmp_path / "big").exists()
        assert await pending_uploads(seaweed, store) == []
    # The first part crossed once; the second one and a half times; the third once.
    print(f"{size} bytes in parts, cut mid-part: {link.delivered[True]} crossed the link")
    assert link.delivered[True] <= size + PART // 2 + 8 * HEADERS, link.delivered[True]


async def test_a_single_put_cut_midway_is_sent_again_whole(
    link: Link, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    size, digest = random_file(tmp_path / "small", 2_000_000)
    async with store_behind(link, seaweed, attempts=2, backoff_s=0.01) as store:
        link.sever_after(1_000_000)
        with pytest.raises(StoreUnavailable):
            await store.put_file("small", tmp_path / "small")
        link.restore()
        await store.put_file("small", tmp_path / "small")
        assert await store.stat("small") == (size, digest)
    assert link.delivered[True] >= size + 1_000_000


async def test_uploads_in_parts_are_write_once(
    link: Link, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    size, digest = random_file(tmp_path / "first", PART + 1000)
    random_file(tmp_path / "second", PART + 2000)
    async with store_behind(link, seaweed, part_bytes=PART) as store:
        await store.put_file("k", tmp_path / "first")
        with pytest.raises(AlreadyExists):
            await store.put_file("k", tmp_path / "second")
        assert await store.stat("k") == (size, digest)
        assert not store.uploads
        assert await pending_uploads(seaweed, store) == [], "the refused upload was aborted"


async def test_a_lost_completion_reply_counts_as_success(
    link: Link, seaweed: SeaweedS3, tmp_path: Path
) -> None:
    size, digest = random_file(tmp_path / "f", PART + 1000)
    async with store_behind(link, seaweed, part_bytes=PART) as store:
        client = await store._client()
        real = client.complete_multipart_upload

        async def lose_reply(**kw: Any) -> Any:
            client.complete_multipart_upload = real
            await real(**kw)
            raise ReadTimeoutError(endpoint_url="lost reply")

        client.complete_multipart_upload = lose_reply
        await store.put_file("k", tmp_path / "f")
        assert await store.stat("k") == (size, digest)

        # And a rival's object under the key is still refused after a lost reply.
        random_file(tmp_path / "g", PART + 1000)
        await store.put_once("rival", b"theirs")

        async def rival_then_lose(**kw: Any) -> Any:
            client.complete_multipart_upload = real
            raise ReadTimeoutError(endpoint_url="lost reply")

        client.complete_multipart_upload = rival_then_lose
        with pytest.raises(AlreadyExists):
            await store.put_file("rival", tmp_path / "g")
        assert await store.get("rival") == b"theirs"


def test_digests_cover_the_file_and_each_part(tmp_path: Path) -> None:
    data = os.urandom(2 * 1024 + 5)
    (tmp_path / "f").write_bytes(data)
    size, whole, parts = digests(tmp_path / "f", 1024)
    assert (size, whole) == (len(data), hashlib.sha256(data).hexdigest())
    assert len(parts) == 3
    (tmp_path / "empty").write_bytes(b"")
    assert digests(tmp_path / "empty", 1024) == (0, hashlib.sha256().hexdigest(), [])
