// torch_nbdebug memory views (plain ES module: no bundler, no CDN).
// Timeline: the kernel holds the full series; we set `x_range` and draw the decimated `view` it sends.
// Colours of text, axes and grid come from base.css (JupyterLab's theme); the chart shrinks to the
// output's width (viewBox), wide tables scroll in their own box, and a row's details show on
// keyboard focus as they do on hover.
import { h, s, bytes, count, place, listen } from "./dom.js";

// The chart is drawn at the width there is (up to FULL_W), never shrunk below its text's size:
// in a ~500 px side panel its labels stay 10 px.
const FULL_W = 760, FULL_H = 270, MIN_W = 320, MIN_H = 190, L = 78, R = 12, T = 18, B = 32;

// Round byte values for the y axis: 1/2/2.5/5 × a power of ten in the largest unit that fits.
function niceTicks(top, count = 4) {
  if (!(top > 0)) return [0];
  const unit = 1024 ** Math.min(3, Math.max(0, Math.floor(Math.log(Math.max(top, 1)) / Math.log(1024))));
  const raw = top / unit / count, mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((m) => m >= raw) * unit;
  const out = [];
  for (let k = 0; k * step <= top; k++) out.push(k * step);
  return out;
}
// This view builds top-down: each element made by dom.js's h or s and appended to its parent.
const html = (tag, attrs, parent, text) => { const e = h(tag, attrs, text); if (parent) parent.append(e); return e; };
const svg = (tag, attrs, parent) => { const e = s(tag, attrs); if (parent) parent.append(e); return e; };
function shape(a) { return a.dtype ? `${a.dtype}[${a.shape.join(", ")}]` : "(allocator block)"; }
const where = (l) => place(l) + (l.text ? `: ${l.text}` : "");
function lineOf(a) { return a.line ? where(a.line) : ""; }
// The kernel sends each series as differences, a run of n equal ones as "d*n" (render/memory.py: deltas).
function ints(s) {
  const out = []; let x = 0;
  for (const t of s ? s.split(",") : []) { const [d, n] = t.split("*"); for (let k = n ? +n : 1; k > 0; k--) out.push(x += +d); }
  return out;
}
// Phases and the peak's allocations come as JSON texts.
const unpacked = new WeakMap();  // view sent -> as arrays (read again on every pointer move)
function unpack(v) {
  if (!v || typeof v.steps !== "string") return v;
  if (!unpacked.has(v)) unpacked.set(v, { ...v, steps: ints(v.steps), time_s: ints(v.time_us).map((t) => t / 1e6),
    series: v.series.map(ints), reserved: v.reserved === null ? null : ints(v.reserved), phases: JSON.parse(v.phases),
    local_peak: { ...v.local_peak, allocations: JSON.parse(v.local_peak.allocations) } });
  return unpacked.get(v);
}

function allocTable(parent, allocs, labels, cats, colors, detail, leaked) {
  const table = html("table", { class: "allocs" }, html("div", { class: "scroll" }, parent));
  const head = html("tr", {}, table);
  for (const h of ["size", "tensor", "category", "held by", "module", "allocated at"]) html("th", { class: h === "size" ? "num" : "" }, head, h);
  for (const a of allocs) {
    const tr = html("tr", { class: leaked.has(a.id) ? "alloc leak" : "alloc", tabindex: "0" }, table);
    html("td", { class: "num" }, tr, bytes(a.nbytes));
    html("td", { class: "mono nowrap" }, tr, shape(a));
    const cat = html("td", { class: "nowrap" }, tr);
    html("span", { class: "swatch", style: `background:${colors[cats.indexOf(a.category)]}` }, cat);
    cat.appendChild(document.createTextNode(labels[cats.indexOf(a.category)] || a.category));
    const held = html("td", { class: "mono" }, tr, a.holder || "");
    if (leaked.has(a.id)) html("span", { class: "bad" }, held, " leak");
    html("td", { class: "mono" }, tr, a.module || "");
    html("td", { class: "mono src", title: lineOf(a) }, tr, lineOf(a));
    const show = () => {
      tr.classList.add("hl");
      detail.textContent = `${bytes(a.nbytes)} ${shape(a)} · ${a.category} · op ${a.op || "-"} · phase ${a.phase}` +
        ` · module ${a.module || "-"} · alive events ${a.start}–${a.end === null ? "end" : a.end}` +
        (a.line ? ` · ${lineOf(a)}` : "");
    };
    const hide = () => { if (document.activeElement !== tr) tr.classList.remove("hl"); };
    tr.addEventListener("mouseenter", show);
    tr.addEventListener("focus", show);
    tr.addEventListener("mouseleave", hide);
    tr.addEventListener("blur", () => tr.classList.remove("hl"));
  }
}

