"""Engine behaviour on the demo model: validation, seeds, stops, sampling, aborts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jaxserve import LLM, AsyncEngine, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", page_size=8, num_pages=96, max_num_batched_tokens=64, max_model_len=128,
               check_invariants=True, warmup=False)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(seed=-1), "seed"), (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(logprobs=-1), "logprobs"), (dict(logprobs=21), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=11), "repetition_penalty"),
    (dict(min_tokens=17), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(logit_bias={"5": 1.0}), "logit_bias keys"), (dict(logit_bias={5: 101}), "logit_bias values"),
    (dict(logit_bias={5: float("inf")}), "logit_bias values"), (dict(logit_bias=[5]), "logit_bias"),
    (dict(logit_bias={t: 1.0 for t in range(1025)}), "logit_bias"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"), (dict(ignore_eos=1), "ignore_eos"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_and_engine_keeps_serving(llm):
    ok = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts=[""], sampling_params=ok)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompt_token_ids=[[]], sampling_params=ok)
    with pytest.raises(ValueError, match="prompt.*max_model_len"):
        llm.generate(prompt_token_ids=[prompt(200, 1)], sampling_params=ok)
    with pytest.raises(ValueError, match="max_tokens.*max_model_len"):
        llm.generate(prompt_token_ids=[prompt(100, 1)], sampling_params=SamplingParams(max_tokens=64))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(prompt_token_ids=[[1, 2, 10**6]], sampling_params=ok)
    # the wrong shapes and types are ValueErrors that say what is expected (not TypeErrors deep inside)
    from jaxserve import ApiCall
    with pytest.raises(ValueError, match="a list of lists"):
        llm.generate(prompt_token_ids=[5, 6, 7], sampling_params=ok)
    with pytest.raises(ValueError, match="api_calls: one list"):
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=ok, api_calls=[ApiCall(2, 0.0)])
    with pytest.raises(ValueError, match="sampling_params must be a jaxserve.SamplingParams"):
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params={"max_tokens": 4})
    with pytest.raises(ValueError, match="prompt_token_ids must be a list"):
        llm.engine.add_request(prompt_token_ids=5, sampling_params=ok)
    # a batch with one bad prompt queues nothing
    with pytest.raises(ValueError):
        llm.generate(prompt_token_ids=[prompt(5, 2), []], sampling_params=ok)
    assert not llm.engine.has_unfinished()
    out = llm.generate(prompts=["Hello, world!"], sampling_params=ok)
    assert len(out[0].token_ids) == 4 and out[0].text


def test_a_higher_priority_class_is_scheduled_first_and_answers_the_same(llm):
    """Prompts that take a step's whole budget each: the last one queued, alone in
    class 0 behind five in class 1, is scheduled before them; without classes it waits
    its turn. Greedy answers are the same either way, and bad priorities queue nothing.
    (Fresh prompts for each ordering: cached ones would all fit one step.)"""
    prompts, others = ([prompt(60, seed + i) for i in range(6)] for seed in (100, 200))
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    ranked = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, priority=[1] * 5 + [0])
    plain = llm.generate(prompt_token_ids=others, sampling_params=greedy)

    def first_scheduled(outs):
        return [o.metrics["first_scheduled_time"] for o in outs]
    *low, high = first_scheduled(ranked)
    assert high <= min(low) and sum(high < t for t in low) >= 4
    *early, last = first_scheduled(plain)
    assert last > max(early)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    assert [o.token_ids for o in ranked] == [o.token_ids for o in again]
    for bad in (1.5, "1", True, None):
        with pytest.raises(ValueError, match="priority"):
            llm.engine.add_request(prompt_token_ids=prompts[0], sampling_params=greedy, priority=bad)
    with pytest.raises(ValueError, match="priority lists"):
        llm.generate(prompt_token_ids=prompts, sampling_params=greedy, priority=[0])
    assert not llm.engine.has_unfinished()


def test_an_urgent_request_preempts_batch_work_that_fills_the_pool_and_every_answer_stays_exact(llm):
    """Six class-1 requests grow to fill the 96-page pool; a class-0 request queued
    then preempts one of them (recomputed later) and starts before any of them ends.
    Every answer is what each prompt gets alone in one class."""
    engine = llm.engine
    prompts = [prompt(64, 300 + i) for i in range(6)]
    urgent_prompt = prompt(20, 399)
    long, short = SamplingParams(max_tokens=63, temperature=0.0), SamplingParams(max_tokens=8, temperature=0.0)
    batch = [engine.add_request(prompt_token_ids=p, sampling_params=long, priority=1) for p in prompts]
    final = {}

    def run_step():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    while engine.scheduler.kv.num_free_device >= 3:
        run_step()
    urgent = engine.add_request(prompt_token_ids=urgent_prompt, sampling_params=short)
    while engine.has_unfinished():
        run_step()
    assert final[urgent].metrics["first_scheduled_time"] < min(final[b].metrics["finish_time"] for b in batch)
    assert sum(final[b].metrics["num_preemptions"] for b in batch) >= 1
    alone = llm.generate(prompt_token_ids=prompts + [urgent_prompt], sampling_params=[long] * 6 + [short])
    assert [final[r].token_ids for r in batch + [urgent]] == [o.token_ids for o in alone]


def test_same_seed_same_tokens_alone_or_in_a_batch_of_16(llm):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    target = prompt(11, 3)
    alone = llm.generate(prompt_token_ids=[target], sampling_params=params)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=k, ignore_eos=True) for k in range(15)]
    batch = llm.generate(prompt_token_ids=[prompt(3 + k, 100 + k) for k in range(7)] + [target]
                         + [prompt(20 - k, 200 + k) for k in range(8)],
                         sampling_params=others[:7] + [params] + others[7:])
    assert batch[7].token_ids == alone
    again = llm.generate(prompt_token_ids=[target], sampling_params=params)[0].token_ids
    assert again == alone
    different = llm.generate(prompt_token_ids=[target], sampling_params=SamplingParams(
        max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=99, ignore_eos=True))[0].token_ids
    assert different != alone


def test_top_k_one_top_p_tiny_and_min_p_one_are_greedy(llm):
    p = prompt(9, 4)
    greedy = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=8, temperature=0.0,
                                                                                ignore_eos=True))[0].token_ids
    for extra in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        out = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
            max_tokens=8, temperature=1.5, seed=7, ignore_eos=True, **extra))[0].token_ids
        assert out == greedy, extra


def test_stop_token_ids_and_stop_strings(llm):
    p = prompt(9, 5)
    free = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=10, temperature=0.0,
                                                                              ignore_eos=True))[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    text = free.text
    needle = text[len(text) // 2:len(text) // 2 + 2]
    if needle.strip():
        out = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
            max_tokens=10, temperature=0.0, ignore_eos=True, stop=[needle]))[0]
        assert out.finish_reason == "stop" and needle not in out.text and text.startswith(out.text)


def _stream(llm, p: list[int], params: SamplingParams) -> tuple[list[str], object]:
    """The text deltas of one request, step by step, and its final output."""
    engine = llm.engine
    rid = engine.add_request(prompt_token_ids=p, sampling_params=params)
    deltas, final = [], None
    while final is None:
        for out in engine.step():
            if out.request_id == rid:
                deltas.append(out.delta_text)
                final = out if out.finish_reason is not None else None
    return deltas, final


def test_a_stop_string_spanning_tokens_never_shows_in_the_stream(llm):
    """A stream shows no part of a stop string that a later token completes: text that
    could still start one is held back, and what was held is shown once it cannot."""
    p = prompt(9, 5)
    free = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=12, temperature=0.0,
                                                                              ignore_eos=True))[0]
    text = free.text
    assert len(text) >= 9
    needle = text[5:9]   # four characters: several tokens of the demo's byte-level tokenizer
    assert len(llm.tokenizer.encode(needle, add_special_tokens=False)) > 1
    deltas, out = _stream(llm, p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[needle]))
    assert out.finish_reason == "stop" and out.text == text[:text.index(needle)]
    assert "".join(deltas) == out.text
    shown = ""
    for delta in deltas:
        shown += delta
        assert out.text.startswith(shown), (shown, out.text)
    # a stop string that never completes holds nothing back in the end: every character is shown
    deltas, out = _stream(llm, p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                 stop=[text[-2:] + "\u2603"]))
    assert out.finish_reason == "length" and "".join(deltas) == out.text == text


def test_the_detokenizer_holds_back_exactly_a_tail_that_may_start_a_stop_string(llm):
    from jaxserve.detokenizer import IncrementalDetokenizer
    detok = IncrementalDetokenizer(llm.tokenizer, stop=["aab", "xyz"])
    held = []
    for token in llm.tokenizer.encode("caaaxy", add_special_tokens=False):
        detok.add(token)
        held.append(len(detok.text) - detok.releasable())
    assert detok.text == "caaaxy"
    assert held == [0, 1, 2, 2, 1, 2]   # "a", "aa", "aa" (of "aab"), then "x", "xy" (of "xyz")


def test_the_text_continues_the_prompt_with_a_sentencepiece_tokenizer():
    """A Metaspace (SentencePiece-style) tokenizer drops the space of a piece decoded first
    (``"▁Paris"`` alone is ``"Paris"``): decoded after the prompt's last ids, the output is
    ``" Paris"``, so prompt + text is the text, and a stop string with the space matches at
    the first token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxserve.detokenizer import DETOKENIZER_CONTEXT, IncrementalDetokenizer
    words = ["The", "capital", "of", "France", "is", "Paris"]
    vocab = {"<unk>": 0, **{f"\u2581{w}": i + 1 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    ids = tokenizer.encode("The capital of France is Paris", add_special_tokens=False)
    prompt, answer = ids[:-1], ids[-1]
    assert tokenizer.decode([answer]) == "Paris"   # (what a detokenizer without the prompt shows)
    detok = IncrementalDetokenizer(tokenizer, context=prompt[-DETOKENIZER_CONTEXT:])
    assert detok.add(answer) == (" Paris", False)
    assert tokenizer.decode(prompt) + detok.text == tokenizer.decode(ids)
    stopping = IncrementalDetokenizer(tokenizer, stop=[" Paris"], context=prompt[-DETOKENIZER_CONTEXT:])
    assert stopping.add(answer) == ("", True)
    # A token-id prompt cut inside a character (byte fallback: each byte of it decodes as its own
    # U+FFFD) is not decoded with the output, whose first word would lose its first characters.
    vocab = {"<unk>": 0, **{f"<0x{i:02X}>": 1 + i for i in range(256)}, "\u2581Hello": 257, "\u2581is": 258}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    bytes_tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    cut = IncrementalDetokenizer(bytes_tokenizer, context=[257, 1 + 0xE4, 1 + 0xB8])   # "Hello" + 2 bytes of "中"
    for token in (1 + 0xAD, 258):
        cut.add(token)
    assert cut.text.endswith(" is") and cut.text != "is"


def test_a_request_keeps_the_settings_it_was_given(llm):
    """The engine keeps its own copy of a request's ``SamplingParams`` (and decodes its first
    tokens after the prompt's last ids): a caller that reuses the object, changing a field or
    breaking one, changes nothing for the request already queued, and no step fails."""
    p = llm.tokenizer.encode("the settings it was given", add_special_tokens=False)   # (whole characters)
    greedy = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=10, temperature=0.0,
                                                                                ignore_eos=True))[0].token_ids
    shared = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=["never-seen"])
    engine = llm.engine
    request = engine.make_request(prompt_token_ids=p, sampling_params=shared)
    assert request.detokenizer.ids == p[-5:]
    rid = engine.add_request(prompt_token_ids=p, sampling_params=shared)
    shared.temperature, shared.top_k = 1.5, None   # (the next request's settings, and a broken one)
    shared.stop.append(llm.tokenizer.decode(greedy[:2]))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs[rid].token_ids == greedy and outs[rid].finish_reason == "length"


