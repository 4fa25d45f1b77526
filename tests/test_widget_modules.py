"""The widgets' ES modules: one shared helper (static/dom.js) put into every view's module at load by
render/widget.py's include mechanism, and its number format the statistics' own (data/stats.py).

The JavaScript runs in node where it is installed (the helper's functions, the modules' syntax)."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torch_nbdebug.data.stats import fmt_number
from torch_nbdebug.render.widget import View, compact_js, esm_path, module_source, unpack

VIEWS = ["explain", "grads", "graph", "live", "memory", "monitor", "nanwatch", "profile"]
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed")


def _node(script: str, cwd: Path) -> str:
    assert NODE is not None
    run = subprocess.run([NODE, "--input-type=module", "-e", script], cwd=cwd, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def _widget_classes() -> list[type[View]]:
    import torch_nbdebug.render.explain  # noqa: F401  (each defines its View subclasses)
    import torch_nbdebug.render.grads  # noqa: F401
    import torch_nbdebug.render.graph  # noqa: F401
    import torch_nbdebug.render.live  # noqa: F401
    import torch_nbdebug.render.memory  # noqa: F401
    import torch_nbdebug.render.monitor  # noqa: F401
    import torch_nbdebug.render.nanwatch  # noqa: F401
    import torch_nbdebug.render.profile  # noqa: F401

    def below(cls: type[View]) -> list[type[View]]:
        return [c for sub in cls.__subclasses__() for c in [sub, *below(sub)]]

    # the classes the package defines (anywidget's add_traits makes a subclass per instance shown)
    return [c for c in below(View) if c.__module__.startswith("torch_nbdebug.")
            and getattr(sys.modules[c.__module__], c.__name__, None) is c]


@pytest.mark.parametrize("name", VIEWS)
def test_every_view_builds_its_elements_with_the_shared_helper(name: str) -> None:
    source = esm_path(f"{name}.js").read_text(encoding="utf-8")
    assert re.search(r'^import \{[^}]*\bh\b[^}]*\} from "\./dom\.js";$', source, re.M), f"{name}.js does not use dom.js"
    # no element builder or number formatter of its own (seven dialects of them were here)
    assert not re.search(r"^(?:function|const) (?:h|s|floats|fmtBytes|numAt)\b", source, re.M), name
    assert "createElement(" not in source and "createElementNS(" not in source, name
    assert "toPrecision(" not in source and "toExponential(" not in source, f"{name}.js formats numbers its own way"


@pytest.mark.parametrize("name", VIEWS)
def test_a_loaded_view_module_stands_alone_with_each_helper_once(name: str) -> None:
    module = compact_js(module_source(esm_path(f"{name}.js")))
    assert "import " not in module.split("\n", 1)[0] and not re.search(r"^import\b", module, re.M)
    assert len(re.findall(r"^function h\(", module, re.M)) == 1
    assert "export default" in module  # the view's own export stays; the helper's are gone
    assert not re.search(r"^export (?:function|const) (?:h|s|num|build)\b", module, re.M)


def test_each_widget_class_sends_its_module_with_the_helper_in_it() -> None:
    classes = _widget_classes()
    assert len(classes) >= 8, classes
    for cls in classes:
        esm = unpack(cls._esm)[0]  # the module as the packed loader carries it
        assert "function build(node, attrs, children) {" in esm and not re.search(r"^import\b", esm, re.M), cls


@needs_node
@pytest.mark.parametrize("name", VIEWS)
def test_a_loaded_view_module_is_valid_javascript(name: str, tmp_path: Path) -> None:
    module = tmp_path / f"{name}.mjs"
    module.write_text(compact_js(module_source(esm_path(f"{name}.js"))), encoding="utf-8")
    assert NODE is not None
    check = subprocess.run([NODE, "--check", str(module)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")


SHARED = """// the shared file
export const NS = "ns";
// a helper only `b` uses
function inner() { return NS; }
export function a() { return 1; }
// b calls inner, which reads NS; "a" in a comment is not a use of a()
export function b() { return inner(); }
export const c = () => a() + 1;
"""


def test_include_puts_in_what_the_names_need_once(tmp_path: Path) -> None:
    _write(tmp_path, {"shared.js": SHARED,
                      "view.js": 'import { b } from "./shared.js";\nimport { b, c } from "./shared.js";\n'
                                 "export default { render() { return b() + c(); } };\n"})
    out = module_source(tmp_path / "view.js")
    assert "import" not in out and "export const" not in out and "export function" not in out
    for name in ("NS", "inner", "a", "b", "c"):  # c needs a; b needs inner, which needs NS
        assert len(re.findall(rf"^(?:const|function) {name}\b", out, re.M)) == 1, (name, out)
    assert out.index("const NS") < out.index("function inner") < out.index("function b")  # the file's order
    _write(tmp_path, {"one.js": 'import { a } from "./shared.js";\n'})
    just_a = module_source(tmp_path / "one.js")
    assert "function a()" in just_a and "inner" not in just_a and "NS" not in just_a
    if NODE is not None:  # the result runs: what each name needs is there
        (tmp_path / "out.mjs").write_text(out, encoding="utf-8")
        assert _node('import v from "./out.mjs"; console.log(v.render());', tmp_path).strip() == "ns2"


def test_include_refuses_unknown_names_aliases_and_circles(tmp_path: Path) -> None:
    _write(tmp_path, {"shared.js": SHARED, "bad.js": 'import { inner } from "./shared.js";\n',
                      "alias.js": 'import { a as z } from "./shared.js";\n',
                      "x.js": 'import { y } from "./y.js";\nexport function x() {}\n',
                      "y.js": 'import { x } from "./x.js";\nexport function y() {}\n'})
    with pytest.raises(ValueError, match="inner that shared.js does not export"):
        module_source(tmp_path / "bad.js")
    with pytest.raises(ValueError, match="does not export"):
        module_source(tmp_path / "alias.js")
    with pytest.raises(ValueError, match="import circle"):
        module_source(tmp_path / "x.js")


JS = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
# No exact decimal ties (1234.5 to 4 digits): JavaScript rounds them up, Python to even.
NUMBERS = [0.0, 1.0, -1.0, 1024.0, 1234.56, 12345.6, 99994.0, 99999.7, 100000.0, 123456.0, 8.1251e19, -5.136e21,
           0.001, 0.0009999, 0.00123456, 0.000999951, 1.5e-7, -2.5e-4, 3.14159, 0.1 + 0.2, 1e300, 5e-324,
           float("nan"), float("inf"), float("-inf")]


@needs_node
def test_the_helper_writes_numbers_as_the_statistics_do() -> None:
    """dom.js's num is data/stats.py's fmt_number: one rule in every view, Python or JavaScript."""
    script = ("import { num } from './dom.js';\n"
              f"const xs = {json.dumps([repr(v) if math.isfinite(v) else JS[str(v)] for v in NUMBERS])}.map(Number);\n"
              "console.log(JSON.stringify([3, 4, 6].map((d) => xs.map((x) => num(x, d)))));")
    got = json.loads(_node(script, esm_path("dom.js").parent))
    for digits, row in zip([3, 4, 6], got):
        want = [fmt_number(v, digits) for v in NUMBERS]
        assert row == want, [(v, g, w) for v, g, w in zip(NUMBERS, row, want) if g != w]


FAKE_DOM = """
class Node { constructor(tag) { this.tag = tag; this.attrs = {}; this.kids = []; this.on = {}; }
  setAttribute(k, v) { this.attrs[k] = String(v); } addEventListener(k, f) { this.on[k] = f; }
  append(...c) { this.kids.push(...c.map((x) => (x instanceof Node ? x : new Text(String(x))))); } }
