"""The ``jaxserve`` command: env-var defaults, ``profile`` and ``generate`` on the demo model."""

from __future__ import annotations

import json

import pytest

from jaxserve import cli
from scheduler import CostModel


def test_env_vars_set_flag_defaults_and_the_command_line_wins():
    parser = cli.build_parser()
    cli.apply_env_defaults(parser, {"JAXSERVE_MAX_TOKENS": "7", "JAXSERVE_IGNORE_EOS": "true",
                                    "JAXSERVE_POLICY": "lamps"})
    args = parser.parse_args(["generate", "demo"])
    assert args.max_tokens == 7 and args.ignore_eos is True and args.policy == "lamps"
    assert parser.parse_args(["generate", "demo", "--max-tokens", "3"]).max_tokens == 3
    assert cli.env_var_for("--max-model-len") == "JAXSERVE_MAX_MODEL_LEN"


def test_env_var_of_a_repeatable_flag_is_one_value_and_the_command_line_replaces_it():
    """``JAXSERVE_PROMPT=hey`` is the prompt "hey" (it was read as the list h, e, y), and
    ``--prompt`` given as well replaces it (it failed appending to a string)."""
    parser = cli.build_parser()
    cli.apply_env_defaults(parser, {"JAXSERVE_PROMPT": "hey", "JAXSERVE_API_CALL": "1:0.01:hi"})
    args = parser.parse_args(["generate", "demo"])
    assert args.prompt == ["hey"] and args.api_call == ["1:0.01:hi"]
    args = parser.parse_args(["generate", "demo", "--prompt", "a", "--prompt", "b"])
    assert args.prompt == ["a", "b"] and args.api_call == ["1:0.01:hi"]
    assert parser.parse_args(["generate", "demo"]).prompt == ["hey"]   # the default itself is left alone