function renderTimeline(model, el) {
  const meta = model.get("meta");
  const root = html("div", { class: "tnd tnd-memory-widget" }, el);
  let W = FULL_W, H = FULL_H;
  html("h3", {}, root, meta.title);
  if (meta.note) html("div", { class: "warn" }, root, meta.note);
  const bar = html("div", { class: "toolbar" }, root);
  const buttons = {};
  for (const [name, label, what] of [["out", "− zoom out", "zoom out"], ["in", "+ zoom in", "zoom in"],
                                     ["left", "◀", "move the range left"], ["right", "▶", "move the range right"],
                                     ["peak", "peak", "zoom to the peak"], ["reset", "reset", "show all events"]]) {
    buttons[name] = html("button", { type: "button", "data-action": name, "aria-label": what, title: what }, bar, label);
  }
  const rangeLabel = html("span", { class: "range muted" }, bar);
  const chart = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, "font-size": 10, role: "img",
                             "aria-label": "memory allocated over allocation/free events",
                             "font-family": "sans-serif", class: "chart plot fluid" }, root);
  const tip = html("div", { class: "mono tip" }, root, " ");
  tip.style.minHeight = "1.4em";
  const legend = html("div", { class: "legend muted" }, root);
  const key = (colour, label, kind) => {
    const s = html("span", {}, legend);
    html("span", { class: kind ? `swatch ${kind}` : "swatch", style: `background:${colour}` }, s);
    s.appendChild(document.createTextNode(label));
  };
  meta.labels.forEach((label, i) => key(meta.colors[i], label));
  html("br", {}, legend);
  for (const [p, c] of Object.entries(meta.phase_colors)) key(c, `${p} (shading)`, "phase");
  html("span", {}, legend, "┆ iteration start");
  html("span", { class: "bad" }, legend, "│ peak");
  html("span", {}, legend, "drag across the chart to zoom");
  const leakBox = html("div", {}, root);  // the finding first: what the cell leaked
  html("h3", {}, root, "Largest allocations alive at the highest point of the visible range");
  const detail = html("div", { class: "mono muted detail", "aria-live": "polite" }, root, "hover or focus a row for details");
  const tableBox = html("div", {}, root);
  const leaked = new Set(meta.leaks.flatMap((leak) => leak.allocation_ids || []));
  for (const leak of meta.leaks) {
    const card = html("div", { class: "card" }, leakBox);
    html("b", {}, card, "Leak: ");
    html("b", { class: "mono" }, card, leak.holder);
    card.appendChild(document.createTextNode(` holds ${count(leak.count)} tensor(s), ${bytes(leak.nbytes)}`));
    if (leak.has_graph) { card.appendChild(document.createTextNode(" — ")); html("span", { class: "bad" }, card, "autograd graph attached"); }
    if (leak.names && leak.names.length) html("div", { class: "muted mono" }, card, leak.names.join(", "));
    if (leak.line) html("div", { class: "mono src" }, card, `allocated at ${where(leak.line)}`);
    if (leak.note) html("div", {}, card, leak.note);
  }

  const n = meta.n;
  const setRange = (lo, hi) => {
    lo = Math.max(0, Math.round(lo)); hi = Math.min(n - 1, Math.round(hi));
    if (hi - lo < 2) { const mid = (lo + hi) / 2; lo = Math.max(0, Math.floor(mid - 1)); hi = Math.min(n - 1, lo + 2); }
    model.set("x_range", [lo, hi]); model.save_changes();
  };
  const current = () => model.get("x_range");
  buttons.in.onclick = () => { const [lo, hi] = current(); const q = (hi - lo) / 4; setRange(lo + q, hi - q); };
  buttons.out.onclick = () => { const [lo, hi] = current(); const h = (hi - lo); setRange(lo - h / 2, hi + h / 2); };
  buttons.left.onclick = () => { const [lo, hi] = current(); const s = Math.min(lo, (hi - lo) / 2); setRange(lo - s, hi - s); };
  buttons.right.onclick = () => { const [lo, hi] = current(); const s = Math.min(n - 1 - hi, (hi - lo) / 2); setRange(lo + s, hi + s); };
  buttons.reset.onclick = () => setRange(0, n - 1);
  buttons.peak.onclick = () => { const w = Math.max(20, (n - 1) / 20); setRange(meta.peak.step - w, meta.peak.step + w); };

  let scale = null, drawnFor = 0;
  function fit() {  // the width there is, the aspect kept (not below MIN_H high)
    const avail = Math.floor(root.getBoundingClientRect().width);
    drawnFor = avail;
    W = avail > 0 ? Math.max(MIN_W, Math.min(FULL_W, avail)) : FULL_W;
    H = Math.max(MIN_H, Math.round(W * FULL_H / FULL_W));
    chart.setAttribute("width", W); chart.setAttribute("height", H); chart.setAttribute("viewBox", `0 0 ${W} ${H}`);
  }
  function draw() {
    const v = unpack(model.get("view"));
    fit();
    chart.replaceChildren();
    if (!v || !v.steps) return;
    const lo = v.lo, hi = v.hi;
    root.setAttribute("data-lo", lo); root.setAttribute("data-hi", hi);
    rangeLabel.textContent = ` events ${lo}–${hi} of ${n - 1} (${v.steps.length} points drawn)`;
    let ymax = 1;
    for (let k = 0; k < v.steps.length; k++) {
      let s = 0; for (const col of v.series) s += col[k];
      if (s > ymax) ymax = s;
      if (v.reserved && v.reserved[k] > ymax) ymax = v.reserved[k];
    }
    ymax *= 1.08;
    const sx = (s) => L + (W - L - R) * ((s - lo) / Math.max(hi - lo, 1));
    const sy = (b) => T + (H - T - B) * (1 - b / ymax);
    scale = { lo, hi, sx, sy };
    let lastIter = null;
    const ticks = [];
    for (const p of v.phases) {
      const x0 = Math.max(L, sx(p.start - 1)), x1 = Math.min(W - R, sx(p.end));
      if (lastIter !== null && p.iteration !== lastIter && x0 > L) ticks.push([x0, p.iteration]);  // new iteration
      lastIter = p.iteration;
      if (x1 <= x0) continue;
      const r = svg("rect", { x: x0, y: T, width: Math.max(x1 - x0, 0.5), height: H - T - B, fill: meta.phase_colors[p.phase] || "#eee", class: "phase" }, chart);
      svg("title", {}, r).textContent = `${p.phase} (iteration ${p.iteration})`;
    }
    const upper = v.steps.map(() => 0);
    v.series.forEach((col, c) => {
      if (!col.some((x) => x)) return;
      const lower = upper.slice();
      col.forEach((x, k) => { upper[k] += x; });
      const pts = v.steps.map((s, k) => `${sx(s).toFixed(1)},${sy(upper[k]).toFixed(1)}`);
      for (let k = v.steps.length - 1; k >= 0; k--) pts.push(`${sx(v.steps[k]).toFixed(1)},${sy(lower[k]).toFixed(1)}`);
      svg("polygon", { points: pts.join(" "), fill: meta.colors[c], "fill-opacity": 0.85, "data-category": meta.categories[c] }, chart);
    });
    for (const [x, it] of ticks) {
      const tick = svg("line", { x1: x, x2: x, y1: T, y2: H - B, stroke: "#57606a", "stroke-dasharray": "2 3", class: "iteration axis" }, chart);
      svg("title", {}, tick).textContent = `iteration ${it}`;
    }
    if (v.reserved) {
      svg("polyline", { points: v.steps.map((s, k) => `${sx(s).toFixed(1)},${sy(v.reserved[k]).toFixed(1)}`).join(" "),
                        fill: "none", stroke: "#24292f", "stroke-dasharray": "4 2", class: "fg-line" }, chart);
    }
    svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#57606a", class: "axis" }, chart);
    svg("line", { x1: L, x2: L, y1: T, y2: H - B, stroke: "#57606a", class: "axis" }, chart);
    for (const b of niceTicks(ymax / 1.08)) {
      svg("line", { x1: L - 3, x2: L, y1: sy(b), y2: sy(b), stroke: "#57606a", class: "axis" }, chart);
      svg("text", { x: L - 5, y: sy(b) + 3, "text-anchor": "end", fill: "#57606a" }, chart).textContent = bytes(b).replace(".0 ", " ");
    }
    const mid = (T + H - B) / 2;
    svg("text", { x: 11, y: mid, "text-anchor": "middle", fill: "#57606a", transform: `rotate(-90 11 ${mid})` }, chart).textContent = "memory allocated";
    svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", fill: "#57606a" }, chart).textContent =
      W < 600 ? "events, in order (dashed: iterations)" :
      "allocation/free events, in order (dashed lines: iteration starts)" + (v.reserved ? "; dashed line on top: reserved" : "");
    for (let k = 0; k <= 4; k++) {
      const s = Math.round(lo + (hi - lo) * k / 4);
      svg("text", { x: sx(s), y: H - B + 12, "text-anchor": "middle", fill: "#57606a", class: "xtick" }, chart).textContent = s;
    }
    if (meta.peak.step >= lo && meta.peak.step <= hi) {
      const px = sx(meta.peak.step);
      svg("line", { x1: px, x2: px, y1: T, y2: H - B, stroke: "#cf222e", class: "red-line" }, chart);
      svg("text", { x: Math.min(px + 4, W - 120), y: T - 5, fill: "#cf222e", "font-weight": 600, class: "bad" }, chart).textContent = `peak ${bytes(meta.peak.bytes)}`;
    }
    svg("line", { class: "cursor fg-line", x1: -10, x2: -10, y1: T, y2: H - B, stroke: "#24292f", "stroke-opacity": 0.5 }, chart);
    svg("rect", { class: "brush", x: 0, y: T, width: 0, height: H - T - B, fill: "#0969da", "fill-opacity": 0.15 }, chart);
    tableBox.replaceChildren();
    allocTable(tableBox, v.local_peak.allocations, meta.labels, meta.categories, meta.colors, detail, leaked);
  }

  const toStep = (evt) => {
    const box = chart.getBoundingClientRect();
    const x = (evt.clientX - box.left) * (W / box.width);
    return { x, step: scale.lo + (x - L) / (W - L - R) * (scale.hi - scale.lo) };
  };
  let dragFrom = null;
  const onDown = (evt) => { if (scale) { dragFrom = toStep(evt); evt.preventDefault(); } };
  const onMove = (evt) => {
    if (!scale) return;
    const { x, step } = toStep(evt);
    const v = unpack(model.get("view"));
    let k = 0, hiK = v.steps.length - 1;
    while (k < hiK) { const m = (k + hiK) >> 1; if (v.steps[m] < step) k = m + 1; else hiK = m; }
    const cur = chart.querySelector(".cursor");
    cur.setAttribute("x1", scale.sx(v.steps[k])); cur.setAttribute("x2", scale.sx(v.steps[k]));
    const parts = v.series.map((col, c) => col[k] ? `${meta.labels[c]} ${bytes(col[k])}` : null).filter(Boolean);
    const total = v.series.reduce((s, col) => s + col[k], 0);
    const phase = v.phases.find((p) => p.start - 1 <= v.steps[k] && v.steps[k] <= p.end);
    tip.textContent = `event ${v.steps[k]} · t=${v.time_s[k].toFixed(4)} s · total ${bytes(total)}` +
      (v.reserved ? ` · reserved ${bytes(v.reserved[k])}` : "") + (phase ? ` · ${phase.phase} (iteration ${phase.iteration})` : "") +
      (parts.length ? " · " + parts.join(", ") : "");
    if (dragFrom) {
      const brush = chart.querySelector(".brush");
      brush.setAttribute("x", Math.min(dragFrom.x, x)); brush.setAttribute("width", Math.abs(x - dragFrom.x));
    }
  };
  const onUp = (evt) => {
    if (!dragFrom || !scale) return;
    const { step } = toStep(evt);
    const a = Math.min(dragFrom.step, step), b = Math.max(dragFrom.step, step);
    dragFrom = null;
    if (b - a >= 2) setRange(a, b); else draw();
  };
  chart.addEventListener("mousedown", onDown);
  chart.addEventListener("mousemove", onMove);
  window.addEventListener("mouseup", onUp);
  const unlisten = listen(model, { "change:view": draw });
  draw();
  const resized = new ResizeObserver(() => { if (Math.floor(root.getBoundingClientRect().width) !== drawnFor) draw(); });
  resized.observe(root);
  return () => { unlisten(); window.removeEventListener("mouseup", onUp); resized.disconnect(); };
}

