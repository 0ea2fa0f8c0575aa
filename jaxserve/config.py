"""``EngineConfig``: every engine setting, its default, its validation and its
command-line flag, in one place.

``LLM``, ``LLMEngine`` and ``AsyncEngine`` take an ``EngineConfig`` (and
keyword overrides of its fields); every subcommand (``serve``, ``generate``,
``replay``, ``profile``, ``bench``) builds its engine flags with
``EngineConfig.add_cli_arguments`` and reads them back with
``EngineConfig.from_cli``, so a shared flag has the same name, default and
help everywhere, and ``JAXSERVE_<FLAG>`` environment variables set any of
them (``jaxserve.cli.apply_env_defaults``).

Validation runs when the config is built, before any model is loaded: an
invalid setting is a ``ValueError`` whose message starts with the field name.
This module imports no JAX (the simulator builds configs too).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_POLICY = "infercept"
DTYPES = ("auto", "float32", "bfloat16", "float16")
REPLICA_ROUTERS = ("affinity", "least_loaded", "round_robin")
LOAD_FORMATS = ("safetensors", "dummy")
HANDLINGS = ("preserve", "discard", "swap")
# The kernels' implementation names (kernels.IMPLS; a test keeps the two in step without importing JAX here).
ATTENTION_IMPLS = ("reference", "pallas_gpu", "pallas_mosaic_gpu", "pallas_tpu")


def cache_root() -> Path:
    """Where jaxserve keeps what it builds once per machine (XLA's compiled programs, the
    demo checkpoint, the indexes and converted tokenizers of GGUF files): ``$JAXSERVE_CACHE_DIR``,
    by default ``~/.cache/jaxserve``."""
    return Path(os.environ.get("JAXSERVE_CACHE_DIR", Path.home() / ".cache" / "jaxserve"))


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts and sizes that must be at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def read_chat_template(value: str) -> str:
    """The chat template ``value`` names: the text of the file at that path, else ``value``
    itself when it is Jinja (holds ``{{`` or ``{%``). ``ValueError`` naming
    ``chat_template`` for neither, or for a template Jinja cannot parse (read as
    transformers renders templates: sandboxed, with loop controls)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"chat_template must be a template or a file path, got {value!r}")
    if "{{" not in value and "{%" not in value:
        path = Path(value).expanduser()
        try:
            value = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: {value!r} is not a readable file ({type(e).__name__}) "
                             "and not a Jinja template") from None
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return value


def _flag(help_text: str, *, group: str = "engine", choices: tuple | None = None, cli: bool = True) -> dict:
    return {"help": help_text, "group": group, "choices": choices, "cli": cli}


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Token counts are tokens, sizes are pages of ``page_size`` tokens.

    ``None`` means "sized for you": on the real engine from the model and the
    device's memory, in the simulator from the cost profile (a profile
    records the budget and pools of the machine it describes).
    """

    # ---------------------------------------------------------------- model
    model: str = field(default="demo", metadata=_flag(
        "checkpoint directory, .gguf file, or a built-in name (smollm2-135m; demo: tiny random model)", cli=False))
    dtype: str = field(default="auto", metadata=_flag(
        "weights and KV cache dtype (auto: float32 on CPU, bfloat16 on GPU/TPU)", choices=DTYPES))
    load_format: str = field(default="safetensors", metadata=_flag(
        "'safetensors' (the checkpoint's weights) or 'dummy' (random weights of the checkpoint's shapes)",
        choices=LOAD_FORMATS))
    max_model_len: int | None = field(default=None, metadata=_flag(
        "context window in tokens (default: the model's, capped by the KV pool)"))
    seed: int = field(default=0, metadata=_flag("engine seed: dummy weights and per-request sampling seeds"))
    attention_impl: str | None = field(default=None, metadata=_flag(
        "attention kernel (default: the best one for this backend)", choices=ATTENTION_IMPLS))
    interpret: bool | None = field(default=None, metadata=_flag(
        "run Pallas kernels in interpret mode (default: on CPU only)", cli=False))
    # ------------------------------------------------------------- KV cache
    page_size: int = field(default=16, metadata=_flag("tokens per KV page (a power of two)"))
    num_pages: int | None = field(default=None, metadata=_flag(
        "device KV pages (default: what the model and max_model_len need, within free device memory)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_flag(
        "share of each accelerator's memory limit (as this process's JAX reports it) this engine may hold: "
        "its weights and, sized to fill the rest, its KV pool (when num_pages is unset); per engine, so two "
        "engines in one process take 0.45 each; the remainder is left for the step's buffers (none at 1). "
        "Ignored on CPU, which reports no memory"))
    num_host_pages: int | None = field(default=None, metadata=_flag(
        "host KV pages for Swap and the prefix cache's host tier (cached pages evicted from the device; "
        "Swap's pages come first); 0: no Swap to host, device-only cache (default: as many as device pages)"))
    enable_prefix_caching: bool = field(default=True, metadata=_flag(
        "share the KV of full pages of equal token prefixes across requests and turns"))
    prefix_retention_s: float = field(default=30.0, metadata=_flag(
        "eviction priority bonus, in seconds, of cached pages of a context inside an API call "
        "(decays as time passes; memory pressure still evicts them)"))
    # ----------------------------------------------------------- scheduling
    policy: str = field(default=DEFAULT_POLICY, metadata=_flag(
        "scheduling policy: fcfs, fcfs-improved, infercept, infercept-minwaste, lamps (mars), augserve, "
        "sjf, sjf-total, prophet, continuum, autellix"))
    handling: str | None = field(default=None, metadata=_flag(
        "force one handling for every API pause (default: the policy decides)", choices=HANDLINGS))
    predictor: str = field(default="oracle", metadata=_flag(
        "what ranking policies are told: oracle | noisy:P | api-type-mean | elapsed | learned:DIR "
        "(a probe from `jaxserve predictor train`)"))
    policy_options: dict = field(default_factory=dict, metadata=_flag("policy keyword options", cli=False))
    max_num_batched_tokens: int | None = field(default=None, metadata=_flag(
        "query tokens per engine step (default: 512; in the simulator, the profile's)"))
    max_num_seqs: int = field(default=256, metadata=_flag("requests per engine step"))
    priority_aging_s: float | None = field(default=None, metadata=_flag(
        "move a request waiting in the queue in a priority class above 0 one class lower each time it has "
        "waited this many seconds there (so batch work, class 1 on the server, is not starved by a sustained "
        "interactive load; default: off, strict classes as vLLM's)"))
    swap_budget_tokens: int | None = field(default=None, metadata=_flag(
        "KV tokens copied host<->device per step (default: max_num_batched_tokens; in the simulator, "
        "what one full step hides)"))
    cost_profile: str | None = field(default=None, metadata=_flag(
        "cost model for the waste equations: a built-in name or a JSON from `jaxserve profile` "
        "(default: the shipped profile of this backend)"))
    # ---------------------------------------------------------------- tools
    chat_template: str | None = field(default=None, metadata=_flag(
        "a Jinja chat template, or the path of a file holding one, used instead of the checkpoint's "
        "(tool-call format detection reads it too)"))
    tool_call_parser: str | None = field(default=None, metadata=_flag(
        "tool-call format the model writes: hermes (qwen), llama3_json, mistral (default: detected from the "
        "chat template, else hermes)"))
    reasoning_parser: str | None = field(default=None, metadata=_flag(
        "split the reasoning a thinking model writes (<think>...</think>) from the answer: qwen3 (a turn "
        "thinks when it starts with <think>), deepseek_r1 (a turn starts inside the reasoning; also QwQ) "
        "(default: off: the reasoning stays in the text)", choices=("qwen3", "deepseek_r1")))
    # ---------------------------------------------------------- scale-out
    tensor_parallel_size: int = field(default=1, metadata=_flag(
        "devices the model is split over (Megatron-style tensor parallelism on a 'model' mesh axis; "
        "over all processes' devices with --num-processes > 1)"))
    coordinator_address: str | None = field(default=None, metadata=_flag(
        "multi-host: host:port of process 0's jax.distributed coordinator (default: one process)",
        group="multihost"))
    num_processes: int = field(default=1, metadata=_flag("multi-host: processes sharing the mesh",
                                                         group="multihost"))
    process_id: int = field(default=0, metadata=_flag(
        "multi-host: this process's rank (0 schedules and serves; the others run steps it broadcasts)",
        group="multihost"))
    # ------------------------------------------------------- replicas (Ray)
    data_parallel_size: int = field(default=1, metadata=_flag(
        "engine replicas behind one endpoint (Ray Serve; > 1 starts or joins a Ray cluster, docs/scaling.md)",
        group="replicas"))
    ray_address: str | None = field(default=None, metadata=_flag(
        "replicas: the Ray cluster to join (ray://host:port or host:port; default: start a local one)",
        group="replicas"))
    prefill_replicas: int = field(default=0, metadata=_flag(
        "prefill/decode disaggregation: replicas that compute prompts' KV (with --decode-replicas; 0: off)",
        group="replicas"))
    decode_replicas: int = field(default=0, metadata=_flag(
        "prefill/decode disaggregation: replicas that continue generation from the moved KV pages",
        group="replicas"))
    decode_policy: str = field(default="prophet", metadata=_flag(
        "prefill/decode disaggregation: the decode replicas' scheduling policy (default: prophet, whose decode "
        "phase is MLFQ; prefill replicas run prophet, whose prefill phase is SRPT by prompt tokens)",
        group="replicas"))
    replica_router: str = field(default="affinity", metadata=_flag(
        "how the front picks a replica: affinity (parked tool context, session key, cached prefix, then least "
        "loaded), least_loaded, round_robin", group="replicas", choices=REPLICA_ROUTERS))
    # ------------------------------------------------------------- executor
    warmup: bool = field(default=True, metadata=_flag("compile the step programs before serving"))
    warmup_all_shapes: bool = field(default=False, metadata=_flag(
        "with --warmup, compile every step shape (token bucket x page-table width) before serving, so none "
        "compiles mid-run (timed replays; a slower start)"))
    compilation_cache: bool = field(default=True, metadata=_flag("use JAX's persistent compilation cache"))
    compilation_cache_max_gb: float = field(default=4.0, metadata=_flag(
        "size limit of the persistent compilation cache in GiB, applied when an engine starts: the oldest "
        "programs are deleted until it fits"))
    cuda_graphs: bool | None = field(default=None, metadata=_flag(
        "GPUs (tried on CUDA only): compile the step programs with XLA command buffers (CUDA graphs) for every "
        "command kind, the attention kernel's custom call and the sampler's conditionals included, to cut the "
        "host's launch time per step (0.91x a 1B decode step on an H200, docs/engine.md); default: on on NVIDIA "
        "GPUs, off elsewhere; --no-cuda-graphs turns it off; asked for on CPU or TPU it is ignored with a warning"))
    check_invariants: bool = field(default=False, metadata=_flag(
        "check the page invariants after every step (tests; slow)"))
    keep_logits: bool = field(default=False, metadata=_flag(
        "keep the last step's logits (tests, debugging)", cli=False))

    DEFAULT_MAX_NUM_BATCHED_TOKENS = 512

    def __post_init__(self) -> None:
        def positive(name: str, value, allow_none: bool = True) -> None:
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a checkpoint path or 'demo', got {self.model!r}")
        for name in ("dtype", "load_format", "attention_impl", "handling"):
            allowed = self.__dataclass_fields__[name].metadata["choices"]
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        positive("page_size", self.page_size, allow_none=False)
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")
        positive("num_pages", self.num_pages)
        if self.num_host_pages is not None and (isinstance(self.num_host_pages, bool)
                                                or not isinstance(self.num_host_pages, int)
                                                or self.num_host_pages < 0):
            raise ValueError(f"num_host_pages must be an integer >= 0, got {self.num_host_pages!r}")
        if isinstance(self.gpu_memory_utilization, bool) \
                or not isinstance(self.gpu_memory_utilization, (int, float)) \
                or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {self.gpu_memory_utilization!r}")
        positive("max_model_len", self.max_model_len)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("max_num_seqs", self.max_num_seqs, allow_none=False)
        positive("swap_budget_tokens", self.swap_budget_tokens)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if isinstance(self.prefix_retention_s, bool) or not isinstance(self.prefix_retention_s, (int, float)) \
                or not 0 <= self.prefix_retention_s < float("inf"):
            raise ValueError(f"prefix_retention_s must be a finite number >= 0, got {self.prefix_retention_s!r}")
        if self.priority_aging_s is not None and (isinstance(self.priority_aging_s, bool) or not isinstance(
                self.priority_aging_s, (int, float)) or not 0 < self.priority_aging_s < float("inf")):
            raise ValueError(f"priority_aging_s must be a finite number > 0, got {self.priority_aging_s!r}")
        if isinstance(self.compilation_cache_max_gb, bool) or not isinstance(self.compilation_cache_max_gb, (int, float)) \
                or not 0 < self.compilation_cache_max_gb < float("inf"):
            raise ValueError(f"compilation_cache_max_gb must be a number > 0, got {self.compilation_cache_max_gb!r}")
        positive("tensor_parallel_size", self.tensor_parallel_size, allow_none=False)
        positive("num_processes", self.num_processes, allow_none=False)
        if isinstance(self.process_id, bool) or not isinstance(self.process_id, int) \
                or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be an integer in [0, num_processes={self.num_processes}), "
                             f"got {self.process_id!r}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError(f"coordinator_address (host:port) is required with num_processes={self.num_processes}")
        if self.coordinator_address is not None:
            host, _, port = self.coordinator_address.rpartition(":") if isinstance(self.coordinator_address, str) \
                else ("", "", "")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"coordinator_address must be host:port with a port in [1, 65535], "
                                 f"got {self.coordinator_address!r}")
        from scheduler import available_policies
        positive("data_parallel_size", self.data_parallel_size, allow_none=False)
        for name in ("prefill_replicas", "decode_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if (self.prefill_replicas == 0) != (self.decode_replicas == 0):
            raise ValueError(f"prefill_replicas and decode_replicas go together (both > 0 for disaggregation), "
                             f"got {self.prefill_replicas} and {self.decode_replicas}")
        if self.prefill_replicas and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size: use either --data-parallel-size N (colocated replicas) or "
                             "--prefill-replicas/--decode-replicas (disaggregated), not both")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address):
            raise ValueError(f"ray_address must be a non-empty address, got {self.ray_address!r}")
        if self.decode_policy not in available_policies():
            raise ValueError(f"decode_policy: unknown policy {self.decode_policy!r}; "
                             f"available: {', '.join(available_policies())}")
        if self.replica_router not in REPLICA_ROUTERS:
            raise ValueError(f"replica_router must be one of {', '.join(REPLICA_ROUTERS)}, "
                             f"got {self.replica_router!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        from scheduler import make_predictor
        if self.policy not in available_policies():
            raise ValueError(f"policy: unknown policy {self.policy!r}; available: {', '.join(available_policies())}")
        try:
            make_predictor(self.predictor)
        except ValueError as e:
            raise ValueError(f"predictor: {e}") from None
        if self.predictor.startswith("learned:"):   # (found before the weights load, not after)
            from jaxserve.predictor.checkpoint import ProbeCheckpointError
            probe = Path(self.predictor[len("learned:"):]).expanduser().resolve() / "probe"
            if not probe.is_dir():
                raise ProbeCheckpointError(f"no probe checkpoint at {probe} (train one with "
                                           f"`jaxserve predictor train`)")
        if not isinstance(self.policy_options, dict):
            raise ValueError("policy_options must be a dict of keyword options")
        if self.chat_template is not None:
            read_chat_template(self.chat_template)
        if self.tool_call_parser is not None:
            from jaxserve.tool_format import get_format
            try:
                get_format(self.tool_call_parser)
            except ValueError as e:
                raise ValueError(f"tool_call_parser: {e}") from None
        if self.reasoning_parser is not None:
            from jaxserve.reasoning import get_reasoning_format
            try:
                get_reasoning_format(self.reasoning_parser)
            except ValueError as e:
                raise ValueError(f"reasoning_parser: {e}") from None

    # --------------------------------------------------------------- derived
    @property
    def replicated(self) -> bool:
        """Whether ``serve`` runs replicas on Ray Serve (data parallel or disaggregated)."""
        return self.data_parallel_size > 1 or self.prefill_replicas > 0

    @property
    def batched_tokens(self) -> int:
        """``max_num_batched_tokens`` with the real engine's default applied."""
        return self.max_num_batched_tokens or self.DEFAULT_MAX_NUM_BATCHED_TOKENS

    def replace(self, **changes: Any) -> "EngineConfig":
        """A validated copy with ``changes`` (unknown names are a ``ValueError``)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown engine setting(s) {', '.join(unknown)}; "
                             f"known: {', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def build(cls, config: "EngineConfig | None" = None, **overrides: Any) -> "EngineConfig":
        """``config`` (or the defaults) with keyword ``overrides`` applied."""
        return (config or cls()).replace(**overrides) if overrides else (config or cls())

    # ------------------------------------------------------------------ CLI
    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser, *, exclude: tuple[str, ...] = (),
                          defaults: dict[str, Any] | None = None, serve: bool = False) -> None:
        """Add one ``--flag`` per CLI setting (``--no-flag`` for booleans) to an
        "engine" argument group. ``exclude`` leaves settings out (a subcommand
        that cannot use them); ``defaults`` changes a default for a subcommand
        whose job needs another value (say so in its help); ``serve`` adds the
        settings only ``serve`` takes: the "multihost" group's (one engine over several
        processes) and the "replicas" group's (several engines behind one endpoint)."""
        groups = {"engine": parser.add_argument_group("engine")}
        if serve:
            groups["multihost"] = parser.add_argument_group("multi-host (one engine over several processes)")
            groups["replicas"] = parser.add_argument_group("replicas (Ray Serve)")
        defaults = defaults or {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if not meta.get("cli") or f.name in exclude or meta["group"] not in groups:
                continue
            target = groups[meta["group"]]
            flag = "--" + f.name.replace("_", "-")
            default = defaults.get(f.name, f.default)
            help_text = meta["help"] + (f" (default: {default})" if default is not None
                                        and "default:" not in meta["help"] else "")
            if f.type in ("bool", bool, "bool | None"):
                target.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                   help=meta["help"])
                continue
            kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            target.add_argument(flag, dest=f.name, type=kind, default=default, choices=meta["choices"],
                               help=help_text)

    @classmethod
    def from_cli(cls, args: argparse.Namespace, **overrides: Any) -> "EngineConfig":
        """The config for parsed ``args`` (settings a subcommand left out keep their defaults)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if f.metadata.get("cli") and hasattr(args, f.name)}
        if hasattr(args, "model") and isinstance(args.model, str):
            values["model"] = args.model
        values.update(overrides)
        return cls(**values)


__all__ = ["ATTENTION_IMPLS", "DEFAULT_POLICY", "EngineConfig", "REPLICA_ROUTERS"]
