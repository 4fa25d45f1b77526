# %% [markdown]
# # 02 · Hunting NaNs
#
# A NaN does not raise. It spreads: one NaN in a loss makes every gradient NaN, one optimizer step
# makes every weight NaN, and from then on the loss prints `nan` forever. By the time you notice,
# the place where it was **born** — the first operation that turned finite numbers into NaN or Inf —
# is long gone. This notebook hunts three classic births with two tools, side by side:
#
# * **`torch.autograd.detect_anomaly()`** — PyTorch's built-in: checks the *backward* pass and raises
#   at the first backward function that returns NaN, printing the forward traceback of its op.
# * **`%%nanwatch`** (torch_nbdebug) — watches forward, backward and `optimizer.step()`, and reports
#   the first op that turned finite inputs into NaN **or Inf**, with its module, your line, the
#   statistics of its inputs, and a likely fix.
#
# The bugs: `log(0)` in a hand-written loss, an in-place operation in a custom activation that
# silently corrupts the graph, and the `torch.where` gradient trap.

# %%
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

%load_ext torch_nbdebug
# detect_anomaly warns that it is slow every time it is entered; we know.
warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")


def with_detect_anomaly(run):
    """Call `run()` under detect_anomaly; print its error and the notebook lines of its forward traceback.

    Anomaly mode prints the forward traceback as a warning, from the kernel's event loop down to
    torch's own modules; we keep the frames that are cells of this notebook and the innermost frame.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly():
                run()
        except RuntimeError as err:
            print("detect_anomaly raised:", err)
            error = str(err)
        else:
            print("detect_anomaly: nothing found")
            error = ""
    for warning in caught:
        text = str(warning.message)
        if "Traceback of forward call" not in text:
            continue
        lines = text.split("Traceback of forward call that caused the error:")[1].splitlines()
        frames = [(lines[i].strip(), lines[i + 1].strip()) for i in range(len(lines) - 1)
                  if lines[i].strip().startswith("File ")]
        mine = [f for f in frames if "ipykernel" in f[0] and "site-packages" not in f[0]]
        print("forward traceback, notebook frames and the innermost one:")
        for where, code in mine + ([frames[-1]] if frames and frames[-1] not in mine else []):
            print("   ", where.split(",")[-1].strip() if "ipykernel" in where else where, "->", code)
    return error

# %% [markdown]
# ## 1. A loss that will not go down
#
# A small classifier on a 2-D toy problem, with binary cross-entropy written by hand, and a bold
# learning rate. Watch the loss:

# %%
torch.manual_seed(0)
points = torch.randn(256, 2)
labels = (points.sum(dim=1, keepdim=True) > 0).float()


def bce(p, y):
    """Binary cross-entropy, the textbook formula."""
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def fresh_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=2.0)


model, optimizer = fresh_run()
history = []
for step in range(20):
    p = torch.sigmoid(model(points))
    loss = bce(p, labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    history.append(round(loss.item(), 3))
print(history)
print("first weight is NaN now:", torch.isnan(model[0].weight).any().item())
assert history[5] < history[0] and history[-1] != history[-1]  # it learned, then became NaN

# %% [markdown]
# The loss went down nicely, then became `nan` at one step and stayed there: the NaN reached the
# gradients, `optimizer.step()` wrote it into every weight, and nothing can recover. Checking
# `torch.isnan(loss)` tells you *that* it happened, not *where*.
#
# ### Tool 1: `detect_anomaly`
#
# Run the same training under `torch.autograd.detect_anomaly()`. It makes every backward function
# check its output for NaN, and raises at the first one, after printing (as a warning, on stderr)
# the traceback of the forward call that created that function:

# %%
def train_with_handwritten_bce():
    global step
    for step in range(20):
        p = torch.sigmoid(model(points))
        loss = bce(p, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


model, optimizer = fresh_run()
anomaly = with_detect_anomaly(train_with_handwritten_bce)
print("stopped at step", step)
assert "LogBackward0" in anomaly

# %% [markdown]
# It found it: `LogBackward0`, and the forward traceback (trimmed here to the notebook's frames by
# `with_detect_anomaly`, defined at the top) ends at the line of `bce`.
# Which of the two logs, and why, you work out from there. Note what it needed: the loop wrapped,
# every backward slowed down, and it stopped the run by raising.
#
# ### Tool 2: `%%nanwatch`
#
# `%%nanwatch` runs the cell and watches every operation. The report opens on the **first birth**:
# where, what, why, and the fix. Below the card: per-layer statistics and every birth in order.

# %%
%%nanwatch
model, optimizer = fresh_run()
for step in range(20):
    p = torch.sigmoid(model(points))
    loss = bce(p, labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

# %% [markdown]
# The report is also a Python object: the magic stores it as `_nanwatch` (and `%%nanwatch -o`
# returns it). The first birth is an **Inf**, born in the forward pass, at `torch.log`, in the
# iteration where the loss first went bad:

# %%
first = _nanwatch.first
print(first.phase, first.op, first.kind, "iteration", first.iteration, "line", first.lineno)
print("hint:", first.hint)
for event in _nanwatch.events:
    print(f"  {event.phase:>9}  {event.kind:>3}  {event.op}")
assert (first.phase, first.op, first.kind) == ("forward", "aten.log.default", "inf")
assert first.iteration == history.index(next(h for h in history if h != h)) + 1  # the step where loss went NaN
assert "torch.log(1 - p)" in first.line or "torch.log(p)" in first.line

# %% [markdown]
# The story, in the order the report lists it:
#
# 1. The weights grew until, for one easy example, `sigmoid` returned **exactly 1.0** (float32 cannot
#    represent `1 - 1e-8`). `1 - p` is 0 and `log(1 - p)` is **-inf** — the birth (an Inf, which
#    `detect_anomaly` does not look for).
# 2. That example's label is 1, so the term is `(1 - y) · log(1 - p) = 0 · (-inf)` = **NaN** — the
#    loss is NaN.
# 3. In backward, `LogBackward0` computes `grad / (1 - p)` = `0 / 0` = NaN — where `detect_anomaly`
#    stopped.
#
# **The fix** is not a smaller learning rate; it is to never take the log of a probability. Keep
# logits and use the fused, stable loss (it computes `log(sigmoid(z))` as `-softplus(-z)`, exact
# for any `z`), or clamp:

# %%
%%nanwatch -q
model, optimizer = fresh_run()
for step in range(20):
    loss = F.binary_cross_entropy_with_logits(model(points), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

# %%
print("final loss:", loss.item(), "| births found:", len(_nanwatch.events))
assert torch.isfinite(loss) and _nanwatch.first is None

# %% [markdown]
# The same weights grow as before; the loss stays finite and nothing is born. (`-q` skips
# displaying the report; it is still stored in `_nanwatch`.)
#
# ## 2. The in-place operation in a custom activation
#
# Autograd keeps, for many operations, a tensor it needs for backward — `sqrt` keeps its **output**,
# because `d sqrt(u)/du = 1 / (2·sqrt(u))`. If you modify such a tensor in place, the backward uses
# the modified values. PyTorch guards against this with a **version counter** on every tensor: an
# in-place op bumps it, and backward refuses to use a saved tensor whose version changed.
#
# A custom activation: a smooth `|x|` with a "dead zone" that zeroes small outputs, written the way
# many people first write it — in place:

# %%
class DeadZoneAbs(nn.Module):
    def forward(self, x):
        out = torch.sqrt(x * x + 1e-4)  # smooth |x|: finite gradient everywhere
        out[out < 0.05] = 0.0           # dead zone, in place
        return out


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), DeadZoneAbs(), nn.Linear(16, 1))
features, targets = torch.randn(32, 8), torch.randn(32, 1)

# %% tags=["raises-exception"]
F.mse_loss(net(features), targets).backward()

# %% [markdown]
# That is the **loud** version, and the message says it all: a tensor that `SqrtBackward0` saved
# (its output 0) is at version 1, expected version 0 — something modified it in place after it was
# saved. Its hint, *enable anomaly detection*, would print the forward traceback of `sqrt`.
#
# Now the dangerous part. Search for this error and you will find advice to "use `.data`" — which
# hides the write from the version counter. The error disappears. The bug does not:

# %%
class DeadZoneAbsSilent(nn.Module):
    def forward(self, x):
        out = torch.sqrt(x * x + 1e-4)
        out.data[out.data < 0.05] = 0.0  # .data: autograd does not see this write
        return out


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), DeadZoneAbsSilent(), nn.Linear(16, 1))
loss = F.mse_loss(net(features), targets)
loss.backward()
print("loss:", loss.item(), "| NaN in net[0].weight.grad:", torch.isnan(net[0].weight.grad).sum().item(),
      "of", net[0].weight.grad.numel())
assert torch.isfinite(loss) and torch.isnan(net[0].weight.grad).any()

# %% [markdown]
# A finite loss, and NaN gradients for the first layer. `SqrtBackward0` divides by its saved output —
# which we set to **0** behind autograd's back — so its gradient is `inf`. Side by side:

# %%
net.zero_grad()
anomaly = with_detect_anomaly(lambda: F.mse_loss(net(features), targets).backward())
assert "AddmmBackward0" in anomaly  # it blames the first Linear layer...

# %% [markdown]
# `detect_anomaly` blames `AddmmBackward0` — the first `nn.Linear` (its forward traceback ends in
# `linear.py`). That is where the first **NaN** appeared, when `inf` gradients met
# weights of both signs in a matrix product (`inf - inf`). The activation produced an **Inf**, which
# anomaly mode does not check. Now `%%nanwatch`:

# %%
%%nanwatch
net.zero_grad()
F.mse_loss(net(features), targets).backward()

# %%
first = _nanwatch.first
print(first.phase, first.op, "| module:", first.module, "| forward op:", first.forward_op,
      "| line:", first.line)
assert first.phase == "backward" and first.op == "SqrtBackward0" and first.module == "net.1"

# %% [markdown]
# `%%nanwatch` names the backward node `SqrtBackward0`, the forward op that created it, the module
# `net.1` (our activation, not the Linear after it) and the line `torch.sqrt(...)`. Its hint reads
# "the gradient of sqrt at 0 is infinite" — and the input statistics in the card show why it was
# at 0: the saved output has `min=0`, although `sqrt(x² + 1e-4)` is never below 0.01. Something
# wrote zeros into it: the `.data` line.
#
# **The fix**: no in-place writes to tensors autograd may have saved, and never `.data`. Build the
# result out of place; the gradient in the dead zone is then exactly 0, as intended:

# %%
class DeadZoneAbsFixed(nn.Module):
    def forward(self, x):
        out = torch.sqrt(x * x + 1e-4)
        return out.masked_fill(out < 0.05, 0.0)  # a new tensor: the saved output stays intact


net[1] = DeadZoneAbsFixed()
net.zero_grad()
F.mse_loss(net(features), targets).backward()
assert torch.isfinite(net[0].weight.grad).all()
print("gradients finite:", torch.isfinite(net[0].weight.grad).all().item())

# %% [markdown]
# ## 3. The `torch.where` gradient trap
#
# "Take the log where it is defined, 0 elsewhere" is one line:
# `torch.where(a > 0, torch.log(a), 0)`. The forward is perfect: the `-inf` of `log(0)` is thrown
# away. But autograd computes the gradient of **both** branches and multiplies the unused one by
# 0 — and at `a = 0` that is `0 · (1/0)` = `0 · inf` = NaN.
#
# Count data (word counts, event counts) is full of exact zeros. A layer that takes the log of
# counts scaled by a learnable weight:

# %%
class LogCounts(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, counts):
        a = counts * self.scale
        return torch.where(a > 0, torch.log(a), torch.zeros_like(a))


torch.manual_seed(0)
counter = nn.Sequential(LogCounts(6), nn.Linear(6, 1))
counts = torch.randint(0, 4, (16, 6)).float()  # about a quarter of the entries are exactly 0

out = counter(counts).sum()
out.backward()
print("forward:", out.item(), "| scale.grad:", counter[0].scale.grad)
assert torch.isfinite(out) and torch.isnan(counter[0].scale.grad).all()

# %%
counter.zero_grad()
anomaly = with_detect_anomaly(lambda: counter(counts).sum().backward())
assert "LogBackward0" in anomaly

# %%
%%nanwatch
counter.zero_grad()
counter(counts).sum().backward()

# %%
first = _nanwatch.first
print(first.phase, first.op, "| module:", first.module, "| line:", first.line,
      "\nthrown away in forward:", [e.op for e in _nanwatch.absorbed])
assert (first.phase, first.op, first.module) == ("backward", "LogBackward0", "counter.0")
assert "where" in first.hint.lower()

# %% [markdown]
# Here both tools find `LogBackward0` and its line — this NaN is born in backward, which is what
# anomaly mode checks. `%%nanwatch` adds the module (`counter.0`) and the diagnosis: the forward
# `log` produced `-inf` that `torch.where` threw away (listed under *thrown away*), and its hint
# names the trap.
#
# **The fix** is the "double where": make the unused branch safe *before* the op, so nothing
# infinite is ever computed:

# %%
class LogCountsSafe(LogCounts):
    def forward(self, counts):
        a = counts * self.scale
        positive = a > 0
        safe = torch.where(positive, a, torch.ones_like(a))  # log(1) = 0, gradient 1: harmless
        return torch.where(positive, torch.log(safe), torch.zeros_like(a))


counter[0].__class__ = LogCountsSafe  # same parameters, new forward
counter.zero_grad()
counter(counts).sum().backward()
assert torch.isfinite(counter[0].scale.grad).all()
print("scale.grad:", counter[0].scale.grad)

# ## 4. What neither `backward` check can see
#
# Validation runs under `torch.no_grad()` and in `eval()` mode: there is no backward pass, so
# `detect_anomaly` has nothing to check, and a NaN validation metric goes unnoticed until someone
# reads the dashboard. Take the model trained in section 1 with `binary_cross_entropy_with_logits`
# — a healthy model, whose logits are large, as confident models' are — and compute the validation
# loss with the hand-written `bce`:

# %%
def validate():
    model.eval()
    try:
        with torch.no_grad():
            return bce(torch.sigmoid(model(points)), labels)
    finally:
        model.train()


_ = with_detect_anomaly(validate)

# %%
%%nanwatch
val_loss = validate()

# %%
first = _nanwatch.first
print("validation loss:", val_loss.item(), "| first birth:", first.phase, first.op, first.kind)
assert (first.phase, first.op, first.kind) == ("forward", "aten.log.default", "inf")

# %% [markdown]
# `detect_anomaly` has nothing to say (no backward ran); `%%nanwatch` finds the same `log(0)` as in
# section 1, in forward, under `no_grad`. The fix is the same too: compute validation metrics from
# logits with the stable functions.
#
# ## Summary
#
# | | `detect_anomaly` | `%%nanwatch` |
# |---|---|---|
# | NaN born in backward | ✔ raises at the backward function | ✔ backward node *and* its forward op, module, line |
# | Inf (overflow, `log(0)`, `1/0`) | ✘ checks NaN only | ✔ |
# | Born in forward (NaN loss, finite grads) | only once it turns into a backward NaN | ✔ the forward op |
# | under `no_grad` / `eval` | ✘ no backward | ✔ |
# | in `optimizer.step()` | ✘ | ✔ names the parameter and the step |
# | how it reports | raises, stops the run | a report (and `--raise` if you want to stop) |
#
# * Births, not symptoms: the first non-finite value is where the fix goes.
# * Never take `log` of a probability: keep logits, use `*_with_logits`, `log_softmax`, `cross_entropy`.
# * Never `.data` (and no in-place writes to tensors autograd saved): the error it silences was right.
# * `torch.where` does not protect gradients: make the unused branch safe *inside* the where.
# %% [markdown]
# ## Exercise: binary cross-entropy by hand
#
# A binary classifier's loss, written out from the textbook formula. One logit is large (40: the
# model is very sure, and wrong). The loss is `inf` and the gradients are NaN. Find the first
# non-finite value with `%%nanwatch` (does `detect_anomaly` see it?), then fix the loss so that it is
# finite and its gradient too — for any logits.

# %%
logits = torch.tensor([[0.5], [-1.0], [40.0]], requires_grad=True)
labels = torch.tensor([[1.0], [0.0], [0.0]])
p = torch.sigmoid(logits)
bce = -(labels * torch.log(p) + (1 - labels) * torch.log(1 - p)).mean()
bce.backward()
print("loss:", bce.item(), "| grad:", logits.grad.flatten().tolist())

# %% [markdown]
# <details><summary>Solution</summary>
#
# `%%nanwatch` names the birth: `aten.log` in forward, an `inf` on the `bce = ...` line. In float32
# `sigmoid(40.0)` is exactly `1.0`, so `1 - p` is 0 and `log(0)` is `-inf`; in backward `1/(1-p)`
# meets a zero and the gradient becomes NaN. The forward-born Inf is invisible to `detect_anomaly`
# until it turns into a NaN in backward. Never take the log of a probability: compute the loss from
# the logits with `F.binary_cross_entropy_with_logits`, which uses `log(1 + e^x)` in a form that
# cannot overflow.
#
# ```python
# %%nanwatch
# logits = torch.tensor([[0.5], [-1.0], [40.0]], requires_grad=True)
# labels = torch.tensor([[1.0], [0.0], [0.0]])
# bce = F.binary_cross_entropy_with_logits(logits, labels)
# bce.backward()
# print("loss:", bce.item(), "| grad:", logits.grad.flatten().tolist())
# ```
#
# ```python
# assert torch.isfinite(bce) and torch.isfinite(logits.grad).all() and _nanwatch.first is None
# ```
#
# </details>
