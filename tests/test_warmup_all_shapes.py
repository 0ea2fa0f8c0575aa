"""``warmup_all_shapes``: every step shape is compiled before serving, so a timed
run (tools/replay_fidelity.py) never pays a compile mid-run."""

from jaxserve import LLM, SamplingParams


def test_warmup_all_shapes_compiles_every_step_shape_before_the_run():
    llm = LLM("demo", page_size=8, num_pages=32, max_num_batched_tokens=32, max_model_len=64,
              warmup_all_shapes=True)
    executor = llm.engine.executor
    cfg = executor.config
    widths = {cfg.page_bucket(p) for p in range(1, cfg.pages_per_seq + 1)}
    compiled = executor._step._cache_size()
    assert compiled == len(cfg.token_buckets) * len(widths)
    outs = llm.generate(prompt_token_ids=[list(range(4, 30)), list(range(5, 12)), list(range(6, 50))],
                        sampling_params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    assert len(executor.step_shapes) >= 2
    assert executor._step._cache_size() == compiled    # nothing compiled while serving
