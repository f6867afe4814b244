"""The durable consumers, one definition each: whose, of what, with which acks and
redeliveries. `shared.bus.streams.ensure_consumer` applies them."""

from __future__ import annotations

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
)

from shared.bus import names


def dispatcher_consumer(site: str = "") -> ConsumerConfig:
    """The dispatcher's: the hub's submissions, or at `site` the jobs submitted there
    (`services/dispatcher/site.py`)."""
    return ConsumerConfig(
        durable_name=names.DISPATCHER_CONSUMER,
        filter_subject=names.site_root(site, "submit") if site else names.SUBMIT_ALL,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=30.0,
        max_deliver=10,
    )


def checkpointer_consumer(site: str = "") -> ConsumerConfig:
    # Commits are never dropped for lack of tries: a store that is down for an hour must
    # still get every commit once it is back. Poison commits are terminated explicitly.
    return ConsumerConfig(
        durable_name=names.CHECKPOINTER_CONSUMER,
        filter_subject=names.at_site(names.CKPT_ALL, site),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=60.0,
        max_deliver=-1,
    )


def trainer_consumer(
    pool: str, ack_wait_s: float, max_deliver: int, site: str = ""
) -> ConsumerConfig:
    """A trainer's consumer of its pool's work queue: the hub's (tasks and calls for ranks),
    or with `site` that site's own queue of the runs granted to it, in its domain."""
    # Failures of user code are counted in the run record (max_retries), and kills, cuts
    # and preemptions must not use up a run's tries; so `max_deliver` is high and only
    # catches a task that keeps taking trainers down with it (the reaper dead-letters it).
    # At the hub, tasks and calls for ranks share one consumer: a trainer holds one thing
    # at a time, and an idle one takes whichever comes first.
    queue = (
        [names.site_tasks_of_pool(site, pool), names.site_calls_of_pool(site, pool)]
        if site
        else [names.tasks_of_pool(pool), names.calls_of_pool(pool)]
    )
    return ConsumerConfig(
        durable_name=names.trainer_consumer(pool),
        filter_subjects=queue,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
    )


def reconciler_consumer() -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=names.RECONCILER_CONSUMER,
        filter_subject=names.REPORTS_ALL,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=30.0,
        max_deliver=-1,
    )


def cancel_consumer() -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=names.CANCEL_CONSUMER,
        filter_subjects=[names.CANCEL_ALL, names.STEER_ALL],
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=30.0,
        max_deliver=10,
    )


def reaper_consumer() -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=names.REAPER_CONSUMER,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=30.0,
        max_deliver=-1,
    )


NOTIFIER_MAX_DELIVER = 10_000
"""Tries at one event's notifications: with the notifier's back-off capped at 5 minutes,
more than the events stream's 30 days, so an event is retried until it ages out."""


def notifier_consumer() -> ConsumerConfig:
    # New events only: a notifier started for the first time does not page anyone about the
    # last 30 days. A receiver that is down keeps the event here (nak with a delay).
    return ConsumerConfig(
        durable_name=names.NOTIFIER_CONSUMER,
        filter_subjects=names.notified_events(),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.NEW,
        ack_wait=60.0,
        max_deliver=NOTIFIER_MAX_DELIVER,
    )
