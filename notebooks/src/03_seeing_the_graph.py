# %% [markdown]
# # 03 · Seeing the graph
#
# Every time you compute with tensors that require gradients, PyTorch records **what it did** so it
# can run the chain rule backwards later. That record is the *autograd graph*. Most "why is my
# gradient None / zero / wrong" questions are answered by looking at it.
#
# 1. **What the graph is** — `grad_fn`, `next_functions`, `AccumulateGrad`, saved tensors — walked
#    by hand.
# 2. **torchviz's `make_dot`** — the classic static picture.
# 3. **`%graph`** — the same graph, with parameter names and modules, collapsible, searchable.
# 4. **A custom `autograd.Function`** — where its `backward` sits in the graph, and the order in
#    which backward runs.

# %%
import math
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn
from IPython.display import Image, display

torch.manual_seed(0)
%load_ext torch_nbdebug

# %% [markdown]
# ## 1. The graph, by hand
#
# A two-layer network and a loss. Nothing special — but every operation in the forward pass left a
# node behind:

# %%
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
x = torch.randn(16, 4)
y = torch.randn(16, 1)
loss = ((model(x) - y) ** 2).mean()

print("loss.grad_fn:", loss.grad_fn)
print("its inputs:  ", loss.grad_fn.next_functions)

# %% [markdown]
# * `loss.grad_fn` is the node that **made** `loss`: `MeanBackward0`. Its name says which forward op
#   it undoes (the `0` is a version suffix).
# * `next_functions` are the nodes that made *its* inputs — following them walks the graph from the
#   output back towards the inputs, exactly the route gradients take.
# * A leaf tensor that requires grad (a parameter) ends a path in an **`AccumulateGrad`** node: that
#   is where `backward()` *adds* into `param.grad`. Tensors that do not require grad (`x`, `y`) do
#   not appear at all — `next_functions` holds `None` for them.
#
# A ten-line recursive walk prints the whole graph:

# %%
def walk(node, depth=0, seen=None):
    """Print the autograd graph below `node`, each node once."""
    seen = set() if seen is None else seen
    if node is None or node in seen:
        return seen
    seen.add(node)
    name = type(node).__name__
    if name == "AccumulateGrad":
        name += f"  -> grad of a parameter of shape {tuple(node.variable.shape)}"
    print("  " * depth + name)
    for child, _ in node.next_functions:
        walk(child, depth + 1, seen)
    return seen


nodes_by_hand = walk(loss.grad_fn)
print(len(nodes_by_hand), "nodes")

# %% [markdown]
# Two things the walk shows that surprise people:
#
# * `TBackward0`: `nn.Linear` computes `x @ W.T + b`, so the transpose of the weight is an operation
#   of its own, and `AddmmBackward0` is the fused "add + matrix multiply".
# * Nodes **save** what they need for backward. `PowBackward0` kept its input to compute `2·(model(x)
#   - y)`; those saved tensors are why a forward pass costs memory until `backward()` frees them:

# %%
pow_node = loss.grad_fn.next_functions[0][0]
print(type(pow_node).__name__, "saved:", [a for a in dir(pow_node) if a.startswith("_saved_")])
print("_saved_self.shape =", tuple(pow_node._saved_self.shape), " _saved_exponent =", pow_node._saved_exponent)
assert type(pow_node).__name__ == "PowBackward0" and pow_node._saved_self.shape == (16, 1)

# %% [markdown]
# ## 2. torchviz's `make_dot`
#
# [torchviz](https://github.com/szagoruyko/pytorchviz) turns this walk into a Graphviz drawing.
# Parameters (blue) are labelled with the names you pass in `params`, the output is green, and every
# other box is a backward node. Graphviz's `dot` program does the layout; this environment has no
# system Graphviz, so we hand the DOT text to the `graphviz-pure` wheel's `dot`-compatible binary.

# %%
from torchviz import make_dot

dot_graph = make_dot(loss, params=dict(model.named_parameters()))


