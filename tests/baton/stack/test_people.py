"""The people of a stack (`baton.stack.people`, `baton people`, `baton up --submitter`,
`baton auth-config --submitter`): names that cannot pass for another user, a people file and
credentials that only their owner reads, and the servers' authorization reloaded in place —
at every node of a clustered hub, a removed person's connections closed by the servers, a
person kept throughout untouched, and a node restarted afterwards starting with the people
of now. Real nats-servers; `tests/e2e/test_people.py` runs the same through `baton up`."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from baton.cli.app import app
from baton.stack.authority import reload_people
from baton.stack.cluster import HubCluster
from baton.stack.natsserver import NatsServer, NatsServerError
from baton.stack.options import StackOptions
from baton.stack.people import People, check_person
from baton.stack.servers import hub
from shared.auth import DEPARTURES_USER, HUB_ROLES, SITE_ROLES, env_name
from shared.credentials import Credentials
from tests.support.logins import Watched, login
from tests.support.stack import eventually

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# -- names ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["alice", "a", "bob-2", "c_d-e9", "a" * 32])
def test_a_subject_token_of_plain_characters_is_a_persons_name(name: str) -> None:
    assert check_person(name) == name


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("", "1 to 32 characters"),
        ("a" * 33, "1 to 32 characters"),
        ("Alice", "lowercase"),
        ("9lives", "starting with a letter"),
        ("-a", "starting with a letter"),
        ("a.b", "lowercase letters, digits"),  # two subject tokens: not one owner
        ("a*", "lowercase letters, digits"),
        ("a>", "lowercase letters, digits"),
        ("a b", "lowercase letters, digits"),
        *((r, "a role") for r in sorted({*HUB_ROLES, *SITE_ROLES})),
        ("site-lab1", "'site-' starts the sites' links"),
        ("lab1-trainer", "a site's users"),  # its runs and replies would be lab1's trainer's
        ("lab1_submitter", "a site's users"),  # `_INBOX_lab1_submitter`, the site's inbox
        ("x-operator", "a site's users"),
    ],
)
def test_a_name_that_could_pass_for_another_user_is_refused_with_the_rule(
    name: str, rule: str
) -> None:
    with pytest.raises(ValueError) as refused:
        check_person(name)
    assert rule in str(refused.value), str(refused.value)


# -- the people file -------------------------------------------------------------------


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask that takes nothing away: a file is owner-only only if it was made so."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("open_umask")
def test_people_round_trip_owner_only_with_their_credentials(tmp_path: Path) -> None:
    people = People(tmp_path)
    assert people.names() == [], "no file yet: no people"
    assert people.add("carol") and people.add("alice")
    assert not people.add("alice"), "adding a person again changes nothing"
    assert people.names() == ["alice", "carol"]
    assert msgspec.json.decode((tmp_path / "auth" / "people.json").read_bytes()) == [
        "alice",
        "carol",
    ]
    assert mode(tmp_path / "auth") == 0o700
    for f in ("people.json", "people.lock", "alice.env", "carol.env"):
        assert mode(tmp_path / "auth" / f) == 0o600, f"{f}: {oct(mode(tmp_path / 'auth' / f))}"
    assert "NATS_USER=alice\n" in people.auth_file("alice").read_text()
    assert not list((tmp_path / "auth").glob("*.tmp")), "written through a renamed temporary"
    alice = people.vault.get("alice")

    assert people.remove("alice") == alice, "the credentials it had, to check they are refused"
    assert people.names() == ["carol"]
    assert not people.auth_file("alice").exists(), "its credentials are deleted"
    assert people.remove("alice") is None
    assert people.add("alice")
    assert people.vault.get("alice").password != alice.password, "a new person, a new password"


def test_two_people_may_not_share_a_reply_inbox(tmp_path: Path) -> None:
    people = People(tmp_path)
    people.add("a-b")
    with pytest.raises(ValueError, match="share a reply inbox"):
        people.add("a_b")  # `_INBOX_a_b` would be both people's
    assert people.names() == ["a-b"]


@pytest.mark.parametrize("text", ["{}", '["alice", 3]', '["operator"]', "not json"])
def test_a_people_file_that_is_not_a_list_of_names_says_so(tmp_path: Path, text: str) -> None:
    people = People(tmp_path)
    people.add("alice")
    people.path.write_text(text)
    with pytest.raises(ValueError, match=r"people\.json"):
        people.names()
    assert people.changed_from(("alice",)), "a stack reloads, to say what is wrong"


# -- the CLI without a stack -----------------------------------------------------------


AT_A_SITE = ("--site", "lab1", "--hub", "ws://127.0.0.1:1", "--store", "file:///x", "--no-auth")


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--submitter", "Bad!"), "lowercase"),
        (("--submitter", "alice,operator"), "a role"),
        (("--submitter", "a-b", "--submitter", "a_b"), "share a reply inbox"),
        (("--submitter", "alice", "--no-auth"), "needs authorization"),
        ((*AT_A_SITE, "--submitter", "alice"), "a site has no people"),
    ],
)
def test_up_refuses_a_submitter_it_cannot_add_before_anything_starts(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    code, output = cli("up", "--data-dir", str(tmp_path / "data"), *args)
    assert code == 2 and said in output, output
    assert not (tmp_path / "data").exists(), "nothing started, nothing written"


def test_people_commands_with_no_stack_change_only_the_files(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    code, output = cli("people", "add", "dave", "--data-dir", data)
    assert code == 0 and "no stack is up" in output and "dave.env" in output, output
    code, output = cli("people", "add", "dave", "--data-dir", data, "--json")
    said = msgspec.json.decode(output)
    assert code == 0 and said["added"] is False and said["stack"] == "down", output
    assert said["auth_file"] == str(tmp_path / "data" / "auth" / "dave.env")
    code, output = cli("people", "list", "--data-dir", data, "--json")
    assert [p["person"] for p in msgspec.json.decode(output)] == ["dave"], output
    code, output = cli("people", "add", "operator", "--data-dir", data)
    assert code == 2 and "a role" in output, output
    code, output = cli("people", "remove", "erin", "--data-dir", data)
    assert code == 3 and "no person 'erin'" in output, output
    code, output = cli("people", "remove", "dave", "--data-dir", data)
    assert code == 0 and "removed" in output, output
    assert not (tmp_path / "data" / "auth" / "dave.env").exists()


def test_a_stack_json_left_behind_is_no_stack_to_signal(tmp_path: Path) -> None:
    """A stack killed by SIGKILL leaves `stack.json`, naming a pid that may be another
    process's by now: with no one holding the stack's lock, nothing is signalled."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        run = tmp_path / "data" / "run"
        run.mkdir(parents=True)
        (run / "stack.lock").touch()
        stack = {"nats_url": "nats://127.0.0.1:1", "site": "", "auth": True,
                 "pids": {"supervisor": bystander.pid}}  # fmt: skip
        (run / "stack.json").write_text(msgspec.json.encode(stack).decode())
        code, output = cli("people", "add", "dave", "--data-dir", str(tmp_path / "data"))
        assert code == 0 and "no stack is up" in output, output
        assert bystander.poll() is None, "SIGHUP went to a process that is no stack"
    finally:
        bystander.kill()
        bystander.wait()


