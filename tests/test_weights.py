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


def _with_config(tmp_path, src, **changes):
    """A copy of checkpoint ``src`` with ``config.json`` entries changed (None: removed)."""
    dst = tmp_path / "configured"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes,message", [
    # an architecture without Llama's keys: named as unsupported, not as a missing key
    (dict(model_type="gpt2", num_attention_heads=None, n_head=4), "unsupported model_type 'gpt2'"),
    (dict(hidden_act="gelu_fast"), "unsupported hidden_act 'gelu_fast'"),
    (dict(rope_scaling={"rope_type": "linear"}, rope_parameters=None), "'linear' is missing 'factor'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}, rope_parameters=None),
     "'llama3' is missing 'original_max_position_embeddings'"),
])
def test_a_setting_this_model_cannot_run_is_a_named_error(tmp_path, hf_checkpoints, changes, message):
    with pytest.raises(ValueError, match=message):
        load_model(_with_config(tmp_path, hf_checkpoints["llama"][1], **changes), progress=False)


def test_sliding_windows_are_read_per_family():
    """As ``transformers`` reads them: Mistral windows every layer, Qwen2/3 only the layers
    ``layer_types`` (or ``max_window_layers``) name and only with ``use_sliding_window``,
    Llama never (a ``sliding_window`` in its config.json is not read)."""
    from jaxserve.models import ModelConfig
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                sliding_window=8)
    windows = lambda **cfg: [ModelConfig.from_hf({**base, **cfg}).window_of(i) for i in range(3)]   # noqa: E731
    assert windows(model_type="mistral") == [8, 8, 8]
    assert windows(model_type="llama") == [None, None, None]
    assert windows(model_type="qwen2") == [None, None, None]
    assert windows(model_type="qwen2", use_sliding_window=True, max_window_layers=1) == [None, 8, 8]
    assert windows(model_type="qwen3", use_sliding_window=True, max_window_layers=1,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]) == [8, None, 8]


def test_generation_config_stop_ids_end_generation(tmp_path, hf_checkpoints):
    """``generation_config.json``'s ``eos_token_id`` (a list) ends generation as
    ``transformers``' ``generate`` ends it, besides ``config.json``'s."""
    from jaxserve.weights import read_config
    dst = _with_config(tmp_path, hf_checkpoints["llama"][1], eos_token_id=2)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 106]}))
    assert read_config(dst).eos_token_ids == (2, 106)
    llm = LLM(str(dst), dtype="float32", num_pages=32, page_size=8, max_model_len=64, warmup=False)
    assert {2, 106} <= llm.engine.eos_token_ids


def test_a_whole_file_beside_a_stale_index_is_the_one_loaded(tmp_path, hf_checkpoints):
    """A folder saved sharded and then whole keeps the shards' index: ``model.safetensors``
    is the checkpoint, as ``transformers`` reads it; an index whose shards are gone (and no
    whole file) is a named error."""
    model, single = hf_checkpoints["qwen2"]
    dst = tmp_path / "resaved"
    model.save_pretrained(dst, max_shard_size="20KB")
    for shard in dst.glob("model-*.safetensors"):
        shard.unlink()
    with pytest.raises(ValueError, match="names .* shard"):
        load_model(dst, progress=False)
    shutil.copy(single / "model.safetensors", dst / "model.safetensors")
    loaded, _ = load_model(dst, progress=False)
    np.testing.assert_array_equal(np.asarray(loaded.lm_head.kernel[...]),
                                  load_file(str(single / "model.safetensors"))["lm_head.weight"].T)


def test_a_tied_checkpoint_with_its_own_head_uses_that_head(tmp_path, hf_checkpoints):
    """``tie_word_embeddings`` with an ``lm_head.weight`` that differs from the embeddings:
    the file's head is used (untied), as ``transformers`` does; an equal one stays tied."""
    src = hf_checkpoints["llama"][1]   # (tied)
    rng = np.random.default_rng(0)
    path = _copy_with(tmp_path, src, lambda t: t.update({"lm_head.weight": rng.standard_normal(
        t["model.embed_tokens.weight"].shape).astype(np.float32)}))
    model, cfg = load_model(path, progress=False)
    head = load_file(f"{path}/model.safetensors")["lm_head.weight"]
    assert not cfg.tie_word_embeddings
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]), head.T)
    same = _copy_with(tmp_path / "same", src, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    assert load_model(same, progress=False)[1].tie_word_embeddings


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
