// Baton's dashboard: one run's page (see app.js).
"use strict";

const PALETTE = ["#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#393b79"];
const MARK_COLOURS = {
  attempt_failed: "#d62728", fenced: "#d62728", failed: "#d62728", handed_over: "#e8710a",
  preempted: "#e8710a", redispatched: "#555555", restored: "#2ca02c", completed: "#2ca02c",
  warning: "#b8860b", cancelled: "#555555", commit_refused: "#d62728", diverged: "#b8860b",
  guarded: "#d62728", paused: "#7c3aed", resumed: "#7c3aed", rolled_back: "#7c3aed",
  forked: "#2563eb", stall_recovered: "#2ca02c",
};

// -- one run -------------------------------------------------------------------------------

function viewRun(runId) {
  const ending = h("div", { class: "ending", id: "run-ending", hidden: true });
  const hold = h("div", { class: "hold", id: "run-hold", hidden: true });
  const controls = runControls(runId);
  const watched = h("div", { class: "vitals", id: "run-vitals" });
  const forking = forkForm(runId);
  const ckptStatus = h("p", { class: "status", id: "checkpoints-status" });
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
    ending,
    hold,
    controls.box,
    facts,
    watched,
    h("h2", {}, "Goodput"), spent,
    h("h2", {}, "Loss per step"), h("div", { class: "card" }, chartBox, legend),
    h("h2", {}, "Timeline"), h("div", { class: "card" }, timeline), marks,
    h("h2", {}, "Checkpoints"), ckpts, ckptStatus, forking.box,
    h("h2", {}, "Output"), logs,
  );
  let chart = null;
  let lastCheckpoints = "";
  let lastView = null;

  const views = new EventSource(`/api/runs/${encodeURIComponent(runId)}/live`);
  views.addEventListener("view", (e) => {
    const view = arrived(JSON.parse(e.data));
    lastView = view;
    drawEnding(ending, view);
    drawHold(hold, view);
    controls.apply(view);
    drawFacts(facts, view);
    drawVitals(watched, view);
    drawGoodput(spent, view.goodput);
    chart = drawLoss(chartBox, legend, view, chart);
    drawTimeline(timeline, view);
    drawMarks(marks, view);
    // Read again when what it shows may have changed: a commit, a rollback, a new state.
    const r = view.record;
    const shown = `${r.step}|${r.state}|${r.rewinds.length}|${r.rollback_to}`;
    if (shown !== lastCheckpoints) {
      lastCheckpoints = shown;
      drawCheckpoints(ckpts, runId, { record: r, status: ckptStatus, reason: controls.reason, forking });
    }
  });
  views.onerror = () => { if (views.readyState === EventSource.CLOSED) facts.replaceChildren(h("p", { class: "error" }, `no run ${runId}`)); };

  const output = new EventSource(`/api/runs/${encodeURIComponent(runId)}/logs`);
  output.addEventListener("log", (e) => {
    const follow = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
    logs.textContent = (logs.textContent + JSON.parse(e.data)).slice(-200000);
    if (follow) logs.scrollTop = logs.scrollHeight;
  });
  const stopTicking = ticking(() => {
    if (!lastView) return;
    const ago = ending.querySelector(".ago");
    if (ago && lastView.ending?.at != null) ago.textContent = `${age(hubAge(lastView, lastView.ending.at))} ago`;
    const shown = document.querySelector("#run-age");
    if (shown) shown.lastChild.textContent = age(hubAge(lastView, lastView.accepted_at));
  });
  return () => { views.close(); output.close(); chart?.destroy(); stopTicking(); };
}

// How the run ended, at the top of its page (never below a scroll box): its state, the step
// it ended at, when (by the hub's clock) and why; hidden while it runs.
function drawEnding(box, view) {
  const end = view.ending;
  box.hidden = !end;
  if (!end) { box.replaceChildren(); return; }
  box.className = `ending ${end.state}`;
  box.dataset.kind = end.kind;
  box.replaceChildren(...[ // replaceChildren would write a null as "null"
    h("b", { class: "ending-kind" }, end.kind),
    ` at step ${end.step}`,
    end.at != null ? h("span", { class: "muted" }, " · ", h("span", { class: "ago" }, `${age(hubAge(view, end.at))} ago`)) : null,
    end.reason ? h("div", { class: "ending-reason" }, end.reason) : null,
    end.detail ? h("details", {}, h("summary", {}, "detail"), h("pre", { class: "preview" }, end.detail)) : null,
  ].filter((c) => c !== null));
}

