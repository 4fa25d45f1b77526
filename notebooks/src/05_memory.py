# %% [markdown]
# # 05 · Memory
#
# `CUDA out of memory` is the error every PyTorch user meets. Sometimes the model simply does not
# fit; more often something keeps tensors alive that should have been freed. This notebook explains
# where memory goes and how to find what holds it:
#
# 1. **The numbers** — `memory_allocated`, `memory_reserved`, `max_memory_allocated`, and the caching
#    allocator behind them.
# 2. **Where a training step's memory goes** — parameters, gradients, optimizer state, activations
#    saved for backward, temporaries — with `%%cudamem`'s timeline.
# 3. **The leak from appending losses** — and its one-word fix.
# 4. **Re-creating models per batch.**
# 5. **`empty_cache`** — a diagnostic, not a fix.
#
# It runs on a CPU: there, torch_nbdebug records CPU tensor allocations itself and shows the same
# views (it says so in one line). On a GPU the same cells use CUDA's allocator.

# %%
import torch
import torch.nn as nn
import torch.nn.functional as F

%load_ext torch_nbdebug
device = "cuda" if torch.cuda.is_available() else "cpu"
print("device:", device)

# %% [markdown]
# ## 1. The numbers, and the caching allocator
#
# Asking the GPU driver for memory (`cudaMalloc`) is slow and synchronises the device, so PyTorch
# keeps what it gets: freed tensor memory goes back to PyTorch's **caching allocator**, not to the
# driver, ready for the next tensor of a similar size. Hence three numbers:
#
# | function | what it counts |
# |---|---|
# | `torch.cuda.memory_allocated()` | bytes in **live tensors** right now |
# | `torch.cuda.memory_reserved()` | bytes the caching allocator **holds** from the driver: live tensors + cached free blocks |
# | `torch.cuda.max_memory_allocated()` | the **peak** of `memory_allocated` since the start (or since `torch.cuda.reset_peak_memory_stats()`) |
#
# `nvidia-smi` shows yet more: reserved memory plus the CUDA context (several hundred MB per
# process). An OOM happens when a new allocation does not fit in the free part of reserved memory
# *and* the driver has no more to give. The peak, not the final value, is what must fit.

# %%
if torch.cuda.is_available():
    torch.cuda.reset_peak_memory_stats()
    big = torch.empty(256, 1024, 1024, device="cuda")  # 1 GiB
    print(f"allocated {torch.cuda.memory_allocated() / 2**20:.0f} MiB, reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB")
    del big
    print(f"after del: allocated {torch.cuda.memory_allocated() / 2**20:.0f} MiB, "
          f"reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB, peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
else:
    print("No CUDA here: torch.cuda.memory_allocated() and friends count nothing on a CPU. "
          "torch_nbdebug's %cudamem shows the live CPU tensors instead:")

# %% [markdown]
# `%cudamem` shows the memory **now**: bytes by category, and the largest live tensors **named by
# what holds them** — a variable, `model.fc.weight.grad`, `optimizer.state[...]["exp_avg"]`.
# A model and an Adam optimizer after one step:

# %%
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 10)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
batches = [(torch.randn(128, 256, device=device), torch.randint(0, 10, (128,), device=device))
           for _ in range(4)]


def train_step(xb, yb):
    loss = F.cross_entropy(model(xb), yb)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


train_step(*batches[0])
%cudamem

# %%
state = %cudamem -o
param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"parameters {state.by_category['parameters']:,} B (sum of p.nbytes: {param_bytes:,} B)")
print(f"gradients {state.by_category['gradients']:,} B, optimizer state {state.by_category['optimizer_state']:,} B")
print("largest:", [(t.name, t.category) for t in state.top[:3]])
# On a CPU the bytes are exact; CUDA's allocator rounds each block up to a multiple of 512 bytes.
slack = 512 * len(list(model.parameters())) if device == "cuda" else 0
assert param_bytes <= state.by_category["parameters"] <= param_bytes + slack
assert param_bytes <= state.by_category["gradients"] <= param_bytes + slack
assert state.by_category["optimizer_state"] >= 2 * param_bytes  # Adam: exp_avg and exp_avg_sq

# %% [markdown]
# For this model, **parameters, gradients and Adam's two moment buffers take 4× the model size** —
# before a single activation. That is the first line of a memory budget: a 1-billion-parameter
# model in float32 needs 16 GB for these alone.
#
# ## 2. Where a training step's memory goes
#
# `%%cudamem` runs the cell and draws its memory **timeline**, stacked by category, with the
# forward, backward and optimizer phases shaded and each loop iteration visible. The peak is marked,
# with the allocations alive at that moment — their size, shape, category, module and the line of
# your code that allocated them. In a live notebook, drag to zoom into a time range and hover an
# allocation for its details.

