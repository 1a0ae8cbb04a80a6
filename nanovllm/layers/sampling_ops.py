"""The sampler's two loops over a step's [rows, vocab] logits, in portable PyTorch: drawing the
rows that have no top-k, top-p or min-p filter, and masking what a grammar disallows. A platform
hands the sampler faster ones where it has them (Platform.sampling_ops: the CPU kernels do both
without [rows, vocab] temporaries); each makes the same draw, to rounding.
"""

import torch


def draw_by_inverse_transform(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token: the first whose cumulative probability under softmax(logits) exceeds the
    row's uniform number times the total."""
    cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)
    total = cdf[:, -1:]
    # u < 1, but the product may round up to the total, past the last token with any probability.
    target = torch.minimum(uniform.unsqueeze(1) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


class SamplingOps:
    def draw_unfiltered(self, logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """Rows drawn from softmax(logits / temperature) at their uniform numbers."""
        return draw_by_inverse_transform(logits / temperatures.unsqueeze(1), uniform)

    def mask_disallowed(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """-inf where a row's bit is clear (bit t % 32 of word t // 32), in place. The bits are
        unpacked into [rows, vocab] temporaries, which a GPU's bandwidth makes cheap."""
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(bitmask), -1)[:, :logits.shape[1]]
        logits.masked_fill_(allowed == 0, float("-inf"))