const GOODPUT_COLOURS = {
  productive: "#2ca02c", queued: "#9ca3af", startup: "#60a5fa", restore: "#a78bfa",
  checkpoint: "#fbbf24", wasted: "#ef4444", recovery: "#f97316", rounds: "#14b8a6",
  other: "#e5e7eb",
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
    fact("at risk", atRisk(view.vitals.at_risk), "run-at-risk"),
    ...(r.reason ? [fact("reason", r.reason)] : []),
  );
}

// What a failure now would lose, as the running attempt last reported it.
function atRisk(risk) {
  if (!risk) return "—";
  const steps = `${risk.steps} step${risk.steps === 1 ? "" : "s"}`;
  return h("span", { title: `reported at step ${risk.step} by ${risk.worker}` },
    `${steps} · checkpoint ${dur(risk.checkpoint_age_s)} old`);
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

// Every checkpoint the run stored, with its status (chain, abandoned, off; final, latest);
// pinning on each, rolling back on each on the chain that is not final while the run is not
// over. A rollback in flight keeps its button disabled through the table's redraws.
const rollbacks = new Set();

async function drawCheckpoints(box, runId, { record, status, reason, forking }) {
  const again = () => drawCheckpoints(box, runId, { record, status, reason, forking });
  const mine = (box.drawn = (box.drawn || 0) + 1); // a slower, older read draws nothing
  let rows;
  try {
    rows = await getJSON(`/api/runs/${encodeURIComponent(runId)}/checkpoints`);
  } catch (e) {
    if (box.drawn !== mine) return;
    box.replaceChildren(h("p", { class: "error" }, e.message));
    forking.offer([]);
    return;
  }
  if (box.drawn !== mine) return;
  forking.offer(rows);
  if (!rows.length) { box.replaceChildren(h("p", { class: "empty" }, "no checkpoint committed yet")); return; }
  const base = `/api/runs/${encodeURIComponent(runId)}/checkpoints`;
  const over = record.state === "COMPLETED" || record.state === "CANCELLED";
  const rollback = (c) => {
    const key = `${runId}/${c.step}/${c.token}`;
    const button = h("button", { class: "rollback", dataset: { step: c.step }, disabled: rollbacks.has(key), onclick: async () => {
      status.textContent = ""; status.classList.remove("error");
      rollbacks.add(key);
      const done = await act(`rolling ${runId} back to step ${c.step}`, `${base}/${c.step}/rollback`,
        { button, status, body: { reason: reason.value } });
      rollbacks.delete(key);
      button.disabled = false;
      if (done) status.textContent = `rollback to step ${c.step} asked (the run was ${done.state})`;
    } }, "roll back");
    return button;
  };
  box.replaceChildren(table(["step", "token", "status", "size", "pinned", ""], rows.map((c) => h("tr", { dataset: { step: c.step, status: c.status, final: c.final } },
    h("td", { class: "num" }, c.step), h("td", { class: "num" }, c.token),
    h("td", { class: "status-cell" }, h("span", { class: `lineage ${c.status}` }, c.status), c.final ? " · final" : "", c.latest ? " · latest" : ""),
    h("td", { class: "num" }, `${(c.bytes / 1e6).toFixed(2)} MB`),
    h("td", {}, c.pinned ? "yes" : ""),
    h("td", {}, c.pinned ? "" : h("button", { class: "pin", dataset: { step: c.step }, onclick: async (e) => {
      const url = `${base}/${c.step}/pin`;
      if (await act(`pinning checkpoint ${c.step} of ${runId}`, url, { button: e.currentTarget })) again();
    } }, "pin"), !over && c.status === "chain" && !c.final ? [" ", rollback(c)] : null)))));
}

// A fork: a new run from a committed checkpoint of this one (on its chain or abandoned), its
// spec this run's with the overrides given (`baton fork --set`, one per line); its id, with
// a link, once submitted. Offered for a run in any state.
function forkForm(runId) {
  const step = h("select", { id: "fork-step" });
  const overrides = h("textarea", { id: "fork-overrides", rows: 3, cols: 44, placeholder: "config.lr=0.01\ntotal_steps=500" });
  const status = h("span", { class: "status", id: "fork-status" });
  const result = h("span", { id: "fork-result" });
  const go = h("button", { id: "fork-go", onclick: async () => {
    status.textContent = ""; status.classList.remove("error"); result.replaceChildren();
    const lines = overrides.value.split("\n").map((l) => l.trim()).filter(Boolean);
    const url = `/api/runs/${encodeURIComponent(runId)}/checkpoints/${step.value}/fork`;
    const done = await act(`forking ${runId} from step ${step.value}`, url,
      { button: go, status, body: { overrides: lines } });
    if (!done) return;
    go.disabled = false;
    result.replaceChildren("forked: ", h("a", { id: "fork-link", href: `#/run/${encodeURIComponent(done.run_id)}` }, done.run_id),
      done.answer ? ` (${done.answer})` : " (not accepted yet)");
  } }, "Fork");
  const box = h("div", { class: "card fork", id: "fork-form", hidden: true },
    h("b", {}, "Fork from step "), step,
    h("div", { class: "muted" }, "overrides, one path=value per line, as `baton fork --set`:"), overrides,
    h("div", {}, go, " ", status, " ", result));
  return {
    box,
    offer(rows) {
      const chosen = step.value;
      const steps = [...new Set(rows.filter((c) => c.status === "chain" || c.status === "abandoned").map((c) => c.step))];
      step.replaceChildren(...steps.map((s) => h("option", { value: s }, String(s))));
      if (steps.map(String).includes(chosen)) step.value = chosen;
      box.hidden = !steps.length;
    },
  };
}

// Pause, resume and a checkpoint now, each shown only where it applies: pause on a queued
// or running run not already asked to stop, resume on a paused one, a checkpoint on a run
// in training. `act` keeps a button disabled while its request is in flight.
function runControls(runId) {
  const base = `/api/runs/${encodeURIComponent(runId)}`;
  const status = h("span", { class: "status", id: "act-status" });
  const reason = h("input", { id: "act-reason", placeholder: "reason (optional)", size: 28 });
  const button = (id, label, path, what, said) => {
    const b = h("button", { id, hidden: true, onclick: async () => {
      status.textContent = ""; status.classList.remove("error");
      const done = await act(`${what} ${runId}`, `${base}/${path}`, { button: b, status, body: { reason: reason.value } });
      if (!done) return;
      b.disabled = false;
      status.textContent = said;
    } }, label);
    return b;
  };
  const pause = button("act-pause", "Pause", "pause", "pausing", "pause asked: it checkpoints, then stops");
  const resume = button("act-resume", "Resume", "resume", "resuming", "resumed: queued again");
  const checkpoint = button("act-checkpoint", "Checkpoint now", "checkpoint", "asking for a checkpoint of",
    "checkpoint asked: listed below once committed");
  const box = h("div", { class: "controls", id: "run-controls" }, pause, resume, checkpoint, reason, status);
  return {
    box,
    reason,
    apply(view) {
      const r = view.record;
      const held = view.vitals.hold;
      const stopping = held.pausing || held.cancelling !== null;
      pause.hidden = !(r.state === "QUEUED" || (r.state === "RUNNING" && !stopping));
      resume.hidden = r.state !== "PAUSED";
      checkpoint.hidden = !(r.state === "RUNNING" && r.worker && !stopping);
      reason.hidden = r.state === "COMPLETED" || r.state === "CANCELLED";
    },
  };
}

// Why the run is held or being stopped: paused (and why), pausing, cancelling, ordered back.
function drawHold(box, view) {
  const held = view.vitals.hold;
  const said = (what, why) => h("div", {}, h("b", {}, what), why ? ` — ${why}` : "");
  const lines = [
    held.paused ? said("paused", held.why) : null,
    held.pausing ? said("pausing", `${held.why}: it checkpoints at its next step, then stops`) : null,
    held.cancelling !== null ? said("cancelling", held.cancelling) : null,
    held.rollback_to !== null ? said(`ordered back to step ${held.rollback_to}`, held.rollback_reason) : null,
  ].filter(Boolean);
  box.hidden = !lines.length;
  box.className = held.paused || held.pausing ? "hold PAUSED" : "hold";
  box.replaceChildren(...lines);
}

// What an operator watches: where the run came from and went back to, its divergence guard's
// stops and the data left out, its stalls, its interruptions by cause and what each cost.
function drawVitals(box, view) {
  const v = view.vitals;
  const t0 = Math.min(...view.marks.map((m) => m.at), view.now);
  const when = (at) => (at == null ? null : h("span", { class: "muted" }, ` · +${dur(at - t0)}`));
  const card = (id, title, ...body) => h("div", { class: "card", id }, h("b", {}, title), ...body);
  const runLink = (id) => h("a", { href: `#/run/${encodeURIComponent(id)}` }, id);
  const parts = [];
  const lin = v.lineage;
  if (lin.forked_from || lin.rewinds.length) {
    parts.push(card("run-lineage", "Lineage",
      lin.forked_from ? h("div", { class: "forked-from" }, "forked from ", runLink(lin.forked_from.run_id),
        ` at step ${lin.forked_from.step}`, lin.graft ? ` (its checkpoint grafted under token ${lin.graft.token})` : " (not grafted yet)",
        lin.graft ? when(lin.graft.at) : null) : null,
      lin.rewinds.map((w) => h("div", { class: "rewind", dataset: { to: w.to_step } },
        `rolled back from step ${w.from_step} to ${w.to_step} (token ${w.token})`,
        w.abandoned.length ? `; abandoned ${w.abandoned.join(", ")}` : "", w.reason ? ` — ${w.reason}` : "", when(w.at)))));
  }
  const g = v.guard;
  if (g.actions.length || g.skips.length) {
    parts.push(card("run-guard", "Divergence guard",
      g.actions.map((a) => h("div", { class: "guarded", dataset: { action: a.action } },
        `step ${a.step}: ${a.metric} = ${a.value} (${a.rule}); ${a.action}`,
        a.action === "rollback" ? ` from step ${a.good_step}` : "", h("span", { class: "muted" }, ` · ${a.worker}`), when(a.at))),
      g.skips.map((x) => h("div", { class: "skip" }, `left out ${x.batches} batch(es) after step ${x.after}`))));
  }
  if (v.stalls.length) {
    parts.push(card("run-stalls", "Stalls", v.stalls.map((x) => h("div", { class: "stall", dataset: { recovered: x.recovered_at !== null } },
      `stalled: ${x.detail}`, when(x.at),
      x.recovered_at !== null ? ` — stepped again at step ${x.step} after ${dur(x.quiet_s)} without one` : " — not recovered"))));
  }
  const i = v.interruptions;
  if (i.each.length) {
    parts.push(card("run-interruptions", "Interruptions",
      table(["cause", "times", "mean recovery"], i.by_cause.map((c) => h("tr", { dataset: { cause: c.cause } },
        h("td", {}, c.cause), h("td", { class: "num" }, c.count), h("td", { class: "num" }, dur(c.mean_s))))),
      h("div", { class: "muted" }, i.each.map((r) => `${r.cause} at step ${r.from_step}, resumed at ${r.to_step}: ${dur(r.seconds)}`).join(" · "))));
  }
  const r = v.rounds;
  if (r) {
    const joined = r.each.filter((n) => n.outcome === "joined");
    const other = r.each.filter((n) => n.outcome !== "joined");
    parts.push(card("run-rounds", `Rounds · replica ${r.replica} of ${r.replicas}, H=${r.inner_steps}`,
      h("div", { class: "muted" }, `${joined.length} round(s) joined; ${dur(r.waited_s)} waiting for rounds`),
      table(["round", "step", "from round", "replicas", "committed by", "stragglers", "MB", "waited"],
        joined.slice(-20).map((n) => h("tr", { class: "round", dataset: { round: n.round, deadline: n.deadline } },
          h("td", { class: "num" }, n.round), h("td", { class: "num" }, n.step), h("td", { class: "num" }, n.base),
          h("td", {}, n.replicas.join(", ")), h("td", { class: "num" }, n.closed_by),
          h("td", {}, n.stragglers.join(", ") + (n.deadline ? " (deadline)" : "")),
          h("td", { class: "num" }, (n.bytes / 1e6).toFixed(2)), h("td", { class: "num" }, dur(n.waited_s))))),
      other.map((n) => h("div", { class: `round-${n.outcome}` }, `step ${n.step}: ${n.outcome} — ${n.detail}`, when(n.at)))));
  }
  box.replaceChildren(...parts);
}
