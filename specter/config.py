"""ModelSpec: one normalised description of every supported MoE architecture.

Hugging Face configs name the same idea six different ways (`num_local_experts`, `num_experts`,
`n_routed_experts`; `decoder_sparse_step`, `first_k_dense_replace`, ...). `ModelSpec.from_hf` reads
them once, so the model code below it only ever sees these fields, and every difference between
architectures is a named field here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import CheckpointError, UnsupportedModelError

# model_type -> the architecture's name as users know it
SUPPORTED = {
    "mixtral": "Mixtral (Mixtral-8x7B, 8x22B)",
    "phimoe": "PhiMoE (Phi-3.5-MoE)",
    "qwen2_moe": "Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B)",
    "qwen3_moe": "Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B)",
    "olmoe": "OLMoE (OLMoE-1B-7B)",
    "deepseek_v2": "DeepSeek-V2 (DeepSeek-V2-Lite, DeepSeek-V2)",
}


def supported_list() -> str:
    return ", ".join(f"{k} [{v}]" for k, v in SUPPORTED.items())


@dataclass
class ModelSpec:
    arch: str                      # HF model_type
    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int                  # q/k/v head dim (GQA); for MLA: qk_nope + qk_rope
    max_position: int              # the context Specter computes exactly (_exact_context; else config.json's)
    norm: str                      # "rms" | "layer" (PhiMoE uses LayerNorm with bias)
    norm_eps: float
    act: str                       # expert / MLP activation (silu for all supported models)
    # attention
    attention: str = "gqa"         # "gqa" | "mla"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"          # "none" | "head" (Qwen3: RMSNorm per head) | "full" (OLMoE: over the projection)
    clip_qkv: float | None = None  # OLMoE
    sliding_window: list[int | None] = field(default_factory=list)  # per layer
    rope_interleaved: bool = False  # DeepSeek rotates (even, odd) pairs, the others (first half, second half)
    # multi-head latent attention (DeepSeek-V2)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    attn_scale: float = 0.0        # softmax scale (MLA with YaRN folds mscale² into it)
    # MoE
    moe_layers: list[bool] = field(default_factory=list)  # per layer: routed experts or a dense MLP
    n_experts: int = 0
    top_k: int = 0
    expert_inter: int = 0          # intermediate size of one routed expert
    dense_inter: int = 0           # intermediate size of dense-layer MLPs
    router: str = "softmax"        # "softmax" | "sparsemixer" (PhiMoE) | "deepseek"
    norm_topk_prob: bool = True
    routed_scale: float = 1.0
    topk_method: str = "greedy"    # DeepSeek: "greedy" | "group_limited_greedy"
    n_group: int = 1
    topk_group: int = 1
    router_jitter: float = 0.0     # PhiMoE sparsemixer's jitter_eps (used deterministically at inference)
    shared_inter: int = 0          # shared expert intermediate size (0 = none)
    shared_gate: bool = False      # Qwen2-MoE: sigmoid gate on the shared expert
    # head
    tie_embeddings: bool = False
    lm_head_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    hf_config: object = None       # the transformers config (rope parameters are read from it)
    context_note: str = ""         # why max_position is below config.json's, for errors that name it

    @property
    def n_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]

    def expert_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """A MoE layer's routed experts as the store holds them: (w13 [E, 2I, H], w2 [E, H, I])."""
        E, I, H = self.n_experts, self.expert_inter, self.hidden
        return (E, 2 * I, H), (E, H, I)

    def expert_numel(self) -> int:
        """Parameters of one routed expert (gate, up, down)."""
        return 3 * self.hidden * self.expert_inter

    @classmethod
    def from_hf(cls, cfg) -> "ModelSpec":
        arch = getattr(cfg, "model_type", None)
        if arch not in SUPPORTED:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: {supported_list()}"
            )
        g = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731
        _require_positive((n, getattr(cfg, n, None)) for n in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                               "num_attention_heads", "max_position_embeddings"))
        n_layers = cfg.num_hidden_layers
        n_heads = cfg.num_attention_heads
        head_dim = g("head_dim") or cfg.hidden_size // n_heads
        spec = cls(
            arch=arch, vocab_size=cfg.vocab_size, hidden=cfg.hidden_size, n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=g("num_key_value_heads") or n_heads, head_dim=head_dim,
            max_position=cfg.max_position_embeddings, norm="rms", norm_eps=cfg.rms_norm_eps,
            act=g("hidden_act", "silu"), tie_embeddings=bool(g("tie_word_embeddings", False)),
            hf_config=cfg,
        )
        spec.attn_scale = head_dim ** -0.5
        spec.sliding_window = _sliding_windows(cfg, n_layers)
        _require_positive(("sliding_window", w) for w in set(spec.sliding_window) if w is not None)
        _check_rope(cfg)
        spec.max_position, spec.context_note = _exact_context(cfg, arch, spec.max_position)

        if arch in ("mixtral", "phimoe"):
            spec.n_experts, spec.top_k = cfg.num_local_experts, cfg.num_experts_per_tok
            spec.expert_inter = cfg.intermediate_size
            spec.moe_layers = [True] * n_layers
            if arch == "phimoe":
                spec.norm = "layer"
                spec.qkv_bias = spec.o_bias = bool(g("attention_bias", False))
                spec.router, spec.router_jitter = "sparsemixer", float(g("router_jitter_noise", 0.01))
                spec.lm_head_bias = bool(g("lm_head_bias", False))
                if spec.top_k != 2:
                    raise UnsupportedModelError("PhiMoE's sparsemixer router is defined for top-2 only")
        elif arch in ("qwen2_moe", "qwen3_moe"):
            spec.n_experts, spec.top_k = cfg.num_experts, cfg.num_experts_per_tok
            spec.expert_inter, spec.dense_inter = cfg.moe_intermediate_size, cfg.intermediate_size
            spec.norm_topk_prob = bool(g("norm_topk_prob", False))
            only, step = set(g("mlp_only_layers", None) or []), g("decoder_sparse_step", 1)
            step = 1 if step is None else step
            _require_positive((("decoder_sparse_step", step),))
            spec.moe_layers = [i not in only and spec.n_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)]
            if arch == "qwen2_moe":
                spec.qkv_bias = bool(g("qkv_bias", True))
                spec.shared_inter = g("shared_expert_intermediate_size", 0) or 0
                spec.shared_gate = spec.shared_inter > 0
            else:
                spec.qkv_bias = bool(g("attention_bias", False))
                spec.o_bias = spec.qkv_bias
                spec.qk_norm = "head"
        elif arch == "olmoe":
            spec.n_experts, spec.top_k = cfg.num_experts, cfg.num_experts_per_tok
            spec.expert_inter = cfg.intermediate_size
            spec.norm_topk_prob = bool(g("norm_topk_prob", False))
            spec.qkv_bias = spec.o_bias = bool(g("attention_bias", False))
            spec.qk_norm, spec.clip_qkv = "full", g("clip_qkv")
            spec.moe_layers = [True] * n_layers
        elif arch == "deepseek_v2":
            spec.attention, spec.rope_interleaved, spec.router = "mla", True, "deepseek"
            spec.n_experts, spec.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
            spec.expert_inter, spec.dense_inter = cfg.moe_intermediate_size, cfg.intermediate_size
            spec.shared_inter = (g("n_shared_experts", 0) or 0) * cfg.moe_intermediate_size
            spec.norm_topk_prob = bool(g("norm_topk_prob", False))
            spec.routed_scale = float(g("routed_scaling_factor", 1.0) or 1.0)
            spec.topk_method = g("topk_method", "greedy") or "greedy"
            spec.n_group, spec.topk_group = (g(n) for n in ("n_group", "topk_group"))
            if spec.topk_method == "greedy":  # (unread)
                spec.n_group, spec.topk_group = 1, 1
            if (g("scoring_func", "softmax") or "softmax") != "softmax":
                raise UnsupportedModelError(
                    f"DeepSeek-V2 with scoring_func {g('scoring_func')!r} is not supported: DeepSeek-V2 routes by "
                    f"softmax (its own code refuses any other, transformers' ignores the field)")
            first_dense, freq = g("first_k_dense_replace", 0) or 0, g("moe_layer_freq", 1) or 1
            spec.moe_layers = [i >= first_dense for i in range(n_layers)]
            spec.q_lora_rank, spec.kv_lora_rank = g("q_lora_rank"), cfg.kv_lora_rank
            spec.qk_nope_dim, spec.qk_rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
            spec.v_head_dim = cfg.v_head_dim
            spec.head_dim = spec.qk_nope_dim + spec.qk_rope_dim
            spec.n_kv_heads = n_heads
            spec.qkv_bias = bool(g("attention_bias", False))
            spec.attn_scale = spec.head_dim ** -0.5 * _yarn_mscale_sq(cfg)
            if spec.topk_method not in ("greedy", "group_limited_greedy"):
                raise UnsupportedModelError(f"DeepSeek topk_method {spec.topk_method!r} is not supported")
            if freq != 1:
                raise UnsupportedModelError(
                    f"DeepSeek-V2 with moe_layer_freq {freq} is not supported: transformers ignores it (every layer "
                    f"from first_k_dense_replace on is MoE) where DeepSeek's own code makes every {freq}th layer MoE, "
                    f"so there is no one reference output to match (released DeepSeek-V2 checkpoints set 1)")
            if spec.norm_topk_prob and spec.top_k > 1:
                raise UnsupportedModelError(
                    "DeepSeek-V2 with norm_topk_prob true is not supported: transformers' implementation ignores "
                    "it (it scales by routed_scaling_factor) where DeepSeek's own code renormalises, so there is no "
                    "one reference output to match (released DeepSeek-V2 checkpoints set it false)")

        if g("mlp_bias", False):
            raise UnsupportedModelError("mlp_bias (biases in the MLPs) is not supported: no supported release has them")
        if spec.act != "silu":
            raise UnsupportedModelError(f"expert activation {spec.act!r} is not supported (silu only)")
        _check_experts(spec)
        if spec.topk_method == "group_limited_greedy":
            _require_positive((("n_group", spec.n_group), ("topk_group", spec.topk_group)))
            G, E = spec.n_group, spec.n_experts
            if E % G or spec.topk_group > G or spec.top_k > spec.topk_group * (E // G):
                raise CheckpointError(
                    f"config.json: group-limited routing needs n_group ({G}) to divide the {E} routed experts, "
                    f"topk_group ({spec.topk_group}) <= n_group, and num_experts_per_tok ({spec.top_k}) experts "
                    f"within topk_group groups")
        spec.eos_token_ids = token_ids(g("eos_token_id"))
        return spec


def _require_positive(named) -> None:
    """config.json's sizes, (name, value) pairs: integers >= 1, else a CheckpointError naming the field (not a
    crash deep in the model's construction, nor a plan of negative bytes)."""
    for name, v in named:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CheckpointError(f"config.json: {name} must be an integer >= 1, got {v!r}")


def _check_experts(spec: "ModelSpec") -> None:
    """The routed experts' sizes, once each architecture's names for them are read."""
    _require_positive((("the number of routed experts", spec.n_experts), ("num_experts_per_tok", spec.top_k),
                       ("the experts' intermediate size", spec.expert_inter),
                       ("num_key_value_heads", spec.n_kv_heads), ("head_dim", spec.head_dim)))
    if spec.top_k > spec.n_experts:
        raise CheckpointError(f"config.json: num_experts_per_tok ({spec.top_k}) is more than the {spec.n_experts} "
                              f"routed experts a layer has")
    if spec.n_heads % spec.n_kv_heads:
        raise CheckpointError(f"config.json: num_attention_heads ({spec.n_heads}) is not a multiple of "
                              f"num_key_value_heads ({spec.n_kv_heads})")


def token_ids(x, what: str = "config.json: eos_token_id") -> list[int]:
    """A token id or a list of them (a config's eos_token_id) as a list; a CheckpointError naming `what`
    for anything else (a string, a bool, a float, a nested list: they never match a token, or match 1)."""
    ids = [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise CheckpointError(f"{what} must be a token id (an integer >= 0) or a list of them, got {x!r}")
    return ids


def _sliding_windows(cfg, n_layers: int) -> list[int | None]:
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if cfg.model_type in ("deepseek_v2", "olmoe"):  # their attention ignores sliding_window (PhiMoE's masks to it)
        return [None] * n_layers
    if cfg.model_type in ("qwen2_moe", "qwen3_moe") and not getattr(cfg, "use_sliding_window", False):
        return [None] * n_layers
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n_layers


def _exact_context(cfg, arch: str, max_position: int) -> tuple[int, str]:
    """(the context Specter computes as transformers does, why it is shorter than config.json's). Under
    rope_type 'longrope' transformers switches, per forward, every position's rotation to the long set
    (generic models: long_factor; PhiMoE: long_mscale) once the forward's last position passes
    original_max_position_embeddings: a prompt that crosses it rotates all its positions the long way,
    a generation that crosses it only the later ones. Specter rotates each position one way whatever the
    batch (a verification's positions as one-token steps would): exact up to that point only, so that
    is the context, where the two sets differ. (Phi-3.5-MoE's mscales are equal: its whole context.)"""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    original = rope.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
    if rope.get("rope_type") != "longrope" or not original or original >= max_position:
        return max_position, ""
    long, short = ("long_mscale", "short_mscale") if arch == "phimoe" else ("long_factor", "short_factor")
    if rope.get(long) == rope.get(short):
        return max_position, ""
    return original, (f" (longrope: past original_max_position_embeddings, {original}, transformers rotates by "
                      f"{long} per forward, which Specter does not reproduce exactly)")


def _check_rope(cfg) -> None:
    """A RoPE variant Specter cannot rotate by, refused from config.json alone (before any weight is read)."""
    kind = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if kind == "dynamic":
        raise UnsupportedModelError("dynamic NTK RoPE (rope_type='dynamic') is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"rope_type {kind!r} is not supported; supported: default, "
                                    f"{', '.join(sorted(k for k in ROPE_INIT_FUNCTIONS if k != 'dynamic'))}")


def _yarn_mscale_sq(cfg) -> float:
    """DeepSeek-V2 with YaRN folds mscale(factor, mscale_all_dim)² into the softmax scale."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") == "default" or not rope.get("mscale_all_dim"):
        return 1.0
    import math

    factor = rope["factor"]
    m = 1.0 if factor <= 1 else 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0
    return m * m
