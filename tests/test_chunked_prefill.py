"""The ragged step (chunked prefill mixed with decode), first without the model: a fake step stands in
for the engine (every sampled sequence gets token 7; a sequence stops at its max_tokens) and the KV
cache manager's invariants are checked after every step. Pinned: decode rows first, the token budget
and the per-prompt cap, sampling only once a whole prompt is in the cache, prefix-cache blocks shared
only once their chunk is scheduled, a prefilling group preempted by recompute in both modes, n > 1
forking at its prompt's end, and no block leaked over random workloads. Then on the real model: the
tokens of the prefill-first policy, over a mix with long prompts, at several budgets."""

from __future__ import annotations

import random

import pytest
import test_scheduler
from conftest import chat_token_ids
from test_scheduler import TOKEN

from jpaged.core.sequence import GroupStatus


class Harness(test_scheduler.Harness):
    """The scheduler tests' harness under the ragged policy, checking every step's rows: a row that
    samples ends its sequence's tokens, and a decode step is one of one token a row."""

    def __init__(self, num_blocks: int, **kwargs):
        kwargs.setdefault("enable_chunked_prefill", True)
        super().__init__(num_blocks, **kwargs)

    def step(self):
        out = super().step()
        for row, seqs in zip(out.rows, out.row_seqs):
            for seq in seqs:  # the token just appended follows the row's last
                assert row.start_position + len(row.token_ids) == seq.num_tokens - 1
        assert not out.rows or out.is_decode == all(len(r.token_ids) == 1 for r in out.rows)
        return out

    def run(self, max_steps: int = 1000) -> list:
        outs = []
        while self.scheduler.has_unfinished():
            outs.append(self.step())
            assert len(outs) < max_steps, "the scheduler made no progress"
        return outs


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode():
    h = Harness(num_blocks=64, max_num_batched_tokens=8)
    a = h.add("a", 3, arrival=0.0)
    out = h.step()  # a's whole prompt fits the budget: it samples at once
    assert [len(r.token_ids) for r in out.rows] == [3] and out.row_seqs[0] == a.seqs
    b = h.add("b", 30, arrival=1.0)  # 30 tokens under a budget of 8: a decodes, b takes the 7 left
    sizes = []
    while not b.seqs[0].output_token_ids:
        out = h.step()
        assert out.rows[0].token_ids == [TOKEN] and out.row_seqs[0] == a.seqs, "decode rows come first"
        assert out.num_tokens <= 8
        sizes.append(len(out.rows[1].token_ids))
        assert (out.row_seqs[1] == b.seqs) == (sum(sizes) == 30), "b samples only with its prompt's last token"
    assert sizes == [7, 7, 7, 7, 2] and len(a.seqs[0].output_token_ids) == 6
    assert b.status is GroupStatus.RUNNING and not b.num_computed_tokens
    out = h.step()
    assert out.is_decode and len(out.rows) == 2


def test_the_per_prompt_cap_lets_two_long_prompts_progress_together():
    h = Harness(num_blocks=64, max_num_batched_tokens=10, long_prefill_token_threshold=4)
    a, b = h.add("a", 9, arrival=0.0), h.add("b", 9, arrival=1.0)
    out = h.step()
    assert [len(r.token_ids) for r in out.rows] == [4, 4] and not any(out.row_seqs)
    out = h.step()
    assert [len(r.token_ids) for r in out.rows] == [4, 4]
    out = h.step()  # each has 1 left: both finish and sample
    assert [len(r.token_ids) for r in out.rows] == [1, 1] and out.is_decode
    assert out.row_seqs == [a.seqs, b.seqs]


