// Trainyard's dashboard: hash routes over the /v1 JSON API. Everything the API returns is
// put on the page through textContent and DOM calls, never as HTML: a job's metadata is
// whatever its submitter wrote.
import {
  FINAL, KEY, LIST_SECONDS, Unauthorized, api, authorized, badge, details, facts, h, json, link, metricsAfter, num, progressBar,
  redraw, runStep, table, when,
} from "./base.js";
import { lineChart } from "./chart.js";
import { comparePage, runPicker } from "./compare.js";
import { usagePage } from "./usage.js";

const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled"];
const main = document.getElementById("main");
let current = null; // the AbortController of the page on screen

// ---------------------------------------------------------------- the key and the event stream

function keyForm(refused) {
  const input = h("input", { type: "password", id: "api-key", name: "api-key", autocomplete: "off", required: true });
  const form = h("form", { class: "key-form", method: "post", action: "#" },
    h("h2", {}, "API key"),
    h("p", {}, "This service needs an API key. It is kept in this tab only and sent as a bearer token."),
    refused && h("p", { class: "error", role: "alert" }, "The service refused that key."),
    h("label", { for: "api-key" }, "Key"), input, h("button", { type: "submit" }, "Continue"));
  form.addEventListener("submit", (event) => {
    event.preventDefault(); // never submitted: the key goes nowhere but sessionStorage
    sessionStorage.setItem(KEY, input.value.trim());
    render();
  });
  return form;
}

// Reads a job's Server-Sent Events with fetch (an EventSource cannot send the key), and
// reconnects with Last-Event-ID until the job ends or the page is left.
async function stream(path, { signal, onEvent, ended }) {
  let last = 0, delay = 500;
  while (!signal.aborted) {
    try {
      const extra = { Accept: "text/event-stream" };
      if (last) extra["Last-Event-ID"] = String(last);
      const response = await authorized(path, { signal, headers: extra });
      if (!response.ok) throw new Error(`stream: ${response.status}`);
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value.replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = parse(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
          if (event) { last = event.id ?? last; onEvent(event); }
        }
      }
      delay = 500;
      if (await ended()) return;
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof Unauthorized) return refused(error);
      delay = Math.min(delay * 2, 10000);
    }
    await new Promise((resolve) => setTimeout(resolve, delay));
  }
}

function parse(block) {
  let id = null, type = "message", data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "id") id = Number(value);
    else if (field === "event") type = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return null;
  try { return { id, type, data: JSON.parse(data.join("\n")) }; } catch { return null; }
}

// ---------------------------------------------------------------- lists

const KINDS = {
  runs: { title: "Runs", path: "v1/runs" },
  "training-jobs": { title: "Training jobs", path: "v1/training-jobs" },
  "rollout-jobs": { title: "Rollout jobs", path: "v1/rollout-jobs" },
};

function progressText(item) {
  const p = item.progress || {};
  if (p.total_steps != null) return `${p.step}/${p.total_steps} steps`;
  if (p.total != null) return `${p.step}/${p.total}`;
  return p.step != null ? String(p.step) : "—";
}

