// nanwatch view: the birth card, the cell with its line highlighted, per-layer statistics with the
// birth row marked, and every event (click one, or Tab to it and press Enter or Space, to show it in
// the card). Plain ES module, no deps; colours from base.css (JupyterLab's theme), wide tables scroll
// in their own box.

import { h, num, count, listen } from "./dom.js";

const PHASE = { forward: "forward", backward: "backward", optimizer: "optimizer step", input: "input data" };
const KIND = { nan: "NaN", inf: "Inf" };
const CONTEXT = 6; // lines shown either side of the birth line (same as the static view)

function brief(s) {
  if (!s) return "";
  let t = `${s.dtype}[${s.shape.join(", ")}]`;
  if (s.note) return `${t} (${s.note})`;
  if (s.min !== null && s.max !== null) t += ` min=${num(s.min)} max=${num(s.max)}`;
  if (s.nan) t += ` nan=${s.nan}`;
  if (s.inf) t += ` inf=${s.inf}`;
  return t;
}

// Why a report without births is not a clean bill of health ("" when it is); same rule as the static view.
function cleanDoubt(report) {
  if ((report.layers || []).some((l) => l.fwd_finite === false || l.grad_finite === false)) {
    if ((report.absorbed || []).length) return "the NaN/Inf values in the table come from the absorbed births listed below.";
    return "but some layer outputs or gradients below hold NaN/Inf: they were not created by a watched op " +
      "(see the notes), so their birth was not caught.";
  }
  if (!report.ops_checked && !moduleCalls(report)) {
    return "but no op or module output was checked, so this says nothing about the values (see the notes).";
  }
  return "";
}

// Module calls whose outputs were checked (with replay or in module mode they cover a model's ops).
function moduleCalls(report) {
  return (report.layers || []).reduce((n, l) => n + (l.calls || 0), 0);
}

// What was checked, in words; same rule as NanSummary.checked.
function checked(report) {
  const ops = report.ops_checked || 0, calls = moduleCalls(report);
  return `${count(ops)} op${ops === 1 ? "" : "s"}` +
    (calls ? ` and ${count(calls)} module call${calls === 1 ? "" : "s"}` : "") + " checked";
}

// As data/source.py's line_label: "line 3" in the watched cell, "In [2], line 3" in another,
// "model.py, line 3" in a file.
function lineLabel(e, report) {
  const cells = report.cells || {}, here = report.cell ?? null;
  const cell = e.filename && e.filename in cells ? cells[e.filename] : null;
  if (cell !== null && cell === here) return `line ${e.lineno}`;
  if (cell !== null) return `In [${cell}], line ${e.lineno}`;
  const isCell = !e.filename || e.filename.includes("ipykernel_") || e.filename.startsWith("<ipython-input");
  if (isCell) return here === null || !e.filename ? `line ${e.lineno}` : `another cell, line ${e.lineno}`;
  return `${e.filename.split(/[\\/]/).pop()}, line ${e.lineno}`;
}

function card(e, report) {
  if (!e) {
    const doubt = cleanDoubt(report);
    if (doubt) {  // never a green "all clear" the data does not support
      return h("div", { class: "card caution nw-card" }, h("b", { class: "warn" }, "nanwatch: no NaN/Inf birth recorded"),
        h("span", { class: "muted" }, ` (${checked(report)}, mode ${report.mode})`), h("div", {}, doubt));
    }
    return h("div", { class: "card ok nw-card" }, h("b", { class: "good" }, "✓ nanwatch: no NaN/Inf born"),
      h("span", { class: "muted" }, ` — every value stayed finite (${checked(report)}, mode ${report.mode})`));
  }
  const where = [];
  if (e.module) where.push(h("code", { class: "nw-module" }, e.module), " · ");
  if (e.param) where.push("parameter ", h("code", {}, e.param), " · ");
  if (e.lineno !== null) where.push(h("span", { class: "nw-where-line" }, lineLabel(e, report)), ": ", h("code", { class: "nw-line" }, e.line || ""), " · ");
  where.push(`${PHASE[e.phase] || e.phase}, step ${e.step}`);
  const what = [h("b", {}, e.kind === "nan" ? "NaN" : "Inf"), " from ", h("code", { class: "nw-op" }, e.op)];
  if (e.aten_op && e.aten_op !== e.op) what.push(" (", h("code", {}, e.aten_op), ")");
  if (e.detail) what.push(" ", h("span", { class: "muted" }, e.detail));
  const rows = [["Where", where], ["What", what]];
  if (e.phase === "backward" && e.forward_op) {
    rows.push(["Forward", ["created by ", h("code", {}, e.forward_op),
      e.forward_module ? [" in ", h("code", {}, e.forward_module)] : "",
      e.forward_lineno ? ` at line ${e.forward_lineno}` : ""]]);
  }
  rows.push(["Why / fix", h("span", { class: "nw-hint" }, e.hint)]);
  const stats = e.inputs.map((s, i) => h("div", { class: "mono" }, `input ${i}: ${brief(s)}`));
  if (e.output) stats.push(h("div", { class: "mono" }, `output: ${brief(e.output)}`));
  rows.push(["Stats", stats]);
  return h("div", { class: "card nw-card" }, h("b", { class: "bad nw-title" }, e.title),
    h("table", {}, rows.map(([k, v]) => h("tr", {}, h("th", {}, k), h("td", {}, v)))));
}

