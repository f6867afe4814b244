// Baton's dashboard: the runs list (see app.js).
"use strict";

const PAGE = 25;

// -- runs ----------------------------------------------------------------------------------

const ENDED = ["COMPLETED", "FAILED", "CANCELLED"];

// The list's one order, the server's (`RunIndex.page`): newest first by creation (each run's
// `created_at`, the dispatcher's clock), a tie by run id. True when `a` is listed before `b`.
function listedBefore(a, b) {
  return a.created_at > b.created_at || (a.created_at === b.created_at && a.run_id < b.run_id);
}

// A page is the runs after its cursor (`after`: the last run of the page before), up to
// PAGE of them. Invariant: the rows are always in the list's order and are the runs that
// belong on this page by it. A pushed change to a row replaces it in place (its creation
// never changes, so neither does its place); a run not shown enters only where it belongs —
// after the cursor and before the last row (anywhere after the cursor on the last page) —
// and pushes the last row off a full page; a row that no longer passes the filters leaves,
// and the page is read again to fill its place. The count and every age tick.
function viewRuns() {
  const filters = { state: "", pool: "", owner: "", site: "" };
  const cursors = []; // the cursors of the pages before this one
  let after = null; // this page's cursor (null: the first page)
  let next = null; // the next page's: the last row's while the page is full
  let total = 0;
  let rows = []; // the summaries shown, in the list's order
  let pending = null; // changes pushed while a page loads: applied once it is in
  let loads = 0;
  let refill = null;
  const body = h("tbody", { id: "runs-body" });
  const count = h("span", { id: "runs-count" });
  const restart = () => { after = null; cursors.length = 0; load(); };
  const older = h("button", { id: "older", onclick: () => { cursors.push(after); after = next; load(); } }, "Older →");
  const newer = h("button", { id: "newer", onclick: () => { after = cursors.pop() ?? null; load(); } }, "← Newer");
  const field = (name, placeholder) => h("input", {
    placeholder, name, onchange: (e) => { filters[name] = e.target.value.trim(); restart(); },
  });
  const states = h("select", { name: "state", onchange: (e) => { filters.state = e.target.value; restart(); } },
    ["", "QUEUED", "RUNNING", "PAUSED", ...ENDED].map((s) => h("option", { value: s }, s || "any state")));
  main.replaceChildren(
    h("h1", {}, "Runs"),
    h("p", { class: "hint" }, "Newest first, by when each run was created."),
    h("div", { class: "filters" }, states, field("pool", "pool"), field("owner", "owner"), field("site", "site")),
    h("table", { id: "runs" },
      h("thead", {}, h("tr", {}, ["run", "name", "state", "step", "attempts", "worker", "goodput", "pool", "changed"].map((x) => h("th", {}, x)))),
      body),
    h("div", { class: "pager" }, newer, older, count),
  );

  function row(s) {
    return h("tr", { dataset: { run: s.run_id, created: s.created_at, seq: s.seq } },
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

  function cursorKey(cursor) { // `<created_at>:<run id>`, as the server writes a cursor
    const at = cursor.indexOf(":");
    return { created_at: Number(cursor.slice(0, at)), run_id: cursor.slice(at + 1) };
  }

  function drawPager() {
    if (!rows.length && !body.querySelector(".empty")) body.replaceChildren(h("tr", {}, h("td", { colspan: 9, class: "empty" }, "no runs")));
    if (rows.length) body.querySelector(".empty")?.closest("tr")?.remove();
    older.disabled = !next;
    newer.disabled = !cursors.length && !after;
    count.textContent = `${total} runs in all`;
  }

  async function load() {
    const mine = ++loads;
    pending ??= [];
    const q = new URLSearchParams({ limit: PAGE, ...filters });
    if (after) q.set("after", after);
    let page;
    try {
      page = await getJSON(`/api/runs?${q}`);
    } catch (e) {
      if (mine === loads) { pending = null; notice(`loading the runs failed: ${e.message}`); }
      return;
    }
    if (mine !== loads) return; // a later load replaces this one
    rows = page.runs.map((s) => arrived(s, page.now));
    next = page.next;
    total = Math.max(total, page.total);
    body.replaceChildren(...rows.map(row));
    const changes = pending;
    pending = null;
    for (const s of changes) apply(s);
    drawPager();
    fillGoodput(rows.filter((s) => ENDED.includes(s.state)).map((s) => s.run_id));
  }

  function rowOf(runId) {
    return body.querySelector(`tr[data-run="${CSS.escape(runId)}"]`);
  }

  function belongs(s) {
    if (after !== null && !listedBefore(cursorKey(after), s)) return false; // an earlier page's
    if (next === null) return true; // the last page holds every run after its cursor
    return rows.length > 0 && listedBefore(s, rows[rows.length - 1]);
  }

  function apply(s) {
    total = Math.max(total, s.total ?? 0);
    if (pending) { pending.push(s); return; }
    const at = rows.findIndex((r) => r.run_id === s.run_id);
    if (at >= 0 && rows[at].seq >= s.seq) return; // this row is newer already
    if (!admits(s)) {
      if (at >= 0) { // it leaves: the page is read again to fill its place
        rows.splice(at, 1);
        rowOf(s.run_id)?.remove();
        clearTimeout(refill);
        refill = setTimeout(load, 300);
      }
      return;
    }
    if (at >= 0) {
      rows[at] = s;
      rowOf(s.run_id)?.replaceWith(row(s));
      if (ENDED.includes(s.state)) fillGoodput([s.run_id]);
      return;
    }
    if (!belongs(s)) return;
    let place = rows.findIndex((r) => listedBefore(s, r));
    if (place < 0) place = rows.length;
    rows.splice(place, 0, s);
    body.insertBefore(row(s), rowOf(rows[place + 1]?.run_id ?? "") ?? null);
    while (rows.length > PAGE) {
      rowOf(rows.pop().run_id)?.remove();
      const last = rows[rows.length - 1];
      next = `${last.created_at}:${last.run_id}`;
    }
    if (ENDED.includes(s.state)) fillGoodput([s.run_id]);
  }

  async function fillGoodput(runIds) {
    if (!runIds.length) return;
    let found;
    try {
      found = await getJSON(`/api/goodput?runs=${runIds.map(encodeURIComponent).join(",")}`);
    } catch { return; } // a cell left at "—": the next change of the run asks again
    for (const [runId, g] of Object.entries(found)) {
      const cell = rowOf(runId)?.querySelector(".goodput-cell");
      if (cell && g) { cell.textContent = `${(100 * g.goodput).toFixed(1)}%`; cell.title = breakdown(g); }
    }
  }

  load();
  const stopTicking = ticking(() => {
    for (const s of rows) {
      const cell = rowOf(s.run_id)?.querySelector(".changed");
      if (cell) cell.textContent = age(hubAge(s));
    }
  });
  const stop = listen((kind, s) => {
    if (kind !== "run") return;
    apply(s);
    if (!pending) drawPager();
  });
  return () => { stop(); stopTicking(); clearTimeout(refill); };
}
