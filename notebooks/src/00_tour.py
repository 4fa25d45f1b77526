# %% [markdown]
# # 00 · torch_nbdebug in five minutes
#
# torch_nbdebug makes the inside of a PyTorch program visible in the notebook, where you already
# are. One line loads it:
#
# | magic | Python twin | shows |
# |---|---|---|
# | `%%nanwatch` | `with torch_nbdebug.nanwatch() as report:` | where the first NaN/Inf was **born**: op, module, your line, a fix |
# | `%graph` | `torch_nbdebug.graph(loss)` | the computation graph, by module, collapsible and searchable |
# | `%grads`, `%%grads` | `torch_nbdebug.record_gradients(model)` | the gradient stepper: per-layer gradients, flags, flow plot |
# | `%cudamem`, `%%cudamem` | `torch_nbdebug.memory_timeline()` | memory by category over time, the peak, and leaked tensors |
# | `%explain`, `%%explain` | `torch_nbdebug.explain()` | why a PyTorch error happened, at which op, module and line, and the fix |
# | `%%repro` | `torch_nbdebug.repro(fn)` | runs a cell twice from the same state: the first op whose result changed, and why |
# | `%%monitor` | `torch_nbdebug.monitor("loss")` | training curves and per-layer gradient norms, live, with alerts |
# | `%%profile` | `torch_nbdebug.profile()` | why a step is slow: a verdict (data, host, launch, sync, compute, copies), the line and the module |
#
# Every view is a live widget when a kernel runs it, and a static picture in the saved notebook.
# This tour runs on a CPU in under a minute. We debug one small model from start to finish: all eight
# magics, in the order a bad day meets them.

# %%
import torch
import torch.nn as nn
import torch.nn.functional as F

%load_ext torch_nbdebug

# %% [markdown]
# ## A model that goes NaN
#
# A classifier that normalises each input vector to unit length before an MLP. The batch is
# **padded**: its last three rows are zeros, as padding often is.

# %%
class Normalize(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Normalize()
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.encoder(self.norm(x)))


torch.manual_seed(0)
x = torch.randn(32, 16)
x[-3:] = 0.0  # padding rows
y = torch.randint(0, 4, (32,))
model = Classifier()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

for step in range(3):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.4f}")

# %% [markdown]
# `nan` from the first step. The NaN surfaces in the loss, but where does it come from?
#
# ## `%%nanwatch`: where the first NaN was born
#
# `%%nanwatch` runs the cell and watches every operation — forward, backward and the optimizer —
# for the first one that turns finite inputs into NaN or Inf:

# %%
%%nanwatch
model = Classifier()
loss = F.cross_entropy(model(x), y)
loss.backward()

# %% [markdown]
# Not "the loss is NaN" but **where it was born**: `aten.div` in `model.norm`, on the line
# `x / x.norm(...)` — 0/0 on the padding rows — with the statistics of the division's inputs (the
# norm's `min=0`) and the fix. The report stays in `_nanwatch` for code:

# %%
birth = _nanwatch.first
print(birth.phase, birth.op, birth.module, "| line:", birth.line)
assert (birth.phase, birth.op, birth.module) == ("forward", "aten.div.Tensor", "model.norm")

# %% [markdown]
# ## `%graph`: see it in the graph
#
# `%graph model --input x` runs the model once and shows its autograd graph nested by module; the
# node where the last `%%nanwatch` found the birth is marked in red. In a live notebook click a
# module to expand or collapse it, click a node for its shapes, dtypes and saved tensors, search,
# pan, zoom, and export SVG/PNG/DOT. (`%graph loss` works on any tensor expression too.)

# %%
%graph model --input x

# %%
explorer = %graph -o model --input x
marked = [(node.label, node.module) for node in explorer.data.nodes if node.nan]
print("marked:", marked)
assert marked and marked[0][1] == "model.norm"

# %% [markdown]
# ## Fix it, then watch the gradients with the stepper
#
# Guard the denominator (`F.normalize` clamps the norm to `eps`), and train for a few steps under
# `%%grads model`. The gradient stepper records every optimizer step: per layer the gradient norm,
# mean, max, zeros/NaN/Inf counts, a histogram, and the update ratio `‖Δw‖/‖w‖`; flags for
# vanishing, exploding, dead and non-finite gradients; a gradient-flow plot and a layers × steps
# heatmap. Live: prev/next buttons, the slider or the arrow keys move through layers and steps.