def test_generate_interrupted_leaves_no_request_of_its_own(llm, monkeypatch):
    """An exception out of ``LLM.generate``'s loop (a KeyboardInterrupt, a failed step) aborts
    that call's requests: none is left to run (and hold pages) under the next call."""
    engine = llm.engine
    steps = [0]
    real_step = engine.core._run_plan

    def interrupted():
        steps[0] += 1
        if steps[0] == 3:
            raise KeyboardInterrupt
        return real_step()
    monkeypatch.setattr(engine.core, "_run_plan", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_token_ids=[prompt(5, 9)] * 3, sampling_params=SamplingParams(max_tokens=50, ignore_eos=True))
    monkeypatch.undo()
    assert not engine.has_unfinished()
    assert engine.scheduler.kv.num_free_device == engine.scheduler.device_pool.num_pages


def test_the_text_is_cut_before_the_earliest_stop_string_whichever_is_listed_first():
    """One token completes two stop strings ("\nUser:" holds "\n" and "User:"): the cut is
    before the earlier one, not before the one listed first (which showed the "\n")."""
    from jaxserve.detokenizer import IncrementalDetokenizer

    class Pieces:   # a tokenizer whose token i is the text pieces[i]
        pieces = {1: "hello", 2: "\nUser:", 3: " hi"}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.pieces[i] for i in ids)

    detok = IncrementalDetokenizer(Pieces(), stop=["User:", "\n"])
    assert detok.add(1) == ("hello", False)
    assert detok.add(2) == ("", True) and detok.text == "hello"