async function listPage(kind, query, signal) {
  const { title, path } = KINDS[kind];
  const status = h("select", { name: "status", id: "filter-status" }, h("option", { value: "" }, "any status"), STATUSES.map((s) => h("option", { value: s }, s)));
  status.value = query.get("status") || "";
  const model = h("input", { name: "model", id: "filter-model", placeholder: "model", value: query.get("model") || "" });
  const filters = h("form", { class: "filters" }, h("label", {}, "Status ", status), h("label", {}, "Model ", model), h("button", { type: "submit" }, "Filter"));
  filters.addEventListener("submit", (event) => {
    event.preventDefault();
    const next = new URLSearchParams();
    if (status.value) next.set("status", status.value);
    if (model.value.trim()) next.set("model", model.value.trim());
    location.hash = `#/${kind}${next.size ? "?" + next : ""}`;
  });
  status.addEventListener("change", () => filters.requestSubmit());
  const body = h("tbody", { id: "rows" });
  const more = h("button", { type: "button", class: "more", hidden: true }, "Load more");
  const picker = kind === "runs" ? runPicker() : null; // ticks to compare runs
  const columns = [...(picker ? [""] : []), "Id", "Model", "Status", "Progress", "Created"];
  const section = h("section", { "data-page": kind }, h("h2", {}, title), filters, picker?.bar,
    h("div", { class: "scroll" }, h("table", {}, h("thead", {}, h("tr", {}, columns.map((t) => h("th", {}, t)))), body)), more);
  let paged = false; // once a person loads more, the list stays as it is
  const load = async (after) => {
    const params = new URLSearchParams({ limit: "50" });
    for (const key of ["status", "model"]) if (query.get(key)) params.set(key, query.get(key));
    if (after) params.set("after", after);
    const page = await api(`${path}?${params}`, { signal });
    const rows = page.data.map((item) => h("tr", { "data-id": item.id }, picker?.cell(item.id), h("td", {}, link([kind, item.id], item.id)), h("td", {}, item.model),
      h("td", {}, badge(item.status), item.paused ? " paused" : ""), h("td", {}, progressText(item)), h("td", {}, when(item.created_at))));
    if (after) body.append(...rows);
    else body.replaceChildren(...rows);
    if (!body.children.length) body.append(h("tr", {}, h("td", { colspan: columns.length, class: "empty" }, "Nothing here yet.")));
    more.hidden = !page.has_more;
    more.onclick = () => { paged = true; load(page.next_cursor).catch(failed); };
  };
  await load(null);
  // The first page again every few seconds: statuses and progress move while it is open.
  const timer = setInterval(() => paged || load(null).catch(failed), LIST_SECONDS * 1000);
  signal.addEventListener("abort", () => clearInterval(timer));
  return section;
}

// ---------------------------------------------------------------- models

async function modelsPage(query, signal) {
  const page = await api("v1/models?limit=100", { signal });
  const cards = await Promise.all(page.data.map(async (model) => {
    const checkpoints = await api(`v1/models/${encodeURIComponent(model.name)}/checkpoints?limit=100`, { signal });
    const rows = checkpoints.data.map((c) => h("tr", { "data-step": c.step }, h("td", {}, String(c.step)), h("td", {}, c.aliases.join(", ") || "—"),
      h("td", {}, num(c.metrics?.reward_mean ?? c.metrics?.loss)), h("td", {}, num(c.validation_metrics?.score)), h("td", {}, c.job_id ? link(["training-jobs", c.job_id], c.job_id) : "—"), h("td", {}, when(c.created_at))));
    return h("article", { class: "card", "data-model": model.name }, h("h3", {}, model.name),
      facts([["Latest step", String(model.current_step)], ["Backend", model.backend], ["Base model", model.base_model], ["Served", model.inference_model_name || "no"]]),
      h("p", {}, ["runs", "training-jobs", "rollout-jobs"].flatMap((kind, i) => [i ? " · " : "", link([kind], KINDS[kind].title, { model: model.name })]),
        model.project === "tinker" ? [" · ", link(["tinker", model.name], "Tinker losses")] : []),
      h("h4", {}, `Checkpoints (${checkpoints.data.length}${checkpoints.has_more ? "+" : ""})`),
      table(["Step", "Aliases", "Reward / loss", "Validation", "Job", "Created"], rows));
  }));
  return h("section", { "data-page": "models" }, h("h2", {}, "Models"), cards.length ? cards : h("p", { class: "empty" }, "No models yet."));
}

// ---------------------------------------------------------------- a job

function actions(buttons) {
  return h("div", { class: "actions" }, buttons.filter(Boolean).map(([label, path, refresh]) => {
    const button = h("button", { type: "button", "data-action": label.toLowerCase() }, label);
    button.addEventListener("click", async () => {
      button.disabled = true;
      try { await api(path, { method: "POST" }); } catch (error) { failed(error); }
      refresh();
    });
    return button;
  }));
}

function eventRow(event) {
  const data = event.data.data;
  return h("tr", { "data-seq": event.data.seq }, h("td", {}, String(event.data.seq)), h("td", {}, when(event.data.created_at)), h("td", {}, event.data.type),
    h("td", {}, h("code", {}, data && Object.keys(data).length ? JSON.stringify(data) : "")));
}

