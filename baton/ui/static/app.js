// Baton's dashboard: plain JavaScript, no build step. The server computes everything a page
// shows (a run's timeline comes from the same code as `baton report`); the page only draws
// it and applies what the server pushes over Server-Sent Events. This file holds what every
// view shares (helpers, the notice and `act`, the live stream) and the routing; the views
// are in runs.js (the runs list), run.js (a run's page), fleet.js (workers, sites,
// streams, dead letters) and queue.js (a pool's queue), loaded after it.
"use strict";

const TOKEN = document.querySelector('meta[name="baton-token"]').content;
const main = document.getElementById("main");

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

// A JSON answer, or an Error saying why there is none: the server's own reason (`error`,
// and `reload` when the page must be reloaded to act again), its status for an answer that
// is not JSON (a proxy's page, a refusal in plain text), or that it did not answer at all.
async function getJSON(url, options = {}) {
  let r;
  try {
    r = await fetch(url, options);
  } catch (e) {
    throw new Error(`the dashboard did not answer (${e.message}): is \`baton ui\` still running?`);
  }
  const text = await r.text();
  let body = null;
  try { body = JSON.parse(text); } catch { /* not JSON: said below */ }
  if (!r.ok || body === null) {
    const said = body?.error || `${r.status} ${r.statusText}${text ? `: ${text.slice(0, 200)}` : ""}`;
    const error = new Error(said);
    error.reload = Boolean(body?.reload);
    throw error;
  }
  return body;
}

// A message at the top of the page that stays until dismissed: what failed and why, with a
// Reload button when only a reload can help (the page's token is stale).
const noticeBox = document.getElementById("notice");
function notice(message, reload = false) {
  noticeBox.replaceChildren(
    h("span", { id: "notice-text" }, message),
    reload ? h("button", { id: "notice-reload", onclick: () => location.reload() }, "Reload") : null,
    h("button", { class: "dismiss", title: "dismiss", onclick: () => { noticeBox.hidden = true; } }, "×"));
  noticeBox.hidden = false;
}

// Every action the page offers goes through `act`: posted with the page's token; a failure
// is said on the page — in the notice, and in `status` next to the action when given — and
// the button is given back; never a silent failure. On success the answer is returned and
// the button left disabled for the caller to redraw. `what` names the action as the notice
// says it ("pinning checkpoint 20"); `body`, if given, is sent as JSON (a reason, a fork's
// overrides). An action is a button whose click awaits `act`.
async function act(what, url, { button = null, status = null, body = null } = {}) {
  if (button) button.disabled = true;
  const options = { method: "POST", headers: { "X-Baton-Token": TOKEN } };
  if (body !== null) {
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  try {
    return await getJSON(url, options);
  } catch (e) {
    const message = `${what} failed: ${e.message}`;
    notice(message, e.reload);
    if (status) { status.textContent = message; status.classList.add("error"); }
    if (button) button.disabled = false;
    return null;
  }
}

// Every second, `tick` runs for the page shown (ages move on the page's monotonic clock,
// from the hub's stamps); leaving the page stops it.
function ticking(tick) {
  const timer = setInterval(tick, 1000);
  return () => clearInterval(timer);
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

// -- routing -------------------------------------------------------------------------------

let leave = null;

function route() {
  const routes = { runs: viewRuns, run: viewRun, workers: viewWorkers, sites: viewSites, streams: viewStreams, dlq: viewDlq, queue: viewQueue };
  if (leave) leave();
  const [, name = "runs", ...rest] = (location.hash || "#/runs").split("/");
  const view = routes[name] || viewRuns;
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.dataset.view === name);
  leave = view(decodeURIComponent(rest.join("/"))) || null;
}

window.addEventListener("hashchange", route);
document.addEventListener("DOMContentLoaded", route); // once every view's script has run