def test_include_stop_str_in_output_keeps_the_stop_string_or_token_and_holds_nothing_back(llm):
    """vLLM's ``include_stop_str_in_output``: the text runs to the end of the stop string
    (cut after it, not before), a stream shows it as it comes (nothing to hold back), and
    a stop token's text stays (the demo's byte tokens are not special)."""
    p = prompt(9, 5)
    free = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=12, temperature=0.0,
                                                                              ignore_eos=True))[0]
    text = free.text
    needle = text[5:9]   # several tokens: a stream without the flag holds its start back
    base = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    deltas, out = _stream(llm, p, SamplingParams(**base, stop=[needle], include_stop_str_in_output=True))
    assert out.finish_reason == "stop" and out.text == text[:text.index(needle) + len(needle)]
    assert "".join(deltas) == out.text
    # a stop string that may still complete is shown at once: the deltas of a stream without stop strings
    plain, _ = _stream(llm, p, SamplingParams(**base))
    never = [needle + "\u2603"]
    shown, _ = _stream(llm, p, SamplingParams(**base, stop=never, include_stop_str_in_output=True))
    held, _ = _stream(llm, p, SamplingParams(**base, stop=never))
    assert shown == plain and held != plain and "".join(held) == "".join(plain)
    # a stop token whose own step shows text (not the first byte of a longer character), first seen there
    first = next(k for k in range(2, 12) if plain[k] and free.token_ids.index(free.token_ids[k]) == k)
    stop_id = free.token_ids[first]
    kept = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
        **base, stop_token_ids=[stop_id], include_stop_str_in_output=True))[0]
    dropped = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(**base, stop_token_ids=[stop_id]))[0]
    assert kept.token_ids == dropped.token_ids == free.token_ids[:first + 1]
    assert kept.finish_reason == dropped.finish_reason == "stop"
    assert kept.text == "".join(plain[:first + 1]) and dropped.text == "".join(plain[:first])


