"""``jaxserve bench``: jaxserve vs transformers ``generate`` (see ``jaxserve.bench``)."""

from jaxserve.bench import add_arguments, main  # noqa: F401
