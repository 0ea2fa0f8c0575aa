"""``cuda_graphs``: the step programs' XLA command-buffer options (GPU only)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.executor.model import CUDA_GRAPH_COMMANDS, step_compiler_options


def test_options_only_on_a_gpu_and_only_when_asked():
    assert step_compiler_options("gpu", False) is None
    assert step_compiler_options("cpu", True) is None and step_compiler_options("tpu", True) is None
    options = step_compiler_options("gpu", True)
    assert options == {"xla_gpu_enable_command_buffer": CUDA_GRAPH_COMMANDS, "xla_gpu_graph_min_graph_size": 1}
    assert {"CUSTOM_CALL", "CONDITIONAL"} <= set(CUDA_GRAPH_COMMANDS.split(","))   # the kernel, the sampler


def test_xla_accepts_the_gpu_options():
    """XLA parses compile options on every backend (a misspelt command kind is an error
    here too), so the GPU's options are checked on CPU."""
    double = jax.jit(lambda x: 2 * x, compiler_options=step_compiler_options("gpu", True))
    np.testing.assert_array_equal(double(jnp.arange(3)), [0, 2, 4])
    with pytest.raises(Exception, match="not a valid enum value"):
        jax.jit(lambda x: x, compiler_options={"xla_gpu_enable_command_buffer": "FUSION,GRAPHS"})(1)


def test_the_option_leaves_a_cpu_engine_as_it_was():
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = []
    for cuda_graphs in (False, True):
        llm = LLM("demo", num_pages=32, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=64,
                  warmup=False, cuda_graphs=cuda_graphs)
        outs.append([o.token_ids for o in llm.generate(prompt_token_ids=[[5, 6, 7], [9] * 20], sampling_params=params)])
        llm.engine.shutdown()
    assert outs[0] == outs[1] and all(len(t) == 5 for t in outs[0])
