"""Token-for-token parity with Hugging Face transformers (PyTorch) on tiny random checkpoints.

The engine runs in float32 like the reference (named: ``dtype="auto"`` is bfloat16 on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from jaxserve import LLM, SamplingParams
from scheduler.scheduler import Scheduler

KINDS = ["llama", "mistral", "qwen2", "qwen3"]
NEW_TOKENS = 24
PROMPT_LENS = [3, 9, 16, 17, 30, 41]


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, n).tolist() for n in PROMPT_LENS]


def hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def references(hf_checkpoints):
    return {kind: [hf_greedy(hf_checkpoints[kind][0], p) for p in prompts()] for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_greedy_matches_transformers(kind, pool, hf_checkpoints, references):
    # tight: 12 pages of 8 tokens for six requests of up to 65 tokens -> preemption by recompute
    num_pages = 256 if pool == "roomy" else 12
    llm = LLM(str(hf_checkpoints[kind][1]), dtype="float32", page_size=8, num_pages=num_pages, max_num_batched_tokens=64,
              max_model_len=128, check_invariants=True, warmup=False)
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for out, want in zip(outs, references[kind]):
        assert out.token_ids == want, out.request_id
        assert out.finish_reason == "length"
    sched = llm.engine.scheduler
    if pool == "tight":
        assert sched.num_preemptions > 0
    assert sched.kv.num_free_device == sched.device_pool.num_pages


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_each_step(kind, hf_checkpoints):
    model, path = hf_checkpoints[kind]
    llm = LLM(str(path), dtype="float32", page_size=8, num_pages=64, max_num_batched_tokens=32, max_model_len=128, warmup=False,
              keep_logits=True)
    engine = llm.engine
    ids = prompts(1)[4]
    engine.add_request("r", prompt_token_ids=ids, sampling_params=SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True))
    context = list(ids)
    steps_compared = 0
    while engine.has_unfinished():
        outs = engine.step()
        if not outs:
            continue  # a prefill chunk that did not reach the end of the prompt
        with torch.no_grad():
            ref = model(torch.tensor([context])).logits[0, -1].numpy()
        ours = np.asarray(engine.last_logits[0])
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
        context += outs[0].delta_token_ids
        steps_compared += 1
    assert steps_compared == 6  # the prefill (in two chunks) and five decode steps


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_greedy_matches_transformers_with_pallas_kernels_in_interpret_mode(impl, hf_checkpoints, references):
    llm = LLM(str(hf_checkpoints["llama"][1]), dtype="float32", page_size=16, num_pages=64, max_num_batched_tokens=64,
              max_model_len=128, attention_impl=impl, interpret=True, check_invariants=True, warmup=False)
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == references["llama"]


@pytest.fixture(scope="module")
def head_dim_64_checkpoint(tmp_path_factory):
    """Directory of a tiny Llama with head_dim 64, the smallest the Mosaic GPU kernel tiles."""
    import transformers as tf

    from conftest import TINY

    torch.manual_seed(3)
    cfg = tf.LlamaConfig(**{**TINY, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1},
                         head_dim=64, tie_word_embeddings=True)
    model = tf.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("hf-llama-d64")
    model.save_pretrained(path)
    return path


def test_greedy_with_mosaic_gpu_kernel_in_interpret_mode_matches_reference_attention(head_dim_64_checkpoint):
    """bfloat16 engine: Mosaic GPU attention (JAX's Mosaic GPU interpreter) vs the reference attention.

    Only the attention implementation differs (float32 transformers drifts
    from any bfloat16 run after a few tokens on this model, so it is not the
    yardstick here). A 33-token prompt is prefilled in two chunks; contexts
    cross page boundaries.
    """
    path = head_dim_64_checkpoint
    ids = [p[:n] for p, n in zip(prompts(2), (3, 16, 30))] + [np.random.default_rng(2).integers(1, 256, 33).tolist()]
    tokens = {}
    for impl in ("reference", "pallas_mosaic_gpu"):
        llm = LLM(str(path), dtype="bfloat16", page_size=16, num_pages=32, max_num_batched_tokens=32,
                  max_num_seqs=4, max_model_len=64, attention_impl=impl, interpret=impl != "reference",
                  check_invariants=True, warmup=False)
        outs = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True))
        tokens[impl] = [o.token_ids for o in outs]
    assert tokens["pallas_mosaic_gpu"] == tokens["reference"]


@pytest.mark.parametrize("dtype,every_product_exact", [("float32", True), ("bfloat16", False)])
def test_float32_engine_multiplies_at_full_precision(dtype, every_product_exact):
    """A float32 engine's step lowers every matrix product at HIGHEST precision, so
    XLA:GPU cannot use TF32 for it (it did for the XLA attention on an H200: 9e-4 off
    float64); bfloat16 steps keep the backend's default for all their products (on the
    H200 they were all at HIGHEST: the model's layers asked for it whatever the dtype)."""
    llm = LLM("demo", dtype=dtype, num_pages=32, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
              warmup=False)
    runner = llm.engine.executor
    text = runner.lower_step(runner.synthetic_inputs(runner.config.token_buckets[0])).as_text()
    llm.engine.shutdown()
    # XLA's own products only: a Pallas Triton kernel is a custom call whose serialized IR
    # may spell "dot_general"; its products take the kernel's precision argument (HIGHEST
    # for float32, checked against float64 by tools/gpu_validate.py's kernels section).
    products = [line for line in text.splitlines() if "= stablehlo.dot_general " in line]
    assert products
    wrong = [line.strip()[:300] for line in products if ("HIGHEST" in line) != every_product_exact]
    assert not wrong, wrong[:5]


def test_logprobs_match_transformers_log_softmax(hf_checkpoints):
    """Each generated token's logprob and its top alternatives are transformers' log-softmax
    at that position (teacher-forced over the whole generated sequence), for a greedy and a
    sampled row batched with a row that asks for none: the model's own distribution, not the
    temperature-scaled one, and each row's records are its own. The greedy row's 41-token
    prompt is computed in chunks of a 16-token budget, beside rows that decode, so steps mix
    chunks that sample and chunks that do not."""
    model, path = hf_checkpoints["llama"]
    llm = LLM(str(path), dtype="float32", page_size=8, num_pages=64, max_num_batched_tokens=16, max_model_len=128,
              check_invariants=True, warmup=False)
    ids = [prompts(3)[1], prompts(3)[0], prompts(3)[5]]   # 9, 3 and 41 tokens: the last one admitted last
    params = [SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)]
    outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
    assert outs[1].logprobs is None
    for out, prompt, p in [(outs[0], ids[0], params[0]), (outs[2], ids[2], params[2])]:
        assert len(out.logprobs) == len(out.token_ids) == 6
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt + out.token_ids])).logits[0], dim=-1).numpy()
        for i, (token, record) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + i]
            assert record.token_id == token
            np.testing.assert_allclose(record.logprob, row[token], atol=1e-4)
            assert len(record.top) == p.logprobs
            top_ids = [t for t, _ in record.top]
            assert top_ids == np.argsort(-row, kind="stable")[:p.logprobs].tolist()
            np.testing.assert_allclose([v for _, v in record.top], row[top_ids], atol=1e-4)
        if p.temperature == 0.0:
            assert all(r.top[0][0] == r.token_id for r in out.logprobs)   # greedy: the most likely token


