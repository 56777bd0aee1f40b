# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Layers whose memory is a fixed-size state per sequence instead of a KV cache that grows with it:
Gated DeltaNet (Qwen3-Next, Qwen3.5), linear attention, and LFM2's short convolution.

Each value head keeps a matrix S [key_dim, value_dim]. A token decays it by exp(g) and writes its
value under its key by the delta rule, the correction of what S already recalls for that key:

    S <- exp(g) S;   S <- S + beta k (v - S^T k)^T;   out = S^T q

with q and k L2-normalised (q also by sqrt(key_dim)), beta = sigmoid(b) and g = -exp(A_log) *
softplus(a + dt_bias) from the token. Before that, q, k and v go through a short causal depthwise
convolution (its last kernel - 1 inputs are state too); after, each head's output is RMS-normalised
and gated by silu(z).

A prompt runs in chunks of CHUNK tokens (the "WY" form of the delta rule: within a chunk the updates
are solved as one triangular system, across chunks the state carries), a decode step as the
recurrence itself. `recurrence` is the plain loop, the reference the tests hold both to.

LFM2's `ShortConv` keeps the short convolution alone: B, C and x projected from the input, B * x
through a causal depthwise convolution of a few taps, times C.
"""
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F

CHUNK = 64
KINDS = ("gated_deltanet", "short_conv")  # ModelArgs.linear_attention


class RecurrentState(nn.Module):
    """A layer's state for max_batch_size rows ("slots"): the convolution's last inputs and the
    delta rule's matrices (none for a short convolution: heads 0). Unlike a KV cache it stands at one
    position, the last its row consumed."""

    def __init__(self, max_batch_size: int, channels: int, kernel: int, heads: int = 0, key_dim: int = 0,
                 value_dim: int = 0, dtype=None):
        super().__init__()
        self.register_buffer("conv", torch.zeros(max_batch_size, channels, kernel - 1, dtype=dtype), persistent=False)
        # fp32 whatever the model's dtype: the state sums every token so far, as transformers keeps it.
        self.register_buffer("memory", torch.zeros(max_batch_size, heads, key_dim, value_dim) if heads else None,
                             persistent=False)

    def read(self, B: int, rows: Optional[Tensor]) -> tuple:
        if self.memory is None:
            return (self.conv[:B] if rows is None else self.conv[rows]), None
        return (self.conv[:B], self.memory[:B]) if rows is None else (self.conv[rows], self.memory[rows])

    def write(self, conv: Tensor, memory: Optional[Tensor], rows: Optional[Tensor]):
        if rows is None:
            self.conv[:conv.shape[0]] = conv
            if memory is not None:
                self.memory[:memory.shape[0]] = memory
        else:
            self.conv[rows] = conv
            if memory is not None:
                self.memory[rows] = memory


def causal_conv(x: Tensor, weight: Tensor, conv: Tensor, keep: Tensor, mask: Optional[Tensor]) -> tuple:
    """A causal depthwise convolution of x [B, T, C] by weight [C, kernel] after the state's last
    kernel - 1 inputs conv [B, C, kernel - 1] (zeros where keep [B or 1, 1] is 0: a row that starts)
    -> (out [B, T, C], the new state: the kernel - 1 inputs before each row's first padding token,
    mask [B, T] saying which tokens are real, None: all)."""
    B, T, C = x.shape
    conv = conv * keep[..., None].to(conv.dtype)
    seq = torch.cat([conv.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, kernel - 1 + T, C]
    # A sum of shifted rows in x's [B, T, C] layout (conv1d's [B, C, T] costs two transposed copies); as
    # conv1d in x's dtype: the weights in it, the products exact in fp32, the sum rounded once.
    taps, wide = weight.to(x.dtype).float().t(), seq.float()
    out = wide[:, :T] * taps[0]
    for j in range(1, weight.shape[1]):
        out.addcmul_(wide[:, j:j + T], taps[j])
    out = out.to(x.dtype)
    if mask is None:
        return out, seq[:, T:].transpose(1, 2)
    index = mask.sum(-1)[:, None] + torch.arange(weight.shape[1] - 1, device=x.device)
    return out, seq.gather(1, index[:, :, None].expand(B, -1, C)).transpose(1, 2)


class ShortConv(nn.Module):
    """LFM2's convolution layer: B, C, x = w_in(input); out = wo(C * conv(B * x)), the convolution
    causal and depthwise over `kernel` taps (its last kernel - 1 inputs the state)."""

    def __init__(self, dim: int, kernel: int):
        super().__init__()
        self.dim, self.kernel = dim, kernel
        self.w_in = nn.Linear(dim, 3 * dim, bias=False)
        self.conv = nn.Parameter(torch.empty(dim, kernel))
        self.wo = nn.Linear(dim, dim, bias=False)
        self.state: Optional[RecurrentState] = None

    def make_state(self, max_batch_size: int, dtype) -> RecurrentState:
        return RecurrentState(max_batch_size, self.dim, self.kernel, dtype=dtype)

    def forward(self, x: Tensor, input_pos: Tensor, rope: Tensor, mask: Optional[Tensor],
                cache_rows: Optional[Tensor] = None) -> Tensor:
        """As GatedDeltaNet.forward."""
        b, c, h = self.w_in(x).chunk(3, dim=-1)
        conv, _ = self.state.read(x.shape[0], cache_rows)
        keep = (input_pos[..., :1] != 0).reshape(-1, 1)  # [1 or B, 1]: 0 where a row starts (empty state)
        y, conv = causal_conv(b * h, self.conv, conv, keep, mask)
        self.state.write(conv.to(self.state.conv.dtype), None, cache_rows)
        return self.wo(c * y)


class GatedDeltaNet(nn.Module):
    def __init__(self, dim: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int,
                 norm_eps: float):
        super().__init__()
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = key_heads, value_heads, key_dim, value_dim
        self.kernel = kernel
        self.channels = 2 * key_heads * key_dim + value_heads * value_dim  # q, k, v: what the convolution mixes
        # q, k, v, the output gate z, and b, a (each one per value head) in one projection: one
        # matrix-vector product per layer in a decode step.
        self.w_in = nn.Linear(dim, self.channels + value_heads * value_dim + 2 * value_heads, bias=False)
        self.conv = nn.Parameter(torch.empty(self.channels, kernel))
        self.A_log = nn.Parameter(torch.empty(value_heads))
        self.dt_bias = nn.Parameter(torch.empty(value_heads))
        self.norm_weight = nn.Parameter(torch.ones(value_dim))
        self.norm_eps = norm_eps
        self.wo = nn.Linear(value_heads * value_dim, dim, bias=False)
        self.state: Optional[RecurrentState] = None

    def make_state(self, max_batch_size: int, dtype) -> RecurrentState:
        return RecurrentState(max_batch_size, self.channels, self.kernel, self.value_heads, self.key_dim,
                              self.value_dim, dtype)

    def forward(self, x: Tensor, input_pos: Tensor, rope: Tensor, mask: Optional[Tensor],
                cache_rows: Optional[Tensor] = None) -> Tensor:
        """As Attention.forward, but mask is [B, T]: True for the tokens a row really has (None: all);
        the others (a right-padded prompt's padding, a row that only rides along in a batched step)
        leave its state as it was. A row whose first position is 0 starts from an empty state."""
        B, T, _ = x.shape
        H, dk, dv = self.value_heads, self.key_dim, self.value_dim
        qkv, z, b, a = self.w_in(x).split([self.channels, H * dv, H, H], dim=-1)
        conv, memory = self.state.read(B, cache_rows)
        keep = (input_pos[..., :1] != 0).reshape(-1, 1)  # [1 or B, 1]: 0 where a row starts (empty state)
        qkv, conv = causal_conv(qkv, self.conv, conv, keep, mask)  # over the previous kernel - 1 inputs and these
        qkv = F.silu(qkv)

        q, k, v = qkv.float().split([self.key_heads * dk, self.key_heads * dk, H * dv], dim=-1)
        q, k = (l2_normalized(t.view(B, T, self.key_heads, dk)) for t in (q, k))
        if H != self.key_heads:  # each key head serves a group of value heads
            q, k = (t.repeat_interleave(H // self.key_heads, dim=2) for t in (q, k))
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if mask is not None:  # no write, no decay
            beta, g = beta * mask[..., None], g * mask[..., None]
        if T == 1:  # the reset folded into the step's decay: no pass over the state of its own
            y, memory = delta_rule_step(q * dk ** -0.5, k, v.view(B, T, H, dv), beta, g, memory, keep)
        else:
            y, memory = delta_rule_chunked(q * dk ** -0.5, k, v.view(B, T, H, dv), beta, g,
                                           memory * keep[..., None, None])
        self.state.write(conv.to(self.state.conv.dtype), memory, cache_rows)

        # Each head's output RMS-normalised (weight in the model dtype, as transformers), gated by silu(z).
        normed = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.norm_eps)).to(x.dtype) * self.norm_weight
        gated = normed.float() * F.silu(z.view(B, T, H, dv).float())
        return self.wo(gated.to(x.dtype).reshape(B, T, H * dv))


def l2_normalized(x: Tensor) -> Tensor:
    """x / |x| as the reference kernels (flash-linear-attention's) compute it, epsilon inside the root."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, memory: Tensor,
                    keep: Optional[Tensor] = None) -> tuple:
    """One token: q, k [B, 1, H, dk], v [B, 1, H, dv], beta, g [B, 1, H], memory [B, H, dk, dv] (fp32),
    keep [B, 1] (0: start from an empty memory; default 1) -> (out [B, 1, H, dv], the new memory).

    A decode step is memory-bound on the state (a 2 MB matrix per layer and sequence in Qwen3.5-9B), so
    it reads it twice and writes it once: what it recalls for k and for q in one product, then
    S' = decay S + k delta^T, whose output S'^T q = decay S^T q + (k.q) delta needs no third pass."""
    q, k, v, beta, g = q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g[:, 0]
    decay = g.exp() if keep is None else g.exp() * keep  # [B, H]
    recalled, seen = (decay[..., None, None] * torch.einsum("bhkv,bhnk->bhnv", memory, torch.stack([k, q], 2))
                      ).unbind(2)
    delta = (v - recalled) * beta[..., None]  # [B, H, dv]
    out = seen + (k * q).sum(-1, keepdim=True) * delta
    return out[:, None], memory * decay[..., None, None] + k[..., None] * delta[..., None, :]


def recurrence(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, memory: Tensor) -> tuple:
    """The delta rule token by token as its definition reads (the tests' reference): shapes as
    delta_rule_chunked's."""
    out = []
    for t in range(q.shape[1]):
        memory = memory * g[:, t].exp()[..., None, None]
        recalled = torch.einsum("bhkv,bhk->bhv", memory, k[:, t])
        memory = memory + k[:, t, ..., None] * ((v[:, t] - recalled) * beta[:, t, ..., None])[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", memory, q[:, t]))
    return torch.stack(out, dim=1), memory


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, memory: Tensor) -> tuple:
    """T tokens: q, k [B, T, H, dk], v [B, T, H, dv], beta, g [B, T, H] (fp32), memory [B, H, dk, dv]
    -> (out [B, T, H, dv], the memory after the last token), as `recurrence` gives them.

    Within a chunk of C tokens, with G_i the decay summed over the chunk's first i tokens, every
    state the chunk passes through is exp(G_i) S0 plus a sum of k_j u_j^T; the u (what each token
    writes) solve one unit lower-triangular system (I + L) U = beta (V - exp(G) K S0) with
    L_ij = beta_i exp(G_i - G_j) k_i.k_j for j < i; then out_i = exp(G_i) q_i S0 + sum_{j<=i}
    exp(G_i - G_j) (q_i.k_j) u_j and S = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T."""
    B, T, H, dk = k.shape
    C = min(CHUNK, T)
    pad = -T % C
    q, k, v = (F.pad(t.transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v))  # [B, H, T + pad, d]
    beta, g = (F.pad(t.transpose(1, 2), (0, pad)) for t in (beta, g))  # padding: beta 0, g 0 (no effect)
    n = (T + pad) // C
    q, k, v = (t.reshape(B, H, n, C, -1) for t in (q, k, v))
    beta, G = beta.reshape(B, H, n, C), g.reshape(B, H, n, C).cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above (masked before exp: G_i - G_j > 0 there could overflow)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # L; the solver takes I + L
    # What U is before S0's part: beta V, and what a unit of S0 subtracts: beta exp(G) K
    writes = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # [B, H, n, C, C]
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    out = []
    for c in range(n):
        u = writes[:, :, c] - reads[:, :, c] @ memory
        out.append(q_decayed[:, :, c] @ memory + scores[:, :, c] @ u)
        memory = memory * G[:, :, c, -1].exp()[..., None, None] + k_to_end[:, :, c].transpose(-1, -2) @ u
    y = torch.stack(out, dim=2).reshape(B, H, n * C, -1)[:, :, :T]
    return y.transpose(1, 2), memory
