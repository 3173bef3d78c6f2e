// What every page of the dashboard uses: DOM calls that put text on the page (never
// HTML: a job's metadata is whatever its submitter wrote), formatting, and the /v1 API
// called with the key the person gave.

export const API = new URL("../", document.baseURI); // the service's root, behind any path prefix
export const KEY = "trainyard.apiKey"; // sessionStorage: gone when the tab closes, never in a URL
export const LIST_SECONDS = 5;
export const FINAL = new Set(["succeeded", "failed", "cancelled"]);

// ---------------------------------------------------------------- DOM and formatting

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v == null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) if (c != null && c !== false) el.append(c instanceof Node ? c : String(c));
  return el;
}

export const present = (...nodes) => nodes.filter((n) => n != null && n !== false);
export const link = (route, text, query) =>
  h("a", { href: "#/" + route.map(encodeURIComponent).join("/") + (query ? "?" + new URLSearchParams(query) : "") }, text);
export const badge = (status) => h("span", { class: `badge ${status}`, "data-status": status }, status);
export const when = (iso) => (iso ? new Date(iso).toLocaleString() : "—");
export const json = (value) => h("pre", { class: "json" }, JSON.stringify(value, null, 2));
export const num = (v) => (typeof v === "number" ? String(+v.toPrecision(4)) : v == null ? "—" : String(v));

export const details = (title, content, open = false) => h("details", { "data-key": title, open }, h("summary", {}, title), content);

// Replaces a page's header, keeping each <details> open or closed as the person left it.
export function redraw(container, ...nodes) {
  const open = new Map([...container.querySelectorAll("details[data-key]")].map((d) => [d.dataset.key, d.open]));
  container.replaceChildren(...present(...nodes));
  for (const d of container.querySelectorAll("details[data-key]")) if (open.has(d.dataset.key)) d.open = open.get(d.dataset.key);
}

export function facts(pairs) {
  return h("dl", { class: "facts" }, pairs.filter(([, v]) => v != null).flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
}

export function progressBar(percent, text) {
  const bar = h("progress", { max: 100, value: percent == null ? null : Math.min(100, percent) });
  return h("div", { class: "progress" }, bar, h("span", {}, text));
}

export function table(headers, rows) {
  return h("div", { class: "scroll" }, h("table", {}, h("thead", {}, h("tr", {}, headers.map((t) => h("th", {}, t)))), h("tbody", {}, rows)));
}

// ---------------------------------------------------------------- the API and the key

// A 401 names the key its request carried (null: none), so that a request sent before the
// person gave a key does not take that key for refused.
export class Unauthorized extends Error {
  constructor(key) { super("the service refused the key"); this.key = key; }
}

// fetch with the key the person gave, read when the request is sent.
export async function authorized(path, { headers = {}, ...init } = {}) {
  const key = sessionStorage.getItem(KEY);
  if (key) headers = { ...headers, Authorization: `Bearer ${key}` };
  const response = await fetch(new URL(path, API), { ...init, cache: "no-store", headers });
  if (response.status === 401) throw new Unauthorized(key);
  return response;
}

export async function api(path, { method = "GET", signal } = {}) {
  const response = await authorized(path, { method, signal, headers: { Accept: "application/json" } });
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error(`${response.status}: ${body?.detail || body?.title || response.statusText}`);
  return body;
}

// A run's rows of curves after `seq` (all of them from 0), every page; and the last seq.
export async function metricsAfter(base, seq, signal) {
  const rows = [];
  for (;;) {
    const page = await api(`${base}/metrics?after=${seq}&limit=1000`, { signal });
    rows.push(...page.data);
    if (page.data.length) seq = page.data[page.data.length - 1].seq;
    if (!page.has_more) return { rows, seq };
  }
}

// A row's x on a run's curves: the run's step. A training step's row counts them; a
// validation's names the model's step it sampled: the run's plus the step the model was
// at when the run started (`start_step` of GET /v1/runs/{id}/settings).
export const runStep = (row, startStep) => (row.kind === "validation" ? row.step - (startStep ?? 0) : row.step);
