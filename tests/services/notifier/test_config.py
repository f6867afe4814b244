"""The alerts file: read whole or refused naming the key, before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.notifier import config
from shared.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]

GOOD = """
[sites]
cut_off_s = 120

[[pools."*".webhooks]]
url = "https://hooks.example.com/services/T0/B0/secret"
format = "slack"

[[pools.gpu.webhooks]]
url = "http://127.0.0.1:9095/hook"
format = "alertmanager"
kinds = ["failed", "guarded"]
name = "oncall"

[[pools.gpu.webhooks]]
url = "http://127.0.0.1:9096/all"
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "alerts.toml"
    path.write_text(text)
    return str(path)


def test_a_good_file_routes_each_pool_and_kind(tmp_path: Path) -> None:
    alerts = config.load(write(tmp_path, GOOD))
    assert alerts.cut_off_s == 120
    gpu_failed = alerts.receivers("gpu", "failed")
    assert [r.format for r in gpu_failed] == ["alertmanager", "json"]
    assert [r.label for r in alerts.receivers("gpu", "stalled")] != ["oncall"]
    assert [r.id for r in alerts.receivers("gpu", "stalled")] == [gpu_failed[1].id]
    # A pool with no entry of its own gets "*"'s receivers, and so do sites.
    other = alerts.receivers("cpu", "stalled")
    assert [r.format for r in other] == ["slack"]
    assert alerts.site_receivers() == other
    assert alerts.count == 3
    # A receiver is named in logs and letters by its name, else host and digest: never by
    # its URL, whose path may be its secret.
    assert gpu_failed[0].label == "oncall"
    assert other[0].label.startswith("hooks.example.com#") and "secret" not in other[0].label
    # Its id keys its marks: stable across loads of the same file.
    assert config.load(write(tmp_path, GOOD)) == alerts


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('[[pools.gpu.webhooks]]\nurl = "http://h/x"\nformat = "xml"\n',
         "pools.gpu.webhooks[0].format"),
        ('[[pools.gpu.webhooks]]\nurl = "ftp://h/x"\n', "pools.gpu.webhooks[0].url"),
        ('[[pools.gpu.webhooks]]\nurl = "http:///x"\n', "pools.gpu.webhooks[0].url"),
        ('[[pools.gpu.webhooks]]\nurl = "http://h/x"\nkinds = ["lunch"]\n',
         "pools.gpu.webhooks[0].kinds[0]"),
        ('[[pools.gpu.webhooks]]\nurll = "http://h/x"\n', "pools.gpu.webhooks[0]"),
        ('[[pools."a b".webhooks]]\nurl = "http://h/x"\n', "pools.a b"),
        ('[sites]\ncut_off_s = 0\n[[pools."*".webhooks]]\nurl = "http://h/x"\n',
         "sites.cut_off_s"),
        ('[sites]\ncut_off = 10\n[[pools."*".webhooks]]\nurl = "http://h/x"\n', "sites"),
        ('[[pools.gpu.webhooks]]\nurl = "http://h/x"\n[[pools.gpu.webhooks]]\nurl = "http://h/x"\n',
         "pools.gpu.webhooks[1]"),
        ("[pools.gpu]\n", "pools"),
        ("[[pools.gpu.webhooks]]\nurl = \n", "not TOML"),
    ],
)  # fmt: skip
def test_a_bad_file_is_refused_naming_the_key(tmp_path: Path, text: str, names: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config.load(write(tmp_path, text))
    assert names in str(refused.value), str(refused.value)
    assert str(tmp_path) in str(refused.value)


def test_no_file_or_a_missing_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="BATON_ALERTS is not set"):
        config.load("")
    with pytest.raises(ConfigError, match="cannot read it"):
        config.load(str(tmp_path / "nowhere.toml"))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.mark.parametrize(
    "argv", [["-m", "services.notifier"], ["-m", "baton", "service", "notifier"]]
)
def test_the_notifier_refuses_a_bad_file_before_it_connects(
    tmp_path: Path, argv: list[str]
) -> None:
    """Pointed at a NATS server that is not there, it still says what is wrong with its
    file at once: nothing is started before the file is read."""
    bad = write(tmp_path, '[[pools.gpu.webhooks]]\nurl = "http://h/x"\nformat = "xml"\n')
    env = {**_env(), "BATON_ALERTS": bad, "NATS_URL": "nats://127.0.0.1:1"}
    done = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 2, done.stderr
    assert "pools.gpu.webhooks[0].format" in done.stderr, done.stderr


def test_baton_up_refuses_a_bad_alerts_file_with_nothing_started(tmp_path: Path) -> None:
    bad = write(tmp_path, '[[pools.gpu.webhooks]]\nurl = "ftp://h/x"\n')
    data = tmp_path / "data"
    done = subprocess.run(
        [sys.executable, "-m", "baton", "up", "--data-dir", str(data), "--port", "0",
         "--alerts", bad],
        env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--alerts" in done.stderr and "pools.gpu.webhooks[0].url" in done.stderr, done.stderr
    assert not data.exists(), "the stack started something"


def test_check_says_a_good_file_is_good(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.notifier", "--check", write(tmp_path, GOOD)],
        env=_env(), capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0 and "3 receiver(s)" in done.stdout, done.stderr
