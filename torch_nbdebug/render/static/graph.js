// %graph explorer view. The kernel lays out and draws the SVG; this module pans and zooms it,
// forwards clicks (open/close a group, select a node), runs the search box and exports the view.
// Plain ES module: no bundler, no CDN, no framework.

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") el.className = v; else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v);
  }
  for (const c of children) el.append(c);
  return el;
}

function download(name, blob) {
  const a = h("a", { href: URL.createObjectURL(blob), download: name });
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

function svgPng(svgText, done) {
  const img = new Image();
  img.onload = () => {
    const c = document.createElement("canvas");
    c.width = img.width * 2; c.height = img.height * 2;
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
    add("nodes", d.size); add("parameters", d.params ? `${d.params} (${d.numel.toLocaleString()} values)` : "");
    add("gradients", d.grad); if (d.nan) add("NaN/Inf", "first birth inside");
  } else {
    add("kind", d.kind); add("op", d.op); add("output", d.shape);
    add("outputs", d.outputs && d.outputs.length > 1 ? d.outputs : ""); add("module", d.module);
    add("inputs", d.inputs); add("used by", d.users); add("saved", d.saved); add("gradient", d.grad);
    add("sequence nr", d.seq); if (d.nan) add("NaN/Inf", "first birth here (last %%nanwatch)");
  }
  return rows;
}

export default {
  render({ model, el }) {
    let scale = 1, tx = 0, ty = 0, drag = null, moved = false;
    const status = h("span", { class: "muted tnd-graph-status" });
    const search = h("input", { type: "search", placeholder: "find node or parameter…", class: "tnd-graph-search",
                                style: "width:220px" });
    const results = h("div", { class: "tnd-graph-results", style: "position:absolute;z-index:5;" +
                               "background:var(--jp-layout-color1, #fff);color:var(--jp-ui-font-color1, #1f2328);" +
                               "border:1px solid #d0d7de;max-height:240px;overflow:auto;display:none" });
    const stage = h("div", { class: "tnd-graph-stage", style: "transform-origin:0 0" });
    const port = h("div", { class: "tnd-graph-port", style: "position:relative;overflow:hidden;height:560px;" +
                            "border:1px solid #d0d7de;border-radius:6px;cursor:grab;background:#fff" }, stage);
    const panel = h("div", { class: "tnd-graph-details", style: "min-width:240px;max-width:360px;max-height:560px;" +
                             "overflow:auto;padding:0 8px" });
    const button = (label, fn) => h("button", { onclick: fn }, label);
    const apply = () => { stage.style.transform = `translate(${tx}px,${ty}px) scale(${scale})`; };
    const fit = () => {
      const svg = stage.querySelector("svg"); if (!svg) return;
      const w = +svg.getAttribute("width"), hh = +svg.getAttribute("height");
      scale = Math.min(1, port.clientWidth / w, port.clientHeight / hh) || 1;
      tx = Math.max(0, (port.clientWidth - w * scale) / 2); ty = 4; apply();
    };
    const toolbar = h("div", { class: "tnd-graph-toolbar", style: "display:flex;gap:6px;align-items:center;" +
                               "margin:4px 0;position:relative;flex-wrap:wrap" },
      search, results,
      button("fit", fit), button("+", () => { scale *= 1.25; apply(); }), button("−", () => { scale /= 1.25; apply(); }),
      button("SVG", () => download("graph.svg", new Blob([model.get("svg")], { type: "image/svg+xml" }))),
      button("PNG", () => svgPng(model.get("svg"), (b) => download("graph.png", b))),
      button("DOT", () => model.send({ type: "dot" })), status);
    const legend = h("div", { class: "legend muted tnd-graph-legend" });
    for (const [fill, stroke, label] of [["#dafbe1", "#2da44e", "input"], ["#cfe8fc", "#218bff", "parameter"],
      ["#eef0f3", "#8c959f", "op"], ["#a6e3a1", "#1a7f37", "output"], ["#fff8e1", "#bf8700", "module (click to open)"],
      ["#f6f0ff", "#8250df", "chunk of ops"], ["#ffebe9", "#cf222e", "first NaN/Inf"]]) {
      legend.append(h("span", {}, h("span", { class: "swatch", style: `background:${fill};border-color:${stroke}` }), label));
    }
    legend.append(h("span", {}, "drag to pan · wheel to zoom · click a node for details"));
    const root = h("div", { class: "tnd tnd-graph-widget" },
      h("div", { class: "muted tnd-graph-summary" }), toolbar, legend,
      h("div", { style: "display:flex;gap:8px;align-items:flex-start" }, h("div", { style: "flex:1;min-width:0" }, port), panel));
    el.append(root);

    const draw = () => {
      stage.innerHTML = model.get("svg");
      const sel = model.get("selected");
      root.querySelector(".tnd-graph-summary").textContent =
        [model.get("summary"), ...model.get("notes")].join(" · ");
      status.textContent = "";
      if (sel) for (const g of stage.querySelectorAll("[data-id]")) if (g.dataset.id === sel) { g.classList.add("selected"); reveal(g); }
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
      results.replaceChildren(...found.map((m) => h("div", {
        class: "tnd-graph-match", style: "padding:2px 8px;cursor:pointer", "data-id": m.id,
        onclick: () => { results.style.display = "none"; status.textContent = "…"; model.send({ type: "reveal", id: m.id }); },
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
    port.addEventListener("click", (e) => {
      if (moved) return;
      const target = e.target.closest("[data-id]");
      if (!target) return;
      const id = target.dataset.id;
      status.textContent = "…";
      if (target.classList.contains("group") || target.classList.contains("cluster")) model.send({ type: "toggle", id });
      else model.send({ type: "select", id });
    });
    const onMsg = (msg) => {
      if (msg && msg.type === "dot") download("graph.dot", new Blob([msg.text], { type: "text/vnd.graphviz" }));
    };
    model.on("msg:custom", onMsg);
    model.on("change:svg", draw);
    model.on("change:selected", draw);
    model.on("change:details", showDetails);
    model.on("change:matches", showMatches);
    draw(); showDetails(); requestAnimationFrame(fit);
    return () => {
      model.off("msg:custom", onMsg); model.off("change:svg", draw); model.off("change:selected", draw);
      model.off("change:details", showDetails); model.off("change:matches", showMatches);
    };
  },
};
