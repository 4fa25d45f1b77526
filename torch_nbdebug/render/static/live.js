// Live view of a running cell: title, steps done, elapsed time (ticking here between updates), a status
// line, and panels sent by the kernel: "lines" (series over steps), "stack" (stacked areas over time) or
// "table". The kernel replaces this view with the final report when the cell ends. Plain ES module.

import { h, s, num, bytes, count, listen } from "./dom.js";

const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#bf8700", "#8250df", "#0a7ea4", "#bc4c00", "#6e7781",
  "#d4a72c", "#116329"];
const W = 560, H = 170, PAD = { l: 64, r: 8, t: 8, b: 26 };
const MAX_LEGEND = 10;

// A value on an axis or in a tooltip: bytes in binary units, anything else as the statistics write it.
const value = (v, unit) => (unit === "bytes" ? bytes(v) : num(v));

export function clock(seconds) {
  const t = Math.max(0, Math.floor(seconds));
  const m = Math.floor(t / 60), sec = t % 60;
  return m >= 60 ? `${Math.floor(m / 60)}h ${m % 60}m ${sec}s` : m ? `${m}m ${sec}s` : `${sec}s`;
}

function axes(xmin, xmax, ymin, ymax, xlabel, yfmt) {
  const g = s("g", { class: "live-axes", "font-size": 10, fill: "#57606a" });
  g.append(s("line", { x1: PAD.l, y1: H - PAD.b, x2: W - PAD.r, y2: H - PAD.b, stroke: "#d0d7de" }));
  g.append(s("line", { x1: PAD.l, y1: PAD.t, x2: PAD.l, y2: H - PAD.b, stroke: "#d0d7de" }));
  g.append(s("text", { x: PAD.l - 4, y: PAD.t + 8, "text-anchor": "end" }, yfmt(ymax)));
  g.append(s("text", { x: PAD.l - 4, y: H - PAD.b, "text-anchor": "end" }, yfmt(ymin)));
  g.append(s("text", { x: PAD.l, y: H - 8 }, value(xmin)));
  g.append(s("text", { x: W - PAD.r, y: H - 8, "text-anchor": "end" }, value(xmax)));
  if (xlabel) g.append(s("text", { x: (W + PAD.l) / 2, y: H - 8, "text-anchor": "middle" }, xlabel));
  return g;
}

function scales(x, lo, hi) {
  const xmin = Math.min(...x), xmax = Math.max(...x);
  const sx = (v) => PAD.l + (xmax > xmin ? (v - xmin) / (xmax - xmin) : 0.5) * (W - PAD.l - PAD.r);
  const sy = (v) => H - PAD.b - (hi > lo ? (v - lo) / (hi - lo) : 0.5) * (H - PAD.t - PAD.b);
  return { xmin, xmax, sx, sy };
}

function legend(series) {
  const shown = series.slice(0, MAX_LEGEND).map((se, i) =>
    h("span", {}, h("span", { class: "swatch", style: `background:${COLORS[i % COLORS.length]}` }), se.name));
  const more = series.length > MAX_LEGEND ? h("span", { class: "muted" }, `+${series.length - MAX_LEGEND} more`) : null;
  return h("div", { class: "legend" }, shown, more);
}

function lines(p) {
  const x = p.x || [];
  const series = p.series || [];
  const log = !!p.log;
  const tf = (v) => (log ? Math.log10(v) : v);
  const ok = (v) => v !== null && v !== undefined && Number.isFinite(v) && (!log || v > 0);
  const all = series.flatMap((se) => se.y.filter(ok).map(tf));
  if (!x.length || !all.length) return h("div", { class: "muted live-empty" }, "no values yet");
  const lo = Math.min(...all), hi = Math.max(...all);
  const { xmin, xmax, sx, sy } = scales(x, lo, hi);
  const svg = s("svg", { width: W, height: H, class: "plot live-plot", viewBox: `0 0 ${W} ${H}` });
  svg.append(axes(xmin, xmax, lo, hi, p.xlabel, (v) => value(log ? 10 ** v : v, p.unit)));
  series.forEach((se, i) => {
    let d = "";
    let pen = "M";
    se.y.forEach((v, k) => {
      if (!ok(v)) { pen = "M"; return; }  // a gap at a missing or non-finite value
      d += `${pen}${sx(x[k]).toFixed(1)},${sy(tf(v)).toFixed(1)}`;
      pen = "L";
    });
    const path = s("path", { d, fill: "none", stroke: COLORS[i % COLORS.length], "stroke-width": 1.5 });
    path.append(s("title", {}, se.name));
    svg.append(path);
  });
  return [svg, legend(series)];
}

