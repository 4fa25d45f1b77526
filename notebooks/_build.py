"""Build the teaching notebooks from their reviewable Python sources in ``notebooks/src/``.

Each source is a plain Python file in the "percent" format:

    # %% [markdown]
    # # A title
    # Some *markdown*, every line prefixed with "# ".

    # %%
    x = 1 + 1

    # %% tags=["raises-exception"]
    raise ValueError("a cell that is meant to fail")

``python notebooks/_build.py`` writes ``notebooks/NN_name.ipynb`` for every source;
``--execute`` also runs each notebook top to bottom (nbclient, the ``python3`` kernel of this
environment) so the committed file carries its outputs (figures and static views that GitHub shows).
Names on the command line restrict the build: ``python notebooks/_build.py --execute 01 06``.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
import time
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SOURCES = HERE / "src"
KERNEL = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
# Executing a notebook must stay fast (a course runs them on laptops); CI uses the same limit.
TIMEOUT_S = 300
_MARKER = re.compile(r"^# %%(?P<md> \[markdown\])?(?:\s+tags=(?P<tags>\[.*\]))?\s*$")


def parse(text: str) -> list[nbformat.NotebookNode]:
    """Split a percent-format source into notebook cells (markdown lines lose their ``# `` prefix)."""
    cells: list[nbformat.NotebookNode] = []
    kind, tags, lines = None, [], []  # type: ignore[var-annotated]

    def flush() -> None:
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(_unprefix(line) for line in body.splitlines())
            cells.append(nbformat.v4.new_markdown_cell(body))
        else:
            cell = nbformat.v4.new_code_cell(body)
            if tags:
                cell.metadata["tags"] = list(tags)
            cells.append(cell)

    for line in text.splitlines():
        match = _MARKER.match(line)
        if match:
            flush()
            kind = "markdown" if match["md"] else "code"
            tags = ast.literal_eval(match["tags"]) if match["tags"] else []
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def _unprefix(line: str) -> str:
    if line.startswith("# "):
        return line[2:]
    if line.rstrip() == "#":
        return ""
    raise ValueError(f"markdown line must start with '# ': {line!r}")


def notebook_for(source: Path) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = parse(source.read_text(encoding="utf-8"))
    nb.metadata["kernelspec"] = dict(KERNEL)
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = TIMEOUT_S) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel, in ``notebooks/``; only ``raises-exception`` cells may fail."""
    from nbclient import NotebookClient

    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(HERE)}})
    client.execute()
    return nb


WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _strip_volatile(nb: nbformat.NotebookNode) -> None:
    # Execution timestamps change on every run and make diffs noisy; the outputs are what matter.
    for cell in nb.cells:
        cell.metadata.pop("execution", None)


# A path component, as it appears in tracebacks, pdb listings and the tools' JSON outputs.
_DIRS = r"(?:/[^\s\"'/\\<>()]+)*"
_MACHINE_PATHS = [
    # /any/venv/lib/python3.11/site-packages/torch/... -> .../site-packages/torch/...
    (re.compile(_DIRS + r"/(site-packages|dist-packages)/"), r".../\1/"),
    # IPython kernel cells: /tmp/ipykernel_4242/3270359850.py -> .../ipykernel_4242/3270359850.py
    (re.compile(_DIRS + r"/(ipykernel_\d+)/"), r".../\1/"),
    # the interpreter's standard library: /root/.pyenv/versions/3.11.7/lib/python3.11/ -> .../lib/python3.11/
    (re.compile(_DIRS + r"/lib/(python3\.\d+)/"), r".../lib/\1/"),
]


def neutral_paths(text: str, repo: Path = REPO) -> str:
    """``text`` without this machine's paths: the repository becomes ``.``, a venv's or the system's
    site-packages ``.../site-packages``, kernel cell files ``.../ipykernel_N/...``, the stdlib
    ``.../lib/python3.X`` (a committed notebook shows what every reader would see, not our disk)."""
    for pattern, replacement in _MACHINE_PATHS:  # first: a venv may live inside the repository
        text = pattern.sub(replacement, text)
    return text.replace(str(repo) + "/", "./").replace(str(repo), ".")


_BASE64_MIME = {"image/png", "image/jpeg", "image/gif", "image/webp"}


def _neutral(value: object, repo: Path) -> object:
    if isinstance(value, str):
        return neutral_paths(value, repo)
    if isinstance(value, list):
        return [_neutral(item, repo) for item in value]
    if isinstance(value, dict):
        return {neutral_paths(key, repo): value[key] if key in _BASE64_MIME else _neutral(value[key], repo)
                for key in value}
    return value


def strip_machine_paths(nb: nbformat.NotebookNode, repo: Path = REPO) -> None:
    """Rewrite every output (streams, tracebacks, every text and JSON MIME type; base64 images untouched)
    and the widget state nbclient stores in the notebook's metadata."""
    for cell in nb.cells:
        if "outputs" in cell:
            cell.outputs = [nbformat.from_dict(_neutral(dict(out), repo)) for out in cell.outputs]
    if "widgets" in nb.metadata:
        nb.metadata["widgets"] = nbformat.from_dict(_neutral(dict(nb.metadata["widgets"]), repo))


def keep_static_views(nb: nbformat.NotebookNode, split: bool = True) -> int:
    """Drop live-widget views that come with a static view; return how many were dropped.

    A saved notebook has no kernel behind its widgets. nbconvert (and nbviewer) pick the widget view
    first and, without stored widget state, render it as nothing — hiding the static HTML/SVG that
    torch_nbdebug puts in the same output for exactly this case. Keeping only the static view makes
    the committed notebook readable on GitHub, in nbconvert HTML and in a JupyterLab without a
    running kernel; running the cell again brings the live widget back.
    """
    dropped = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_MIME in data and ({"text/html", "image/svg+xml", "image/png"} & set(data)):
                del data[WIDGET_MIME]
                dropped += 1
    # Figures as their own image/png outputs: every sanitizer keeps those (nbconvert's escapes an <img>
    # inside text/html; front ends prefer text/html over an image/png in the same output).
    from torch_nbdebug.render.bundle import split_figures

    for cell in nb.cells if split else ():
        if cell.cell_type == "code":
            cell.outputs = [nbformat.from_dict(part) for out in cell.outputs for part in split_figures(dict(out))]
    return dropped


def build(names: list[str], run: bool) -> list[Path]:
    written = []
    for source in sorted(SOURCES.glob("[0-9][0-9]_*.py")):
        if names and not any(source.stem.startswith(n) for n in names):
            continue
        nb = notebook_for(source)
        target = HERE / f"{source.stem}.ipynb"
        if run:
            start = time.perf_counter()
            execute(nb)
            _strip_volatile(nb)
            keep_static_views(nb)
            strip_machine_paths(nb)
            print(f"{target.name}: executed in {time.perf_counter() - start:.1f} s", flush=True)
        nbformat.validate(nb)
        nbformat.write(nb, target)
        print(f"{target.name}: {target.stat().st_size / 1024:.0f} KiB, {len(nb.cells)} cells")
        written.append(target)
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="prefixes of notebooks to build (default: all)")
    parser.add_argument("--execute", action="store_true", help="run each notebook and keep outputs")
    args = parser.parse_args(argv)
    return 0 if build(args.names, args.execute) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
