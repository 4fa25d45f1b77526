"""``%graph`` and ``%%graph``: IPython glue over :mod:`torch_nbdebug.api.graph`."""
from __future__ import annotations

import ast
from typing import Any, Optional

import torch
from IPython.core.error import UsageError
from IPython.core.magic import line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display
from torch import nn

from torch_nbdebug.api.graph import GraphExplorer, check_max_nodes, graph as graph_api, record_graph
from torch_nbdebug.errors import InputError
from torch_nbdebug.magics._common import CellBody, ToolMagics, evaluate, parse_args, require_body, usage_errors
from torch_nbdebug.record.graph import DEFAULT_MAX_NODES


@magics_class
class GraphMagics(ToolMagics):
    @magic_arguments()
    @argument("-o", "--output", action="store_true",
              help="return the explorer instead of displaying it (g = %%graph -o loss; g.data is the plain graph)")
    @argument("--input", "-i", nargs="+", metavar="EXPR",
              help="example inputs, comma-separated: %%graph model --input x shows the module-level graph of model(x)")
    @argument("--saved", action="store_true", help="list the tensors each node saved for backward (shapes only)")
    @argument("--expand", default=None, metavar="HOW",
              help="which groups open first: auto (default), modules, all, or comma-separated module paths")
    @argument("--max-nodes", type=int, default=DEFAULT_MAX_NODES, help="stop walking after this many nodes")
    @argument("expression", nargs="*",
              help="a tensor expression (%%graph loss, %%graph model(x).sum()) or a model with --input")
    @line_cell_magic
    def graph(self, line: str, cell: Optional[str] = None) -> Any:
        """Explore a computation graph: modules collapse and expand, nodes show op, shapes and grads.

        %graph loss                 the autograd graph behind a tensor expression
        %graph model --input x      the module-level graph of model(x)
        %%graph                     record the forward in the cell: every node knows its module
        """
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        args = parse_args(self.graph, line)
        try:
            check_max_nodes(args.max_nodes)
        except InputError as exc:
            raise UsageError(f"%graph --max-nodes {args.max_nodes}: {exc}") from None
        expand = _expand(args.expand)
        try:
            if cell is not None:
                result = self._cell(require_body(cell, "graph"), args, expand)
            else:
                result = self._line(" ".join(args.expression), args, expand)
        except InputError as exc:
            raise usage_errors(exc) from None
        if args.output:
            return result
        display(result)
        return None

    def _line(self, expression: str, args: Any, expand: Any) -> GraphExplorer:
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        if not expression.strip():
            raise UsageError("%graph needs a tensor expression (%graph loss) or a model and --input")
        ns = self.user_ns
        if args.input:
            model = evaluate(self.shell, expression, "%graph")
            if not issubclass(type(model), nn.Module):
                raise UsageError(f"%graph {expression} --input ...: `{expression}` is a {type(model).__name__}, "
                                 f"not an nn.Module; drop --input to graph a tensor expression")
            # tokens were split at spaces: rejoin them and read "x, y" or "torch.ones(3, 5)" as a tuple
            inputs = evaluate(self.shell, f"({' '.join(args.input)},)", "%graph --input")
            return graph_api(model, *inputs, names=ns, saved=args.saved, expand=expand, max_nodes=args.max_nodes)
        with record_graph(names=ns) as rec:  # so %graph model(x).sum() knows every node's module
            try:
                value = evaluate(self.shell, expression, "%graph")
            except UsageError:
                raise
            except Exception as exc:
                raise UsageError(f"%graph: evaluating `{expression}` raised {type(exc).__name__}: {exc}") from None
        if issubclass(type(value), nn.Module):
            raise UsageError(f"%graph {expression}: `{expression}` is a model; give it example inputs: "
                             f"%graph {expression} --input x")
        _check_tensor(value, expression)
        return rec.graph(value, saved=args.saved, expand=expand, max_nodes=args.max_nodes, title=expression)

    def _cell(self, cell: str, args: Any, expand: Any) -> GraphExplorer:
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        body = CellBody(self.shell, cell, "graph")  # a bad cell is a UsageError before recording
        rec = record_graph(names=self.user_ns)
        try:
            with rec:
                value = body.run()  # the user's exception propagates unchanged
        except BaseException:
            _show_partial(rec, args, expand)  # an error or Stop: show what ran, like the other magics
            raise
        if not _has_graph(value):  # a cell that only assigns (``loss = net(x).sum()``): its last graph tensor
            value = _last_assigned_graph(cell, self.user_ns)
        if value is not None:
            return rec.graph(value, saved=args.saved, expand=expand, max_nodes=args.max_nodes)
        return rec.graph(saved=args.saved, expand=expand, max_nodes=args.max_nodes)


def _expand(text: Optional[str]) -> Any:
    if text is None or text in ("auto", "modules", "all"):
        return text
    return [part.strip() for part in text.split(",") if part.strip()]


def _show_partial(rec: Any, args: Any, expand: Any) -> None:
    """Display the graph of the top-level modules that ran before the cell failed, if any is alive."""
    try:
        if not rec.outputs():
            return
        partial = rec.graph(saved=args.saved, expand=expand, max_nodes=args.max_nodes)
    except Exception:  # noqa: BLE001 - the user's exception is the one to see, not ours
        return
    display(partial)


def _last_assigned_graph(cell: str, namespace: Any) -> Any:
    """The tensor with a graph that the cell's last top-level assignment to a plain name left in the
    namespace (``loss = net(x).sum()`` or ``out = net(x); loss = ce(out, y)``: ``loss``), else None."""
    try:
        statements = ast.parse(cell).body
    except SyntaxError:  # (IPython syntax in the cell: its module outputs are graphed instead)
        return None
    targets = [t for node in statements if isinstance(node, ast.Assign) for t in node.targets] + \
        [node.target for node in statements if isinstance(node, (ast.AugAssign, ast.AnnAssign))]
    targets.sort(key=lambda t: (t.lineno, t.col_offset))  # in the cell's order
    names = [t.id for t in targets if isinstance(t, ast.Name)]
    for name in reversed(names):
        try:
            value = namespace.get(name)
        except Exception:  # noqa: BLE001 - a strange namespace: no graph from it
            return None
        if _has_graph(value):
            return value
    return None


def _has_graph(value: Any) -> bool:
    items = value if issubclass(type(value), (tuple, list)) else [value]
    return any(issubclass(type(t), torch.Tensor) and t.grad_fn is not None for t in items)


def _check_tensor(value: Any, expression: str) -> None:
    """`%graph` needs a tensor with a grad_fn: say which of the two is missing, and what to do."""
    items = value if issubclass(type(value), (tuple, list)) else [value]  # type(): proxies may raise
    tensors = [t for t in items if issubclass(type(t), torch.Tensor)]
    if not tensors:
        raise UsageError(f"%graph needs a tensor with a grad_fn or an nn.Module; `{expression}` is a "
                         f"{type(value).__name__}")
    if not any(t.grad_fn is not None for t in tensors):
        t = tensors[0]
        why = "is a leaf tensor (nothing computed it)" if t.requires_grad else \
            "does not require grad (made under torch.no_grad(), or from tensors that do not require grad)"
        raise UsageError(f"%graph: `{expression}` has no grad_fn: it {why}; graph a result computed from "
                         f"parameters or requires_grad=True inputs, e.g. %graph model(x).sum()")


MAGICS = GraphMagics
