// %%monitor view: one chart per watched series (raw + smoothed, alerts marked), a per-layer chart
// (gradient norm or update/parameter ratio), smoothing, log scale and zoom (drag across a chart, or
// click an alert). Hovering a chart shows the values at the step under the pointer. A series constant
// within float noise (a fixed learning rate, smoothed) is drawn flat; tick labels never repeat.
// Alerts are listed one row per step and kind (the per-layer rows folded under it).
// Plain ES module, no CDN. `smoothing`, `log_scale`, `zoom` and `panel` sync both ways.

import { h, s, num, floats, listen } from "./dom.js";

const W = 640, H = 150, PAD = { l: 56, r: 12, t: 8, b: 24 };
const SERIES = "#0969da";
const FLAT_TOL = 1e-9;  // as process.monitor.FLAT_TOL: a spread below this fraction of the value is flat
const ALERT = { "non-finite": "#cf222e", spike: "#bc4c00", plateau: "#9a6700", vanishing: "#8250df", exploding: "#bc4c00" };

// TensorBoard-style debiased exponential moving average, skipping non-finite points.
function smooth(y, w) {
  const out = new Float64Array(y.length).fill(NaN);
  let last = 0, n = 0;
  for (let k = 0; k < y.length; k++) {
    if (!Number.isFinite(y[k])) continue;
    last = last * w + (1 - w) * y[k]; n += 1;
    out[k] = last / (1 - w ** n);
  }
  return out;
}

// The y range: a series flat within FLAT_TOL gets 10% either side of its value (1 at zero).
function yRange(vals) {
  let lo = Math.min(...vals), hi = Math.max(...vals);
  if (hi - lo <= FLAT_TOL * Math.max(Math.abs(lo), Math.abs(hi))) {
    const mid = (lo + hi) / 2, pad = mid ? 0.1 * Math.abs(mid) : 1;
    lo = mid - pad; hi = mid + pad;
  }
  return [lo, hi];
}

// Tick labels for values: more digits until no two read the same, then duplicates dropped.
function tickLabels(values, fmt) {
  for (let digits = 4; digits <= 12; digits++) {
    const labels = values.map((v) => fmt(v, digits));
    if (new Set(labels).size === labels.length) return labels;
  }
  return values.map((v, i) => (i && fmt(v, 12) === fmt(values[i - 1], 12) ? "" : fmt(v, 12)));
}

