"""Scheduling properties on a real tiny model: chunked prefill, prefix-cache hits, mixed
batches and preemption all give the same greedy tokens as a request running alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.errors import RequestError
from engine.llm import LLMEngine
from engine.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, vocab, (n,), generator=g).tolist() for n in lengths]


def make(d: str, engines: list, **kw) -> LLMEngine:
    cfg = dict(page_size=16, num_pages=128)
    cfg.update(kw)
    eng = LLMEngine(d, EngineConfig(**cfg))
    engines.append(eng)
    return eng


def alone(d: str, engines: list, ps: list[list[int]], params=GREEDY) -> list[list[int]]:
    out = []
    for p in ps:
        eng = make(d, engines, enable_prefix_cache=False)
        out.append(eng.generate([p], params)[0].output_tokens)
    return out


def test_engine_chunked_prefill_equals_one_shot(tiny_model_dir, engines):
    d = tiny_model_dir("llama-gqa4")
    [p] = prompts(262, [150])
    one = make(d, engines, max_num_batched_tokens=4096)
    one.record_logits = {}
    [a] = one.generate([p], GREEDY)
    for budget in (7, 16, 33):
        ch = make(d, engines, max_num_batched_tokens=budget)
        ch.record_logits = {}
        [b] = ch.generate([p], GREEDY)
        assert ch.steps > one.steps
        assert b.output_tokens == a.output_tokens
        for x, y in zip(ch.record_logits[b.request_id], one.record_logits[a.request_id]):
            assert float((x - y).norm() / y.norm()) < 1e-5


def test_engine_prefix_hit_equals_no_hit(tiny_model_dir, engines):
    d = tiny_model_dir("llama-tiny")
    base = prompts(262, [70])[0]
    tails = prompts(262, [5, 19, 33], seed=3)
    ps = [base] + [base + t for t in tails] + [base[:40]]
    ref = alone(d, engines, ps)
    eng = make(d, engines)
    got = []
    for p in ps:
        [s] = eng.generate([p], GREEDY)
        got.append(s.output_tokens)
        eng.check_integrity()
    assert got == ref
    # 70 + 12 generated tokens -> 5 full pages cached; later prompts extending it hit them.
    assert eng.bm.hit_tokens_total > 0
    [s] = eng.generate([base + tails[0]], GREEDY)
    assert s.num_cached_tokens == 64


def test_engine_full_prompt_hit_recomputes_last_token(tiny_model_dir, engines):
    d = tiny_model_dir("llama-tiny")
    [p] = prompts(262, [64])
    eng = make(d, engines)
    [a] = eng.generate([p], GREEDY)
    [b] = eng.generate([p], GREEDY)
    assert b.num_cached_tokens == 48  # the last page is recomputed to get logits
    assert a.output_tokens == b.output_tokens


def test_engine_mixed_batch_equals_alone(tiny_model_dir, engines):
    d = tiny_model_dir("qwen2-tiny")
    ps = prompts(262, [3, 17, 64, 100, 31, 5], seed=7)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 3, 9, 12, 1, 20)]
    ref = [alone(d, engines, [p], sp)[0] for p, sp in zip(ps, params)]
    eng = make(d, engines, max_num_batched_tokens=48, max_num_seqs=4)
    seqs = eng.generate(ps, params)
    assert [s.output_tokens for s in seqs] == ref


def test_engine_requests_join_mid_flight(tiny_model_dir, engines):
    d = tiny_model_dir("llama-tiny")
    ps = prompts(262, [40, 25, 90], seed=11)
    ref = alone(d, engines, ps)
    eng = make(d, engines, max_num_batched_tokens=32)
    seqs = [eng.add_request(ps[0], GREEDY)]
    for p in ps[1:]:
        for _ in range(3):
            eng.step()
        seqs.append(eng.add_request(p, GREEDY))
    while eng.has_work():
        eng.step()
        eng.check_integrity()
    assert [s.output_tokens for s in seqs] == ref


def test_engine_preemption_by_recompute(tiny_model_dir, engines):
    d = tiny_model_dir("llama-tiny")
    ps = prompts(262, [30, 30, 30, 30], seed=5)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = alone(d, engines, ps, params)
    # 4 requests x 70 tokens need 20 pages; 12 pages force preemptions.
    eng = make(d, engines, num_pages=12, enable_prefix_cache=False)
    seqs = eng.generate(ps, params)
    assert eng.scheduler.num_preemptions > 0
    assert [s.output_tokens for s in seqs] == ref
    eng2 = make(d, engines, num_pages=12)  # with the prefix cache, recompute mostly hits
    assert [s.output_tokens for s in eng2.generate(ps, params)] == ref


def test_engine_seeded_sampling_independent_of_batch(tiny_model_dir, engines):
    d = tiny_model_dir("llama-tiny")
    ps = prompts(262, [20, 50], seed=2)
    sp = SamplingParams(max_tokens=15, temperature=0.9, top_k=40, top_p=0.9, seed=1234, ignore_eos=True)
    ref = alone(d, engines, ps[:1], sp)[0]
    eng = make(d, engines)
    seqs = eng.generate(ps, [sp, SamplingParams(max_tokens=15, temperature=1.0, seed=9, ignore_eos=True)])
    assert seqs[0].output_tokens == ref


def test_engine_stop_rules(tiny_model_dir, engines):
    d = tiny_model_dir("llama-tiny")
    eng = make(d, engines)
    [p] = prompts(262, [20])
    [free] = eng.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.output_tokens) == 10
    stop_tok = free.output_tokens[3]
    first = free.output_tokens.index(stop_tok)
    [s] = eng.generate([p], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop_tok,)))
    assert s.finish_reason == "stop" and s.output_tokens == free.output_tokens[: first + 1]
    text = eng.tokenizer.decode(free.output_tokens)
    if len(text) > 4:
        stop = text[2:4]
        [s2] = eng.generate([p], SamplingParams(max_tokens=10, temperature=0, stop=(stop,), ignore_eos=True))
        assert s2.finish_reason == "stop"
        assert eng.text_of(s2.request_id) == text[: text.index(stop)]


def test_engine_rejects_bad_requests(tiny_model_dir, engines):
    eng = make(tiny_model_dir("llama-tiny"), engines, num_pages=8)
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(RequestError, match="outside"):
        eng.add_request([10**6], GREEDY)
    with pytest.raises(RequestError, match="exceeds"):
        eng.add_request([7] * 120, GREEDY)  # 8 pages x 16 = 128 tokens
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_engine_long_prefills_compete_for_a_small_pool(tiny_model_dir, engines):
    d = tiny_model_dir("llama-tiny")
    ps = prompts(262, [100, 100, 100], seed=13)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ref = alone(d, engines, ps, params)
    # Each request alone needs 7 pages; 9 pages and 32-token chunks make prefills collide.
    eng = make(d, engines, num_pages=9, max_num_batched_tokens=32, enable_prefix_cache=False)
    seqs = eng.generate(ps, params)
    assert [s.output_tokens for s in seqs] == ref


def test_engine_long_prefill_never_stalls_decodes(tiny_model_dir, engines):
    d = tiny_model_dir("llama-tiny")
    eng = make(d, engines, max_num_batched_tokens=32)
    a = eng.add_request(prompts(262, [10])[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    eng.step()  # a's prefill
    b = eng.add_request(prompts(262, [300], seed=1)[0], GREEDY)
    while b.num_computed < b.num_prompt:
        before = len(a.output_tokens)
        eng.step()
        assert len(a.output_tokens) == before + 1  # a decodes every step while b prefills in chunks
    while eng.has_work():
        eng.step()


@pytest.fixture(scope="module")
def gqa_reference(tiny_model_dir):
    """Greedy outputs of prompts run alone (memoised), for the random-schedule test."""
    d = tiny_model_dir("llama-gqa4")
    eng = LLMEngine(d, EngineConfig(page_size=16, num_pages=64, enable_prefix_cache=False))
    memo: dict[tuple, list[int]] = {}

    def ref(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in memo:
            sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            memo[key] = eng.generate([prompt], sp)[0].output_tokens
        return memo[key]

    return d, ref


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 70), st.integers(1, 12), st.integers(0, 4)),
        min_size=1,
        max_size=6,
    ),
    page_size=st.sampled_from([4, 8, 16]),
    budget=st.integers(3, 64),
    spare_pages=st.integers(0, 12),
    prefix_cache=st.booleans(),
)
def test_engine_random_schedules_equal_running_alone(
    gqa_reference, reqs, page_size, budget, spare_pages, prefix_cache
):
    """Random arrivals, shared prefixes, chunk budgets, page sizes and pool sizes (down to
    barely one request): every request's greedy tokens equal its tokens when run alone."""
    d, ref = gqa_reference
    bases = prompts(262, [40, 40, 40, 40], seed=21)
    need = max(-(-(n + k) // page_size) for _, n, k, _ in reqs)
    eng = LLMEngine(
        d,
        EngineConfig(
            page_size=page_size,
            num_pages=max(2, need + spare_pages),
            max_num_batched_tokens=budget,
            max_num_seqs=4,
            enable_prefix_cache=prefix_cache,
        ),
    )
    pending = sorted(enumerate(reqs), key=lambda r: r[1][3])  # by arrival step
    seqs: dict[int, object] = {}
    step = 0
    while pending or eng.has_work():
        while pending and pending[0][1][3] <= step:
            i, (b, n, k, _) = pending.pop(0)
            p = (bases[b] + bases[(b + 1) % 4])[:n]
            seqs[i] = (eng.add_request(p, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)), p, k)
        eng.step()
        eng.check_integrity()
        step += 1
        assert step < 5000, "no progress"
    for s, p, k in seqs.values():
        assert s.output_tokens == ref(p, k)
    assert eng.bm.num_used == 0


def test_engine_warm_up_leaves_no_trace(tiny_model_dir, engines):
    # AsyncEngine.start runs it (issue 11: nothing slow on the first request)
    eng = LLMEngine(tiny_model_dir("llama-tiny"), EngineConfig(num_pages=48))
    engines.append(eng)
    prompt = list(range(10, 60))
    first = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    cached, steps, hits = dict(eng.bm.cache), eng.steps, eng.bm.hit_tokens_total
    eng.release(first.request_id)
    eng.warm_up()
    assert eng.bm.cache == cached and eng.steps == steps and eng.bm.hit_tokens_total == hits
    assert eng.timeline.count("compute") == steps  # the warm-up's steps are not in the timeline
    assert not eng.requests and not eng.scheduler.has_work()
    again = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert again.output_tokens == first.output_tokens and again.num_cached_tokens == 48
