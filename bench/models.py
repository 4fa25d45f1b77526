"""Models shared by the benchmarks: a GPT-2-small-like transformer, a 2-layer GPT, a small MLP, a small
CNN, and the training step every benchmark times.

Not a benchmark itself (``./dev bench`` runs every ``bench/*.py``; this one only defines helpers).
The benchmark scripts import it as ``from models import ...``: Python puts a script's own directory
on ``sys.path``, so ``python bench/bench_x.py`` finds it from any working directory.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A GPT-2 block: pre-LayerNorm causal self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int, fused_attention: bool = False) -> None:
        super().__init__()
        self.heads, self.fused_attention = heads, fused_attention
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.fused_attention:  # one fused op, as most current models do
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            # The causal mask's -inf is intentional: nanwatch must never report it as a birth.
            y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """GPT-2-small-like by default (12 blocks, d=768, 12 heads): token and position embeddings, blocks,
    a final LayerNorm and a bias-free head, optionally tied to the token embedding.

    Weights start as GPT-2's, N(0, 0.02): with PyTorch's N(0, 1) embedding init a tied head makes the
    logits so large that the cross-entropy is exactly 0 and every gradient vanishes.
    """

    def __init__(self, vocab: int = 8192, d: int = 768, layers: int = 12, heads: int = 12, ctx: int = 256,
                 tied: bool = False, fused_attention: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads, fused_attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def small_gpt(vocab: int = 512, d: int = 64, layers: int = 2, heads: int = 4, ctx: int = 64) -> GPT:
    """A 2-layer GPT (d=64): each op is cheap, so per-op Python work dominates its step, as on a GPU.

    The CPU stand-in for the GPU regime: a tool's overhead that hides behind GPT-2-small's slow CPU ops
    shows here (time it with a sequence of 32 tokens)."""
    return GPT(vocab=vocab, d=d, layers=layers, heads=heads, ctx=ctx)


def lm_loss(model: nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's logits for ``idx`` against ``target`` (same shape, token ids)."""
    return F.cross_entropy(model(idx).flatten(0, 1), target.flatten())


def mlp(*widths: int) -> nn.Sequential:
    """Linear layers of the given widths with a ReLU between each two: ``mlp(784, 512, 512, 10)``."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        layers += [nn.ReLU()] if i else []
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def small_cnn(classes: int = 10) -> nn.Sequential:
    """Two conv-BatchNorm-ReLU-maxpool stages and a linear classifier, for 3x32x32 images."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, classes))


def training_step(opt: torch.optim.Optimizer, loss: Callable[[], torch.Tensor],
                  after_backward: Optional[Callable[[], None]] = None) -> None:
    """One full step as the benchmarks time it: zero_grad (to None), forward and loss, backward,
    ``after_backward`` (e.g. reading the gradients), optimizer step."""
    opt.zero_grad(set_to_none=True)
    loss().backward()
    if after_backward is not None:
        after_backward()
    opt.step()
