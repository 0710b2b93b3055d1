// The lmcache operator page: a thin client of the JSON API of the server that serves it
// (the controller, or one instance's API). No framework, no build step, no CDN.
//
// Security: every string from the server (keys, model names, errors) is put into the page
// with textContent or as an attribute value, never parsed as HTML. The token lives in
// sessionStorage (this tab only) and goes in the Authorization header, never in a URL.
// State-changing calls are POSTs with a JSON body, sent only after the confirm dialog.
"use strict";

const POLL_MS = 2000;        // how often the page asks again
const HISTORY = 180;         // chart points kept (6 minutes at 2 s)
const TOKEN_KEY = "lmcache.token";
const ENTRIES_LIMIT = 200;   // entries listed per tier

const state = {
  mode: null,          // "controller" or "instance"
  self: null,          // the instance view: {instance_id, model, version}
  history: [],         // [{t, hitRate, bytes}]
  entriesOf: null,     // {instance, tier} listed in #entries
  busy: false,
};

// ---------------------------------------------------------------- small helpers
const $ = (sel) => document.querySelector(sel);

function el(tag, props, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v === null || v === undefined ? "" : String(v));
    else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

function human(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n), i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : String(v)) + " " + units[i];
}

function pct(r) { return r === null || r === undefined ? "–" : (100 * r).toFixed(1) + "%"; }

// a cell whose data-value is the raw number from the JSON and whose text is for people
function cell(cls, value, text) {
  return el("td", { class: cls, "data-value": value === null || value === undefined ? "" : value,
                    text: text === undefined ? (value === null || value === undefined ? "–" : String(value)) : text });
}

function setStatus(text) { $("#status").textContent = text; }

function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

async function api(method, path, body) {
  const headers = { "Accept": "application/json" };
  const t = token();
  if (t) headers["Authorization"] = "Bearer " + t;
  const opts = { method, headers, cache: "no-store", credentials: "omit", redirect: "error",
                 // same-origin: the browser sends this page's Origin with a POST (the server refuses other origins)
                 referrerPolicy: "same-origin" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(path, opts);
  let data = null;
  try { data = await r.json(); } catch (e) { data = null; }
  if (!r.ok) {
    const msg = data && typeof data.error === "string" ? data.error : r.statusText;
    throw new Error(r.status + ": " + msg);
  }
  return data;
}

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined && v !== "") q.set(k, String(v));
  return q.toString();
}

// ---------------------------------------------------------------- the confirm dialog
function confirmAction(text) {
  const d = $("#confirm");
  $("#confirm-text").textContent = text;
  return new Promise((resolve) => {
    const done = (answer) => {
      $("#confirm-yes").removeEventListener("click", yes);
      $("#confirm-no").removeEventListener("click", no);
      d.removeEventListener("cancel", no);
      if (d.open) d.close();
      resolve(answer);
    };
    const yes = () => done(true);
    const no = () => done(false);
    $("#confirm-yes").addEventListener("click", yes);
    $("#confirm-no").addEventListener("click", no);
    d.addEventListener("cancel", no);
    d.showModal();
  });
}

// Ask, then POST; the outcome (or the error) goes to #status, and the view refreshes.
async function act(question, path, body) {
  if (!(await confirmAction(question))) { setStatus("cancelled"); return null; }
  try {
    const r = await api("POST", path, body);
    setStatus(summarize(r));
    await refresh();
    if (state.entriesOf) await showEntries(state.entriesOf.instance, state.entriesOf.tier, true);
    return r;
  } catch (e) {
    setStatus(e.message);
    return null;
  }
}

function summarize(r) {
  const res = r && r.result !== undefined ? r.result : r;
  if (!res || typeof res !== "object") return "done";
  if (Array.isArray(res.evicted)) return "evicted " + res.evicted.length + " entries";
  if (typeof res.evicted === "number") return "evicted " + res.evicted + " entries";
  if (typeof res.cleared === "number") return "evicted " + res.cleared + " entries";
  if (Array.isArray(res.pinned)) return "pinned " + res.pinned.length + " entries";
  if (Array.isArray(res.unpinned)) return "unpinned " + res.unpinned.length + " entries";
  if (Array.isArray(res.recoded)) return "recoded " + res.recoded.length + " entries";
  if (Array.isArray(res.pushed)) return "moved " + res.pushed.length + " entries";
  const n = Object.entries(res).find(([, v]) => typeof v === "number");
  return n ? r.command + ": " + n[0] + " " + n[1] : (r.command || "done");
}

