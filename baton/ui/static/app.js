// Baton's dashboard: plain JavaScript, no build step. The server computes everything a page
// shows (a run's timeline comes from the same code as `baton report`); this file only draws
// it and applies what the server pushes over Server-Sent Events.
"use strict";

const TOKEN = document.querySelector('meta[name="baton-token"]').content;
const main = document.getElementById("main");
const PALETTE = ["#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#393b79"];
const MARK_COLOURS = {
  attempt_failed: "#d62728", fenced: "#d62728", failed: "#d62728", handed_over: "#e8710a",
  preempted: "#e8710a", redispatched: "#555555", restored: "#2ca02c", completed: "#2ca02c",
  warning: "#b8860b", cancelled: "#555555", commit_refused: "#d62728", diverged: "#b8860b",
};
const PAGE = 25;

// -- small helpers -----------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// Every age is read off the hub's clock, never this browser's nor the writer's: with each
// item the server sends the hub server's stamp of it (`stamped_at`) and the hub's time when
// it sent it (`now`); the page adds only how long ago it got them (`received`), on its own
// monotonic clock.
function arrived(item, now = item.now) {
  item.now = now;
  item.received = performance.now();
  return item;
}

function hubAge(item, stamped = item.stamped_at) {
  if (stamped === null || stamped === undefined || item.now === undefined) return null;
  return Math.max(0, item.now + (performance.now() - item.received) / 1000 - stamped);
}

function age(s) {
  if (s === null) return "—";
  if (s < 60) return `${s.toFixed(0)}s`;
  if (s < 3600) return `${(s / 60).toFixed(0)}m`;
  if (s < 86400) return `${(s / 3600).toFixed(1)}h`;
  return `${(s / 86400).toFixed(1)}d`;
}

function dur(s) {
  if (s < 10) return `${s.toFixed(2)}s`;
  if (s < 120) return `${s.toFixed(1)}s`;
  return `${(s / 60).toFixed(1)}min`;
}

async function getJSON(url, options = {}) {
  const r = await fetch(url, options);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function post(url) {
  return getJSON(url, { method: "POST", headers: { "X-Baton-Token": TOKEN } });
}

function stateBadge(state) {
  return h("span", { class: `state ${state}` }, state);
}

function progress(step, total) {
  const pct = total ? Math.min(100, (100 * step) / total) : 0;
  const bar = h("span", { class: "bar" }, h("span", { style: `width:${pct}%` }));
  return h("span", {}, bar, `${step}/${total}`);
}

function table(headers, rows, attrs = {}) {
  return h("table", attrs, h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows));
}

// -- the live stream: run summaries and heartbeats ----------------------------------------

const listeners = new Set();
const link = document.getElementById("link");
const live = new EventSource("/api/live"); // reconnects by itself, naming the last id it got
live.onopen = () => { link.textContent = "live"; link.className = "link up"; };
live.onerror = () => { link.textContent = "reconnecting…"; link.className = "link down"; };
for (const kind of ["run", "worker"]) {
  live.addEventListener(kind, (e) => {
    const data = arrived(JSON.parse(e.data));
    for (const f of listeners) f(kind, data);
  });
}

function listen(f) {
  listeners.add(f);
  return () => listeners.delete(f);
}

// -- runs ----------------------------------------------------------------------------------