def test_with_include_stop_the_cut_is_after_the_earliest_stop_string_and_the_shortest_of_those():
    from jaxserve.detokenizer import IncrementalDetokenizer

    class Pieces:   # a tokenizer whose token i is the text pieces[i]
        pieces = {1: "hello", 2: "\nUser: hi", 3: "x"}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.pieces[i] for i in ids)

    detok = IncrementalDetokenizer(Pieces(), stop=["User:", "\nUser: h", "\nU"], include_stop=True)
    assert detok.add(1) == ("hello", False)
    assert detok.add(2) == ("\nU", True) and detok.text == "hello\nU"


def test_an_output_that_fails_to_build_fails_its_request_alone(llm):
    """A defect while building one request's output (here its detokenizer's hold-back)
    ends that request with an error; the other request of the same steps finishes. One
    that ended before its last output failed to build ends as an error too."""
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    broken = engine.add_request(prompt_token_ids=prompt(7, 11), sampling_params=params)
    fine = engine.add_request(prompt_token_ids=prompt(7, 12), sampling_params=params)

    class Failing:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def releasable(self):
            raise RuntimeError("hold-back defect")
    request = engine.scheduler.requests[broken]
    request.detokenizer = Failing(request.detokenizer)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[broken].finish_reason == "error" and "hold-back defect" in finals[broken].error
    assert finals[fine].finish_reason == "length" and len(finals[fine].token_ids) == 6 and finals[fine].error is None
    assert engine.scheduler.kv.num_free_device == engine.scheduler.device_pool.num_pages

    # A request whose last output fails once it has ended (at "length") is an error after all, counted so.
    class FailsAtTheEnd(Failing):
        def releasable(self):
            return self.inner.releasable()

        @property
        def text(self):
            if request.is_finished:
                raise RuntimeError("final text defect")
            return self.inner.text
    before = dict(engine.stats.finished)
    rid = engine.add_request(prompt_token_ids=prompt(7, 13), sampling_params=params)
    request = engine.scheduler.requests[rid]
    request.detokenizer = FailsAtTheEnd(request.detokenizer)
    final = None
    while final is None:
        final = next((out for out in engine.step() if out.finished), None)
    assert final.finish_reason == "error" and "final text defect" in final.error
    after = engine.stats.finished
    assert (after.get("error", 0) - before.get("error", 0), after.get("length", 0) - before.get("length", 0)) == (1, 0)


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm):
    p = prompt(9, 5)
    free = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=8, temperature=0.0,
                                                                              ignore_eos=True))[0]
    text = free.text
    needle = text[-3:]
    assert needle.strip() and text.index(needle) == len(text) - 3, "the stop string must first occur at the end"
    finished_before = dict(llm.engine.stats.finished)
    deltas, out = _stream(llm, p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[needle]))
    assert out.finish_reason == "stop"
    assert out.text == "".join(deltas) == text[:-3]
    finished = llm.engine.stats.finished
    assert finished.get("stop", 0) == finished_before.get("stop", 0) + 1
    assert finished.get("length", 0) == finished_before.get("length", 0)