async function jobPage(kind, id, signal) {
  const base = `${KINDS[kind].path}/${encodeURIComponent(id)}`;
  const head = h("div", {});
  const log = h("tbody", { id: "events" });
  const section = h("section", { "data-page": "job", "data-kind": kind }, h("p", {}, link([kind], `← ${KINDS[kind].title}`)), head,
    h("h3", {}, "Events"), h("div", { class: "scroll" }, h("table", { class: "events" }, h("thead", {}, h("tr", {}, ["Seq", "Time", "Type", "Data"].map((t) => h("th", {}, t)))), log)));
  let job = null;
  const refresh = coalesce(async () => {
    job = await api(base, { signal });
    const live = !FINAL.has(job.status) && !job.cancel_requested;
    const p = job.progress;
    redraw(head,
      h("h2", {}, `${KINDS[kind].title.replace(/s$/, "")} `, h("code", {}, job.id), " ", badge(job.status)),
      actions([live && ["Cancel", `${base}/cancel`, refresh]]),
      progressBar(p.percent ?? (live ? null : 0), p.total != null ? `step ${p.step} of ${p.total}` : `step ${p.step}`),
      job.waiting_for && h("div", { class: "waiting", id: "waiting-for" }, h("strong", {}, "Waiting"), ": ", job.waiting_for),
      facts([["Model", job.model], ["Attempts", `${job.attempts}/${job.max_attempts}`], ["Cancel requested", job.cancel_requested ? "yes" : null],
        ["Created", when(job.created_at)], ["Started", when(job.started_at)], ["Finished", when(job.finished_at)],
        ["Training job", job.training_job_id ? link(["training-jobs", job.training_job_id], job.training_job_id) : null]]),
      job.error && h("div", { class: "error" }, h("strong", {}, job.error.type), ": ", job.error.message),
      job.result && details("Result", json(job.result), true),
      details("Summary", json(job.summary), !job.result),
      details("Metadata", json(job.metadata)));
  });
  await refresh.now();
  stream(`${base}/events/stream`, { signal, onEvent: (event) => { log.append(eventRow(event)); refresh(); }, ended: async () => (await refresh.now(), FINAL.has(job.status)) });
  return section;
}

// At most one call of `fn` every `ms`, never two at once, and one after the last request:
// steps can land ten times a second, and the page must neither starve nor fall behind.
function coalesce(fn, ms = 250) {
  let timer = null, chain = Promise.resolve();
  const run = () => {
    if (!timer) timer = setTimeout(() => { timer = null; run.now().catch(failed); }, ms);
  };
  run.now = () => (chain = chain.catch(() => {}).then(fn));
  return run;
}

// ---------------------------------------------------------------- a run

const KNOWN = new Set(["reward_mean", "reward_std", "loss"]);
const SKIP = /_id$|_ids$|^job/;

function runCharts(rows, startStep) {
  const steps = rows.filter((r) => r.kind === "step");
  const validations = rows.filter((r) => r.kind === "validation");
  const points = (list, key) => list.filter((r) => typeof r.data[key] === "number").map((r) => ({ x: runStep(r, startStep), y: r.data[key] }));
  const band = steps.filter((r) => typeof r.data.reward_mean === "number")
    .map((r) => ({ x: r.step, lo: r.data.reward_mean - (r.data.reward_std || 0), hi: r.data.reward_mean + (r.data.reward_std || 0) }));
  const xs = rows.map((r) => runStep(r, startStep));
  const domain = rows.length ? [Math.min(...xs), Math.max(...xs)] : undefined;
  const charts = [lineChart({ name: "reward", title: "Reward", domain, series: [
    { name: "reward_mean", label: "train reward (mean ± std)", points: points(steps, "reward_mean"), band },
    { name: "validation", label: "validation score", points: points(validations, "score") },
  ] })];
  charts.push(lineChart({ name: "loss", title: "Loss", domain, series: [{ name: "loss", label: "loss", points: points(steps, "loss") }] }));
  const others = new Set(steps.flatMap((r) => Object.keys(r.data).filter((k) => typeof r.data[k] === "number" && !KNOWN.has(k) && !SKIP.test(k))));
  for (const key of [...others].sort()) {
    charts.push(lineChart({ name: key, title: key, domain, series: [{ name: key, label: key, points: points(steps, key) }] }));
  }
  return charts;
}