function viewRuns() {
  const filters = { state: "", pool: "", owner: "", site: "" };
  const cursors = []; // the cursors of the pages before this one
  let after = null;
  let next = null;
  const body = h("tbody", { id: "runs-body" });
  const count = h("span", {});
  const older = h("button", { id: "older", onclick: () => { cursors.push(after); after = next; load(); } }, "Older →");
  const newer = h("button", { id: "newer", onclick: () => { after = cursors.pop() ?? null; load(); } }, "← Newer");
  const field = (name, placeholder) => h("input", {
    placeholder, name, onchange: (e) => { filters[name] = e.target.value.trim(); after = null; cursors.length = 0; load(); },
  });
  const states = h("select", { name: "state", onchange: (e) => { filters.state = e.target.value; after = null; cursors.length = 0; load(); } },
    ["", "QUEUED", "RUNNING", "COMPLETED", "FAILED", "CANCELLED"].map((s) => h("option", { value: s }, s || "any state")));
  main.replaceChildren(
    h("h1", {}, "Runs"),
    h("div", { class: "filters" }, states, field("pool", "pool"), field("owner", "owner"), field("site", "site")),
    h("table", { id: "runs" },
      h("thead", {}, h("tr", {}, ["run", "name", "state", "step", "attempts", "worker", "goodput", "pool", "changed"].map((x) => h("th", {}, x)))),
      body),
    h("div", { class: "pager" }, newer, older, count),
  );

  function row(s) {
    return h("tr", { dataset: { run: s.run_id, created: s.created_at } },
      h("td", {}, h("a", { href: `#/run/${encodeURIComponent(s.run_id)}` }, s.run_id)),
      h("td", {}, s.name),
      h("td", { class: "state-cell" }, stateBadge(s.state)),
      h("td", { class: "step-cell" }, progress(s.step, s.total_steps)),
      h("td", { class: "num" }, s.attempts),
      h("td", {}, s.worker ?? "—"),
      h("td", { class: "num goodput-cell" }, "—"),
      h("td", {}, s.pool),
      h("td", { class: "num changed", title: `created ${new Date(s.created_at * 1000).toISOString()} (the dispatcher's clock)` },
        age(hubAge(s))));
  }

  function admits(s) {
    return (!filters.state || s.state === filters.state) && (!filters.pool || s.pool === filters.pool)
      && (!filters.owner || s.owner === filters.owner) && (!filters.site || s.site === filters.site);
  }

  async function load() {
    const q = new URLSearchParams({ limit: PAGE, ...filters });
    if (after) q.set("after", after);
    const page = await getJSON(`/api/runs?${q}`);
    for (const s of page.runs) arrived(s, page.now);
    next = page.next;
    body.replaceChildren(...page.runs.map(row));
    if (!page.runs.length) body.append(h("tr", {}, h("td", { colspan: 9, class: "empty" }, "no runs")));
    older.disabled = !next;
    newer.disabled = !cursors.length && !after;
    count.textContent = `${page.total} runs in all`;
    fillGoodput(page.runs.filter((s) => ["COMPLETED", "FAILED", "CANCELLED"].includes(s.state)).map((s) => s.run_id));
  }

  async function fillGoodput(runIds) {
    if (!runIds.length) return;
    const found = await getJSON(`/api/goodput?runs=${runIds.map(encodeURIComponent).join(",")}`);
    for (const [runId, g] of Object.entries(found)) {
      const cell = body.querySelector(`tr[data-run="${CSS.escape(runId)}"] .goodput-cell`);
      if (cell && g) { cell.textContent = `${(100 * g.goodput).toFixed(1)}%`; cell.title = breakdown(g); }
    }
  }

  load();
  return listen((kind, s) => {
    if (kind !== "run") return;
    const old = body.querySelector(`tr[data-run="${CSS.escape(s.run_id)}"]`);
    const ended = ["COMPLETED", "FAILED", "CANCELLED"].includes(s.state);
    if (old) { old.replaceWith(row(s)); if (ended) fillGoodput([s.run_id]); return; }
    // A new run belongs at the top of the first page.
    if (after === null && admits(s)) {
      body.querySelector(".empty")?.closest("tr")?.remove();
      body.prepend(row(s));
      while (body.children.length > PAGE) body.lastElementChild.remove();
    }
  });
}

// -- one run -------------------------------------------------------------------------------

