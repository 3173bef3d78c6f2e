// A small SVG line chart: lines with a circle per point, an optional band (mean ± std),
// axes with a handful of ticks, a legend. Every label goes in through textContent.

const NS = "http://www.w3.org/2000/svg";
const W = 640, H = 240, PAD = { left: 52, right: 12, top: 12, bottom: 28 };

function svg(tag, attrs = {}, text) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text != null) el.textContent = text;
  return el;
}

// About `count` round tick values covering [lo, hi].
function ticks(lo, hi, count = 5) {
  const span = hi - lo || Math.abs(hi) || 1;
  const raw = span / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
  const out = [];
  for (let i = Math.ceil(lo / step); i * step <= hi + step * 1e-9; i++) out.push(+(i * step).toPrecision(12));
  return out;
}

function label(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  return a >= 1e4 || a < 1e-3 ? v.toExponential(1) : String(+v.toPrecision(4));
}

function extent(values) {
  let lo = Math.min(...values), hi = Math.max(...values);
  if (!Number.isFinite(lo)) return [0, 1];
  if (lo === hi) { lo -= Math.abs(lo) * 0.1 || 0.5; hi += Math.abs(hi) * 0.1 || 0.5; }
  return [lo, hi];
}

// series: [{ name, label, points: [{x, y}], band?: [{x, lo, hi}] }]
// domain: the x range to draw (every chart of a run shares its steps), else the points'.
export function lineChart({ name, title, series, domain, xLabel = "step" }) {
  const figure = document.createElement("figure");
  figure.className = "chart";
  figure.dataset.chart = name;
  const caption = document.createElement("figcaption");
  caption.textContent = title;
  figure.append(caption);

  const all = series.flatMap((s) => s.points);
  const bands = series.flatMap((s) => s.band || []);
  const [x0, x1] = extent(domain || all.map((p) => p.x));
  const [y0, y1] = extent([...all.map((p) => p.y), ...bands.flatMap((b) => [b.lo, b.hi])]);
  const sx = (x) => PAD.left + ((x - x0) / (x1 - x0)) * (W - PAD.left - PAD.right);
  const sy = (y) => H - PAD.bottom - ((y - y0) / (y1 - y0)) * (H - PAD.top - PAD.bottom);

  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  const axes = svg("g", { class: "axes" });
  for (const t of ticks(y0, y1)) {
    axes.append(svg("line", { x1: PAD.left, x2: W - PAD.right, y1: sy(t), y2: sy(t), class: "grid" }));
    axes.append(svg("text", { x: PAD.left - 6, y: sy(t) + 4, "text-anchor": "end" }, label(t)));
  }
  for (const t of ticks(x0, x1, 6).filter(Number.isInteger)) { // steps are whole numbers
    axes.append(svg("text", { x: sx(t), y: H - PAD.bottom + 16, "text-anchor": "middle" }, label(t)));
  }
  axes.append(svg("text", { x: W - PAD.right, y: H - 2, "text-anchor": "end" }, xLabel));
  root.append(axes);

  series.forEach((s, i) => {
    const g = svg("g", { class: `series s${i}`, "data-series": s.name });
    if (s.band && s.band.length > 1) {
      const upper = s.band.map((b) => `${sx(b.x)},${sy(b.hi)}`);
      const lower = s.band.map((b) => `${sx(b.x)},${sy(b.lo)}`).reverse();
      g.append(svg("polygon", { class: "band", points: [...upper, ...lower].join(" ") }));
    }
    if (s.points.length > 1) {
      g.append(svg("polyline", { class: "line", points: s.points.map((p) => `${sx(p.x)},${sy(p.y)}`).join(" ") }));
    }
    for (const p of s.points) {
      const dot = svg("circle", { class: "point", cx: sx(p.x), cy: sy(p.y), r: 3, "data-x": p.x, "data-y": p.y });
      dot.append(svg("title", {}, `${s.label}, ${xLabel} ${p.x}: ${label(p.y)}`));
      g.append(dot);
    }
    root.append(g);
  });
  figure.append(root);

  const legend = document.createElement("ul");
  legend.className = "legend";
  series.forEach((s, i) => {
    const item = document.createElement("li");
    item.className = `s${i}`;
    item.textContent = `${s.label} (${s.points.length})`;
    legend.append(item);
  });
  figure.append(legend);
  return figure;
}
