// cri-resmgr web UI: plain JS, SVG for the topology grid, canvas for the time heatmap.
// It only reads the agent's REST API (/api/v1/...), the same one documented at /openapi.json.
"use strict";

const $ = (sel) => document.querySelector(sel);
const SVG_NS = "http://www.w3.org/2000/svg";
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
const CPU_GROUPS = ["cpu", "core", "die", "numa_node", "package"];
const CONTAINER_GROUPS = ["container", "pod"];

const state = {
  catalogue: [],
  serverOffset: 0,     // server clock minus browser clock, seconds (from the topology response's `at`)
  topo: null,          // last /api/v1/heatmap/topology response
  heatmap: null,       // last /api/v1/heatmap response
  containers: [],
  plan: null,          // last /api/v1/rebalancer/plan round's plan (null: no rebalancer or no round yet)
  selectedMove: null,  // container_id of the move outlined on the topology grid
  selectedCpu: null,
  sort: { key: "namespace", asc: true },
  timer: null,
  busy: false,
};

// ---------------------------------------------------------------------------------------------
// helpers

// The read token (api.read_token) when the agent asks for one: typed in by the user, kept for this tab only
// (sessionStorage), sent as a bearer header and never put in a URL.
const TOKEN_KEY = "cri-resmgr-token";

class Unauthorized extends Error {}

function authHeaders() {
  const t = sessionStorage.getItem(TOKEN_KEY);
  return t ? { Authorization: "Bearer " + t } : {};
}

async function fetchApi(url) {
  const r = await fetch(url, { headers: authHeaders(), cache: "no-store" });
  if (r.status === 401) {
    const had = sessionStorage.getItem(TOKEN_KEY) !== null;
    throw new Unauthorized(had ? "the token was not accepted (api.read_token)" : "this agent asks for a read token");
  }
  return r;
}