function viewRun(runId) {
  const facts = h("div", { class: "facts", id: "facts" });
  const chartBox = h("div", { id: "loss" });
  const legend = h("div", { class: "legend", id: "loss-legend" });
  const timeline = h("div", { id: "timeline" });
  const marks = h("div", { class: "marks card", id: "marks" });
  const ckpts = h("div", { id: "checkpoints" });
  const logs = h("pre", { class: "logs", id: "logs" });
  const spent = h("div", { class: "card", id: "goodput" });
  main.replaceChildren(
    h("h1", {}, h("a", { href: "#/runs" }, "Runs"), " / ", runId),
    facts,
    h("h2", {}, "Goodput"), spent,
    h("h2", {}, "Loss per step"), h("div", { class: "card" }, chartBox, legend),
    h("h2", {}, "Timeline"), h("div", { class: "card" }, timeline), marks,
    h("h2", {}, "Checkpoints"), ckpts,
    h("h2", {}, "Output"), logs,
  );
  let chart = null;
  let lastStep = -1;

  const views = new EventSource(`/api/runs/${encodeURIComponent(runId)}/live`);
  views.addEventListener("view", (e) => {
    const view = arrived(JSON.parse(e.data));
    drawFacts(facts, view);
    drawGoodput(spent, view.goodput);
    chart = drawLoss(chartBox, legend, view, chart);
    drawTimeline(timeline, view);
    drawMarks(marks, view);
    if (view.record.step !== lastStep) { lastStep = view.record.step; drawCheckpoints(ckpts, runId); }
  });
  views.onerror = () => { if (views.readyState === EventSource.CLOSED) facts.replaceChildren(h("p", { class: "error" }, `no run ${runId}`)); };

  const output = new EventSource(`/api/runs/${encodeURIComponent(runId)}/logs`);
  output.addEventListener("log", (e) => {
    const follow = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
    logs.textContent = (logs.textContent + JSON.parse(e.data)).slice(-200000);
    if (follow) logs.scrollTop = logs.scrollHeight;
  });
  return () => { views.close(); output.close(); chart?.destroy(); };
}

const GOODPUT_COLOURS = {
  productive: "#2ca02c", queued: "#9ca3af", startup: "#60a5fa", restore: "#a78bfa",
  checkpoint: "#fbbf24", wasted: "#ef4444", recovery: "#f97316", other: "#e5e7eb",
};

function breakdown(g) {
  return Object.keys(GOODPUT_COLOURS).map((c) => `${c} ${g[`${c}_s`].toFixed(1)}s`).join(" · ");
}

function drawGoodput(box, g) {
  if (!g) { box.replaceChildren(); return; }
  const bar = h("div", { class: "goodput" }, Object.entries(GOODPUT_COLOURS).map(([c, colour]) =>
    h("span", { title: `${c}: ${g[`${c}_s`].toFixed(2)}s`, dataset: { category: c },
      style: `width:${g.wall_s > 0 ? (100 * Math.max(0, g[`${c}_s`])) / g.wall_s : 0}%;background:${colour}` })));
  const legend = h("div", { class: "legend" }, Object.entries(GOODPUT_COLOURS).map(([c, colour]) =>
    h("span", {}, h("i", { style: `background:${colour}` }), `${c} ${g[`${c}_s`].toFixed(1)}s`)));
  box.replaceChildren(h("div", {}, h("b", { id: "goodput-share" }, `${(100 * g.goodput).toFixed(1)}%`),
    ` of ${dur(g.wall_s)} productive${g.steps_redone ? ` · ${g.steps_redone} steps redone` : ""}`), bar, legend);
}

function drawFacts(box, view) {
  const r = view.record;
  const fact = (name, value, id) => h("div", { id }, h("b", {}, name), value);
  box.replaceChildren(
    fact("state", stateBadge(r.state), "run-state"),
    fact("step", progress(r.step, r.spec.total_steps), "run-step"),
    fact("attempts", String(r.attempts), "run-attempts"),
    fact("worker", r.worker ?? "—"),
    fact("token", r.token ?? "—"),
    fact("pool", r.spec.pool),
    fact("entry point", r.spec.entry_point),
    fact("age", age(hubAge(view, view.accepted_at)), "run-age"),
    fact("digest", r.digest ? `${r.digest.slice(0, 16)}…` : "—"),
    ...(r.reason ? [fact("reason", r.reason)] : []),
  );
}

