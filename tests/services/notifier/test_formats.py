"""What each format sends, built from real events and a real site episode."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from services.notifier.alert import Alert, of_event, of_site, payload_of
from services.notifier.formats import body, rfc3339
from shared.contracts import JobSpec, RunRecord, convert, encode, spec_hash
from shared.contracts.alerts import SiteEpisode
from shared.contracts.events import Failed, RunWarning
from shared.errors import ContractError

AT = 1_767_225_600.25  # 2026-01-01T00:00:00.250Z
SPEC = convert(
    {"name": "bert <big> & co", "entry_point": "m:f", "total_steps": 5, "pool": "gpu"}, JobSpec
)
RECORD = RunRecord(
    run_id="alice.rabc", spec=SPEC, spec_hash=spec_hash(SPEC), created_at=0, updated_at=0
)
TRACE = "Traceback (most recent call last):\n" + "  frame\n" * 500 + "RuntimeError: boom at step 3"


def failed() -> Alert:
    event = Failed(run_id="alice.rabc", reason="user code failed", detail=TRACE, at=AT - 1)
    payload = payload_of(encode(event))
    alert = of_event("baton.events.alice.rabc.failed", payload, 42, AT, RECORD)
    assert alert is not None
    return alert


def test_json_is_the_alert_and_its_event() -> None:
    sent = json.loads(body(failed(), "json"))
    assert set(sent) == {
        "id", "kind", "status", "run_id", "pool", "site", "summary", "detail", "event", "at",
    }  # fmt: skip
    assert sent["id"] == "e.42" and sent["kind"] == "failed" and sent["status"] == "firing"
    assert (sent["run_id"], sent["pool"]) == ("alice.rabc", "gpu")
    assert "bert <big> & co" in sent["summary"] and "user code failed" in sent["summary"]
    # A long traceback is kept by its end, where the exception is; the event has it whole.
    assert sent["detail"].endswith("RuntimeError: boom at step 3") and len(sent["detail"]) <= 2000
    assert sent["event"]["detail"] == TRACE and sent["event"]["type"] == "failed"
    assert sent["at"] == "2026-01-01T00:00:00.250Z"


def test_alertmanager_is_what_its_webhook_receivers_take() -> None:
    sent = json.loads(body(failed(), "alertmanager"))
    assert sent["version"] == "4" and sent["status"] == "firing"
    for key in ("groupKey", "truncatedAlerts", "receiver", "groupLabels", "commonLabels",
                "commonAnnotations", "externalURL"):  # fmt: skip
        assert key in sent, key
    (one,) = sent["alerts"]
    assert one["status"] == "firing"
    assert one["labels"] == {
        "alertname": "BatonRunFailed", "severity": "critical", "kind": "failed",
        "run_id": "alice.rabc", "pool": "gpu", "source": "baton",
    }  # fmt: skip
    assert one["annotations"]["summary"].startswith("Run bert")
    assert one["startsAt"] == "2026-01-01T00:00:00.250Z"
    assert one["endsAt"] == "0001-01-01T00:00:00Z"
    assert len(one["fingerprint"]) == 16 and int(one["fingerprint"], 16) >= 0
    assert sent["commonLabels"] == one["labels"]
    assert sent["groupLabels"] == {"alertname": "BatonRunFailed"}


def test_slack_is_escaped_text() -> None:
    sent = json.loads(body(failed(), "slack"))
    assert list(sent) == ["text"]
    assert "bert &lt;big&gt; &amp; co" in sent["text"] and "<big>" not in sent["text"]
    assert sent["text"].startswith(":x: *Run ")


def test_a_site_cut_off_fires_then_resolves_as_one_alert() -> None:
    episode = SiteEpisode(
        site="lab1", episode=3, status="firing", last_heard=AT, noticed_at=AT + 400,
        cut_off_s=300,
    )  # fmt: skip
    firing = of_site(episode, "firing")
    back = msgspec.structs.replace(episode, status="resolved", back_at=AT + 500)
    resolved = of_site(back, "resolved")
    assert (firing.key, resolved.key) == ("s.lab1.3.firing", "s.lab1.3.resolved")
    assert firing.fingerprint == resolved.fingerprint
    am = json.loads(body(resolved, "alertmanager"))
    assert am["status"] == "resolved" and am["alerts"][0]["status"] == "resolved"
    assert am["alerts"][0]["labels"]["site"] == "lab1"
    assert am["alerts"][0]["labels"]["alertname"] == "BatonSiteCutOff"
    assert am["alerts"][0]["startsAt"] == rfc3339(AT)
    assert am["alerts"][0]["endsAt"] == rfc3339(AT + 500)
    assert "400s" in firing.summary and "500s" in resolved.summary
    assert json.loads(body(resolved, "json"))["status"] == "resolved"
    assert json.loads(body(resolved, "slack"))["text"].startswith(":white_check_mark:")


def test_which_events_are_told() -> None:
    def alert(subject: str, event: object) -> Alert | None:
        return of_event(subject, payload_of(encode(event)), 1, time.time(), None)

    stalled = RunWarning(run_id="r1", kind="stalled", detail="no step progress for 9s")
    assert alert("baton.events.r1.warning", stalled) is not None
    soft = RunWarning(run_id="r1", kind="soft_timeout", detail="past it")
    assert alert("baton.events.r1.warning", soft) is None
    budget = RunWarning(run_id="r1", kind="budget_75", detail="spent 0.75 of 1")
    told = alert("baton.events.r1.warning", budget)
    assert told is not None and "75%" in told.summary
    # Events added beside these are read as JSON, for the fields an alert shows.
    guarded = {"type": "guarded", "run_id": "r1", "step": 7, "metric": "loss",
               "value": 1e9, "rule": "loss > 100", "action": "rollback", "at": AT}  # fmt: skip
    told = alert("baton.events.r1.guarded", guarded)
    assert told is not None and "loss = 1000000000.0" in told.detail
    paused = {"type": "paused", "run_id": "r1", "reason": "loss spiked", "at": AT}
    told = alert("baton.events.r1.paused", paused)
    assert told is not None and told.detail == "loss spiked"
    # A payload naming another run than its subject is not believed.
    with pytest.raises(ContractError):
        alert("baton.events.r2.failed", Failed(run_id="r1", reason="x"))
    with pytest.raises(ContractError):
        payload_of(b"[1, 2]")
