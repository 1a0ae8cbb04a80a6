"""Scheduler: shared token budget, chunked prefill, limits, preemption by recompute, and
block-manager invariants after every step of a randomized run (no model: tokens are faked)."""

import random

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.stop import StopChecker
from nanovllm.sampling_params import SamplingParams

BS = 4
EOS = 0


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=32, prefix_caching=True):
    bm = BlockManager(num_blocks, BS, prefix_caching)
    return Scheduler(bm, max_num_seqs, budget)


def seq_of(tokens: list[int], params: SamplingParams) -> Sequence:
    return Sequence(tokens, params, StopChecker(params, max_model_len=256, eos_token_ids={EOS}))


def make_seq(n, max_tokens=8, start=1, ignore_eos=True):
    return seq_of(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


def run_step(sched, token=lambda seq: 7):
    batch = sched.schedule()
    sampled = [token(seq) for i, seq in enumerate(batch.seqs) if batch.samples(i)]
    advanced = sched.postprocess(batch, sampled)
    return batch, [seq for seq in advanced if seq.is_finished]


def test_long_prompt_is_chunked_and_does_not_stall_decodes():
    sched = make_scheduler(budget=16)
    short = make_seq(3, max_tokens=20)
    sched.add(short)
    run_step(sched)  # short is now decoding
    sched.add(make_seq(100, start=50))
    for _ in range(5):
        batch, _ = run_step(sched)
        assert batch.seqs[0] is short and batch.num_new_tokens[0] == 1
        assert batch.num_tokens <= 16
        assert batch.num_new_tokens[1] == 15  # the long prompt gets the rest of the budget


def test_max_num_seqs_is_honoured():
    sched = make_scheduler(max_num_seqs=3, budget=1000)
    for i in range(6):
        sched.add(make_seq(5, start=10 * i + 1))
    batch, _ = run_step(sched)
    assert len(batch) == 3 and len(sched.waiting) == 3


def test_partial_prefill_does_not_sample():
    sched = make_scheduler(budget=8)
    sched.add(make_seq(20))
    batch, _ = run_step(sched)
    assert not batch.samples(0)
    assert sched.running[0].num_computed_tokens == 8 and sched.running[0].num_completion_tokens == 0


def test_fully_cached_prompt_still_computes_its_last_token():
    sched = make_scheduler()
    first = make_seq(8, max_tokens=1)
    sched.add(first)
    run_step(sched)
    again = make_seq(8, max_tokens=1)
    sched.add(again)
    batch, finished = run_step(sched)
    assert batch.num_new_tokens == [4] and finished == [again]
    assert sched.prefix_cache_hit_tokens == 4


def test_preemption_takes_newest_and_sequence_resumes():
    # 6 blocks of 4 = 24 slots; two sequences of 8 prompt tokens growing to 20 each cannot both fit.
    sched = make_scheduler(num_blocks=6, budget=64, prefix_caching=False)
    old, new = make_seq(8, max_tokens=12), make_seq(8, max_tokens=12, start=100)
    sched.add(old)
    sched.add(new)
    finished = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        _, done = run_step(sched)
        finished += done
        sched.block_manager.check_invariants(sched.running)
    assert sched.num_preemptions > 0
    assert finished[0] is old  # the older sequence was never the victim
    assert all(s.num_completion_tokens == 12 for s in (old, new))


def test_eos_stops_unless_ignored_and_length_stops():
    sched = make_scheduler()
    stops, ignores = make_seq(3, ignore_eos=False), make_seq(3, max_tokens=2, start=20)
    sched.add(stops)
    sched.add(ignores)
    _, finished = run_step(sched, token=lambda seq: EOS)
    assert finished == [stops] and stops.finish_reason == "stop"
    _, finished = run_step(sched, token=lambda seq: EOS)
    assert finished == [ignores] and ignores.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_randomized_run_keeps_invariants():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=40, max_num_seqs=6, budget=24)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(3)]
    seqs = []
    for _ in range(30):
        tokens = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
        seq = seq_of(tokens, SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=rng.random() < 0.5))
        seqs.append(seq)
        sched.add(seq)
    steps = 0
    while sched.has_unfinished():
        batch, _ = run_step(sched, token=lambda seq: rng.randrange(0, 50))
        assert batch.num_tokens <= 24 and len(sched.running) <= 6
        sched.block_manager.check_invariants(sched.running)
        steps += 1
        assert steps < 2000
    assert all(s.status == SequenceStatus.FINISHED for s in seqs)
    assert sched.block_manager.num_free_blocks == 40
    assert sched.prefix_cache_hit_tokens > 0


def test_prefix_hits_are_counted_once_when_admission_waits_for_blocks():
    sched = make_scheduler(num_blocks=5, budget=64)
    first = make_seq(8, max_tokens=1)
    sched.add(first)
    run_step(sched)  # its two full blocks are now cached and free
    hog = make_seq(8, max_tokens=4, start=100)
    sched.add(hog)
    run_step(sched)
    again = seq_of(first.token_ids[:8] + list(range(60, 68)), SamplingParams(max_tokens=1, ignore_eos=True))
    sched.add(again)
    steps_waited = 0
    while again.status == SequenceStatus.WAITING:  # the hit plus two new blocks do not fit beside hog
        run_step(sched)
        steps_waited += 1
    assert steps_waited > 1
    assert sched.prefix_cache_hit_tokens == 8


def test_later_streams_join_in_the_step_that_completes_the_first_prompt():
    from nanovllm.engine.sequence import Request
    sched = make_scheduler(budget=16)
    request = Request("n4", None, list(range(1, 39)), SamplingParams(n=4, max_tokens=2, ignore_eos=True))
    for seq in request.seqs:
        sched.add(seq)
    short = make_seq(3, max_tokens=2, start=80)
    sched.add(short)
    first, *later = request.seqs
    for _ in range(2):
        batch, _ = run_step(sched)
        assert batch.seqs == [first] and batch.num_new_tokens == [16]
    # The last 6 prompt tokens, the later streams' own last 2 (the first 9 blocks are shared),
    # and the request behind them, all in one step.
    batch, _ = run_step(sched)
    assert batch.seqs == [first, *later, short] and batch.num_new_tokens == [6, 2, 2, 2, 3]
    assert all(seq.block_table[:9] == first.block_table[:9] for seq in later)
    while sched.has_unfinished():
        run_step(sched)
        sched.block_manager.check_invariants(sched.running)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_every_published_hash_is_its_blocks_whole_chain():
    """Two equal prompts in one step, one with n=2: the duplicate's blocks stay unpublished,
    and its later stream (which shares them) must still hash its own blocks from the prompt's
    start, never from a gap."""
    from nanovllm.engine.block_manager import block_hash
    from nanovllm.engine.sequence import Request
    sched = make_scheduler(budget=64)
    prompt = list(range(1, 11))  # two full blocks and a partial one
    sched.add(make_seq(10, max_tokens=8))
    for seq in Request("n2", None, prompt, SamplingParams(n=2, max_tokens=8, ignore_eos=True)).seqs:
        sched.add(seq)
    while sched.has_unfinished():
        run_step(sched, token=lambda seq: 20 + seq.num_tokens)
        for seq in sched.running:
            parent = None
            for i, h in enumerate(seq.block_hashes):
                parent = block_hash(seq.token_ids[i * BS:(i + 1) * BS], parent)
                assert h == parent
    for h, block_id in sched.block_manager.hash_to_block.items():
        assert sched.block_manager.blocks[block_id].hash == h