class Text extends Node { constructor(t) { super("#text"); this.text = t; } }
globalThis.Node = Node;
globalThis.document = { createElement: (t) => new Node(t), createElementNS: (ns, t) => Object.assign(new Node(t), { ns }) };
const show = (n) => n.tag === "#text" ? n.text : { tag: n.tag, ns: n.ns, attrs: n.attrs, on: Object.keys(n.on), kids: n.kids.map(show) };
"""


@needs_node
def test_the_element_builders_make_text_nodes_and_skip_what_is_not_there() -> None:
    script = FAKE_DOM + """
import { h, s } from './dom.js';
const el = h("div", { class: "card", hidden: true, title: null, "aria-x": false, tabindex: 0, onclick: () => 1 },
  "<b>x</b>", 0, null, false, undefined, ["a", ["b", h("i", {})]]);
const svg = s("text", { x: 4, y: 10 }, "label");
console.log(JSON.stringify([show(el), show(svg)]));
"""
    div, text = json.loads(_node(script, esm_path("dom.js").parent))
    assert div == {"tag": "div", "attrs": {"class": "card", "hidden": "", "tabindex": "0"}, "on": ["click"],
                   "kids": ["<b>x</b>", "0", "a", "b", {"tag": "i", "attrs": {}, "on": [], "kids": []}]}
    assert text == {"tag": "text", "ns": "http://www.w3.org/2000/svg", "attrs": {"x": "4", "y": "10"}, "on": [],
                    "kids": ["label"]}


@needs_node
def test_listen_subscribes_each_event_and_unsubscribes_them_all() -> None:
    script = """
import { listen } from './dom.js';
const on = [], off = [];
const model = { on: (n, f) => on.push([n, f.name]), off: (n, f) => off.push([n, f.name]) };
function draw() {} function onMsg() {}
const stop = listen(model, { "change:a change:b": draw, "msg:custom": onMsg });
const before = off.length;
stop();
console.log(JSON.stringify([on, before, off]));
"""
    on, before, off = json.loads(_node(script, esm_path("dom.js").parent))
    assert on == [["change:a", "draw"], ["change:b", "draw"], ["msg:custom", "onMsg"]]
    assert before == 0 and off == on  # a closed view leaves no handler behind