def test_min_tokens_holds_back_stop_strings_and_stop_ids(llm):
    """Before ``min_tokens`` are generated neither a stop string nor a stop id ends the
    request: the stop string first seen early is not matched (the text runs on), and the
    stop id is never sampled (greedy would have picked it at once)."""
    p = prompt(9, 5)
    free = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=10, temperature=0.0,
                                                                              ignore_eos=True))[0]
    needle = free.text[:2]
    stopped = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, stop=[needle]))[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 10
    held = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, stop=[needle], min_tokens=10))[0]
    assert held.finish_reason == "length" and held.token_ids == free.token_ids and held.text == free.text
    first = free.token_ids[0]
    out = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[first], min_tokens=3))[0]
    assert first not in out.token_ids[:3] and out.token_ids[0] != first


def test_penalties_act_and_penalised_sampling_is_the_same_alone_and_in_a_batch(llm):
    """Greedy, a prompt whose free answer repeats tokens: with a repetition and a presence
    penalty none repeats, and a -100 bias removes a token the free answer has. Sampled and
    seeded, with every adjustment: the same tokens alone and batched with requests that have
    other adjustments or none (rows never mix), and not the tokens drawn without them."""
    greedy = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    p = [ids for seed in range(20) for ids in [prompt(7, seed)]
         if len(set(out := llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(**greedy))[0].token_ids))
         < len(out)][0]   # the first of these prompts whose free answer repeats a token
    free = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(**greedy))[0].token_ids
    penalised = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
        **greedy, repetition_penalty=10.0, presence_penalty=2.0, logit_bias={free[0]: -100.0}))[0].token_ids
    assert len(set(penalised)) == len(penalised) and free[0] not in penalised
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True, presence_penalty=2.0,
                            repetition_penalty=10.0, logit_bias={free[1]: -100.0}, min_tokens=4)
    alone = llm.generate(prompt_token_ids=[p], sampling_params=params)[0]
    plain = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
        max_tokens=12, temperature=0.8, seed=3, ignore_eos=True))[0]
    batch = llm.generate(prompt_token_ids=[prompt(30, 9), p, prompt(5, 10)], sampling_params=[
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), params,
        SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=True, frequency_penalty=-2.0)])
    assert batch[1].token_ids == alone.token_ids != plain.token_ids
    assert len(set(alone.token_ids)) == len(alone.token_ids) and free[1] not in alone.token_ids


