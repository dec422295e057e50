"""Scheduler: continuous batching, chunked prefill, preemption; pure Python (no torch)."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from steadyserve.engine.block_manager import BlockManager
from steadyserve.engine.scheduler import Scheduler, SchedulerOutput
from steadyserve.engine.sequence import Request, SamplingParams, Sequence, SequenceStatus


def make_seq(i: int, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(i, Request(f"r{i}", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens)))


def advance(sched: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """What the engine does after executing a step: count computed tokens, publish full blocks to the
    prefix cache, sample, retire."""
    finished = []
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens
        sched.block_manager.cache_full_blocks(seq, item.num_new_tokens)
        assert seq.num_computed_tokens <= seq.num_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_generated_tokens >= seq.params.max_tokens:
                sched.retire(seq)
                finished.append(seq)
    return finished


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    bm = sched.block_manager
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    holders = Counter(b for s in sched.running for b in s.block_table)  # shared prefix blocks count once each
    assert all(bm.ref_count(b) == n for b, n in holders.items()), "a block's ref count is not its holders"
    assert all(len(s.block_table) == len(set(s.block_table)) for s in sched.running)
    assert len(holders) + bm.num_free_blocks == bm.num_blocks, "a block leaked"
    assert all(not s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
    ids = [id(i.seq) for i in out.scheduled]
    assert len(ids) == len(set(ids))
    for item in out.scheduled:
        s = item.seq
        assert s.status is SequenceStatus.RUNNING and s in sched.running
        assert item.num_new_tokens >= 1
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens + item.num_new_tokens
    for s in out.preempted:
        assert s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0 and not s.block_table


def run_to_completion(sched: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> list[SchedulerOutput]:
    for s in seqs:
        sched.add(s)
    outs = []
    while sched.has_work():
        out = sched.schedule()
        check_invariants(sched, out)
        assert not out.is_empty, f"stalled with work left: {sched.running} {list(sched.waiting)}"
        advance(sched, out)
        outs.append(out)
        assert len(outs) < max_steps
    return outs


def test_scheduler_modules_do_not_import_torch():
    code = ("import sys\n"
            "import steadyserve.engine.scheduler, steadyserve.engine.block_manager\n"
            "import steadyserve.engine.sequence, steadyserve.engine.detokenizer, steadyserve.engine.stop\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_admission_is_fcfs_and_bounded_by_seats():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(i, 3) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [i.seq.request_id for i in out.scheduled] == ["r0", "r1"]
    assert [i.num_new_tokens for i in out.scheduled] == [3, 3]
    assert [s.request_id for s in sched.waiting] == ["r2", "r3"]
    advance(sched, out)
    out = sched.schedule()  # decodes only: seats are full
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("r0", 1), ("r1", 1)]


def test_token_budget_chunks_prefill_and_decodes_go_first():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=4, max_num_batched_tokens=5)
    a, b = make_seq(0, 3, max_tokens=10), make_seq(1, 12)
    sched.add(a)
    advance(sched, sched.schedule())  # a prefilled, now decoding
    sched.add(b)
    chunks = []
    while b.num_computed_tokens < b.num_prompt_tokens:
        out = sched.schedule()
        assert out.scheduled[0].seq is a and out.scheduled[0].num_new_tokens == 1  # decode never stalls
        assert out.num_tokens <= 5
        chunks.append(out.scheduled[1].num_new_tokens)
        advance(sched, out)
    assert chunks == [4, 4, 4]


def test_budget_exhaustion_stops_admission_and_spreads_a_long_prompt():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=6)
    long_, short = make_seq(0, 20), make_seq(1, 2)
    sched.add(long_)
    sched.add(short)
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("r0", 6)]
    assert list(sched.waiting) == [short]  # no budget left for it this step
    advance(sched, out)
    outs = run_to_completion(sched, [])
    assert long_.status is SequenceStatus.FINISHED and short.status is SequenceStatus.FINISHED
    assert all(o.num_tokens <= 6 for o in outs)


def test_admission_waits_for_blocks():
    sched = Scheduler(BlockManager(3, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_seq(0, 8, max_tokens=1), make_seq(1, 8, max_tokens=1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [a]  # b's 2 blocks are not there
    assert list(sched.waiting) == [b]
    advance(sched, out)  # a finishes and frees its blocks
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [b]


def test_preemption_takes_the_newest_and_it_comes_back_first():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_seq(0, 4, max_tokens=8), make_seq(1, 4, max_tokens=8)
    c = make_seq(2, 4, max_tokens=2)
    for s in (a, b):
        sched.add(s)
    advance(sched, sched.schedule())  # a, b prefilled: 1 block each, both hold 5 tokens now
    sched.add(c)
    advance(sched, sched.schedule())  # a, b decode into block 2 each -> 4 blocks used, c must wait
    assert bm.num_free_blocks == 0 and list(sched.waiting) == [c]
    # a and b keep decoding; at 8 computed tokens both need a third block: b (newest) is preempted.
    preempted = []
    for _ in range(10):
        out = sched.schedule()
        check_invariants(sched, out)
        preempted += out.preempted
        advance(sched, out)
        if preempted:
            break
    assert preempted == [b]
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.waiting[0] is b, "a preempted sequence goes back to the head of the queue"
    assert b.num_computed_tokens == 0 and b.num_tokens > b.num_prompt_tokens  # recomputes its generated tokens
    run_to_completion(sched, [])
    assert all(s.status is SequenceStatus.FINISHED for s in (a, b, c))
    assert a.num_generated_tokens == 8 and b.num_generated_tokens == 8 and c.num_generated_tokens == 2
    assert bm.num_free_blocks == bm.num_blocks


def test_a_sequence_alone_that_outgrows_the_cache_preempts_itself_not_forever_others():
    bm = BlockManager(2, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = make_seq(0, 8, max_tokens=4)  # 12 tokens never fit in 8 slots: the engine refuses it up front
    assert not bm.can_ever_fit(a.max_total_tokens)
    sched.add(a)
    advance(sched, sched.schedule())
    out = sched.schedule()  # the 9th token needs a 3rd block: it can only preempt itself
    assert out.preempted == [a] and out.is_empty
    assert bm.num_free_blocks == 2


def test_abort_running_and_waiting_frees_blocks():
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = make_seq(0, 6), make_seq(1, 6)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    assert bm.num_free_blocks == 8
    assert sched.abort("r1") is b and b.status is SequenceStatus.FINISHED and not sched.waiting
    assert sched.abort("r0") is a and a.status is SequenceStatus.FINISHED and not sched.running
    assert bm.num_free_blocks == 10 and not sched.has_work()
    assert sched.abort("r0") is None  # twice is harmless
    assert sched.abort("nope") is None


def test_abort_of_a_preempted_sequence():
    bm = BlockManager(2, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seq(0, 4, max_tokens=3), make_seq(1, 3, max_tokens=2)  # each fits alone, not together
    sched.add(a)
    sched.add(b)
    for _ in range(6):
        out = sched.schedule()
        advance(sched, out)
        if b.num_preemptions:
            break
    assert b.num_preemptions == 1 and b in sched.waiting
    assert sched.abort("r1") is b
    assert b not in sched.waiting
    run_to_completion(sched, [])
    assert bm.num_free_blocks == 2


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 12), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 6), st.integers(6, 40))
def test_random_workloads_finish_with_invariants(seed, num_blocks, block_size, max_seqs, budget):
    rng = random.Random(seed)
    budget = max(budget, max_seqs)
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    cap = num_blocks * block_size
    seqs = []
    for i in range(rng.randrange(1, 12)):
        p = rng.randrange(1, cap)
        seqs.append(make_seq(i, p, max_tokens=rng.randrange(1, cap - p + 1)))  # each fits alone
    pending = list(seqs)
    steps = 0
    aborted = set()
    while pending or sched.has_work():
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if rng.random() < 0.03 and sched.running:
            victim = rng.choice(sched.running)
            assert sched.abort(victim.request_id) is victim
            aborted.add(victim.request_id)
        out = sched.schedule()
        check_invariants(sched, out)
        if sched.has_work() and not pending:
            assert not out.is_empty or out.preempted, "stalled"
        advance(sched, out)
        steps += 1
        assert steps < 20_000
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED
        assert not s.block_table
        if s.request_id not in aborted:
            assert s.num_generated_tokens == s.params.max_tokens
    assert bm.num_free_blocks == num_blocks


def test_a_twin_waits_for_the_prefix_blocks_in_prefill_and_takes_them_from_the_cache():
    """n samples of one prompt: the first computes the prompt; the others wait at the head of the queue until its
    blocks are published, then are admitted with them as cache hits (only the rest is computed twice)."""
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=64)
    twins = [make_seq(i, 14) for i in range(3)]  # 3 full blocks and 2 tokens
    other = Sequence(9, Request("other", [50 + t for t in range(14)], SamplingParams(max_tokens=4)))
    for s in twins + [other]:
        sched.add(s)
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("r0", 14)]
    assert [s.request_id for s in sched.waiting] == ["r1", "r2", "other"]  # FCFS: nothing jumps the queue
    advance(sched, out)
    out = sched.schedule()
    new = {i.seq.request_id: i.num_new_tokens for i in out.scheduled}
    assert new == {"r0": 1, "r1": 2, "r2": 2, "other": 14}  # 12 prompt tokens each from the cache
    assert twins[1].num_cached_tokens == twins[2].num_cached_tokens == 12


def test_without_prefix_caching_or_with_prompt_logprobs_twins_do_not_wait():
    for caching, logprobs in ((False, None), (True, 0)):
        sched = Scheduler(BlockManager(100, 4, prefix_caching=caching), max_num_seqs=8, max_num_batched_tokens=64)
        seqs = [Sequence(i, Request(f"r{i}", list(range(14)), SamplingParams(max_tokens=4, prompt_logprobs=logprobs)))
                for i in range(2)]
        for s in seqs:
            sched.add(s)
        out = sched.schedule()
        assert [i.num_new_tokens for i in out.scheduled] == [14, 14], (caching, logprobs)