function drawLoss(box, legend, view, chart) {
  const attempts = view.attempts;
  const tables = attempts.map((a) => [a.loss.map((p) => p[0]), a.loss.map((p) => p[1])]);
  const data = tables.length ? uPlot.join(tables) : [[], []];
  legend.replaceChildren(...attempts.map((a, i) => h("span", { class: "series", dataset: { attempt: a.attempt } },
    h("i", { style: `background:${PALETTE[i % PALETTE.length]}` }),
    `attempt ${a.attempt} · ${a.worker} · ${a.outcome}${a.resumed_from != null ? ` · resumed at ${a.resumed_from}` : ""}`)),
  ...(attempts.some((a) => a.redone) ? [h("span", {}, h("i", { style: "background:#fde2e2" }), "steps redone")] : []));
  const redone = attempts.map((a) => a.redone).filter(Boolean);
  if (chart && chart.series.length - 1 === attempts.length) {
    chart._redone = redone;
    chart.setData(data);
    window.batonLoss = chart;
    return chart;
  }
  chart?.destroy();
  const opts = {
    width: Math.max(400, box.clientWidth || 900), height: 280, legend: { show: false },
    scales: { x: { time: false } },
    axes: [{ label: "step" }, { label: "loss" }],
    series: [{ label: "step" }, ...attempts.map((a, i) => ({
      label: `attempt ${a.attempt}`, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true,
    }))],
    hooks: {
      drawClear: [(u) => {
        const { ctx } = u;
        ctx.save();
        ctx.fillStyle = "#fde2e2";
        for (const [from, to] of u._redone || []) {
          const x0 = u.valToPos(from, "x", true);
          const x1 = u.valToPos(to, "x", true);
          ctx.fillRect(x0, u.bbox.top, Math.max(1, x1 - x0), u.bbox.height);
        }
        ctx.restore();
      }],
    },
  };
  box.replaceChildren();
  const made = new uPlot(opts, data, box);
  made._redone = redone;
  window.batonLoss = made; // for whoever inspects the page (and its tests)
  return made;
}

function drawTimeline(box, view) {
  const attempts = view.attempts;
  const t0 = Math.min(...view.marks.map((m) => m.at), ...attempts.map((a) => a.start), view.now);
  const t1 = Math.max(...view.marks.map((m) => m.at), ...attempts.map((a) => a.end), t0 + 1);
  const rows = Math.max(1, ...attempts.map((a) => a.row + 1));
  const W = 1000, left = 110, rowH = 28, top = 18, H = top + rows * rowH + 24;
  const x = (t) => left + ((W - left - 10) * (t - t0)) / (t1 - t0);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const el = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
    return e;
  };
  const workers = [];
  for (const a of attempts) workers[a.row] = a.worker;
  workers.forEach((w, i) => el("text", { x: 4, y: top + i * rowH + 17 }, w));
  attempts.forEach((a, i) => {
    const y = top + a.row * rowH + 4;
    const bar = el("rect", {
      x: x(a.start), y, width: Math.max(2, x(a.end) - x(a.start)), height: rowH - 8, rx: 3,
      fill: PALETTE[i % PALETTE.length], "fill-opacity": 0.85, "data-attempt": a.attempt, "data-outcome": a.outcome,
    });
    const title = document.createElementNS(ns, "title");
    title.textContent = `attempt ${a.attempt} on ${a.worker}: ${a.outcome}, steps ${a.first_step}–${a.last_step}, ${dur(a.end - a.start)}`;
    bar.append(title);
    for (const [step, at] of a.commits) { // each committed checkpoint, where it landed
      const tick = el("rect", { x: x(at) - 1, y: y - 3, width: 2, height: rowH - 2, fill: "#111827", "data-commit": step });
      const what = document.createElementNS(ns, "title");
      what.textContent = `checkpoint ${step} committed at +${dur(at - t0)}`;
      tick.append(what);
    }
    if (a.alive_until < a.end) {
      el("rect", { x: x(a.alive_until), y, width: Math.max(1, x(a.end) - x(a.alive_until)), height: rowH - 8, fill: "#fff", "fill-opacity": 0.6 });
    }
  });
  for (const m of view.marks) {
    const colour = MARK_COLOURS[m.kind];
    if (!colour) continue;
    const mx = x(m.at);
    const line = el("line", { x1: mx, x2: mx, y1: top - 6, y2: H - 20, stroke: colour, "stroke-width": 2, "data-kind": m.kind });
    const title = document.createElementNS(ns, "title");
    title.textContent = `${m.kind} at +${dur(m.at - t0)}`;
    line.append(title);
  }
  el("text", { x: left, y: H - 4 }, "0s");
  el("text", { x: W - 60, y: H - 4 }, `+${dur(t1 - t0)}`);
  box.replaceChildren(svg);
}