# %%
class Normalize(nn.Module):
    def forward(self, x):
        return F.normalize(x, dim=-1, eps=1e-6)


torch.manual_seed(0)
model = Classifier()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

# %%
%%grads model
for step in range(8):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

# %%
trace = %grads -o model
print("loss now:", round(loss.item(), 4), "| layers:", trace.layers)
assert torch.isfinite(loss) and not [f for f in trace.flags if f.kind == "non-finite"]

# %% [markdown]
# ## `%%cudamem`: find the leak
#
# Last, an evaluation loop that slowly eats memory. `%%cudamem` runs the cell and draws its memory
# timeline stacked by category (parameters, gradients, optimizer state, activations saved for
# backward, temporaries), marks the peak, and lists the tensors the cell **leaked** — still alive
# after it — with what holds them. On a machine without CUDA it records CPU tensors and says so.
# Live: drag to zoom into a time range, hover an allocation for its details.

# %%
%%cudamem
val_losses = []
for _ in range(4):
    batch = torch.randn(256, 16)
    val_losses.append(F.cross_entropy(model(batch), torch.randint(0, 4, (256,))))

# %% [markdown]
# `val_losses` holds the loss **tensors**, each with the autograd graph of its forward pass — and
# the activations that graph saved for a backward that never comes. The fix: `.item()`, and
# `torch.no_grad()` for evaluation. The Python twin checks it in code:

# %%
import torch_nbdebug

with torch_nbdebug.memory_timeline() as leaky:
    val_losses = [F.cross_entropy(model(torch.randn(256, 16)), torch.randint(0, 4, (256,))) for _ in range(4)]
with torch.no_grad(), torch_nbdebug.memory_timeline() as fixed:
    val_losses = [F.cross_entropy(model(torch.randn(256, 16)), torch.randint(0, 4, (256,))).item()
                  for _ in range(4)]
print("before:", [(leak.holder, leak.count, leak.has_graph) for leak in leaky.leaks])
print("after: ", fixed.leaks)
held = {leak.holder: leak for leak in leaky.leaks}
assert list(held) == ["val_losses"] and held["val_losses"].has_graph  # the graphs' saved tensors too
assert not fixed.leaks

# %% [markdown]
# ## `%%explain`: why this error, and where
#
# Once the extension is loaded, every PyTorch error gets one paragraph under its traceback. `%%explain`
# runs a cell with a light recorder and, when it raises, shows the full card — the kind of error, the
# op, the module as you write it, your line, the operands and the fix — and re-raises your exception
# unchanged. (`%explain` on its own line shows the card for the last error, like `%debug`.) Here a new
# head expects 32 features where the encoder makes 64:

# %% tags=["raises-exception"]
%%explain
head = nn.Linear(32, 4)  # the encoder's last layer makes 64 features
logits = head(model.encoder(model.norm(x)))

# %%
print(_explain.kind, "|", _explain.module, "|", _explain.summary)
assert _explain.kind == "shape"

# %% [markdown]
# ## `%%repro`: same seed, different results — which op?
#
# `%%repro` runs the cell **twice from the same starting state** (model, optimizer and, unless
# `--no-restore-rng`, the random generators) and compares the runs op by op. Here dropout draws fresh
# random numbers in each run because the generators are not restored: the report names the op, its
# module and line, the cause (`rng`) and the fix. Afterwards the state is as if the cell ran once.

# %%
%%repro --no-restore-rng
loss = F.cross_entropy(F.dropout(model(x), p=0.2), y)
optimizer.zero_grad()
loss.backward()
optimizer.step()

# %%
print("identical:", _repro.identical, "| cause:", _repro.cause, "| first op:", _repro.first.op)
assert not _repro.identical and _repro.cause == "rng"

# %% [markdown]
# ## `%%monitor`: training curves, live
#
# `%%monitor` evaluates its expressions at every optimizer step and draws them live while the cell runs,
# with each layer's gradient norm and update ratio; alerts (a non-finite value, a spike, a plateau, a
# vanishing or exploding layer) are drawn on the curve and listed. The record stays in `_monitor`.

# %%
%%monitor loss, optimizer.param_groups[0]["lr"]
for step in range(30):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

# %%
losses = _monitor["loss"]
print(f"{len(losses)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}; alerts: {len(_monitor.alerts)}")
assert len(losses) == 30 and losses[-1] < losses[0]

# %% [markdown]
# ## `%%profile`: why is my step slow?
#
# `%%profile` runs the cell under `torch.profiler` and answers with a **verdict** — data, host, launch,
# sync, compute or copies — its share of the step, the **statement line** and the **module**, and the fix.
# Here each sample is "decoded" in Python when the DataLoader asks for it.

