// Gradient stepper: flow plot + layers×steps heatmap overview, per-layer detail with histograms.
// Plain ES module (no bundler, no CDN). Numbers arrive as float32 bytes (float64 for the arrays
// meta.wide names); `layer`, `step` and `log_scale` are synced both ways so Python can drive the
// view and read where the user is.
// Keyboard: the view is one Tab stop whose arrow keys move layer (←/→) and step (↓/↑); each flow
// bar is a Tab stop too (Enter/Space selects it). Text and axis colours come from base.css (the
// theme); the canvas heatmap keeps its own colour scale, drawn on the theme's background.

import { h, s, num, count, floats, listen } from "./dom.js";

// Statistics as every view writes them (an exponent from 1e5 up or below 1e-3, as data/stats.py);
// "—" where there is no value (a layer without a gradient is NaN in the bytes).
const fmt = (v, approx) => (v === null || v === undefined || Number.isNaN(v) ? "—" : (approx ? "≈" : "") + num(v));

// Counts (zeros, NaN, Inf) as whole numbers: "1,024", not "1024.0".
const fmtCount = (v, approx) => (v === null || v === undefined || !Number.isFinite(v) ? "—" : (approx ? "≈" : "") + count(v));

// Histogram axis labels: the range's ends, and "0" under the zero line when it falls inside and clears
// both ends by a gap (else the dashed line alone marks it). Widths are estimated, so the SVG needs no
// layout pass: a digit of 10-px sans-serif is at most ~6.2 px wide. Ends too long to fit side by side
// are shortened to 3 significant digits. -> [x, text, text-anchor] for each label drawn.
const HIST_FONT = 10, CHAR_W = 6.2, GAP = 6;
function endLabels(loText, hiText, zeroX, W) {
  const width = (t) => t.length * CHAR_W;
  if (width(loText) + width(hiText) + GAP > W) {
    const short = (t) => { const v = Number(t.replace("≈", "")); return Number.isFinite(v) ? num(v, 3) : t; };
    loText = short(loText); hiText = short(hiText);
  }
  const out = [[0, loText, "start"], [W, hiText, "end"]];
  if (zeroX !== null) {
    const half = width("0") / 2;
    if (zeroX - half >= width(loText) + GAP && zeroX + half <= W - width(hiText) - GAP) out.push([zeroX, "0", "middle"]);
  }
  return out;
}