# -- auth-config -----------------------------------------------------------------------


def test_auth_config_adds_each_person_with_its_variable_password() -> None:
    code, output = cli("auth-config", "--submitter", "alice", "--submitter", "bob,carol")
    assert code == 0, output
    for name in ("alice", "bob", "carol"):
        assert f'"user": "{name}",\n      "password": ${env_name(name)},' in output, name
        assert f'"baton.submit.*.{name}"' in output and f'"_INBOX_{name}.>"' in output
    assert output.startswith(
        "# Generated by `baton auth-config --submitter alice --submitter bob --submitter carol`"
    )
    assert "include" not in output
    code, output = cli("auth-config", "--site", "lab1", "--submitter", "alice")
    assert code == 2 and "a site has no people" in output, output
    code, output = cli("auth-config", "--submitter", "submitter")
    assert code == 2 and "a role" in output, output
    code, output = cli("auth-config", "--submitter", "a-b,a_b")
    assert code == 2 and "share a reply inbox" in output, output


async def test_a_deployed_hub_takes_a_person_in_and_out_on_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/deploy.md, "People": a server's environment is fixed when it starts, so a new
    person's password comes from the file `--passwords` includes, which the server reads
    again on reload — and which must name no one the block does not (the server refuses a
    variable it does not use)."""
    for role in (*HUB_ROLES, DEPARTURES_USER):
        monkeypatch.setenv(env_name(role), f"pw-{role}")  # what compose gives the servers
    data = tmp_path / "nats"
    data.mkdir()
    auth = data / "auth-hub.conf"
    passwords = data / "people.conf"

    def generate(*args: str) -> None:
        code, output = cli("auth-config", *args)
        assert code == 0, output
        auth.write_text(output)

    generate()
    server = NatsServer(
        data, jetstream=False, extra_config='include "auth-hub.conf"',
        probe={"user": "operator", "password": "pw-operator"},
    )  # fmt: skip
    await server.start()
    try:
        alice = Credentials("alice", "alice-secret")
        assert await login(server.url, alice) == "refused"
        passwords.write_text(f'{env_name("alice")}: "{alice.password}"\n')
        generate("--submitter", "alice", "--passwords", "people.conf")
        await server.reload(server.extra_config)  # `nats-server --signal reload`
        assert await login(server.url, alice) == "ok"
        generate("--passwords", "people.conf")  # alice out, her password still there:
        with pytest.raises(NatsServerError, match="unknown field"):
            await server.reload(server.extra_config)
        assert await login(server.url, alice) == "ok", "a failed reload changes nothing"
        passwords.write_text("")
        await server.reload(server.extra_config)
        assert await login(server.url, alice) == "refused"
    finally:
        await server.stop()


# -- reloading a running hub -----------------------------------------------------------




@pytest.fixture
async def clustered(tmp_path: Path) -> AsyncIterator[tuple[StackOptions, HubCluster]]:
    """Three hub nodes as `baton up --port 0 --hub-nodes 3 --submitter carol` makes them,
    monitoring on (a listener the reload must leave as it was)."""
    opts = StackOptions(data_dir=tmp_path / "hub", port=0, ws_port=0, hub_nodes=3)
    opts = msgspec.structs.replace(opts, submitters=People(opts.data_dir).adding(("carol",)))
    nodes = hub(opts, http_port=0)
    try:
        await nodes.start()
        yield opts, nodes
    finally:
        await nodes.stop()


async def test_every_node_of_a_clustered_hub_lets_a_person_in_and_out_without_a_restart(
    clustered: tuple[StackOptions, HubCluster],
) -> None:
    opts, nodes = clustered
    people = People(opts.data_dir)
    urls = [n.url for n in nodes.nodes]
    pids = [n.pid for n in nodes.nodes]
    carol = await Watched().connect(urls[1], people.vault.get("carol"))
    watched = [carol]
    try:
        people.add("alice")
        alice = people.vault.get("alice")
        assert [await login(u, alice) for u in urls] == ["refused"] * 3, "not before a reload"
        opts = await reload_people(opts, nodes)
        assert opts.submitters == ("alice", "carol")
        assert [await login(u, alice) for u in urls] == ["ok"] * 3
        bob = Credentials("bob", "never-added")
        assert [await login(u, bob) for u in urls] == ["refused"] * 3

        held = await Watched().connect(urls[2], alice)
        watched.append(held)
        assert people.remove("alice") == alice
        opts = await reload_people(opts, nodes)

        async def closed() -> bool:
            return held.nc.is_closed

        await eventually(closed, 10, "the server to close alice's connection")
        assert held.disconnects >= 1, "we never closed it: the server did"
        assert [await login(u, alice) for u in urls] == ["refused"] * 3
        assert carol.nc.is_connected and carol.disconnects == 0, "carol kept her connection"
        await carol.nc.flush(timeout=5)
        assert [n.pid for n in nodes.nodes] == pids, "no node was restarted"

        # A node that starts again starts with the people of now.
        await nodes.nodes[0].restart(kill=True)
        assert await login(urls[0], alice) == "refused"
        assert await login(urls[0], people.vault.get("carol")) == "ok"
        assert '"user": "alice"' not in nodes.nodes[0].config_path.read_text()
    finally:
        for w in watched:
            if not w.nc.is_closed:
                await w.nc.close()


def test_up_refuses_a_pools_table_that_does_not_read_before_anything_starts(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "pools.toml"
    bad.write_text("[pools.default]\npriorities = { high = 'ten' }\n")
    code, output = cli("up", "--data-dir", str(tmp_path / "data"), "--pools", str(bad))
    assert code == 2 and "pools.toml" in output and "priorities" in output, output
    bad.write_text("[pools.default]\nmax_priority = 5\n")
    code, output = cli("up", "--data-dir", str(tmp_path / "data"), *AT_A_SITE, "--pools", str(bad))
    assert code == 2 and "for the hub, not a site" in output, output
    assert not (tmp_path / "data").exists(), "nothing started, nothing written"