// One chart: lines over steps within [x0, x1]; drag to zoom; hover for values; alerts as dashed lines.
function chart({ x, lines, log, x0, x1, alerts, label, onZoom }) {
  const inRange = (k) => x[k] >= x0 && x[k] <= x1;
  const ok = (v) => Number.isFinite(v) && (!log || v > 0);
  const tf = (v) => (log ? Math.log10(v) : v);
  const vals = [];
  for (const ln of lines) ln.y.forEach((v, k) => { if (inRange(k) && ok(v)) vals.push(tf(v)); });
  const svg = s("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "plot tnd-chart", role: "img",
    "aria-label": label });
  if (!vals.length) {
    svg.append(s("text", { x: PAD.l, y: H / 2, "font-size": 12, fill: "#57606a" }, "no finite values in this range"));
    return svg;
  }
  const [lo, hi] = yRange(vals);
  const sx = (v) => PAD.l + (x1 > x0 ? (v - x0) / (x1 - x0) : 0.5) * (W - PAD.l - PAD.r);
  const sy = (v) => H - PAD.b - ((v - lo) / (hi - lo)) * (H - PAD.t - PAD.b);
  svg.append(s("line", { x1: PAD.l, y1: H - PAD.b, x2: W - PAD.r, y2: H - PAD.b, stroke: "#8c959f" }));
  svg.append(s("line", { x1: PAD.l, y1: PAD.t, x2: PAD.l, y2: H - PAD.b, stroke: "#8c959f" }));
  const fr = [0, 0.5, 1], ys = fr.map((f) => lo + f * (hi - lo));
  const yLabels = tickLabels(ys.map((v) => (log ? 10 ** v : v)), num);
  const xLabels = tickLabels(fr.map((f) => Math.round(x0 + f * (x1 - x0))), (v) => String(v));
  fr.forEach((f, i) => {
    svg.append(s("text", { x: PAD.l - 4, y: sy(ys[i]) + 4, "text-anchor": "end", "font-size": 10, fill: "#57606a",
      class: "tnd-ytick" }, yLabels[i]));
    if (xLabels[i]) svg.append(s("text", { x: sx(x0 + f * (x1 - x0)), y: H - 6, "text-anchor": "middle",
      "font-size": 10, fill: "#57606a", class: "tnd-xtick" }, xLabels[i]));
  });
  lines.forEach((ln) => {
    let d = "", pen = "M";
    ln.y.forEach((v, k) => {
      if (!inRange(k) || !ok(v)) { pen = "M"; return; }
      d += `${pen}${sx(x[k]).toFixed(1)},${sy(tf(v)).toFixed(1)}`;
      pen = "L";
    });
    const path = s("path", { d, fill: "none", stroke: ln.color, "stroke-width": ln.width || 1.5,
      "stroke-opacity": ln.opacity || 1, class: ln.cls || "" });
    path.append(s("title", {}, ln.name));
    svg.append(path);
  });
  for (const a of alerts) {
    if (a.step < x0 || a.step > x1) continue;
    const line = s("line", { x1: sx(a.step), x2: sx(a.step), y1: PAD.t, y2: H - PAD.b, stroke: ALERT[a.kind] || "#cf222e",
      "stroke-dasharray": "4 3", class: `tnd-alert-mark tnd-alert-${a.kind}` });
    line.append(s("title", {}, a.message));
    svg.append(line);
  }
  // Drag across the chart to zoom to those steps.
  const band = s("rect", { y: PAD.t, height: H - PAD.t - PAD.b, fill: "rgba(9,105,218,0.15)", width: 0, x: 0 });
  svg.append(band);
  let start = null;
  const stepAt = (ev) => {
    const r = svg.getBoundingClientRect();
    const px = ((ev.clientX - r.left) / r.width) * W;
    return x0 + ((px - PAD.l) / (W - PAD.l - PAD.r)) * (x1 - x0);
  };
  // Hover: a guide at the nearest recorded step and its values (each line's, in its colour).
  const guide = s("line", { y1: PAD.t, y2: H - PAD.b, stroke: "#8c959f", visibility: "hidden" });
  const tip = s("text", { y: PAD.t + 10, "font-size": 10, class: "tnd-hover", visibility: "hidden",
    "paint-order": "stroke", style: "stroke: var(--tnd-bg, #fff)", "stroke-width": 3 });
  svg.append(guide, tip);
  const hover = (ev) => {
    const at = stepAt(ev);
    let k = -1;
    x.forEach((xv, j) => { if (inRange(j) && (k < 0 || Math.abs(xv - at) < Math.abs(x[k] - at))) k = j; });
    if (k < 0) return;
    const px = sx(x[k]), right = px > (W + PAD.l) / 2;
    guide.setAttribute("x1", px); guide.setAttribute("x2", px); guide.setAttribute("visibility", "visible");
    const tx = right ? px - 6 : px + 6;
    const rows = [["step " + x[k], null], ...lines.map((ln) => [`${ln.short || ln.name} ${num(ln.y[k])}`, ln.color])];
    tip.replaceChildren(...rows.map(([t, c], i) => s("tspan", c ? { x: tx, dy: 12, fill: c } : { x: tx,
      "font-weight": "bold" }, t)));
    tip.setAttribute("x", tx);
    tip.setAttribute("text-anchor", right ? "end" : "start");
    tip.setAttribute("visibility", "visible");
  };
  svg.addEventListener("pointerleave", () => { guide.setAttribute("visibility", "hidden"); tip.setAttribute("visibility", "hidden"); });
  svg.addEventListener("pointerdown", (ev) => { start = stepAt(ev); });
  svg.addEventListener("pointermove", (ev) => {
    hover(ev);
    if (start === null) return;
    const a = sx(Math.min(start, stepAt(ev))), b = sx(Math.max(start, stepAt(ev)));
    band.setAttribute("x", a); band.setAttribute("width", Math.max(b - a, 0));
  });
  svg.addEventListener("pointerup", (ev) => {
    if (start === null) return;
    const a = Math.min(start, stepAt(ev)), b = Math.max(start, stepAt(ev));
    start = null;
    band.setAttribute("width", 0);
    if (b - a >= 1) onZoom([Math.max(Math.floor(a), x[0]), Math.min(Math.ceil(b), x[x.length - 1])]);
  });
  return svg;
}

