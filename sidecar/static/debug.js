"use strict";
// The /debug/requests page (docs/observability.md, "The /debug/requests page").
//
// Every string from a record reaches the DOM as text (textContent, attribute values), never as
// HTML: request ids and errors come from clients. The Content-Security-Policy requires Trusted
// Types, so an HTML sink (innerHTML and the like) would throw rather than render.
(() => {
  const STATES = ["received", "prefilling", "decoding", "completed", "failed", "cancelled"];
  const IN_FLIGHT = new Set(["received", "prefilling", "decoding"]);
  const DECISIONS = ["remote", "local", "none"];
  const MARKS = ["prefill_sent", "prefill_done", "decode_sent", "first_byte"];
  // A segment runs from one phase the record has to the next. It is named after the furthest
  // phase reached by its start, in this order: "received" < MARKS, so when phases overlap (SGLang
  // sends both legs at once; its prefill may end after the first byte) the bar follows the
  // decode's progress, and adjacent segments of one name merge.
  const SEGMENT = {
    received: "placing", prefill_sent: "prefill", prefill_done: "handoff",
    decode_sent: "first token", first_byte: "streaming",
  };
  const TICK_MS = 500; // how often bars of requests in flight grow between two fetches
  const AXES = ["log", "shared", "fit"]; // the first is the default
  // The limit control's choices, up to the server's max_limit (which is always offered, as is the
  // limit in force, whatever a link asked for).
  const LIMITS = [20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];
  // On the log axis, durations below this count as this (a record's phases may be 0 apart).
  const FLOOR_S = 1e-5;

  const $ = (id) => document.getElementById(id);
  const query = new URLSearchParams(location.search);
  const view = {
    states: new Set(STATES), decisions: new Set(DECISIONS), axis: AXES[0], selected: null,
    limit: null, // records fetched per list; null: the server's default
  };
  const rows = new Map(); // row key → <tr>, kept across refreshes: focus and scroll stay put
  let records = [];       // in flight first, then recent; newest first in each (as the API)
  let held = 0;           // records the sidecar holds, both lists, whatever the limit
  let loaded = false;
  let clockOffset = 0;    // the sidecar's clock minus the browser's, seconds
  let paused = false, pausedAt = 0, timer = 0;
  let generation = 0;     // of refresh(): only the latest one schedules the next
  let lastCopy = null;    // the selected record as last seen, kept when it leaves the list
  let fetching = null;    // the id looked up at requests/{id} (not in the list)
  let lookupError = null; // why that lookup failed

  // --- small helpers --------------------------------------------------------------------------
  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  const decisionOf = (r) => r.decision || "none";
  const outcomeOf = (r) => (IN_FLIGHT.has(r.state) ? "inflight" : r.state);
  const pct = (fraction) => `${Math.max(0, Math.min(1, fraction)) * 100}%`;
  const now = () => (paused ? pausedAt : Date.now() / 1000 + clockOffset);

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    if (seconds < 1) return `${(seconds * 1000).toFixed(seconds < 0.01 ? 2 : seconds < 0.1 ? 1 : 0)} ms`;
    if (seconds < 60) return `${seconds.toFixed(2)} s`;
    return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
  }
  function clock(unix) {
    const date = new Date(unix * 1000);
    return `${date.toTimeString().slice(0, 8)}.${String(date.getMilliseconds()).padStart(3, "0")}`;
  }
  function brief(value) {
    if (value === null || value === undefined || value === "") return null;
    if (Array.isArray(value)) return value.length ? value.map(brief).join(", ") : null;
    if (typeof value !== "object") return String(value);
    const parts = Object.entries(value)
      .map(([name, inner]) => [name, brief(inner)])
      .filter(([, text]) => text !== null)
      .map(([name, text]) => (typeof value[name] === "object" ? `${name} (${text})` : `${name} ${text}`));
    return parts.length ? parts.join(" · ") : null;
  }
  function definitions(target, pairs) {
    target.replaceChildren();
    for (const [name, value] of pairs) {
      if (value === null || value === undefined || value === "") continue;
      target.append(el("dt", "", name), el("dd", "", value));
    }
    return target;
  }
  function setText(node, text) { if (node.textContent !== text) node.textContent = text; }

  // --- the view in the URL: #state=a,b&decision=c&axis=fit&limit=500&id=<request id> ---------
  function readHash() {
    const hash = new URLSearchParams(location.hash.slice(1));
    const chosen = (value, all) =>
      value === null ? new Set(all) : new Set(value.split(",").filter((v) => all.includes(v)));
    view.states = chosen(hash.get("state") ?? query.get("state"), STATES);
    view.decisions = chosen(hash.get("decision"), DECISIONS);
    view.axis = AXES.includes(hash.get("axis")) ? hash.get("axis") : AXES[0];
    const limit = hash.get("limit") ?? query.get("limit");
    view.limit = limit !== null && /^[0-9]{1,9}$/.test(limit) && Number(limit) > 0 ? Number(limit) : null;
    view.selected = hash.get("id");
    for (const box of $("filters").querySelectorAll("input[type=checkbox]")) {
      box.checked = (box.name === "state" ? view.states : view.decisions).has(box.value);
    }
    $("axis").value = view.axis;
  }
  function writeHash() {
    const parts = [];
    if (view.states.size < STATES.length) parts.push(`state=${STATES.filter((s) => view.states.has(s))}`);
    if (view.decisions.size < DECISIONS.length) {
      parts.push(`decision=${DECISIONS.filter((d) => view.decisions.has(d))}`);
    }
    if (view.axis !== AXES[0]) parts.push(`axis=${view.axis}`);
    if (view.limit !== null) parts.push(`limit=${view.limit}`);
    if (view.selected !== null) parts.push(`id=${encodeURIComponent(view.selected)}`);
    history.replaceState(null, "", parts.length ? `#${parts.join("&")}` : location.pathname + location.search);
  }

  // --- fetching -------------------------------------------------------------------------------
  async function getJSON(url) {
    let response;
    try {
      response = await fetch(url, { headers: { Accept: "application/json" }, cache: "no-store" });
    } catch (error) {
      throw new Error(`sidecar unreachable (${error.message})`);
    }
    const text = await response.text();
    let body = null;
    try { body = JSON.parse(text); } catch { /* reported below */ }
    if (!response.ok || body === null) {
      const reason = body?.error?.message ?? (body === null ? "not JSON" : text);
      throw new Error(`GET ${url}: HTTP ${response.status}: ${reason}`);
    }
    return { body, response };
  }

  async function refresh() {
    clearTimeout(timer);
    const mine = ++generation;
    const [requests, scheduler] = await Promise.allSettled([
      getJSON(view.limit === null ? "requests" : `requests?limit=${view.limit}`),
      getJSON("scheduler"),
    ]);
    if (mine !== generation) return; // a newer refresh started meanwhile: its answers win
    const error = $("error");
    if (requests.status === "fulfilled") {
      const { body, response } = requests.value;
      records = [...(body.inflight || []), ...(body.recent || [])];
      held = (body.held?.inflight ?? 0) + (body.held?.recent ?? 0);
      limitChoices(body.limit, body.max_limit);
      const sidecarTime = Number(response.headers.get("x-sidecar-time"));
      if (sidecarTime > 0) clockOffset = sidecarTime - Date.now() / 1000;
      loaded = true;
      error.hidden = true;
      document.body.classList.remove("stale");
      setText($("status"), `${paused ? "paused · " : ""}updated ${clock(Date.now() / 1000)}`);
    } else {
      error.hidden = false;
      setText(error, `${requests.reason.message} — showing the last data seen; retrying every ${interval()} s`);
      document.body.classList.add("stale");
    }
    if (scheduler.status === "fulfilled") {
      renderScheduler(scheduler.value.body);
      setText($("scheduler-status"), "");
    } else {
      setText($("scheduler-status"), `unavailable: ${scheduler.reason.message}`);
    }
    render();
    if (!paused) timer = setTimeout(refresh, interval() * 1000);
  }
  const interval = () => Number($("interval").value) || 2;

  // The limit control offers LIMITS up to the server's maximum, the maximum itself ("all") and
  // the limit in force; rebuilt only when that set changes, so an open list is not disturbed.
  function limitChoices(applied, maximum) {
    if (!(applied > 0 && maximum > 0)) return;
    const values = [...new Set([...LIMITS.filter((v) => v < maximum), applied, maximum])]
      .sort((a, b) => a - b);
    const select = $("limit");
    if ([...select.options].map((o) => o.value).join() !== values.join()) {
      select.replaceChildren(...values.map((v) => {
        const option = el("option", "", v === maximum ? `${v} (all)` : v);
        option.value = String(v);
        return option;
      }));
    }
    select.value = String(applied);
  }

  // --- the timeline ---------------------------------------------------------------------------
  function span(r, at) {
    const phases = r.phases || {};
    const live = !("done" in phases);
    const marks = [["received", 0], ...MARKS.filter((m) => m in phases).map((m) => [m, phases[m]])];
    marks.sort((a, b) => a[1] - b[1]);
    const end = Math.max(live ? at - r.started_at : phases.done, marks[marks.length - 1][1]);
    const order = Object.keys(SEGMENT);
    const segments = [];
    let kind = "received";
    marks.forEach(([from, t0], i) => {
      if (order.indexOf(from) > order.indexOf(kind)) kind = from;
      const next = marks[i + 1];
      const to = next ? next[0] : live ? "now" : "done", t1 = next ? next[1] : end;
      const last = segments[segments.length - 1];
      if (last && last.kind === kind) Object.assign(last, { to, t1 });
      else segments.push({ kind, from, to, t0, t1 });
    });
    return { start: r.started_at, end, live, segments };
  }

  function render() {
    const at = now();
    const shown = records.filter((r) => view.states.has(r.state) && view.decisions.has(decisionOf(r)));
    const spans = shown.map((r) => span(r, at));
    let axis = null;
    if (view.axis === "shared" && spans.length) {
      const t0 = Math.min(...spans.map((s) => s.start));
      const t1 = Math.max(...spans.map((s) => s.start + s.end));
      axis = { kind: "shared", t0, width: Math.max(t1 - t0, 0.001) };
    } else if (view.axis === "log" && spans.length) {
      // Whole decades, from one below the shortest request's (so even it gets a decade of width)
      // to the longest's, at least two.
      const ends = spans.map((s) => Math.log10(Math.max(s.end, FLOOR_S)));
      const e0 = Math.floor(Math.min(...ends)) - 1;
      axis = { kind: "log", e0, e1: Math.max(Math.ceil(Math.max(...ends)), e0 + 2) };
    }
    drawTicks(axis);
    const body = $("rows");
    const kept = new Set();
    const selectedIndex = shown.findIndex((r) => r.id === view.selected);
    shown.forEach((r, i) => {
      let key = `${r.id}\u0000${r.started_at}`;
      while (kept.has(key)) key += "+";
      kept.add(key);
      let tr = rows.get(key);
      if (!tr) {
        tr = el("tr");
        tr.tabIndex = 0;
        rows.set(key, tr);
      }
      fillRow(tr, r, spans[i], axis, i === selectedIndex);
      if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null);
    });
    for (const [key, tr] of rows) {
      if (!kept.has(key)) { tr.remove(); rows.delete(key); }
    }
    const empty = $("empty");
    empty.hidden = shown.length > 0 || !loaded;
    setText(empty, records.length ? "No request matches the filters." : "No requests yet: none served since the sidecar started.");
    const inflight = records.filter((r) => IN_FLIGHT.has(r.state)).length;
    const beyond = held > records.length ? ` · ${held - records.length} beyond the limit` : "";
    setText($("counts"), loaded ? `${shown.length} shown of ${held} held${beyond} · ${inflight} in flight` : "");
    renderDetail();
  }

  function fillRow(tr, r, s, axis, selected) {
    const decision = decisionOf(r);
    tr.className = `row d-${decision} o-${outcomeOf(r)}${selected ? " selected" : ""}`;
    tr.setAttribute("aria-selected", String(selected));
    tr.dataset.id = r.id;
    tr.dataset.state = r.state;
    tr.dataset.decision = decision;

    const request = el("td", "request");
    request.title = r.id;
    request.append(el("code", "rid", r.id), el("span", "sub", `${(r.path || "").replace("/v1/", "")} · ${clock(r.started_at)}`));
    const placement = el("td", "decision");
    const why = [r.reason, r.fallback_reason && `fallback ${r.fallback_reason}`].filter(Boolean).join(" · ");
    placement.append(el("span", `pill d-${decision}`, decision), el("span", "sub", why));
    placement.title = [why, r.prefill_endpoint && `prefill ${r.prefill_endpoint}`].filter(Boolean).join("\n");
    const prefill = el("td", "endpoint");
    const where = decision === "remote" ? r.prefill_endpoint || "—" : decision === "local" ? "local" : "—";
    // A local request may have fallen back from a prefill server (its endpoint is kept).
    const note = decision === "local" && r.prefill_endpoint ? `fell back from ${r.prefill_endpoint}`
      : r.prefill_attempts > 1 ? `${r.prefill_attempts} attempts` : "";
    prefill.append(el("code", "where", where), el("span", "sub", note));
    prefill.title = [where, note].filter(Boolean).join("\n");
    const state = el("td", "state");
    const detail = [r.status, r.error].filter((v) => v !== null && v !== undefined).join(" · ");
    state.append(el("span", `pill o-${outcomeOf(r)}`, r.state), el("span", "sub", detail));
    state.title = detail;
    const total = el("td", "num", s.live ? `${duration(s.end)}…` : duration(s.end));
    total.title = Object.entries(r.durations_ms || {})
      .map(([name, ms]) => `${name}: ${ms === null ? "–" : duration(ms / 1000)}`).join("\n");
    const track = el("td", "track");
    const lane = el("div", "lane");
    lane.append(bar(s, axis));
    track.append(lane);
    tr.replaceChildren(request, placement, prefill, state, total, track);
  }

  function bar(s, axis) {
    const node = el("div", `bar${s.live ? " live" : ""}`);
    if (axis?.kind === "shared") {
      node.style.left = pct((s.start - axis.t0) / axis.width);
      node.style.width = pct(s.end / axis.width);
    } else {
      node.style.left = "0%";
      node.style.width = axis ? pct(logFraction(s.end, axis)) : "100%";
    }
    for (const g of s.segments) {
      const segment = el("span", `seg seg-${g.kind}${g.to === "now" ? " running" : ""}`);
      segment.dataset.phase = SEGMENT[g.kind];
      segment.dataset.from = g.from;
      segment.dataset.to = g.to;
      segment.style.width = s.end > 0 ? pct((g.t1 - g.t0) / s.end) : `${100 / s.segments.length}%`;
      segment.title = `${SEGMENT[g.kind]}: ${g.from} → ${g.to}, ${duration(g.t1 - g.t0)}`;
      node.append(segment);
    }
    return node;
  }

  const logFraction = (seconds, axis) =>
    (Math.log10(Math.max(seconds, 10 ** axis.e0)) - axis.e0) / (axis.e1 - axis.e0);
  function decade(e) { // 10^e seconds, as a tick's label
    if (e < -3) return `${10 ** (e + 6)} µs`;
    return e < 0 ? `${10 ** (e + 3)} ms` : `${10 ** e} s`;
  }

  function drawTicks(axis) {
    const ticks = $("ticks");
    ticks.replaceChildren();
    if (!axis) {
      if (view.axis === "fit") ticks.append(el("span", "tick-note", "each bar spans its own request"));
      return;
    }
    if (axis.kind === "log") {
      const every = Math.ceil((axis.e1 - axis.e0) / 6); // at most about 7 labels
      for (let e = axis.e0; e <= axis.e1; e += every) {
        const tick = el("span", "tick", decade(e));
        tick.style.left = pct((e - axis.e0) / (axis.e1 - axis.e0));
        ticks.append(tick);
      }
      return;
    }
    const raw = axis.width / 5;
    const magnitude = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 5, 10].map((m) => m * magnitude).find((v) => v >= raw);
    for (let t = 0; t <= axis.width + step / 1000; t += step) {
      const tick = el("span", "tick", t === 0 ? clock(axis.t0) : `+${duration(t)}`);
      tick.style.left = pct(t / axis.width);
      ticks.append(tick);
    }
  }

  // --- the selected record --------------------------------------------------------------------
  function renderDetail() {
    const id = view.selected;
    $("detail-hint").hidden = id !== null;
    $("detail-body").hidden = id === null;
    if (id === null) { lastCopy = null; return; }
    const current = records.find((r) => r.id === id);
    if (current) lastCopy = current;
    else if (lastCopy && lastCopy.id !== id) lastCopy = null;
    if (!current && !lastCopy && loaded && fetching !== id) fetchOne(id);
    const record = current || lastCopy;
    setText($("detail-id"), id);
    $("detail-link").href = `requests/${encodeURIComponent(id)}`;
    const note = $("detail-note");
    note.hidden = Boolean(current);
    setText(note, record ? "Not in the list now (history size, limit): the last copy seen."
      : lookupError || "Not in the list: looking it up…");
    if (!record) return;
    const d = record.durations_ms || {};
    definitions($("detail-summary"), [
      ["decision", [decisionOf(record), record.reason, record.fallback_reason].filter(Boolean).join(" · ")],
      ["state", [record.state, record.status].filter((v) => v !== null).join(" · ")],
      ["engine id", record.engine_id],
      ["prefill", record.prefill_endpoint && `${record.prefill_endpoint} · ${record.prefill_attempts} attempt(s)`],
      ["predicted", record.prefill_predicted_ms !== null ? duration(record.prefill_predicted_ms / 1000) : null],
      ["predicted cached", record.prefill_predicted_cached_tokens ? `${record.prefill_predicted_cached_tokens} tokens on the prefill server` : null],
      ["cached from", record.cached_source ? (record.cached_source === "events" ? "the engine's KV events" : "the approximate index") : null],
      ["token ids", record.tokenize_ms != null ? `${duration(record.tokenize_ms / 1000)} (decode engine's /tokenize)` : null],
      ["observed", record.prefill_observed_ms !== null ? duration(record.prefill_observed_ms / 1000) : null],
      ["durations", ["prefill", "ttft", "decode", "total"].filter((n) => d[n] != null)
        .map((n) => `${n} ${duration(d[n] / 1000)}`).join(" · ")],
      ["error", record.error],
    ]);
    setText($("detail-json"), JSON.stringify(record, null, 2));
  }

  async function fetchOne(id) {
    fetching = id;
    try {
      const { body } = await getJSON(`requests/${encodeURIComponent(id)}`);
      if (view.selected === id) lastCopy = body;
    } catch (error) {
      if (view.selected === id) lookupError = error.message;
    }
    renderDetail();
  }

  function select(id) {
    view.selected = id;
    fetching = lookupError = null;
    writeHash();
    render();
  }

  // --- the scheduler --------------------------------------------------------------------------
  function renderScheduler(s) {
    setText($("scheduler-json"), JSON.stringify(s, null, 2));
    const parts = [];
    const local = s.local || {};
    parts.push(definitions(el("dl", "kv"), [
      ["policy", s.policy && `${s.policy}${s.choices ? ` · choices ${s.choices}` : ""}`],
      ["disaggregate", s.disagg_min_tokens === undefined ? null
        : `from ${s.disagg_min_tokens} uncached tokens · TTFT ratio ${s.disagg_ttft_ratio}`],
      ["discovery", brief(s.discovery) || "no pool configured"],
      ["shared state", brief(s.state_backend)],
      ["decisions", brief(s.decisions) || "none yet"],
      ["prefill prefix index", prefixIndex(s.prefill_prefixes)],
    ]));
    parts.push(el("h3", "", "local decode engine"), definitions(el("dl", "kv"), [
      ["ahead", local.ahead_tokens === undefined ? null : `${local.ahead_tokens} prefill tokens`],
      ["load", load(local.scraped) || "not scraped yet"],
      ["speed", speed(local.speed)],
      ["prefix index", local.prefix_index_blocks === undefined ? null : `${local.prefix_index_blocks} blocks`],
    ]));
    const endpoints = Array.isArray(s.endpoints) ? s.endpoints : [];
    parts.push(el("h3", "", `prefill endpoints (${endpoints.length})`));
    if (!endpoints.length) parts.push(el("p", "hint", "None in the pool."));
    const list = el("ul", "endpoints");
    const held = (s.prefill_prefixes && s.prefill_prefixes.endpoints) || {};
    for (const e of endpoints) {
      const item = el("li");
      item.dataset.endpoint = e.endpoint;
      const head = el("p", "endpoint-head");
      head.append(el("code", "", e.endpoint), el("span", `pill e-${e.state}`, e.state));
      const away = e.ejected_for_s ?? e.ejected_elsewhere_for_s;
      item.append(head, definitions(el("dl", "kv"), [
        ["reserved", `${e.reserved_tokens} tokens · ${e.reserved_requests} requests (${e.inflight_here} from here)`],
        ["load", load(e.scraped) || "not scraped yet"],
        ["speed", speed(e.speed) && `${speed(e.speed)} · ${e.speed_samples} samples`],
        ["prefix cache", prefixes(held[e.endpoint])],
        ["failures", e.consecutive_failures ? `${e.consecutive_failures} in a row` : null],
        ["ejected", away === null || away === undefined ? null : `${duration(away)} more`],
      ]));
      list.append(item);
    }
    if (endpoints.length) parts.push(list);
    $("scheduler-body").replaceChildren(...parts);
  }
  function prefixIndex(p) {
    if (!p) return null;
    if (!p.enabled) return "off (prefix-blind)";
    const loop = p.feedback === "open" ? " · open-loop: the engines do not report cached tokens" : ` · feedback ${p.feedback}`;
    return `${p.blocks} of ${p.max_blocks} blocks of ${p.block_tokens} tokens · trust ${p.trust}${loop}`;
  }
  function prefixes(p) {
    if (!p) return null;
    const error = p.mean_abs_error_tokens === null ? "" : ` · error ±${p.mean_abs_error_tokens} tokens`;
    return `${p.blocks} of ${p.limit_blocks} blocks predicted held${error}`;
  }
  function load(scraped) {
    if (!scraped) return null;
    const kv = typeof scraped.kv_usage === "number" ? ` · KV ${(scraped.kv_usage * 100).toFixed(0)}%` : "";
    return `${scraped.waiting ?? "?"} waiting · ${scraped.running ?? "?"} running${kv} · ${duration(scraped.age_s)} ago`;
  }
  function speed(value) {
    if (!value || typeof value.s_per_token !== "number") return null;
    return `${(value.s_per_token * 1000).toFixed(3)} ms/token + ${duration(value.overhead_s)}`;
  }

  // --- wiring ---------------------------------------------------------------------------------
  $("filters").addEventListener("change", () => {
    const boxes = [...$("filters").querySelectorAll("input[type=checkbox]:checked")];
    view.states = new Set(boxes.filter((b) => b.name === "state").map((b) => b.value));
    view.decisions = new Set(boxes.filter((b) => b.name === "decision").map((b) => b.value));
    writeHash();
    render();
  });
  $("axis").addEventListener("change", () => { view.axis = $("axis").value; writeHash(); render(); });
  $("limit").addEventListener("change", () => { view.limit = Number($("limit").value); writeHash(); refresh(); });
  $("interval").addEventListener("change", () => { if (!paused) refresh(); });
  $("pause").addEventListener("click", () => {
    paused = !paused;
    pausedAt = Date.now() / 1000 + clockOffset;
    $("pause").textContent = paused ? "Resume" : "Pause";
    $("pause").setAttribute("aria-pressed", String(paused));
    clearTimeout(timer);
    if (paused) setText($("status"), `paused · ${$("status").textContent.replace(/^paused · /, "")}`);
    else refresh();
  });
  $("rows").addEventListener("click", (event) => {
    const tr = event.target.closest("tr");
    if (tr) select(tr.dataset.id);
  });
  $("rows").addEventListener("keydown", (event) => {
    const tr = event.target.closest("tr");
    if (!tr) return;
    if (event.key === "Enter" || event.key === " ") { event.preventDefault(); select(tr.dataset.id); }
    const next = { ArrowDown: tr.nextElementSibling, ArrowUp: tr.previousElementSibling }[event.key];
    if (next) { event.preventDefault(); next.focus(); }
  });
  $("detail-close").addEventListener("click", () => select(null));
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && view.selected !== null) select(null);
  });
  window.addEventListener("hashchange", () => {
    const limit = view.limit;
    fetching = lookupError = null;
    readHash();
    if (view.limit !== limit) refresh();
    else render();
  });
  setInterval(() => {
    if (!paused && records.some((r) => IN_FLIGHT.has(r.state))) render();
  }, TICK_MS);

  readHash();
  refresh();
})();
