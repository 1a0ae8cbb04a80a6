"""AsyncLLMEngine in-process: concurrent streams, validation before queueing, abort, shutdown,
a failed step, and an idle engine thread that sleeps instead of spinning."""

import asyncio
import os
import time

import pytest

from conftest import make_tiny_checkpoint
from nanovllm import LLM, SamplingParams
from nanovllm.engine.async_engine import AsyncLLMEngine, EngineDeadError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("async-ckpt"))


@pytest.fixture
def engine(checkpoint):
    engine = AsyncLLMEngine(LLM(str(checkpoint), dtype="float32", num_kvcache_blocks=64).llm_engine)
    engine.start()
    yield engine
    engine.shutdown()


async def final_outputs(stream) -> dict:
    return {output.request_id: output async for output in stream if output.finished}


def test_concurrent_requests_match_offline(engine, checkpoint):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20]
    expected = LLM(str(checkpoint), dtype="float32", num_kvcache_blocks=64).generate(prompts, GREEDY, use_tqdm=False)

    async def run():
        streams = [await engine.add_requests([f"r{i}"], [p], GREEDY) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(final_outputs(s) for s in streams))

    finals = asyncio.run(run())
    assert [f[f"r{i}"].outputs[0].token_ids for i, f in enumerate(finals)] == [e.outputs[0].token_ids for e in expected]
    assert engine.metrics["num_free_blocks"] == engine.metrics["num_kvcache_blocks"]


def test_bad_prompt_raises_before_anything_is_queued(engine):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_requests(["ok", "too-long"], [[1, 2], [1] * 300], GREEDY)
        return await final_outputs(await engine.add_requests(["ok"], [[1, 2]], GREEDY))  # the id is free

    assert asyncio.run(run())["ok"].outputs[0].finish_reason == "length"


def test_abort_returns_blocks(engine):
    async def run():
        stream = await engine.add_requests(["long"], [[1, 2, 3]], LONG)
        await stream.__anext__()
        stream.abort()
        for _ in range(200):
            if engine.metrics["num_running"] == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert engine.metrics["num_free_blocks"] == engine.metrics["num_kvcache_blocks"]
    assert engine.metrics["generation_tokens"] < LONG.max_tokens


def test_shutdown_aborts_running_streams(engine):
    async def run():
        stream = await engine.add_requests(["long"], [[1, 2, 3]], LONG)
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        last = [output async for output in stream][-1]
        assert last.outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError, match="shutting down"):
            await engine.add_requests(["late"], [[1]], GREEDY)

    asyncio.run(run())


def test_failed_step_fails_streams_and_later_requests(engine):
    def broken_step():
        raise RuntimeError("boom")

    engine.engine.step = broken_step

    async def run():
        stream = await engine.add_requests(["doomed"], [[1, 2]], GREEDY)
        with pytest.raises(EngineDeadError, match="boom"):
            await stream.__anext__()
        with pytest.raises(EngineDeadError, match="boom"):
            await engine.add_requests(["late"], [[1]], GREEDY)

    asyncio.run(run())
    assert not engine.is_alive


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads thread CPU time from /proc")
def test_idle_engine_thread_sleeps(engine):
    def cpu_ticks() -> int:
        with open(f"/proc/self/task/{engine._thread.native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    before = cpu_ticks()
    time.sleep(0.5)
    assert cpu_ticks() - before <= 1
