// %graph explorer view. The kernel lays out and draws the SVG; this module pans and zooms it,
// forwards clicks and keys (open/close a group, select a node), runs the search box and exports the
// view. It opens at a readable zoom with the output in view, and paints the SVG with JupyterLab's
// theme variables (light and dark). Plain ES module: no bundler, no CDN, no framework.

import { h, count, listen } from "./dom.js";

// Labels are 11 px in the SVG: below this zoom they would be drawn smaller than 10 px.
const READABLE = 10 / 11;
// The viewport is as tall as the first view needs at that zoom, between these (render/graph.py's
// OPEN_H picks a first view that fits PORT_MAX).
const PORT_MIN = 320, PORT_MAX = 760;

// The SVG carries light colours as presentation attributes (for a page with no CSS); here they follow
// the theme. Box fills are the kind's colour mixed into the theme's panel colour: pale on light,
// deep on dark, with the theme's text on top.
const THEME = `
.tnd-graph-widget { --g-bg: var(--tnd-bg, var(--jp-layout-color0, #fff)); --g-panel: var(--tnd-panel, var(--jp-layout-color1, #fff));
  --g-fg: var(--tnd-fg, var(--jp-ui-font-color1, #1f2328)); --g-muted: var(--tnd-muted, var(--jp-ui-font-color2, #57606a));
  --g-line: var(--jp-ui-font-color3, #8c959f); --g-border: var(--tnd-border, var(--jp-border-color1, #d0d7de));
  --g-focus: var(--tnd-focus, var(--jp-brand-color1, #0969da)); }
.tnd-graph-widget .tnd-graph-port { background: var(--g-bg); border: 1px solid var(--g-border); }
.tnd-graph-widget .tnd-graph-results { background: var(--g-panel); color: var(--g-fg); border: 1px solid var(--g-border); }
.tnd-graph-widget .tnd-graph-match:focus, .tnd-graph-widget .tnd-graph-match:hover { background: rgba(127, 127, 127, 0.18); }
.tnd-graph-widget svg text { fill: var(--g-fg); }
.tnd-graph-widget svg g[data-id] > text ~ text { fill: var(--g-muted); }
.tnd-graph-widget svg g.cluster > rect { fill: var(--g-panel); stroke: var(--g-line); }
.tnd-graph-widget svg g.cluster text.title { fill: var(--g-muted); }
.tnd-graph-widget svg g.cluster text.title tspan { fill: var(--g-line); }
.tnd-graph-widget svg path.edge { stroke: var(--g-line); }
.tnd-graph-widget svg marker path { fill: var(--g-muted); }
.tnd-graph-widget svg g.node.op > rect { fill: color-mix(in srgb, #8c959f 18%, var(--g-panel)); stroke: #8c959f; }
.tnd-graph-widget svg g.node.param > rect { fill: color-mix(in srgb, #218bff 24%, var(--g-panel)); stroke: #218bff; }
.tnd-graph-widget svg g.node.input > rect { fill: color-mix(in srgb, #2da44e 24%, var(--g-panel)); stroke: #2da44e; }
.tnd-graph-widget svg g.node.output > rect { fill: color-mix(in srgb, #1a7f37 45%, var(--g-panel)); stroke: #1a7f37; }
.tnd-graph-widget svg g.group > rect { fill: color-mix(in srgb, #d4a72c 20%, var(--g-panel)); stroke: #bf8700; }
.tnd-graph-widget svg g.group[data-id^="c:"] > rect { fill: color-mix(in srgb, #8250df 14%, var(--g-panel)); stroke: #8250df; }
.tnd-graph-widget svg g.node.nan > rect, .tnd-graph-widget svg g.group.nan > rect,
.tnd-graph-widget svg g.group.nan[data-id] > rect { fill: color-mix(in srgb, #cf222e 22%, var(--g-panel)); stroke: #cf222e; }
.tnd-graph-widget svg g[tabindex] { outline: none; }
.tnd-graph-widget svg g[tabindex]:focus-visible > rect:last-of-type { stroke: var(--g-focus); stroke-width: 3px; }
.tnd-graph-widget svg g.cluster[tabindex]:focus-visible > rect { stroke-dasharray: none; }
`;

