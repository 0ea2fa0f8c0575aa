"""Read a llama.cpp GGUF file: model config from its metadata, weights dequantized
to numpy with the ``gguf`` package, tokenizer and chat template through
transformers' GGUF tokenizer support.

Architectures: ``llama`` (Llama 2/3, Mistral, SmolLM…: the GGUF converter
writes all of them as ``llama``), ``qwen2`` (Qwen2, Qwen2.5: q/k/v biases) and
``qwen3`` (per-head q/k norms, heads wider than hidden/heads). For ``llama``,
llama.cpp stores the query and key projections with their rotary halves
interleaved; ``_unpermute`` undoes that so the weights match the Hugging Face
layout the model code uses. The Qwen architectures use the rotary layout
Hugging Face does (llama.cpp's NEOX rope), so their tensors are stored as is.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.config import cache_root

log = logging.getLogger("jaxserve.gguf")

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_PERMUTED_QK = ("llama",)   # architectures whose q/k rows llama.cpp interleaves
INDEX_FORMAT = "2"   # what a kept index holds (``hf_config``'s rules): a new one makes kept indexes stale

# nnx parameter path pieces -> GGUF tensor name pieces (per layer: ``blk.{i}.``).
_LAYER_NAMES = {
    ("input_layernorm", "weight"): "attn_norm.weight",
    ("post_attention_layernorm", "weight"): "ffn_norm.weight",
    ("self_attn", "q_proj", "kernel"): "attn_q.weight",
    ("self_attn", "k_proj", "kernel"): "attn_k.weight",
    ("self_attn", "v_proj", "kernel"): "attn_v.weight",
    ("self_attn", "o_proj", "kernel"): "attn_output.weight",
    ("self_attn", "q_proj", "bias"): "attn_q.bias",
    ("self_attn", "k_proj", "bias"): "attn_k.bias",
    ("self_attn", "v_proj", "bias"): "attn_v.bias",
    ("self_attn", "o_proj", "bias"): "attn_output.bias",
    ("self_attn", "q_norm", "weight"): "attn_q_norm.weight",
    ("self_attn", "k_norm", "weight"): "attn_k_norm.weight",
    ("mlp", "gate_proj", "kernel"): "ffn_gate.weight",
    ("mlp", "up_proj", "kernel"): "ffn_up.weight",
    ("mlp", "down_proj", "kernel"): "ffn_down.weight",
}


def is_gguf_path(path: str | Path) -> bool:
    """True when ``path`` names a ``.gguf`` file (existing or not)."""
    return str(path).lower().endswith(".gguf")


KEPT_VERSIONS = 32   # GGUF file versions whose index, and whose tokenizer, are kept (most recently used)
STALE_WRITE_S = 3600   # an entry still being written after this long was left by a writer that died


def _touch(kept: Path) -> None:
    """Mark a kept entry used now (``_keep_newest`` drops the least recently used)."""
    try:
        os.utime(kept)
    except OSError:
        pass


def _keep_newest(folder: Path, count: int = KEPT_VERSIONS) -> None:
    """Delete all but the ``count`` most recently used entries of ``folder`` (files or
    folders; by modification time, which a use refreshes: ``_touch``): each edited or
    replaced GGUF file leaves an entry for its old version behind, which nothing reads
    again. Entries being written (dot names) are left alone unless older than
    ``STALE_WRITE_S`` (their writer died); ones another process deletes meanwhile are
    skipped."""
    entries, stale = [], []
    oldest_write = time.time_ns() - STALE_WRITE_S * 10**9
    for entry in os.scandir(folder):
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime_ns
            if not entry.name.startswith("."):
                entries.append((mtime, entry.path, entry.is_dir()))
            elif mtime < oldest_write:
                stale.append((mtime, entry.path, entry.is_dir()))
        except FileNotFoundError:
            continue
    for _, name, is_dir in sorted(entries)[:max(0, len(entries) - count)] + stale:
        if is_dir:
            shutil.rmtree(name, ignore_errors=True)
        else:
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass


def _version_key(path: Path, *versions: str) -> str:
    """A name for what is kept of the file ``path`` (resolved) as it is now (inode, change
    and modification times, size) and built by the library ``versions``."""
    stat = path.stat()
    key = "|".join(map(str, (path, stat.st_ino, stat.st_ctime_ns, stat.st_mtime_ns, stat.st_size, *versions)))
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` for ``path``; a missing or non-GGUF file is a ``ValueError``.

    Readers are kept per file version (path, inode, change and modification times, size)
    until ``release_readers``: parsing the metadata (SmolLM2's ~100,000 vocabulary and
    merge strings, one by one) takes ~4 s, and an engine reads the config and then the
    weights."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    stat = path.stat()
    return _reader(str(path.resolve()), stat.st_ino, stat.st_ctime_ns, stat.st_mtime_ns, stat.st_size)


def release_readers() -> None:
    """Forget the kept readers, unmapping their files (``load_model`` calls it once the
    weights are on the devices)."""
    _reader.cache_clear()


@functools.lru_cache(maxsize=2)
def _reader(path: str, inode: int, ctime_ns: int, mtime_ns: int, size: int):
    import gguf

    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path!r} is not a GGUF file (it does not start with the 'GGUF' magic bytes)")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - truncated or corrupt file: say which
        raise ValueError(f"cannot read GGUF file {path!r}: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name, quantization (``gguf.GGMLQuantizationType``)
    and raw data (read-only, mapped from the file), as ``gguf.GGUFReader`` gives them."""

    name: str
    tensor_type: object
    data: np.ndarray


