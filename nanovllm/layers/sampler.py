"""Turns the logits of sampled positions into tokens: greedy rows take the argmax,
the others are drawn with the Gumbel-max trick (argmax of probs / Exp(1) noise)."""

import torch
from torch import nn


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """logits: [n, vocab]; temperatures: [n] fp32, 0 = greedy. Returns [n] token ids."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if not bool((temperatures > 0).any()):
            return greedy
        probs = torch.softmax(logits / temperatures.clamp(min=1e-5).unsqueeze(1), dim=-1)
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperatures > 0, sampled, greedy)
