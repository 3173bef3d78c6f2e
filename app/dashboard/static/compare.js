// Runs side by side (`#/compare?runs=a,b`): their curves overlaid on shared axes, one
// colour per run, and their settings in one table, the values that differ marked. Read
// from GET /v1/runs/{id}, its /settings and its /metrics; live runs are read again every
// few seconds.
import { FINAL, LIST_SECONDS, Unauthorized, api, badge, h, link, metricsAfter, num, runStep, table } from "./base.js";
import { lineChart } from "./chart.js";

export const MAX_RUNS = 8; // a colour each: dashboard.css's --s0 … --s7

const hashOf = (ids) => "#/compare?runs=" + ids.map(encodeURIComponent).join(",");

// The runs list's ticks: which runs to compare, kept while the list refreshes its rows.
export function runPicker() {
  const picked = new Set();
  const button = h("button", { type: "button", id: "compare", disabled: true }, "Compare");
  const hint = h("span", { class: "hint" }, `Tick 2 to ${MAX_RUNS} runs to compare their curves and settings.`);
  const sync = () => {
    button.disabled = picked.size < 2 || picked.size > MAX_RUNS;
    button.textContent = picked.size >= 2 ? `Compare ${picked.size} runs` : "Compare";
  };
  button.addEventListener("click", () => { location.hash = hashOf([...picked]); });
  const cell = (id) => {
    const box = h("input", { type: "checkbox", name: "compare", value: id, "aria-label": `Compare ${id}`, checked: picked.has(id) });
    box.addEventListener("change", () => { if (box.checked) picked.add(id); else picked.delete(id); sync(); });
    return h("td", { class: "pick" }, box);
  };
  return { bar: h("div", { class: "compare-bar" }, button, hint), cell };
}

// ---------------------------------------------------------------- loading

async function loadRun(id, signal) {
  const base = `v1/runs/${encodeURIComponent(id)}`;
  const run = await api(base, { signal }); // first: a run that is not there is one 404
  const [settings, curves] = await Promise.all([api(`${base}/settings`, { signal }), metricsAfter(base, 0, signal)]);
  return { id, base, run, settings, rows: curves.rows, seq: curves.seq };
}

// A live run again: its header and the rows of its curves since the last seen.
async function reload(entry, signal) {
  const [run, curves] = await Promise.all([api(entry.base, { signal }), metricsAfter(entry.base, entry.seq, signal)]);
  entry.run = run;
  entry.rows.push(...curves.rows);
  entry.seq = curves.seq;
}

// ---------------------------------------------------------------- curves

function charts(runs) {
  const steps = runs.flatMap((r) => r.rows.map((m) => runStep(m, r.settings.start_step)));
  const domain = steps.length ? [Math.min(...steps), Math.max(...steps)] : undefined;
  const series = (kind, key) => runs.map((r) => ({
    name: r.id,
    label: r.id,
    points: r.rows.filter((m) => m.kind === kind && typeof m.data[key] === "number").map((m) => ({ x: runStep(m, r.settings.start_step), y: m.data[key] })),
  }));
  return [
    lineChart({ name: "reward", title: "Train reward (mean)", domain, series: series("step", "reward_mean") }),
    lineChart({ name: "validation", title: "Validation score", domain, series: series("validation", "score") }),
    lineChart({ name: "loss", title: "Loss", domain, series: series("step", "loss") }),
  ];
}

// ---------------------------------------------------------------- settings

// Nested settings as dotted rows: {recipe: {sampling: {temperature: 1}}} → recipe.sampling.temperature.
function flatten(value, prefix, out) {
  if (value && typeof value === "object" && !Array.isArray(value) && Object.keys(value).length) {
    for (const [k, v] of Object.entries(value)) flatten(v, prefix ? `${prefix}.${k}` : k, out);
  } else out.set(prefix, value);
  return out;
}

