"""What a decode step would make a GPU's host wait for, counted on CPU: while the step samples,
the only read back from the device is the sampled ids (one `tolist`); no `bool(tensor)`,
`.item()` or `int(tensor)` (each a device-to-host sync on CUDA), whatever the rows ask for
(greedy and sampled rows, a seed, min_tokens' banned ids, penalties, logit_bias, a grammar).
Host-to-device copies go through transfer.to_device, which pins and does not block."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import make_tiny_checkpoint
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine.transfer import to_device


class SyncCounter(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (`aten._local_scalar_dense`)."""

    def __init__(self):
        super().__init__()
        self.scalar_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalar_reads += 1
        return func(*args, **(kwargs or {}))


def test_a_decode_step_reads_back_only_the_sampled_ids(tmp_path, monkeypatch):
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(str(path), dtype="float32", num_kvcache_blocks=64, enforce_eager=True)
    engine = llm.llm_engine
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, min_tokens=4),
        SamplingParams(temperature=0.7, max_tokens=8, repetition_penalty=1.2, presence_penalty=0.5,
                       logit_bias={7: 2.0}),
        SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]+")),
    ]
    for i, p in enumerate(params):
        engine.add_request(str(i), [5 + i, 9, 11, 13], p)
    engine.step()  # the prefill
    runner = engine.executor
    sample = runner._sample
    counters = []
    tolist_calls = []
    real_tolist = torch.Tensor.tolist

    def counted_sample(batch, hidden):
        counter = SyncCounter()
        counters.append(counter)
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: tolist_calls.append(t.shape) or real_tolist(t))
        try:
            with counter:
                return sample(batch, hidden)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)

    monkeypatch.setattr(runner, "_sample", counted_sample)
    outputs = engine.step()
    assert len(outputs) == 5 and len(counters) == 1
    assert counters[0].scalar_reads == 0
    assert tolist_calls == [torch.Size([5])]


@pytest.mark.parametrize("data", [[1, 2, 3], torch.arange(1, 4)])
def test_to_device_on_cpu_is_the_host_tensor(data):
    out = to_device(data, torch.int32, "cpu")
    assert out.dtype == torch.int32 and out.tolist() == [1, 2, 3] and out.device.type == "cpu"