def test_a_logit_bias_outside_the_vocabulary_is_refused_and_nothing_is_queued(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias: its keys must be token ids in \\[0, {vocab}\\)"):
        llm.generate(prompt_token_ids=[prompt(5, 1)], sampling_params=SamplingParams(logit_bias={vocab: 1.0}))
    assert not llm.engine.has_unfinished()


def test_the_logit_adjuster_reads_each_new_token_once():
    """Entries grow past the first arrays; the repetition penalty covers every context token
    (API-returned ones too), presence and frequency only generated ones; a request whose only
    adjustment is ``min_tokens`` has nothing to adjust once it is reached, or without stop ids."""
    from jaxserve.logit_adjust import LogitAdjuster, entry_bucket, step_adjustments
    params = SamplingParams(max_tokens=40, repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5,
                            logit_bias={900: 2.5}, min_tokens=2)
    adjuster = LogitAdjuster(params, frozenset({1}))
    context = list(range(100, 130))   # 30 prompt tokens: more entries than the first arrays hold
    ids, pre, scale, post = adjuster.entries(context, 30, [])
    assert ids[:2].tolist() == [900, 1] and pre[:2].tolist() == [2.5, -np.inf]
    assert set(ids[2:].tolist()) == set(context) and (scale[2:] == 2.0).all() and (post == 0).all()
    context += [100, 100, 555, 556, 100]   # generated 100, 100, then an API returned 555, 556, then 100
    generated = [100, 100, 100]
    ids, pre, scale, post = adjuster.entries(context, len(context), generated)
    by_token = dict(zip(ids.tolist(), zip(pre.tolist(), scale.tolist(), post.tolist())))
    assert by_token[100] == (0.0, 2.0, -(0.5 * 3 + 1.0))
    assert by_token[555] == (0.0, 2.0, 0.0) and by_token[1] == (0.0, 1.0, 0.0)   # min_tokens reached
    assert len(ids) == 34
    only_min = LogitAdjuster(SamplingParams(max_tokens=8, min_tokens=2), frozenset({1}))
    assert only_min.active(1) and not only_min.active(2)
    assert not LogitAdjuster(SamplingParams(max_tokens=8, min_tokens=2), frozenset()).active(0)
    # a forced tool turn ended on EOS, which ends the request again from here: it is held back too
    held = LogitAdjuster(SamplingParams(max_tokens=40, min_tokens=10), frozenset({1}))
    held.set_stop_ids(frozenset({1, 2}), 5)
    e_ids, e_pre, _, _ = held.entries([9] * 20, 20, [9] * 5)
    assert dict(zip(e_ids.tolist(), e_pre.tolist())) == {1: -np.inf, 2: -np.inf} and held.active(5)
    e_ids, e_pre, _, _ = held.entries([9] * 25, 25, [9] * 10)
    assert (e_pre == 0).all() and not held.active(10) and not held.holds_stops(10)
    held.set_stop_ids(frozenset({3}), 12)   # past min_tokens: nothing to hold
    assert not held.active(12)
    # a new turn (a fresh budget) counts min_tokens and presence/frequency from its start
    turn = LogitAdjuster(SamplingParams(max_tokens=40, min_tokens=3, presence_penalty=1.0), frozenset({1}))
    turn.entries([5, 6], 2, [6])
    turn.new_turn(1)
    assert turn.holds_stops(3) and not turn.holds_stops(4)
    t_ids, t_pre, _, t_post = turn.entries([5, 6, 6], 3, [6, 6])
    by = dict(zip(t_ids.tolist(), zip(t_pre.tolist(), t_post.tolist())))
    assert by[1] == (-np.inf, 0.0) and by[6] == (0.0, -1.0)   # one 6 in this turn, not two
    arrays = step_adjustments([(3, (ids, pre, scale, post))])
    assert len(arrays["adjust_ids"]) == entry_bucket(34) == 64 and arrays["adjust_rows"][:34].tolist() == [3] * 34
    assert (arrays["adjust_ids"][34:] == 2**31 - 1).all() and (arrays["adjust_scale"][34:] == 1).all()


def test_eos_stops_unless_ignored(llm):
    eos = llm.tokenizer.eos_token_id
    p = prompt(9, 6)
    free = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=10, temperature=0.0,
                                                                              ignore_eos=True))[0]
    # treat the 3rd generated token as EOS through stop_token_ids' sibling: the engine's eos set
    llm.engine.eos_token_ids.add(free.token_ids[2])
    try:
        out = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=10, temperature=0.0))[0]
        kept = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
            max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    finally:
        llm.engine.eos_token_ids.discard(free.token_ids[2])
        llm.engine.eos_token_ids.add(eos)
    assert out.finish_reason == "stop" and len(out.token_ids) <= 3
    assert kept.token_ids == free.token_ids