# %%
%%cudamem
for xb, yb in batches:
    train_step(xb, yb)

# %% [markdown]
# The Python twin, `torch_nbdebug.memory_timeline()`, records a `with` block and gives the same
# timeline as an object (the magic returns it with `-o`); its data is plain: samples, per-category
# totals, phases, the peak and its allocations, leaks. Two more steps, recorded that way:

# %%
import torch_nbdebug

with torch_nbdebug.memory_timeline() as timeline:
    for xb, yb in batches[:2]:
        train_step(xb, yb)

# %% [markdown]
# Reading the picture:
#
# * **parameters, gradients, optimizer state** — flat: allocated once, they live as long as the
#   model.
# * **activations saved for backward** — grow through each forward pass (every layer saves its
#   input for the weight gradient, every ReLU its output) and are freed during backward. They scale
#   with **batch size × depth**, which is why halving the batch size fixes most OOMs, and why
#   *activation checkpointing* (recompute instead of save) exists.
# * **temporaries** — short-lived intermediate results: gradients of activations in backward, the
#   optimizer's scratch buffers.
# * The **peak** is where the most categories coexist. With large batches it is at the end of
#   forward or early in backward (all saved activations plus the first activation gradients). In
#   this small model with a small batch, it is in the **optimizer** phase: Adam's multi-tensor
#   implementation allocates temporaries the size of the parameters, on top of parameters,
#   gradients and both moments.

# %%
peak_phase = next((p.phase for p in timeline.phases if p.start <= timeline.peak_step <= p.end), None)
print(f"peak {timeline.peak_bytes / 2**20:.2f} MiB at step {timeline.peak_step}, in the {peak_phase} phase; "
      f"{timeline.iterations} iterations")
for alloc in timeline.peak_allocations[:5]:
    print(f"  {alloc.nbytes / 2**20:6.2f} MiB  {alloc.category:<16} {alloc.shape}")
assert timeline.iterations == 2 and {p.phase for p in timeline.phases} >= {"forward", "backward", "optimizer"}
assert timeline.category_totals["activations"]["max"] > 0
assert not timeline.leaks  # a training step that keeps nothing

# %% [markdown]
# ## 3. The leak from appending losses
#
# The most common leak in PyTorch code is one line in an evaluation loop:
#
# ```python
# val_losses.append(loss)          # keeps the tensor — and the whole autograd graph behind it
# ```
#
# A loss computed with gradients enabled carries its `grad_fn`, which holds every tensor saved for
# backward: the activations of the entire forward pass. Without a `backward()` to free them, each
# appended loss keeps one batch's activations alive. Over a validation set that is a slow climb to
# OOM. `%%cudamem` reports the tensors a cell allocated that are **still alive after it**, grouped
# by what holds them:

# %%
%%cudamem
val_losses = []
for xb, yb in batches:
    loss = F.cross_entropy(model(xb), yb)
    val_losses.append(loss)

# %% [markdown]
# The same check in code, with the Python twin (a second list, so that we can compare):

# %%
with torch_nbdebug.memory_timeline() as leaky:
    val_losses_again = [F.cross_entropy(model(xb), yb) for xb, yb in batches]
for leak in leaky.leaks:
    print(f"{leak.holder}: {leak.count} tensors, {leak.nbytes / 2**20:.1f} MiB, graph attached: {leak.has_graph}")
    print("   ", leak.note)
held = {leak.holder: leak for leak in leaky.leaks}
assert "val_losses_again" in held and held["val_losses_again"].has_graph
assert sum(leak.nbytes for leak in leaky.leaks) > 4 * 128 * 1024 * 4  # at least the saved activations

# %% [markdown]
# A list of four scalar losses holds several MiB: the saved activations of four forward passes.
# **The fix** is two habits, each sufficient here:
#
# * store numbers, not tensors: `val_losses.append(loss.item())` (or `loss.detach()`);
# * evaluate under `torch.no_grad()` (or `torch.inference_mode()`): no graph is built at all, and
#   the forward pass itself needs less memory.
#
# The same mistake hides in training loops as `total_loss += loss` (a chain of graphs, one per
# step) and in logging code that keeps `outputs` "for later".

# %%
%%cudamem
val_losses = []
with torch.no_grad():
    for xb, yb in batches:
        val_losses.append(F.cross_entropy(model(xb), yb).item())

# %%
with torch.no_grad(), torch_nbdebug.memory_timeline() as fixed:
    val_losses = [F.cross_entropy(model(xb), yb).item() for xb, yb in batches]
print("leaks after the fix:", fixed.leaks)
assert not fixed.leaks
del val_losses_again

