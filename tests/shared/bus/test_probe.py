"""A probe says "gone" only when nothing listens any more: a listener whose process ended
(its socket closed) is gone at once; a live listener, answering nothing, is not."""

from __future__ import annotations

from shared.bus import names, probe
from tests.support.roles import AuthorizedHub
from tests.support.stack import eventually


async def test_a_listener_is_there_until_its_connection_closes(authorized: AuthorizedHub) -> None:
    asker = await authorized.connect("trainer", name="leader")
    member = await authorized.connect("trainer", name="member")

    async def silent(_msg: object) -> None:
        return None

    await member.subscribe(names.alive_subject("t2"), cb=silent)
    await member.flush()
    assert not await probe.gone(asker, names.alive_subject("t2")), "there, answering nothing"
    assert await probe.gone(asker, names.alive_subject("t9")), "never there"
    await member.close()  # as its process ending
    # Gone once its server has taken the close in (a probe that races it finds it there).

    async def gone() -> bool:
        return await probe.gone(asker, names.alive_subject("t2"))

    await eventually(gone, 10, "the closed listener's subscription gone")
