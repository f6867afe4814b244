"""Settings from the environment: defaults, validation, the entry-point allow-list."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shared import config
from shared.errors import ConfigError


def test_defaults_and_derived_values() -> None:
    s = config.load({})
    assert s.lease_ttl_s == 10 and s.ack_wait_s == 15 and s.sweep_s == 5
    assert s.allows("anything.at:all")


def test_allow_list_matches_whole_module_prefixes() -> None:
    s = config.load({"BATON_ENTRY_ALLOW": "examples, mylab.models"})
    assert s.allows("examples.regression:train")
    assert s.allows("examples:train")
    assert s.allows("mylab.models.big:train")
    assert not s.allows("examplesx.evil:train")
    assert not s.allows("mylab.other:train")
    assert not s.allows("os:system")


@pytest.mark.parametrize(
    ("name", "value"),
    [("BATON_LEASE_TTL", "soon"), ("BATON_LEASE_TTL", "1"), ("BATON_GRACE", "-3"),
     ("BATON_MAX_DELIVER", "0"), ("BATON_SITE", "Lab 1"), ("BATON_SITE", "hub"),
     ("BATON_SITE", "a.b"), ("BATON_SITE", "x" * 33)],
)  # fmt: skip
def test_bad_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        config.load({name: value})


def test_a_site_writes_into_the_hubs_domain() -> None:
    assert config.load({}).hub_api is None
    s = config.load({"BATON_SITE": "lab-1", "BATON_HUB_DOMAIN": "core"})
    assert s.site == "lab-1" and s.hub_api == "$JS.core.API"


def test_the_settings_reference_lists_every_variable_settings_reads() -> None:
    read: list[str] = []

    class Recording(dict[str, str]):
        def get(self, key: str, default: object = None) -> Any:
            read.append(key)
            return super().get(key, default)

    s = config.load(Recording())
    assert s.log_level == "INFO" and config.load({"BATON_LOG_LEVEL": "DEBUG"}).log_level == "DEBUG"
    table = (Path(__file__).parents[2] / "docs" / "settings.md").read_text()
    assert read and [v for v in read if f"`{v}`" not in table] == []


def test_grants_ahead_is_per_site_with_a_default() -> None:
    load = config.load
    s = load({"BATON_DELEGATE_AHEAD": "lab1=3, lab2=0, *=2"})
    assert (s.ahead("lab1"), s.ahead("lab2"), s.ahead("lab9")) == (3, 0, 2)
    assert load({}).ahead("lab1") == 1 and load({"BATON_DELEGATE_AHEAD": "0"}).ahead("x") == 0
    for bad in ("x", "lab1=-1", "Bad Site=1", "lab1=9999"):
        with pytest.raises(ConfigError, match=r"BATON_DELEGATE_AHEAD|BATON_SITE"):
            config.load({"BATON_DELEGATE_AHEAD": bad})


def test_grants_by_time_are_per_site_then_per_pool_then_a_default() -> None:
    load = config.load
    assert load({}).horizon("lab1") is None and load({}).horizon("lab1", 600.0) == 600.0
    s = load({"BATON_GRANT_AHEAD_S": "lab1=3600, lab2=0, *=900"})
    assert (s.horizon("lab1"), s.horizon("lab2"), s.horizon("lab9")) == (3600.0, None, 900.0)
    # A pool's own horizon stands for the sites the variable does not name.
    assert (s.horizon("lab1", 60.0), s.horizon("lab2", 60.0), s.horizon("lab9", 60.0)) == (
        3600.0, None, 60.0,
    )  # fmt: skip
    assert load({"BATON_GRANT_AHEAD_S": "1800"}).horizon("x") == 1800.0
    for bad in ("x", "lab1=-1", "Bad Site=1", "lab1=nan", f"{31 * 86400}"):
        with pytest.raises(ConfigError, match=r"BATON_GRANT_AHEAD_S|BATON_SITE"):
            config.load({"BATON_GRANT_AHEAD_S": bad})
