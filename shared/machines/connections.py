"""Closing a user's connections on every server of the hub, as the system account's user.

The servers close what an `authorization` reload removes, but not a user the auth callout
admitted (`shared.machines.callout`): they never knew it. So a revoked machine, or a person
removed from a hub that admits machines, is closed through the servers' system API — asked
where the user is connected (`$SYS.REQ.SERVER.PING.CONNZ`, answered by every server) and told
to close each connection (`$SYS.REQ.SERVER.<id>.KICK`). Its reconnects are refused by then:
the caller changed the record the callout reads first.
"""

from __future__ import annotations

import asyncio
import json

from nats.aio.client import Client
from nats.aio.msg import Msg

GATHER_S = 0.5
"""How long the servers' answers to one `CONNZ` ping are gathered: each answers at once,
this only bounds the wait for the last. Closing repeats until a ping finds none."""
ROUNDS = 10


async def close_all(system: Client, user: str) -> int:
    """Close every connection of `user` on every server; until a ping finds none. The
    connections closed."""
    closed = 0
    for _ in range(ROUNDS):
        found = await connections(system, user)
        if not found:
            break
        for server_id, cid in found:
            subject = f"$SYS.REQ.SERVER.{server_id}.KICK"
            await system.request(subject, json.dumps({"cid": cid}).encode(), timeout=2)
            closed += 1
    return closed


async def close_users(system: Client, users: set[str]) -> int:
    """Close every connection of any of `users`, found in one listing of every server's
    connections: a registrar starting closes what a revocation it did not finish left."""
    closed = 0
    for server_id, cid in await connections(system, None, users):
        await system.request(
            f"$SYS.REQ.SERVER.{server_id}.KICK", json.dumps({"cid": cid}).encode(), timeout=2
        )
        closed += 1
    return closed


async def connections(
    system: Client, user: str | None, among: set[str] | None = None
) -> list[tuple[str, int]]:
    """(server id, connection id) of each connection of `user` — or, with `user` None, of
    any user in `among` — on every server."""
    inbox = system.new_inbox()
    answers: asyncio.Queue[bytes] = asyncio.Queue()

    async def heard(msg: Msg) -> None:
        answers.put_nowait(msg.data)

    sub = await system.subscribe(inbox, cb=heard)
    try:
        ask = {"user": user} if user is not None else {"auth": True}
        query = json.dumps({**ask, "limit": 100_000}).encode()
        await system.publish("$SYS.REQ.SERVER.PING.CONNZ", query, reply=inbox)
        found: list[tuple[str, int]] = []
        while True:
            try:
                data = await asyncio.wait_for(answers.get(), GATHER_S)
            except TimeoutError:
                return found
            answer = json.loads(data)
            server = answer.get("server", {}).get("id", "")
            for conn in (answer.get("data") or {}).get("connections") or []:
                if among is None or conn.get("authorized_user") in among:
                    found.append((server, int(conn["cid"])))
    finally:
        await sub.unsubscribe()
