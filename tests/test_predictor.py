"""The learned length predictor: probe training/eval round trip on the demo model,
checkpoints bound to their model, clear errors for bad input, predictions landing on
requests in the engine (equal to the training-time features' predictions), and the
simulator's cached predictions."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import cli
from jaxserve.predictor.checkpoint import ModelIdentity, ProbeCheckpointError, load_probe
from scheduler.predictors import LEARNED_FROM, LEARNED_LEN, LEARNED_SEGMENT_LENS, make_predictor

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _text(rng, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _trace(path, n: int = 24):
    """Text-form requests whose completion length follows the prompt's first word:
    "short" -> a few tokens, "long" -> one fixed text of ~100 tokens (learnable from the prompt)."""
    rng = np.random.default_rng(0)
    data = {}
    for i in range(n):
        segs, prompt = [], ("short " if i % 2 else "long ") + _text(rng, 6)
        for j in range(2):
            completion = "alpha beta" if i % 2 else " ".join(WORDS * 3)
            seg = {"prompt": prompt, "completion": completion}
            if j == 0:
                seg.update(api_token="ok " + _text(rng, 2), api_time=0.5)
            segs.append(seg)
            prompt = prompt + completion + seg.get("api_token", "")
        data[f"r{i}"] = segs
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    trace = _trace(d / "trace.json")
    rc = cli.main(["predictor", "train", "--model", "demo", "--out", str(d / "ckpt"), "--trace", str(trace),
                   "--epochs", "300", "--probe-hidden", "32"])
    assert rc == 0
    return d / "ckpt", trace


def test_train_eval_round_trip(trained, tmp_path, capsys):
    ckpt, trace = trained
    out = tmp_path / "eval.json"
    assert cli.main(["predictor", "eval", "--model", "demo", "--checkpoint", str(ckpt), "--trace", str(trace),
                     "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {"acc5", "acc15", "mae_bins", "baseline_mae_bins", "mae_tokens", "n_test"} <= set(res)
    assert res["n_test"] == 8   # 4 held-out requests x 2 segments: split by request
    # The length is a function of the prompt's first word: the probe must beat the constant clearly.
    assert res["mae_bins"] < 0.5 * res["baseline_mae_bins"]
    assert "Acc-15" in capsys.readouterr().out
    params, meta = load_probe(ckpt)
    assert meta["model"]["name"] == "demo" and meta["model"]["hidden_size"] == 128
    assert params["w1"].shape == (128, 32)


def test_checkpoint_refuses_another_model(trained):
    ckpt, _ = trained
    _, meta = load_probe(ckpt)
    other = ModelIdentity("other", meta["model"]["hidden_size"], "0" * 16)
    with pytest.raises(ProbeCheckpointError, match="trained on model 'demo'.*not on 'other'") as e:
        load_probe(ckpt, other)
    assert str(ckpt.resolve()) in str(e.value)


def test_corrupt_or_missing_checkpoint_and_empty_trace(trained, tmp_path, capsys):
    ckpt, _ = trained
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    for f in (bad / "probe").rglob("*"):
        if f.is_file() and "params" in f.parts:
            f.write_bytes(b"not a checkpoint")
    with pytest.raises(ProbeCheckpointError, match="corrupt") as e:
        load_probe(bad)
    assert str(bad.resolve()) in str(e.value)
    from jaxserve.engine import LLMEngine
    missing = tmp_path / "nowhere"
    with pytest.raises(ProbeCheckpointError, match=str(missing)):
        LLMEngine("demo", predictor=f"learned:{missing}", num_pages=16, warmup=False)
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert cli.main(["predictor", "train", "--model", "demo", "--out", str(tmp_path / "x"),
                     "--trace", str(empty)]) == 2
    assert str(empty) in capsys.readouterr().err


def test_a_truncated_checkpoint_is_one_error_without_a_late_traceback(trained, tmp_path):
    """A data file cut short: orbax's restore fails at its first bad read, closes its
    event loop, and tensorstore's other reads land on the closed loop afterwards;
    their ``Event loop is closed`` tracebacks reached stderr now and then (about
    one load in two) after the one-line refusal. Six loads in one process, then a
    pause for stragglers: one error each, nothing else on stderr. Other
    unraisable exceptions still reach the hook that was there before."""
    bad = tmp_path / "cut"
    shutil.copytree(trained[0], bad)
    data = [f for f in (bad / "probe" / "params" / "d").iterdir() if f.is_file()]
    assert data
    for f in data:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    script = f"""
