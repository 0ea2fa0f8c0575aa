"""Import ``transformers`` for its tokenizers without its "PyTorch was not found" notice.

jaxserve uses transformers only for tokenizers, chat templates and GGUF
tokenizer conversion, none of which need PyTorch; at import time transformers
logs an advisory on its root logger whenever PyTorch is absent, which on a
normal (torch-free) install is noise on every run. A filter on that one logger
drops exactly that record; every other transformers message still shows.
"""

from __future__ import annotations

import logging

_NO_TORCH_NOTICE = "PyTorch was not found"


class _DropNoTorchNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _NO_TORCH_NOTICE not in record.getMessage()


def quiet_transformers():
    """The ``transformers`` module, imported with the no-PyTorch notice filtered out."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _DropNoTorchNotice) for f in logger.filters):
        logger.addFilter(_DropNoTorchNotice())
    import transformers

    return transformers