def test_the_first_prefilling_group_progresses_even_when_decodes_fill_the_budget():
    h = Harness(num_blocks=64, max_num_batched_tokens=2, max_num_seqs=4)
    h.add("a", 2, arrival=0.0), h.add("b", 2, arrival=1.0)
    h.step(), h.step()  # a's 2 tokens; a's decode and b's first token
    c = h.add("c", 5, arrival=2.0)
    steps = 0
    while not c.seqs[0].output_token_ids:
        out = h.step()
        steps += 1
        assert out.num_tokens <= 2 + 4  # the budget plus at most max_num_seqs
        assert steps < 10
    # one step waits (b's last token takes what a's decode leaves), then one token a step, whatever the
    # two decodes take of the budget
    assert steps == 6


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_group_preempted_while_prefilling_is_recomputed_in_both_modes(mode):
    h = Harness(num_blocks=9, mode=mode, max_num_batched_tokens=4)  # 8 usable blocks of 4 slots
    a = h.add("a", 8, arrival=0.0)  # 2 blocks, grows
    h.step(), h.step()  # a prefilled (4 + 4, samples at the second)
    b = h.add("b", 20, arrival=1.0, max_tokens=4)  # 5 blocks: the pool is full, b is prefilled in chunks of 3
    h.step()
    assert b.num_computed_tokens and b.status is GroupStatus.RUNNING
    for _ in range(6):
        out = h.step()
        if out.preempted:
            break
    assert [g.request_id for g in out.preempted] == ["b"], "a's growth preempts b, the latest arrival"
    assert b.status is GroupStatus.WAITING and not b.num_computed_tokens, "never swapped while prefilling"
    assert not any(h.scheduler.block_manager.has(s.seq_id) for s in b.seqs)
    h.scheduler.finish_seq(a.seqs[0], "length")
    h.scheduler.finish_group(a)
    h.run()
    assert h.scheduler.block_manager.num_free_blocks == 8


def test_n_samples_fork_when_their_prompt_is_in_the_cache():
    h = Harness(num_blocks=64, max_num_batched_tokens=5)
    g = h.add("g", 10, n=3)  # 2 full blocks and one of 2 tokens
    outs = [h.step() for _ in range(2)]
    assert [len(o.rows[0].token_ids) for o in outs] == [5, 5]
    assert [len(seqs) for o in outs for seqs in o.row_seqs] == [0, 3]
    bm = h.scheduler.block_manager
    assert all(bm.block_table(s.seq_id) == bm.block_table(g.seqs[0].seq_id) for s in g.seqs)
    out = h.step()
    assert out.is_decode and len(out.rows) == 3  # the shared last block: copy-on-write for two of them
    assert len(out.ops.copy_pairs) == 2


def test_a_recomputed_group_of_several_sequences_samples_them_all_in_one_step():
    h = Harness(num_blocks=11, max_num_batched_tokens=6)  # 10 blocks of 4
    a = h.add("a", 4, arrival=0.0, max_tokens=3)
    g = h.add("g", 6, n=2, arrival=1.0)
    while not g.seqs[0].output_token_ids:
        h.step()
    g_tokens = [s.num_tokens for s in g.live_seqs]
    # force g back to the waiting queue, as a preemption by recompute does
    h.scheduler.running.remove(g)
    h.scheduler._release(g)
    g.status = GroupStatus.WAITING
    h.scheduler.waiting.appendleft(g)
    sampled_in = []
    while len(g.seqs[0].output_token_ids) < 2 and g.live_seqs:
        out = h.step()
        sampled = [s for seqs in out.row_seqs for s in seqs if s in g.seqs]
        if sampled:
            sampled_in.append(len(sampled))
    assert sampled_in[0] == 2, "both of g's sequences sample in the same step"
    assert g_tokens == [7, 7]
    del a


def test_prefix_cache_blocks_are_shared_only_once_their_chunk_is_scheduled():
    h = Harness(num_blocks=64, max_num_batched_tokens=8, long_prefill_token_threshold=4, prefix_caching=True)
    prompt = list(range(100, 132))  # 8 blocks of 4
    a = h.add("a", prompt, arrival=0.0)
    h.step()  # a's first 4 tokens: block 0
    b = h.add("b", prompt + [5, 6], arrival=1.0)
    h.step()  # a's next 4 (block 1, written in this step); b admitted after it
    assert b.num_cached_tokens == 8, "b shares the blocks scheduled so far, this step's included, no more"
    h.run()
    assert h.scheduler.block_manager.num_free_blocks == 63
    del a


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_leak_no_block_and_respect_the_budget(seed):
    rnd = random.Random(seed)
    mode = rnd.choice(["recompute", "swap"])
    budget, max_seqs = rnd.choice([1, 3, 8, 20]), rnd.choice([2, 4, 8])
    h = Harness(num_blocks=rnd.choice([12, 20, 40]), mode=mode, prefix_caching=rnd.random() < 0.5,
                max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                long_prefill_token_threshold=rnd.choice([0, 0, 5]), watermark=rnd.choice([0.0, 0.1]))
    shared = [rnd.randrange(50) for _ in range(12)]
    groups = []
    for i in range(14):
        length = rnd.randrange(1, 30)
        prompt = (shared[:rnd.randrange(13)] + [rnd.randrange(50) for _ in range(length)])[:30] or [1]
        groups.append(h.add(f"r{i}", prompt, max_tokens=rnd.randrange(1, 8), n=rnd.choice([1, 1, 2]),
                            arrival=float(i)))
    steps = 0
    while h.scheduler.has_unfinished():
        out = h.step()
        assert out.num_tokens <= budget + max_seqs
        steps += 1
        assert steps < 2000
    assert h.scheduler.block_manager.num_free_blocks == h.scheduler.block_manager.num_blocks - 1
    for g in groups:
        assert g.is_finished
        for s in g.seqs:
            assert s.finish_reason == "length"