function download(name, blob) {
  const a = h("a", { href: URL.createObjectURL(blob), download: name });
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

function svgPng(svgText, done) {
  const img = new Image();
  img.onload = () => {
    const c = h("canvas", { width: img.width * 2, height: img.height * 2 });
    const ctx = c.getContext("2d");
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, c.width, c.height);
    ctx.scale(2, 2); ctx.drawImage(img, 0, 0);
    c.toBlob(done, "image/png");
  };
  img.src = "data:image/svg+xml;charset=utf-8," + encodeURIComponent(svgText);
}

function detailRows(d) {
  const rows = [];
  const add = (k, v) => {
    if (v === undefined || v === null || v === "" || (Array.isArray(v) && !v.length)) return;
    // pre-line: a list (inputs, users, outputs) shows one entry per line
    rows.push(h("tr", {}, h("th", {}, k), h("td", { style: "white-space:pre-line" }, Array.isArray(v) ? v.join("\n") : String(v))));
  };
  if (d.kind === "group") {
    add("module", d.module || d.label); add("class", d.type); add("repeated", d.repeat);
    add("autograd nodes", d.size); add("parameters", d.params ? `${d.params} (${count(d.numel)} values)` : "");
    add("gradients", d.grad); if (d.nan) add("NaN/Inf", `first birth inside (${d.nan})`);
  } else {
    add("kind", d.kind); add("op", d.op); add("output", d.shape);
    add("outputs", d.outputs && d.outputs.length > 1 ? d.outputs : ""); add("module", d.module);
    add("also named", d.aliases); add("inputs", d.inputs); add("used by", d.users); add("saved", d.saved); add("gradient", d.grad);
    add("sequence nr", d.seq); if (d.nan) add("NaN/Inf", `first birth here (${d.nan})`);
  }
  return rows;
}