# %%
import math

class Decoded(torch.utils.data.Dataset):
    """Each sample is "decoded" in Python when it is asked for."""
    def __len__(self):
        return 256
    def __getitem__(self, i):
        row = [math.sin(i * k) for k in range(20000)]  # the slow line
        return torch.tensor(row[:16]), torch.tensor(row[16:18])

loader = torch.utils.data.DataLoader(Decoded(), batch_size=32)
net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.01)

# %%
%%profile
for xb, yb in loader:
    opt.zero_grad()
    F.mse_loss(net(xb), yb).backward()
    opt.step()

# %% [markdown]
# The step is **data-bound**, and the line is the decoding in `__getitem__`. Decode once, reuse the
# batches, and compare the two profiles: which category got faster, and whether the verdict changed.

# %%
slow = _profile
batches = list(loader)  # decode once, reuse every epoch
with torch_nbdebug.profile() as fast:
    for xb, yb in batches:
        opt.zero_grad()
        F.mse_loss(net(xb), yb).backward()
        opt.step()
assert slow.verdict.kind == "data" and fast.verdict.kind != "data"
fast.compare(slow)

# %% [markdown]
# ## Where next
#
# The teaching notebooks go deeper, one debugging skill each:
#
# * **01 · Reading errors** — stack traces, the CUDA device-side assert, `%debug` post-mortem.
# * **02 · Hunting NaNs** — `detect_anomaly` versus `%%nanwatch` on three classic bugs.
# * **03 · Seeing the graph** — autograd nodes by hand, torchviz, `%graph`, custom Functions.
# * **04 · Watching gradients** — hooks, vanishing/exploding, dead ReLUs, the update ratio.
# * **05 · Memory** — allocated vs reserved, leaks, re-created models, `empty_cache`.
# * **06 · Reproducibility and numerics** — seeds, determinism, epsilons, mixed precision.
# * **07 · Code that debugs itself** — assertions, `assert_close`, `gradcheck`, structured logs.
# * **08 · Monitoring training** — a run that diverges: *when* with `%%monitor`, *where* with `%%nanwatch`.
# * **09 · Finding slow steps** — a data-bound step, then a launch-bound one, fixed and compared with `%%profile`.
#
# Every magic has help: `%nanwatch?`, `%graph?`, `%grads?`, `%cudamem?`, `%explain?`, `%repro?`, `%monitor?`, `%profile?`.
# %% [markdown]
# ## Exercise: a NaN in attention
#
# An attention-style cell: scores, a padding mask, a softmax, a weighted sum. Row 3 of the batch is
# all padding. The output is `nan` — find where the NaN is **born** with the tools of this tour, and
# fix the cell so that `out` and `scores.grad` are finite. (Hint: put `%%nanwatch` on the first line.)

# %%
torch.manual_seed(0)
scores = torch.randn(4, 6, requires_grad=True)
padding = torch.zeros(4, 6, dtype=torch.bool)
padding[:, 4:] = True  # the last two positions of every row are padding
padding[3] = True      # row 3 is padding only
weights = torch.softmax(scores.masked_fill(padding, float("-inf")), dim=-1)
out = (weights @ torch.randn(6, 8)).sum()
out.backward()
print("out:", out.item())

# %% [markdown]
# <details><summary>Solution</summary>
#
# `%%nanwatch` names the birth: `aten._softmax` in forward, on the `weights = ...` line. A row whose
# every score is `-inf` has no maximum to subtract: softmax computes `exp(-inf - (-inf))`, which is
# NaN, and the NaN flows into `out` and back into the gradients. Mask with the most negative
# *finite* number instead (a fully padded row then gets uniform weights), or drop fully padded rows
# before the softmax.
#
# ```python
# %%nanwatch
# torch.manual_seed(0)
# scores = torch.randn(4, 6, requires_grad=True)
# padding = torch.zeros(4, 6, dtype=torch.bool)
# padding[:, 4:] = True
# padding[3] = True
# weights = torch.softmax(scores.masked_fill(padding, torch.finfo(scores.dtype).min), dim=-1)
# out = (weights @ torch.randn(6, 8)).sum()
# out.backward()
# ```
#
# ```python
# assert torch.isfinite(out) and torch.isfinite(scores.grad).all()
# assert _nanwatch.first is None  # no birth any more
# ```
#
# </details>