function drawMarks(box, view) {
  const t0 = Math.min(...view.marks.map((m) => m.at), view.now);
  const describe = (d) => Object.entries(d).filter(([, v]) => v !== "" && v !== null && !(Array.isArray(v) && !v.length))
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
  const rows = view.marks.map((m) => h("tr", { dataset: { kind: m.kind } },
    h("td", { class: "num" }, `+${dur(m.at - t0)}`),
    h("td", {}, h("b", { style: `color:${MARK_COLOURS[m.kind] || "inherit"}` }, m.kind)),
    h("td", {}, describe(m.detail))));
  const spans = view.attempts.map((a) => h("tr", { dataset: { attempt: a.attempt } },
    h("td", {}, `attempt ${a.attempt}`), h("td", {}, a.worker), h("td", {}, a.outcome),
    h("td", { class: "num" }, `${a.first_step}→${a.last_step}`), h("td", { class: "num" }, dur(a.end - a.start)),
    h("td", {}, a.redone ? `steps ${a.redone[0]}–${a.redone[1]} redone` : "")));
  box.replaceChildren(
    table(["attempt", "worker", "outcome", "steps", "lasted", ""], spans, { id: "attempts" }),
    table(["when", "event", "detail"], rows));
}

async function drawCheckpoints(box, runId) {
  let rows;
  try {
    rows = await getJSON(`/api/runs/${encodeURIComponent(runId)}/checkpoints`);
  } catch (e) {
    box.replaceChildren(h("p", { class: "error" }, e.message));
    return;
  }
  if (!rows.length) { box.replaceChildren(h("p", { class: "empty" }, "no checkpoint committed yet")); return; }
  box.replaceChildren(table(["step", "token", "size", "pinned", ""], rows.map((c) => h("tr", {},
    h("td", { class: "num" }, c.step), h("td", { class: "num" }, c.token), h("td", { class: "num" }, `${(c.bytes / 1e6).toFixed(2)} MB`),
    h("td", {}, c.pinned ? "yes" : ""),
    h("td", {}, c.pinned ? "" : h("button", { onclick: async (e) => {
      e.target.disabled = true;
      await post(`/api/runs/${encodeURIComponent(runId)}/checkpoints/${c.step}/pin`);
      drawCheckpoints(box, runId);
    } }, "pin"))))));
}

// -- the fleet -----------------------------------------------------------------------------