async function runPage(id, signal) {
  const base = `v1/runs/${encodeURIComponent(id)}`;
  const head = h("div", {});
  const charts = h("div", { class: "charts", id: "charts" });
  const log = h("tbody", { id: "events" });
  const section = h("section", { "data-page": "run" }, h("p", {}, link(["runs"], "← Runs")), head, h("h3", {}, "Curves"), charts,
    h("details", {}, h("summary", {}, "Events"), h("div", { class: "scroll" }, h("table", { class: "events" }, h("thead", {}, h("tr", {}, ["Seq", "Time", "Type", "Data"].map((t) => h("th", {}, t)))), log))));
  const rows = [];
  let run = null, seq = 0, startStep = null;
  const refresh = coalesce(async () => {
    run = await api(base, { signal });
    const p = run.progress, live = !FINAL.has(run.status);
    redraw(head,
      h("h2", {}, "Run ", h("code", {}, run.id), " ", badge(run.status), run.paused ? h("span", { class: "badge paused" }, "paused") : ""),
      actions([live && !run.paused && ["Pause", `${base}/pause`, refresh], live && run.paused && ["Resume", `${base}/resume`, refresh],
        live && !run.cancel_requested && ["Cancel", `${base}/cancel`, refresh]]),
      progressBar(p.percent, `step ${p.step} of ${p.total_steps} · ${p.phase}${p.eta_seconds != null ? ` · ${Math.round(p.eta_seconds)} s left` : ""}`),
      facts([["Model", link(["models"], run.model)], ["Epoch", p.epochs ? `${p.epoch} of ${p.epochs}` : String(p.epoch)],
        ["Best checkpoint", run.best_checkpoint ? `step ${run.best_checkpoint.step} (score ${num(run.best_checkpoint.score)})` : null],
        ["Stop reason", run.stop_reason], ["Now waiting on", run.current_jobs.length ? run.current_jobs.map((j) => h("code", {}, j, " ")) : null],
        ["Created", when(run.created_at)], ["Finished", run.finished_at ? when(run.finished_at) : null]]),
      run.error && h("div", { class: "error" }, h("strong", {}, run.error.type), ": ", run.error.message),
      details("Metadata", json(run.metadata)));
  });
  // New rows of the curves since the last seen: on load, and whenever a step or validation lands.
  const more = coalesce(async () => {
    const page = await metricsAfter(base, seq, signal);
    rows.push(...page.rows);
    seq = page.seq;
    // A validation is placed by the model step the run started from (known once it has).
    if (startStep == null && rows.some((r) => r.kind === "validation")) startStep = (await api(`${base}/settings`, { signal })).start_step;
    charts.replaceChildren(...runCharts(rows, startStep));
  }, 100);
  await Promise.all([refresh.now(), more.now()]);
  const onEvent = (event) => {
    log.append(eventRow(event));
    if (event.type === "run_step" || event.type === "run_validated") more();
    refresh();
  };
  stream(`${base}/events/stream`, { signal, onEvent, ended: async () => (await refresh.now(), FINAL.has(run.status)) });
  return section;
}

// ---------------------------------------------------------------- a Tinker training run