function render({ model, el }) {
  const meta = model.get("meta");
  const F = Object.fromEntries(meta.fields.map((f, i) => [f, i]));
  const nS = meta.steps.length, nP = meta.params.length, nL = meta.layers.length, nF = meta.fields.length;
  const B = meta.bins, nA = meta.act_fields.length;
  const wide = new Set(meta.wide || []);  // sent as float64: a number beyond float32's range
  const numbers = (key) => floats(model.get(key), wide.has(key));
  const stats = numbers("stats");
  const flow = numbers("flow");
  const hist = numbers("hist");
  const range = numbers("hist_range");
  const acts = numbers("acts");
  const stat = (st, p, f) => stats[(st * nP + p) * nF + F[f]];
  const flowAt = (st, l, k) => flow[(st * nL + l) * 4 + k];
  const flagsAt = (st) => meta.flags.filter((f) => f[2] === st);

  const root = h("div", { class: "tnd tnd-grads", tabindex: "0", role: "group",
    "aria-label": "gradient stepper: ← → change the layer, ↑ ↓ the step" });
  const title = h("h3", {});
  const flowBox = h("div", { class: "tnd-flow-box scroll" });
  const heatBox = h("div", { class: "tnd-heat-box" });
  const button = (cls, label, text) => h("button", { type: "button", class: cls, title: label, "aria-label": label }, text);
  const prevL = button("tnd-prev", "previous layer (←)", "◀");
  const nextL = button("tnd-next", "next layer (→)", "▶");
  const sliderL = h("input", { type: "range", min: "0", max: String(Math.max(nL - 1, 0)), class: "tnd-layer-slider", "aria-label": "layer" });
  const layerLabel = h("span", { class: "tnd-layer-name mono" });
  const prevS = button("tnd-prev-step", "previous step (↓)", "◀");
  const nextS = button("tnd-next-step", "next step (↑)", "▶");
  const sliderS = h("input", { type: "range", min: "0", max: String(Math.max(nS - 1, 0)), class: "tnd-step-slider", "aria-label": "step" });
  const stepLabel = h("span", { class: "tnd-step-name" });
  const logBox = h("input", { type: "checkbox", class: "tnd-log" });
  const detail = h("div", { class: "tnd-detail card info" });
  const stepRow = h("div", { style: nS > 1 ? "" : "display:none" }, "step ", prevS, sliderS, nextS, " ", stepLabel);
  root.append(title, flowBox, heatBox,
    h("div", {}, "layer ", prevL, sliderL, nextL, " ", layerLabel, "  ", h("label", {}, logBox, " log counts")),
    stepRow, detail,
    ...meta.notes.map((n) => h("p", { class: "muted" }, n)));
  el.append(root);

  const clamp = (v, n) => Math.max(0, Math.min(n - 1, v));
  const setLayer = (l) => { model.set("layer", clamp(l, nL)); model.save_changes(); };
  const setStep = (st) => { model.set("step", clamp(st, nS)); model.save_changes(); };

  // The charts take the width there is (640 px where nothing says otherwise), so the flow of a dozen
  // layers fits a ~500 px side panel; only a long model's bars scroll, inside their own box.
  const widthThere = () => Math.floor(root.getBoundingClientRect().width) || 640;

  function drawFlow(st, cur) {
    const H = 140, left = 58;
    const w = Math.max(8, Math.min(40, Math.floor((Math.min(widthThere(), 700) - left - 10) / Math.max(nL, 1))));
    const vals = [];
    for (let l = 0; l < nL; l++) for (const k of [1, 2]) { const v = flowAt(st, l, k); if (v > 0 && isFinite(v)) vals.push(v); }
    let lo = vals.length ? Math.floor(Math.log10(Math.min(...vals))) : -8;
    let hi = vals.length ? Math.ceil(Math.log10(Math.max(...vals))) : 0;
    if (hi <= lo) hi = lo + 1;
    const y = (v) => (v > 0 && isFinite(v)) ? H - (Math.log10(v) - lo) / (hi - lo) * H + 6 : H + 6;
    const svg = s("svg", { width: Math.max(left + nL * w + 10, 260), height: H + 44, class: "tnd-flow plot", "font-family": "sans-serif" });
    const label = (x, y, text, extra) => { const t = s("text", { x, y, "font-size": 10, "text-anchor": "middle", fill: "#57606a", ...extra }); t.textContent = text; svg.append(t); };
    const focused = flowBox.contains(document.activeElement) ? document.activeElement.getAttribute("data-layer") : null;
    label(11, H / 2 + 6, "|gradient| (log scale)", { transform: `rotate(-90 11 ${H / 2 + 6})` });
    label(left + nL * w / 2, H + 40, "layer # (from 0; click one)");
    for (let e = lo; e <= hi; e++) {
      svg.append(s("line", { x1: left, x2: left + nL * w, y1: y(10 ** e), y2: y(10 ** e), stroke: "#eaeef2", class: "grid" }));
      const t = s("text", { x: left - 4, y: y(10 ** e) + 4, "font-size": 10, "text-anchor": "end", fill: "#57606a" });
      t.textContent = "1e" + e; svg.append(t);
    }
    const flagged = {};
    for (const f of flagsAt(st)) if (!(f[1] in flagged)) flagged[f[1]] = f;
    for (let l = 0; l < nL; l++) {
      const x = left + l * w;
      const colour = flagged[l] ? meta.colours[flagged[l][0]] : "#1f6feb";
      const g = s("g", { class: "tnd-flow-layer", "data-layer": l, style: "cursor:pointer", tabindex: "0", role: "button",
        "aria-label": `layer #${l} (${l + 1}/${nL}): ${meta.layers[l].name}`, "aria-pressed": l === cur ? "true" : "false",
        "data-lm-suppress-shortcuts": "true" });
      g.append(s("rect", { x, y: 0, width: w, height: H + 32, fill: l === cur ? "#fff3bf" : "transparent", class: l === cur ? "col current" : "col" }));
      if (!(isFinite(flowAt(st, l, 1)) && isFinite(flowAt(st, l, 2)))) {  // nothing to draw: say why, in red
        g.append(s("rect", { x: x + 2, y: 6, width: w - 4, height: H, fill: "#cf222e", opacity: 0.12 }));
        const t = s("text", { x: x + w / 2, y: H / 2 + 6, "font-size": 9, "text-anchor": "middle", fill: "#cf222e", class: "bad", transform: `rotate(-90 ${x + w / 2} ${H / 2 + 6})` });
        t.textContent = "NaN/Inf"; g.append(t);
      }
      if (nL <= 40 || l % Math.max(1, Math.floor(nL / 20)) === 0) {
        const n = s("text", { x: x + w / 2, y: H + 18, "font-size": 9, "text-anchor": "middle", fill: "#57606a" }); n.textContent = String(l); g.append(n);
      }
      if (flagged[l]) {
        const m = s("text", { x: x + w / 2, y: H + 29, "font-size": 10, "font-weight": "bold", "text-anchor": "middle", fill: colour, style: `fill:${colour}` }); m.textContent = "!"; g.append(m);
      }
      [[flowAt(st, l, 2), 0.35], [flowAt(st, l, 1), 1]].forEach(([v, op]) => {
        if (v > 0 && isFinite(v)) g.append(s("rect", { x: x + 2, y: y(v), width: w - 4, height: H + 6 - y(v), fill: colour, "fill-opacity": op }));
      });
      const tip = s("title", {});
      tip.textContent = `${meta.layers[l].name}: mean |g| ${fmt(flowAt(st, l, 1))}, max |g| ${fmt(flowAt(st, l, 2))}` +
        (flagged[l] ? `; ${flagged[l][0]}: ${flagged[l][3]}` : "");
      g.append(tip);
      g.addEventListener("click", () => setLayer(l));
      g.addEventListener("keydown", (e) => {
        if (e.key !== "Enter" && e.key !== " ") return;
        e.preventDefault(); e.stopPropagation(); // Space would scroll, Enter would edit the cell
        setLayer(l);
      });
      svg.append(g);
    }
    flowBox.replaceChildren(h("div", {}, h("b", {}, "gradient flow "), h("span", { class: "muted" }, "per layer at this step: dark bar = mean |g|, light bar = max |g|, log scale; ! = flagged; click a layer")), svg);
    if (focused !== null) {  // the bars were redrawn: keyboard users keep their place
      const again = svg.querySelector(`g.tnd-flow-layer[data-layer="${focused}"]`);
      if (again) again.focus();
    }
  }

  function drawHeat(st, cur) {
    if (nS < 2) return;
    const cw = Math.max(2, Math.min(40, Math.floor(Math.min(widthThere(), 640) / nS))), ch = Math.max(4, Math.min(20, Math.floor(240 / nL)));
    const canvas = h("canvas", { width: nS * cw, height: nL * ch, class: "tnd-heatmap", style: "display:block;border:1px solid var(--tnd-border);cursor:pointer",
      role: "img", "aria-label": "gradient norm per layer and step; the arrow keys move the selected cell" });
    const ctx = canvas.getContext("2d");
    let lo = Infinity, hi = -Infinity;
    for (let t = 0; t < nS; t++) for (let l = 0; l < nL; l++) { const v = flowAt(t, l, 0); if (v > 0 && isFinite(v)) { lo = Math.min(lo, Math.log10(v)); hi = Math.max(hi, Math.log10(v)); } }
    const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
    const badCell = new Uint8Array(nS * nL);  // NaN/Inf gradients: red, not blank like "no gradient"
    for (const f of meta.flags) if (f[0] === "non-finite" && f[2] < nS && f[1] < nL) badCell[f[2] * nL + f[1]] = 1;
    for (let t = 0; t < nS; t++) for (let l = 0; l < nL; l++) {
      const v = flowAt(t, l, 0);
      const bad = badCell[t * nL + l];
      if (bad || !(v > 0 && isFinite(v))) { ctx.fillStyle = bad || v === Infinity ? "#cf222e" : "#fff"; ctx.fillRect(t * cw, l * ch, cw, ch); continue; }
      const p = (hi > lo ? (Math.log10(v) - lo) / (hi - lo) : 0.5) * (stops.length - 1);
      const i = Math.min(Math.floor(p), stops.length - 2), f = p - i;
      const c = stops[i].map((a, k) => Math.round(a * (1 - f) + stops[i + 1][k] * f));
      ctx.fillStyle = `rgb(${c})`; ctx.fillRect(t * cw, l * ch, cw, ch);
    }
    // The current cell: a white frame inside a black one reads on every colour, red (NaN) included.
    ctx.lineWidth = 2; ctx.strokeStyle = "#000"; ctx.strokeRect(st * cw + 1, cur * ch + 1, cw - 2, ch - 2);
    ctx.lineWidth = 1; ctx.strokeStyle = "#fff"; ctx.strokeRect(st * cw + 2.5, cur * ch + 2.5, cw - 5, ch - 5);
    canvas.addEventListener("click", (e) => {
      const r = canvas.getBoundingClientRect();
      setStep(Math.floor((e.clientX - r.left) / r.width * nS));
      setLayer(Math.floor((e.clientY - r.top) / r.height * nL));
    });
    const ramp = `linear-gradient(to right, ${stops.map((c) => `rgb(${c})`).join(", ")})`;
    const scale = isFinite(lo) ? h("div", { class: "legend muted" }, "‖g‖ colour: ", h("span", { class: "mono" }, fmt(10 ** lo)), " ",
      h("span", { style: `display:inline-block;width:120px;height:10px;vertical-align:-1px;background:${ramp}` }), " ",
      h("span", { class: "mono" }, fmt(10 ** hi)), " (log)  ", h("span", { class: "swatch", style: "background:#cf222e" }), "NaN/Inf  ",
      h("span", { class: "swatch", style: "background:#fff" }), "no gradient") : "";
    heatBox.replaceChildren(h("div", { style: "margin-top:8px" }, h("b", {}, "gradient norm, layers × steps "),
      h("span", { class: "muted" }, `(rows = layers #0…#${nL - 1}, top to bottom; columns = steps ${meta.steps[0]}…${meta.steps[nS - 1]}, left to right); click a cell`)),
      h("div", { class: "scroll" }, canvas), scale);
  }

  function histSvg(row, p, log) {
    const W = 256, H = 70, off = (row * nP + p) * B;
    const counts = Array.from(hist.subarray(off, off + B)).map((c) => (log ? Math.log10(c + 1) : c));
    const top = Math.max(...counts, 1e-12), bw = W / B;
    const svg = s("svg", { width: W, height: H + 14, class: "tnd-hist plot", "data-param": meta.params[p].name, "font-family": "sans-serif" });
    counts.forEach((c, i) => { if (c > 0) svg.append(s("rect", { x: i * bw, y: H - c / top * H, width: Math.max(bw - 0.5, 0.5), height: c / top * H, fill: "#1f6feb" })); });
    const lo = range[(row * nP + p) * 2], hi = range[(row * nP + p) * 2 + 1];
    svg.append(s("line", { x1: 0, x2: W, y1: H, y2: H, stroke: "#8c959f", class: "axis" }));
    const labels = endLabels(fmt(lo), fmt(hi), lo < 0 && hi > 0 ? -lo / (hi - lo) * W : null, W);
    for (const [x, text, anchor] of labels) {
      const t = s("text", { x, y: H + 12, "font-size": HIST_FONT, "text-anchor": anchor, fill: "#57606a" });
      t.textContent = text; svg.append(t);
    }
    if (lo < 0 && hi > 0) {  // where zero falls: a gradient centred off zero is worth seeing
      const zx = -lo / (hi - lo) * W;
      const zero = s("line", { x1: zx, x2: zx, y1: 0, y2: H, stroke: "#57606a", "stroke-dasharray": "2 2", class: "axis" });
      zero.append(Object.assign(s("title", {}), { textContent: "0" }));
      svg.append(zero);
    }
    return svg;
  }

  function drawDetail(st, l, log) {
    const layer = meta.layers[l];
    const kids = [h("b", { class: "mono" }, layer.name), ` (${layer.kind}) — layer #${l} (${l + 1}/${nL})`];
    const mine = flagsAt(st).filter((f) => f[1] === l);
    detail.className = "tnd-detail " + (mine.some((f) => f[0] === "non-finite") ? "card" : mine.length ? "card caution" : "card info");
    for (const f of mine) kids.push(h("div", { class: "tnd-flag", style: `color:${meta.colours[f[0]]}` }, `${f[0]}: ${f[3]}`));
    const row = meta.hist_rows.indexOf(st);
    for (const p of layer.params) {
      const info = meta.params[p], ex = meta.exact[st][p] === 1;
      const v = (f) => stat(st, p, f);
      const cells = stat(st, p, "has_grad") > 0
        ? [["norm", fmt(v("norm"))], ["mean", fmt(v("mean"))], ["std", fmt(v("std"))], ["max |g|", fmt(v("max_abs"))],
           ["zeros", fmtCount(v("zeros"), !ex)], ["NaN", fmtCount(v("nan"), !ex)], ["Inf", fmtCount(v("inf"), !ex)],
           ["‖w‖", fmt(v("param_norm"))], ["‖Δw‖/‖w‖", fmt(v("update_ratio"), !ex)]]
        : [["gradient", info.requires_grad ? "none" : "frozen (requires_grad=False)"], ["‖w‖", fmt(v("param_norm"))]];
      // name over value, side by side where there is room and wrapping where there is not (a side panel);
      // styled here, not in base.css, which every widget of every tool carries into a saved notebook
      const table = h("div", { class: "tnd-stats", style: "display:flex;flex-wrap:wrap;margin:4px 0;white-space:nowrap" },
        cells.map(([k, x]) => h("span", { style: "display:flex;flex-direction:column;min-width:76px;padding-right:8px" },
          h("span", { class: "muted" }, k), h("span", { class: "num" }, x))));
      const block = h("div", { class: "tnd-param", style: "margin-top:6px" }, h("div", {}, h("b", { class: "mono" }, info.short), h("span", { class: "mono muted" }, ` [${info.shape.join(", ")}] ${info.dtype}`)), table);
      if (row >= 0 && !Number.isNaN(range[(row * nP + p) * 2])) block.append(histSvg(row, p, log));
      else block.append(h("div", { class: "muted" }, "no histogram kept for this step"));
      kids.push(block);
    }
    if (acts.length) {
      const a = meta.act_fields.map((k, i) => [k, acts[(st * nL + l) * nA + i]]).filter(([, x]) => !Number.isNaN(x));
      if (a.length) kids.push(h("div", { class: "tnd-acts" }, "activations: " + a.map(([k, x]) => `${k} ${fmt(x)}`).join(", ")));
    }
    detail.replaceChildren(...kids);
  }

  function redraw() {
    const l = clamp(model.get("layer"), nL), st = clamp(model.get("step"), nS), log = model.get("log_scale");
    const kind = { snapshot: "current .grad", optimizer: "optimizer steps", backward: "backward passes" }[meta.step_kind];
    title.textContent = `gradients of ${meta.model}: ${nL} layers in ${meta.order} order — ${kind}`;
    sliderL.value = String(l); sliderS.value = String(st); logBox.checked = log;
    layerLabel.textContent = `${l + 1}/${nL} ${meta.layers[l].name}`;
    stepLabel.textContent = `step ${meta.steps[st]} (${st + 1}/${nS})`;
    // One way to number, for layers as for steps: a name counted from 0 (layer #1 is view.layer == 1;
    // step 6 had 6 steps completed before it, as every tool's report names it), then its place among
    // the recorded ones (2/3, 7/8), the form the slider's label uses.
    const done = meta.step_kind === "backward" ? "backward passes" : "optimizer steps";
    layerLabel.title = `layer #${l} (${l + 1}/${nL}): counted from 0; layer ${l + 1} of ${nL}`;
    stepLabel.title = `step ${meta.steps[st]} (${st + 1}/${nS}): ${meta.steps[st]} ${done} completed before it ` +
      `(counted from 0); recorded step ${st + 1} of ${nS}`;
    sliderL.setAttribute("aria-valuetext", `layer #${l} (${l + 1}/${nL}): ${meta.layers[l].name}`);
    sliderS.setAttribute("aria-valuetext", `step ${meta.steps[st]} (${st + 1}/${nS})`);
    // A focused button that becomes disabled (▶ at the last layer) drops the focus to <body>, where the
    // arrow keys no longer reach the view: hand the focus to the view itself first.
    for (const [b, off] of [[prevL, l === 0], [nextL, l === nL - 1], [prevS, st === 0], [nextS, st === nS - 1]]) {
      if (off && document.activeElement === b) root.focus();
      b.disabled = off;
    }
    if (!nS) { detail.replaceChildren("nothing recorded"); return; }
    drawFlow(st, l); drawHeat(st, l); drawDetail(st, l, log);
  }

  prevL.addEventListener("click", () => setLayer(model.get("layer") - 1));
  nextL.addEventListener("click", () => setLayer(model.get("layer") + 1));
  prevS.addEventListener("click", () => setStep(model.get("step") - 1));
  nextS.addEventListener("click", () => setStep(model.get("step") + 1));
  sliderL.addEventListener("input", () => setLayer(Number(sliderL.value)));
  sliderS.addEventListener("input", () => setStep(Number(sliderS.value)));
  logBox.addEventListener("change", () => { model.set("log_scale", logBox.checked); model.save_changes(); });
  const onKey = (e) => {
    const moves = { ArrowLeft: [-1, 0], ArrowRight: [1, 0], ArrowDown: [0, -1], ArrowUp: [0, 1] }[e.key];
    if (!moves || e.target.tagName === "INPUT") return;
    e.preventDefault(); e.stopPropagation(); // keep JupyterLab from moving between cells
    if (moves[0]) setLayer(model.get("layer") + moves[0]);
    if (moves[1]) setStep(model.get("step") + moves[1]);
  };
  root.addEventListener("keydown", onKey);
  const unlisten = listen(model, { "change:layer change:step change:log_scale": redraw });
  redraw();
  let drawnFor = widthThere();  // a panel resized: the charts take the new width
  const resized = new ResizeObserver(() => { if (widthThere() !== drawnFor) { drawnFor = widthThere(); redraw(); } });
  resized.observe(root);
  return () => {
    unlisten();
    root.removeEventListener("keydown", onKey);
    resized.disconnect();
  };
}

export default { render };