// ---------------------------------------------------------------- what the server reports
// One shape for both servers: [{id, healthy, age, version, model, namespace, keys, tiers: [[name, stats]]}]
async function load() {
  if (state.mode === "controller") {
    const list = await api("GET", "/v1/instances");
    return list.map((i) => ({
      id: i.instance_id, healthy: i.healthy, age: i.last_heartbeat_age_s, version: i.version, model: i.model,
      namespace: i.namespace, keys: i.keys,
      tiers: i.tiers.map((t) => [t, (i.tier_stats || {})[t] || {}]),
    }));
  }
  const tiers = await api("GET", "/v1/tiers");
  const s = state.self;
  return [{
    id: s.instance_id || "this instance", healthy: true, age: 0, version: s.version, model: s.model,
    namespace: s.namespace, keys: null,
    tiers: tiers.map((t) => [t.name, t]),
  }];
}

function tierValues(st) {
  const used = st.used_bytes !== undefined ? st.used_bytes : st.bytes;
  let backoff = st.retry_in_s;
  if (backoff === undefined || backoff === null) backoff = st.available === false ? null : (st.available === true ? 0 : null);
  return {
    entries: st.entries, used: used, capacity: st.capacity_bytes, hitRate: st.hit_rate, evictions: st.evictions,
    errors: st.errors, refusals: st.refused_writes, backoff: backoff, available: st.available,
    writeRefused: st.write_refused, hits: st.hits, misses: st.misses, backend: st.backend,
  };
}

// ---------------------------------------------------------------- rendering
function renderInstances(insts) {
  const rows = insts.map((i) => el("tr", { "data-instance": i.id },
    el("td", { class: "instance", text: i.id }),
    el("td", { class: "health " + (i.healthy ? "ok" : "bad"), text: i.healthy ? "healthy" : "unhealthy" }),
    cell("heartbeat-age", i.age, i.age === null || i.age === undefined ? "–" : Number(i.age).toFixed(1)),
    el("td", { class: "version", text: i.version || "–" }),
    el("td", { class: "model", text: i.model || "–" }),
    el("td", { class: "namespace", text: i.namespace || "–" }),
    el("td", { class: "tiers", text: i.tiers.map(([t]) => t).join(", ") }),
    cell("keys", i.keys)));
  $("#instances tbody").replaceChildren(...rows);
}

function bar(used, capacity) {
  const frac = capacity ? Math.min(1, Math.max(0, used / capacity)) : 0;
  const s = svg("svg", { viewBox: "0 0 100 10", preserveAspectRatio: "none", class: "bar-svg" });
  s.append(svg("rect", { x: 0, y: 0, width: 100, height: 10, class: "bar-back" }));
  s.append(svg("rect", { x: 0, y: 0, width: (100 * frac).toFixed(2), height: 10,
                          class: "bar-fill" + (frac > 0.9 ? " full" : "") }));
  const td = el("td", { class: "bar", "data-value": capacity ? frac.toFixed(4) : "" }, s);
  td.title = capacity ? (100 * frac).toFixed(1) + "% of " + human(capacity) : "no capacity reported";
  return td;
}

