"""Helpers for the HTTP server tests: a tiny checkpoint trained to call tools,
and real ``uvicorn`` server processes on loopback.

The demo model's random weights never emit a tool call, so
``train_tool_checkpoint`` trains a 2-layer Llama (demo tokenizer, chat
template) for a few hundred Adam steps with a plain causal forward (no
paging) until it greedily reproduces three conversations:

- ``calculator`` (built-in server-side tool): "what is 6*7?"
- ``record_note`` (a Python callable given to the server): "remember: the sky is blue"
- ``get_weather`` (client-side: declared by the request): "weather in Paris?"

Each is the exact token sequence the server renders with the chat template
(server-side tools advertised after the request's own), the tool call, the
tool turn and a short answer ending in ``<|im_end|>`` (an EOS of this model).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": [1, 3], "torch_dtype": "float32",
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CALC_USER = "what is 6*7?"
CALC_CALL = {"name": "calculator", "arguments": {"expression": "6*7"}}
CALC_RESULT = "42"
CALC_ANSWER = "The answer is 42."
NOTE_USER = "remember: the sky is blue"
NOTE_CALL = {"name": "record_note", "arguments": {"text": "the sky is blue"}}
NOTE_RESULT = "saved"
NOTE_ANSWER = "Noted."
WEATHER_USER = "weather in Paris?"
WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
WEATHER_RESULT = "sunny, 21C"
WEATHER_ANSWER = "It is sunny in Paris."
NOTE_LOG_ENV = "JAXSERVE_TEST_NOTE_LOG"
NOTE_GATE_ENV = "JAXSERVE_TEST_NOTE_GATE"


def record_note(text: str) -> str:
    """The server-side Python tool of the tests: appends ``text`` to the file named by
    ``$JAXSERVE_TEST_NOTE_LOG`` (so a test can see that the server really ran it).
    While the file ``$JAXSERVE_TEST_NOTE_GATE`` is absent it waits (up to 20 s), so a
    test can hold requests paused inside the tool."""
    gate = os.environ.get(NOTE_GATE_ENV)
    deadline = time.monotonic() + 20
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(os.environ[NOTE_LOG_ENV], "a") as f:
        f.write(text + "\n")
    return NOTE_RESULT


def server_tool_schemas() -> list[dict]:
    """What the server advertises: the engine's tools, calculator first."""
    from jaxserve.tools import normalize_tools
    return [t.openai_schema() for t in normalize_tools({"record_note": record_note}).values()]


def request_tool_schema(tool: dict) -> dict:
    from server.protocol import ToolDef
    return ToolDef.model_validate(tool).schema_dict()


def call_text(call: dict) -> str:
    return f"<tool_call>{json.dumps(call)}</tool_call>"


@dataclass
class Conversation:
    """One trained conversation: ``prompt_ids`` (what the server renders for the
    first request), the ``call`` the model makes, ``full_ids`` (prompt, call, tool
    turn, answer, ``<|im_end|>``) and a mask of the tokens the model generates."""

    user: str
    client_tools: list[dict]
    call: dict
    result: str
    answer: str
    prompt_ids: list[int]
    full_ids: list[int]
    generated_mask: list[bool]
    tool_turn_ids: list[int]     # between the call and the answer: what a resume appends


def render_ids(tokenizer, messages: list[dict], client_tools: list[dict]) -> list[int]:
    tools = [request_tool_schema(t) for t in client_tools] + server_tool_schemas()
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def build_conversations(tokenizer) -> list[Conversation]:
    out = []
    for user, tools, call, result, answer in [
            (CALC_USER, [], CALC_CALL, CALC_RESULT, CALC_ANSWER),
            (NOTE_USER, [], NOTE_CALL, NOTE_RESULT, NOTE_ANSWER),
            (WEATHER_USER, [WEATHER_TOOL], WEATHER_CALL, WEATHER_RESULT, WEATHER_ANSWER)]:
        first = [{"role": "user", "content": user}]
        prompt = render_ids(tokenizer, first, tools)
        call_ids = tokenizer.encode(call_text(call), add_special_tokens=False)
        follow = first + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
                "name": call["name"], "arguments": json.dumps(call["arguments"])}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": result}]
        follow_ids = render_ids(tokenizer, follow, tools)
        assert follow_ids[:len(prompt) + len(call_ids)] == prompt + call_ids, "template is not prefix-stable"
        answer_ids = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        full = follow_ids + answer_ids
        mask = [False] * len(prompt) + [True] * len(call_ids) + [False] * (len(follow_ids) - len(prompt)
                                                                            - len(call_ids)) + [True] * len(answer_ids)
        out.append(Conversation(user, tools, call, result, answer, prompt, full, mask,
                                follow_ids[len(prompt) + len(call_ids):]))
    return out


# --------------------------------------------------------------- training
def _init_weights(cfg: dict, vocab: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, h)).astype(np.float32),
         "model.norm.weight": np.ones(h, np.float32), "lm_head.weight": mat(vocab, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "self_attn.q_proj.weight"] = mat(nh * d, h)
        w[p + "self_attn.k_proj.weight"] = mat(nkv * d, h)
        w[p + "self_attn.v_proj.weight"] = mat(nkv * d, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, nh * d)
        w[p + "mlp.gate_proj.weight"] = mat(i, h)
        w[p + "mlp.up_proj.weight"] = mat(i, h)
        w[p + "mlp.down_proj.weight"] = mat(h, i)
    return w


