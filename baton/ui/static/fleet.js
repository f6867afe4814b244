// Baton's dashboard: the fleet — workers, sites, streams, dead letters (see app.js).
"use strict";

// -- the fleet -----------------------------------------------------------------------------

// Each trainer as its heartbeat says, with whether it is drained; Drain or Undrain on each.
// A row is drawn again at every heartbeat: what was asked of a trainer (`ordered`, until its
// heartbeat says so), what is in flight and what was said about it outlive the row.
function viewWorkers() {
  const body = h("tbody", { id: "workers-body" });
  main.replaceChildren(h("h1", {}, "Workers"),
    h("table", {}, h("thead", {}, h("tr", {}, ["worker", "pool", "site", "host", "device", "GPU", "run", "step", "heartbeat", "drained", ""].map((x) => h("th", {}, x)))), body));
  const last = new Map(); // worker -> its newest heartbeat
  const inFlight = new Set();
  const ordered = new Map(); // worker -> drained (true) or not, as asked from this page
  const said = new Map(); // worker -> [text, failed]
  const redraw = (worker) => {
    const old = body.querySelector(`tr[data-worker="${CSS.escape(worker)}"]`);
    if (old && last.has(worker)) old.replaceWith(row(last.get(worker)));
  };
  const drain = async (worker, drained) => {
    const what = drained ? "drain" : "undrain";
    const status = h("span");
    inFlight.add(worker);
    said.delete(worker);
    redraw(worker);
    const done = await act(`${what}ing trainer ${worker}`, `/api/workers/${encodeURIComponent(worker)}/${what}`, { status });
    inFlight.delete(worker);
    if (done) ordered.set(worker, drained); else said.set(worker, [status.textContent, true]);
    redraw(worker);
  };
  const row = (w) => {
    last.set(w.worker, w);
    if (ordered.get(w.worker) === Boolean(w.drained)) ordered.delete(w.worker); // its heartbeat says so
    const asked = ordered.get(w.worker);
    const [text, failed] = said.get(w.worker) ?? (asked === undefined ? ["", false] : [asked ? "drain ordered" : "undrain ordered", false]);
    const drained = asked ?? Boolean(w.drained);
    const button = h("button", { class: drained ? "undrain" : "drain", disabled: inFlight.has(w.worker),
      onclick: () => drain(w.worker, !drained) }, drained ? "Undrain" : "Drain");
    return h("tr", { dataset: { worker: w.worker, at: w.at, stamped: w.stamped_at, now: w.now, received: w.received } },
      h("td", {}, w.worker), h("td", {}, w.pool), h("td", {}, w.site || "hub"), h("td", {}, w.host),
      h("td", {}, w.device), h("td", {}, w.gpu_name || "—"),
      h("td", {}, w.run_id ? h("a", { href: `#/run/${encodeURIComponent(w.run_id)}` }, w.run_id) : "idle"),
      h("td", { class: "num" }, w.step ?? "—"), h("td", { class: "num beat" }, `${age(hubAge(w))} ago`),
      h("td", { class: "drained-cell" }, w.drained ? "drained" : ""),
      h("td", {}, button, " ", h("span", { class: failed ? "status error" : "status" }, text)));
  };
  getJSON("/api/workers").then((ws) => body.replaceChildren(...ws.map((w) => row(arrived(w)))),
    (e) => notice(`loading the workers failed: ${e.message}`));
  const tick = setInterval(() => { // ages move with this page's monotonic clock, from the hub's
    for (const tr of body.querySelectorAll("tr[data-stamped]")) {
      const { stamped, now, received } = tr.dataset;
      tr.querySelector(".beat").textContent = `${age(hubAge({ now: +now, received: +received }, +stamped))} ago`;
    }
  }, 1000);
  const stop = listen((kind, w) => {
    if (kind !== "worker") return;
    const old = body.querySelector(`tr[data-worker="${CSS.escape(w.worker)}"]`);
    if (old) old.replaceWith(row(w)); else body.append(row(w));
  });
  return () => { clearInterval(tick); stop(); };
}

// A fleet page kept live: the server sends its view at once and again whenever it changed
// (`/api/<page>/live`, read every few seconds: no refresh button, no reload); a read that
// failed is said on the page until one succeeds.
function following(url, draw, failed) {
  const source = new EventSource(url);
  source.addEventListener("view", (e) => { failed.hidden = true; draw(JSON.parse(e.data)); });
  source.addEventListener("failed", (e) => {
    failed.textContent = `reading this page failed: ${JSON.parse(e.data).error} (tried again every few seconds)`;
    failed.hidden = false;
  });
  return () => source.close();
}

function viewSites() {
  const box = h("div", { id: "sites" });
  const failed = h("p", { class: "error", hidden: true });
  main.replaceChildren(h("h1", {}, "Sites"), failed, box);
  return following("/api/sites/live", ({ sites }) => {
    box.replaceChildren(sites.length ? table(["site", "link", "last greeting", "backlog", "links", "outbox last seq"],
      sites.map((s) => h("tr", { dataset: { site: s.site } }, h("td", {}, s.site), h("td", { class: `link-cell ${s.link}` }, s.link),
        h("td", { class: "num" }, `${dur(s.last_seen_s)} ago`), h("td", { class: "num" }, s.backlog),
        h("td", { class: "num" }, s.links), h("td", { class: "num" }, s.outbox_last_seq))))
      : h("p", { class: "empty" }, "no site has greeted this hub yet"));
  }, failed);
}

