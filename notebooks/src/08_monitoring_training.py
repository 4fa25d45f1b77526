# %% [markdown]
# # 08 · Monitoring a training run: *when* it went wrong, then *where*
#
# Debugging tells you why one step is wrong; **monitoring** tells you which step to look at. A
# training cell runs for minutes and prints a loss now and then; when it ends in `nan`, the printout
# says *that* it diverged, not *when* it started, nor which layer went first.
#
# * **`%%monitor loss, opt.param_groups[0]["lr"]`** (torch_nbdebug) runs the cell and, at every
#   `optimizer.step()`, evaluates the expressions and records each layer's gradient norm and
#   update/parameter ratio. In a live notebook the view appears when the cell starts and updates
#   while it runs (a few times a second at most); the final view has smoothing, a log scale and zoom.
#   Alerts mark the curve: a non-finite value, a spike (×10 over the running median), a plateau, a
#   vanishing or exploding layer.
# * **`%%nanwatch`** (notebook 02) then finds *where*: the first op that produced the NaN or Inf.
#
# The run below uses a learning-rate warmup that was never capped: the learning rate grows by 8%
# per step, forever.

# %%
import torch
import torch.nn as nn
import torch.nn.functional as F

%load_ext torch_nbdebug

g = torch.Generator().manual_seed(1)
x = torch.randn(512, 16, generator=g)
y = torch.sin(x.sum(1, keepdim=True))


def make(warmup=lambda step: 1.08 ** step):
    """A small regression MLP, SGD with momentum, and a multiplicative warmup schedule."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    return model, opt, sched


def batch(step):
    i = (step * 64) % 512
    return x[i:i + 64], y[i:i + 64]

# %% [markdown]
# ## 1. The usual way: print the loss every 25 steps

# %%
model, opt, sched = make()
for step in range(150):
    xb, yb = batch(step)
    loss = F.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    if step % 25 == 0:
        print(f"step {step:3d}  loss {loss.item():.4g}")
print(f"final loss: {loss.item()}")

# %% [markdown]
# The loss went down, then up, then `nan`. Somewhere between step 50 and step 75 — but which step,
# and was it the loss, a layer, or the learning rate? The printout cannot say.
#
# ## 2. *When*: `%%monitor`
#
# Same cell, with `%%monitor loss, opt.param_groups[0]["lr"]` on top. In a live notebook watch the
# curves grow while the cell runs; drag across a chart to zoom into steps 50–80, move the
# **smoothing** slider, tick **log scale**, and switch the per-layer chart between *gradient norm*
# and *update / parameter ratio*. Click an alert to zoom to its step. On GitHub you see the static
# figure and the summary.

# %%
%%monitor loss, opt.param_groups[0]["lr"]
model, opt, sched = make()
for step in range(150):
    xb, yb = batch(step)
    loss = F.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()

# %% [markdown]
# Read the alerts in order: the loss **spikes** (more than ten times its running median), at the
# next step every layer's **gradient norm explodes** (above 10³), and a few steps later values become
# **non-finite**. The result is stored as `_monitor` (as `%%nanwatch` stores `_nanwatch`); `history`
# holds the numbers.

# %%
import numpy as np

mon = _monitor
history = mon.history
first = {}
for alert in mon.alerts:
    first.setdefault(alert.kind, alert.step)
print("first step of each alert:", first)
lr = history['opt.param_groups[0]["lr"]']
print(f"learning rate at the spike: {lr[first['spike'] - 1]:.3g}")
finite = np.isfinite(history["loss"])
print(f"the last finite loss: step {history.steps[finite][-1]}, {history['loss'][finite][-1]:.3g}")
assert first["spike"] <= first["exploding"] < first["non-finite"]

# %% [markdown]
# The run broke when the learning rate passed ~1: that is the *when*. The non-finite alert
# says what to do next — *rerun the cell under `%%nanwatch` to find where it was born*.
#
# ## 3. *Where*: `%%nanwatch`
#
# `make()` seeds everything, so the rerun diverges exactly the same way.

# %%
%%nanwatch
model, opt, sched = make()
for step in range(150):
    xb, yb = batch(step)
    loss = F.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()

# %%
birth = _nanwatch.first
print(birth.op, "in iteration", birth.iteration)
assert "mse_loss" in birth.op

# %% [markdown]
# The first Inf is born in the **loss**: the model's outputs reached ~10²⁰ and squaring them
# overflowed float32. `%%nanwatch` also names the cause it sees — the learning rate kept growing —
# and the fix: cap the schedule, lower the learning rate, or clip gradients.
#
# ## 4. The Python twin, and TensorBoard
#
# `with torch_nbdebug.monitor("loss", ...) as mon:` does the same in code. Expressions are looked up
# where `optimizer.step()` is called first (so `loss`, local to `train()`, is found), then where the
# `with` is. `mon.to_tensorboard(logdir)` writes the run as TensorBoard event files — scalars per step,
# per-layer gradient norms and update ratios, the alerts as text (it needs
# `pip install torch_nbdebug[tensorboard]`).

# %%
import tempfile
from pathlib import Path

from torch_nbdebug import monitor


def train(model, opt, sched, steps=150, clip=None):
    for step in range(steps):
        xb, yb = batch(step)
        loss = F.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()


with monitor("loss", every=5) as twin:
    train(*make())
print(f"{len(twin.history)} points (every 5 steps); alerts:", sorted({a.kind for a in twin.alerts}))

logdir = tempfile.mkdtemp(prefix="monitor-")
try:
    twin.to_tensorboard(logdir)  # then: tensorboard --logdir <logdir>
    print("TensorBoard event files:", [p.name.split(".")[0] + "..." for p in Path(logdir).iterdir()])
except ImportError as err:  # TensorBoard is an optional extra
    print(err)

# %% [markdown]
# ## Exercise
#
# A colleague "fixed" the run by clipping the gradient norm to 1.0. Run the cell below under
# `%%monitor loss, opt.param_groups[0]["lr"]` (add the line at its top): does the run still diverge,
# and when? Then fix it for real, so that 150 steps finish with a finite loss below 0.5.

# %%
model, opt, sched = make()
train(model, opt, sched, clip=1.0)
print("final loss:", F.mse_loss(model(x), y).item())

# %% [markdown]
# <details><summary>Solution</summary>
#
# Under `%%monitor` the clipped run shows no exploding layer — clipping caps the gradient norm at
# 1.0 — and no NaN, but the loss **spikes** around step 66 and ends near 10⁵: the learning-rate curve
# keeps growing by 8% per step (20 at step 100), and each clipped step still moves the weights by up
# to `lr × 1.0`. Clipping treats the symptom; the cause is the schedule. Cap the warmup:
#
# ```python
# %%monitor loss, opt.param_groups[0]["lr"]
# model, opt, sched = make(warmup=lambda step: min(1.08 ** step, 5.0))  # lr grows to 0.05, then stays
# train(model, opt, sched)
# final = F.mse_loss(model(x), y).item()
# assert final < 0.5, final
# ```
#
# The monitor then shows a loss that falls and settles, no alert but perhaps a *plateau* at the end,
# and per-layer update ratios around 10⁻³–10⁻², the range usually considered healthy.
# </details>