@dataclass(frozen=True)
class GGUFIndex:
    """What loading a model needs of a GGUF file: its Hugging Face config (``hf_config``)
    and its tensors."""

    config: dict
    tensors: list[GGUFTensor]


def open_index(path: str | Path) -> GGUFIndex:
    """The ``GGUFIndex`` of a GGUF file (a ``ValueError`` as ``open_gguf`` and ``hf_config``
    raise them).

    ``gguf.GGUFReader`` parses every metadata entry, SmolLM2's ~100,000 vocabulary and
    merge strings among them (~3 s), where a model needs a few numbers and the tensors'
    places. So the config and each tensor's type, data type, shape and offset are kept
    in ``cache_root() / "gguf-index"`` per file version (path, inode, change and
    modification times, size, gguf version, ``INDEX_FORMAT``), and later loads map the tensors from that
    without parsing the file (the ``KEPT_VERSIONS`` most recently used). A cache that
    cannot be written only costs the time."""
    import gguf

    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    path = path.resolve()
    kept = cache_root() / "gguf-index" / f"{_version_key(path, importlib.metadata.version('gguf'), INDEX_FORMAT)}.json"
    try:
        index = json.loads(kept.read_text())
    except (OSError, ValueError):
        index = None
    if index is not None:
        _touch(kept)
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = []
        for name, kind, dtype, shape, offset in index["tensors"]:
            dtype = np.dtype(dtype)
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            tensors.append(GGUFTensor(name, gguf.GGMLQuantizationType(kind),
                                      raw[offset:offset + size].view(dtype).reshape(shape)))
        return GGUFIndex(index["config"], tensors)
    reader = open_gguf(path)
    config = hf_config(reader)
    tensors = [GGUFTensor(t.name, t.tensor_type, t.data) for t in reader.tensors]
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        entries = [(t.name, int(t.tensor_type), t.data.dtype.str, list(t.data.shape), int(t.data_offset))
                   for t in reader.tensors]
        fd, tmp = tempfile.mkstemp(dir=kept.parent, prefix=".index-")
        with os.fdopen(fd, "w") as f:
            json.dump({"config": config, "tensors": entries}, f)
        os.replace(tmp, kept)
        _keep_newest(kept.parent)
    except OSError as e:
        log.info("index of %s not kept in %s (%s)", path.name, kept.parent, e)
    return GGUFIndex(config, tensors)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def hf_config(reader) -> dict:
    """The checkpoint's hyper-parameters as a Hugging Face ``config.json`` dict.

    Raises ``ValueError`` for an architecture not in ``SUPPORTED_ARCHITECTURES`` or
    missing required keys.
    """
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return value

    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (only none and linear)")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF files with per-frequency rope factors (rope_freqs.weight, Llama 3.1 style) are not supported")
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    cfg = {
        "model_type": arch,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length")
                        or _field(reader, f"{arch}.rope.dimension_count") or hidden // heads),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        # (Qwen2's q/k/v biases come with its model type; o_proj has none)
        "attention_bias": arch == "llama" and any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    return cfg


def gguf_name(path: tuple) -> tuple[str, bool]:
    """nnx parameter path -> (GGUF tensor name, needs transpose to the nnx layout)."""
    parts = tuple(str(p) for p in path)
    if parts[0] == "embed_tokens":
        return "token_embd.weight", False
    if parts[0] == "lm_head":
        return "output.weight", True
    if parts[0] == "norm":
        return "output_norm.weight", False
    if parts[0] == "layers" and parts[2:] in _LAYER_NAMES:
        name = _LAYER_NAMES[parts[2:]]
        return f"blk.{parts[1]}.{name}", parts[-1] == "kernel"
    raise ValueError(f"no GGUF tensor for model parameter {'.'.join(parts)}")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary interleave of a q/k projection (rows ``[heads*head_dim]``)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_quant_types(reader) -> None:
    """Raise ``ValueError`` naming any tensor of ``reader`` (a ``gguf.GGUFReader`` or a
    ``GGUFIndex``) whose quantization ``gguf`` cannot dequantize."""
    import gguf

    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    known = plain | set(getattr(gguf.quants, "_type_traits", {}).keys())
    bad = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in known})
    if bad:
        raise ValueError(f"GGUF quantization type(s) {', '.join(bad)} are not supported by the installed gguf "
                         f"package; supported: {', '.join(sorted(k.name for k in known))}")