import gc, sys, time
from jaxserve.predictor.checkpoint import ProbeCheckpointError, load_probe
for _ in range(6):
    try:
        load_probe({str(bad)!r})
    except ProbeCheckpointError as e:
        print("refused:", str(e).split(":")[0])
time.sleep(1.0)
class Leaky:
    def __del__(self):
        raise KeyError("another unraisable")
Leaky()
gc.collect()
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("refused: probe checkpoint") == 6, run.stdout
    assert "Event loop is closed" not in run.stderr, run.stderr
    assert "another unraisable" in run.stderr   # (the filter drops nothing else)


def test_predictions_land_on_requests_in_the_engine(trained):
    """The probe runs inside the step: after the prefill, and again after the API
    return; the value equals the probe applied to the training-time features."""
    from jaxserve.engine import LLMEngine
    from jaxserve.outputs import ApiCall
    from jaxserve.predictor.features import HiddenStateReader, load_served_model
    from jaxserve.predictor.probe import probe_predict
    from jaxserve.sampling_params import SamplingParams
    ckpt, _ = trained
    eng = LLMEngine("demo", predictor=f"learned:{ckpt}", policy="lamps", num_pages=64,
                    max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    served = load_served_model("demo")
    ids = served.tokenizer.encode("long alpha beta gamma", add_special_tokens=True)
    ret = served.tokenizer.encode("ok beta", add_special_tokens=False)
    eng.add_request("a", prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=8, ignore_eos=True),
                    api_calls=[ApiCall(after_tokens=3, api_type="chat", duration_s=0.0, returned_token_ids=ret)])
    req = eng.scheduler.requests["a"]
    assert LEARNED_LEN not in req.predictions
    eng.step()
    first = dict(req.predictions)
    params, _ = load_probe(ckpt)
    feats = HiddenStateReader(served).read(ids, [len(ids)])
    want = float(params["bin_tokens"][int(probe_predict({k: jnp.asarray(v) for k, v in params.items()},
                                                        jnp.asarray(feats))[0])])
    assert first[LEARNED_LEN] == want and first[LEARNED_FROM] == 0
    context = list(ids)
    seen = []
    while eng.has_unfinished():
        eng.step()
        seen.append(dict(req.predictions))
        context = list(req.token_ids)
    after = [p for p in seen if p.get(LEARNED_FROM) == 3]
    assert after, "no new prediction after the API return"
    feats = HiddenStateReader(served).read(context, [len(ids) + 3 + len(ret)])
    want = float(params["bin_tokens"][int(probe_predict({k: jnp.asarray(v) for k, v in params.items()},
                                                        jnp.asarray(feats))[0])])
    assert after[0][LEARNED_LEN] == want


def test_simulator_uses_cached_predictions(trained, monkeypatch):
    from jaxserve.predictor import sim_cache
    from jaxserve.replay.trace import load_trace
    ckpt, trace = trained
    preds = sim_cache.trace_predictions(ckpt, "demo", trace, progress=False)
    assert set(preds) == {f"r{i}" for i in range(24)} and all(len(v) == 2 for v in preds.values())
    # Second call: from the cache, without loading the model.
    monkeypatch.setattr("jaxserve.predictor.features.load_served_model",
                        lambda *a, **k: pytest.fail("the cache was not used"))
    assert sim_cache.trace_predictions(ckpt, "demo", trace, progress=False) == preds
    entries = sim_cache.attach(load_trace(trace), preds)
    req = entries[0].to_request("x", 0.0)
    assert req.predictions[LEARNED_SEGMENT_LENS] == preds[entries[0].request_id]
    p = make_predictor("learned:" + str(ckpt))
    assert p.segment_output_len(req) == round(preds[entries[0].request_id][0])
    req.segment_index, req.segment_generated = 1, 2
    assert p.segment_output_len(req) == max(0, round(preds[entries[0].request_id][1]) - 2)


def test_learned_predictor_falls_back_to_class_running_mean():
    from scheduler import Request, Segment
    p = make_predictor("learned:x")
    p.default_len = 40.0
    r = Request("t", 0.0, prompt_len=5, max_tokens=100, segments=[Segment(10, "math", 0.1, 2), Segment(5)],
                predictions={"class": "math"})
    assert p.segment_output_len(r) == 40          # nothing observed: the default
    r.segment_generated = 10
    v = p.version
    p.observe_output(r)
    assert p.version == v + 1
    fresh = Request("u", 0.0, prompt_len=5, max_tokens=100, segments=[Segment(7, "math", 0.1, 2)],
                    predictions={"class": "math"})
    assert p.segment_output_len(fresh) == 10      # the class's running mean