function viewWorkers() {
  const body = h("tbody", { id: "workers-body" });
  main.replaceChildren(h("h1", {}, "Workers"),
    h("table", {}, h("thead", {}, h("tr", {}, ["worker", "pool", "site", "host", "device", "GPU", "run", "step", "heartbeat"].map((x) => h("th", {}, x)))), body));
  const row = (w) => h("tr", { dataset: { worker: w.worker, at: w.at, stamped: w.stamped_at, now: w.now, received: w.received } },
    h("td", {}, w.worker), h("td", {}, w.pool), h("td", {}, w.site || "hub"), h("td", {}, w.host),
    h("td", {}, w.device), h("td", {}, w.gpu_name || "—"),
    h("td", {}, w.run_id ? h("a", { href: `#/run/${encodeURIComponent(w.run_id)}` }, w.run_id) : "idle"),
    h("td", { class: "num" }, w.step ?? "—"), h("td", { class: "num beat" }, `${age(hubAge(w))} ago`));
  getJSON("/api/workers").then((ws) => body.replaceChildren(...ws.map((w) => row(arrived(w)))));
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

function refreshable(title, load) {
  const box = h("div", {});
  const button = h("button", { onclick: () => load(box) }, "Refresh");
  main.replaceChildren(h("h1", {}, title, " ", button), box);
  load(box);
  return null;
}

function viewSites() {
  return refreshable("Sites", async (box) => {
    const sites = await getJSON("/api/sites");
    box.replaceChildren(sites.length ? table(["site", "link", "last greeting", "backlog", "links", "outbox last seq"],
      sites.map((s) => h("tr", { dataset: { site: s.site } }, h("td", {}, s.site), h("td", { class: s.link }, s.link),
        h("td", { class: "num" }, `${dur(s.last_seen_s)} ago`), h("td", { class: "num" }, s.backlog),
        h("td", { class: "num" }, s.links), h("td", { class: "num" }, s.outbox_last_seq))))
      : h("p", { class: "empty" }, "no site has greeted this hub yet"));
  });
}

function viewStreams() {
  return refreshable("Streams and consumers", async (box) => {
    const streams = await getJSON("/api/streams");
    const rows = [];
    for (const s of streams) {
      rows.push(h("tr", { dataset: { stream: s.name } }, h("td", {}, h("b", {}, s.name)), h("td", { class: "num" }, s.messages),
        h("td", { class: "num" }, `${(s.bytes / 1e6).toFixed(2)} MB`), h("td", {}, ""), h("td", {}, ""), h("td", {}, "")));
      for (const c of s.consumers || []) {
        rows.push(h("tr", {}, h("td", {}, `  ↳ ${c.name}`), h("td", {}, ""), h("td", {}, ""),
          h("td", { class: "num" }, c.pending), h("td", { class: "num" }, c.ack_pending), h("td", { class: "num" }, c.redelivered)));
      }
    }
    box.replaceChildren(table(["stream / consumer", "messages", "size", "pending", "ack pending", "redelivered"], rows));
  });
}

function viewDlq() {
  return refreshable("Dead letters", async (box) => {
    const letters = (await getJSON("/api/dlq")).map((l) => arrived(l));
    if (!letters.length) { box.replaceChildren(h("p", { class: "empty" }, "no dead letters")); return; }
    box.replaceChildren(table(["#", "when", "from", "subject", "reason", "payload", ""], letters.map((l) => {
      const status = h("span", {});
      const replay = h("button", { class: "replay", onclick: async () => {
        replay.disabled = true;
        try {
          const r = await post(`/api/dlq/${l.seq}/replay`);
          status.textContent = `replayed to ${r.subject}`;
        } catch (e) { status.textContent = e.message; status.className = "error"; replay.disabled = false; }
      } }, "replay");
      return h("tr", { dataset: { seq: l.seq } }, h("td", { class: "num" }, l.seq), h("td", { title: `written ${new Date(l.at * 1000).toISOString()} (its writer's clock)` }, `${age(hubAge(l))} ago`),
        h("td", {}, l.source), h("td", {}, l.subject), h("td", { style: "white-space:normal" }, l.reason),
        h("td", {}, h("pre", { class: "preview" }, l.preview)), h("td", {}, replay, " ", status));
    })));
  });
}

// -- routing -------------------------------------------------------------------------------

const routes = { runs: viewRuns, run: viewRun, workers: viewWorkers, sites: viewSites, streams: viewStreams, dlq: viewDlq };
let leave = null;

function route() {
  if (leave) leave();
  const [, name = "runs", ...rest] = (location.hash || "#/runs").split("/");
  const view = routes[name] || viewRuns;
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.dataset.view === name);
  leave = view(decodeURIComponent(rest.join("/"))) || null;
}

window.addEventListener("hashchange", route);
route();
