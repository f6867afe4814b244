"""Groups give way to older ones on either side of a site (`older_on_either_side`), on a
real server: a site's trainers serve the groups granted to the site and the hub's alike."""

from __future__ import annotations

from nats.aio.client import Client

from shared.bus import names
from shared.bus.layout import site_kv_configs
from shared.contracts.groups import GroupKey
from shared.state.groups import GroupStore, older_on_either_side


def group(run_id: str, priority: float, *, formed: bool = False) -> GroupKey:
    return GroupKey(
        run_id=run_id, pool="default", epoch=1, ranks=2, leader="w", priority=priority,
        port=29500 if formed else 0,
    )  # fmt: skip


async def test_a_group_gives_way_to_an_older_one_on_the_other_side(declared: Client) -> None:
    js = declared.jetstream()
    [config] = [c for c in site_kv_configs("lab1") if c.bucket.startswith("baton_groups")]
    await js.create_key_value(config)
    hub = GroupStore(js, None, 30)
    site = GroupStore(js, None, 30, names.site_groups_bucket("lab1"))
    granted, held = group("lab1-sub.r2", 20.0), group("r1", 10.0)
    await site.put(names.group_key("default", granted.run_id), granted)
    await hub.put(names.group_key("default", held.run_id), held)
    # The granted group is the younger: it gives way to the hub's, forming too.
    assert await older_on_either_side(granted, site, hub) == held
    assert await older_on_either_side(held, hub, site) is None
    assert await older_on_either_side(granted, site, None) is None  # at the hub: one side
    # Once the hub's group formed, nothing is left to give way to.
    await hub.put(names.group_key("default", held.run_id), group("r1", 10.0, formed=True))
    assert await older_on_either_side(granted, site, hub) is None
    # The other side unreadable (the hub's bucket, cut off): nothing to give way to there.
    gone = GroupStore(js, None, 30, "baton_groups_nowhere")
    assert await older_on_either_side(granted, site, gone) is None
