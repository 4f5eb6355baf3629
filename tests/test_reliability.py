"""Trying hard to break jpaged: bad requests, exhaustion, aborts, faults, fuzzing and a soak.

Every check is against a run that cannot be wrong the same way: the same good requests alone, or
with ample memory, must give exactly the same tokens; and every block must come back. (Corrupt
model files: tests/test_loader.py; the CLI's bad input: tests/test_cli.py.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import random
import re
import resource
import time

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from jpaged import SamplingParams
from jpaged.core.sequence import GroupStatus

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def chats(llm, texts):
    return [llm.chat_prompt([{"role": "user", "content": t}]) for t in texts]


def run_all(engine, deadline_s: float = 600.0, on_step=None) -> dict:
    """Steps until nothing is left, checking the KV cache manager after every step; fails on a
    livelock (the wall-clock deadline). Returns the finished outputs by request id."""
    finished, start = {}, time.monotonic()
    while engine.has_unfinished():
        assert time.monotonic() - start < deadline_s, "the engine did not finish: a livelock?"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.scheduler.block_manager.check_invariants()
        if on_step is not None:
            on_step()
    return finished


def assert_all_free(engine) -> None:
    stats = engine.stats()
    assert stats["num_free_blocks"] == engine.num_blocks - 1 and stats["num_seqs"] == 0, stats
    assert stats["num_used_cpu_blocks"] == 0, stats
    assert not engine.has_unfinished()


def tokens(outputs: dict) -> dict:
    return {rid: [o.token_ids for o in out.outputs] for rid, out in outputs.items()}


# ---------------------------------------------------------------- 1. a catalogue of bad requests

def bad_requests(llm):
    """(name, the call that must raise ValueError, what the message must say)."""
    engine = llm.engine
    vocab = engine.model.config.vocab_size
    context = engine.max_model_len
    prompt = "Name a color."
    params = lambda **kw: SamplingParams(**kw)  # noqa: E731
    add = lambda p, sp=None, rid="bad": lambda: engine.add_request(rid, p, sp)  # noqa: E731
    return [
        ("empty prompt", add(""), "prompt is empty"),
        ("blank prompt", add(" \n\t "), "prompt is empty"),
        ("no token ids", add([]), "prompt is empty: give at least one token id"),
        ("token id past the vocabulary", add([1, vocab]), f"token id {vocab} is outside the vocabulary"),
        ("negative token id", add([5, -1]), "token id -1 is outside the vocabulary"),
        ("a number as prompt", add(3.5), "a prompt must be a string or a list of token ids, got float"),
        ("None as prompt", add(None), "a prompt must be a string or a list of token ids, got NoneType"),
        ("bytes as prompt", add(b"hello"), "a prompt must be a string or a list of token ids, got bytes"),
        ("floats as token ids", add([1.0, 2.0]), "a list of token ids holds integers only, got float 1.0"),
        ("bools as token ids", add([True, False]), "a list of token ids holds integers only, got bool True"),
        ("no ids in a prompt dict", add({"prompt_token_ids": None}), "prompt_token_ids must be a list of token "
         "ids, got NoneType"),
        ("text as ids in a prompt dict", add({"prompt_token_ids": "hello"}), "prompt_token_ids must be a list"),
        ("arrival time not a number", lambda: engine.add_request("bad", prompt, None, "abc"),
         "arrival_time must be None or a number"),
        ("longer than the context", add([42] * context), f"the model's context is {context}"),
        ("larger than the KV pool", add([42] * (16 * engine.num_blocks)), "KV blocks of 16 tokens but the pool has"),
        ("n < 1", lambda: params(n=0), "n must be an integer >= 1"),
        ("n not an integer", lambda: params(n=2.5), "n must be an integer >= 1"),
        ("n above max_num_seqs", add(prompt, params(n=9, temperature=0.5)), "max_num_seqs=8"),
        ("n > 1 with greedy sampling", lambda: params(n=3, temperature=0), "3 identical samples"),
        ("beam width < 1", lambda: params(beam_width=0), "beam_width must be an integer >= 1"),
        ("beam search with n > 1", lambda: params(beam_width=2, n=2), r"either n > 1 \(sampling\) or beam_width"),
        ("beam search with a temperature", lambda: params(beam_width=2, temperature=0.7), "beam search is deterministic"),
        ("beam search with top-k", lambda: params(beam_width=2, top_k=5), "beam search is deterministic"),
        ("beam search with stop strings", lambda: params(beam_width=2, stop=["x"]), "stop strings are not supported"),
        ("top_p of 0", lambda: params(top_p=0), r"top_p must be in \(0, 1\]"),
        ("top_p above 1", lambda: params(top_p=1.5), r"top_p must be in \(0, 1\]"),
        ("negative top_k", lambda: params(top_k=-2), "top_k must be an integer in \\[0, 2"),
        ("top_k past int32", lambda: params(top_k=2**31), "top_k must be an integer in \\[0, 2"),
        ("negative temperature", lambda: params(temperature=-0.5), "temperature must be a number >= 0"),
        ("NaN temperature", lambda: params(temperature=float("nan")), "temperature must be a number >= 0"),
        ("max_tokens of 0", lambda: params(max_tokens=0), "max_tokens must be an integer >= 1"),
        ("max_tokens not an integer", lambda: params(max_tokens=1.5), "max_tokens must be an integer >= 1"),
        ("stop as a number", lambda: params(stop=5), "stop must be a string or a list of non-empty strings"),
        ("an empty stop string", lambda: params(stop=["ok", ""]), "stop must be a string or a list of non-empty"),
        ("stop token ids of the wrong type", lambda: params(stop_token_ids=["x"]), "stop_token_ids must be a list of integers"),
        ("logprobs above 20", lambda: params(logprobs=21), r"logprobs must be None or an integer in \[0, 20\]"),
        ("a negative seed", lambda: params(seed=-1), r"seed must be None or an integer in \[0, 2\*\*32\)"),
        ("params not SamplingParams", add(prompt, {"max_tokens": 3}), "params must be a SamplingParams, got dict"),
        ("a duplicate request id", add(prompt, GREEDY, rid="good-0"), "request_id 'good-0' is already in use"),
        ("aborting an unknown request", lambda: engine.abort("no-such-request"), "no request 'no-such-request' in flight"),
    ]


def test_bad_requests_are_refused_and_the_others_finish_with_their_own_tokens(make_llm, alpaca_prompts):
    llm = make_llm(num_blocks=48, max_num_seqs=8)
    engine = llm.engine
    good = chats(llm, alpaca_prompts[:3])
    alone = tokens(run_all_requests(engine, {f"good-{i}": (p, LONG) for i, p in enumerate(good)}))
    for i, p in enumerate(good):
        engine.add_request(f"good-{i}", p, LONG)
    engine.step()
    cases = bad_requests(llm)
    assert len(cases) >= 20
    for name, call, match in cases:  # one at a time, with the good requests mid-flight
        try:
            call()
        except ValueError as e:
            assert re.search(match, str(e)), f"{name}: {e}"
        else:
            pytest.fail(f"{name}: accepted")
        assert engine.has_unfinished(), "the good requests were meant to be still running"
        if len(engine.scheduler.waiting) + len(engine.scheduler.running) == 3:
            engine.step()
    assert tokens(run_all(engine)) == alone
    assert_all_free(engine)


def run_all_requests(engine, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    return run_all(engine)


@pytest.mark.parametrize("text", ["\x00\x07 control \x1b[31m characters \u202e reversed", "a lone surrogate \ud800 here",
                                  "caf\u00e9 \U0001f600 \u0928\u092e\u0938\u094d\u0924\u0947"])
def test_unusual_text_in_prompts_works(llm, text):
    (out,) = llm.generate(text, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert out.finished and len(out.outputs[0].token_ids) == 3
    assert out.prompt == text.replace("\ud800", "\ufffd")  # what UTF-8 cannot hold becomes U+FFFD
    (chat,) = llm.chat([{"role": "user", "content": text}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert chat.finished


def test_generate_refuses_requests_it_did_not_queue(make_llm):
    llm = make_llm(num_blocks=16)
    llm.engine.add_request("mine", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="requests in flight that generate.. did not queue"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    assert set(run_all(llm.engine)) == {"mine"}  # it was left alone, and runs to its end
    assert llm.generate("hello", GREEDY, use_tqdm=False)[0].finished


# ---------------------------------------------------------------- 2. exhaustion

@pytest.fixture(scope="module")
def heavy_workload(make_llm, alpaca_prompts):
    """16 requests with long prompts (100-300 tokens of real text), parallel samples, beams, greedy
    and nucleus sampling, and their tokens with ample memory."""
    ample = make_llm(num_blocks=1024)
    text_ids = ample.tokenizer(" ".join(alpaca_prompts)).input_ids
    rng = random.Random(2)
    kinds = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=24, ignore_eos=True),
             SamplingParams(beam_width=2, max_tokens=16, ignore_eos=True),
             SamplingParams(temperature=0.7, top_p=0.9, seed=9, max_tokens=24)]
    requests = {}
    for i in range(16):
        start, n = rng.randrange(len(text_ids) - 300), rng.randint(100, 300)
        requests[f"r{i}"] = (text_ids[start:start + n], kinds[i % 4])
    return requests, tokens(run_all_requests(ample.engine, requests))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_ten_times_more_demand_than_the_pool_holds(make_llm, heavy_workload, mode):
    """The heavy workload needs over 10x a 32-block pool: each request fits alone, all of them finish
    with exactly the tokens they get with ample memory, without livelock."""
    requests, expected = heavy_workload
    small = make_llm(num_blocks=33, preemption_mode=mode, swap_space=0.05, max_num_seqs=16)
    bs = small.engine.config.block_size
    demand = sum(-(-(len(p) + 24) // bs) * max(sp.n, sp.beam_width) for p, sp in requests.values())
    assert demand > 10 * 32  # ten times what the pool holds
    got = tokens(run_all_requests(small.engine, requests))
    assert got == expected
    assert small.engine.stats()["num_preemptions"] > 0
    assert_all_free(small.engine)
    with pytest.raises(ValueError, match="needs .* KV blocks of 16 tokens but the pool has 32"):
        small.engine.add_request("never", [42] * (33 * bs), GREEDY)  # could never fit: refused, not queued


# ---------------------------------------------------------------- 3. aborts at random points

def test_aborts_in_every_state_return_every_block_and_spare_the_others(make_llm, alpaca_prompts):
    texts = [" ".join(alpaca_prompts[i:i + 2]) for i in range(0, 40, 2)]
    kinds = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
             SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=20, ignore_eos=True),
             SamplingParams(beam_width=3, max_tokens=12, ignore_eos=True)]
    ample = make_llm(num_blocks=1024)
    requests = {f"r{i}": (p, kinds[i % 3]) for i, p in enumerate(chats(ample, texts))}
    expected = tokens(run_all_requests(ample.engine, requests))

    llm = make_llm(num_blocks=40, preemption_mode="swap", swap_space=0.05, max_num_seqs=12)
    engine, scheduler = llm.engine, llm.engine.scheduler
    rng = random.Random(0)
    aborted, seen_states = set(), set()

    def state_of(group) -> str:
        if group.status is GroupStatus.RUNNING and group.params.use_beam_search and len(group.seqs) > 1:
            return "mid-beam-search"
        if group.status is GroupStatus.RUNNING and group.first_token_time is not None and not any(
                s.output_token_ids[1:] for s in group.seqs):
            return "just prefilled"
        return group.status.value

    def maybe_abort():
        groups = [g for q in (scheduler.waiting, scheduler.running, scheduler.swapped) for g in q]
        by_state = {}
        for g in groups:
            by_state.setdefault(state_of(g), []).append(g)
        new = [s for s in by_state if s not in seen_states]
        if new and rng.random() < 0.5:
            state = rng.choice(sorted(new))
            victim = rng.choice(by_state[state])
            engine.abort(victim.request_id)
            aborted.add(victim.request_id)
            seen_states.add(state)

    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finished = run_all(engine, on_step=maybe_abort)
    assert seen_states >= {"waiting", "just prefilled", "running", "swapped", "mid-beam-search"}, seen_states
    for rid in aborted:
        assert {o.finish_reason for o in finished[rid].outputs} <= {"abort", "length"}
    assert {rid: t for rid, t in tokens(finished).items() if rid not in aborted} == {
        rid: t for rid, t in expected.items() if rid not in aborted}
    assert_all_free(engine)


# ---------------------------------------------------------------- 4. faults inside a step

class InjectedFault(RuntimeError):
    pass


def inject(engine, when, lose_pool: bool = False):
    """Makes the runner's model step raise when `when(decode)` is true (once), optionally after
    consuming the KV pool as a failed executable that took it donated would."""
    runner = engine.runner
    real = runner.run_step
    fired = []

    def run_step(inputs, *, decode):
        if not fired and when(decode):
            fired.append(decode)
            if lose_pool:
                runner.cache.kv.delete()
            raise InjectedFault("injected into the model step")
        return real(inputs, decode=decode)

    runner.run_step = run_step  # a test double on this one runner object
    return fired


@pytest.mark.parametrize("lose_pool", [False, True])
def test_a_failed_step_fails_only_its_requests(make_llm, alpaca_prompts, lose_pool):
    # the paper's policy: the new requests' prefill is a step of its own (a ragged step would run the
    # old requests' decode rows in it too, and fail them with it)
    llm = make_llm(num_blocks=64, enable_chunked_prefill=False)
    engine = llm.engine
    old, new = chats(llm, alpaca_prompts[:2]), chats(llm, alpaca_prompts[2:4])
    alone = tokens(run_all_requests(engine, {f"old{i}": (p, GREEDY) for i, p in enumerate(old)}))
    alone |= tokens(run_all_requests(engine, {f"new{i}": (p, GREEDY) for i, p in enumerate(new)}))
    for i, p in enumerate(old):
        engine.add_request(f"old{i}", p, GREEDY)
    engine.step(), engine.step()  # the old requests are decoding
    fired = inject(engine, when=lambda decode: not decode, lose_pool=lose_pool)  # the next prefill fails
    for i, p in enumerate(new):
        engine.add_request(f"new{i}", p, GREEDY)
    finished = run_all(engine)
    assert fired == [False]
    for rid in ("new0", "new1"):  # the prefill that failed touched these alone
        assert finished[rid].error.startswith("InjectedFault: injected into the model step")
        assert {o.finish_reason for o in finished[rid].outputs} == {"error"}
    if lose_pool:  # their K/V went with the pool: the running requests failed too, with the reason
        assert all("the KV pool was lost" in finished[rid].error for rid in ("old0", "old1"))
    else:
        assert all(finished[rid].error is None for rid in ("old0", "old1"))
        assert tokens({rid: finished[rid] for rid in ("old0", "old1")}) == {k: alone[k] for k in ("old0", "old1")}
    assert_all_free(engine)
    # the engine serves the next requests correctly
    assert tokens(run_all_requests(engine, {f"new{i}": (p, GREEDY) for i, p in enumerate(new)})) == {
        k: alone[k] for k in ("new0", "new1")}
    assert_all_free(engine)


# ---------------------------------------------------------------- 5. fuzzing and a soak

PROMPTS = [[1, 9690, 198], list(range(500, 530)), list(range(2000, 2070)), [42] * 17]


class EngineMachine(RuleBasedStateMachine):
    """Random adds (valid and invalid), steps and aborts; the KV cache manager's invariants after
    every step; at the end every request finishes and every block is free."""

    llm = None  # set by the test: one small LLM shared by every run

    def __init__(self):
        super().__init__()
        self.engine = self.llm.engine
        assert not self.engine.has_unfinished()
        self.ids = 0
        self.in_flight = set()

    @rule(prompt=st.sampled_from(PROMPTS + [[], [10**7], "", "Hi there"]),
          kind=st.sampled_from(["greedy", "sampled", "n3", "beam", "bad_n", "bad_top_p", "stop"]),
          max_tokens=st.integers(1, 6))
    def add(self, prompt, kind, max_tokens):
        try:
            params = {"greedy": lambda: SamplingParams(temperature=0, max_tokens=max_tokens),
                      "sampled": lambda: SamplingParams(temperature=0.8, seed=self.ids, max_tokens=max_tokens),
                      "n3": lambda: SamplingParams(n=3, temperature=1.0, max_tokens=max_tokens),
                      "beam": lambda: SamplingParams(beam_width=2, max_tokens=max_tokens),
                      "bad_n": lambda: SamplingParams(n=0),
                      "bad_top_p": lambda: SamplingParams(top_p=2.0),
                      "stop": lambda: SamplingParams(temperature=0, max_tokens=max_tokens, stop=[" the"])}[kind]()
            rid = f"f{self.ids}"
            self.ids += 1
            self.engine.add_request(rid, prompt, params)
            self.in_flight.add(rid)
        except ValueError:
            pass  # refused at admission, with nothing queued

    @rule()
    def step(self):
        for out in self.engine.step():
            if out.finished:
                self.in_flight.discard(out.request_id)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def abort(self, data):
        self.engine.abort(data.draw(st.sampled_from(sorted(self.in_flight))))

    @rule()
    def abort_unknown(self):
        with pytest.raises(ValueError, match="in flight"):
            self.engine.abort("no-such-request")

    @invariant()
    def blocks_are_accounted_for(self):
        self.engine.scheduler.block_manager.check_invariants()

    def teardown(self):
        run_all(self.engine, deadline_s=300)
        assert_all_free(self.engine)


def test_fuzz_the_engine_api(make_llm):
    EngineMachine.llm = make_llm(num_blocks=12, max_num_seqs=6, preemption_mode="swap", swap_space=0.01)
    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=12, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)))


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except (OSError, TypeError):
        return None


_GLIBC = _glibc()
_M_TRIM_THRESHOLD = -1  # <malloc.h>


def return_free_memory_promptly() -> None:
    """Has glibc's malloc give back free memory at the top of a thread's arena as soon as it passes
    128 KiB (glibc's default threshold, which by default rises with the large blocks freed)."""
    if _GLIBC is not None:
        _GLIBC.mallopt(_M_TRIM_THRESHOLD, 128 << 10)


def resident_mib() -> float:
    """The resident memory in MiB, after glibc's malloc has handed back the free memory it caches.

    malloc keeps what is freed resident for reuse. `malloc_trim(0)` gives back every whole page of a
    free chunk inside a heap, but not the free top of a thread's arena (XLA's threads allocate a
    step's buffers there: the f32[32, 49152] logits alone are 6 MiB); that top shrinks only past the
    trim threshold, which glibc raises with the large blocks freed. So an arena stays at the highest
    transient use it has seen, which depends on timing: in one soak an arena's heap grew 39 -> 48 MiB
    at the 7th wave, all of it free (malloc_info), while the bytes in use (mallinfo2) stayed flat within
    0.3 MiB; one CI run failed on a single 24.004 MiB step. With `return_free_memory_promptly` and the
    trim, what stays resident is what is allocated: a leak stays, and is counted."""
    if _GLIBC is not None:
        _GLIBC.malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_soak_of_a_thousand_mixed_requests(make_llm):
    """1,000 requests: ten waves of the same 100 (greedy, sampled, n=2, beams, stop strings, every
    25th aborted), so that after the first wave no new step shape compiles. Every block is free at
    the end, and the resident memory after the last wave is that after the second: nothing leaks
    (measured with malloc's cached free memory handed back: see `resident_mib`)."""
    return_free_memory_promptly()  # for the rest of this process: see `resident_mib`
    llm = make_llm(num_blocks=96, max_num_seqs=32)
    engine = llm.engine
    kinds = [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0.9, seed=4, max_tokens=3),
             SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=2), SamplingParams(beam_width=2, max_tokens=2),
             SamplingParams(temperature=0, max_tokens=3, stop=["."])]
    rss, objects, compilations, finished = [], [], [], 0
    for wave in range(10):
        rng = random.Random(1)  # the same wave every time
        for i in range(100):
            rid = f"w{wave}-{i}"
            engine.add_request(rid, rng.choice(PROMPTS)[:rng.choice([3, 17, 30])], rng.choice(kinds))
            if i % 25 == 24:
                engine.abort(rid)
        finished += len(run_all(engine))
        gc.collect()
        rss.append(resident_mib())
        objects.append(len(gc.get_objects()))
        compilations.append(engine.runner.num_compilations)
    assert finished == 1000
    assert_all_free(engine)
    assert compilations[1:] == [compilations[1]] * 9, compilations  # the waves really are the same work
    assert rss[-1] <= rss[1] + 24, f"resident memory grew from {rss[1]:.0f} to {rss[-1]:.0f} MiB: {rss}"
    assert objects[-1] <= objects[1] + 100, f"Python objects grew: {objects}"  # 800 requests later
