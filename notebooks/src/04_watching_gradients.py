# %% [markdown]
# # 04 · Watching gradients
#
# A network learns through its gradients, layer by layer. When training stalls, the question is
# usually *which layer stopped receiving a useful gradient, and why*. This notebook shows how to look:
#
# 1. **`register_hook` by hand** — the mechanism everything else is built on.
# 2. **`%grads`: the gradient stepper** — every layer's gradient statistics, histograms and flags,
#    one click (or arrow key) per layer.
# 3. **Vanishing and exploding gradients** — what they look like in the gradient-flow view, and the
#    fixes (activation, initialisation).
# 4. **Dead ReLUs** — layers whose gradient is exactly zero.
# 5. **The update ratio** `‖Δw‖/‖w‖` — whether the learning rate fits the layer, over a training loop
#    recorded with `%%grads`.

# %%
import torch
import torch.nn as nn
import torch.nn.functional as F

%load_ext torch_nbdebug


def mlp(activation, depth=8, width=32, std_gain=None, seed=0):
    """`depth` Linear+activation blocks and a Linear head; optional N(0, gain²/width) weights."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        linear = nn.Linear(width, width)
        if std_gain is not None:
            nn.init.normal_(linear.weight, std=std_gain / width ** 0.5)
        layers += [linear, activation()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


torch.manual_seed(0)
x, y = torch.randn(64, 32), torch.randn(64, 1)

# %% [markdown]
# ## 1. `register_hook` by hand
#
# `tensor.register_hook(fn)` calls `fn(grad)` when the gradient **with respect to that tensor** has
# been computed during `backward()`. On a parameter, that is the gradient about to be accumulated
# into `.grad`; on an intermediate activation, it is a gradient you could not otherwise see (only
# leaves keep `.grad`). Hooks can also *return* a modified gradient — which is how gradient clipping
# per tensor, or gradient reversal layers, are written. Here we only look.
#
# An 8-layer MLP with sigmoid activations, the textbook network of the 1990s:

# %%
model = mlp(nn.Sigmoid)
norms, handles = {}, []
for name, param in model.named_parameters():
    if name.endswith("weight"):
        handles.append(param.register_hook(lambda grad, name=name: norms.__setitem__(name, grad.norm().item())))

hidden = model[:2](x)  # the first block's activation, an intermediate tensor
handles.append(hidden.register_hook(lambda grad: norms.__setitem__("activation after block 0", grad.norm().item())))
F.mse_loss(model[2:](hidden), y).backward()

for handle in handles:  # hooks stay until removed: always keep the handles
    handle.remove()
for name, value in norms.items():
    print(f"{name:>26}: ‖grad‖ = {value:.2e}")
assert norms["0.weight"] < 1e-4 * norms["16.weight"]

# %% [markdown]
# Each layer closer to the input gets a gradient roughly **7× smaller** than the one after it: the
# derivative of the sigmoid is at most 0.25, and backward multiplies by it once per layer. After eight
# layers the first layer's gradient is ~10⁻⁷ — it will not learn. That is the *vanishing gradient*.
#
# Hooks work, but writing them for every experiment (and remembering to remove them) is tedious.

# %% [markdown]
# ## 2. `%grads`: the gradient stepper
#
# `%grads model` after a `backward()` shows the model's layers in forward order. In a live notebook:
# **prev/next** buttons, a slider and the arrow keys move through the layers; each shows its
# parameters' gradient histogram (linear or log scale), norm, mean, std, max |g|, counts of zeros,
# NaN and Inf, the parameter's norm, and flags with a one-line reason. Above the stepper, the
# **gradient-flow** plot: mean and max |grad| per layer on a log scale, flagged layers in colour —
# click a layer to jump there. On GitHub you see the static flow plot and table.

# %%
%grads model

# %%
report = %grads -o model
flags = {(report.layers[f.layer], f.kind) for f in report.flags}
print(sorted(flags))
assert ("model.0", "vanishing") in flags

# %% [markdown]
# The flag on `model.0` says *vanishing*, with the number that tripped it (its gradient's RMS is
# below 1e-8, lost in float32 rounding next to weights of size ~0.1). You may also see the **last**
# layer flagged *exploding* — relative to the **median** layer. In a network whose lower layers
# have vanished, the median is tiny, so a perfectly normal last-layer gradient stands out by 10⁴×.
# Read the reasons, not only the colours: here the disease is the vanishing, and the flow plot shows
# it as a straight line falling by a constant factor per layer.

# %% [markdown]
# ## 3. Vanishing and exploding — and the fixes
#
# Three versions of the same depth-8 network:
#
# * **sigmoid, default init** — vanishing (above).
# * **no activation, weights too large** (`std = 2.5/√width`): each layer multiplies the signal by
#   ~2.5, forward and backward: after 8 layers, ×10⁶ — *exploding*.
# * **ReLU with He (Kaiming) initialisation** (`std = √2/√width`): the variance of the signal is
#   preserved through each layer, forward and backward, so every layer gets a gradient of the same
#   order.

# %%
exploding = mlp(nn.Identity, std_gain=2.5)
F.mse_loss(exploding(x), y).backward()
%grads exploding

# %%
healthy = mlp(nn.ReLU, std_gain=2 ** 0.5)
F.mse_loss(healthy(x), y).backward()
%grads healthy

# %%
def layer_norms(report):
    return [report.layer(i).params[0].norm for i in range(len(report.layers))]


exploding_report = %grads -o exploding
healthy_report = %grads -o healthy
print("exploding:", " ".join(f"{n:.1e}" for n in layer_norms(exploding_report)))
print("healthy:  ", " ".join(f"{n:.1e}" for n in layer_norms(healthy_report)))
assert all(f.kind == "exploding" for f in exploding_report.flags) and len(exploding_report.flags) > 0
assert not healthy_report.flags
healthy_norms = layer_norms(healthy_report)
assert max(healthy_norms) / min(healthy_norms) < 10

# %% [markdown]
# In the healthy network the gradient norms stay within a factor of a few across all nine layers,
# and nothing is flagged. The usual remedies, in the order to try them:
#
# 1. An activation whose derivative does not shrink the signal (ReLU, GELU) **with the matching
#    initialisation** (`nn.init.kaiming_normal_` for ReLU — PyTorch's default `Linear` init is
#    more conservative).
# 2. **Normalisation layers** (LayerNorm, BatchNorm) and **residual connections** — why transformers
#    and ResNets train at depth 100+.
# 3. `torch.nn.utils.clip_grad_norm_` as a *guard* against rare spikes, not as a cure for a
#    network that explodes every step.

# %% [markdown]
# ## 4. Dead ReLUs
#
# A ReLU unit whose input is negative for every example outputs 0 and passes back a gradient of
# exactly 0 — it is *dead*, and nothing will revive it, because its weights never change. Whole
# layers die after a too-large learning-rate step pushes biases very negative. Here we set one
# layer's bias to −5 to show the symptom, and record two steps with `%%grads -a` (`-a` adds
# activation statistics from forward hooks: the fraction of zeros after each layer):

# %%
torch.manual_seed(0)
relu_net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
with torch.no_grad():
    relu_net[2].bias.fill_(-5.0)  # what one bad update can do
optimizer = torch.optim.SGD(relu_net.parameters(), lr=0.01)

# %%
%%grads -a relu_net
for step in range(2):
    optimizer.zero_grad()
    F.mse_loss(relu_net(x), y).backward()
    optimizer.step()

# %%
trace = %grads -o relu_net
dead_layers = sorted({trace.layers[f.layer] for f in trace.flags if f.kind == "dead"})
print("dead:", dead_layers)
print("fraction of zeros after relu_net.3:", (relu_net[:4](x) == 0).float().mean().item())
assert "relu_net.0" in dead_layers and "relu_net.2" in dead_layers

# %% [markdown]
# All outputs of the second ReLU are zero, so no gradient flows back through it: `relu_net.2` and
# everything below it (`relu_net.0`) get an all-zero gradient, flagged *dead* with the count of
# zero values. The last layer still learns its bias — the network has collapsed to a constant.
#
# What to do: lower the learning rate (or warm it up), initialise biases at 0, use LeakyReLU/GELU
# whose gradient is never exactly zero, or add normalisation before the activation.

# %% [markdown]
# ## 5. The update ratio: does the learning rate fit?
#
# The gradient tells you the direction; what changes the model is the **update**. A rule of thumb
# (from Karpathy's *CS231n* notes) is that each step should change a layer's weights by about
# **10⁻³ of their size**: `‖Δw‖ / ‖w‖ ≈ 1e-3`. Much smaller and the layer barely learns; much larger
# (1e-1 and up) and it is being overwritten every step.
#
# `%%grads model` around a training loop records every optimizer step: the stepper gets a second
# axis (the step), a layers × steps heatmap of gradient norm, and the update ratio of every layer.
# Three runs of the healthy network with plain SGD, at learning rates 1e-5, 1e-2 and 0.5:

# %%
def train(model, lr, steps=10):
    """Plain SGD on (x, y); returns the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


