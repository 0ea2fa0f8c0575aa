"""EngineConfig: one place for engine settings, their defaults, checks and flags."""

import argparse
import dataclasses
import time

import pytest

from jaxserve.cli import apply_env_defaults, build_parser
from jaxserve.config import ATTENTION_IMPLS, DEFAULT_POLICY, EngineConfig

BAD_SETTINGS = [
    ("page_size", 3), ("page_size", 0), ("num_pages", 0), ("num_host_pages", -1), ("max_model_len", 0),
    ("max_num_batched_tokens", -5), ("max_num_seqs", 0), ("swap_budget_tokens", 0), ("seed", -1),
    ("dtype", "int8"), ("load_format", "pickle"), ("attention_impl", "flash"), ("handling", "keep"),
    ("policy", "lifo"), ("predictor", "psychic"), ("tool_call_parser", "xml"), ("max_num_seqs", True),
    ("compilation_cache_max_gb", 0), ("compilation_cache_max_gb", float("inf")), ("compilation_cache_max_gb", "4"),
    ("chat_template", "/no/such/template.jinja"), ("chat_template", "{% for m in messages %}unclosed"),
    ("chat_template", ""), ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5),
    ("gpu_memory_utilization", True), ("gpu_memory_utilization", "0.5"),
]

ENGINE_SUBCOMMANDS = ("serve", "run-batch", "generate", "replay", "profile", "bench")   # the ones that build an engine
# Settings whose default a subcommand changes on purpose (documented in its --help).
SUBCOMMAND_DEFAULTS = {("profile", "num_pages"): 512}


@pytest.mark.parametrize("name,value", BAD_SETTINGS)
def test_every_invalid_setting_is_a_value_error_naming_the_field(name, value):
    with pytest.raises(ValueError) as err:
        EngineConfig(**{name: value})
    assert str(err.value).startswith(name), str(err.value)


def test_bad_setting_is_refused_before_any_model_is_loaded():
    from jaxserve import LLM

    start = time.perf_counter()
    with pytest.raises(ValueError, match="^page_size"):
        LLM("/nonexistent/checkpoint", page_size=12)   # the path is never looked at
    assert time.perf_counter() - start < 5


def test_unknown_override_names_the_known_settings():
    with pytest.raises(ValueError, match="unknown engine setting.*host_num_pages"):
        EngineConfig().replace(host_num_pages=4)


def test_attention_impls_match_the_kernels():
    import kernels

    assert set(ATTENTION_IMPLS) == set(kernels.IMPLS)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_has_the_same_engine_flags_and_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli")}
    seen = {}
    subs = _subparsers()
    for name in ENGINE_SUBCOMMANDS:
        sub = subs[name]
        dests = {a.dest: a.default for a in sub._actions}
        shared = {k: v for k, v in dests.items() if k in defaults}
        assert shared, f"{name} builds no engine flags from EngineConfig"
        seen[name] = set(shared)
        for key, value in shared.items():
            assert value == SUBCOMMAND_DEFAULTS.get((name, key), defaults[key]), (name, key, value)
    # The flags every engine-building subcommand shares:
    for name in ENGINE_SUBCOMMANDS:
        assert {"page_size", "num_pages", "max_num_batched_tokens", "dtype"} <= seen[name], name
    assert DEFAULT_POLICY == "infercept" and defaults["policy"] == DEFAULT_POLICY


def test_env_vars_set_engine_defaults_in_every_subcommand():
    parser = build_parser()
    apply_env_defaults(parser, {"JAXSERVE_PAGE_SIZE": "32", "JAXSERVE_WARMUP": "false"})
    for name in ("serve", "generate", "profile"):
        argv = [name] + (["demo"] if name in ("serve",) else [])
        args = parser.parse_args(argv)
        config = EngineConfig.from_cli(args)
        assert config.page_size == 32 and config.warmup is False, name