const shown = (v) => (v == null ? "—" : typeof v === "string" ? v : JSON.stringify(v)); // exact: 1e-5 ≠ 1.1e-5

function settingsOf({ run, settings }) {
  const p = run.progress;
  const best = run.best_checkpoint;
  return flatten(settings, "", new Map([
    ["model", run.model],
    ["status", run.paused ? `${run.status} (paused)` : run.status],
    ["steps", `${p.step} of ${p.total_steps}`],
    ["best checkpoint", best ? `${run.model}@${best.step} (score ${num(best.score)})` : null],
    ["stop reason", run.stop_reason],
  ]));
}

function settingsTable(runs) {
  const each = runs.map(settingsOf);
  const keys = [...new Set(each.flatMap((m) => [...m.keys()]))];
  const rows = keys.map((key) => {
    const values = each.map((m) => shown(m.get(key)));
    const differs = new Set(values).size > 1;
    return h("tr", { "data-setting": key, class: differs ? "differs" : null },
      h("th", { scope: "row" }, key, differs ? h("span", { class: "tag" }, "differs") : null),
      values.map((v, i) => h("td", {}, key === "status" ? badge(runs[i].run.status) : v, key === "status" && runs[i].run.paused ? " paused" : "")));
  });
  const heads = ["Setting", ...runs.map((r, i) => h("span", {}, h("span", { class: `swatch s${i}` }), link(["runs", r.id], r.id)))];
  return table(heads, rows);
}

// ---------------------------------------------------------------- the page

function problem(text) {
  return h("p", { class: "error", role: "alert", "data-problem": "" }, text);
}

export async function comparePage(query, signal, failed) {
  const ids = [...new Set((query.get("runs") || "").split(",").map((s) => s.trim()).filter(Boolean))];
  const section = h("section", { "data-page": "compare" }, h("p", {}, link(["runs"], "← Runs")), h("h2", {}, "Compare runs"));
  if (ids.length < 2 || ids.length > MAX_RUNS) {
    section.append(problem(`Pick 2 to ${MAX_RUNS} runs to compare (this link names ${ids.length}): tick them in the runs list.`));
    return section;
  }
  const loaded = await Promise.allSettled(ids.map((id) => loadRun(id, signal)));
  const refused = loaded.find((r) => r.status === "rejected" && (r.reason instanceof Unauthorized || r.reason?.name === "AbortError"));
  if (refused) throw refused.reason; // the key form, or a page already left
  const runs = loaded.filter((r) => r.status === "fulfilled").map((r) => r.value);
  loaded.forEach((r, i) => {
    if (r.status === "rejected") section.append(problem(`Run ${ids[i]} cannot be compared: ${r.reason.message || r.reason}`));
  });
  if (runs.length < 2) {
    section.append(h("p", {}, "Fewer than two of these runs could be read: nothing to compare. ", link(["runs"], "Pick runs")));
    return section;
  }
  const curves = h("div", { class: "charts", id: "charts" });
  const only = h("input", { type: "checkbox", id: "only-differences" });
  const settings = h("div", { id: "settings" });
  only.addEventListener("change", () => settings.classList.toggle("only-differences", only.checked));
  section.append(h("h3", {}, "Curves"), curves, h("h3", {}, "Settings"),
    h("label", { class: "toggle" }, only, " only the settings that differ"), settings);
  const draw = () => {
    curves.replaceChildren(...charts(runs));
    settings.replaceChildren(settingsTable(runs));
  };
  draw();
  // Runs still going gain points: read them again until each has ended or the page is left.
  const timer = setInterval(async () => {
    const live = runs.filter((r) => !FINAL.has(r.run.status));
    if (!live.length) return clearInterval(timer);
    try { await Promise.all(live.map((r) => reload(r, signal))); draw(); } catch (error) { failed(error); }
  }, LIST_SECONDS * 1000);
  signal.addEventListener("abort", () => clearInterval(timer));
  return section;
}