export default {
  render({ model, el }) {
    let scale = 1, tx = 0, ty = 0, drag = null, moved = false;
    const status = h("span", { class: "muted tnd-graph-status", role: "status", "aria-live": "polite" });
    const search = h("input", { type: "search", placeholder: "find node or parameter…", class: "tnd-graph-search",
                                style: "width:220px", "aria-label": "Find a node, parameter or module" });
    const results = h("div", { class: "tnd-graph-results", role: "listbox", "aria-label": "matches",
                               style: "position:absolute;z-index:5;max-height:240px;overflow:auto;display:none" });
    const stage = h("div", { class: "tnd-graph-stage", style: "transform-origin:0 0" });
    const port = h("div", { class: "tnd-graph-port", style: "position:relative;overflow:hidden;height:560px;" +
                            "border-radius:6px;cursor:grab" }, stage);
    const panel = h("div", { class: "tnd-graph-details", style: "min-width:240px;max-width:360px;max-height:560px;" +
                             "overflow:auto;padding:0 8px" });
    const button = (label, aria, fn) => h("button", { type: "button", "aria-label": aria, title: aria, onclick: fn }, label);
    const apply = () => { stage.style.transform = `translate(${tx}px,${ty}px) scale(${scale})`; };
    const extent = () => {
      const svg = stage.querySelector("svg");
      return svg ? [+svg.getAttribute("width"), +svg.getAttribute("height")] : null;
    };
    const fit = () => { // the whole view, however small that makes it
      const size = extent(); if (!size) return;
      const [w, hh] = size;
      scale = Math.min(1, port.clientWidth / w, port.clientHeight / hh) || 1;
      tx = Math.max(0, (port.clientWidth - w * scale) / 2); ty = 4; apply();
    };
    // The first view: whole if it fits at a readable zoom; else at that zoom, with the output in view
    // (the end of the flow, where the user's tensor is), centred on it across.
    const opening = () => {
      const size = extent(); if (!size) return;
      port.style.height = `${Math.round(Math.min(PORT_MAX, Math.max(PORT_MIN, size[1] * READABLE + 12)))}px`;
      panel.style.maxHeight = port.style.height;
      const [w, hh] = size, pw = port.clientWidth, ph = port.clientHeight;
      scale = Math.max(READABLE, Math.min(1, pw / w, ph / hh));
      tx = Math.max(0, (pw - w * scale) / 2); ty = 4; apply();
      const out = stage.querySelector("g.node.output");
      if (!out) return;
      const r = out.getBoundingClientRect(), p = port.getBoundingClientRect();
      if (r.right > p.right - 8 || r.left < p.left + 8) {
        tx += p.left + pw / 2 - (r.left + r.width / 2);
        tx = Math.min(8, Math.max(pw - w * scale - 8, tx));
      }
      if (r.bottom > p.bottom - 8) ty -= r.bottom - (p.bottom - 16);
      apply();
    };
    const toolbar = h("div", { class: "tnd-graph-toolbar", style: "display:flex;gap:6px;align-items:center;" +
                               "margin:4px 0;position:relative;flex-wrap:wrap" },
      search, results,
      button("fit", "Fit the whole graph in view", fit),
      button("+", "Zoom in", () => { scale *= 1.25; apply(); }),
      button("−", "Zoom out", () => { scale /= 1.25; apply(); }),
      button("SVG", "Download this view as SVG",
             () => download("graph.svg", new Blob([model.get("svg")], { type: "image/svg+xml" }))),
      button("PNG", "Download this view as PNG", () => svgPng(model.get("svg"), (b) => download("graph.png", b))),
      button("DOT", "Download this view as Graphviz DOT", () => model.send({ type: "dot" })), status);
    const legend = h("div", { class: "legend muted tnd-graph-legend" });
    for (const [fill, stroke, label] of [["#dafbe1", "#2da44e", "input"], ["#cfe8fc", "#218bff", "parameter"],
      ["#eef0f3", "#8c959f", "op"], ["#a6e3a1", "#1a7f37", "output"], ["#fff8e1", "#bf8700", "module (click to open)"],
      ["#f6f0ff", "#8250df", "chunk of ops"], ["#ffebe9", "#cf222e", "first NaN/Inf"]]) {
      legend.append(h("span", {}, h("span", { class: "swatch", style: `background:${fill};border-color:${stroke}` }), label));
    }
    legend.append(h("span", { style: "white-space:normal" },  // the one long key wraps in a narrow panel
      "drag to pan · wheel to zoom · click a node for details · Tab, Enter and Space work too"));
    // data-lm-suppress-shortcuts: Enter/Space inside the view act on it, not on the notebook around it.
    const root = h("div", { class: "tnd tnd-graph-widget", "data-lm-suppress-shortcuts": "true" },
      h("style", {}, THEME), h("div", { class: "muted tnd-graph-summary" }), toolbar, legend,
      // In a narrow panel (~500 px) the details go under the graph instead of squeezing it.
      h("div", { style: "display:flex;gap:8px;align-items:flex-start;flex-wrap:wrap" },
        h("div", { style: "flex:1 1 320px;min-width:0" }, port), panel));
    el.append(root);

    const draw = () => {
      const active = document.activeElement;
      const focused = active && stage.contains(active) && active.dataset ? active.dataset.id : null;
      stage.innerHTML = model.get("svg");
      const sel = model.get("selected");
      root.querySelector(".tnd-graph-summary").textContent =
        [model.get("summary"), ...model.get("notes")].join(" · ");
      status.textContent = "";
      for (const g of stage.querySelectorAll("g[data-id]")) focusable(g);
      if (sel) for (const g of stage.querySelectorAll("[data-id]")) if (g.dataset.id === sel) { g.classList.add("selected"); reveal(g); }
      if (focused) { // the item acted on keeps the focus across the redraw (an opened group: its frame)
        const again = [...stage.querySelectorAll("g[data-id]")].find((g) => g.dataset.id === focused);
        if (again) { again.focus({ preventScroll: true }); if (again.matches(":focus-visible")) reveal(again); }
      }
    };
    // Every node and module box is a button for the keyboard: Tab reaches it, Enter/Space acts.
    const focusable = (g) => {
      const open = g.classList.contains("cluster"), group = open || g.classList.contains("group");
      const title = g.querySelector("title"), text = g.querySelector("text");
      const name = (title && title.textContent) || (text && text.textContent) || g.dataset.id;
      g.setAttribute("tabindex", "0");
      g.setAttribute("role", "button");
      g.setAttribute("aria-label", group ? `${open ? "close" : "open"} ${name}` : `details of ${name}`);
      if (group) g.setAttribute("aria-expanded", open ? "true" : "false");
    };
    // Bring a selected item into view (after a search opened the groups around it).
    const reveal = (g) => {
      const r = g.getBoundingClientRect(), p = port.getBoundingClientRect();
      if (r.left >= p.left && r.right <= p.right && r.top >= p.top && r.bottom <= p.bottom) return;
      tx += p.left + p.width / 2 - (r.left + r.width / 2);
      ty += p.top + p.height / 2 - (r.top + r.height / 2);
      apply();
    };
    const showDetails = () => {
      const d = model.get("details");
      panel.replaceChildren();
      if (!d || !d.id) return;
      panel.append(h("h3", {}, d.label || d.id), h("table", {}, ...detailRows(d)));
    };
    const showMatches = () => {
      const found = model.get("matches");
      const pick = (m) => { results.style.display = "none"; status.textContent = "…"; model.send({ type: "reveal", id: m.id }); };
      results.replaceChildren(...found.map((m) => h("div", {
        class: "tnd-graph-match", style: "padding:2px 8px;cursor:pointer", "data-id": m.id, tabindex: "0", role: "option",
        onclick: () => pick(m),
        onkeydown: (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); pick(m); } },
      }, `${m.label}  `, h("span", { class: "muted" }, m.where))));
      results.style.top = `${search.offsetTop + search.offsetHeight}px`;
      results.style.left = `${search.offsetLeft}px`;
      results.style.display = found.length ? "block" : "none";
    };

    search.addEventListener("input", () => model.send({ type: "search", q: search.value }));
    search.addEventListener("keydown", (e) => {
      if (e.key === "Enter") { const first = results.querySelector("[data-id]"); if (first) first.click(); }
      if (e.key === "Escape") results.style.display = "none";
    });
    port.addEventListener("wheel", (e) => {
      e.preventDefault();
      const r = port.getBoundingClientRect(), px = e.clientX - r.left, py = e.clientY - r.top;
      const k = Math.exp(-e.deltaY * 0.0015);
      tx = px - (px - tx) * k; ty = py - (py - ty) * k; scale *= k; apply();
    }, { passive: false });
    port.addEventListener("pointerdown", (e) => { drag = { x: e.clientX, y: e.clientY, tx, ty }; moved = false; });
    port.addEventListener("pointermove", (e) => {
      if (!drag) return;
      const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
      if (Math.abs(dx) + Math.abs(dy) > 4) moved = true;
      if (moved) { tx = drag.tx + dx; ty = drag.ty + dy; apply(); }
    });
    const end = () => { drag = null; };
    port.addEventListener("pointerup", end);
    port.addEventListener("pointerleave", end);
    const act = (target) => {
      const id = target.dataset.id;
      status.textContent = "…";
      if (target.classList.contains("group") || target.classList.contains("cluster")) model.send({ type: "toggle", id });
      else model.send({ type: "select", id });
    };
    port.addEventListener("click", (e) => {
      if (moved) return;
      const target = e.target.closest("[data-id]");
      if (target) act(target);
    });
    port.addEventListener("keydown", (e) => {
      const target = e.target.closest && e.target.closest("g[data-id]");
      if (!target || (e.key !== "Enter" && e.key !== " ")) return;
      e.preventDefault(); e.stopPropagation();
      act(target);
    });
    port.addEventListener("focusin", (e) => { // a box reached with Tab is brought into the view
      const target = e.target.closest && e.target.closest("g[data-id]");
      if (target && target.matches(":focus-visible")) reveal(target);
    });
    const onMsg = (msg) => {
      if (msg && msg.type === "dot") download("graph.dot", new Blob([msg.text], { type: "text/vnd.graphviz" }));
    };
    const unlisten = listen(model, { "msg:custom": onMsg, "change:svg change:selected": draw,
      "change:details": showDetails, "change:matches": showMatches });
    draw(); showDetails();
    let tries = 0;
    const open = () => { // once the output area has laid the view out (it may be hidden at first)
      if (!port.clientWidth && tries++ < 600) { requestAnimationFrame(open); return; }
      opening();
    };
    requestAnimationFrame(open);
    return unlisten;
  },
};
