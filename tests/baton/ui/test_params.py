"""What a URL or an action's body may name on the dashboard, checked without a server: a
dead-letter page's cursor and size, a worker id, an action's reason and overrides, and every
value out of range or shape refused with a message naming it."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.datastructures import QueryParams
from starlette.requests import Request

from baton.client.errors import CliError
from baton.ui import params


def test_a_letters_page_defaults_to_the_first_page_of_the_default_size() -> None:
    assert params.letters_page(QueryParams("")) == (0, params.LETTERS_PAGE)
    assert params.letters_page(QueryParams("after=&limit=")) == (0, params.LETTERS_PAGE)
    assert params.letters_page(QueryParams("after=120&limit=7")) == (120, 7)
    top = f"after={params.MAX_SEQ}&limit={params.MAX_LETTERS_PAGE}"
    assert params.letters_page(QueryParams(top)) == (params.MAX_SEQ, params.MAX_LETTERS_PAGE)


@pytest.mark.parametrize(
    "query",
    [
        "limit=0", f"limit={params.MAX_LETTERS_PAGE + 1}", "limit=-1", "limit=1e3",
        "limit=٣", "after=-1", "after=1.5", "after=abc", f"after={params.MAX_SEQ + 1}",
        f"after={'9' * 25}", "after=>", "after=*",
    ],
)  # fmt: skip
def test_a_letters_page_out_of_range_is_refused_naming_the_parameter(query: str) -> None:
    with pytest.raises(CliError) as refused:
        params.letters_page(QueryParams(query))
    assert refused.value.code == params.BAD_REQUEST
    assert query.partition("=")[0] in str(refused.value), refused.value


@pytest.mark.parametrize("name", ["trainer-1", "host_a.gpu=0", "lab1/trainer-2"])
def test_a_worker_id_that_can_be_a_key_is_taken(name: str) -> None:
    assert params.worker(name) == name


@pytest.mark.parametrize("name", ["*", ">", "trainer.*", "a b", "", ".x", "x.", "tr\u00e4iner"])
def test_a_worker_id_that_could_be_a_wildcard_or_no_key_is_refused(name: str) -> None:
    with pytest.raises(CliError) as refused:
        params.worker(name)
    assert refused.value.code == params.BAD_REQUEST and "not a worker id" in str(refused.value)


def posted(body: bytes, chunks: int = 1) -> Request:
    """A POST whose body arrives in `chunks` pieces, as a server hands it to a route."""
    size = max(1, -(-len(body) // chunks))
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
        for i, p in enumerate(parts)
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


async def test_an_actions_body_may_be_empty_or_a_reason_and_overrides() -> None:
    assert await params.action_body(posted(b"")) == params.ActionBody()
    body = b'{"reason": "bad shard", "overrides": ["config.lr=0.01", "total_steps=90"]}'
    taken = await params.action_body(posted(body, chunks=4))
    assert taken == params.ActionBody(
        reason="bad shard", overrides=["config.lr=0.01", "total_steps=90"]
    )


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"not json", "not an action's body"),
        (b'{"reason": 7}', "$.reason"),
        (b'{"why": "x"}', "why"),
        (b'{"overrides": "config.lr=1"}', "$.overrides"),
        (b'{"reason": "' + b"x" * 513 + b'"}', "$.reason"),
        (b'{"overrides": [' + b",".join([b'"a=1"'] * 65) + b"]}", "$.overrides"),
        (b'{"reason": "' + b"x" * (params.MAX_BODY + 1) + b'"}', "at most"),
    ],
)  # fmt: skip
async def test_an_actions_body_of_another_shape_is_refused_saying_what(
    body: bytes, said: str
) -> None:
    with pytest.raises(CliError) as refused:
        await params.action_body(posted(body, chunks=3))
    assert refused.value.code == params.BAD_REQUEST
    assert said in str(refused.value), refused.value


@pytest.mark.parametrize("name", ["default", "gpu-a100", "pool_2", "p" * 64])
def test_a_pool_name_that_is_a_subject_token_is_taken(name: str) -> None:
    assert params.pool(name) == name


@pytest.mark.parametrize("name", ["*", ">", "gpu.*", "a.b", "", "a b", "p" * 65, "gp\u00fc"])
def test_a_pool_name_that_could_be_a_wildcard_or_no_token_is_refused(name: str) -> None:
    with pytest.raises(CliError) as refused:
        params.pool(name)
    assert refused.value.code == params.BAD_REQUEST and "not a pool name" in str(refused.value)
