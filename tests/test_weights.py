"""Checkpoint loading: sharded files, dtypes, dummy weights, and clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.weights import load_model


def test_sharded_checkpoint_loads_identically(tmp_path, hf_checkpoints):
    model, single = hf_checkpoints["qwen2"]
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a, _ = load_model(single, progress=False)
    b, _ = load_model(sharded, progress=False)
    np.testing.assert_array_equal(np.asarray(a.layers[1].self_attn.q_proj.bias[...]),
                                  np.asarray(b.layers[1].self_attn.q_proj.bias[...]))
    np.testing.assert_array_equal(np.asarray(a.lm_head.kernel[...]), np.asarray(b.lm_head.kernel[...]))


def _copy_with(tmp_path, src, edit) -> str:
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_missing_tensor_is_named(tmp_path, hf_checkpoints):
    path = _copy_with(tmp_path, hf_checkpoints["mistral"][1],
                      lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(path, progress=False)


def test_mismatched_tensor_is_named(tmp_path, hf_checkpoints):
    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:10]
    path = _copy_with(tmp_path, hf_checkpoints["mistral"][1], shrink)
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(10,\)"):
        load_model(path, progress=False)


def test_unknown_model_type_lists_supported(tmp_path, hf_checkpoints):
    dst = tmp_path / "gpt"
    shutil.copytree(hf_checkpoints["llama"][1], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gpt2.*llama, mistral, qwen2"):
        load_model(dst, progress=False)


def test_bfloat16_and_dummy_weights_run(hf_checkpoints):
    path = str(hf_checkpoints["llama"][1])
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    f32 = LLM(path, page_size=8, num_pages=32, max_num_batched_tokens=16, max_model_len=64, warmup=False)
    bf16 = LLM(path, dtype="bfloat16", page_size=8, num_pages=32, max_num_batched_tokens=16, max_model_len=64,
               warmup=False)
    assert bf16.engine.executor.kv[0][0].dtype.name == "bfloat16"
    a = f32.generate(prompt_token_ids=prompts, sampling_params=params)
    b = bf16.generate(prompt_token_ids=prompts, sampling_params=params)
    # the wide-init test model keeps a clear top-1 margin for the first tokens even in bfloat16
    assert [o.token_ids[:2] for o in a] == [o.token_ids[:2] for o in b]
    dummy = LLM(path, load_format="dummy", page_size=8, num_pages=32, max_num_batched_tokens=16, max_model_len=64,
                warmup=False)
    out = dummy.generate(prompt_token_ids=prompts, sampling_params=params)
    assert all(len(o.token_ids) == 6 for o in out)
    with pytest.raises(ValueError, match="dtype"):
        LLM(path, dtype="int8", warmup=False)
    with pytest.raises(ValueError, match="load_format"):
        LLM(path, load_format="pickle", warmup=False)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in name \\(demo, smollm2-135m\\), a checkpoint directory"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))


def test_a_checkpoint_without_tokenizer_warns_in_one_line(tmp_path, caplog):
    """No tokenizer files: token-id prompts only, said in one line (transformers 5's
    error appends a paragraph about converting slow tokenizers)."""
    import logging

    from jaxserve.model_source import load_tokenizer
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert load_tokenizer(tmp_path) is None
    (message,) = [r.getMessage() for r in caplog.records if "no tokenizer" in r.getMessage()]
    assert "\n" not in message and message.endswith("prompts must be token ids")


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_abstract_model_is_the_model_built_with_nnx_rngs(hf_checkpoints, kind):
    """``abstract_model`` builds without counting RNG draws (each costs time in proportion
    to the trace inside ``nnx.eval_shape``): the same graph, and every parameter of the
    same path, shape and dtype, as the model built with ``nnx.Rngs``."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.weights import abstract_model, model_class_for, read_config
    cfg = read_config(hf_checkpoints[kind][1])
    fast = abstract_model(cfg, jnp.bfloat16, "reference")
    counted = nnx.eval_shape(lambda: model_class_for(cfg.model_type)(
        cfg, dtype=jnp.bfloat16, attention_impl="reference", rngs=nnx.Rngs(0)))
    (fast_graph, fast_state), (graph, state) = nnx.split(fast), nnx.split(counted)
    assert fast_graph == graph
    shapes = [(path, v.get_value().shape, v.get_value().dtype) for path, v in nnx.to_flat_state(state)]
    assert [(path, v.get_value().shape, v.get_value().dtype) for path, v in nnx.to_flat_state(fast_state)] == shapes