function renderTiers(insts) {
  const rows = [];
  for (const i of insts) {
    for (const [name, st] of i.tiers) {
      const v = tierValues(st);
      let backoffText = "ok";
      if (v.backoff === null) backoffText = v.available === false ? "backoff" : "–";
      else if (v.backoff > 0) backoffText = "backoff, retry in " + Number(v.backoff).toFixed(1) + " s";
      if (v.writeRefused) backoffText += "; writes refused: " + v.writeRefused;
      const show = el("button", { type: "button", class: "show-entries", text: "entries" });
      show.addEventListener("click", () => showEntries(i.id, name));
      const evict = el("button", { type: "button", class: "evict-tier danger", text: "evict tier" });
      evict.addEventListener("click", () => evictTier(i.id, name));
      rows.push(el("tr", { class: "tier", "data-instance": i.id, "data-tier": name },
        el("td", { class: "instance", text: i.id }),
        el("td", { class: "tier-name", text: name + (v.backend ? " (" + v.backend + ")" : "") }),
        cell("entries", v.entries),
        cell("used-bytes", v.used, human(v.used)),
        cell("capacity-bytes", v.capacity, human(v.capacity)),
        bar(v.used, v.capacity),
        cell("hit-rate", v.hitRate, pct(v.hitRate)),
        cell("evictions", v.evictions),
        cell("errors", v.errors),
        cell("write-refusals", v.refusals),
        cell("backoff", v.backoff, backoffText),
        el("td", { class: "actions" }, show, evict)));
    }
  }
  $("#tiers tbody").replaceChildren(...rows);
}

function record(insts) {
  let hits = 0, looked = 0, bytes = 0, rates = [];
  for (const i of insts) {
    for (const [, st] of i.tiers) {
      const v = tierValues(st);
      if (typeof v.hits === "number" && typeof v.misses === "number") { hits += v.hits; looked += v.hits + v.misses; }
      else if (typeof v.hitRate === "number") rates.push(v.hitRate);
      if (typeof v.used === "number") bytes += v.used;
    }
  }
  const hitRate = looked ? hits / looked : (rates.length ? rates.reduce((a, b) => a + b, 0) / rates.length : null);
  state.history.push({ t: Date.now(), hitRate, bytes });
  if (state.history.length > HISTORY) state.history.shift();
}

function renderChart() {
  const chart = $("#chart");
  const W = 600, H = 160, P = 8;
  const h = state.history;
  chart.replaceChildren(svg("rect", { x: 0, y: 0, width: W, height: H, class: "chart-back" }));
  for (const f of [0.25, 0.5, 0.75]) {
    chart.append(svg("line", { x1: 0, x2: W, y1: P + (H - 2 * P) * f, y2: P + (H - 2 * P) * f, class: "grid" }));
  }
  const maxBytes = Math.max(1, ...h.map((p) => p.bytes));
  const x = (k) => (h.length < 2 ? W / 2 : (k * W) / (h.length - 1));
  const y = (f) => P + (H - 2 * P) * (1 - f);
  const line = (pick, cls) => {
    const pts = [];
    h.forEach((p, k) => { const v = pick(p); if (v !== null && v !== undefined) pts.push(x(k).toFixed(1) + "," + y(v).toFixed(1)); });
    if (pts.length) chart.append(svg("polyline", { points: pts.join(" "), class: cls }));
  };
  line((p) => p.hitRate, "line hit-rate-line");
  line((p) => p.bytes / maxBytes, "line bytes-line");
  const last = h.length ? h[h.length - 1] : null;
  $("#chart-legend").replaceChildren(
    el("span", { class: "key hit-rate-key", text: "hit rate (0–100%): " + (last ? pct(last.hitRate) : "–") }),
    el("span", { class: "key bytes-key", text: "bytes used (0–" + human(maxBytes) + "): " + (last ? human(last.bytes) : "–") }),
    el("span", { class: "span", text: h.length + " samples, every " + POLL_MS / 1000 + " s" }));
}

