"""The engine on the real model: preemption, parallel sampling, prefix caching, abort, threads.

Every comparison is against a run that cannot be wrong in the same way: the same requests with
ample memory (no preemption), n separate single-sample requests, prefix caching off.
"""

from __future__ import annotations

import threading

import jax
import pytest

from jpaged import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(alpaca_prompts):
    return alpaca_prompts[:32]


@pytest.fixture(scope="module")
def reference_tokens(default_model, prompts):
    """Greedy tokens with a pool large enough that nothing is ever preempted."""
    llm = LLM(loaded=default_model, num_blocks=1024)
    outs = llm.generate([llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.stats()["num_preemptions"] == 0
    return [o.outputs[0].token_ids for o in outs]


def chat(llm, prompts):
    return [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]


def assert_all_free(llm):
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == llm.engine.num_blocks - 1, stats
    assert stats["num_used_cpu_blocks"] == 0, stats
    llm.engine.scheduler.block_manager.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_same_tokens(default_model, prompts, reference_tokens, mode):
    # 32 prompts of ~40-90 tokens + 20 new each need ~6 blocks of 16: 64 blocks hold about ten at a time
    llm = LLM(loaded=default_model, num_blocks=64, preemption_mode=mode, swap_space=0.25)
    outs = llm.generate(chat(llm, prompts), GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small"
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens
    assert sum(o.metrics.num_preemptions for o in outs) == stats["num_preemptions"]
    assert_all_free(llm)


def test_group_that_cannot_grow_alone_finishes_with_length(default_model):
    llm = LLM(loaded=default_model, num_blocks=4, block_size=4)  # 3 usable blocks = 12 token slots
    (out,) = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=20,
                                                                       ignore_eos=True), use_tqdm=False)
    o = out.outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 12 - 9 + 1  # prompt 9 + 3 decoded slots + 1
    assert_all_free(llm)


def test_parallel_samples_equal_separate_seeded_requests(default_model, prompts):
    llm = LLM(loaded=default_model, num_blocks=256)
    n, seed = 4, 1234
    sampling = dict(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12)
    prompt = chat(llm, prompts[:1])[0]
    engine = llm.engine
    engine.add_request("group", prompt, SamplingParams(n=n, seed=seed, **sampling))
    engine.step()  # prefill: one row for the prompt, n samples drawn from it
    bm = engine.scheduler.block_manager
    group = engine.scheduler.running[0]
    tables = [bm.block_table(s.seq_id) for s in group.seqs]
    assert all(t == tables[0] for t in tables)  # the prompt's blocks are held once ...
    assert all(bm.refcount(b) == n for b in tables[0])  # ... with refcount n
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    together = [o.token_ids for o in results["group"].outputs]
    separate = llm.generate([prompt] * n, [SamplingParams(n=1, seed=seed + i, **sampling) for i in range(n)],
                            use_tqdm=False)
    assert together == [o.outputs[0].token_ids for o in separate]
    assert len({tuple(t) for t in together}) > 1  # the samples differ from each other
    assert_all_free(llm)


def test_seeded_request_ignores_its_batch(default_model, prompts):
    llm = LLM(loaded=default_model, num_blocks=256)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=7)
    alone = llm.generate(chat(llm, prompts[:1]), params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(chat(llm, prompts[:6]), [params] + [SamplingParams(temperature=1.0, max_tokens=16)] * 5,
                         use_tqdm=False)
    assert crowd[0].outputs[0].token_ids == alone


def test_prefix_caching_same_outputs_fewer_prefilled_tokens(default_model, prompts):
    system = ("You are a meticulous assistant for a library. Answer briefly, cite the catalogue rule you "
              "used, and never invent titles. Rules: 1. Books are due in three weeks. 2. Renewals are "
              "allowed twice. 3. Reference works stay in the building. 4. Fines are waived for children.")
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": p}] for p in prompts[:8]]
    params = SamplingParams(temperature=0, max_tokens=12)
    results = {}
    for caching in (False, True):
        llm = LLM(loaded=default_model, num_blocks=256, enable_prefix_caching=caching)
        outs = []
        for conversation in conversations:  # one after another: later requests find the cached prefix
            outs += llm.chat(conversation, params, use_tqdm=False)
        results[caching] = ([o.outputs[0].token_ids for o in outs], llm.engine.stats())
        assert_all_free(llm)
    assert results[True][0] == results[False][0]
    on, off = results[True][1], results[False][1]
    assert on["prefix_cache_hit_rate"] > 0.5 and off["prefix_cache_hit_rate"] == 0
    assert on["num_prefilled_tokens"] < 0.5 * off["num_prefilled_tokens"]


def test_logprobs_and_stop_strings(default_model, prompts):
    llm = LLM(loaded=default_model, num_blocks=128)
    prompt = chat(llm, ["List three colors, one per line."])[0]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, logprobs=3), use_tqdm=False)
    o = out.outputs[0]
    assert len(o.logprobs) == len(o.token_ids)
    for token, top in zip(o.token_ids, o.logprobs):
        assert len(top) == 3 and max(top, key=top.get) == token  # greedy picks the most likely token
    assert abs(sum(top[t] for t, top in zip(o.token_ids, o.logprobs)) - o.cumulative_logprob) < 1e-3
    stop = o.text.split("\n")[1][:3]  # a string that occurs in the greedy text
    (cut,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)
    assert cut.outputs[0].finish_reason == "stop" and stop not in cut.outputs[0].text
    assert o.text.startswith(cut.outputs[0].text)