slow, good, fast = (mlp(nn.ReLU, std_gain=2 ** 0.5) for _ in range(3))

# %%
%%grads -o slow
slow_losses = train(slow, lr=1e-5)

# %% [markdown]
# With `-o` the cell's value is the recording, so IPython shows it (as `Out[...]`) and keeps it in
# `_`. The Python twin does the same without a magic — here for the other two runs:

# %%
import torch_nbdebug

slow_run = _
with torch_nbdebug.record_gradients(good) as good_run:
    good_losses = train(good, lr=1e-2)
with torch_nbdebug.record_gradients(fast) as fast_run:
    fast_losses = train(fast, lr=0.5)
fast_run

# %%
def median_ratio(report, step):
    ratios = sorted(report.layer(i, step).params[0].update_ratio for i in range(len(report.layers)))
    return ratios[len(ratios) // 2]


for name, run, losses in [("1e-5", slow_run, slow_losses), ("1e-2", good_run, good_losses),
                          ("0.5", fast_run, fast_losses)]:
    print(f"lr={name:>4}: update ratio at the first step {median_ratio(run, 0):.1e}, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3g}")
assert len(slow_run.steps) == len(good_run.steps) == len(fast_run.steps) == 10
assert median_ratio(slow_run, 0) < 1e-5 and 1e-4 < median_ratio(good_run, 0) < 1e-2 < median_ratio(fast_run, 0)
assert good_losses[-1] < good_losses[0] and not all(l == l for l in fast_losses)  # fast ends in NaN

# %% [markdown]
# * `lr=1e-5`: the weights move by ~10⁻⁶ of their size per step — the loss barely changes; it
#   would need tens of thousands of steps.
# * `lr=1e-2`: ~10⁻³ per step, the loss goes down.
# * `lr=0.5`: ~10⁻¹ at the first step; three steps later the loss is 10³⁰ and then NaN — the
#   heatmap in the view above shows the gradient norms exploding across all layers at once.
#
# Adjust the learning rate per model (and with Adam, per parameter group) until the ratios sit
# around 10⁻³, and watch them over training: a ratio that creeps up precedes divergence.
#
# The same numbers are available as data: `good_run.layer("good.0", step=3).params[0]` has the norm,
# mean, std, max |g|, zero/NaN/Inf counts, parameter norm, update ratio and histogram of one
# parameter at one step; `report.flags` lists every flag with its reason.
#
# ## Summary
#
# * `register_hook` shows the gradient of any tensor during backward; keep the handles, remove them.
# * `%grads model` after a backward, `%%grads model` around a loop: per-layer statistics, flags with
#   reasons, the gradient-flow plot and the layers × steps heatmap.
# * Vanishing: gradients shrinking by a constant factor per layer (saturating activations). Exploding:
#   growing (weights too large, no normalisation). Fix with activation + matching init + normalisation.
# * Dead ReLUs: gradients of exactly zero; look for very negative biases and too-large steps.
# * Update ratio `‖Δw‖/‖w‖ ≈ 1e-3` per step is a good starting point for a learning rate.
# %% [markdown]
# ## Exercise: a deep network whose first layers do not learn
#
# Eight sigmoid layers. Train it for 20 steps under `%%grads deep` and read the flags and the
# gradient-flow plot: which layers are flagged, and why? Then change the model so that no layer is
# flagged vanishing or exploding (keep the depth and the optimizer).

# %%
torch.manual_seed(0)
deep = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(32, 32), nn.Sigmoid())], nn.Linear(32, 1))
deep_opt = torch.optim.SGD(deep.parameters(), lr=0.1)
xs, ys = torch.randn(64, 32), torch.randn(64, 1)
for step in range(20):
    loss = F.mse_loss(deep(xs), ys)
    deep_opt.zero_grad()
    loss.backward()
    deep_opt.step()
print("loss after 20 steps:", round(loss.item(), 4))

# %% [markdown]
# <details><summary>Solution</summary>
#
# Under `%%grads deep` the first layers (`deep.0`, `deep.2`) are flagged **vanishing** and the last
# one **exploding** relative to them: the gradient-flow plot falls by a constant factor per layer
# going back towards the input. The sigmoid's derivative is at most 0.25, so every layer multiplies
# the gradient by a factor below 1 on its way back — eight of them leave the first layers almost
# nothing. Use an activation whose derivative stays near 1 where it is active (GELU here; ReLU would
# trade the problem for dead units in this small net — try it and read the flags):
#
# ```python
# torch.manual_seed(0)
# deep = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(32, 32), nn.GELU())], nn.Linear(32, 1))
# deep_opt = torch.optim.SGD(deep.parameters(), lr=0.1)
# with torch_nbdebug.record_gradients(deep) as trace:
#     for step in range(20):
#         loss = F.mse_loss(deep(xs), ys)
#         deep_opt.zero_grad()
#         loss.backward()
#         deep_opt.step()
# print([(flag.kind, flag.layer) for flag in trace.flags])
# assert not [flag for flag in trace.flags if flag.kind in ("vanishing", "exploding")]
# ```
#
# </details>
