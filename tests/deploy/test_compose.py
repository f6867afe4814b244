"""compose.yaml, the Dockerfile and the otel collector config, checked structurally.

Docker is not run here: these tests hold the deployment files to what the code and the
NATS configs say — real CLI commands, mounted files that exist, ports and hostnames that
agree with deploy/nats/*.conf, and only environment variables Baton reads.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from baton.cli.app import SERVICES, app
from shared.bus import names
from tests.deploy.natsconf import (
    CERT_SCRIPT,
    NATS_DIR,
    REPO,
    ROUTE_CERT_SCRIPT,
    inline_includes,
    listeners,
    strip_comments,
)

COMPOSE: dict[str, Any] = yaml.safe_load((REPO / "compose.yaml").read_text())
SVC: dict[str, dict[str, Any]] = COMPOSE["services"]
CERTS_OUT = Path("deploy/certs/out")

# Read by Baton outside shared/config.py: the S3 store (shared/checkpoint/store/s3.py) and
# OpenTelemetry (shared/telemetry.py: OTEL_EXPORTER_OTLP_* and the SDK's OTEL_*).
S3_ENV = {
    "BATON_S3_ENDPOINT",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
}
# Set in compose ahead of the code that reads them; each must be explained in docs/deploy.md.
PENDING_ENV: set[str] = set()


def baton_image() -> str:
    built = {s["image"] for s in SVC.values() if s.get("build") in (".", {"context": "."})}
    assert len(built) == 1, f"one image built from this repository expected, got {built}"
    return built.pop()


def baton_services() -> dict[str, dict[str, Any]]:
    image = baton_image()
    return {name: s for name, s in SVC.items() if s.get("image") == image}


def nats_services() -> dict[str, str]:
    """compose service -> the deploy/nats config it runs."""
    found: dict[str, str] = {}
    for name, s in SVC.items():
        cmd = s.get("command") or []
        if "--config" in cmd:
            target = cmd[cmd.index("--config") + 1]
            source = bind_mounts(s)[target]
            assert source.parent == Path("deploy/nats"), f"{name} runs {source}"
            found[name] = source.name
    return found


def env(service: dict[str, Any]) -> dict[str, str]:
    e = service.get("environment") or {}
    if isinstance(e, list):
        e = dict(item.split("=", 1) for item in e)
    return {k: str(v) for k, v in e.items()}


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path (relative to the repository) of each bind mount."""
    mounts: dict[str, Path] = {}
    for v in service.get("volumes") or []:
        if isinstance(v, str):
            source, target = v.split(":")[:2]
            if not source.startswith((".", "/")):
                continue  # a named volume
        else:
            if v.get("type") != "bind":
                continue
            source, target = v["source"], v["target"]
        path = Path(source)
        assert not path.is_absolute(), f"host path {source} is outside the repository"
        mounts[target] = Path(*path.parts)  # normalises ./x
    return mounts


def argv(service: dict[str, Any]) -> list[str]:
    """The process a Baton container runs: the image's ENTRYPOINT ["baton"] plus command."""
    entry = service.get("entrypoint")
    cmd = service.get("command") or []
    cmd = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    if entry is None:
        return ["baton", *cmd]
    assert entry in (["/usr/bin/env"], []), f"unexpected entrypoint {entry}"
    return cmd


def nats_conf(name: str) -> str:
    return (NATS_DIR / name).read_text()


