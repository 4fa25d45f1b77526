"""Which notebook cell a line is in: ``In [7], line 14`` rather than ``cell line 14`` where IPython knows."""
from __future__ import annotations

import subprocess
import sys
from typing import Any

from torch_nbdebug.data.source import SourceLine
from torch_nbdebug.record.source import cell_number, line_of, running_cell_number


def test_location_names_the_cell_when_its_number_is_known() -> None:
    cell = "/tmp/ipykernel_42/3270359850.py"
    assert str(SourceLine(cell, 14, "<module>", "x = f()", cell=7)) == "In [7], line 14: x = f()"
    assert SourceLine(cell, 14, "forward", cell=7).location == "In [7], line 14 in forward()"
    assert str(SourceLine(cell, 14, "<module>", "x = f()")) == "cell line 14: x = f()"  # number unknown
    assert str(SourceLine("train.py", 3, "step", "y")) == "train.py:3 in step(): y"
    assert SourceLine(cell, 1, cell=7).to_dict()["cell"] == 7  # what the widgets receive


def test_cell_number_of_a_cell_ipython_ran(ipython: Any) -> None:
    ipython.run_cell("from torch_nbdebug.record.source import user_line, running_cell_number\n"
                     "_here = user_line()\n_running = running_cell_number()", store_history=True)
    here, running = ipython.user_ns.pop("_here"), ipython.user_ns.pop("_running")
    count = ipython.execution_count - 1  # the count of the cell that just ran
    assert here.cell == count == running == cell_number(here.filename)
    assert str(here) == f"In [{count}], line 2: _here = user_line()"
    assert cell_number("/some/script.py") is None and line_of("/some/script.py", 1).cell is None
    assert running_cell_number() is None  # a test function is no cell


def test_a_number_the_shell_has_not_reached_is_never_shown(ipython: Any) -> None:
    """IPython counts a cell before running it: code compiled during cell N with the shell's count
    (N + 1) must not be shown as In [N + 1]."""
    name = ipython.compile.cache("pass\n", ipython.execution_count)
    assert cell_number(name) is None
    assert cell_number(ipython.compile.cache("pass  # earlier\n", ipython.execution_count - 1)) == \
        ipython.execution_count - 1


def test_memory_leak_says_which_cell_allocated_it(ipython: Any) -> None:
    """The leak list names the cell the way IPython's traceback does (In [N]), never a wrong one."""
    ipython.run_cell("import torch, torch_nbdebug\n_kept = []", store_history=True)
    result = ipython.run_cell("with torch_nbdebug.memory_timeline() as _tl:\n"
                              "    for _ in range(3):\n        _kept.append(torch.ones(256, 256))",
                              store_history=True)
    assert result.success, result
    count = ipython.execution_count - 1
    timeline = ipython.user_ns.pop("_tl")
    ipython.user_ns.pop("_kept")
    lines = {leak.line for leak in timeline.leaks if leak.line is not None}
    assert {line.cell for line in lines} == {count}, timeline.leaks
    assert any(str(line).startswith(f"In [{count}], line 3: ") for line in lines)

    # The same through %%cudamem: the body of a cell magic is compiled for the cell that runs it.
    ipython.user_ns["_kept"] = []
    result = ipython.run_cell("%%cudamem -o\nfor _ in range(3):\n    _kept.append(torch.ones(256, 256))",
                              store_history=True)
    count = ipython.execution_count - 1
    ipython.user_ns.pop("_kept")
    lines = {leak.line for leak in result.result.leaks if leak.line is not None}
    assert lines and {line.cell for line in lines} == {count}


def test_record_layer_does_not_import_ipython_for_cell_numbers() -> None:
    code = ("import sys\nfrom torch_nbdebug.record.source import line_of, running_cell_number\n"
            "assert line_of('/x/ipykernel_1/2.py', 1).cell is None and running_cell_number() is None\n"
            "assert 'IPython' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_line_label_names_the_cell_or_file_outside_the_current_cell() -> None:
    from torch_nbdebug.data.source import line_label

    cell = "/tmp/ipykernel_42/3270359850.py"
    assert line_label(3, cell, cell=4, here=4) == "line 3"
    assert line_label(3, cell, cell=2, here=4) == "In [2], line 3"
    assert line_label(3, "/home/me/model.py", None, here=4) == "model.py, line 3"
    assert line_label(3, cell, None, here=None) == "line 3"  # no numbers known: as before


def test_nanwatch_card_says_which_cell_a_line_outside_it_is_in(ipython: Any) -> None:
    """The birth in a module defined in an earlier cell: "line 3" there is not line 3 of this cell."""
    ipython.run_cell("import torch\nfrom torch import nn\nclass Normalize(nn.Module):\n"
                     "    def forward(self, x):\n        return x / x.norm(dim=-1, keepdim=True)\n"
                     "model = Normalize()", store_history=True)
    defined = ipython.execution_count - 1
    result = ipython.run_cell("%%nanwatch -o\nx = torch.zeros(2, 3)\ny = model(x)\nz = torch.log(-x - 1)",
                              store_history=True)
    watched = ipython.execution_count - 1
    report = result.result
    ipython.user_ns.pop("model")
    first, last = report.events[0], report.events[-1]
    assert report.summary.cell == watched
    assert report.summary.line_label(first) == f"In [{defined}], line 5"
    assert report.summary.line_label(last) == "line 3"  # in the watched cell itself (its body)
    text = report.text()
    assert f"In [{defined}], line 5: return x / x.norm(dim=-1, keepdim=True)" in text
    assert f"In [{defined}], line 5" in report.html() and ">line 3<" in report.html()
    assert report.widget().report["cell"] == watched
    assert f"NaN born in forward: aten.div.Tensor in model (In [{defined}], line 5)" in text


def test_explain_card_says_which_cell_a_line_outside_it_is_in(ipython: Any) -> None:
    """A shape error raised in a module defined in an earlier cell: the card names that cell."""
    ipython.run_cell("import torch\nfrom torch import nn\nclass Head(nn.Module):\n    def __init__(self):\n"
                     "        super().__init__()\n        self.fc = nn.Linear(8, 2)\n"
                     "    def forward(self, x):\n        return self.fc(x)\nhead = Head()", store_history=True)
    defined = ipython.execution_count - 1
    ipython.run_cell("%%explain\nx = torch.ones(3, 5)\ny = head(x)", store_history=True)
    shown = ipython.execution_count - 1
    diagnosis = ipython.user_ns["_explain"]
    ipython.user_ns.pop("head")
    assert diagnosis.kind == "shape"
    assert diagnosis.here == shown and diagnosis.cell == defined
    assert diagnosis.where_label == f"In [{defined}], line 8"
    assert f"In [{defined}], line 8: return self.fc(x)" in diagnosis.text()
    assert f"In [{defined}], line 8" in diagnosis.html()
    assert diagnosis.to_dict()["where_label"] == f"In [{defined}], line 8"
