"""The ``jaxserve`` command: ``serve``, ``run-batch``, ``replay``, ``profile``, ``bench``, ``generate``, ``predictor``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; this file only wires them. Every ``--some-flag`` can
also be set with the environment variable ``JAXSERVE_SOME_FLAG`` (the command
line wins).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("jaxserve.generate_cli", "generate text from prompts (the main job: smollm2-135m, see README)"),
    "serve": ("server.cli", "run the OpenAI-compatible HTTP server"),
    "run-batch": ("server.batch_cli", "run an OpenAI batch file (JSONL of chat, completions and responses "
                  "requests) offline"),
    "replay": ("jaxserve.replay.cli", "replay a workload trace and compare scheduling policies"),
    "profile": ("jaxserve.profiling", "measure the cost model (T_fwd, host<->device bandwidth) of this device"),
    "bench": ("jaxserve.bench", "benchmark jaxserve against transformers generate"),
    "predictor": ("jaxserve.predictor.cli", "train / evaluate the learned output-length probe"),
}


def refuse(command: str, error: Exception | str) -> int:
    """A user error of ``jaxserve COMMAND`` (a bad setting, a model that is not there): one
    line on stderr; returns the exit status, 2 (argparse's for a usage error)."""
    print(f"jaxserve {command}: {error}", file=sys.stderr)
    return 2


def check_output_dir(flag: str, out: Path) -> None:
    """An output directory option ``flag`` set to ``out``, checked before any work: it, or
    the nearest folder above it that exists, must be a writable directory (``ValueError``)."""
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{flag} {out}: {existing} is a file, not a directory")
    if existing is not None and not os.access(existing, os.W_OK):
        raise ValueError(f"{flag} {out}: {existing} is not writable")


def env_var_for(option: str) -> str:
    """``--max-model-len`` -> ``JAXSERVE_MAX_MODEL_LEN``."""
    return "JAXSERVE_" + option.lstrip("-").replace("-", "_").upper()


class _AppendOverEnv(argparse._AppendAction):
    """A repeatable option whose default came from ``JAXSERVE_<FLAG>``: its first use on
    the command line replaces that default (the command line wins, as for every option)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


class RefusedEnvValue:
    """A ``JAXSERVE_<FLAG>`` value its option refuses, kept as the option's default: only
    the subcommand that runs with it refuses it (``check_env_values``; an option of the
    same name in another subcommand may take it)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"<refused: {self.message}>"


def apply_env_defaults(parser: argparse.ArgumentParser, environ: dict[str, str] | None = None) -> None:
    """Let ``JAXSERVE_<FLAG>`` set the default of every long option of ``parser`` (and of
    its subcommands'), read as the option reads its argument (a ``RefusedEnvValue`` where
    it would refuse it)."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest == "help":
            continue
        name = env_var_for(longs[0])
        value = environ.get(name)
        if value is None:
            continue
        if action.nargs == 0:  # store_true / store_false / --flag/--no-flag: the variable says whether it is on
            word = value.strip().lower()
            action.default = word in TRUE_WORDS if word in TRUE_WORDS + FALSE_WORDS else RefusedEnvValue(
                f"{name}: {value!r} is not one of {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS[:-1])}")
        elif type(action) is argparse._AppendAction:   # a repeatable option: the variable is one value
            action.default = [_env_value(action, name, value)]
            action.__class__ = _AppendOverEnv
        else:
            action.default = _env_value(action, name, value)
        action.required = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                apply_env_defaults(sub, environ)


def _env_value(action: argparse.Action, name: str, value: str):
    """``value`` of the variable ``name`` as ``action`` reads its argument: converted by its
    type and one of its choices, else a ``RefusedEnvValue`` saying why."""
    try:
        converted = action.type(value) if action.type else value
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        type_name = getattr(action.type, "__name__", "")
        reason = str(e) if isinstance(e, argparse.ArgumentTypeError) or not type_name else f"invalid {type_name} value"
        return RefusedEnvValue(f"{name}: {reason}: {value!r}")
    if action.choices is not None and converted not in action.choices:
        return RefusedEnvValue(f"{name}: invalid choice {value!r} (choose from {', '.join(map(str, action.choices))})")
    return converted


def check_env_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser``'s usage error (exit status 2) if a setting of ``args`` is a
    ``JAXSERVE_<FLAG>`` value its option refuses (``apply_env_defaults``)."""
    for value in vars(args).values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, RefusedEnvValue):
                parser.error(item.message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    subs = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sub)
        sub.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    apply_env_defaults(parser)
    args = parser.parse_args(argv)
    check_env_values(parser, args)
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