def test_async_engine_streams_deltas_and_abort_frees_pages(llm):
    engine = AsyncEngine(engine=llm.engine)

    async def main():
        pieces = []
        async for out in engine.generate(None, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                         request_id="s", prompt_token_ids=prompt(7, 8)):
            pieces.append(out.delta_token_ids)
        full = out.token_ids
        stream = engine.generate(None, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
                                 request_id="long", prompt_token_ids=prompt(7, 9))
        await stream.__anext__()
        assert await engine.abort("long")
        assert not await engine.abort("long")
        # the aborted request's stream gets its final output and ends (it used to wait forever)
        async def drain():
            return [out async for out in stream]
        rest = await asyncio.wait_for(drain(), timeout=30)
        assert rest and rest[-1].finish_reason == "abort" and rest[-1].finished
        return pieces, full

    try:
        pieces, full = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [t for p in pieces for t in p] == full and len(full) == 6
    sched = llm.engine.scheduler
    assert sched.kv.num_free_device == sched.device_pool.num_pages


def test_async_engine_after_shutdown_fails_fast():
    from jaxserve.async_engine import EngineDeadError
    engine = AsyncEngine("demo", page_size=8, num_pages=16, max_num_batched_tokens=16, max_model_len=64, warmup=False)
    engine.shutdown()

    async def main():
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("hi", SamplingParams(max_tokens=2)):
                pass
        assert not await engine.abort("anything")

    asyncio.run(main())
    assert not engine.is_alive


def test_returned_token_ids_outside_the_vocabulary_are_rejected(llm):
    from jaxserve import ApiCall
    with pytest.raises(ValueError, match="returned_token_ids"):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=4),
                     api_calls=[[ApiCall(2, 0.0, [10**6])]])
    with pytest.raises(ValueError, match="api_calls"):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=4), api_calls=[["x"]])
