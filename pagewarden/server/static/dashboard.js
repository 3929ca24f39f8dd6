// pagewarden dashboard: polls /dashboard/state once a second and draws it with plain
// DOM and SVG (no library, nothing fetched from elsewhere). Schema: docs/dashboard.md.
"use strict";

const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
// One letter per block in snapshot.blocks / snapshot.host_blocks -> state (CSS class).
const STATES = {
  R: "reserved", F: "free", C: "cached", U: "used", S: "shared", Q: "quarantined", X: "retired",
};
const HOST_STATES = { F: "free", U: "swapped" };
const LEGEND = [
  ["free", "free"], ["cached", "cached-free (prefix kept)"], ["used", "used"],
  ["shared", "shared"], ["quarantined", "quarantined"], ["retired", "retired"],
  ["reserved", "reserved"], ["swapped", "host: swapped out"], ["faulted", "was quarantined"],
];
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563"];

const $ = (id) => document.getElementById(id);
let snapshot = null; // the latest one drawn (the tooltip reads it)

// Strip ?key= from the address bar: the server set a cookie that carries it from now on.
if (new URLSearchParams(location.search).has("key")) {
  history.replaceState(null, "", location.pathname);
}

function el(tag, attrs, text) {
  const node = tag.startsWith("svg:")
    ? document.createElementNS(SVG, tag.slice(4))
    : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawLegend() {
  const legend = $("legend");
  for (const [cls, label] of LEGEND) {
    const color = cls === "faulted" ? "var(--free)" : `var(--${cls})`;
    const ring = cls === "faulted" ? "inset 0 0 0 2px var(--fault)" : "none";
    legend.append(el("span", { style: `--c: ${color}; --ring: ${ring}` }, label));
  }
}

// ---- block maps -----------------------------------------------------------------
function cellSize(n) {
  return n <= 512 ? 14 : n <= 2048 ? 10 : n <= 8192 ? 7 : 5;
}

function drawMap(container, letters, names, faulted) {
  if (container.childElementCount !== letters.length) {
    container.replaceChildren();
    container.style.setProperty("--cell", cellSize(letters.length) + "px");
    const frag = document.createDocumentFragment();
    for (let i = 0; i < letters.length; i++) frag.append(el("div", { "data-i": i }));
    container.append(frag);
  }
  const cells = container.children;
  for (let i = 0; i < letters.length; i++) {
    const cls = "cell " + names[letters[i]] + (faulted && faulted[i] ? " faulted" : "");
    if (cells[i].className !== cls) cells[i].className = cls;
  }
}

function blockTooltip(i) {
  const state = STATES[snapshot.blocks[i]];
  const holders = snapshot.holders[i] || [];
  let text = `block ${i} · ${state}`;
  if (holders.length) text += ` · held by ${holders.join(", ")}`;
  const q = snapshot.quarantines[i];
  if (q) text += ` · quarantined ${q}×`;
  return text;
}

function hostTooltip(i) {
  const holder = snapshot.host_holders[i];
  return `host block ${i} · ${holder ? "holds " + holder : "free"}`;
}

function wireTooltip(container, describe) {
  const tip = $("tooltip");
  container.addEventListener("mousemove", (ev) => {
    const i = ev.target.dataset && ev.target.dataset.i;
    if (i === undefined || !snapshot) { tip.hidden = true; return; }
    tip.textContent = describe(Number(i));
    tip.style.left = ev.clientX + 12 + "px";
    tip.style.top = ev.clientY + 12 + "px";
    tip.hidden = false;
  });
  container.addEventListener("mouseleave", () => { tip.hidden = true; });
}

// ---- tables ---------------------------------------------------------------------
function fillTable(tbody, rows, empty, columns) {
  const frag = document.createDocumentFragment();
  if (!rows.length) {
    const tr = el("tr");
    tr.append(el("td", { colspan: columns, class: "empty" }, empty));
    frag.append(tr);
  }
  for (const row of rows) frag.append(row);
  tbody.replaceChildren(frag);
}

function requestRows(snap) {
  return snap.requests.map((r) => {
    const tr = el("tr", { class: r.status });
    tr.append(el("td", { class: "id", title: r.id }, r.id), el("td", {}, r.status));
    for (const v of [r.prompt_tokens, r.output_tokens, r.computed_tokens, r.blocks, r.preemptions]) {
      tr.append(el("td", { class: "num" }, String(v)));
    }
    return tr;
  });
}

function eventRows(snap) {
  return snap.events.map((e) => {
    const tr = el("tr", { class: "event" });
    const rolled = Object.entries(e.rolled_back).map(([r, p]) => `${r}@${p}`).join(", ");
    tr.append(
      el("td", {}, new Date(e.time * 1000).toLocaleTimeString()),
      el("td", { class: "num" }, String(e.step)),
      el("td", {}, e.kind),
      el("td", {}, e.found_by),
      el("td", { class: "blocks" }, e.blocks.join(", ")),
      el("td", { title: e.detail }, rolled || "none"),
    );
    return tr;
  });
}

// ---- charts ---------------------------------------------------------------------
// Each chart: a title and the series it draws, as [label, column of state.series].
const CHARTS = [
  ["KV cache usage %", (s) => [["used", s.kv_usage.map((v) => v * 100)]], 100],
  ["Requests", (s) => [["running", s.running], ["waiting", s.waiting], ["swapped", s.swapped]]],
  ["Tokens / s", (s) => [["generated", s.generation_tps], ["prompt", s.prompt_tps]]],
  ["Time to first token (ms)", (s) => [["p50", s.ttft_p50_ms], ["p99", s.ttft_p99_ms]]],
  ["Inter-token latency (ms)", (s) => [["p50", s.itl_p50_ms], ["p99", s.itl_p99_ms]]],
  ["Admission rejections / s", (s) => [["429s", s.admission_rejections_ps]]],
  ["Integrity checks / s", (s) => [["tag checks", s.tag_checks_ps], ["block verifies", s.block_verifies_ps]]],
  ["Integrity failures (kind/found by)", (s) => Object.entries(s.failures)],
  ["Recoveries and preemptions", (s) => [["recoveries", s.recoveries], ["preemptions", s.preemptions]]],
  ["Batch limit (max_num_seqs)", (s) => [["max_num_seqs", s.max_num_seqs]]],
];

function fmt(v) {
  if (v === null || v === undefined) return "–";
  const a = Math.abs(v);
  return a >= 1000 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : v.toFixed(2);
}

function drawChart(box, title, t, series, fixedMax, note) {
  const W = 300, H = 100, L = 30, B = 12;
  const values = series.flatMap(([, col]) => col.filter((v) => v !== null));
  const max = fixedMax || Math.max(1e-9, ...values) * 1.1;
  const t0 = t.length ? t[0] : 0, t1 = t.length ? t[t.length - 1] : 1;
  const x = (ti) => L + ((ti - t0) / Math.max(t1 - t0, 1)) * (W - L - 2);
  const y = (v) => H - B - (v / max) * (H - B - 4);
  const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  svg.append(
    el("svg:line", { x1: L, y1: H - B, x2: W, y2: H - B, stroke: "#d1d5db" }),
    el("svg:text", { x: 2, y: 10 }, fmt(max)),
    el("svg:text", { x: 2, y: H - B }, "0"),
    el("svg:text", { x: L, y: H - 1 }, t.length ? `-${Math.round(t1 - t0)} s` : ""),
  );
  const keys = el("div", { class: "keys" });
  series.forEach(([label, col], k) => {
    const color = COLORS[k % COLORS.length];
    let d = "";
    col.forEach((v, i) => {
      if (v === null) return;
      const prev = i > 0 ? col[i - 1] : null;
      d += `${prev === null ? "M" : "L"}${x(t[i]).toFixed(1)},${y(v).toFixed(1)}`;
    });
    svg.append(el("svg:path", { d, fill: "none", stroke: color, "stroke-width": 1.5, "vector-effect": "non-scaling-stroke" }));
    const last = col.length ? col[col.length - 1] : null;
    const key = el("span", { style: `color: ${color}` }, `${label} `);
    key.append(el("b", {}, fmt(last)));
    keys.append(key);
  });
  if (!series.length) keys.append(el("span", {}, "none so far"));
  if (note) keys.append(el("span", {}, note));
  box.replaceChildren(el("h3", {}, title), svg, keys);
}

function drawCharts(series, profile) {
  const root = $("charts");
  if (root.childElementCount !== CHARTS.length) {
    root.replaceChildren(...CHARTS.map(() => el("div", { class: "chart" })));
  }
  CHARTS.forEach(([title, pick, max], i) => {
    const note = i === CHARTS.length - 1 ? `profile: ${profile}` : "";
    drawChart(root.children[i], title, series.t, pick(series), max, note);
  });
}

// ---- the poll -------------------------------------------------------------------
function render(state) {
  $("model").textContent = state.model;
  const profile = $("profile");
  profile.textContent = "profile: " + state.profile;
  profile.className = "badge" + (state.profile === "normal" ? "" : " safe");
  const engine = $("engine");
  engine.textContent = state.engine.alive ? "engine up" : "engine down";
  engine.className = "badge " + (state.engine.alive ? "ok" : "bad");
  const kv = state.kv;
  if (kv) {
    // The engine's counts of its latest step: the very numbers /metrics exports
    // (pagewarden:kv_blocks_*), so the two agree; the map below may be older (its caption
    // says how old).
    const summary = $("kv-summary");
    summary.textContent =
      `${kv.used} used · ${kv.cached} cached · ${kv.free} free · ${kv.quarantined} ` +
      `quarantined · ${kv.retired} retired of ${kv.total} at step ${kv.step}`;
    summary.dataset.used = kv.used;
    summary.dataset.step = kv.step;
  }
  const snap = state.snapshot;
  if (snap) {
    const shared = snap.blocks.split("").filter((l) => l === "S").length;
    const host = snap.host_blocks;
    const swapped = host.split("").filter((l) => l === "U").length;
    $("host-summary").textContent = host.length ? `${swapped} of ${host.length} hold swapped KV` : "none";
    snapshot = snap;
    $("meta").textContent =
      `block map of step ${snap.step} (${shared} shared), ${snap.age_s.toFixed(1)} s old, took ` +
      `${(snap.cost_s * 1000).toFixed(2)} ms · ${state.engine.restarts} restarts`;
    const faulted = snap.blocks.split("").map((_, i) => (snap.quarantines[i] || 0) > 0);
    drawMap($("blockmap"), snap.blocks, STATES, faulted);
    drawMap($("hostmap"), snap.host_blocks, HOST_STATES, null);
    $("blockmap").dataset.step = snap.step;
    $("req-summary").textContent =
      `${snap.num_running} running · ${snap.num_waiting} waiting · ${snap.num_swapped} swapped`;
    fillTable($("requests").tBodies[0], requestRows(snap), "no requests", 7);
    fillTable($("events").tBodies[0], eventRows(snap), "no integrity events", 6);
  }
  renderTiers(state.tiers);
  drawCharts(state.series, state.profile);
}

// The KV tiers' counters of the latest step: the same numbers /metrics exports
// (pagewarden:kv_tier_*); the section stays hidden on an engine without tiers.
function renderTiers(t) {
  $("tiers-section").hidden = !t;
  if (!t) return;
  const rows = Object.entries(t.tiers).map(([name, c]) => {
    const rejected = Object.entries(c.rejected).map(([r, n]) => `${r}: ${n}`).join(", ");
    const total = Object.values(c.rejected).reduce((a, b) => a + b, 0);
    const tr = el("tr", { "data-tier": name });
    tr.append(el("td", {}, name));
    for (const v of [c.hits, c.stores, total ? `${total} (${rejected})` : "0", c.errors, c.bytes]) {
      tr.append(el("td", { class: "num" }, String(v)));
    }
    return tr;
  });
  fillTable($("tiers").tBodies[0], rows, "no tiers", 6);
  const perLoad = t.loads ? ` · ${((t.load_seconds / t.loads) * 1000).toFixed(2)} ms per load` : "";
  $("tiers-summary").textContent =
    `${t.misses} misses · ${t.offload_dropped} not offloaded (queue full) · ` +
    `${t.offload_unverified} failed their seal · ${t.load_timeouts ?? 0} loads timed out${perLoad}`;
}

function notice(text) {
  const n = $("notice");
  n.hidden = !text;
  n.textContent = text || "";
}

async function poll() {
  try {
    const r = await fetch("/dashboard/state", { credentials: "same-origin", cache: "no-store" });
    if (r.status === 401) {
      notice("This server wants an API key: open /dashboard?key=YOUR_KEY");
    } else if (!r.ok) {
      notice(`/dashboard/state answered ${r.status}`);
    } else {
      render(await r.json());
      notice("");
    }
  } catch (err) {
    notice(`cannot reach the server (${err.message}); retrying`);
  }
  setTimeout(poll, POLL_MS);
}

drawLegend();
wireTooltip($("blockmap"), blockTooltip);
wireTooltip($("hostmap"), hostTooltip);
poll();
