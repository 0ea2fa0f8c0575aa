"""``cuda_graphs``: the step programs' XLA command-buffer options (GPU only)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.executor import model as executor_module
from jaxserve.executor.model import CUDA_GRAPH_COMMANDS, cuda_graphs_for, step_compiler_options


def test_options_only_on_a_gpu_and_only_when_asked():
    assert step_compiler_options("gpu", False) is None
    assert step_compiler_options("cpu", True) is None and step_compiler_options("tpu", True) is None
    options = step_compiler_options("gpu", True)
    assert options == {"xla_gpu_enable_command_buffer": CUDA_GRAPH_COMMANDS, "xla_gpu_graph_min_graph_size": 1}
    assert {"CUSTOM_CALL", "CONDITIONAL"} <= set(CUDA_GRAPH_COMMANDS.split(","))   # the kernel, the sampler


def test_on_by_default_on_cuda_gpus_only_and_a_user_choice_wins():
    from types import SimpleNamespace

    cuda, rocm = SimpleNamespace(platform="gpu", compute_capability="9.0"), \
        SimpleNamespace(platform="gpu", compute_capability="gfx90a")
    assert cuda_graphs_for(cuda, None) is True and cuda_graphs_for(rocm, None) is False
    assert cuda_graphs_for(jax.devices()[0], None) is False   # this CPU
    assert cuda_graphs_for(SimpleNamespace(platform="tpu"), None) is False
    assert cuda_graphs_for(cuda, False) is False and cuda_graphs_for(jax.devices()[0], True) is True


def test_xla_accepts_the_gpu_options():
    """XLA parses compile options on every backend (a misspelt command kind is an error
    here too), so the GPU's options are checked on CPU."""
    double = jax.jit(lambda x: 2 * x, compiler_options=step_compiler_options("gpu", True))
    np.testing.assert_array_equal(double(jnp.arange(3)), [0, 2, 4])
    with pytest.raises(Exception, match="not a valid enum value"):
        jax.jit(lambda x: x, compiler_options={"xla_gpu_enable_command_buffer": "FUSION,GRAPHS"})(1)


def test_the_option_is_ignored_with_a_warning_off_a_gpu(caplog):
    with caplog.at_level("WARNING", logger="jaxserve"):
        llm = LLM("demo", num_pages=32, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=64,
                  warmup=False, cuda_graphs=True)
    llm.engine.shutdown()
    assert "cuda_graphs is for GPUs: ignored on cpu" in caplog.text


def test_the_default_on_cpu_builds_without_graphs_and_says_nothing(caplog):
    with caplog.at_level("WARNING", logger="jaxserve"):
        llm = LLM("demo", num_pages=32, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=64, warmup=False)
    llm.engine.shutdown()
    assert llm.engine.config.cuda_graphs is None and llm.engine.executor.config.cuda_graphs is False
    assert "cuda_graphs" not in caplog.text


def test_the_option_reaches_every_step_program(monkeypatch):
    """With the GPU's options forced on this CPU (XLA:CPU accepts them), an engine built with
    ``cuda_graphs`` jits its four step programs (step, forward, masked sampler, log-probabilities)
    with them, and its steps compile and run."""
    gpu_options = step_compiler_options("gpu", True)
    monkeypatch.setattr(executor_module, "step_compiler_options",
                        lambda platform, cuda_graphs: step_compiler_options("gpu", cuda_graphs))
    passed, real_jit = [], jax.jit

    def spy_jit(fn, **kwargs):
        passed.append(kwargs.get("compiler_options"))
        return real_jit(fn, **kwargs)
    monkeypatch.setattr(jax, "jit", spy_jit)
    llm = LLM("demo", num_pages=32, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=64,
              warmup=False, cuda_graphs=True)
    try:
        assert llm.engine.executor.config.cuda_graphs is True
        assert passed.count(gpu_options) == 4, passed
        out = llm.generate(prompt_token_ids=[[5, 6, 7]],
                           sampling_params=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1))
    finally:
        llm.engine.shutdown()
    assert len(out[0].token_ids) == len(out[0].logprobs) == 3
