"""The model `python -m bench.model` measures: a stack of llama-shaped decoder layers, defined here so nothing is
downloaded. Each layer: RMSNorm, a fused qkv projection (3H), causal attention through
F.scaled_dot_product_attention, the output projection, a residual; RMSNorm, a SiLU-gated MLP (gate, up, down), a
residual. Every projection is an `nn.Linear` without bias (its weight stored (out, in), as checkpoints hold it), so
`kernels.patch` meets exactly what it meets in a real model. The input is the residual stream of one sequence,
(1, M, hidden): no embedding, no head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.core.problem import DTYPES_BY_NAME

MODEL_DTYPES = ("bf16", "fp16", "fp32")


class ModelShapeError(ValueError):
    """Sizes that do not make a decoder layer; the message names the flag."""


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (llama's)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, hidden: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = hidden // head_dim, head_dim
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        # (B, M, 3, heads, d) -> three (B, heads, M, d)
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(batch, tokens, hidden))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, head_dim: int):
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = Attention(hidden, head_dim)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = GatedMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class DecoderStack(nn.Module):
    def __init__(self, hidden: int, intermediate: int, layers: int, head_dim: int = 128):
        super().__init__()
        check_shape(hidden, intermediate, layers, head_dim)
        self.layers = nn.ModuleList(DecoderLayer(hidden, intermediate, head_dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def check_shape(hidden: int, intermediate: int, layers: int, head_dim: int) -> None:
    for flag, value in (("--hidden", hidden), ("--intermediate", intermediate), ("--layers", layers),
                        ("--head-dim", head_dim)):
        if value < 1:
            raise ModelShapeError(f"{flag} must be a positive integer, got {value}")
    if hidden % head_dim:
        raise ModelShapeError(f"--hidden {hidden} is not a multiple of --head-dim {head_dim} (heads = hidden / "
                              f"head_dim)")


def build_model(hidden: int, intermediate: int, layers: int, head_dim: int, dtype: str, device: str,
                seed: int = 0) -> DecoderStack:
    """The stack with nn.Linear's own initialisation drawn from `seed`, in `dtype` on `device`."""
    if dtype not in MODEL_DTYPES:
        raise ModelShapeError(f"--dtype {dtype!r}: one of {', '.join(MODEL_DTYPES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DecoderStack(hidden, intermediate, layers, head_dim)
    return model.to(device=device, dtype=DTYPES_BY_NAME[dtype])


def model_input(tokens: int, hidden: int, dtype: str, device: str, seed: int = 1) -> torch.Tensor:
    """The residual stream entering the first layer: (1, tokens, hidden), unit normal."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, hidden, generator=gen)
    return x.to(device=device, dtype=DTYPES_BY_NAME[dtype])


def linear_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """Each projection's weight shape (out, in), by its name in a layer."""
    return {"attn.qkv": (3 * hidden, hidden), "attn.o": (hidden, hidden), "mlp.gate": (intermediate, hidden),
            "mlp.up": (intermediate, hidden), "mlp.down": (hidden, intermediate)}