# %% [markdown]
# ## 4. Re-creating models per batch
#
# Another pattern that wastes memory and time — and silently breaks training:
#
# ```python
# for xb, yb in loader:
#     model = Net().to(device)                      # a fresh, untrained model every batch
#     optimizer = torch.optim.Adam(model.parameters())
#     ...
# ```
#
# Every iteration allocates all parameters and, after the first step, all optimizer state again,
# only to throw them away; the model never learns beyond one batch. If anything else keeps a
# reference to the old models (a list of them, a hook, a closure, an optimizer created once
# outside the loop), their memory is never freed. The timeline shows the signature: **parameter
# memory allocated in every iteration**.

# %%
def make_model():
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)


# %%
%%cudamem
for xb, yb in batches:
    fresh = make_model()
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    loss = F.cross_entropy(fresh(xb), yb)
    fresh_optimizer.zero_grad()
    loss.backward()
    fresh_optimizer.step()

# %%
with torch_nbdebug.memory_timeline() as churn:
    for xb, yb in batches:
        fresh = make_model()
        fresh(xb).sum().backward()
one_model = sum(p.numel() * p.element_size() for p in make_model().parameters())
allocated = churn.category_totals["parameters"]["allocated"]
print(f"parameter bytes allocated in the cell: {allocated:,} = {allocated / one_model:.0f} × one model")
assert one_model * len(batches) <= allocated <= (one_model + 512 * 4) * len(batches)  # 4 tensors/model

# %% [markdown]
# Four batches, four models' worth of parameters allocated. Create the model and the optimizer
# **once**, before the loop.
#
# ## 5. `empty_cache`: a diagnostic, not a fix
#
# `torch.cuda.empty_cache()` returns the caching allocator's **free cached blocks** to the driver.
# It does not free a single live tensor. So:
#
# * after an OOM, if `memory_allocated()` is high, `empty_cache()` cannot help: something holds the
#   tensors (find it with `%cudamem`, as above) or the step genuinely needs that much;
# * if `memory_reserved()` is much larger than `memory_allocated()`, the cache is holding free
#   blocks — often **fragmentation**: free memory in pieces too small for the next allocation.
#   `empty_cache()` shrinking `reserved` *confirms* that diagnosis. The fixes are elsewhere: fewer
#   distinct tensor sizes, `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, or a smaller peak;
# * calling it in the training loop only makes the next allocations slow again (back to
#   `cudaMalloc`), and it is useful mainly to give memory back to *another process* on the same GPU.

# %%
if torch.cuda.is_available():
    scratch = [torch.empty(2**20 * k, device="cuda") for k in (64, 32, 16)]  # 448 MiB
    del scratch
    before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    print(f"allocated {before[0] / 2**20:.0f} -> {after[0] / 2**20:.0f} MiB (unchanged), "
          f"reserved {before[1] / 2**20:.0f} -> {after[1] / 2**20:.0f} MiB")
    assert after[0] == before[0] and after[1] <= before[1]
else:
    print("No CUDA: a CPU has no caching allocator to empty; the distinction above is CUDA's.")

# %% [markdown]
# ## Summary
#
# * `allocated` = live tensors, `reserved` = what PyTorch holds from the driver, `max_allocated` =
#   the peak that must fit. Parameters + gradients + Adam state ≈ 4× the model in float32.
# * Activations saved for backward scale with batch size × depth and peak around the start of
#   backward; the timeline shows them.
# * Append `loss.item()`, never `loss`; evaluate under `torch.no_grad()`. `%%cudamem` lists what a
#   cell leaked and who holds it.
# * Build models and optimizers once. `empty_cache()` tells fragmentation from live tensors; it
#   fixes neither.
# %% [markdown]
# ## Exercise: a validation loop that grows
#
# A validation loop that adds up the loss of five batches. Run it under `%%cudamem`: what does the
# cell leave allocated, who holds it, and why so much for one number? Fix the loop so that it leaves
# nothing behind.

# %%
torch.manual_seed(0)
val_model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
total = 0
for _ in range(5):
    batch = torch.randn(512, 64)
    total = total + F.mse_loss(val_model(batch), torch.zeros(512, 8))
print("mean validation loss:", (total / 5).item())

# %% [markdown]
# <details><summary>Solution</summary>
#
# `%%cudamem` lists one leak: `total` holds about twenty tensors and an autograd graph. `total` is a
# tensor that requires grad, so each `+` extends one graph through all five forward passes, and that
# graph keeps every activation it saved for a backward that never comes. Validation needs no graph
# and the sum needs no tensor: run under `torch.no_grad()` and add `.item()`s.
#
# ```python
# with torch_nbdebug.memory_timeline() as timeline:
#     total = 0.0
#     with torch.no_grad():
#         for _ in range(5):
#             batch = torch.randn(512, 64)
#             total += F.mse_loss(val_model(batch), torch.zeros(512, 8)).item()
# print("mean validation loss:", total / 5, "| leaks:", timeline.leaks)
# assert not timeline.leaks
# ```
#
# </details>
