// explain view: the diagnosis card (kind, where, op, culprit, fix, warnings), the operands table, a
// collapsible details section (full message, files) and a copy button. Plain ES module, no deps.
// Every user string (module names, lines, operand names, the message) goes in as a text node.

import { h, listen } from "./dom.js";

// "`a` and `b`" -> ["", <code>a</code>, " and ", <code>b</code>]: the kernel marks code with backticks.
function rich(text) {
  return String(text || "").split("`").map((part, i) => (i % 2 ? h("code", {}, part) : part));
}

const shapeText = (shape) => (shape ? `[${shape.join(", ")}]` : "?");

// "model.fc · line 7: return self.fc(x)"
// label: "line 7" in the cell the card is under, "In [2], line 7" in another (data/source.py's line_label)
function site(module, lineno, line, moduleClass, label) {
  const out = [];
  if (module) out.push(h("code", { class: moduleClass }, module));
  if (lineno) out.push(out.length ? " · " : "", label || `line ${lineno}`, line ? [": ", h("code", { class: "xp-line" }, line)] : "");
  return out;
}

function factsTable(d) {
  const rows = [];
  const where = site(d.module, d.lineno, d.line, "xp-module", d.where_label);
  if (where.length) rows.push(["Where", "tnd-explain-where", where]);
  if (d.op) rows.push(["Op", "tnd-explain-op", h("code", {}, d.op)]);
  const culprit = site(d.culprit_module, d.culprit_lineno, d.culprit_line, "xp-culprit-module", d.culprit_label);
  if (d.culprit_op || culprit.length) {
    rows.push(["Culprit", "tnd-explain-culprit", [d.culprit_op ? h("code", {}, d.culprit_op) : "",
      d.culprit_op && culprit.length ? " in " : "", culprit]]);
  }
  if (d.hint) rows.push(["Why / fix", "tnd-explain-fix", rich(d.hint)]);
  return h("table", { class: "xp-facts" },
    rows.map(([label, cls, value]) => h("tr", {}, h("th", { scope: "row" }, label), h("td", { class: cls }, value))));
}

function notes(d) {
  const out = [];
  if (d.warning) out.push(h("div", { class: "xp-warning tnd-explain-warning", role: "note" }, h("b", { class: "warn" }, "Careful: "), rich(d.warning)));
  if (d.restart_needed) out.push(h("div", { class: "xp-note warn" }, "Restart the kernel: the CUDA context is unusable after a device-side assert."));
  if (d.suggest_record) out.push(h("div", { class: "xp-note muted" }, rich("Run the cell again with `%%explain` on its first line to name the culprit.")));
  if (d.note) out.push(h("div", { class: "xp-note muted" }, rich(d.note)));
  return out;
}

function operandsTable(d) {
  if (!d.operands || !d.operands.length) return null;
  const head = h("tr", {}, ["operand", "shape", "dtype", "device", "produced by"].map((c) => h("th", { scope: "col" }, c)));
  const rows = d.operands.map((o) => h("tr", { class: "xp-operand" },
    h("td", { class: "mono" }, h("span", { class: "xp-name" }, o.name),
      o.requires_grad ? h("span", { class: "muted", title: "requires grad" }, " (grad)") : ""),
    h("td", { class: "mono nowrap" }, shapeText(o.shape)), h("td", { class: "mono" }, o.dtype),
    h("td", { class: "mono" }, o.device), h("td", { class: "mono" }, o.producer || "—")));
  // Shapes and producers can be long: the table scrolls in its own box, the card keeps its width.
  return h("div", { class: "scroll" }, h("table", { class: "xp-operands tnd-explain-operands", "aria-label": "operands of the failing op" },
    h("thead", {}, head), h("tbody", {}, rows)));
}

function details(d, id) {
  const files = [];
  if (d.filename) files.push(h("div", {}, "error at ", h("code", {}, `${d.filename}:${d.lineno}`)));
  if (d.culprit_filename) files.push(h("div", {}, "culprit at ", h("code", {}, `${d.culprit_filename}:${d.culprit_lineno}`)));
  const how = d.recorded ? "recorded by a %%explain run (the culprit was seen happening)"
    : "read post mortem from the traceback (nothing was run again)";
  return h("div", { class: "xp-details", id },
    h("div", {}, h("b", {}, d.exc_type || "Error"), h("span", { class: "muted" }, ` — ${how}`)),
    h("pre", { class: "xp-message" }, d.message || ""), files);
}

let counter = 0; // unique ids for aria-controls when one notebook shows several views

export default {
  render({ model, el }) {
    const root = h("div", { class: "tnd tnd-explain-view" });
    el.append(root);
    const detailsId = `tnd-explain-details-${++counter}`;
    let timer = null;
    let parts = null; // the nodes that change without a redraw (so a focused button keeps its focus)

    const copy = async () => {
      const text = (model.get("diagnosis") || {}).text || "";
      let status;
      try {
        await navigator.clipboard.writeText(text);
        status = "Copied";
      } catch (err) {
        status = "Copy failed: the browser refused clipboard access";
      }
      parts.status.textContent = status;
      clearTimeout(timer);
      timer = setTimeout(() => { parts.status.textContent = ""; }, 2500);
    };
    const toggle = () => { model.set("expanded", !model.get("expanded")); model.save_changes(); };
    const showExpanded = () => {
      const open = !!model.get("expanded");
      parts.toggle.setAttribute("aria-expanded", open ? "true" : "false");
      parts.caret.textContent = open ? "▾" : "▸";
      parts.details.hidden = !open;
    };

    const draw = () => {
      const d = model.get("diagnosis") || {};
      const title = d.summary ? `${d.title}: ${d.summary}` : d.title || "PyTorch error";
      // data-lm-suppress-shortcuts: Enter/Space on a focused button act on it, not on the notebook.
      const status = h("span", { class: "muted xp-status", role: "status", "aria-live": "polite" });
      const head = h("div", { class: "xp-head" },
        h("b", { class: "bad tnd-explain-title" }, rich(title)),
        h("button", { type: "button", class: "xp-copy", title: "Copy the diagnosis as text",
          "aria-label": "Copy the diagnosis as text", "data-lm-suppress-shortcuts": "true", onclick: copy },
          "Copy"), status);
      const caret = h("span", { class: "xp-caret", "aria-hidden": "true" });
      const toggleButton = h("button", { type: "button", class: "xp-toggle", "aria-controls": detailsId,
        "data-lm-suppress-shortcuts": "true", onclick: toggle }, caret, "Details");
      const more = details(d, detailsId);
      parts = { status, caret, toggle: toggleButton, details: more };
      root.replaceChildren(h("div", { class: `card tnd-explain-${d.kind || "other"}`, "data-kind": d.kind || "other" },
        head, factsTable(d), notes(d), operandsTable(d), toggleButton, more));
      showExpanded();
    };
    draw();
    const unlisten = listen(model, { "change:diagnosis": draw, "change:expanded": showExpanded });
    return () => { clearTimeout(timer); unlisten(); };
  },
};