# ---- on the real model: the ragged step gives the prefill-first policy's tokens -------------------

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def mix(default_model, alpaca_prompts):
    """(prompts, params): chat prompts of ~40-90 tokens, two long ones (~300 and ~500 tokens: several
    times the smaller budgets), a shared-prefix pair (prefix caching), greedy, seeded, n = 2 and beam
    search requests."""
    from jpaged import SamplingParams

    tok = default_model.tokenizer
    chat = [chat_token_ids(tok, p) for p in alpaca_prompts[:8]]
    long_a = sum((list(tok(p, add_special_tokens=False).input_ids) for p in alpaca_prompts[8:28]), [])[:300]
    long_b = sum((list(tok(p, add_special_tokens=False).input_ids) for p in alpaca_prompts[28:60]), [])[:500]
    prompts = [long_a, chat[0], chat[1], long_b, chat[2], long_a + chat[3][:20], chat[4], chat[5]]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True), greedy,
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, n=2, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(beam_width=2, max_tokens=MAX_TOKENS, ignore_eos=True), greedy,
              SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True), greedy]
    return prompts, params


def _tokens(llm, mix, waves: int = 2):
    """Each request's tokens, the mix sent in `waves` waves (a later wave finds an earlier one's
    prefixes cached)."""
    prompts, params = mix
    size = -(-len(prompts) // waves)
    outs = []
    for start in range(0, len(prompts), size):
        outs += llm.generate(prompts[start:start + size], params[start:start + size], use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def prefill_first_tokens(make_llm, mix):
    llm = make_llm(num_blocks=512, enable_chunked_prefill=False)
    return _tokens(llm, mix)


@pytest.mark.parametrize("budget, blocks, mode, caching, cap", [
    (32, 512, "recompute", True, 0),   # a budget smaller than most prompts, prefix caching
    (128, 36, "recompute", True, 48),  # a small pool: preemption by recompute, a per-prompt cap
    (96, 36, "swap", False, 0),        # preemption by swap
])
def test_the_ragged_step_gives_the_prefill_first_tokens(make_llm, mix, prefill_first_tokens, budget, blocks,
                                                        mode, caching, cap):
    llm = make_llm(num_blocks=blocks, max_num_batched_tokens=budget, preemption_mode=mode, watermark=0.0,
                   swap_space=0.25 if mode == "swap" else 0.0, enable_prefix_caching=caching,
                   long_prefill_token_threshold=cap)
    records = []
    llm.engine.add_observer(records.append)
    assert _tokens(llm, mix, waves=2 if blocks == 512 else 1) == prefill_first_tokens
    stats = llm.engine.stats()
    if blocks < 512:
        assert stats["num_preemptions"] > 0, "the pool was meant to be too small"
    if caching:
        assert stats["prefix_cache_hit_rate"] > 0
    mixed = [r for r in records if r.kind == "prefill" and r.num_sampled_tokens and r.num_rows > 1]
    assert mixed, "some step mixed decode rows with prompt chunks"
    assert max(r.num_computed_tokens for r in records) <= budget + llm.engine.scheduler.config.max_num_seqs
    assert stats["num_free_blocks"] == llm.engine.num_blocks - 1 and stats["num_used_cpu_blocks"] == 0
    llm.engine.scheduler.block_manager.check_invariants()