def test_from_cli_round_trip_and_overrides():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(["demo", "--policy", "lamps", "--num-pages", "64", "--no-compilation-cache",
                              "--handling", "swap", "--cuda-graphs"])
    config = EngineConfig.from_cli(args, seed=7)
    assert (config.model, config.policy, config.num_pages, config.compilation_cache, config.handling,
            config.seed, config.cuda_graphs) == ("demo", "lamps", 64, False, "swap", 7, True)
    assert config.batched_tokens == EngineConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
    # cuda_graphs: unset means "on on GPUs" (None); --no-cuda-graphs turns it off
    assert [EngineConfig.from_cli(parser.parse_args(argv)).cuda_graphs
            for argv in (["demo"], ["demo", "--no-cuda-graphs"])] == [None, False]


def test_prefix_cache_settings_flags_and_validation():
    assert EngineConfig().enable_prefix_caching and EngineConfig().prefix_retention_s == 30.0
    ap = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(ap)
    c = EngineConfig.from_cli(ap.parse_args(["--no-enable-prefix-caching", "--prefix-retention-s", "2.5"]))
    assert c.enable_prefix_caching is False and c.prefix_retention_s == 2.5
    for bad in (-1, float("inf"), "3", True):
        with pytest.raises(ValueError, match="^prefix_retention_s"):
            EngineConfig(prefix_retention_s=bad)
    with pytest.raises(ValueError, match="^enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="yes")


def test_the_compilation_cache_is_pruned_to_its_limit_oldest_first(tmp_path):
    """``compilation_cache.prune``: the oldest files go first until the folder fits; a
    folder within the limit is left alone."""
    import os

    from jaxserve.compilation_cache import prune
    for age, name in enumerate(["newest", "newer", "older", "oldest"]):
        f = tmp_path / name
        f.write_bytes(b"x" * 1000)
        os.utime(f, ns=(10**18 - age * 10**9, 10**18 - age * 10**9))
    assert prune(tmp_path, 4000) == 0 and len(list(tmp_path.iterdir())) == 4
    assert prune(tmp_path, 2500) == 2000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newer", "newest"]


def test_an_engine_start_prunes_the_compilation_cache(tmp_path):
    """An engine with ``compilation_cache_max_gb`` of 1 MiB starts by deleting an old 2 MB
    file from its cache folder (a fresh process: the cache is set up once per process)."""
    import os
    import subprocess
    import sys
    cache = tmp_path / "xla-cache"
    cache.mkdir()
    (cache / "old-program-cache").write_bytes(b"x" * 2_000_000)
    script = "from jaxserve import LLMEngine; LLMEngine('demo', warmup=False, compilation_cache_max_gb=1 / 1024)"
    env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_NO_COMPILATION_CACHE"}
    proc = subprocess.run([sys.executable, "-c", script], env={**env, "JAXSERVE_CACHE_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (cache / "old-program-cache").exists()


def test_a_chat_template_given_as_a_file_or_text_replaces_the_checkpoints(tmp_path):
    """``chat_template`` (``--chat-template``): a file's template, or the template text
    itself, replaces the checkpoint's; the server renders chats with it."""
    from fastapi.testclient import TestClient

    from jaxserve import AsyncEngine
    from server import create_app
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    parser = build_parser()
    args = parser.parse_args(["serve", "demo", "--chat-template", str(path)])
    assert EngineConfig.from_cli(args).chat_template == str(path)
    assert EngineConfig(chat_template=template).chat_template == template
    engine = AsyncEngine("demo", chat_template=str(path), page_size=8, num_pages=32, max_model_len=128, warmup=False)
    try:
        assert engine.tokenizer.chat_template == template
        with TestClient(create_app(engine, served_model_name="demo", max_model_len=128)) as client:
            ids = client.post("/tokenize", json={"model": "demo", "tool_choice": "none", "add_generation_prompt": False,
                                                 "messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert engine.tokenizer.decode(ids) == "<user>hi"
    finally:
        engine.shutdown()