def port_of(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def hub_ports() -> dict[str, int]:
    """client, monitoring, leafnode, websocket ports of deploy/nats/hub.conf, in file order."""
    found = listeners(nats_conf("hub.conf"))
    assert len(found) == 4, f"hub.conf: expected client, http, leafnodes, websocket: {found}"
    client, http, leaf, ws = (port_of(a) for a in found)
    return {"client": client, "http": http, "leafnode": leaf, "websocket": ws}


def gen_certs(out: Path, script: Path = CERT_SCRIPT) -> list[str]:
    proc = subprocess.run(
        ["bash", str(script), str(out)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return sorted(p.name for p in out.iterdir())


# -- commands ------------------------------------------------------------------------------


def test_baton_services_run_real_cli_commands() -> None:
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    services = baton_services()
    assert {"dispatcher", "checkpointer", "reaper", "trainer-1", "trainer-2", "cli"} <= set(
        services
    ), sorted(services)
    ran = set()
    for name, s in services.items():
        args = argv(s)
        assert args[0] == "baton", f"{name} runs {args}"
        if args[1:] == ["--help"]:
            continue  # the cli tool's default
        assert args[1] in commands, f"{name}: `baton {args[1]}` is not a CLI command"
        if args[1] == "service":
            assert len(args) == 3 and args[2] in SERVICES, f"{name}: {args}"
            assert (REPO / "services" / args[2] / "__main__.py").exists()
            ran.add(args[2])
        # The arguments parse (with --help nothing runs).
        result = CliRunner().invoke(app, [*args[1:], "--help"])
        assert result.exit_code == 0, f"{name}: {args}: {result.output}"
    assert ran == set(SERVICES), f"services no container runs: {set(SERVICES) - ran}"


def test_cli_service_is_a_tool() -> None:
    cli = SVC["cli"]
    assert cli.get("profiles") == ["tools"], cli.get("profiles")
    # `docker compose run --rm cli baton runs` must read `baton runs`, not `baton baton runs`.
    assert cli.get("entrypoint") in (["/usr/bin/env"], []), cli.get("entrypoint")
    assert argv({**cli, "command": ["baton", "runs"]}) == ["baton", "runs"]


def test_depends_on_names_real_services() -> None:
    for name, s in SVC.items():
        for dep in s.get("depends_on") or {}:
            assert dep in SVC, f"{name} depends on unknown service {dep}"
    for name in baton_services():
        if "tools" not in (SVC[name].get("profiles") or []):
            deps = SVC[name]["depends_on"]
            assert deps["minio-init"]["condition"] == "service_completed_successfully", name


# -- files --------------------------------------------------------------------------------


def test_mounted_host_paths_exist(tmp_path: Path) -> None:
    generated = gen_certs(tmp_path / "certs")
    assert generated == ["ca-key.pem", "ca.pem", "hub-key.pem", "hub.pem"], generated
    both = gen_certs(tmp_path / "certs", ROUTE_CERT_SCRIPT)
    routes = sorted(set(both) - set(generated))
    want = ["route-ca.pem"] + [f"route-{n}{k}.pem" for n in HUB_NODES for k in ("-key", "")]
    assert routes == sorted(want), f"the routes' CA key must not be written: {routes}"
    generated = both
    named = set(COMPOSE.get("volumes") or {})
    for name, s in SVC.items():
        for target, source in bind_mounts(s).items():
            if source.parent == CERTS_OUT:
                # Made by gen-dev-certs.sh before `docker compose up` (docs/deploy.md).
                assert source.name in generated, f"{name}: the script makes no {source.name}"
                assert source.name != "ca-key.pem", f"{name} mounts the CA's private key"
            else:
                assert (REPO / source).exists(), f"{name}: {source} (-> {target}) is missing"
        for v in s.get("volumes") or []:
            if isinstance(v, str) and not v.startswith((".", "/")):
                assert v.split(":")[0] in named, f"{name}: volume {v} is not declared"


def test_cert_output_is_never_committed() -> None:
    ignore = (REPO / "deploy" / "certs" / ".gitignore").read_text().split()
    assert "out/" in ignore, ignore
    dockerignore = (REPO / ".dockerignore").read_text().split()
    assert "deploy/certs/out" in dockerignore
    try:
        tracked = subprocess.run(
            ["git", "ls-files", "--", "deploy"],
            cwd=REPO, capture_output=True, text=True, timeout=30, check=True,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    keys = [p for p in tracked if p.endswith((".pem", ".key", ".creds", ".nk"))]
    assert not keys, f"key material committed: {keys}"


HUB_NODES = ("hub-1", "hub-2", "hub-3")


def test_nats_services_mount_what_their_config_references() -> None:
    services = nats_services()
    want = {**dict.fromkeys(HUB_NODES, "hub-node.conf"), "leaf": "leaf.conf"}
    assert services == want, services
    for name, conf in services.items():
        s = SVC[name]
        binds = bind_mounts(s)
        targets = list(binds) + [
            v.split(":")[1] for v in s.get("volumes") or [] if isinstance(v, str)
        ]
        # Included files are read beside the config (/etc/nats/), so they must be there too.
        for included in re.findall(r'include\s+"([^"]+)"', strip_comments(nats_conf(conf))):
            assert f"/etc/nats/{included}" in targets, f"{name}: {conf} includes {included}"
        body = inline_includes(strip_comments(nats_conf(conf)))
        paths = re.findall(r'"(/[^"]+)"', body)
        assert paths, f"{conf} references no files"
        for path in paths:
            assert any(path == t or path.startswith(t.rstrip("/") + "/") for t in targets), (
                f"{name}: {conf} uses {path}, which no volume provides"
            )
    assert env(SVC["leaf"]).get("SITE"), "the leaf needs SITE (leaf.conf uses $SITE)"
    assert "$SITE" in nats_conf("leaf.conf")
    # Each node its own name, which hub-node.conf reads from HUB_NODE.
    assert [env(SVC[n]).get("HUB_NODE") for n in HUB_NODES] == list(HUB_NODES)
    assert re.search(r"^server_name\s*:\s*\$HUB_NODE\s*$", nats_conf("hub-node.conf"), re.M)


def test_routes_need_the_password_and_their_own_certificates() -> None:
    """hub-node.conf's cluster asks every route for the route user's password (from
    BATON_PW_ROUTE) and a certificate of the routes' CA; compose gives each node the route
    URLs of all three carrying that same password, and its own route certificate."""
    conf = strip_comments(nats_conf("hub-node.conf"))
    (cluster,) = re.findall(r"^cluster\s*\{.*?^\}", conf, re.M | re.S)
    user = re.search(r"authorization\s*\{[^}]*\buser\s*:\s*([\w-]+)", cluster)
    assert user and re.search(r"\bpassword\s*:\s*\$BATON_PW_ROUTE\s*$", cluster, re.M), cluster
    tls = dict(re.findall(r'^\s*(cert_file|key_file|ca_file)\s*:\s*"([^"]+)"', cluster, re.M))
    assert set(tls) == {"cert_file", "key_file", "ca_file"}, cluster
    assert re.search(r"^\s*verify\s*:\s*true\s*$", cluster, re.M), "routes must verify peers"
    assert re.search(r"^\s*routes\s*:\s*\$BATON_ROUTES\s*$", cluster, re.M), cluster
    cluster_port = port_of(listeners(nats_conf("hub-node.conf"))[0])
    for name in HUB_NODES:
        e = env(SVC[name])
        assert e["BATON_PW_ROUTE"] == "${BATON_PW_ROUTE:-dev-route}", e["BATON_PW_ROUTE"]
        urls = [urlsplit(u) for u in json.loads(e["BATON_ROUTES"])]
        assert [(u.scheme, u.hostname, u.port) for u in urls] == [
            ("nats-route", n, cluster_port) for n in HUB_NODES
        ], e["BATON_ROUTES"]
        for u in urls:  # urlsplit cannot read `${…:-…}` as a password: compare the text
            assert u.netloc.startswith(f"{user[1]}:{e['BATON_PW_ROUTE']}@"), u.netloc
        binds = bind_mounts(SVC[name])
        assert binds[tls["cert_file"]] == CERTS_OUT / f"route-{name}.pem", binds
        assert binds[tls["key_file"]] == CERTS_OUT / f"route-{name}-key.pem", binds
        assert binds[tls["ca_file"]] == CERTS_OUT / "route-ca.pem", binds


# -- ports, hostnames, URLs ----------------------------------------------------------------


def test_nats_ports_agree_with_configs() -> None:
    ports = hub_ports()
    assert ports == {"client": 4222, "http": 8222, "leafnode": 7422, "websocket": 443}, ports
    hub = strip_comments(nats_conf("hub.conf"))
    assert re.search(r"websocket\s*\{[^}]*\btls\s*\{", hub), "the hub's websocket needs TLS"
    assert "no_tls" not in hub
    published = {str(p).rsplit(":", 1)[-1] for p in SVC["hub-1"]["ports"]}
    assert str(ports["websocket"]) in published, f"hub does not publish {ports['websocket']}"
    # Only the WebSocket port is for the world; the rest stays on the docker host's loopback.
    for p in SVC["hub-1"]["ports"]:
        if not str(p).endswith(f":{ports['websocket']}"):
            assert str(p).startswith("127.0.0.1:"), f"hub publishes {p} on every interface"
    # Routes are for the nodes alone (password and route certificates): no node publishes
    # them on the docker host.
    cluster_port = port_of(listeners(nats_conf("hub-node.conf"))[0])
    for name in HUB_NODES:
        assert not any(str(p).endswith(f":{cluster_port}") for p in SVC[name].get("ports", []))
    for name in (*HUB_NODES, "leaf"):
        check = " ".join(SVC[name]["healthcheck"]["test"])
        leaf_http = port_of(listeners(nats_conf("leaf.conf"))[1])
        want = ports["http"] if name in HUB_NODES else leaf_http
        assert f":{want}/healthz" in check, f"{name} healthcheck {check}"


def test_leaf_dials_the_hub_websocket_by_its_certificate_name(tmp_path: Path) -> None:
    leaf = strip_comments(nats_conf("leaf.conf"))
    assert re.search(r"urls\s*:\s*\$BATON_HUB_URL\s*$", leaf, re.M), "the URLs are the env's"
    # An array, as the server parses it from the environment: every node's URL.
    urls = json.loads(SVC["leaf"]["environment"]["BATON_HUB_URL"])
    hosts = []
    for url in urls:
        parts = urlsplit(url)
        assert parts.username == "site-site1" and parts.password, "the site's link user"
        assert parts.scheme == "wss", url
        assert nats_services().get(parts.hostname or "") == "hub-node.conf", url
        assert parts.port == hub_ports()["websocket"], url
        hosts.append(parts.hostname)
    assert hosts == list(HUB_NODES), hosts
    assert re.search(r'reconnect\s*:\s*"1s"', leaf)
    assert re.search(r'ping_interval\s*:\s*"2s"', leaf) and re.search(r"ping_max\s*:\s*2\b", leaf)
    # The hub's certificate names the host the leaf dials.
    gen_certs(tmp_path / "certs")
    san = subprocess.run(
        ["openssl", "x509", "-in", str(tmp_path / "certs" / "hub.pem"), "-noout", "-ext",
         "subjectAltName"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    for name in (*(f"DNS:{h}" for h in hosts), "DNS:localhost", "IP Address:127.0.0.1"):
        assert name in san, san


def test_dev_configs_pair_up() -> None:
    hub = listeners(nats_conf("dev/hub.conf"))
    assert all(a.startswith("127.0.0.1:") for a in hub), hub
    assert all(a.startswith("127.0.0.1:") for a in listeners(nats_conf("dev/leaf.conf")))
    (url,) = re.findall(r'"(ws://[^"]+)"', strip_comments(nats_conf("dev/leaf.conf")))
    assert urlsplit(url).netloc == hub[3], f"dev leaf dials {url}, dev hub listens on {hub[3]}"
    assert "no_tls: true" in nats_conf("dev/hub.conf")


def test_the_servers_baton_starts_match_the_dev_configs() -> None:
    """`baton up` and the tests run `baton.stack.natsconf`; compose runs deploy/nats. They must
    agree on what makes the hub/site protocol work."""
    from baton.stack import natsconf

    def settings(text: str) -> dict[str, str]:
        body = strip_comments(text)
        return {
            key: m.group(1)
            for key in ("ping_interval", "ping_max", "reconnect", "domain")
            if (m := re.search(rf"^\s*{key}\s*:\s*(\S+)\s*$", body, re.M))
        }

    hub, leaf = settings(nats_conf("dev/hub.conf")), settings(nats_conf("dev/leaf.conf"))
    ours_hub, ours_leaf = (
        settings(natsconf.hub_fragment()),
        settings(natsconf.leaf_fragment(["ws://h:1"])),
    )
    for key in ("ping_interval", "ping_max"):
        assert hub[key] == ours_hub[key] == leaf[key] == ours_leaf[key], key
    assert leaf["reconnect"] == ours_leaf["reconnect"]
    assert hub["domain"] == names.HUB_DOMAIN and leaf["domain"] == "$SITE"


def test_every_baton_service_has_nats_url() -> None:
    ports = {
        **dict.fromkeys(HUB_NODES, port_of(listeners(nats_conf("hub.conf"))[0])),
        "leaf": port_of(listeners(nats_conf("leaf.conf"))[0]),
    }
    for name, s in baton_services().items():
        url = env(s).get("NATS_URL")
        assert url, f"{name} has no NATS_URL"
        hosts = []
        for part in url.split(","):
            parts = urlsplit(part)
            assert parts.scheme == "nats" and parts.hostname in ports, f"{name}: {url}"
            assert parts.port == ports[parts.hostname], f"{name}: {url}"
            hosts.append(parts.hostname)
        at_site = hosts == ["leaf"]
        # At the hub: every node, so that a client moves to another when one is lost.
        assert at_site or hosts == list(HUB_NODES), f"{name}: {url}"
        assert at_site or env(s).get("BATON_REPLICAS") == str(len(HUB_NODES)), name
        # Site services name their site, which is the leaf's JetStream domain.
        assert (env(s).get("BATON_SITE") == "site1") == at_site, f"{name}: {env(s)}"
        if args_of(name)[1:2] == ["service"] and args_of(name)[2] == "trainer":
            assert env(s).get("BATON_POOL"), f"{name} has no BATON_POOL"


def args_of(name: str) -> list[str]:
    return argv(SVC[name])


def test_store_and_telemetry_endpoints_point_at_their_services() -> None:
    init = " ".join(SVC["minio-init"]["command"])
    buckets = re.findall(r"mc mb (?:--ignore-existing )?local/([a-z0-9.-]+)", init)
    minio_cmd = SVC["minio"]["command"]
    assert "--address" not in minio_cmd  # so the API is on MinIO's default port, 9000
    collector = SVC["otel-collector"]
    (config_arg,) = [a for a in collector["command"] if a.startswith("--config=")]
    config_source = bind_mounts(collector)[config_arg.split("=", 1)[1]]
    otel = yaml.safe_load((REPO / config_source).read_text())
    protocol = "http" if "otlp.proto.http" in (REPO / "shared/telemetry.py").read_text() else "grpc"
    otlp_port = port_of(otel["receivers"]["otlp"]["protocols"][protocol]["endpoint"])
    for name, s in baton_services().items():
        e = env(s)
        store = urlsplit(e["BATON_STORE"])
        assert store.scheme == "s3" and store.hostname in buckets, f"{name}: {e['BATON_STORE']}"
        s3 = urlsplit(e["BATON_S3_ENDPOINT"])
        assert (s3.hostname, s3.port) == ("minio", 9000), f"{name}: {s3.geturl()}"
        assert e["AWS_ACCESS_KEY_ID"] and e["AWS_SECRET_ACCESS_KEY"], name
        otlp = urlsplit(e["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert otlp.hostname == "otel-collector" and otlp.port == otlp_port, (
            f"{name}: {otlp.geturl()} (Baton exports OTLP/{protocol} to port {otlp_port})"
        )
    # The collector's pipelines use only what it defines, and print to the debug exporter.
    for kind, pipe in otel["service"]["pipelines"].items():
        for section in ("receivers", "processors", "exporters"):
            for item in pipe.get(section, []):
                assert item in otel[section], f"{kind}: {section} {item} is not defined"
        assert "debug" in pipe["exporters"], kind
    # MinIO's credentials are the ones the services sign with.
    minio = env(SVC["minio"])
    for name, s in baton_services().items():
        assert env(s)["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"], name
        assert env(s)["AWS_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"], name


def test_env_var_names_are_ones_baton_reads() -> None:
    # Settings, and the credentials shared/credentials.py reads (never a field of them).
    config = (REPO / "shared" / "config.py").read_text()
    config += (REPO / "shared" / "credentials.py").read_text()
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]{2,})`", config)) | set(
        re.findall(r'"([A-Z][A-Z0-9_]{2,})"', config)
    )
    assert {"NATS_URL", "BATON_STORE", "BATON_POOL"} <= documented, documented
    assert not PENDING_ENV & documented, (
        f"{PENDING_ENV & documented} is read now: drop it from PENDING_ENV and compose's comment"
    )
    deploy_doc = (REPO / "docs" / "deploy.md").read_text()
    for name in PENDING_ENV:
        assert name in deploy_doc, f"{name} is set by compose but not explained in docs/deploy.md"
    allowed = documented | S3_ENV | PENDING_ENV
    for name, s in baton_services().items():
        for var in env(s):
            assert var in allowed or var.startswith("OTEL_"), f"{name}: Baton never reads {var}"


# -- image --------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")
    ]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def test_dockerfile() -> None:
    steps = dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim"), steps[0]
    runs = [arg for op, arg in steps if op == "RUN"]
    torch = next(i for i, r in enumerate(runs) if "pip install torch" in r)
    project = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch < project, "CPU torch must be installed before the project"
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for op, a in steps if op == "ARG"}
    assert "download.pytorch.org/whl/cpu" in runs[torch] + args.get("TORCH_INDEX_URL", "")
    users = [arg for op, arg in steps if op == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    (entry,) = [arg for op, arg in steps if op == "ENTRYPOINT"]
    assert json.loads(entry) == ["baton"]
    copied = set()
    for op, arg in steps:
        if op == "COPY":
            *sources, _dest = arg.split()
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: no such path"
                copied.add(src.rstrip("/"))
    pyproject = (REPO / "pyproject.toml").read_text()
    include = re.search(r"include\s*=\s*\[([^\]]*)\]", pyproject)
    assert include, "pyproject has no packages.find include"
    for pattern in re.findall(r'"([^"]+)"', include.group(1)):
        assert pattern.rstrip("*") in copied, f"package {pattern} is not copied into the image"
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in (".venv", ".git", "out", "**/__pycache__", ".pytest_cache", "deploy/certs/out"):
        assert path in ignored, f".dockerignore misses {path}"


def test_committed_authorization_is_what_the_code_generates() -> None:
    """deploy/nats/auth-*.conf are `baton auth-config` output: the roles' allow-lists live in
    one place (shared/auth/), and the files cannot drift from it."""
    from shared import auth

    body = "\n".join(ln for ln in nats_conf("auth-hub.conf").splitlines() if not ln.startswith("#"))
    assert body.strip() == auth.deployment_config(None, ("site1",)).strip()
    body = "\n".join(
        ln for ln in nats_conf("auth-site.conf").splitlines() if not ln.startswith("#")
    )
    assert body.strip() == auth.deployment_config("site1").strip()


def test_every_service_logs_in_as_its_role_with_the_servers_password() -> None:
    """Each Baton container's NATS_USER is a user of the server it connects to, and its
    NATS_PASSWORD is the same variable (and default) that server reads."""
    from shared import auth

    for name, s in baton_services().items():
        e = env(s)
        host = urlsplit(e["NATS_URL"].split(",")[0]).hostname
        at_hub = host in HUB_NODES
        users = auth.HUB_ROLES if at_hub else tuple(f"site1-{r}" for r in auth.SITE_ROLES)
        assert e.get("NATS_USER") in users, f"{name}: {e.get('NATS_USER')}"
        server = env(SVC["hub-1" if at_hub else "leaf"])
        var = auth.env_name(e["NATS_USER"])
        assert var in server, f"{name}: the {host} server does not read {var}"
        assert e["NATS_PASSWORD"] == server[var], f"{name}: password differs from the server's"
        if "BATON_DEPARTURES_USER" in e:  # the reaper's system-account user
            assert at_hub and e["BATON_DEPARTURES_USER"] == auth.DEPARTURES_USER, name
            var = auth.env_name(auth.DEPARTURES_USER)
            assert e["BATON_DEPARTURES_PASSWORD"] == server[var], f"{name}: departures password"
    assert "BATON_DEPARTURES_USER" in env(SVC["reaper"]), "the reaper hears departures"


def test_every_password_a_server_config_reads_is_in_its_environment() -> None:
    """nats-server refuses to start on a `$VARIABLE` its environment lacks, so each server
    gets every `BATON_PW_…` its authorization config names — a role added to the code, and
    so to the generated config, must be added to compose too."""
    for conf, server in (("auth-hub.conf", "hub-1"), ("auth-site.conf", "leaf")):
        wanted = set(re.findall(r"\$(BATON_PW_[A-Z0-9_]+)", nats_conf(conf)))
        assert wanted, conf
        for node in HUB_NODES if server == "hub-1" else (server,):
            missing = wanted - set(env(SVC[node]))
            assert not missing, f"{node} starts without {sorted(missing)} ({conf} reads them)"
