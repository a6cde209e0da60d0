"""A lean decoder forward for Llama-family models (llama, mistral, qwen2, qwen3) over our KV cache and attention.

Fused QKV and gate-up weights (one GEMV each instead of three and two: a memory-bound step reads the same bytes in
fewer, larger calls), prepacked where that pays (linear.py), the HF model's own embedding, norm, rotary and activation
modules; unsupported features refused. On CPU bf16 and float32 with our kernels the layers run in one call
(cpu_layers.py); elsewhere on the CPU, once compiled.compile_layers ran, through inductor (compiled.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrun.decoding.forward.attention import ForwardContext
from specrun.decoding.forward.cpu_layers import CpuLayers
from specrun.decoding.forward.linear import Linear
from specrun.decoding.kernels.cpu_kernels import cpu_kernels

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
# config fields that change the computation in ways this forward does not implement: (field, applies(value))
_REFUSED = (
    ("final_logit_softcapping", lambda v: v is not None),
    ("attn_logit_softcapping", lambda v: v is not None),
    ("logit_scale", lambda v: v is not None and v != 1.0),
    ("logits_scaling", lambda v: v is not None and v != 1.0),
)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # row counts of the fixed-shape forwards (static_step.py, compiled.py)


def rows_bucket(rows: int) -> int | None:
    """The smallest row bucket holding `rows` rows, None above the largest."""
    return next((w for w in ROW_BUCKETS if w >= rows), None)


# rope types whose frequencies depend on the sequence length a forward sees (HF's dynamic_rope_update): a position's
# rotary would depend on how many rows a forward carries or where a resume started (drafted or resumed != AR)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_types(config) -> set[str]:
    """The rope types a config declares (rope_parameters, or older configs' rope_scaling; per layer type if nested)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    groups = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return {g.get("rope_type") or g.get("type") or "default" for g in groups if isinstance(g, dict)}


def check_supported(config) -> None:
    """ValueError naming the architecture or feature that our forward would silently get wrong."""
    arch = getattr(config, "model_type", "?")
    if arch not in SUPPORTED:
        raise ValueError(f"model type {arch!r} is not supported; specrun runs {', '.join(SUPPORTED)} models")
    for name, applies in _REFUSED:
        if applies(getattr(config, name, None)):
            raise ValueError(f"{arch} config sets {name}={getattr(config, name)!r}, which specrun does not implement")
    bad = sorted(t for t in rope_types(config) if any(d in t for d in LENGTH_DEPENDENT_ROPE))  # HF matches "dynamic"
    # as a substring
    if bad:
        raise ValueError(f"{arch} config uses rope_type={bad[0]!r}, whose frequencies depend on the sequence length a "
                         f"forward sees: drafted and resumed output could differ from plain decoding, so specrun "
                         f"refuses it (docs/design.md section 2)")
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", arch == "mistral")
    if uses_window and window is not None and window < config.max_position_embeddings:
        raise ValueError(f"{arch} config uses sliding-window attention (sliding_window={window}), which specrun does "
                         f"not implement")
    if getattr(config, "layer_types", None) and any(t != "full_attention" for t in config.layer_types):
        raise ValueError(f"{arch} config has non-full attention layers ({sorted(set(config.layer_types))}), which "
                         f"specrun does not implement")


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum N, K] weight (and bias); the modules' weights become views of it, so memory is not doubled."""
    weight = torch.cat([m.weight.data for m in linears])
    bias = torch.cat([m.bias.data for m in linears]) if linears[0].bias is not None else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[row : row + n]
        if bias is not None:
            m.bias.data = bias[row : row + n]
        row += n
    return weight, bias


