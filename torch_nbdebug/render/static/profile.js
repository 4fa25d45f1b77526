// %%profile view: the verdict and its fix, a stacked bar per step (time by category), the timeline of
// one step (drag across it to zoom, buttons to zoom out or reset), and tables of the top lines, modules
// and ops; a line's row opens the statement with the lines around it. Plain ES module, no CDN.
// `zoom` and `opened` sync both ways.

import { h, s, place, listen } from "./dom.js";

const W = 720, BAR_H = 170, LINE_H = 64, PAD = { l: 48, r: 12, t: 10, b: 24 };

function ms(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "-";
  if (v >= 100) return `${v.toFixed(0)} ms`;
  if (v >= 1) return `${v.toFixed(1)} ms`;
  return `${(v * 1000).toFixed(0)} µs`;
}

const pct = (v) => `${Math.round(v * 100)}%`;

function legend(r) {
  return h("div", { class: "tnd-legend" }, r.categories.map((c) =>
    h("span", { style: "margin-right:12px" }, h("span", { style: `color:${r.colours[c]}`, "aria-hidden": "true" }, "■ "), r.labels[c])));
}

function bars(r) {
  const steps = r.steps;
  const top = Math.max(1e-9, ...steps.map((st) => st.ms));
  const svg = s("svg", { width: W, height: BAR_H, viewBox: `0 0 ${W} ${BAR_H}`, class: "plot", role: "img",
    "aria-label": "time per step by category" });
  const bw = (W - PAD.l - PAD.r) / Math.max(1, steps.length);
  const sy = (v) => (v / top) * (BAR_H - PAD.t - PAD.b);
  steps.forEach((st, k) => {
    let y = BAR_H - PAD.b;
    for (const c of r.categories) {
      const v = st.categories[c] || 0;
      if (v <= 0) continue;
      const hgt = sy(v);
      y -= hgt;
      const rect = s("rect", { x: PAD.l + k * bw + bw * 0.1, y, width: Math.max(1, bw * 0.8), height: hgt, fill: r.colours[c] });
      rect.append(s("title", {}, `step ${st.number}: ${r.labels[c]} ${ms(v)} of ${ms(st.ms)}`));
      svg.append(rect);
    }
    if (steps.length <= 30 || k % Math.ceil(steps.length / 30) === 0)
      svg.append(s("text", { x: PAD.l + (k + 0.5) * bw, y: BAR_H - 8, "text-anchor": "middle", "font-size": 10, fill: "#57606a" }, String(st.number)));
  });
  svg.append(s("text", { x: PAD.l - 4, y: PAD.t + 8, "text-anchor": "end", "font-size": 10, fill: "#57606a" }, ms(top)));
  svg.append(s("line", { x1: PAD.l, y1: BAR_H - PAD.b, x2: W - PAD.r, y2: BAR_H - PAD.b, stroke: "#8c959f" }));
  return svg;
}

function timeline(r, model) {
  const segs = r.timeline;
  const end = segs.length ? segs[segs.length - 1].end : 1;
  const zoom = model.get("zoom");
  const [x0, x1] = zoom && zoom.length === 2 ? zoom : [0, end];
  const sx = (v) => PAD.l + ((v - x0) / Math.max(1e-9, x1 - x0)) * (W - PAD.l - PAD.r);
  const svg = s("svg", { width: W, height: LINE_H, viewBox: `0 0 ${W} ${LINE_H}`, class: "plot tnd-timeline", role: "img",
    "aria-label": `step ${r.timeline_step}: what the host did, ${ms(x0)} to ${ms(x1)}`,
    "data-lo": x0.toFixed(4), "data-hi": x1.toFixed(4) });
  for (const seg of segs) {
    if (seg.end < x0 || seg.start > x1) continue;
    const a = sx(Math.max(seg.start, x0)), b = sx(Math.min(seg.end, x1));
    const rect = s("rect", { x: a, y: 6, width: Math.max(0.5, b - a), height: 30, fill: r.colours[seg.category] });
    rect.append(s("title", {}, `${r.labels[seg.category]}${seg.label ? ": " + seg.label : ""} — ${ms(seg.end - seg.start)} at ${ms(seg.start)}`));
    svg.append(rect);
  }
  for (const f of [0, 0.5, 1]) {
    const v = x0 + f * (x1 - x0);
    svg.append(s("text", { x: sx(v), y: LINE_H - 8, "text-anchor": "middle", "font-size": 10, fill: "#57606a" }, ms(v)));
  }
  let from = null;
  const toMs = (ev) => {
    const box = svg.getBoundingClientRect();
    const px = ((ev.clientX - box.left) / Math.max(1, box.width)) * W;
    return x0 + ((px - PAD.l) / (W - PAD.l - PAD.r)) * (x1 - x0);
  };
  svg.addEventListener("mousedown", (ev) => { from = toMs(ev); });
  svg.addEventListener("mouseup", (ev) => {
    if (from === null) return;
    const to = toMs(ev);
    const lo = Math.max(0, Math.min(from, to)), hi = Math.min(end, Math.max(from, to));
    from = null;
    if (hi - lo > (x1 - x0) / 200) { model.set("zoom", [lo, hi]); model.save_changes(); }
  });
  const out = () => {
    const mid = (x0 + x1) / 2, half = Math.min(end, (x1 - x0) * 2) / 2;
    const lo = Math.max(0, mid - half), hi = Math.min(end, lo + 2 * half);
    model.set("zoom", hi - lo >= end ? [] : [lo, hi]); model.save_changes();
  };
  const reset = () => { model.set("zoom", []); model.save_changes(); };
  return h("div", {},
    h("p", {}, h("b", {}, `Step ${r.timeline_step}: what the host did `), "(drag across it to zoom) ",
      h("button", { type: "button", onclick: out, "data-action": "out" }, "zoom out"), " ",
      h("button", { type: "button", onclick: reset, "data-action": "reset" }, "whole step")),
    svg);
}