def _check_prompt_logprobs(model, prompt: list[int], records: list, k: int) -> None:
    """``records`` (``RequestOutput.prompt_logprobs``) are transformers' log-softmax over
    ``prompt``: token j's value at place j - 1, and the ``k`` likeliest there."""
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1).numpy()
    assert len(records) == len(prompt) and records[0] is None
    for j, record in enumerate(records[1:], start=1):
        row = ref[j - 1]
        assert record.token_id == prompt[j]
        np.testing.assert_allclose(record.logprob, row[prompt[j]], atol=1e-4)
        top_ids = [t for t, _ in record.top]
        assert top_ids == np.argsort(-row, kind="stable")[:k].tolist()
        np.testing.assert_allclose([v for _, v in record.top], row[top_ids], atol=1e-4)


@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_prompt_logprobs_match_transformers_log_softmax(pool, hf_checkpoints, references, monkeypatch):
    """Every prompt token's logprob and its top alternatives are transformers' log-softmax
    at the place before it. The 41-token prompt is computed in chunks of a 16-token budget
    beside other rows. Roomy pool: a first request left its pages in the prefix cache; the
    scoring request computes its prompt anyway (no cached tokens), the plain one reuses them.
    Tight pool (10 pages of 8): the scoring request, admitted last, is preempted while its
    prompt is computed and recomputed (re-linking the pages it had scored), and no token is
    scored twice or skipped. The generated tokens stay transformers' greedy ones."""
    model, path = hf_checkpoints["llama"]
    llm = LLM(str(path), dtype="float32", page_size=8, num_pages=256 if pool == "roomy" else 10,
              max_num_batched_tokens=16, max_model_len=128, check_invariants=True, warmup=False)
    greedy = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    if pool == "roomy":
        first = llm.generate(prompt_token_ids=[prompts()[5]], sampling_params=SamplingParams(**greedy))[0]
        assert first.prompt_logprobs is None
        which = [5, 1, 5, 0]   # 41, 9, 41 and 3 tokens
        params = [SamplingParams(**greedy, prompt_logprobs=3, logprobs=1), SamplingParams(**greedy, prompt_logprobs=0),
                  SamplingParams(**greedy), SamplingParams(**greedy, prompt_logprobs=20)]
    else:
        which = [1, 0, 2, 5]   # 9, 3, 16 and 41 tokens
        params = [SamplingParams(**greedy), SamplingParams(**greedy, prompt_logprobs=20), SamplingParams(**greedy),
                  SamplingParams(**greedy, prompt_logprobs=3)]
    preempted_scoring = []   # requests preempted while their prompt was still being scored
    preempt = Scheduler._preempt

    def spy(self, request, plan):
        scored = request.prompt_logprobs
        preempted_scoring.append(scored is not None and len(scored) < request.prompt_len)
        return preempt(self, request, plan)
    monkeypatch.setattr(Scheduler, "_preempt", spy)
    ids = [prompts()[i] for i in which]
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)   # its rows sample beside scoring
    outs = llm.generate(prompt_token_ids=ids + [prompts()[3]], sampling_params=params + [sampled])
    assert outs.pop().token_ids == llm.generate(prompt_token_ids=[prompts()[3]], sampling_params=sampled)[0].token_ids
    for out, prompt, p, i in zip(outs, ids, params, which):
        assert out.token_ids == references["llama"][i]
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            _check_prompt_logprobs(model, prompt, out.prompt_logprobs, p.prompt_logprobs)
    if pool == "roomy":
        assert outs[0].num_cached_tokens == 0 and outs[2].num_cached_tokens == 40   # 5 full pages of 8
    else:
        assert any(preempted_scoring)