function source(report, e) {
  if (!e) return null;
  // The selected event's own cell/file when known, else the first event's cell.
  const own = e.filename && report.sources ? report.sources[e.filename] : null;
  const src = own || { text: report.cell_source, first_line: report.source_first_line };
  if (!src.text) return null;
  const same = !!own || !e.filename || e.filename === report.cell_filename;
  const lines = src.text.split("\n");
  if (lines.length && lines[lines.length - 1] === "") lines.pop();
  const [lo, hi] = same ? windowOf(lines.length, src.first_line, e.lineno) : [0, lines.length];
  const gap = (k, where) => h("span", { class: "gap" }, `… ${k} line${k === 1 ? "" : "s"} ${where}`);
  return h("pre", { class: "cell nw-source" }, lo ? gap(lo, "above") : null, lines.slice(lo, hi).map((text, i) => {
    const n = i + lo + src.first_line;
    const hl = same && n === e.lineno;
    return h("span", { class: hl ? "line hl" : "line", "data-line": String(n) },
      h("span", { class: "muted" }, String(n).padStart(3, " ")), "  ", text);
  }), hi < lines.length ? gap(lines.length - hi, "below") : null);
}

// All of a short cell, else CONTEXT lines around the target; never fold just one or two lines.
function windowOf(count, first, target) {
  if (target === null || target === undefined || count <= 2 * CONTEXT + 3) return [0, count];
  const at = target - first;
  let lo = Math.max(0, at - CONTEXT), hi = Math.min(count, at + CONTEXT + 1);
  if (lo <= 2) lo = 0;
  if (count - hi <= 2) hi = count;
  return [lo, hi];
}

// A long module path may wrap after its dots, so the numbers beside it stay in view in a narrow panel.
const breakable = (path) => String(path).split(".").flatMap((part, i) => (i ? [".", h("wbr"), part] : [part]));

function statCells(finite, values) {
  if (finite === null || finite === undefined) return values.map(() => h("td", { class: "muted num" }, "—"));
  if (!finite) return [h("td", { class: "bad", colspan: "3" }, "NaN/Inf")];
  return values.map((v) => h("td", { class: "num" }, num(v)));
}

// In a narrow output (a ~500 px side panel) a module's name gets a row of its own above its numbers,
// so the gradient columns stay in view (container query on .tnd-nanwatch).
const NARROW_CSS = `
.tnd-nanwatch { container-type: inline-size; }
.tnd-nanwatch table.nw-layers tr.nw-name { display: none; }
.tnd-nanwatch table.nw-layers tr.mark-name td { background: var(--tnd-mark); font-weight: 600; }
@container (max-width: 640px) {
  .tnd-nanwatch table.nw-layers tr.nw-name { display: table-row; }
  .tnd-nanwatch table.nw-layers tr.nw-name td { border-bottom: none; padding-bottom: 0; }
  .tnd-nanwatch table.nw-layers .nw-module { display: none; }
  .tnd-nanwatch table.nw-layers td.num, .tnd-nanwatch table.nw-layers th.num { padding-left: 3px; padding-right: 3px; font-size: 12px; }
}`;