def test_batched_hidden_states_equal_one_by_one():
    """``read_many`` (right-padded batches of similar length, and the one-by-one path
    for contexts past the window) gives the same features as ``read`` per context."""
    import dataclasses

    import numpy as np

    from jaxserve.predictor.features import HiddenStateReader, load_served_model
    served = dataclasses.replace(load_served_model("demo"), window=40)
    tok = served.tokenizer
    texts = ["hi", "alpha beta gamma delta", "a much longer conversation about the weather " * 2,
             "tool call then more words " * 3, "short one", "x " * 30]
    contexts = []
    for t in texts:
        ids = tuple(tok.encode(t, add_special_tokens=True))
        contexts.append((ids, tuple(sorted({max(1, len(ids) // 2), len(ids)}))))
    assert any(max(e) > served.window for _, e in contexts) and any(max(e) <= served.window for _, e in contexts)
    reader = HiddenStateReader(served)
    batched = reader.read_many(contexts, max_batch_tokens=64)
    for (ids, ends), got in zip(contexts, batched):
        np.testing.assert_allclose(got, reader.read(ids, ends), atol=2e-4, rtol=0)


@pytest.mark.parametrize("flags, message", [(["--epochs", "0"], "--epochs must be >= 1"),
                                            (["--probe-hidden", "-1"], "--probe-hidden must be >= 0"),
                                            (["--max-context", "0"], "--max-context must be >= 1"),
                                            (["--out", "FILE/sub"], "is a file, not a directory")])
def test_train_refuses_bad_values_in_one_line_before_loading_anything(tmp_path, capsys, flags, message):
    """An untrained probe written for ``--epochs 0``, a JAX traceback for a negative width,
    a ``FileExistsError`` for an ``--out`` under a file: now status 2 and one line."""
    (tmp_path / "FILE").write_text("")
    flags = [str(tmp_path / f) if f.startswith("FILE") else f for f in flags]
    args = ["predictor", "train", "--model", "demo", "--out", str(tmp_path / "ckpt"), *flags]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "ckpt").exists()


def test_text_requests_load_from_jsonl_and_a_mooncake_trace_is_named(tmp_path):
    """The probe's dataset reads JSONL text-form traces as replay does (it took them for
    broken JSON), and says a Mooncake trace has no text."""
    from jaxserve.predictor.dataset import TraceDataError, load_text_requests

    class Characters:   # one token per character
        def encode(self, text, add_special_tokens=False):
            return [ord(ch) % 1000 for ch in text]

    data = json.loads(_trace(tmp_path / "trace.json", n=3).read_text())
    lines = tmp_path / "trace.jsonl"
    lines.write_text("\n".join(json.dumps({"id": rid, "segments": segs}) for rid, segs in data.items()) + "\n")
    assert load_text_requests(lines, Characters()) == load_text_requests(tmp_path / "trace.json", Characters())
    mooncake = tmp_path / "mc.jsonl"
    mooncake.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1]}\n')
    with pytest.raises(TraceDataError, match="line 1: a Mooncake record"):
        load_text_requests(mooncake, Characters())
    with pytest.raises(TraceDataError, match="none of its 3 text-form requests fits --max-context 2"):
        load_text_requests(lines, Characters(), max_context=2)


def _save_variant(trained, out, params_change=None, summary_change=None):
    """The trained probe saved again under ``out`` with some values changed."""
    from jaxserve.predictor.checkpoint import save_probe
    ckpt, _ = trained
    params, meta = load_probe(ckpt)
    params.update(params_change or {})
    summary = dict(meta["summary"])
    for key, value in (summary_change or {}).items():
        if value is KeyError:
            summary.pop(key)
        else:
            summary[key] = value
    save_probe(out, params, ModelIdentity(**meta["model"]), meta["probe_hidden"], summary)
    return out


@pytest.mark.parametrize("params_change, summary_change, message", [
    ({"bin_tokens": np.full(50, np.nan, np.float32)}, None, "parameter 'bin_tokens' holds NaN or infinite"),
    ({"mean": np.full(128, np.inf, np.float32)}, None, "parameter 'mean' holds NaN or infinite"),
    (None, {"train_mean_tokens": float("nan")}, "train_mean_tokens must be a finite number >= 0, got nan"),
    (None, {"train_mean_tokens": float("inf")}, "train_mean_tokens must be a finite number >= 0, got inf"),
    (None, {"train_mean_tokens": KeyError}, "train_mean_tokens must be a finite number >= 0, got None"),
    (None, {"train_mean_tokens": "abc"}, "train_mean_tokens must be a finite number >= 0, got 'abc'"),
])
def test_a_probe_with_values_serving_cannot_use_is_refused_when_it_loads(trained, tmp_path, params_change,
                                                                         summary_change, message):
    """A NaN or infinite parameter, or a train mean that is missing or not a finite number,
    loaded without complaint and then failed requests mid-serving (500s from ``round(nan)``
    the first time a policy ranked by it; a 400 blaming the client): refused at load,
    naming the checkpoint, so the server never starts with it."""
    bad = _save_variant(trained, tmp_path / "bad", params_change, summary_change)
    with pytest.raises(ProbeCheckpointError, match=message) as e:
        load_probe(bad)
    assert str(bad.resolve()) in str(e.value)


def test_eval_takes_a_probe_written_without_a_seed(trained, tmp_path, capsys):
    """``bench --length-probe random`` writes a summary without ``seed``; eval's test split does
    not depend on it (it was a ``KeyError`` traceback)."""
    _, trace = trained
    seedless = _save_variant(trained, tmp_path / "seedless", summary_change={"seed": KeyError})
    assert cli.main(["predictor", "eval", "--model", "demo", "--checkpoint", str(seedless),
                     "--trace", str(trace)]) == 0
    assert "held-out test" in capsys.readouterr().out


def test_too_few_requests_or_a_lone_surrogate_are_one_line_errors(trained, tmp_path, capsys):
    """Two text requests cannot be split into train, validation and test (an empty split's
    metrics error came after the features were computed); a ``\\ud800`` escape in a trace
    is no text a tokenizer encodes (a tokenizers ``TypeError`` traceback)."""
    ckpt, _ = trained
    two = _trace(tmp_path / "two.json", n=2)
    for command in (["train", "--out", str(tmp_path / "x")], ["eval", "--checkpoint", str(ckpt)]):
        assert cli.main(["predictor", command[0], "--model", "demo", *command[1:], "--trace", str(two)]) == 2
        err = capsys.readouterr().err
        assert "2 text-form request(s) to use; a probe needs at least 3" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()   # (said before any feature was computed and cached)
    lone = tmp_path / "lone.json"
    lone.write_text('{"r0": [{"prompt": "hi \\ud800", "completion": "ok"}]}')
    assert cli.main(["predictor", "train", "--model", "demo", "--out", str(tmp_path / "y"), "--trace", str(lone)]) == 2
    err = capsys.readouterr().err
    assert "request 'r0': a lone surrogate '\\ud800' at character 3" in err and "Traceback" not in err


def test_a_missing_probe_directory_is_found_before_the_weights_load(tmp_path):
    """``EngineConfig.validate`` looks for the probe (it was found after loading the model)."""
    from jaxserve.config import EngineConfig
    with pytest.raises(ProbeCheckpointError, match=f"no probe checkpoint at {tmp_path / 'gone'}"):
        EngineConfig(model="demo", predictor=f"learned:{tmp_path / 'gone'}").validate()


def test_a_probe_trains_on_a_gguf_model(tmp_path, capsys):
    """The built-in ``smollm2-135m`` is a GGUF file: the hidden-state reader loaded it as a
    transformers directory ("config file ... is not a valid JSON file", labelled ``output``).
    Trained on its hidden states, the probe loads against the served model's identity."""
    from jaxserve.model_source import smollm2_path
    from jaxserve.predictor.features import load_served_model
    trace = _trace(tmp_path / "trace.json", n=4)
    out = tmp_path / "smol"
    assert cli.main(["predictor", "train", "--model", "smollm2-135m", "--out", str(out), "--trace", str(trace),
                     "--epochs", "2", "--probe-hidden", "0"]) == 0, capsys.readouterr().err
    served = load_served_model(str(smollm2_path()))
    params, meta = load_probe(out, served.identity)
    assert params["w2"].shape == (576, 50) and meta["model"]["hidden_size"] == 576
