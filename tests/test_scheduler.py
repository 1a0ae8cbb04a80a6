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
    return batch, [seq for seq, _ in advanced if seq.is_finished]


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


def test_drafts_are_verified_and_only_accepted_tokens_keep_their_kv():
    """A decoding sequence with drafts computes them in its step; the accepted ones and the token
    after them are appended, KV counts only up to them, blocks only rejected drafts filled go back
    to the pool, and the prefix cache hashes accepted tokens alone."""
    sched = make_scheduler(budget=16)
    seq = make_seq(6, max_tokens=20)
    sched.add(seq)
    run_step(sched)  # prompt: 6 tokens, then token 7 sampled
    assert (seq.num_tokens, seq.num_computed_tokens, len(seq.block_table)) == (7, 6, 2)
    seq.draft_token_ids = [8, 9, 10, 11, 12]
    batch = sched.schedule()
    assert batch.num_new_tokens == [6] and batch.drafts == [[8, 9, 10, 11, 12]] and batch.samples(0)
    assert len(seq.block_table) == 3  # 6 computed + 6 new = 12 slots
    # The model agreed with two drafts (8, 9), then sampled 5 where 10 was drafted.
    [(advanced, appended)] = sched.postprocess(batch, [8, 9, 5], [3])
    assert advanced is seq and appended == 3
    assert seq.token_ids[6:] == [7, 8, 9, 5] and seq.num_computed_tokens == 9
    assert len(seq.block_table) == 3  # positions 0-9 (the next step writes token 5 at 9)
    assert len(seq.block_hashes) == 2  # blocks [1..4], [5, 6, 7, 8]: computed and full
    sched.block_manager.check_invariants([seq])
    # All rejected, with the rejected drafts' block freed at once.
    seq.draft_token_ids = [1, 2, 3, 4, 5, 6]
    batch = sched.schedule()
    assert len(seq.block_table) == 4
    sched.postprocess(batch, [3], [1])
    assert seq.num_computed_tokens == 10 and seq.num_tokens == 11 and len(seq.block_table) == 3
    sched.block_manager.check_invariants([seq])


def test_drafts_are_cut_to_the_budget_and_a_stop_ends_the_sequence_mid_draft():
    sched = make_scheduler(budget=4)
    seq = make_seq(3, max_tokens=5)
    sched.add(seq)
    run_step(sched)
    seq.draft_token_ids = [8, 9, 10, 11, 12]
    batch = sched.schedule()
    assert batch.num_new_tokens == [4] and batch.drafts == [[8, 9, 10]]
    # Every draft accepted, one token after them: max_tokens (5) ends it at the fourth token emitted.
    [(_, appended)] = sched.postprocess(batch, [8, 9, 10, 13], [4])
    assert appended == 4 and seq.is_finished and seq.completion_token_ids == [7, 8, 9, 10, 13]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