function layers(report, e) {
  if (!report.layers.length) return null;
  const target = e ? e.module : null;
  const head = [h("tr", {}, h("th", { rowspan: "2", class: "nw-module" }, "module"), h("th", { rowspan: "2", class: "num" }, "calls"),
    h("th", { colspan: "3" }, "activation (output)"), h("th", { colspan: "3" }, "gradient (w.r.t. output)")),
  h("tr", {}, ["min", "max", "mean", "min", "max", "mean"].map((c) => h("th", { class: "num" }, c)))];
  const name = (l) => [...breakable(l.module), l.module === target ? " ◀ birth" : ""];
  const rows = report.layers.flatMap((l) => [
    h("tr", { class: l.module === target ? "nw-name mark-name" : "nw-name" }, h("td", { class: "mono", colspan: "7" }, ...name(l))),
    h("tr", { class: l.module === target ? "mark" : "" },
      h("td", { class: "mono nw-module" }, ...name(l)), h("td", { class: "num" }, String(l.calls)),
      statCells(l.fwd_finite, [l.fwd_min, l.fwd_max, l.fwd_mean]),
      statCells(l.grad_finite, [l.grad_min, l.grad_max, l.grad_mean]))]);
  return [h("h3", {}, "Per-layer activations and gradients"),
    h("div", { class: "scroll" }, h("table", { class: "nw-layers" }, head, rows))];
}

function events(report, selected, select) {
  if (!report.events.length) return null;
  const numeric = [true, false, true, false, false, false, false];
  const head = h("tr", {}, ["#", "phase", "step", "kind", "op", "module / parameter", "line"]
    .map((c, k) => h("th", { class: numeric[k] ? "num" : "" }, c)));
  const onKey = (i) => (evt) => {
    if (evt.key !== "Enter" && evt.key !== " ") return;
    evt.preventDefault(); // Space would scroll the page
    evt.stopPropagation(); // Enter would put the notebook cell in edit mode
    select(i);
  };
  const rows = report.events.map((e, i) => h("tr", {
    class: i === selected ? "mark nw-event" : "nw-event", title: "show in the card", tabindex: "0",
    "data-index": String(i), "aria-current": i === selected ? "true" : null, "data-lm-suppress-shortcuts": "true",
    onclick: () => select(i), onkeydown: onKey(i),
  }, [String(i + 1), PHASE[e.phase] || e.phase, String(e.step), KIND[e.kind] || e.kind, e.op, e.module || e.param || "",
    e.lineno === null || e.lineno === undefined ? "" : lineLabel(e, report)]
    .map((c, k) => h("td", { class: k === 4 || k === 5 ? "mono" : k === 3 ? "bad" : numeric[k] ? "num" : "" }, String(c)))));
  return [h("h3", {}, `All births (${report.events.length})`),
    h("div", { class: "scroll" }, h("table", { class: "nw-events", "aria-label": "every NaN/Inf birth; Enter shows one in the card" }, head, rows))];
}

export default {
  render({ model, el }) {
    const root = h("div", { class: "tnd tnd-nanwatch" });
    el.append(h("style", {}, NARROW_CSS), root);
    const draw = () => {
      // A redraw replaces the rows: the focused one (Enter on it) gets the focus back.
      const focused = root.contains(document.activeElement) ? document.activeElement.getAttribute("data-index") : null;
      const report = model.get("report") || { events: [], absorbed: [], layers: [], notes: [] };
      const n = report.events.length;
      const selected = Math.min(Math.max(model.get("selected") || 0, 0), Math.max(n - 1, 0));
      const e = n ? report.events[selected] : null;
      const select = (i) => { model.set("selected", i); model.save_changes(); };
      root.replaceChildren(...[card(e, report), source(report, e), layers(report, e), events(report, selected, select),
        report.absorbed.length ? h("div", { class: "muted" },
          "Absorbed: thrown away by torch.where / masked_fill or a cast to integers, or skipped by GradScaler: ",
          report.absorbed.map((a) => `${a.op} at line ${a.lineno}`).join("; ")) : null,
        ...report.notes.map((t) => h("div", { class: "muted" }, `note: ${t}`))].flat().filter(Boolean));
      if (focused !== null) {
        const again = root.querySelector(`tr.nw-event[data-index="${focused}"]`);
        if (again) again.focus();
      }
    };
    draw();
    return listen(model, { "change:report change:selected": draw });
  },
};