async function api(path, params) {
  const url = new URL(path, window.location.origin);
  for (const [k, v] of Object.entries(params || {})) {
    if (v !== undefined && v !== null && v !== "") url.searchParams.set(k, v);
  }
  const r = await fetchApi(url);
  if (!r.ok) {
    let detail = r.statusText;
    try { detail = (await r.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new Error(`${url.pathname}: ${r.status} ${typeof detail === "string" ? detail : JSON.stringify(detail)}`);
  }
  return r.json();
}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function scaled(v, steps) {
  for (const [div, suffix] of steps) if (Math.abs(v) >= div) return (v / div).toFixed(1) + suffix;
  return null;
}

// Display of one value in its unit; the exact value stays in data-value attributes.
function fmt(v, unit) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (unit === "ratio") return (v * 100).toFixed(1) + "%";
  if (unit === "bytes" || unit === "bytes/s") {
    const s = scaled(v, [[2 ** 40, " TiB"], [2 ** 30, " GiB"], [2 ** 20, " MiB"], [2 ** 10, " KiB"]]);
    return (s || v.toFixed(0) + " B") + (unit === "bytes/s" ? "/s" : "");
  }
  if (unit === "hertz") return (v / 1e9).toFixed(2) + " GHz";
  if (unit === "seconds") return v.toPrecision(3) + " s";
  const s = scaled(v, [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]);
  const base = s || (Number.isInteger(v) ? String(v) : v.toPrecision(3));
  return unit && unit !== "1/s" && unit !== "" ? `${base} ${unit}` : (unit === "1/s" ? base + "/s" : base);
}

function domain(values, unit) {
  const xs = values.filter((v) => v !== null && !Number.isNaN(v));
  // Ratios keep a fixed 0..1 scale, unless they exceed it (CPU seconds per second of a multi-CPU container).
  if (unit === "ratio") return [0, Math.max(1, ...xs)];
  if (!xs.length) return [0, 1];
  let lo = Math.min(...xs), hi = Math.max(...xs);
  if (lo > 0) lo = 0;
  if (hi === lo) hi = lo + 1;
  return [lo, hi];
}

function colour(v, [lo, hi]) {
  if (v === null || v === undefined || Number.isNaN(v)) return "#e5e7eb";
  const t = Math.min(1, Math.max(0, (v - lo) / (hi - lo))) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - i;
  const c = VIRIDIS[i].map((a, k) => Math.round(a + (VIRIDIS[i + 1][k] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

function textColour(fill) {
  const m = /rgb\((\d+),(\d+),(\d+)\)/.exec(fill);
  if (!m) return "#374151";
  const [r, g, b] = m.slice(1).map(Number);
  return 0.299 * r + 0.587 * g + 0.114 * b > 140 ? "#111827" : "#ffffff";
}

function legend(node, [lo, hi], unit) {
  node.replaceChildren();
  const bar = el("i");
  bar.style.background = `linear-gradient(to right, ${VIRIDIS.map((c) => `rgb(${c})`).join(",")})`;
  node.append(el("span", {}, fmt(lo, unit)), bar, el("span", {}, fmt(hi, unit)));
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

function serverNow() {
  return Date.now() / 1000 + state.serverOffset;
}

function showError(err) {
  if (err instanceof Unauthorized) {
    askToken(err.message);
    return;
  }
  $("#status").textContent = String(err.message || err);
  console.error(err);
}

// 401: show the token form; a token typed in is tried at once (the form stays up with the reason if refused).
function askToken(reason) {
  clearTimeout(state.timer);
  $("#login-reason").textContent = reason;
  $("#login").hidden = false;
  $("#token").focus();
}

async function useToken(ev) {
  ev.preventDefault();
  const t = $("#token").value.trim();
  $("#token").value = "";
  if (t) sessionStorage.setItem(TOKEN_KEY, t); else sessionStorage.removeItem(TOKEN_KEY);
  $("#login").hidden = true;
  await start();
}

// The CSV link: with a token the browser cannot send the header on a plain link, so fetch and save it.
async function downloadCsv(ev) {
  if (!sessionStorage.getItem(TOKEN_KEY)) return;  // no token: the link works as it is
  ev.preventDefault();
  try {
    const r = await fetchApi(ev.currentTarget.href);
    if (!r.ok) throw new Error(`CSV: ${r.status} ${r.statusText}`);
    const a = el("a", { href: URL.createObjectURL(await r.blob()), download: "heatmap.csv" });
    a.click();
    URL.revokeObjectURL(a.href);
  } catch (err) {
    showError(err);
  }
}

function hashState() {
  return Object.fromEntries(new URLSearchParams(window.location.hash.slice(1)));
}

function saveHash() {
  const h = new URLSearchParams({
    topo: $("#topo-metric").value, hm: $("#hm-metric").value, by: $("#hm-by").value,
    span: $("#hm-span").value, top: $("#hm-top").value, refresh: $("#refresh").value,
  });
  history.replaceState(null, "", "#" + h.toString());
}

// ---------------------------------------------------------------------------------------------
// metric pickers
function fillSelect(select, options, wanted) {
  const cur = wanted || select.value;
  const names = options.map((o) => o.value);
  if (select.options.length === options.length && [...select.options].every((o, i) => o.value === names[i])) {
    if (cur && names.includes(cur)) select.value = cur;
    return;
  }
  select.replaceChildren(...options.map((o) => el("option", { value: o.value, title: o.title || "" }, o.label)));
  if (cur && names.includes(cur)) select.value = cur;
}

function metricInfo(name) {
  return state.catalogue.find((m) => m.name === name);
}

async function loadCatalogue(initial) {
  state.catalogue = await api("/api/v1/heatmap/metrics");
  const h = initial ? hashState() : {};
  const perCpu = state.catalogue.filter((m) => m.per_cpu);
  const opt = (m) => ({ value: m.name, label: m.name.replace(/^cri_resmgr_/, ""), title: m.help });
  fillSelect($("#topo-metric"), perCpu.map(opt),
    h.topo || (initial && perCpu.some((m) => m.name === "cri_resmgr_cpu_utilization_ratio")
      ? "cri_resmgr_cpu_utilization_ratio" : undefined));
  const preferred = state.catalogue.some((m) => m.name === "cri_resmgr_container_cpu_usage_seconds_total")
    ? "cri_resmgr_container_cpu_usage_seconds_total" : "cri_resmgr_cpu_utilization_ratio";
  fillSelect($("#hm-metric"), state.catalogue.map(opt), h.hm || (initial ? preferred : undefined));
  fillGroups(h.by);
  if (initial) {
    if (h.span) $("#hm-span").value = h.span;
    if (h.top) $("#hm-top").value = h.top;
    if (h.refresh) $("#refresh").value = h.refresh;
  }
}

function fillGroups(wanted) {
  const m = metricInfo($("#hm-metric").value);
  let groups = CPU_GROUPS.concat(CONTAINER_GROUPS);
  if (m && m.per_cpu && !m.per_container) groups = CPU_GROUPS;
  if (m && m.per_container && !m.per_cpu) groups = CONTAINER_GROUPS;
  const cur = wanted || $("#hm-by").value;
  fillSelect($("#hm-by"), groups.map((g) => ({ value: g, label: g })), groups.includes(cur) ? cur : groups[0]);
  if (!groups.includes($("#hm-by").value)) $("#hm-by").value = groups[0];
}

// ---------------------------------------------------------------------------------------------
// topology grid
const CELL_W = 50, CELL_H = 22, GAP = 4, PAD = 8, TITLE = 16;

function drawTopology(t) {
  const svg = $("#topology");
  svg.replaceChildren();
  const values = [];
  for (const p of t.packages) for (const d of p.dies) for (const c of d.cores) for (const th of c.threads) values.push(th.value);
  const dom = domain(values, t.unit);
  legend($("#topo-legend"), dom, t.unit);
  svg.setAttribute("data-metric", t.metric);
  svg.setAttribute("data-at", String(t.at));
  svg.setAttribute("data-window", String(t.window_seconds));

  const defs = svgEl("defs");
  const pat = svgEl("pattern", { id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" });
  pat.append(svgEl("line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#000", "stroke-opacity": 0.35, "stroke-width": 2 }));
  defs.append(pat);
  svg.append(defs);

  let y = 0, width = 0;
  for (const p of t.packages) {
    const py = y;
    y += TITLE + PAD;
    let pw = 0;
    for (const d of p.dies) {
      const dy = y;
      y += TITLE;
      const maxThreads = Math.max(1, ...d.cores.map((c) => c.threads.length));
      const coreW = maxThreads * CELL_W + 2;
      const cols = Math.max(1, Math.min(d.cores.length, Math.floor(1100 / (coreW + GAP)), 16));
      d.cores.forEach((c, i) => {
        const cx = PAD * 2 + (i % cols) * (coreW + GAP);
        const cy = y + Math.floor(i / cols) * (CELL_H + 2 + GAP);
        svg.append(svgEl("rect", { class: "box core", x: cx, y: cy, width: coreW, height: CELL_H + 2, rx: 2 }));
        c.threads.forEach((th, k) => drawCell(svg, t, c, th, cx + 1 + k * CELL_W, cy + 1, dom));
      });
      const rows = Math.ceil(d.cores.length / cols);
      const dw = PAD * 2 + cols * (coreW + GAP) + PAD;
      y += rows * (CELL_H + 2 + GAP) + PAD;
      svg.append(svgEl("rect", { class: "box die", x: PAD, y: dy, width: dw, height: y - dy, rx: 3 }));
      svg.append(svgEl("text", { class: "label", x: PAD + 6, y: dy + 12 }, `die ${d.id}`));
      pw = Math.max(pw, dw + PAD);
      y += GAP;
    }
    svg.append(svgEl("rect", { class: "box package", x: 0, y: py, width: pw, height: y - py, rx: 4 }));
    svg.append(svgEl("text", { class: "label", x: 6, y: py + 13 }, `package ${p.id}`));
    width = Math.max(width, pw);
    y += PAD;
  }
  svg.setAttribute("width", width + 2);
  svg.setAttribute("height", y);
  svg.setAttribute("viewBox", `-1 -1 ${width + 2} ${y}`);
}

function drawCell(svg, t, core, th, x, y, dom) {
  const fill = colour(th.value, dom);
  const g = svgEl("g", {
    class: "cell", "data-cpu": th.cpu, "data-value": th.value === null ? "" : String(th.value),
    "data-sst": th.sst_priority || "", "data-containers": th.containers.length,
  });
  if (state.selectedCpu === th.cpu) g.classList.add("selected");
  g.append(svgEl("rect", { class: "v", x, y, width: CELL_W - 2, height: CELL_H, rx: 2, fill }));
  if (th.isolated) g.append(svgEl("rect", { x, y, width: CELL_W - 2, height: CELL_H, fill: "url(#hatch)" }));
  g.append(svgEl("text", { x: x + 3, y: y + 9, fill: textColour(fill), "font-size": 8 }, String(th.cpu)));
  g.append(svgEl("text", { class: "val", x: x + CELL_W - 5, y: y + CELL_H - 4, fill: textColour(fill), "text-anchor": "end" },
    fmt(th.value, t.unit)));
  if (th.sst_priority === "high") {
    g.append(svgEl("text", { x: x + CELL_W - 13, y: y + 9, fill: "#f59e0b", "font-size": 9 }, "★"));
  }
  const mv = selectedMove();
  const view = $("#plan-view").value;
  if (mv && view !== "after" && cpuInList(th.cpu, mv.from_cpus)) g.classList.add("plan-from");
  if (mv && view !== "before" && cpuInList(th.cpu, mv.to_cpus)) g.classList.add("plan-to");
  const names = th.containers.map((i) => t.containers[i]).map((c) => (c.pod ? `${c.namespace}/${c.pod}/` : "") + (c.name || c.container_id.slice(0, 12)));
  const lines = [
    `cpu ${th.cpu} · core ${core.core} (id ${core.core_id}) · NUMA ${th.numa_node}` + (core.l3_id !== null ? ` · L3 #${core.l3_id}` : ""),
    `${t.metric.replace(/^cri_resmgr_/, "")}: ${fmt(th.value, t.unit)}`,
    (th.sst_priority ? `SST-BF ${th.sst_priority} priority` : "SST-BF: no split") + (th.base_frequency_hz ? ` (base ${(th.base_frequency_hz / 1e9).toFixed(2)} GHz)` : ""),
    th.isolated ? "isolated (isolcpus)" : null,
    names.length ? `containers (${names.length}): ${names.slice(0, 8).join(", ")}${names.length > 8 ? ", …" : ""}` : "no containers",
  ].filter(Boolean);
  g.append(svgEl("title", {}, lines.join("\n")));
  g.addEventListener("click", () => {
    state.selectedCpu = state.selectedCpu === th.cpu ? null : th.cpu;
    for (const c of svg.querySelectorAll(".cell")) c.classList.toggle("selected", Number(c.dataset.cpu) === state.selectedCpu);
    renderContainers();
  });
  svg.append(g);
}

async function refreshTopology() {
  const metric = $("#topo-metric").value;
  if (!metric) return;
  const t = await api("/api/v1/heatmap/topology", { metric });
  state.serverOffset = t.at - Date.now() / 1000;
  state.topo = t;
  drawTopology(t);
}

// ---------------------------------------------------------------------------------------------
// time heatmap
async function refreshHeatmap() {
  const metric = $("#hm-metric").value;
  if (!metric) return;
  const by = $("#hm-by").value;
  const span = Number($("#hm-span").value);
  const end = state.topo ? state.topo.at : serverNow();
  // Never a step shorter than the metric's collection interval: a 5 s counter at 2.5 s steps would
  // leave every other column empty.
  const info = metricInfo(metric);
  const every = info && info.interval_seconds ? Math.ceil(info.interval_seconds - 1e-6) : 1;
  const step = Math.max(1, Math.round(span / 120), every);
  const params = { metric, by, start: end - span, end, step };
  if (CONTAINER_GROUPS.includes(by) && $("#hm-top").value) params.top = $("#hm-top").value;
  const h = await api("/api/v1/heatmap", params);
  state.heatmap = { ...h, params };
  const csv = new URL("/api/v1/heatmap", window.location.origin);
  for (const [k, v] of Object.entries({ ...params, format: "csv" })) csv.searchParams.set(k, v);
  $("#hm-csv").href = csv.toString();
  drawHeatmap();
}

function drawHeatmap() {
  const h = state.heatmap;
  const canvas = $("#heatmap");
  const ctx = canvas.getContext("2d");
  const width = Math.max(400, $("#timeline-section").clientWidth - 26);
  const rows = h.rows.length, cols = h.times.length;
  ctx.font = "10px system-ui, sans-serif";
  const labelW = Math.min(260, Math.max(40, ...h.rows.map((r) => ctx.measureText(r).width)) + 10);
  const cellW = Math.max(1, (width - labelW - 8) / Math.max(1, cols));
  const cellH = Math.max(3, Math.min(16, Math.floor(420 / Math.max(1, rows))));
  const top = 4, axis = 22;
  const height = top + Math.max(1, rows) * cellH + axis;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  canvas.style.width = width + "px";
  canvas.style.height = height + "px";
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "10px system-ui, sans-serif";
  const dom = domain(h.values.flat(), h.unit);
  legend($("#hm-legend"), dom, h.unit);
  Object.assign(canvas.dataset, {
    metric: h.metric, by: h.by, rows, cols, left: labelW, top, cellW, cellH,
    start: h.params.start, end: h.params.end, step: h.params.step, top_n: h.params.top || "",
  });
  if (!rows) {
    ctx.fillStyle = "#6b7280";
    ctx.fillText("no series for this metric and grouping in the window", labelW, top + 12);
    return;
  }
  const every = Math.ceil(10 / cellH);
  h.rows.forEach((name, i) => {
    const y = top + i * cellH;
    h.values[i].forEach((v, j) => {
      ctx.fillStyle = colour(v, dom);
      ctx.fillRect(labelW + j * cellW, y, Math.ceil(cellW), cellH);
    });
    if (i % every === 0) {
      ctx.fillStyle = "#374151";
      ctx.textBaseline = "middle";
      ctx.fillText(name.length > 40 ? "…" + name.slice(-39) : name, 2, y + cellH / 2);
    }
  });
  ctx.fillStyle = "#6b7280";
  ctx.textBaseline = "top";
  const ticks = Math.min(6, cols);
  for (let k = 0; k < ticks; k++) {
    const j = Math.round((k * (cols - 1)) / Math.max(1, ticks - 1));
    const x = labelW + j * cellW;
    ctx.fillText(clock(h.times[j]), Math.min(x, width - 50), top + rows * cellH + 6);
  }
}

function heatmapHover(ev) {
  const h = state.heatmap, canvas = $("#heatmap"), tip = $("#hm-tip");
  if (!h) return;
  const d = canvas.dataset, rect = canvas.getBoundingClientRect();
  const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
  const j = Math.floor((x - Number(d.left)) / Number(d.cellW)), i = Math.floor((y - Number(d.top)) / Number(d.cellH));
  if (i < 0 || j < 0 || i >= h.rows.length || j >= h.times.length) { tip.hidden = true; return; }
  tip.textContent = `${h.rows[i]} · ${clock(h.times[j])} · ${fmt(h.values[i][j], h.unit)}`;
  tip.dataset.row = h.rows[i];
  tip.dataset.time = h.times[j];
  tip.dataset.value = h.values[i][j] === null ? "" : String(h.values[i][j]);
  tip.style.left = Math.min(x + 12, rect.width - 260) + "px";
  tip.style.top = y + 12 + "px";
  tip.hidden = false;
}

// ---------------------------------------------------------------------------------------------
// containers table
async function refreshContainers() {
  const cs = await api("/api/v1/containers");
  const end = state.topo ? state.topo.at : serverNow();
  let rates = {};
  if (state.catalogue.some((m) => m.name === "cri_resmgr_container_cpu_usage_seconds_total")) {
    const q = await api("/api/v1/query_range", {
      metric: "cri_resmgr_container_cpu_usage_seconds_total", fn: "rate", start: end - 30, end, step: 30,
    });
    rates = Object.fromEntries(q.series.map((s) => [s.labels.container_id, s.values[s.values.length - 1]]));
  }
  // One query at a time: the API serves few heavy requests at once (api.max_concurrent_queries).
  const avx = await latestByContainer("cri_resmgr_container_avx512_ratio", "raw", end);
  const llc = await latestByContainer("cri_resmgr_container_llc_misses_total", "rate", end);
  const bw = await latestByContainer("cri_resmgr_container_memory_bandwidth_bytes_total", "rate", end, '{scope="total"}');
  state.containers = cs.map((c) => ({
    ...c, cpu_rate: rates[c.container_id] ?? null, avx512_ratio: avx[c.container_id] ?? null,
    llc_miss_rate: llc[c.container_id] ?? null, memory_bandwidth: bw[c.container_id] ?? null,
  }));
  renderContainers();
}

// The newest value per container of a per-container metric ({} when it is not collected here).
async function latestByContainer(metric, fn, end, match) {
  if (!state.catalogue.some((m) => m.name === metric)) return {};
  const info = metricInfo(metric);
  const step = Math.max(30, Math.ceil((info && info.interval_seconds) || 0));
  const params = { metric, fn, start: end - step, end, step };
  if (match) params["match[]"] = match;
  const q = await api("/api/v1/query_range", params);
  const out = {};
  for (const s of q.series) {
    const v = s.values[s.values.length - 1];
    if (v !== null && v !== undefined) out[s.labels.container_id] = (out[s.labels.container_id] || 0) + v;
  }
  return out;
}

function cpuInList(cpu, list) {
  if (!list) return false;
  return list.split(",").some((part) => {
    const [a, b] = part.split("-").map(Number);
    return b === undefined ? cpu === a : cpu >= a && cpu <= b;
  });
}

function renderContainers() {
  const { key, asc } = state.sort;
  const rows = [...state.containers].sort((a, b) => {
    const x = a[key], y = b[key];
    const c = typeof x === "number" || typeof y === "number" ? (x ?? -1) - (y ?? -1) : String(x ?? "").localeCompare(String(y ?? ""));
    return asc ? c : -c;
  });
  const body = $("#containers tbody");
  body.replaceChildren();
  const sel = state.selectedCpu;
  $("#ct-filter").textContent = sel === null ? `(${rows.length})` : `on cpu ${sel} (click it again to show all)`;
  for (const c of rows) {
    const tr = el("tr", { "data-id": c.container_id });
    if (sel !== null && !cpuInList(sel, c.cpuset)) tr.classList.add("hidden");
    tr.append(
      el("td", {}, c.namespace), el("td", {}, c.pod), el("td", {}, c.name),
      el("td", { title: c.container_id }, c.container_id.slice(0, 12)),
      el("td", {}, c.qos_class || "–"), el("td", {}, c.cpuset ?? "–"),
      el("td", { class: "num", "data-value": c.cpu_rate ?? "" }, c.cpu_rate === null ? "–" : c.cpu_rate.toFixed(2)),
      el("td", { class: "num", "data-value": c.memory_working_set_bytes ?? "" }, fmt(c.memory_working_set_bytes, "bytes")),
      el("td", { class: "num avx", "data-value": c.avx512_ratio ?? "" }, c.avx512_ratio === null ? "–" : (c.avx512_ratio * 100).toFixed(1) + "%"),
      el("td", { class: "num llc", "data-value": c.llc_miss_rate ?? "" }, c.llc_miss_rate === null ? "–" : fmt(c.llc_miss_rate, "")),
      el("td", { class: "num bw", "data-value": c.memory_bandwidth ?? "" }, c.memory_bandwidth === null ? "–" : fmt(c.memory_bandwidth, "bytes") + "/s"),
    );
    body.append(tr);
  }
  for (const th of document.querySelectorAll("#containers th")) {
    th.classList.toggle("sorted", th.dataset.k === key);
    th.classList.toggle("asc", th.dataset.k === key && asc);
  }
}

// ---------------------------------------------------------------------------------------------
// rebalancer plan: the moves of the last round, each outlined on the topology grid (before → after)
async function refreshPlan() {
  let r;
  try {
    r = await api("/api/v1/rebalancer/plan");
  } catch (err) {
    state.plan = null;  // no rebalancer on this agent (503) is not an error of the page
    $("#plan-summary").textContent = "(no rebalancer)";
    renderPlan();
    return;
  }
  state.plan = r.last && r.last.plan ? r.last.plan : null;
  const p = state.plan;
  $("#plan-summary").textContent = p
    ? `· ${r.mode} · ${p.moves.length} moves · objective ${p.objective_before.toFixed(1)} → ${p.objective_after.toFixed(1)}`
    : `· ${r.mode} · no round yet`;
  if (!p || !p.moves.some((m) => m.container_id === state.selectedMove)) {
    state.selectedMove = p && p.moves.length ? p.moves[0].container_id : null;
  }
  renderPlan();
}

function selectedMove() {
  if (!state.plan || !state.selectedMove) return null;
  const m = state.plan.moves.find((x) => x.container_id === state.selectedMove);
  return m || null;
}

function renderPlan() {
  const body = $("#moves tbody");
  body.replaceChildren();
  const p = state.plan;
  for (const m of p ? p.moves : []) {
    const tr = el("tr", { "data-id": m.container_id });
    if (m.container_id === state.selectedMove) tr.classList.add("selected");
    const terms = Object.entries(m.gain_by_term || {}).filter(([, v]) => Math.abs(v) > 1e-9)
      .map(([k, v]) => `${k} ${v > 0 ? "+" : ""}${v.toFixed(2)}`).join(", ");
    const seps = (m.separates || []).map((s) => `${s.victim} ← ${s.antagonist} (${s.term}, +${s.predicted_gain.toFixed(2)})`).join("; ");
    tr.append(
      el("td", { title: m.reason }, m.name || m.container_id),
      el("td", { class: "fromto" }, `${m.from_cpus} → ${m.to_cpus}`),
      el("td", { class: "num" }, m.predicted_gain.toFixed(2)),
      el("td", { class: "num" }, m.migration_cost.toFixed(2)),
      el("td", { class: "terms" }, terms || "–"),
      el("td", { class: "separates" }, seps || "–"),
    );
    tr.addEventListener("click", () => {
      state.selectedMove = m.container_id;
      renderPlan();
      if (state.topo) drawTopology(state.topo);
    });
    body.append(tr);
  }
  const topo = $("#topology");
  topo.dataset.planView = $("#plan-view").value;
  topo.dataset.planMove = state.selectedMove || "";
}

// ---------------------------------------------------------------------------------------------
// header: node and collectors
async function refreshHeader() {
  const cols = await api("/api/v1/collectors");
  const box = $("#collectors");
  box.replaceChildren(...cols.map((c) => el("span", {
    class: "chip " + (!c.enabled ? "off" : c.up ? "up" : "down"), title: c.reason, "data-collector": c.name,
  }, c.name)));
}

// ---------------------------------------------------------------------------------------------
async function refresh() {
  if (state.busy) return;
  state.busy = true;
  try {
    await loadCatalogue(false);
    await refreshPlan();
    await refreshTopology();
    await Promise.all([refreshHeatmap(), refreshHeader()]);
    await refreshContainers();
    $("#status").textContent = "";
    $("#updated").textContent = "updated " + clock(state.topo ? state.topo.at : serverNow());
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  } catch (err) {
    showError(err);
  } finally {
    state.busy = false;
  }
}

function schedule() {
  clearTimeout(state.timer);
  const s = Number($("#refresh").value);
  if (s > 0 && $("#login").hidden) state.timer = setTimeout(async () => { await refresh(); schedule(); }, s * 1000);
}

// First load, and again after a token is given: the node name, the metric catalogue, then the refresh loop.
async function start() {
  try {
    const cfg = await api("/api/v1/config");
    $("#node").textContent = cfg.node_name ? "· " + cfg.node_name : "";
    await loadCatalogue(true);
  } catch (err) {
    showError(err);
    if (err instanceof Unauthorized) return;
  }
  await refresh();
  schedule();
}

async function main() {
  $("#login").addEventListener("submit", useToken);
  $("#hm-csv").addEventListener("click", downloadCsv);
  for (const id of ["#topo-metric", "#hm-metric", "#hm-by", "#hm-span", "#hm-top"]) {
    $(id).addEventListener("change", async () => {
      if (id === "#hm-metric") fillGroups();
      saveHash();
      await refresh();
    });
  }
  $("#refresh").addEventListener("change", () => { saveHash(); schedule(); });
  $("#plan-view").addEventListener("change", () => { renderPlan(); if (state.topo) drawTopology(state.topo); });
  $("#heatmap").addEventListener("mousemove", heatmapHover);
  $("#heatmap").addEventListener("mouseleave", () => { $("#hm-tip").hidden = true; });
  for (const th of document.querySelectorAll("#containers th")) {
    th.addEventListener("click", () => {
      state.sort = { key: th.dataset.k, asc: state.sort.key === th.dataset.k ? !state.sort.asc : true };
      renderContainers();
    });
  }
  window.addEventListener("resize", () => { if (state.heatmap) drawHeatmap(); });
  await start();
}

main();