def tensor_values(index: GGUFIndex, flat: list, progress: bool = False) -> list[np.ndarray]:
    """float32 numpy arrays for the nnx parameters ``flat`` (``(path, variable)``
    pairs, nnx layout: linear kernels ``[in, out]``), dequantized from ``index``'s tensors."""
    import gguf
    from tqdm.auto import tqdm

    check_quant_types(index)
    cfg = index.config
    tensors = {t.name: t for t in index.tensors}
    values = []
    for path, var in tqdm(flat, desc="loading GGUF", disable=not progress, leave=False):
        name, transpose = gguf_name(path)
        if name not in tensors:
            raise ValueError(f"GGUF file is missing tensor {name!r}")
        t = tensors[name]
        arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if cfg["model_type"] in _PERMUTED_QK and name.endswith(("attn_q.weight", "attn_q.bias")):
            arr = _unpermute(arr, cfg["num_attention_heads"])
        elif cfg["model_type"] in _PERMUTED_QK and name.endswith(("attn_k.weight", "attn_k.bias")):
            arr = _unpermute(arr, cfg["num_key_value_heads"])
        if transpose:
            arr = arr.T
        want = tuple(var.get_value().shape)
        if tuple(arr.shape) != want:
            raise ValueError(f"GGUF tensor {name!r} has shape {tuple(arr.shape)}, the model expects {want}")
        values.append(arr)
    return values


def load_tokenizer(path: str | Path):
    """The file's tokenizer (with its chat template) as a transformers fast tokenizer.

    transformers builds it from the file's vocabulary and merges (~3 s for SmolLM2's
    49,152 tokens); the result is kept in ``cache_root() / "tokenizers"`` under the file
    version (path, inode, change and modification times, size) and the transformers and
    tokenizers versions, and later loads read that (~0.2 s; the ``KEPT_VERSIONS`` most
    recently used are kept). A cache that cannot be written only costs the time."""
    import tokenizers

    from jaxserve.hf_import import quiet_transformers

    transformers = quiet_transformers()
    path = Path(path).expanduser().resolve()
    kept = cache_root() / "tokenizers" / _version_key(path, transformers.__version__, tokenizers.__version__)
    if (kept / "tokenizer.json").is_file():
        _touch(kept)
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(kept), local_files_only=True)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                     local_files_only=True)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=kept.parent, prefix=".tokenizer-"))
        try:
            tokenizer.save_pretrained(str(tmp))
            os.replace(tmp, kept)   # whole or not at all (another process may have won the race)
            _keep_newest(kept.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        log.info("tokenizer of %s not kept in %s (%s)", path.name, kept.parent, e)
    return tokenizer
