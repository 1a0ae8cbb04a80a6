"""Host data onto a step's device without the host waiting for it.

A step's inputs are built on the host (Python lists, numpy arrays). Copied to a GPU from
ordinary (pageable) memory, each copy makes the host wait for the device to drain its queue;
from pinned memory with `non_blocking`, the copy is queued behind the work already launched
and the host goes on. torch's caching host allocator keeps a pinned buffer alive until the
copies that read it have run. On CPU the host tensor is the device tensor.
"""

import torch


def to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`data` (a list, a numpy array, or a CPU tensor) as a `dtype` tensor on `device`."""
    tensor = torch.as_tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
