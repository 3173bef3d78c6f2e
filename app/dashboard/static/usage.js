// The usage page: GET /v1/usage by day for the key's project (an admin picks one, or sees
// them all), a bar chart per figure and a table with the totals. Every numeric column the
// answer has is shown, whatever it is called: seconds today, more figures later.

import { api, h, table } from "./base.js";

const NS = "http://www.w3.org/2000/svg";
const W = 640, H = 200, PAD = { left: 52, right: 12, top: 12, bottom: 28 };
const DAY_MS = 86400000;
const DEFAULT_DAYS = 30;

const iso = (date) => date.toISOString().slice(0, 10);
const title = (column) => column.replace(/_/g, " ").replace(/^./, (c) => c.toUpperCase());
const figure = (v, column) => (column === "cost" ? v.toFixed(2) : String(+v.toFixed(3)));

function svg(tag, attrs = {}, text) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text != null) el.textContent = text;
  return el;
}

// The numeric columns of the answer's rows, in the order the API writes them.
function columns(usage) {
  const seen = [];
  for (const row of [usage.total, ...usage.data]) {
    for (const [key, value] of Object.entries(row)) if (typeof value === "number" && !seen.includes(key)) seen.push(key);
  }
  return seen;
}

// Every UTC day of [from, to): a day with no jobs is a bar of 0.
function days(from, to) {
  const out = [];
  for (let t = Date.parse(from + "T00:00:00Z"); t < Date.parse(to + "T00:00:00Z"); t += DAY_MS) out.push(iso(new Date(t)));
  return out;
}

function barChart(column, label, values) {
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label });
  const top = Math.max(...values.map((v) => v.value), 0) || 1;
  const band = (W - PAD.left - PAD.right) / Math.max(values.length, 1);
  const sy = (y) => H - PAD.bottom - (y / top) * (H - PAD.top - PAD.bottom);
  const axes = svg("g", { class: "axes" });
  for (const t of [0, top / 2, top]) {
    axes.append(svg("line", { x1: PAD.left, x2: W - PAD.right, y1: sy(t), y2: sy(t), class: "grid" }));
    axes.append(svg("text", { x: PAD.left - 6, y: sy(t) + 4, "text-anchor": "end" }, String(+t.toPrecision(3))));
  }
  const every = Math.ceil(values.length / 6); // a handful of day labels
  values.forEach((v, i) => {
    if (i % every === 0) axes.append(svg("text", { x: PAD.left + band * (i + 0.5), y: H - PAD.bottom + 16, "text-anchor": "middle" }, v.day.slice(5)));
  });
  root.append(axes);
  const bars = svg("g", { class: "series s0", "data-series": column });
  values.forEach((v, i) => {
    const bar = svg("rect", { class: "bar", x: PAD.left + band * i + band * 0.1, y: sy(v.value), width: band * 0.8, height: sy(0) - sy(v.value),
      "data-day": v.day, "data-value": v.value });
    bar.append(svg("title", {}, `${v.day}: ${figure(v.value, column)}`));
    bars.append(bar);
  });
  root.append(bars);
  const chart = h("figure", { class: "chart", "data-chart": column }, h("figcaption", {}, label));
  chart.append(root);
  return chart;
}

// An admin's projects to pick from (null for a project's key: GET /v1/projects is admin's).
async function projects(signal) {
  try {
    return (await api("v1/projects?limit=100", { signal })).data;
  } catch (error) {
    if (String(error.message).startsWith("403")) return null;
    throw error;
  }
}

export async function usagePage(query, signal) {
  const to = query.get("to") || iso(new Date(Date.now() + DAY_MS));
  const from = query.get("from") || iso(new Date(Date.parse(to + "T00:00:00Z") - DEFAULT_DAYS * DAY_MS));
  const project = query.get("project") || "";
  const params = new URLSearchParams({ group_by: "day", from: `${from}T00:00:00Z`, to: `${to}T00:00:00Z` });
  if (project) params.set("project_id", project);
  const [usage, choices] = await Promise.all([api(`v1/usage?${params}`, { signal }), projects(signal)]);

  const go = (changes) => {
    const next = new URLSearchParams({ from, to, ...(project ? { project } : {}), ...changes });
    for (const [k, v] of [...next]) if (!v) next.delete(k);
    location.hash = `#/usage?${next}`;
  };
  const fromInput = h("input", { type: "date", id: "usage-from", value: from });
  const toInput = h("input", { type: "date", id: "usage-to", value: to });
  const picker = choices && h("select", { id: "usage-project" }, h("option", { value: "" }, "every project"),
    choices.map((p) => h("option", { value: p.id }, p.name)));
  if (picker) picker.value = project;
  const filters = h("form", { class: "filters" }, h("label", {}, "From ", fromInput), h("label", {}, "To ", toInput),
    picker && h("label", {}, "Project ", picker), h("button", { type: "submit" }, "Show"));
  filters.addEventListener("submit", (event) => {
    event.preventDefault();
    go({ from: fromInput.value, to: toInput.value, project: picker ? picker.value : project });
  });
  picker?.addEventListener("change", () => filters.requestSubmit());

  const names = columns(usage);
  const label = (column) => (column === "cost" ? `Cost (${usage.currency}, estimated)` : title(column));
  const byDay = new Map(usage.data.map((row) => [row.group, row]));
  const charts = names.map((column) =>
    barChart(column, label(column), days(from, to).map((day) => ({ day, value: byDay.get(day)?.[column] ?? 0 }))));
  const cells = (row) => names.map((column) => h("td", { "data-column": column }, figure(row[column] ?? 0, column)));
  const rows = usage.data.map((row) => h("tr", { "data-day": row.group }, h("td", {}, row.group), cells(row)));
  if (!rows.length) rows.push(h("tr", {}, h("td", { colspan: names.length + 1, class: "empty" }, "No jobs started in this window.")));
  rows.push(h("tr", { class: "total", "data-day": "total" }, h("th", {}, "Total"), cells(usage.total)));
  const scope = project ? (choices?.find((p) => p.id === project)?.name ?? project) : choices ? "every project" : "this key's project";
  return h("section", { "data-page": "usage" }, h("h2", {}, "Usage"),
    h("p", {}, `Jobs that started from ${from} to before ${to} (UTC), `, h("strong", { id: "usage-scope" }, scope),
      ": each job's attempts, on the day of its last claim."),
    filters, h("div", { class: "charts", id: "charts" }, charts), table(["Day", ...names.map(label)], rows));
}