// ---------------------------------------------------------------- entries and their actions
async function showEntries(instance, tier, quiet) {
  state.entriesOf = { instance, tier };
  try {
    const page = state.mode === "controller"
      ? await api("GET", "/v1/entries?" + query({ instance, tier, limit: ENTRIES_LIMIT }))
      : await api("GET", "/v1/keys?" + query({ tier, limit: ENTRIES_LIMIT }));
    const rows = page.entries.map((e) => {
      const ev = el("button", { type: "button", class: "evict-key danger", text: "evict" });
      ev.addEventListener("click", () => evictKey(instance, tier, e.key));
      const pin = el("button", { type: "button", class: "pin-key", text: "pin" });
      pin.addEventListener("click", () => pinKey(instance, tier, e.key, true));
      const unpin = el("button", { type: "button", class: "unpin-key", text: "unpin" });
      unpin.addEventListener("click", () => pinKey(instance, tier, e.key, false));
      return el("tr", { class: "entry", "data-key": e.key },
        el("td", { class: "key", text: e.key }),
        cell("size", e.size, human(e.size)),
        el("td", { class: "codec", text: e.codec || "–" }),
        el("td", { class: "pinned", text: e.pinned ? "yes" : "no" }),
        el("td", { class: "actions" }, ev, pin, unpin));
    });
    $("#entries tbody").replaceChildren(...rows);
    $("#entries-caption").textContent = instance + " / " + tier + ": " + rows.length + " of " + page.total;
    if (!quiet) setStatus("listed " + rows.length + " of " + page.total + " entries of " + instance + " / " + tier);
  } catch (e) {
    $("#entries tbody").replaceChildren();
    $("#entries-caption").textContent = "";
    setStatus(e.message);
  }
}

function evictTier(instance, tier) {
  const q = "Evict every entry of tier " + tier + " of " + instance + "?";
  return state.mode === "controller"
    ? act(q, "/v1/clear", { instance, tier })
    : act(q, "/v1/clear", { tier });
}

function evictKey(instance, tier, key) {
  const q = "Evict the entry " + key + " from tier " + tier + " of " + instance + "?";
  return state.mode === "controller"
    ? act(q, "/v1/clear", { instance, tier, keys: [key] })
    : act(q, "/v1/evict", { tier, keys: [key] });
}

function pinKey(instance, tier, key, pin) {
  const verb = pin ? "pin" : "unpin";
  const q = (pin ? "Pin " : "Unpin ") + "the entry " + key + " in tier " + tier + " of " + instance + "?";
  return state.mode === "controller"
    ? act(q, "/v1/" + verb, { instance, tier, keys: [key] })
    : act(q, "/v1/" + verb, { key, tier });
}

function lines(text) { return text.split("\n").map((s) => s.trim()).filter((s) => s); }

function tokenIds(text) {
  const parts = text.split(/[\s,]+/).filter((s) => s);
  const ids = parts.map((s) => Number(s));
  if (ids.some((n) => !Number.isInteger(n) || n < 0)) throw new Error("token ids must be non-negative integers");
  return ids;
}

function move() {
  const src = $("#move-src").value.trim(), srcTier = $("#move-src-tier").value.trim();
  const dst = $("#move-dst").value.trim(), dstTier = $("#move-dst-tier").value.trim();
  const keys = lines($("#move-keys").value);
  let tokens;
  try { tokens = tokenIds($("#move-tokens").value); } catch (e) { setStatus(e.message); return null; }
  if (!dst || !srcTier || !dstTier || (!keys.length && !tokens.length)) {
    setStatus("move: give both instances, both tiers and keys or token ids"); return null;
  }
  const remove = $("#move-remove").checked;
  const what = keys.length ? keys.length + " entries" : "the chunks of " + tokens.length + " tokens";
  const q = (remove ? "Move " : "Copy ") + what + " from " + (src || "this instance") + " / " + srcTier +
            " to " + dst + " / " + dstTier + "?";
  const sel = keys.length ? { keys } : { tokens };
  if (state.mode === "controller") {
    return act(q, "/v1/move", { src_instance: src, src_tier: srcTier, dst_instance: dst, dst_tier: dstTier,
                                remove_source: remove, ...sel });
  }
  return act(q, "/v1/push", { target: dst, tier: srcTier, target_tier: dstTier, remove_source: remove, ...sel });
}