function render({ model, el }) {
  const root = h("div", { class: "tnd tnd-monitor" });
  el.append(root);

  function draw() {
    const meta = model.get("meta");
    const nE = meta.expressions.length, nL = meta.layers.length;
    const steps = meta.steps, lsteps = meta.layer_steps;
    const values = floats(model.get("values"));
    const panelKind = model.get("panel");
    const layerData = floats(model.get(panelKind === "ratio" ? "ratios" : "norms"));
    const w = Math.min(Math.max(model.get("smoothing"), 0), 0.99);
    const log = model.get("log_scale");
    const zoom = model.get("zoom");
    const first = steps.length ? steps[0] : 0, last = steps.length ? steps[steps.length - 1] : 1;
    const [x0, x1] = zoom && zoom.length === 2 ? zoom : [first, last];
    const setZoom = (z) => { model.set("zoom", z); model.save_changes(); };

    const smoothIn = h("input", { type: "range", min: "0", max: "0.99", step: "0.01", value: String(w),
      class: "tnd-smoothing", "aria-label": "smoothing" });
    smoothIn.addEventListener("change", () => { model.set("smoothing", Number(smoothIn.value)); model.save_changes(); });
    const logIn = h("input", { type: "checkbox", class: "tnd-log" });
    logIn.checked = log;
    logIn.addEventListener("change", () => { model.set("log_scale", logIn.checked); model.save_changes(); });
    const reset = h("button", { class: "tnd-reset-zoom", title: "show every step" }, "reset zoom");
    reset.disabled = !(zoom && zoom.length === 2);
    reset.addEventListener("click", () => setZoom([]));
    const controls = h("div", { class: "tnd-controls" },
      h("label", {}, "smoothing ", smoothIn, ` ${w.toFixed(2)}`), "  ",
      h("label", {}, logIn, " log scale"), "  ", reset,
      h("span", { class: "muted" }, `  steps ${x0}–${x1} (drag across a chart to zoom)`));

    const charts = [];
    for (let e = 0; e < nE; e++) {
      const y = Float64Array.from(steps, (_, k) => values[k * nE + e]);
      const name = meta.expressions[e];
      const alerts = meta.alerts.filter((a) => a.series === name);
      charts.push(h("div", { class: "tnd-series" }, h("h3", {}, name),
        chart({ x: steps, log, x0, x1, alerts, label: `${name} by optimizer step`, onZoom: setZoom,
          lines: [{ y, color: SERIES, opacity: 0.3, width: 1, name: `${name} (raw)`, short: "value", cls: "tnd-raw" },
            { y: smooth(y, w), color: SERIES, name: `${name} (smoothed ${w.toFixed(2)})`, short: "smoothed",
              cls: "tnd-smooth" }] })));
    }
    let layerBox = null;
    const colors = meta.colours || [SERIES];
    if (nL && lsteps.length) {
      const pick = h("select", { class: "tnd-panel", "aria-label": "layer figure" },
        h("option", { value: "norm" }, "gradient norm"), h("option", { value: "ratio" }, "update / parameter ratio"));
      pick.value = panelKind;
      pick.addEventListener("change", () => { model.set("panel", pick.value); model.save_changes(); });
      const flagged = new Set(meta.alerts.filter((a) => meta.layers.includes(a.series)).map((a) => a.series));
      const lastRow = lsteps.length - 1;
      const order = [...Array(nL).keys()].sort((a, b) =>
        (flagged.has(meta.layers[b]) - flagged.has(meta.layers[a])) ||
        ((layerData[lastRow * nL + b] || 0) - (layerData[lastRow * nL + a] || 0)));
      const shown = order.slice(0, 8);
      const lines = shown.map((li, i) => ({
        y: Float64Array.from(lsteps, (_, k) => { const v = layerData[k * nL + li]; return v < 0 ? NaN : v; }),
        color: colors[i % colors.length], width: 1.2, name: meta.layers[li] }));
      const alerts = meta.alerts.filter((a) => meta.layers.includes(a.series));
      layerBox = h("div", { class: "tnd-layers" }, h("h3", {}, "per layer: ", pick,
        h("span", { class: "muted" }, nL > 8 ? ` (${shown.length} of ${nL} layers: flagged, then largest)` : "")),
        chart({ x: lsteps, log: true, x0, x1, alerts, label: "per-layer values by optimizer step", onZoom: setZoom, lines }),
        h("div", { class: "legend" }, shown.map((li, i) =>
          h("span", {}, h("span", { class: "swatch", style: `background:${colors[i % colors.length]}` }), meta.layers[li]))));
    }
    const groups = meta.groups || meta.alerts;
    const alertRow = (g) => {
      const head = [h("button", { class: "tnd-alert", title: "zoom to this step",
        onclick: () => setZoom([Math.max(first, g.step - 20), Math.min(last, g.step + 20)]) }, g.kind), " ", g.message];
      if (!g.layers || !g.layers.length) return h("li", {}, ...head);
      return h("li", {}, h("details", { class: "tnd-alert-layers" }, h("summary", {}, ...head),
        h("ul", {}, g.layers.map((m) => h("li", {}, m)))));
    };
    const alertList = groups.length ? h("ul", { class: "tnd-alerts" }, groups.map(alertRow)) : null;
    const parts = [h("h3", { class: "tnd-title" }, meta.title), controls, ...charts, layerBox, alertList,
      ...meta.errors.map((t) => h("p", { class: "warn" }, t)), ...meta.notes.map((t) => h("p", { class: "muted" }, t))];
    root.replaceChildren(...parts.filter((p) => p !== null));
  }

  draw();
  return listen(model, { "change:meta change:values change:norms change:ratios change:smoothing change:log_scale change:zoom change:panel": draw });
}

export default { render };