function viewStreams() {
  const box = h("div", { id: "streams" });
  const failed = h("p", { class: "error", hidden: true });
  main.replaceChildren(h("h1", {}, "Streams and consumers"), failed, box);
  return following("/api/streams/live", ({ streams }) => {
    const rows = [];
    for (const s of streams) {
      rows.push(h("tr", { dataset: { stream: s.name } }, h("td", {}, h("b", {}, s.name)), h("td", { class: "num messages" }, s.messages),
        h("td", { class: "num" }, `${(s.bytes / 1e6).toFixed(2)} MB`), h("td", {}, ""), h("td", {}, ""), h("td", {}, "")));
      for (const c of s.consumers || []) {
        rows.push(h("tr", { dataset: { consumer: c.name } }, h("td", {}, `  ↳ ${c.name}`), h("td", {}, ""), h("td", {}, ""),
          h("td", { class: "num" }, c.pending), h("td", { class: "num" }, c.ack_pending), h("td", { class: "num" }, c.redelivered)));
      }
    }
    box.replaceChildren(table(["stream / consumer", "messages", "size", "pending", "ack pending", "redelivered"], rows));
  }, failed);
}

// Dead letters, a page at a time, oldest first (in the order they were dead-lettered); the
// server cuts the pages (`after`: the last letter of the page before). The page shown is
// followed live. A letter never changes, so a row stays as it is while its letter is on the
// page; one this page replayed stays too, with what came of it, until the page is left.
function viewDlq() {
  const cursors = []; // [after, offset] of the pages before this one
  let after = 0;
  let offset = 0; // letters on the pages before this one
  let next = null;
  let onPage = 0; // letters the server put on this page, last time
  let stop = null;
  const letters = new Map(); // seq -> the letter a row shows
  const acted = new Set(); // seqs of letters replayed from this page
  const body = h("tbody", { id: "dlq-body" });
  const count = h("span", { id: "dlq-count" });
  const failed = h("p", { class: "error", hidden: true });
  const empty = h("p", { class: "empty", hidden: true }, "no dead letters");
  const go = (to, at) => { after = to; offset = at; letters.clear(); acted.clear(); body.replaceChildren(); follow(); };
  const older = h("button", { id: "dlq-next", disabled: true, onclick: () => { cursors.push([after, offset]); go(next, offset + onPage); } }, "Next →");
  const newer = h("button", { id: "dlq-previous", disabled: true, onclick: () => go(...(cursors.pop() ?? [0, 0])) }, "← Previous");
  main.replaceChildren(h("h1", {}, "Dead letters"),
    h("p", { class: "hint" }, "Oldest first, in the order they were dead-lettered."), failed, empty,
    h("table", { id: "dlq" }, h("thead", {}, h("tr", {}, ["#", "when", "from", "subject", "reason", "payload", ""].map((x) => h("th", {}, x)))), body),
    h("div", { class: "pager" }, newer, older, count));

  function row(l) {
    const status = h("span", { class: "status" });
    const tr = h("tr", { dataset: { seq: l.seq } });
    const replay = h("button", { class: "replay", onclick: async () => {
      const done = await act(`replaying dead letter #${l.seq}`, `/api/dlq/${l.seq}/replay`, { button: replay, status });
      if (done) { status.textContent = `replayed to ${done.subject}`; status.classList.remove("error"); acted.add(l.seq); tr.classList.add("done"); }
    } }, "replay");
    tr.append(h("td", { class: "num" }, l.seq),
      h("td", { class: "ago", title: `written ${new Date(l.at * 1000).toISOString()} (its writer's clock)` }, `${age(hubAge(l))} ago`),
      h("td", {}, l.source), h("td", {}, l.subject), h("td", { style: "white-space:normal" }, l.reason),
      h("td", {}, h("pre", { class: "preview" }, l.preview)), h("td", {}, replay, " ", status));
    return tr;
  }

  function draw(page) {
    const rows = new Map([...body.querySelectorAll("tr[data-seq]")].map((tr) => [Number(tr.dataset.seq), tr]));
    const shown = new Set(page.letters.map((l) => l.seq));
    for (const seq of [...letters.keys()]) if (!shown.has(seq) && !acted.has(seq)) letters.delete(seq);
    for (const l of page.letters) if (!letters.has(l.seq)) letters.set(l.seq, arrived(l, page.now));
    const seqs = [...letters.keys()].sort((a, b) => a - b);
    body.replaceChildren(...seqs.map((seq) => rows.get(seq) ?? row(letters.get(seq))));
    next = page.next;
    older.disabled = !next;
    newer.disabled = !cursors.length;
    empty.hidden = letters.size > 0;
    const n = page.letters.length;
    onPage = n;
    count.textContent = `${n ? `${offset + 1}–${offset + n} of ` : ""}${page.total} dead letters in all`;
  }

  function follow() {
    stop?.();
    stop = following(`/api/dlq/live?after=${after}`, draw, failed);
  }

  follow();
  const stopTicking = ticking(() => {
    for (const tr of body.querySelectorAll("tr[data-seq]")) {
      const l = letters.get(Number(tr.dataset.seq));
      if (l) tr.querySelector(".ago").textContent = `${age(hubAge(l))} ago`;
    }
  });
  return () => { stop?.(); stopTicking(); };
}