function recode() {
  const inst = $("#recode-instance").value.trim(), tier = $("#recode-tier").value.trim();
  const op = $("#recode-op").value, codec = $("#recode-codec").value.trim();
  const keys = lines($("#recode-keys").value);
  if (!tier || (op === "compress" && !codec) || (state.mode === "controller" && !inst)) {
    setStatus("recode: give the instance, the tier and (to compress) a codec"); return null;
  }
  const what = keys.length ? keys.length + " entries" : "every entry";
  const q = (op === "compress" ? "Compress " + what + " with " + codec : "Decompress " + what) +
            " in tier " + tier + " of " + (inst || "this instance") + "?";
  const sel = keys.length ? { keys } : {};
  if (state.mode === "controller") {
    return act(q, "/v1/" + op, op === "compress" ? { instance: inst, tier, codec, ...sel } : { instance: inst, tier, ...sel });
  }
  return act(q, "/v1/recode", { tier, codec: op === "compress" ? codec : "raw", ...sel });
}

// ---------------------------------------------------------------- lookup
async function lookup() {
  const raw = $("#lookup-tokens").value.trim();
  const text = $("#lookup-text").value;
  let body;
  try {
    if (raw) body = { tokens: tokenIds(raw) };
    else if (text.trim()) body = { text };
    else { setStatus("lookup: give a text or token ids"); return; }
  } catch (e) { setStatus(e.message); return; }
  $("#lookup-results tbody").replaceChildren();  // no stale rows while the answer is on its way
  setStatus("looking up ...");
  try {
    const r = await api("POST", "/v1/lookup", body);
    const rows = r.results.map((x) => el("tr", { "data-instance": x.instance_id },
      el("td", { class: "instance", text: x.instance_id }),
      cell("tokens", x.hit_tokens),
      cell("chunks", x.hit_chunks),
      el("td", { class: "tier", text: x.tier || "–" }),
      el("td", { class: "per-tier", text: Object.entries(x.tiers || {}).map(([t, n]) => t + ": " + n).join(", ") })));
    $("#lookup-results tbody").replaceChildren(...rows);
    setStatus("lookup: " + rows.length + " of " + r.instances_considered + " instances hold a prefix" +
              (r.num_tokens !== null && r.num_tokens !== undefined ? " of " + r.num_tokens + " tokens" : ""));
  } catch (e) {
    $("#lookup-results tbody").replaceChildren();
    setStatus(e.message);
  }
}

// ---------------------------------------------------------------- the loop
async function detect() {
  const h = await api("GET", "/v1/health");
  state.mode = h.service === "instance" ? "instance" : "controller";
  state.self = h;
  document.body.dataset.mode = state.mode;
  $("#mode").textContent = state.mode === "controller" ? "controller " + (h.version || "")
                                                       : "instance " + (h.instance_id || "") + " " + (h.version || "");
  $("#lookup-view").hidden = state.mode !== "controller";
  $("#instances-title").textContent = state.mode === "controller" ? "Instances" : "This instance";
}

async function refresh() {
  if (state.busy) return;
  state.busy = true;
  try {
    if (!state.mode) await detect();
    const insts = await load();
    renderInstances(insts);
    renderTiers(insts);
    record(insts);
    renderChart();
    if ($("#status").dataset.error === "1") { setStatus(""); delete $("#status").dataset.error; }
  } catch (e) {
    setStatus(e.message);
    $("#status").dataset.error = "1";
  } finally {
    state.busy = false;
  }
}

function start() {
  if (token()) $("#token").placeholder = "a token is set for this tab";
  $("#token-save").addEventListener("click", () => {
    const t = $("#token").value.trim();
    if (t) sessionStorage.setItem(TOKEN_KEY, t);
    $("#token").value = "";
    $("#token").placeholder = t ? "a token is set for this tab" : $("#token").placeholder;
    state.mode = null;
    setStatus(t ? "token set" : "no token given");
    refresh();
  });
  $("#token-clear").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    $("#token").value = "";
    $("#token").placeholder = "bearer token (kept in this tab only)";
    setStatus("token forgotten");
    refresh();
  });
  $("#refresh").addEventListener("click", () => refresh());
  $("#lookup-go").addEventListener("click", () => lookup());
  $("#move-go").addEventListener("click", () => move());
  $("#recode-go").addEventListener("click", () => recode());
  for (const f of ["#move-form", "#recode-form"]) $(f).addEventListener("submit", (ev) => ev.preventDefault());
  refresh();
  setInterval(refresh, POLL_MS);
}

document.addEventListener("DOMContentLoaded", start);
