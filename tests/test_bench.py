"""The benchmark's measurement of the learned length probe's cost (issue 18): it runs
end to end on the demo model and reports every figure it promises."""

from __future__ import annotations

import argparse
import json
import tempfile

import pytest

from jaxserve import bench


def test_probe_cost_random_probe_reports_paired_figures(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "cost.json"
    args = parser.parse_args(["--length-probe", "random", "--num-prompts", "4", "--prompt-len", "8",
                              "--max-tokens", "4", "--rounds", "2", "--probe-calls", "4", "--json", str(out)])
    assert bench.main(args) == 0
    cost = json.loads(out.read_text())
    assert cost["same_tokens"] is True   # the probe never changes what is generated
    assert cost["jitted_rows"] == 4 and cost["jitted_context"] == 12
    for key in ("engine_step_wall", "engine_step_cpu", "jitted_step_wall", "jitted_step_cpu"):
        m = cost[key]
        assert m["median_without_ms"] > 0 and m["median_with_ms"] > 0
        lo, hi = m["overhead_iqr"]
        assert lo <= m["overhead"] <= hi
    assert cost["probe_alone_cpu_ms"] >= 0 and cost["probe_alone_share"] < 1.0


def test_timed_pass_computes_every_prompt_token_and_compiles_nothing():
    """The untimed warm pass must leave the timed pass nothing to reuse or compile: same
    step shapes, no prompt in the prefix cache (found on an H200, where the timed pass of
    the same prompts compiled two shapes at ~19 s each and reused cached prompt pages)."""
    import numpy as np

    from jaxserve.model_source import resolve_model
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--num-prompts", "4", "--prompt-len", "40", "--max-tokens", "4"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, n).tolist() for n in (24, 33, 40, 40)]   # each spans full pages
    result = bench.run_jaxserve(str(resolve_model("demo")), prompts, args, "safetensors")
    assert result["tokens"] == 4 * 4
    assert result["cached_prompt_tokens"] == 0
    assert result["shapes_compiled_while_timed"] == 0


def test_shape_checkpoints_are_one_directory_per_shape(tmp_path, monkeypatch):
    """Every run of a shape reuses its directory (each run used to leave a new one in /tmp)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    small = dict(bench.SHAPES["llama-small"])
    first, again = bench.shape_checkpoint(small), bench.shape_checkpoint(dict(reversed(list(small.items()))))
    other = bench.shape_checkpoint({**small, "num_hidden_layers": 2})
    assert first == again and first != other
    assert json.loads((first / "config.json").read_text()) == small
    assert json.loads((other / "config.json").read_text())["num_hidden_layers"] == 2
    assert first.parent == tmp_path and [p.name for p in first.iterdir()] == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


@pytest.mark.parametrize("flags", [["--logprobs", "3"], ["--prompt-logprobs", "2", "--no-enable-prefix-caching"],
                                   ["--penalties"]])
def test_option_cost_reports_paired_figures_and_same_tokens(tmp_path, flags):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "cost.json"
    args = parser.parse_args([*flags, "--num-prompts", "4", "--prompt-len", "8", "--max-tokens", "4",
                              "--rounds", "2", "--json", str(out)])
    assert bench.main(args) == 0
    cost = json.loads(out.read_text())
    if flags == ["--penalties"]:
        assert cost["asked"]["repetition_penalty"] == 1.1   # (penalties may change the tokens)
    else:
        asked = flags[0][2:].replace("-", "_")
        assert cost["same_tokens"] is True and cost["asked"] == {asked: int(flags[1])}   # scoring changes nothing
    for key in ("engine_step_wall", "engine_step_cpu"):
        m = cost[key]
        assert m["median_without_ms"] > 0 and m["median_with_ms"] > 0
        lo, hi = m["overhead_iqr"]
        assert lo <= m["overhead"] <= hi


def test_bad_logprobs_and_a_gguf_model_are_handled_before_loading(monkeypatch):
    """``--logprobs 21`` is refused before anything loads; a ``.gguf`` model (the built-in
    ``smollm2-135m``) has its vocabulary read from the file, not from a config.json beside it."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit, match="--logprobs"):
        bench.main(parser.parse_args(["--logprobs", "21"]))
    with pytest.raises(SystemExit, match="--prompt-logprobs"):
        bench.main(parser.parse_args(["--prompt-logprobs", "-1"]))
    class Stop(Exception):
        pass

    def stop_before_loading(model_dir, prompts, *args, **kwargs):
        raise Stop(max(max(p) for p in prompts))
    monkeypatch.setattr(bench, "run_jaxserve", stop_before_loading)
    with pytest.raises(Stop) as stopped:
        bench.main(parser.parse_args(["--model", "smollm2-135m", "--num-prompts", "64"]))
    assert 3 <= stopped.value.args[0] < 49152   # prompts drawn from SmolLM2's vocabulary