// A model of project `tinker` (the Tinker SDK's training run): its loss and learning rate
// per optimizer step, from GET /v1/models/{name}/tinker-metrics, gaining points as steps land.
async function tinkerPage(name, signal) {
  const base = `v1/models/${encodeURIComponent(name)}`;
  const head = h("div", {});
  const charts = h("div", { class: "charts", id: "charts" });
  const section = h("section", { "data-page": "tinker" }, h("p", {}, link(["models"], "← Models")), head, h("h3", {}, "Curves"), charts);
  const rows = [];
  const more = async () => {
    for (;;) {
      const after = rows.length ? rows[rows.length - 1].step : 0;
      const page = await api(`${base}/tinker-metrics?after=${after}&limit=1000`, { signal });
      rows.push(...page.data);
      if (!page.has_more) break;
    }
    const model = await api(base, { signal });
    redraw(head, h("h2", {}, "Tinker run ", h("code", {}, model.name)),
      facts([["Base model", model.base_model], ["Optimizer steps", String(rows.length)], ["Latest checkpoint", String(model.current_step)],
        ["LoRA rank", model.config?.lora_rank != null ? String(model.config.lora_rank) : null], ["Created", when(model.created_at)]]));
    const points = (key) => rows.filter((r) => typeof r[key] === "number").map((r) => ({ x: r.step, y: r[key] }));
    const domain = rows.length ? [rows[0].step, rows[rows.length - 1].step] : undefined;
    const list = [lineChart({ name: "loss", title: "Loss (loss:sum of the step's forward_backward)", domain, series: [{ name: "loss", label: "loss", points: points("loss") }] }),
      lineChart({ name: "learning_rate", title: "Learning rate", domain, series: [{ name: "learning_rate", label: "learning rate", points: points("learning_rate") }] })];
    const others = new Set(rows.flatMap((r) => Object.keys(r.metrics).filter((k) => k !== "learning_rate")));
    for (const key of [...others].sort()) {
      const values = rows.filter((r) => typeof r.metrics[key] === "number").map((r) => ({ x: r.step, y: r.metrics[key] }));
      list.push(lineChart({ name: key, title: key, domain, series: [{ name: key, label: key, points: values }] }));
    }
    charts.replaceChildren(...list);
  };
  await more();
  // A Tinker run has no event stream: its new steps are read every few seconds.
  let busy = false; // never two reads at once: each appends the steps after the last it saw
  const tick = () => { if (!busy) { busy = true; more().catch(failed).finally(() => { busy = false; }); } };
  const timer = setInterval(tick, LIST_SECONDS * 1000);
  signal.addEventListener("abort", () => clearInterval(timer));
  return section;
}

// ---------------------------------------------------------------- routing

function showKey() {
  if (current) current.abort();
  if (document.body.dataset.auth === "needed") return; // asked already
  const refused = sessionStorage.getItem(KEY) != null;
  sessionStorage.removeItem(KEY);
  document.getElementById("forget").hidden = true;
  main.replaceChildren(keyForm(refused));
  document.getElementById("api-key").focus();
  document.body.dataset.auth = "needed";
}

// A key given after the refused request was sent has not been tried: the page is drawn again
// with it (the key form would otherwise drop it).
function refused(error) {
  return sessionStorage.getItem(KEY) === error.key ? showKey() : render();
}

function failed(error) {
  if (error instanceof Unauthorized) return refused(error);
  if (error?.name === "AbortError") return;
  const alert = document.getElementById("alert") || main.appendChild(h("p", { id: "alert", class: "error", role: "alert" }));
  alert.textContent = String(error.message || error); // one alert, however often a poll fails
}

async function render() {
  if (current) current.abort();
  const controller = (current = new AbortController());
  delete document.body.dataset.auth;
  const [path, search] = (location.hash.slice(1) || "/runs").split("?");
  const query = new URLSearchParams(search || "");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  // Runs are compared from their list; a Tinker run is reached from its model's card.
  const section = parts[0] === "compare" ? "runs" : parts[0] === "tinker" ? "models" : parts[0];
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("here", a.getAttribute("href") === `#/${section}`);
  document.getElementById("forget").hidden = !sessionStorage.getItem(KEY);
  main.replaceChildren(h("p", { class: "loading" }, "Loading…"));
  try {
    let page;
    if (parts[0] === "models") page = await modelsPage(query, controller.signal);
    else if (parts[0] === "runs" && parts[1]) page = await runPage(parts[1], controller.signal);
    else if (parts[0] === "tinker" && parts[1]) page = await tinkerPage(parts[1], controller.signal);
    else if (parts[0] === "compare") page = await comparePage(query, controller.signal, failed);
    else if (parts[0] === "usage") page = await usagePage(query, controller.signal);
    else if (KINDS[parts[0]] && parts[1]) page = await jobPage(parts[0], parts[1], controller.signal);
    else if (KINDS[parts[0]]) page = await listPage(parts[0], query, controller.signal);
    else page = h("p", {}, "No such page. ", link(["runs"], "Runs"));
    if (controller === current) main.replaceChildren(page);
  } catch (error) {
    if (controller === current) { main.replaceChildren(); failed(error); }
  }
}

document.getElementById("forget").addEventListener("click", () => { sessionStorage.removeItem(KEY); render(); });
window.addEventListener("hashchange", render);
render();