class _OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens, as its API
    reference writes them: ``logit[j] -= frequency * count[j] + presence * (count[j] > 0)``."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[-1]).to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_logit_adjustments_match_transformers(pool, hf_checkpoints, references):
    """Greedy outputs under ``logit_bias``, ``repetition_penalty``, presence/frequency
    penalties and ``min_tokens`` equal transformers' ``generate`` with its processors
    (``sequence_bias`` of single tokens, ``repetition_penalty``, ``min_new_tokens``; the
    OpenAI penalties as a processor written from OpenAI's formula), each request batched
    with the others and with a plain one (which stays the plain reference). The tight
    pool preempts requests mid-generation: their adjustments carry on from their context."""
    model, path = hf_checkpoints["llama"]
    llm = LLM(str(path), dtype="float32", page_size=8, num_pages=256 if pool == "roomy" else 12,
              max_num_batched_tokens=64, max_model_len=128, check_invariants=True, warmup=False)
    ids = prompts()
    plain = references["llama"]
    greedy = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    stop = 77
    cases = [   # (prompt index, engine settings, transformers generate settings)
        (1, dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (2, dict(logit_bias={plain[2][0]: -100.0, 7: 3.0}), dict(sequence_bias={(plain[2][0],): -100.0, (7,): 3.0})),
        (3, dict(presence_penalty=1.5, frequency_penalty=0.8), dict(penalties=(1.5, 0.8))),
        (4, dict(logit_bias={stop: 100.0}, min_tokens=5, stop_token_ids=[stop]),
         dict(sequence_bias={(stop,): 100.0}, min_new_tokens=5, eos_token_id=stop)),
        (5, dict(logit_bias={plain[5][1]: -5.0}, repetition_penalty=0.7, presence_penalty=-0.5, frequency_penalty=0.3),
         dict(sequence_bias={(plain[5][1],): -5.0}, repetition_penalty=0.7, penalties=(-0.5, 0.3))),
    ]
    outs = llm.generate(prompt_token_ids=[ids[i] for i, _, _ in cases] + [ids[0]],
                        sampling_params=[SamplingParams(**greedy, **engine) for _, engine, _ in cases]
                        + [SamplingParams(**greedy)])
    assert outs[-1].token_ids == plain[0]
    for (i, _, hf), out in zip(cases, outs):
        hf = dict(hf)
        penalties = hf.pop("penalties", None)
        processors = LogitsProcessorList([_OpenAIPenalties(len(ids[i]), *penalties)] if penalties else [])
        with torch.no_grad():
            want = model.generate(torch.tensor([ids[i]]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  logits_processor=processors, **hf)[0, len(ids[i]):].tolist()
        assert out.token_ids == want, (i, out.token_ids, want)
        assert out.token_ids != plain[i]   # the adjustment changed the answer
    assert outs[3].token_ids[-1] == stop and len(outs[3].token_ids) == 6 and outs[3].finish_reason == "stop"
    if pool == "tight":
        assert llm.engine.scheduler.num_preemptions > 0


def _checkpoint(tmp_path, config) -> tuple:
    """A tiny random transformers model of ``config`` (wide init, clear greedy margins), saved."""
    import transformers as tf
    torch.manual_seed(5)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    return model, tmp_path


@pytest.mark.parametrize("setting", ["gelu_tanh_mlp", "qwen2_window_on_later_layers"])
def test_checkpoint_settings_match_transformers(setting, tmp_path):
    """Settings that once loaded silently wrong: a gate activation other than SiLU (it ran as
    SiLU), and Qwen2's sliding window only on the layers from ``max_window_layers`` on (it
    windowed every layer). Prompts longer than the window, so the window matters."""
    import transformers as tf
    from conftest import TINY
    if setting == "gelu_tanh_mlp":
        config = tf.LlamaConfig(**TINY, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=False)
    else:
        config = tf.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                tie_word_embeddings=False)
    model, path = _checkpoint(tmp_path, config)
    llm = LLM(str(path), dtype="float32", page_size=8, num_pages=64, max_num_batched_tokens=64, max_model_len=128,
              warmup=False)
    ids = prompts(2)[3:]
    outs = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=12, temperature=0.0,
                                                                            ignore_eos=True))
    for out, prompt in zip(outs, ids):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert out.token_ids == want.tolist()
    if setting == "qwen2_window_on_later_layers":
        assert [llm.engine.model_config.window_of(layer) for layer in range(2)] == [None, 8]