def test_streamed_text_is_never_retracted(default_model):
    llm = LLM(loaded=default_model, num_blocks=128)
    engine = llm.engine
    prompt = llm.chat_prompt([{"role": "user", "content": "Count from one to ten in words."}])
    (full,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 5]  # occurs in the greedy text, spans several tokens
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop, "zzz-never"]))
    seen = ""
    while engine.has_unfinished():
        for out in engine.step():
            streamed = out.outputs[0].text
            assert streamed.startswith(seen)  # only ever extended
            seen = streamed
    assert out.outputs[0].finish_reason == "stop"
    assert seen == text[:text.index(stop)]


@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_abort_returns_every_block(default_model, prompts, where):
    llm = LLM(loaded=default_model, num_blocks=32, preemption_mode="swap", swap_space=0.25, max_num_seqs=8)
    engine = llm.engine
    for i, prompt in enumerate(chat(llm, prompts[:8])):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=32, ignore_eos=True, n=2))
    scheduler = engine.scheduler
    for _ in range(100):
        engine.step()
        queue = {"waiting": scheduler.waiting, "running": scheduler.running, "swapped": scheduler.swapped}[where]
        if queue:
            break
    assert queue, f"never saw a {where} request"
    victim = queue[-1]
    engine.abort(victim.request_id)
    (aborted,) = [o for o in engine.step() if o.request_id == victim.request_id]
    assert aborted.finished and all(o.finish_reason == "abort" for o in aborted.outputs)
    assert all(victim not in q for q in (scheduler.waiting, scheduler.running, scheduler.swapped))
    bm = scheduler.block_manager
    assert not any(bm.has(s.seq_id) for s in victim.seqs)  # no device or CPU block left behind
    bm.check_invariants()
    others = [g.request_id for q in (scheduler.waiting, scheduler.running, scheduler.swapped) for g in q]
    for request_id in others:
        engine.abort(request_id)
    engine.step()
    assert not engine.has_unfinished()
    assert_all_free(llm)


def test_add_and_abort_from_another_thread(default_model, prompts):
    llm = LLM(loaded=default_model, num_blocks=256)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    finished = {}
    done = threading.Event()

    def producer():
        for i, prompt in enumerate(chat(llm, prompts[:10])):
            engine.add_request(f"t{i}", prompt, params)
            if i % 3 == 2:
                engine.abort(f"t{i}")
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    while not done.is_set() or engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    thread.join()
    assert set(finished) == {f"t{i}" for i in range(10)}
    for i in range(10):
        reasons = {o.finish_reason for o in finished[f"t{i}"].outputs}
        assert reasons <= ({"abort", "length"} if i % 3 == 2 else {"length"})
    assert_all_free(llm)


def test_bad_request_rejected_others_complete(default_model, prompts):
    llm = LLM(loaded=default_model, num_blocks=128, max_model_len=256)
    engine = llm.engine
    engine.add_request("ok", chat(llm, prompts[:1])[0], GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("long", list(range(300)), GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", "again", GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["ok"] and len(outs[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_the_default_token_budget(default_model):
    """On a CPU with chunked prefill, a step computes at most 4096 tokens by default (vLLM's CPU default);
    without chunked prefill, a whole prompt of the context must fit one step."""
    chunked = LLM(loaded=default_model, num_blocks=64)
    whole = LLM(loaded=default_model, num_blocks=64, enable_chunked_prefill=False)
    assert chunked.engine.max_model_len == whole.engine.max_model_len == 8192
    expected = 4096 if jax.default_backend() == "cpu" else 8192
    assert chunked.engine.scheduler.config.max_num_batched_tokens == expected
    assert whole.engine.scheduler.config.max_num_batched_tokens == 8192
    budget = LLM(loaded=default_model, num_blocks=64, max_num_batched_tokens=8192)
    assert budget.engine.scheduler.config.max_num_batched_tokens == 8192