function table(head, rows, onRow) {
  return h("table", {}, h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))),
    h("tbody", {}, rows.map((cells, k) => {
      const tr = h("tr", onRow ? { tabindex: "0", role: "button", class: "tnd-row", style: "cursor:pointer" } : {},
        cells.map((c) => h("td", {}, c)));
      if (onRow) {
        tr.addEventListener("click", () => onRow(k));
        tr.addEventListener("keydown", (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); onRow(k); } });
      }
      return tr;
    })));
}

function opened(row) {
  if (!row.context || !row.context.length) return h("p", {}, h("code", {}, row.line.text));
  return h("pre", { class: "tnd-source" }, row.context.map((text, k) => {
    const no = row.context_start + k;
    const mark = no === row.line.lineno;
    return h("div", mark ? { style: "background:#fff8c5;font-weight:bold" } : {}, `${String(no).padStart(4)}  ${text}`);
  }));
}

function lines(r, model) {
  const open = model.get("opened");
  const toggle = (k) => { model.set("opened", open === k ? -1 : k); model.save_changes(); };
  const rows = r.lines.slice(0, 15).map((row) => [row.where || place(row.line), h("code", {}, row.line.text), ms(row.ms), pct(row.share), row.ops.toFixed(0)]);
  const parts = [h("p", {}, h("b", {}, "Top lines"), " (a row opens its line)"),
    table(["where", "statement", "per step", "share", "ops"], rows, toggle)];
  if (open >= 0 && open < r.lines.length) parts.push(opened(r.lines[open]));
  return h("div", {}, parts);
}

function render({ model, el }) {
  const draw = () => {
    const r = model.get("report");
    if (!r || !r.steps) { el.replaceChildren(h("p", {}, "no profile")); return; }
    const v = r.verdict;
    const parts = [
      h("p", {}, h("b", {}, r.title)),
      h("div", { class: "tnd-verdict", role: "status" },
        h("p", {}, h("b", {}, `Verdict: ${v.kind}`), ` (${pct(v.share)} of the step) — ${v.summary}`),
        h("p", {}, h("b", {}, "Fix: "), v.fix)),
      legend(r), bars(r)];
    if (r.timeline.length) parts.push(timeline(r, model));
    if (r.lines.length) parts.push(lines(r, model));
    if (r.modules.length) parts.push(h("p", {}, h("b", {}, "Top modules"), " (forward)"),
      table(["module", "per step", "self", "share", "calls"], r.modules.slice(0, 15).map((m) =>
        [h("code", {}, m.path), ms(m.ms), ms(m.self_ms), pct(m.share), String(m.calls)])));
    if (r.ops.length) parts.push(h("p", {}, h("b", {}, "Top ops")),
      table(["op", "calls", "per step", "median", "share"], r.ops.slice(0, 15).map((o) =>
        [h("code", {}, o.name), String(o.calls), ms(o.ms), `${o.median_us.toFixed(0)} µs`, pct(o.share)])));
    for (const p of r.patterns) parts.push(h("p", {}, h("b", {}, `TorchTidy: ${p.name}`), ` (${p.count}×) ${p.description}`));
    for (const n of r.notes) parts.push(h("p", { class: "muted" }, `note: ${n}`));
    el.replaceChildren(h("div", { class: "tnd tnd-profile tnd-profile-widget" }, parts));
  };
  draw();
  return listen(model, { "change:report change:zoom change:opened": draw });
}

export default { render };