def dot_to_png(source: str) -> bytes:
    """Lay out DOT text as a PNG (a picture every notebook viewer shows) with a `dot` on PATH, or the
    one the graphviz-pure wheel installs."""
    binary = shutil.which("dot") or shutil.which("graphviz-pure") or \
        str(Path(sys.executable).with_name("graphviz-pure"))
    return subprocess.run([binary, "-Tpng"], input=source.encode(), capture_output=True,
                          check=True).stdout


display(Image(dot_to_png(dot_graph.source)))
torchviz_boxes = dot_graph.source.count("[label=")
print(torchviz_boxes, "boxes in the torchviz picture")

# %% [markdown]
# This picture is fine at this size. Its limits show on real models: one box per operation (a
# transformer has thousands), no notion of modules, parameter names only if you pass them, and a
# system Graphviz to render it.
#
# ## 3. `%graph`: the same graph, explorable
#
# `%graph <expression>` shows the autograd graph behind any tensor expression. Parameters are named
# the way you would write them (`model.0.weight`), and operations are grouped by the module that made
# them. In a live notebook you can click a module to open or close it, click a node for its details
# (op, shapes, dtypes, saved tensors, gradient statistics), search, pan, zoom and export SVG/PNG/DOT.
# On GitHub you see the static picture that comes with it.

# %%
%graph loss

# %% [markdown]
# `-o` returns the explorer instead of displaying it; `.data` is the plain graph (nodes, edges and
# the module tree), which we can check against the walk by hand and against torchviz: the same
# autograd nodes, each exactly once.

# %%
explorer = %graph -o loss
data = explorer.data
print(data.summary())
ops = {node.op for node in data.ops()}
params = sorted(node.label for node in data.params())
print("ops:", sorted(ops))
print("parameters:", params)
by_hand = {type(n).__name__ for n in nodes_by_hand if type(n).__name__ != "AccumulateGrad"}
assert ops == by_hand
assert len(data.ops()) + len(data.params()) == len(nodes_by_hand)
assert params == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight"]

# %% [markdown]
# For a bare tensor, `%graph` has to **infer** modules from the parameters each op touches (the
# note in the output says so). Run the forward under `%%graph` and every node knows the module that
# really created it — ops outside any module (the loss) stay outside. After `backward()`, nodes and
# parameters carry gradient norms too:

# %%
%%graph
prediction = model(x)
loss = ((prediction - y) ** 2).mean()
loss.backward()
loss

# %% [markdown]
# And `%graph model --input x` runs the model on an example input and shows its graph at module
# level: each module a box with its node count, to open with a click — the view to start from on a
# large network. In a small transformer-like stack the four identical blocks are recognised as one
# repeated group (`blocks.0..3 ×4 Block`).

# %%
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class Net(nn.Module):
    def __init__(self, d=16, depth=4):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, inputs):
        h = self.embed(inputs)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


net = Net()
tokens = torch.randn(2, 5, 8)
%graph net --input tokens

# %%
net_graph = %graph -o net --input tokens
modules = {node.module for node in net_graph.data.ops() if node.module}
print(sorted(m for m in modules if m.count(".") <= 2))
assert "net.blocks.3.mlp.0" in modules and "net.head" in modules

# %% [markdown]
# ## 4. A custom `autograd.Function`: where its backward sits
#
# When you write a `torch.autograd.Function`, autograd cannot look inside your `forward`: the whole
# function becomes **one node** in the graph, named after your class (`LogCoshBackward`), and the
# operations inside `forward` leave no nodes at all (it runs with gradient recording off). During
# `backward()`, when the chain rule reaches that node, autograd calls *your* `backward` with the
# gradient of the output, and passes what you return on to the nodes of the inputs.
#
# `log(cosh(x))`, the robust loss of notebook 07, written as a Function:

# %%
class LogCosh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)  # what our backward needs, kept in the graph node
        return z.abs() + torch.log1p(torch.exp(-2 * z.abs())) - math.log(2.0)

    @staticmethod
    def backward(ctx, grad_out):
        (z,) = ctx.saved_tensors
        return grad_out * torch.tanh(z)


