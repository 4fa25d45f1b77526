// The one DOM helper of every view: element builders, number formatting, float32 bytes.
// A view takes what it needs with `import { h, s, num } from "./dom.js";` and render/widget.py puts
// this file's definitions in the view's module in place of that line (once, compacted): a widget's
// module must stand alone, offline, so nothing is fetched at run time. Plain ES, no deps.

export const SVG = "http://www.w3.org/2000/svg";

// Attributes: null/undefined/false are left out, true is an empty attribute, a function (under an
// "on..." name) is an event listener. Children: nested arrays of any depth, nodes, strings or numbers;
// null/undefined/false are skipped. A string is appended as a text node (the DOM's rule), never as HTML.
function build(node, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (typeof v === "function") node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) if (c != null && c !== false) node.append(c);
  return node;
}

// h("div", { class: "card", onclick: f }, "text", child, [more]) -> an HTML element
export function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

// s("text", { x: 4, y: 10 }, "label") -> an SVG element
export function s(tag, attrs, ...children) {
  return build(document.createElementNS(SVG, tag), attrs, children);
}

// Follow a widget model: listen(model, { "change:a change:b": draw, "msg:custom": onMsg }) subscribes each
// function to its space-separated events and returns the function that unsubscribes them all (a view's
// render returns it, so a closed view leaves no handler behind).
export function listen(model, handlers) {
  const pairs = Object.entries(handlers).flatMap(([names, f]) => names.split(" ").map((name) => [name, f]));
  for (const [name, f] of pairs) model.on(name, f);
  return () => { for (const [name, f] of pairs) model.off(name, f); };
}

// Numbers one way, as data/stats.py's fmt_number: plain from 1e-3 up to 1e5 with `digits` significant
// digits (0.001234, 12340), an exponent outside (8.125e+19, -5.136e+21, 1.5e-07); nan, inf, -inf; "—"
// for no value. (An exact decimal tie, 1234.5 to 4 digits, rounds up here and to even in Python.)
export function num(v, digits = 4) {
  if (v === null || v === undefined) return "—";
  v = Number(v);
  if (Number.isNaN(v)) return "nan";
  if (!Number.isFinite(v)) return v > 0 ? "inf" : "-inf";
  const rounded = Number(v.toPrecision(digits)), a = Math.abs(rounded);
  if (v === 0 || (a >= 1e-3 && a < 1e5)) return String(rounded);
  return v.toExponential(digits - 1).replace(/\.?0+e/, "e").replace(/e([+-])(\d)$/, "e$10$2");
}

// Counts as whole numbers: "1,024", not "1.024e+03".
export const count = (v) => Math.round(v).toLocaleString("en-US");

// Bytes in binary units, as render/memory.py's fmt_bytes: "1.5 KiB", "512 B", "-2.0 MiB".
export function bytes(n) {
  if (n === null || n === undefined) return "-";
  let v = Math.abs(n);
  const sign = n < 0 ? "-" : "";
  for (const u of ["B", "KiB", "MiB", "GiB"]) {
    if (v < 1024 || u === "GiB") return sign + (u === "B" ? v.toFixed(0) : v.toFixed(1)) + " " + u;
    v /= 1024;
  }
}

// Where a line is, as data/source.py's SourceLine.location: "In [7], line 3" in a numbered cell, "cell
// line 3" in an unnumbered one (its temp file's name means nothing), else "file.py:3"; then the function.
export function place(l) {
  if (!l) return "";
  const cell = l.filename.includes("ipykernel_") || l.filename.startsWith("<ipython-input");
  const at = l.cell !== null && l.cell !== undefined ? `In [${l.cell}], line ${l.lineno}`
    : cell ? `cell line ${l.lineno}` : `${l.filename}:${l.lineno}`;
  return at + (l.function && l.function !== "<module>" ? ` in ${l.function}()` : "");
}

// A synced Bytes trait (DataView, ArrayBuffer or nothing) as a Float32Array of its own, or as a
// Float64Array when `wide` (a view sends float64 bytes where float32 would turn a number into inf).
export function floats(view, wide = false) {
  const Kind = wide ? Float64Array : Float32Array;
  if (!view || !view.byteLength) return new Kind(0);
  const buf = view.buffer ? view.buffer : view;
  const off = view.byteOffset || 0;
  return new Kind(buf.slice(off, off + view.byteLength));
}