function renderState(model, el) {
  const meta = model.get("meta");
  const st = meta.state;
  const root = html("div", { class: "tnd tnd-memory-state" }, el);
  html("h3", {}, root, meta.title);
  if (meta.note) html("div", { class: "warn" }, root, meta.note);
  const bar = html("div", {}, root);
  Object.assign(bar.style, { display: "flex", height: "16px", maxWidth: "600px", border: "1px solid var(--tnd-border)", margin: "4px 0" });
  const keys = html("div", { class: "legend muted" }, root);
  meta.categories.forEach((c, i) => {
    if (!st.by_category[c]) return;
    const s = html("span", {}, keys);
    html("span", { class: "swatch", style: `background:${meta.colors[i]}` }, s);
    s.appendChild(document.createTextNode(`${meta.labels[i]} ${bytes(st.by_category[c])}`));
  });
  const tip = html("div", { class: "mono muted tip", "aria-live": "polite" }, root, "hover or focus the bar or a row");
  const total = Math.max(st.live_bytes, 1);
  meta.categories.forEach((c, i) => {
    const v = st.by_category[c] || 0;
    if (!v) return;
    const text = `${meta.labels[i]}: ${bytes(v)} (${(100 * v / total).toFixed(1)}%)`;
    const seg = html("div", { "data-category": c, tabindex: "0", "aria-label": text }, bar);
    Object.assign(seg.style, { width: `${(100 * v) / total}%`, background: meta.colors[i] });
    const show = () => { tip.textContent = text; };
    seg.addEventListener("mouseenter", show);
    seg.addEventListener("focus", show);
  });
  const filter = html("input", { placeholder: "filter by name", type: "search", "aria-label": "filter the tensors by name" }, root);
  const table = html("table", { class: "tensors" }, html("div", { class: "scroll" }, root));
  const fill = () => {
    table.replaceChildren();
    const head = html("tr", {}, table);
    for (const h of ["size", "tensor", "category", "held by", "autograd graph"]) html("th", { class: h === "size" ? "num" : "" }, head, h);
    for (const t of st.top.filter((t) => t.name.includes(filter.value))) {
      const tr = html("tr", { tabindex: "0" }, table);
      html("td", { class: "num" }, tr, bytes(t.nbytes)); html("td", { class: "mono nowrap" }, tr, shape(t));
      html("td", {}, tr, meta.labels[meta.categories.indexOf(t.category)]); html("td", { class: "mono" }, tr, t.name);
      html("td", { class: t.has_graph ? "bad" : "" }, tr, t.has_graph ? "yes" : "");
      const show = () => { tip.textContent = `${t.name}: ${bytes(t.nbytes)} ${shape(t)} on ${t.device}`; };
      tr.addEventListener("mouseenter", show);
      tr.addEventListener("focus", show);
    }
  };
  filter.addEventListener("input", fill);
  fill();
  return () => filter.removeEventListener("input", fill);
}

export default {
  render({ model, el }) {
    return model.get("meta").kind === "state" ? renderState(model, el) : renderTimeline(model, el);
  },
};