def test_profile_writes_a_cost_model_the_engine_can_load(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    # (a window of 32 tokens: the host-overhead measurement asked 4 + 42 tokens whatever the window, and
    # failed after every other measurement had run)
    rc = cli.main(["profile", "--num-pages", "64", "--max-num-batched-tokens", "32", "--max-model-len", "32",
                   "--copy-mib", "2", "--repeats", "2", "--out", str(out)])
    assert rc == 0
    cost = CostModel.load(out)
    assert cost.fwd_per_token_s > 0 and cost.swap_bandwidth_bytes_s > 0 and cost.saturation_tokens in (8, 16, 32)
    assert cost.bytes_per_token == 2 * 2 * 2 * 32 * 4  # K+V, 2 layers, 2 KV heads, head_dim 32, float32
    assert set(cost.meta["step_times_s"]) == {"2", "4", "8", "16", "32"}   # every bucket the engine runs (CPU: from 2)
    assert cost.meta["max_model_len"] == 32 and cost.step_overhead_s >= 0
    assert cost.swap_overlaps_forward is False     # this engine copies before the forward
    sweep = cost.meta["context_sweep"]             # page_size 16 .. max_model_len 32, 8 decoding rows
    assert sweep["rows"] == 8 and set(sweep["step_times_s"]) == {"16", "32"}
    assert cost.fwd_per_context_token_s >= 0
    assert "T_fwd(n, c)" in capsys.readouterr().out
    from jaxserve import LLM
    llm = LLM("demo", cost_profile=str(out), page_size=8, num_pages=16, max_num_batched_tokens=16,
              max_model_len=64, warmup=False)
    assert llm.engine.cost.fwd_per_token_s == cost.fwd_per_token_s


def test_generate_prints_outputs_and_api_call_handling(capsys):
    rc = cli.main(["generate", "demo", "--prompt", "Hello", "--max-tokens", "6", "--ignore-eos",
                   "--api-call", "3:0.01:forty two", "--handling", "swap", "--max-num-batched-tokens", "32",
                   "--max-model-len", "128", "--num-pages", "32", "--json"])
    assert rc == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert len(line["token_ids"]) == 6 and line["api_calls"][0]["handling"] == "swap"
    rc = cli.main(["generate", "demo", "--prompt", "Hello", "--max-tokens", "4", "--ignore-eos", "--json",
                   "--logit-bias", "81:100", "--repetition-penalty", "1.2", "--max-num-batched-tokens", "32",
                   "--max-model-len", "128", "--num-pages", "32"])
    assert rc == 0 and json.loads(capsys.readouterr().out.splitlines()[0])["token_ids"] == [81] * 4


def test_bench_runs_with_the_default_dtype(capsys):
    """``--dtype auto`` (the default) is resolved for both engines; transformers' side took
    only float32 or bfloat16 and failed on it (``KeyError: 'auto'``)."""
    assert cli.main(["bench", "--model", "demo", "--num-prompts", "2", "--prompt-len", "8", "--max-tokens", "4"]) == 0
    assert "ratio jaxserve / transformers" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["generate", "demo", "--max-tokens", "0"], "jaxserve generate: max_tokens must be"),
    (["generate", "demo", "--temperature", "-1"], "jaxserve generate: temperature must be"),
    (["generate", "demo", "--prompt", ""], "jaxserve generate: --prompt must not be empty"),
    (["generate", "demo", "--api-call", "x:0.1:hi"], "jaxserve generate: --api-call 'x:0.1:hi'"),
    (["generate", "demo", "--api-call", "2:inf:hi"], "duration_s must be a finite number"),
    (["generate", "demo", "--logit-bias", "5=1"], "jaxserve generate: --logit-bias must look like TOKEN_ID:VALUE"),
    (["generate", "demo", "--logit-bias", "5:500"], "jaxserve generate: logit_bias values must be"),
    (["generate", "demo", "--presence-penalty", "3"], "jaxserve generate: presence_penalty must be"),
    (["generate", "demo", "--min-tokens", "64"], "jaxserve generate: min_tokens must be"),
])
def test_generate_refuses_bad_options_in_one_line_before_loading_a_model(argv, message, monkeypatch, capsys):
    import jaxserve.llm
    monkeypatch.setattr(jaxserve.llm, "LLM", None)   # a model load would fail loudly: none must happen
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("jaxserve generate: ") and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["generate", "demo", "--num-pages", "0"], "num_pages must be a positive integer"),
    (["generate", "demo", "--page-size", "3"], "page_size must be a positive power of two"),
    (["generate", "demo", "--policy", "nope"], "unknown policy 'nope'"),
    (["generate", "/no/such/model"], "model '/no/such/model' is neither a built-in name"),
    (["profile", "--page-size", "3"], "page_size must be a positive power of two"),
    (["bench", "--model", "/no/such/model"], "model '/no/such/model' is neither a built-in name"),
    (["bench", "--model", "demo", "--prompt-len", "100000", "--skip-transformers"], "exceeds"),
    (["bench", "--model", "demo", "--length-probe", "/no/such/probe", "--num-prompts", "1"], "no probe checkpoint at"),
])
def test_a_bad_engine_flag_or_model_is_refused_in_one_line(argv, message, capsys):
    """As ``serve``, ``run-batch`` and ``replay`` do: status 2 and one line, not a
    traceback (the engine's settings and the model were read outside the command's
    error handling)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.rpartition("\r")[2]   # (after a model's loading bar, when one loaded)
    assert message in err and err.startswith(f"jaxserve {argv[0]}: ") and len(err.splitlines()) == 1


@pytest.mark.parametrize("variable, value, message", [
    ("JAXSERVE_MAX_NUM_SEQS", "lots", "JAXSERVE_MAX_NUM_SEQS: invalid int value: 'lots'"),
    ("JAXSERVE_HANDLING", "keep", "JAXSERVE_HANDLING: invalid choice 'keep'"),
    ("JAXSERVE_IGNORE_EOS", "ture", "JAXSERVE_IGNORE_EOS: 'ture' is not one of 1/true/yes/on or 0/false/no/off"),
])
def test_a_bad_env_var_is_a_usage_error_of_the_subcommand_that_reads_it(variable, value, message, monkeypatch,
                                                                       capsys):
    """A value the flag would refuse on the command line is refused from its variable too
    (status 2, the message), before the subcommand runs: it was a traceback, or for a
    switch any word but true/yes/on/1 quietly meant off."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "demo"])
    assert exit_info.value.code == 2 and f"jaxserve: error: {message}" in capsys.readouterr().err


def test_an_env_var_one_subcommand_refuses_is_left_to_the_others(monkeypatch, capsys):
    """``--max-tokens`` is any integer to ``generate`` but at least 1 to ``bench``: 0 in
    ``JAXSERVE_MAX_TOKENS`` stops ``bench`` only (it stopped every subcommand)."""
    monkeypatch.setenv("JAXSERVE_MAX_TOKENS", "0")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench"])
    assert exit_info.value.code == 2 and "JAXSERVE_MAX_TOKENS: must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["generate", "demo"]) == 2   # generate reads it, then refuses max_tokens 0 as it always did
    assert "jaxserve generate: max_tokens must be" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["replay", "--help"])
    assert exit_info.value.code == 0


@pytest.mark.parametrize("argv", [["profile", "--repeats", "0"], ["profile", "--copy-mib", "0"],
                                  ["bench", "--num-prompts", "0"], ["bench", "--max-tokens", "-2"]])
def test_profile_and_bench_refuse_counts_below_one(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2 and "must be >= 1" in capsys.readouterr().err
