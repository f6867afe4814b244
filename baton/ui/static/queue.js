// Baton's dashboard: the Queue page (see app.js) — a pool's queue as the scheduler answers
// for it (`baton queue`): the runs waiting in the order its next pass takes them, each with
// why it waits; the runs training, and which make room for another; the owners' shares, with
// their credit balances when the ledger has any. Followed live (`/api/queue/live?pool=P`, read
// every few seconds by the server and sent when it changed), as the fleet's pages are.
"use strict";

function waitedFor(s) {
  return age(Math.max(0, s));
}

function ownerName(owner) {
  return owner || "operator";
}

function viewQueue(pool) {
  pool = pool || "default";
  const picker = h("select", { id: "queue-pool", name: "pool",
    onchange: (e) => { location.hash = `#/queue/${encodeURIComponent(e.target.value)}`; } });
  const head = h("p", { id: "queue-head", class: "hint" });
  const failed = h("p", { class: "error", hidden: true });
  const waiting = h("div", { id: "queue-waiting" });
  const training = h("div", { id: "queue-training" });
  const owners = h("div", { id: "queue-owners" });
  main.replaceChildren(h("h1", {}, "Queue"), h("div", { class: "filters" }, picker), head, failed,
    h("h2", {}, "Waiting"), waiting, h("h2", {}, "Training"), training, h("h2", {}, "Owners"), owners);

  function pools(names) {
    const shown = [...picker.options].map((o) => o.value);
    if (shown.join() === names.join()) return;
    picker.replaceChildren(...names.map((n) => h("option", { value: n, selected: n === pool }, n)));
  }

  function draw({ pools: names, view, credits }) {
    pools(names);
    const count = view.waiting.length + view.more;
    head.textContent = `pool ${view.pool}: ${view.trainers} live trainer${view.trainers === 1 ? "" : "s"}, ` +
      `${view.free} free; ${count} waiting, ${view.training.length} training`;
    waiting.replaceChildren(view.waiting.length
      ? table(["#", "run", "owner", "priority", "state", "ranks", "waited", "preempted", "why it waits"],
        view.waiting.map((w) => h("tr", { dataset: { run: w.run_id, position: w.position } },
          h("td", { class: "num" }, w.position + 1),
          h("td", {}, h("a", { href: `#/run/${encodeURIComponent(w.run_id)}` }, w.run_id)),
          h("td", {}, ownerName(w.owner)), h("td", { class: "num" }, w.priority), h("td", {}, w.state),
          h("td", { class: "num" }, w.ranks), h("td", { class: "num" }, waitedFor(w.queued_s)),
          h("td", { class: "num" }, w.preemptions), h("td", { class: "why" }, w.waiting))),
        { id: "queue-waiting-table" })
      : h("p", { class: "empty" }, "nothing waits"),
      ...(view.more ? [h("p", { class: "hint" }, `… and ${view.more} more waiting`)] : []));
    training.replaceChildren(view.training.length
      ? table(["run", "owner", "priority", "ranks", "where", "preempted", ""],
        view.training.map((t) => h("tr", { dataset: { run: t.run_id } },
          h("td", {}, h("a", { href: `#/run/${encodeURIComponent(t.run_id)}` }, t.run_id)),
          h("td", {}, ownerName(t.owner)), h("td", { class: "num" }, t.priority), h("td", { class: "num" }, t.ranks),
          h("td", {}, t.worker ? (t.site ? `${t.worker} (site ${t.site})` : t.worker) : (t.site ? `site ${t.site}` : "—")),
          h("td", { class: "num" }, t.preemptions),
          h("td", { class: "leaving" }, t.leaving ? `leaving: ${t.leaving}` : ""))))
      : h("p", { class: "empty" }, "nothing trains"));
    const priced = Object.keys(credits).length > 0;
    const money = (o) => {
      const c = credits[o.owner];
      return c ? `${c.balance}${c.held ? ` (${c.held} held)` : ""}${c.overdrawn ? " overdrawn" : ""}` : "—";
    };
    owners.replaceChildren(view.owners.length
      ? table(["owner", "weight", "team", "share", "entitled", "holding", "usage (trainer-h)", "quota", "max priority", "preempted",
        ...(priced ? ["credits"] : [])],
      view.owners.map((o) => h("tr", { dataset: { owner: ownerName(o.owner) } },
        h("td", {}, ownerName(o.owner)), h("td", { class: "num" }, o.weight),
        h("td", {}, o.team.startsWith("@") ? "—" : o.team), h("td", { class: "num" }, `${(100 * o.share).toFixed(1)}%`),
        h("td", { class: "num" }, o.entitled.toFixed(2)), h("td", { class: "num" }, o.holding),
        h("td", { class: "num" }, o.usage_s ? (o.usage_s / 3600).toPrecision(3) : "0"),
        h("td", { class: "num" }, o.quota ?? "—"), h("td", { class: "num" }, o.max_priority ?? "any"),
        h("td", { class: "num" }, o.preempted),
        priced ? h("td", { class: credits[o.owner]?.overdrawn ? "num credits overdrawn" : "num credits" }, money(o)) : null)))
      : h("p", { class: "empty" }, "no owner is active in this pool"));
  }

  return following(`/api/queue/live?pool=${encodeURIComponent(pool)}`, draw, failed);
}