@dataclass
class _Layer:
    ln1: torch.nn.Module
    ln2: torch.nn.Module
    qkv: Linear  # [Hq*D + 2*Hkv*D, H]
    o: Linear  # [H, Hq*D]
    gate_up: Linear  # [2I, H]
    down: Linear  # [H, I]
    act: torch.nn.Module
    q_norm: torch.nn.Module | None  # qwen3: RMSNorm over each head's D before RoPE
    k_norm: torch.nn.Module | None
    scaling: float

    @classmethod
    def from_hf(cls, layer) -> _Layer:
        att, mlp = layer.self_attn, layer.mlp
        qkv = Linear(*_fuse([att.q_proj, att.k_proj, att.v_proj]))
        gate_up = Linear(*_fuse([mlp.gate_proj, mlp.up_proj]))
        return cls(layer.input_layernorm, layer.post_attention_layernorm, qkv, Linear.of(att.o_proj), gate_up,
                   Linear.of(mlp.down_proj), mlp.act_fn, getattr(att, "q_norm", None), getattr(att, "k_norm", None),
                   att.scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """# x: [T, Hx, D], cos/sin: [T, 1, D] -> [T, Hx, D] (rotate-half convention, as HF)"""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotated_qkv(L, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int, D: int):
    """A layer's (anything with ln1, qkv, q_norm, k_norm) queries and keys after RoPE, and its values.

    # x: [T, H], cos/sin: [T, 1, D] -> qk: [T, nq + nkv, D] (q heads first), v: [T, nkv, D]
    """
    T = x.shape[0]
    qkv = L.qkv(L.ln1(x))  # [T, (nq + 2 nkv) D]
    qk = qkv[:, : (nq + nkv) * D].view(T, nq + nkv, D)
    v = qkv[:, (nq + nkv) * D :].view(T, nkv, D)
    if L.q_norm is not None:
        qk = torch.cat((L.q_norm(qk[:, :nq]), L.k_norm(qk[:, nq:])), dim=1)
    return apply_rope(qk, cos, sin), v  # q and k heads in one pass: elementwise, so the same values as two


def mlp_residual(L, x: torch.Tensor, inter: int) -> torch.Tensor:
    """x plus a layer's (anything with ln2, gate_up, down, act) gated MLP of it.

    # x: [T, H] -> [T, H]
    """
    gu = L.gate_up(L.ln2(x))  # [T, 2I]
    return x + L.down(L.act(gu[:, :inter]) * gu[:, inter:])

class FusedDecoder:
    @classmethod
    def of(cls, model) -> FusedDecoder:
        """The model's decoder, built once per model object (fusing re-points the model's weights at fused storage)."""
        dec = getattr(model, "_specrun_decoder", None)
        if dec is None:
            dec = cls(model)
            model._specrun_decoder = dec
        return dec

    def __init__(self, model):
        cfg = model.config
        check_supported(cfg)
        base = model.get_decoder()
        self.embed, self.norm, self.rotary = base.embed_tokens, base.norm, base.rotary_emb
        self.layers = [_Layer.from_hf(layer) for layer in base.layers[: cfg.num_hidden_layers]]
        self.n_q = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inter = self.layers[0].gate_up.weight.shape[0] // 2
        self.lm_head = Linear.of(model.get_output_embeddings())  # [V, H]
        self.cpu_layers = CpuLayers.of(self, cpu_kernels())  # CPU bf16 or float32: every layer in one call
        self.compiled = None  # CompiledLayers once compiled.compile_layers ran
        self.compiled_head = None  # and its CompiledHead

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, ctx, compiled: bool = False) -> torch.Tensor:
        """ctx: ForwardContext (one sequence) or BatchContext (packed sequences); both attend(layer, q, k, v, scaling).
        compiled: through the compiled layers where compile_layers built them and they cover T rows.

        # tokens, positions: [T] long -> hidden: [T, H] (after the final norm)
        """
        x, cos, sin = self.embed_rope(tokens, positions)
        T = tokens.shape[0]
        if self.cpu_layers is not None:
            if isinstance(ctx, ForwardContext):
                if ctx.whole_layers:
                    new = None if T == 1 else ctx.mask[:, ctx.start : ctx.start + T]  # [T, T]
                    return self.norm(self.cpu_layers(x, cos[:, 0], sin[:, 0], ctx.cache, ctx.start, new, ctx.queries))
            elif (spans := ctx.whole_layer_spans()) is not None:  # a batched worker's BatchContext
                return self.norm(self.cpu_layers.batch(x, cos[:, 0], sin[:, 0], ctx.pool.k, ctx.pool.v, spans,
                                                       ctx.queries))
        if compiled and self.compiled is not None and self.compiled.covers(T):
            return self.norm(self.compiled(x, cos, sin, ctx))
        return self.norm(self.layer_stack(x, cos, sin, ctx))

    def logits(self, hidden: torch.Tensor, compiled: bool = False) -> torch.Tensor:
        """compiled: through the compiled head where compile_layers built it and it covers T rows.

        # hidden: [T, H] -> [T, V] in float32 (float64 stays float64)"""
        head = self.compiled_head
        with torch.inference_mode():
            x = head(hidden) if compiled and head is not None and head.covers(hidden.shape[0]) else self.lm_head(hidden)
        return x if x.dtype in (torch.float32, torch.float64) else x.float()

    def embed_rope(self, tokens: torch.Tensor, positions: torch.Tensor):
        """# tokens, positions: [T] long -> x: [T, H], cos/sin: [T, 1, D]"""
        x = self.embed(tokens)  # [T, H]
        cos, sin = self.rotary(x[None], positions[None])  # [1, T, D] each
        return x, cos[0, :, None, :], sin[0, :, None, :]

    def layer_stack(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """Every layer in torch ops, attention by ctx.attend (any context with that method: static_step's too).

        # x: [T, H], cos/sin: [T, 1, D] -> [T, H] (before the final norm)
        """
        T, D, nq, nkv = x.shape[0], self.head_dim, self.n_q, self.n_kv
        for i, L in enumerate(self.layers):
            qk, v = rotated_qkv(L, x, cos, sin, nq, nkv, D)
            q, k = qk[:, :nq], qk[:, nq:]
            out = ctx.attend(i, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                             L.scaling)  # [1, T, Hq, D]
            x = x + L.o(out.reshape(T, nq * D))
            x = mlp_residual(L, x, self.inter)
        return x