model.zero_grad()
robust_loss = LogCosh.apply(model(x) - y).mean()
display(Image(dot_to_png(make_dot(robust_loss, params=dict(model.named_parameters())).source)))

# %%
%graph robust_loss

# %% [markdown]
# One `LogCoshBackward` box between `SubBackward0` and `MeanBackward0` — no `abs`, `exp` or `log1p`
# nodes inside it. To see *when* its backward runs, hook every node: `node.register_hook(fn)` calls
# `fn` right after that node's backward has run. (Hooks are removed at the end: a forgotten hook
# stays on the graph.)

# %%
def all_nodes(root):
    stack, seen = [root], []
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.append(node)
            stack.extend(child for child, _ in node.next_functions)
    return seen


order, handles = [], []
for node in all_nodes(robust_loss.grad_fn):
    handles.append(node.register_hook(lambda grad_inputs, grad_outputs, node=node:
                                      order.append(type(node).__name__)))
try:
    robust_loss.backward()
finally:
    for handle in handles:
        handle.remove()

print(" -> ".join(order))
assert order.index("MeanBackward0") < order.index("LogCoshBackward") < order.index("SubBackward0")

# %% [markdown]
# Backward runs **output first**: `MeanBackward0` hands `1/N` per element to `LogCoshBackward`,
# which multiplies by `tanh(z)` (our code) and hands the result to `SubBackward0`, and on into the
# model's layers until the `AccumulateGrad` nodes write `.grad`. If a custom backward is wrong,
# that single node is where to look — and `gradcheck` (notebook 07) is how to test it.
#
# ## Summary
#
# * Every op on tensors that require grad leaves a node (`grad_fn`); `next_functions` links it to the
#   nodes that made its inputs; parameters end in `AccumulateGrad`. Nodes save tensors for backward.
# * `make_dot` draws that graph; `%graph` draws it with parameter names and modules, collapses large
#   models, and lets you click, search and export. `%%graph` records the real module of every node.
# * A custom `autograd.Function` is a single node; your `backward` runs when the chain rule reaches
#   it, output first.
# %% [markdown]
# ## Exercise: the encoder that never learns
#
# An encoder and a decoder, trained together. Someone kept the features as NumPy "for a histogram in
# the logs", and the encoder's weights stopped changing. Look at the graph behind `loss` with
# `%graph loss`: which parameters are in it? Fix the cell so that both modules get gradients, and
# keep the NumPy copy for the logs.

# %% tags=["raises-exception"]
torch.manual_seed(0)
encoder, decoder = nn.Linear(4, 8), nn.Linear(8, 1)
inputs = torch.randn(16, 4)
features = encoder(inputs).detach().numpy()  # for a histogram in the logs
loss = decoder(torch.from_numpy(features)).pow(2).mean()
loss.backward()
assert encoder.weight.grad is not None, "the encoder got no gradient: its weights will never change"

# %% [markdown]
# <details><summary>Solution</summary>
#
# `%graph loss` shows only `decoder.weight` and `decoder.bias`: the graph starts at
# `torch.from_numpy(features)`, a new leaf with no history. `.detach()` (needed before `.numpy()`)
# cut the chain back to the encoder, so backward never reaches it. Keep the tensor for the
# computation and take the NumPy copy on the side:
#
# ```python
# torch.manual_seed(0)
# encoder, decoder = nn.Linear(4, 8), nn.Linear(8, 1)
# features = encoder(inputs)
# for_the_logs = features.detach().numpy()  # a copy for the histogram; the graph is untouched
# loss = decoder(features).pow(2).mean()
# loss.backward()
# assert encoder.weight.grad is not None and decoder.weight.grad is not None
# explorer = %graph -o loss
# assert {"encoder.weight", "decoder.weight"} <= {node.label for node in explorer.data.params()}
# ```
#
# </details>