function stack(p) {
  const x = p.x || [];
  const series = (p.series || []).filter((se) => se.y.some((v) => v));
  if (x.length < 1 || !series.length) return h("div", { class: "muted live-empty" }, "no values yet");
  const tops = x.map((_, k) => series.reduce((acc, se) => acc + (se.y[k] || 0), 0));
  const { xmin, xmax, sx, sy } = scales(x, 0, Math.max(...tops));
  const svg = s("svg", { width: W, height: H, class: "plot live-plot", viewBox: `0 0 ${W} ${H}` });
  svg.append(axes(xmin, xmax, 0, Math.max(...tops), p.xlabel, (v) => value(v, p.unit)));
  const base = x.map(() => 0);
  series.forEach((se, i) => {
    const top = base.map((b, k) => b + (se.y[k] || 0));
    const up = x.map((xv, k) => `${sx(xv).toFixed(1)},${sy(top[k]).toFixed(1)}`);
    const down = x.map((xv, k) => `${sx(xv).toFixed(1)},${sy(base[k]).toFixed(1)}`).reverse();
    const area = s("polygon", { points: [...up, ...down].join(" "), fill: COLORS[i % COLORS.length], "fill-opacity": 0.7 });
    area.append(s("title", {}, `${se.name}: ${value(se.y[se.y.length - 1] || 0, p.unit)} now`));
    svg.append(area);
    top.forEach((v, k) => { base[k] = v; });
  });
  return [svg, legend(series)];
}

function table(p) {
  const rows = p.rows || [];
  if (!rows.length) return h("div", { class: "muted live-empty" }, "nothing yet");
  return h("table", { class: "live-table" }, h("tr", {}, (p.columns || []).map((c) => h("th", {}, c))),
    rows.map((r) => h("tr", {}, r.map((c) => h("td", {}, c)))));
}

const DRAW = { lines, stack, table };

function panel(p) {
  const draw = DRAW[p.kind];
  return h("div", { class: "live-panel" }, p.title ? h("h3", {}, p.title) : null,
    draw ? draw(p) : h("div", { class: "muted" }, `(unknown panel kind ${p.kind})`));
}

export default {
  render({ model, el }) {
    const root = h("div", { class: "tnd tnd-live" });
    el.append(root);
    const head = h("div", { class: "card info live-head" });
    const body = h("div", { class: "live-panels" });
    root.append(head, body);
    let base = model.get("elapsed") || 0;
    let since = performance.now();
    const header = () => {
      const running = model.get("running");
      const elapsed = base + (running ? (performance.now() - since) / 1000 : 0);
      const steps = model.get("steps") || 0;
      head.replaceChildren(...[
        h("b", {}, model.get("title")), " ",
        h("span", { class: running ? "live-state" : "live-state muted" }, running ? "● running" : "stopped"), " · ",
        h("span", { class: "live-steps" }, `${count(steps)} step${steps === 1 ? "" : "s"}`), " · ",
        h("span", { class: "live-elapsed" }, clock(elapsed)),
        model.get("status") ? [" · ", h("span", { class: model.get("alert") ? "bad live-status" : "live-status" },
          model.get("status"))] : []].flat());
    };
    const panels = () => body.replaceChildren(...(model.get("panels") || []).map(panel));
    const onElapsed = () => { base = model.get("elapsed") || 0; since = performance.now(); header(); };
    header();
    panels();
    const timer = setInterval(header, 1000);
    const unlisten = listen(model, { "change:elapsed": onElapsed, "change:steps change:status change:running": header,
      "change:panels": panels });
    return () => { clearInterval(timer); unlisten(); };
  },
};