def _forward(params: dict, ids, cfg: dict):
    """Plain causal Llama forward (Hugging Face semantics): ``ids [B, T]`` -> logits ``[B, T, V]``."""
    import jax
    import jax.numpy as jnp

    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    b, t = ids.shape
    inv_freq = 1.0 / (cfg["rope_theta"] ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    freqs = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[None, :, None, :], jnp.sin(emb)[None, :, None, :]

    def rope(x):
        rotated = jnp.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
        return x * cos + rotated * sin

    def norm(x, w):
        return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)

    causal = jnp.tril(jnp.ones((t, t), bool))
    x = params["model.embed_tokens.weight"][ids]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        hx = norm(x, params[p + "input_layernorm.weight"])
        q = rope((hx @ params[p + "self_attn.q_proj.weight"].T).reshape(b, t, nh, d))
        k = rope((hx @ params[p + "self_attn.k_proj.weight"].T).reshape(b, t, nkv, d))
        v = (hx @ params[p + "self_attn.v_proj.weight"].T).reshape(b, t, nkv, d)
        k, v = jnp.repeat(k, nh // nkv, axis=2), jnp.repeat(v, nh // nkv, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d)
        scores = jnp.where(causal[None, None], scores, -1e30)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, nh * d)
        x = x + attn @ params[p + "self_attn.o_proj.weight"].T
        hx = norm(x, params[p + "post_attention_layernorm.weight"])
        gate = jax.nn.silu(hx @ params[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (hx @ params[p + "mlp.up_proj.weight"].T)) @ params[p + "mlp.down_proj.weight"].T
    return norm(x, params["model.norm.weight"]) @ params["lm_head.weight"].T


def tool_conversations() -> list[Conversation]:
    """The conversations ``train_tool_checkpoint`` trains on (the demo tokenizer's ids)."""
    from transformers import AutoTokenizer

    from jaxserve.demo import demo_dir

    return build_conversations(AutoTokenizer.from_pretrained(str(demo_dir())))


def train_tool_checkpoint(out_dir: Path, steps: int = 400, seed: int = 0) -> None:
    """Write a trained checkpoint (config, safetensors, tokenizer) to ``out_dir``; the
    model file last, so its presence means the checkpoint is whole."""
    import jax
    import jax.numpy as jnp
    import optax
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    from jaxserve.demo import demo_dir

    tokenizer = AutoTokenizer.from_pretrained(str(demo_dir()))
    convs = build_conversations(tokenizer)
    cfg = dict(TINY_CONFIG, vocab_size=len(tokenizer))
    t = max(len(c.full_ids) for c in convs)
    ids = np.zeros((len(convs), t), np.int32)
    weights = np.zeros((len(convs), t), np.float32)   # weights[b, j]: predict token j from tokens < j
    for b, c in enumerate(convs):
        ids[b, :len(c.full_ids)] = c.full_ids
        weights[b, :len(c.full_ids)] = c.generated_mask
    inputs, targets, mask = jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]), jnp.asarray(weights[:, 1:])

    def loss_fn(params):
        logits = _forward(params, inputs, cfg)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(nll * mask) / jnp.sum(mask)

    params = {k: jnp.asarray(v) for k, v in _init_weights(cfg, cfg["vocab_size"], seed).items()}
    opt = optax.adam(optax.cosine_decay_schedule(1e-2, steps, alpha=0.05))
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    for _ in range(steps):
        params, state, loss = step(params, state)
    logits = _forward(params, inputs, cfg)
    top2 = jnp.sort(logits, axis=-1)[..., -2:]
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    margin = jnp.where(mask > 0, picked - top2[..., 0], jnp.inf).min()   # target logit minus the runner-up
    assert bool(jnp.all(jnp.where(mask > 0, jnp.argmax(logits, -1) == targets, True))), f"loss {float(loss)}"
    assert float(margin) > 1.0, f"greedy margin too small: {float(margin)}"
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: np.asarray(v) for k, v in params.items()}, str(out_dir / "model.safetensors"))


# ---------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``jaxserve serve MODEL ...`` (as ``python -m jaxserve.cli``) on 127.0.0.1 and a free
    port. ``start()`` returns at once; ``wait_ready()`` polls /health."""

    def __init__(self, model: str, args: list[str], env: dict[str, str] | None = None, log_path: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "jaxserve.cli", "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
                    "--log-level", "warning", *args]
        self.env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s: {self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path and self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)




def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)


def check_with_engine(model_dir: Path, convs: list[Conversation], **engine_kwargs) -> None:
    """Greedy-decode every conversation on the real engine (paged KV, jitted step):
    the call, the tool turn (run by the engine for server-side tools, resumed by
    hand for the client-side one) and the answer must come out token for token."""
    from jaxserve.engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    engine = LLMEngine(model_dir, tools={"record_note": record_note}, **engine_kwargs)
    try:
        for i, c in enumerate(convs):
            rid = f"check-{i}"
            engine.add_request(rid, prompt_token_ids=c.prompt_ids,
                               sampling_params=SamplingParams(max_tokens=64, temperature=0.0))
            final = None
            for _ in range(2000):
                for out in engine.step():
                    if out.request_id == rid and out.finished:
                        final = out
                if final is not None and final.finish_reason == "tool_calls":
                    assert final.tool_call == {"name": c.call["name"], "arguments": json.dumps(c.call["arguments"])}
                    engine.resume(rid, token_ids=c.tool_turn_ids)
                    final = None
                elif final is not None:
                    break
                if not engine.scheduler.has_work():
                    time.sleep(0.001)
            assert final is not None and final.finish_reason == "stop", final
            want = [t for t, m in zip(c.full_ids, c.generated_mask) if m]
            assert final.token_ids == want, (c.user, final.text)
    finally:
        engine.shutdown()

