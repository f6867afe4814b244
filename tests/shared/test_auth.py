"""Least privilege, enforced by real nats-servers with auth on: each denial the roles rely
on, tried and refused. (That the roles are *given* what they need is what every end-to-end
test checks: the test stacks run with auth on, as `baton up` does.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client

from baton.stack.natsserver import NatsServer
from baton.stack.options import StackOptions, operator_options, user_of, vault
from baton.stack.servers import nats_server
from shared import auth, credentials
from shared.bus import names
from shared.bus.streams import declared, ensure, ensure_site
from shared.contracts import decode, encode
from tests.support.stack import eventually

log = logging.getLogger(__name__)


class Servers:
    def __init__(self, hub: StackOptions, site: StackOptions) -> None:
        self.hub_opts, self.site_opts = hub, site
        self.hub: NatsServer
        self.site: NatsServer
        self.clients: list[Client] = []
        self.errors: dict[str, list[str]] = {}

    async def as_user(self, user: str, *, at_site: bool = False) -> Client:
        """A client of the hub (or the site's leaf) as `user`; its async errors (the
        server's permission violations) are collected under the user's name."""
        opts = self.site_opts if at_site else self.hub_opts
        v = vault(opts)
        assert v is not None
        errors = self.errors.setdefault(user, [])

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        server = self.site if at_site else self.hub
        # Reconnecting: a server that closed a connection as stale while this process was
        # starved of CPU (a loaded CI machine) must not fail the test.
        nc = await nats.connect(
            server.url, error_cb=on_error, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
            **credentials.options_for(v.get(user)),
        )  # fmt: skip
        self.clients.append(nc)
        return nc

    async def refused(self, user: str, subject: str) -> None:
        async def seen() -> bool:
            return any("permissions violation" in e.lower() and subject.lower() in e.lower()
                       for e in self.errors.get(user, []))  # fmt: skip

        await eventually(seen, 5, f"the server to refuse {user} on {subject}")


@pytest.fixture
async def servers(tmp_path: Path) -> AsyncIterator[Servers]:
    hub_opts = StackOptions(
        data_dir=tmp_path / "hub", port=0, ws_port=0, sites=("lab1", "lab2"),
        submitters=("alice", "bob"),
    )  # fmt: skip
    s = Servers(hub_opts, hub_opts)
    s.hub = nats_server(hub_opts)
    await s.hub.start()
    try:
        s.site_opts = StackOptions(
            data_dir=tmp_path / "lab1", port=0, site="lab1",
            hub_url=f"ws://127.0.0.1:{s.hub.ws_port}",
            hub_auth=str(tmp_path / "hub" / "auth" / "site-lab1.env"),
        )  # fmt: skip
        s.site = nats_server(s.site_opts)
        await s.site.start()
        # As the services declare them: a declaration that a loaded server answers late is
        # asked again (seen in CI: the site's outbox declared as the leaf came up, unanswered
        # in 5 s).
        hub_js = (await s.as_user("dispatcher")).jetstream()
        site_js = (await s.as_user("lab1-checkpointer", at_site=True)).jetstream()
        await declared(lambda: ensure(hub_js), log)
        await declared(lambda: ensure_site(site_js, "lab1"), log)
        yield s
    finally:
        for nc in s.clients:
            await nc.close()
        if hasattr(s, "site"):
            await s.site.stop()
        await s.hub.stop()


async def messages(js_client: Client, stream: str) -> int:
    return (await js_client.jetstream().stream_info(stream)).state.messages or 0


async def test_a_trainer_cannot_publish_tasks_or_submissions(servers: Servers) -> None:
    trainer = await servers.as_user("trainer")
    operator = await servers.as_user("operator")
    for subject in (names.task_subject("default", "r1"), names.submit_subject("default")):
        await trainer.publish(subject, b"{}")
        await trainer.flush()
        await servers.refused("trainer", subject)
    assert await messages(operator, names.TASKS_STREAM) == 0
    assert await messages(operator, names.SUBMIT_STREAM) == 0
    # What it may do goes through: its own events, and a group leader's calls for ranks
    # (a call names a group whose key only the run's lease holder writes: a forged one is
    # dropped by whoever takes it).
    ack = await trainer.jetstream().publish(names.event_subject("r1", "progress"), b"{}")
    assert ack.stream == names.EVENTS_STREAM
    ack = await trainer.jetstream().publish(names.call_subject("default", "r1"), b"{}")
    assert ack.stream == names.TASKS_STREAM


async def test_no_service_may_delete_or_purge_a_stream(servers: Servers) -> None:
    operator = await servers.as_user("operator")
    await operator.jetstream().publish(names.task_subject("default", "r1"), b"{}")
    for role in ("trainer", "dispatcher", "checkpointer", "reaper", "submitter"):
        nc = await servers.as_user(role)
        for op in ("DELETE", "PURGE"):
            subject = f"$JS.API.STREAM.{op}.{names.TASKS_STREAM}"
            with pytest.raises((TimeoutError, nats.errors.Error)):  # the request is dropped
                await nc.request(subject, b"", timeout=0.5)
            await servers.refused(role, subject)
    assert await messages(operator, names.TASKS_STREAM) == 1, "the task is still there"


async def test_a_trainer_cannot_write_what_is_not_its_to_write(servers: Servers) -> None:
    trainer = await servers.as_user("trainer")
    for subject in (f"$KV.{names.SITES_BUCKET}.lab1", "baton.cancel.r1", "baton.site.lab1.x"):
        await trainer.publish(subject, b"{}")
        await trainer.flush()
        await servers.refused("trainer", subject)


async def test_a_trainer_can_write_only_the_lease_of_a_run_it_was_handed(
    servers: Servers,
) -> None:
    from shared.state.lease import Lease, holder, lease_key

    secret = b"the hub's lease secret"
    handed, other = "r1", "r2"
    a, b = await servers.as_user("trainer"), await servers.as_user("trainer")
    # Trainer A was handed r1: its task carried the key. B was not.
    mine = Lease(a.jetstream(), handed, "a", 30, key=lease_key(handed, secret))
    assert await mine.acquire(), "the handed trainer takes its lease"
    # B cannot find r1's key: no listing the bucket, no reading it by sequence.
    stream = f"KV_{names.LEASES_BUCKET}"
    for subject, body in (
        (f"$JS.API.CONSUMER.CREATE.{stream}", b"{}"),
        (f"$JS.API.STREAM.MSG.GET.{stream}", b'{"seq": 1}'),
        (f"$JS.API.DIRECT.GET.{stream}", b'{"seq": 1}'),
    ):
        with pytest.raises((TimeoutError, nats.errors.Error)):
            await b.request(subject, body, timeout=0.5)
        await servers.refused("trainer", subject)
    # What B can name is not r1's lease: its writes land elsewhere and r1's is untouched.
    theirs = Lease(b.jetstream(), handed, "b", 30)
    assert await theirs.acquire(), "a key of its own making is just another key"
    js = (await servers.as_user("operator")).jetstream()
    assert await holder(js, lease_key(handed, secret)) == "a", "r1's lease is still A's"
    assert mine.key != theirs.key and await mine.renew()
    assert lease_key(other, secret) != lease_key(handed, secret)


async def test_a_submitter_can_only_submit_and_read_its_own_runs(servers: Servers) -> None:
    from baton.client import reader

    alice, bob = await servers.as_user("alice"), await servers.as_user("bob")
    operator = await servers.as_user("operator")
    ack = await alice.jetstream().publish(names.submit_subject("default", "alice"), b"{}")
    assert ack.stream == names.SUBMIT_STREAM, "submitting as itself is what it is for"
    mine, theirs = "alice.r1", "bob.r2"
    for run in (mine, theirs):
        await operator.jetstream().publish(names.event_subject(run, "accepted"), b"{}")
    sub = await reader.read(alice, names.EVENTS_STREAM, names.events_of_run(mine))
    assert (await sub.next_msg(timeout=5)).subject == names.event_subject(mine, "accepted")
    await sub.unsubscribe()
    for run in (theirs, "r3"):  # another submitter's run, an operator's run
        with pytest.raises((TimeoutError, nats.errors.Error)):
            await reader.read(alice, names.EVENTS_STREAM, names.events_of_run(run))
    await servers.refused("alice", f"{names.EVENTS_STREAM}.")  # a consumer on bob's events
    assert any(names.events_of_run(theirs).lower() in e.lower() for e in servers.errors["alice"])
    # nats-py's ordered consumer names no subject in its API call: refused too.
    with pytest.raises((TimeoutError, nats.errors.Error)):
        await alice.request(f"$JS.API.CONSUMER.CREATE.{names.EVENTS_STREAM}", b"{}", timeout=0.5)
    for subject in (
        names.submit_subject("default", "bob"), names.submit_subject("default"),
        names.cancel_subject(theirs), names.task_subject("default", mine),
        names.event_subject(mine, "completed"), f"$KV.{names.RUNS_BUCKET}.{mine}",
        f"$KV.{names.LEASES_BUCKET}.{mine}", "baton.control.t1",
    ):  # fmt: skip
        await alice.publish(subject, b"{}")
        await alice.flush()
        await servers.refused("alice", subject)
    assert await messages(operator, names.SUBMIT_STREAM) == 1, "only alice's own submission"
    del bob


async def test_a_site_cannot_touch_another_sites_subjects_or_the_hubs_streams(
    servers: Servers,
) -> None:
    hub = await servers.as_user("operator")
    seen: list[str] = []

    async def record(msg: nats.aio.msg.Msg) -> None:
        seen.append(msg.subject)

    await hub.subscribe("baton.site.>", cb=record)
    await hub.flush()
    # Even the site's own operator, free at its leaf, is held to its site across the link.
    local = await servers.as_user("lab1-operator", at_site=True)

    async def linked() -> bool:
        await local.publish("baton.site.lab1.probe", b"")
        await local.flush()
        await asyncio.sleep(0.1)
        return "baton.site.lab1.probe" in seen

    await eventually(linked, 20, "the site's link to the hub")
    await local.publish("baton.site.lab2.events.r1.k", b"forged")
    await local.publish(names.task_subject("default", "r9"), b"forged")
    await local.flush()
    with pytest.raises((TimeoutError, nats.errors.Error)):
        await local.request(f"$JS.{names.HUB_DOMAIN}.API.STREAM.DELETE.BATON_TASKS", b"", timeout=2)
    await local.publish("baton.site.lab1.after", b"")  # ordered after the forgeries
    await local.flush()
    await eventually(_has(seen, "baton.site.lab1.after"), 10, "the site's later message")
    assert "baton.site.lab2.events.r1.k" not in seen, "lab1 must not speak for lab2"
    assert await messages(hub, names.TASKS_STREAM) == 0, "no task from a site"
    assert (await hub.jetstream().stream_info(names.TASKS_STREAM)).config.name
    # The site's trainer is held at its own leaf already.
    trainer = await servers.as_user("lab1-trainer", at_site=True)
    await trainer.publish("baton.site.lab2.events.r1.k", encode({}))
    await trainer.flush()
    await servers.refused("lab1-trainer", "baton.site.lab2.events.r1.k")


async def test_a_site_keeps_a_copy_of_the_hubs_run_records_for_its_dispatcher_alone(
    servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """The site's copy of the hub's records (live and archived) arrives over the link as the
    site's own deliveries, the site's dispatcher reads it by run id, and a site trainer
    cannot. Declaring the site again finds nothing to change."""
    from shared.contracts import JobSpec, RunRecord
    from shared.state import archive
    from shared.state.runs import Runs

    spec = JobSpec(name="t", entry_point="examples.regression:train", total_steps=10)
    live, ended = (
        RunRecord(run_id=r, spec=spec, spec_hash="x", created_at=0.0, updated_at=0.0)
        for r in ("lab1-submitter.r1", "alice.r2")
    )
    hub = (await servers.as_user("dispatcher")).jetstream()
    await (await Runs.open(hub)).create(live)
    await archive.keep((await servers.as_user("reaper")).jetstream(), ended)
    site = (await servers.as_user("lab1-dispatcher", at_site=True)).jetstream()

    async def copied() -> list[str]:
        found = []
        subjects = (f"$KV.{names.RUNS_BUCKET}.{live.run_id}", names.archive_subject(ended.run_id))
        for subject in subjects:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                msg = await site.get_last_msg(names.HUB_RUNS_STREAM, subject, direct=True)
                found.append(decode(msg.data, RunRecord).run_id)
        return found

    async def both() -> bool:
        return await copied() == [live.run_id, ended.run_id]

    await eventually(both, 20, "the hub's records in the site's copy")
    trainer = await servers.as_user("lab1-trainer", at_site=True)
    subject = f"$JS.API.DIRECT.GET.{names.HUB_RUNS_STREAM}.$KV.{names.RUNS_BUCKET}.{live.run_id}"
    with pytest.raises((TimeoutError, nats.errors.Error)):
        await trainer.request(subject, b"", timeout=0.5)
    await servers.refused("lab1-trainer", subject)
    with caplog.at_level(logging.WARNING, logger="baton.streams"):
        checkpointer = await servers.as_user("lab1-checkpointer", at_site=True)
        await ensure_site(checkpointer.jetstream(), "lab1")
    assert not [r for r in caplog.records if "differs" in r.getMessage()], caplog.text


async def test_where_the_store_is_said_by_the_checkpointer_and_read_by_clients(
    servers: Servers,
) -> None:
    """The hub's checkpointer says where its store is; a submitter and the dashboard read it
    by key (`shared.state.hub`); a trainer may not say it."""
    from shared.state import hub

    assert await hub.read_store((await servers.as_user("submitter")).jetstream()) is None
    said = hub.store_info("s3://ckpts/team", {"BATON_S3_ENDPOINT": "http://10.0.0.5:8333"})
    await hub.say_store((await servers.as_user("checkpointer")).jetstream(), said)
    for role in ("submitter", "dashboard"):
        reader = await servers.as_user(role)
        assert await hub.read_store(reader.jetstream()) == said, role
    trainer = await servers.as_user("trainer")
    subject = f"$KV.{names.HUB_BUCKET}.{hub.STORE_KEY}"
    await trainer.publish(subject, b"{}")
    await trainer.flush()
    await servers.refused("trainer", subject)
    assert hub.store_info("file://./rel").url.startswith("file:///"), "made absolute"


async def test_generated_credentials_are_owner_only(servers: Servers) -> None:
    v = vault(servers.hub_opts)
    assert v is not None
    assert stat.S_IMODE(v.root.stat().st_mode) == 0o700
    files = sorted(v.root.iterdir())
    assert {p.name for p in files} >= {f"{r}.env" for r in auth.HUB_ROLES}
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert operator_options(servers.hub_opts)["user"] == "operator"
    assert user_of(servers.site_opts, "trainer") == "lab1-trainer"


async def test_wrong_credentials_fail_fast_with_a_clear_error(servers: Servers) -> None:
    from shared.bus.connect import connect
    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match="refused the credentials"):
        await connect(
            servers.hub.url, "t", first_attempt_timeout=5,
            options={"user": "trainer", "password": "wrong"},
        )  # fmt: skip


def _has(seen: list[str], subject: str):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return subject in seen

    return check


def test_a_machine_speaks_only_for_its_own_trainers() -> None:
    """A joined machine has a hub trainer's rights but for heartbeats, pulses and commands,
    which are its own workers' only; its replies come on its own inbox
    (tests/services/registrar has the server refuse the rest)."""
    from shared.auth import hub_permissions, machine_permissions

    workers = ("m-0123456789ab-trainer-1", "m-0123456789ab-trainer-2")
    mine = machine_permissions("m-0123456789ab", workers)
    trainer = hub_permissions("trainer")
    assert trainer is not None
    heartbeats = {s for s in mine.publish if s.startswith(f"$KV.{names.WORKERS_BUCKET}.")}
    assert heartbeats == {f"$KV.{names.WORKERS_BUCKET}.{w}" for w in workers}
    assert f"$KV.{names.WORKERS_BUCKET}.>" in trainer.publish
    pulses = {s for s in mine.publish if s.startswith(f"{names.PREFIX}.pulse.")}
    assert pulses == {names.pulse_subject(w) for w in workers}
    assert names.PULSE_ALL in trainer.publish
    assert set(mine.publish) - heartbeats - pulses == set(trainer.publish) - {
        f"$KV.{names.WORKERS_BUCKET}.>", names.PULSE_ALL
    }
    assert set(mine.subscribe) == {
        "_INBOX_m_0123456789ab.>", f"{names.PREFIX}.events.>",
        *(names.control_subject(w) for w in workers),
        *(names.alive_subject(w) for w in workers),
    }  # fmt: skip
    assert not mine.responses


def test_a_machine_at_a_site_speaks_only_for_its_own_trainers_there() -> None:
    """A machine that joined site lab1 has a lab1 trainer's rights but for heartbeats and
    commands, its own workers' only; its replies come on its own inbox, which the site's
    link lets in from the hub, as it lets in the hub's machine records and lets out joins."""
    from shared.auth import site_link, site_machine_permissions, site_permissions

    workers = ("m-0123456789ab-trainer-1",)
    mine = site_machine_permissions("m-0123456789ab", workers, "lab1")
    trainer = site_permissions("trainer", "lab1")
    assert trainer is not None
    everyone = names.site_root("lab1", "workers")
    assert everyone in trainer.publish and everyone not in mine.publish
    own = {names.heartbeat_subject(w, "lab1") for w in workers}
    assert set(mine.publish) == (set(trainer.publish) - {everyone}) | own
    assert set(mine.subscribe) == {
        "_INBOX_m_0123456789ab.>", names.site_root("lab1", "events"),
        *(names.control_subject(w) for w in workers),
    }  # fmt: skip
    link = site_link("lab1")
    assert "_INBOX_m_*.>" in link.subscribe and "_INBOX_lab1_registrar.>" in link.subscribe
    assert f"$JS.hub.API.CONSUMER.CREATE.KV_{names.MACHINES_BUCKET}.>" in link.publish
    assert names.site_join_subject("lab1", "0123456789ab").startswith("baton.site.lab1.")


def test_a_hub_that_admits_machines_asks_the_registrar_of_everyone_but_its_roles() -> None:
    import json as _json

    from shared.auth import authorization, hub_permissions, system_users
    from shared.credentials import Credentials

    users = [(Credentials(r, "pw"), hub_permissions(r)) for r in ("operator", "trainer")]
    users.append((Credentials("carol", "pw"), None))
    system = system_users(Credentials("departures", "dpw"), Credentials("system", "spw"))
    block = authorization(users, system, "AISSUER", ["operator", "trainer"])
    head, _, rest = block.partition("\naccounts ")
    body = _json.loads(head.removeprefix("authorization "))
    assert body["auth_callout"] == {
        "issuer": "AISSUER", "auth_users": ["operator", "trainer", "departures", "system"]
    }  # fmt: skip
    assert [u["user"] for u in body["users"]] == ["operator", "trainer", "carol"]
    accounts, _, tail = rest.rpartition("\n")
    sys_users = _json.loads(accounts)["SYS"]["users"]
    assert [u["user"] for u in sys_users] == ["departures", "system"]
    assert sys_users[0]["permissions"]["subscribe"] == {"allow": ["$SYS.ACCOUNT.*.DISCONNECT"]}
    assert "permissions" not in sys_users[1]
    assert tail == "system_account: SYS"
    assert "auth_callout" not in authorization(users, system)
