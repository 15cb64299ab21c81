"""Attention weight layouts: the names people give Q/K/V/output projections, mapped onto in_proj.

A layout names the Linear modules of one attention block: separate `q`, `k`, `v` (each
`<name>.weight`, optional `<name>.bias`) or one fused `qkv`, plus `out`. Loading fuses Q/K/V
into PyTorch's `in_proj_weight` / `in_proj_bias` once, so the engine runs one GEMM either way.
Well-known names are detected; anything else is named in config.json's `attention_keys`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch
from torch import Tensor

from .config import MultiheadAttentionConfig
from .errors import CheckpointError, check_state

# PyTorch's own nn.MultiheadAttention names: such state dicts load without any mapping.
PYTORCH_KEYS = frozenset(
    {"in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight"}
    | {"bias_k", "bias_v"}
)
SEPARATE_NAMES = (
    ("W_q", "W_k", "W_v"),  # the classic from-scratch tutorials
    ("w_q", "w_k", "w_v"),
    ("wq", "wk", "wv"),  # gpt-fast / llama reference code
    ("q_proj", "k_proj", "v_proj"),  # fairseq / Hugging Face decoders
    ("query", "key", "value"),
    ("queries", "keys", "values"),
)
FUSED_NAMES = ("wqkv", "qkv_proj", "qkv", "Wqkv")
OUT_NAMES = ("W_o", "w_o", "wo", "out_proj", "o_proj", "fc_out", "out")
PACKINGS = ("concat", "per_head")
KEY_MAP_FIELDS = frozenset({"q", "k", "v", "qkv", "out", "qkv_packing"})


@dataclass(frozen=True)
class AttentionKeys:
    """Module names (without `.weight`/`.bias`) of one attention block's projections.

    qkv_packing says how a fused qkv weight stacks its rows: `concat` is [Q; K; V] (PyTorch,
    gpt-fast), `per_head` is [q_0, k_0, v_0, q_1, ...] per head (some tutorials reshape the
    fused output to (B, T, H, 3 * head_dim) and chunk it).
    """

    out: str
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    qkv_packing: str = "concat"

    @property
    def fused(self) -> bool:
        return self.qkv is not None

    def modules(self) -> tuple[str, ...]:
        return (self.qkv, self.out) if self.fused else (self.q, self.k, self.v, self.out)

    def describe(self) -> str:
        return "/".join(self.modules()) + (f" ({self.qkv_packing})" if self.fused else "")


ANNOTATED = AttentionKeys(q="linears.0", k="linears.1", v="linears.2", out="linears.3")
KNOWN_LAYOUTS: tuple[AttentionKeys, ...] = (
    *(AttentionKeys(q=q, k=k, v=v, out=o) for (q, k, v), o in product(SEPARATE_NAMES, OUT_NAMES)),
    *(AttentionKeys(qkv=f, out=o) for f, o in product(FUSED_NAMES, OUT_NAMES)),
    ANNOTATED,  # The Annotated Transformer: clones(nn.Linear(d_model, d_model), 4)
)


def tried_summary() -> str:
    """The detected layouts, compactly, for error messages."""
    separate = " | ".join("/".join(names) for names in SEPARATE_NAMES)
    return (
        f"PyTorch in_proj_weight/out_proj; separate Q/K/V ({separate}) or fused QKV "
        f"({' | '.join(FUSED_NAMES)}), each with an output projection "
        f"({' | '.join(OUT_NAMES)}); {ANNOTATED.describe()}"
    )


def parse_key_map(key_map: object) -> AttentionKeys:
    """config.json's `attention_keys`: {"q", "k", "v", "out"} or {"qkv", "out", "qkv_packing"?}."""
    if not isinstance(key_map, dict):
        raise CheckpointError(f"config.attention_keys must be an object, got {key_map!r}")
    unknown = sorted(set(key_map) - KEY_MAP_FIELDS)
    if unknown:
        raise CheckpointError(
            f"config.attention_keys has unknown field(s) {unknown}; "
            f"allowed: {sorted(KEY_MAP_FIELDS)}"
        )
    for field, value in key_map.items():
        if not isinstance(value, str) or not value:
            raise CheckpointError(f"config.attention_keys.{field} must be a non-empty string")
    packing = key_map.get("qkv_packing", "concat")
    if packing not in PACKINGS:
        raise CheckpointError(f"config.attention_keys.qkv_packing must be one of {PACKINGS}")
    separate = [key_map.get(n) for n in "qkv"]
    if "out" not in key_map:
        raise CheckpointError("config.attention_keys needs 'out' (the output projection)")
    if "qkv" in key_map and not any(separate):
        return AttentionKeys(qkv=key_map["qkv"], out=key_map["out"], qkv_packing=packing)
    if all(separate) and "qkv" not in key_map:
        q, k, v = separate
        return AttentionKeys(q=q, k=k, v=v, out=key_map["out"])
    raise CheckpointError(
        "config.attention_keys needs either 'q', 'k' and 'v' or one fused 'qkv', not both"
    )


def detect(state: dict, prefix: str = "") -> AttentionKeys | None:
    """The layout of the attention block under `prefix`: None for PyTorch's own names.

    Raises CheckpointError listing the keys found and the layouts tried when no layout, or more
    than one, matches; a key map in config.json settles both cases.
    """
    keys = sorted(k[len(prefix) :] for k in state if k.startswith(prefix))
    if PYTORCH_KEYS.intersection(keys):
        return None
    present = set(keys)
    matches = [
        layout
        for layout in KNOWN_LAYOUTS
        if all(f"{m}.weight" in present for m in layout.modules())
    ]
    if len(matches) == 1:
        return matches[0]
    hint = (
        'name the projections in config.json, e.g. "attention_keys": '
        '{"q": "W_q", "k": "W_k", "v": "W_v", "out": "W_o"} or {"qkv": "qkv", "out": "proj"}'
    )
    if matches:
        raise CheckpointError(
            f"ambiguous attention layout: keys {keys} match "
            f"{[m.describe() for m in matches]}; {hint}"
        )
    raise CheckpointError(
        f"unrecognised attention layout: keys found {keys}; layouts tried: {tried_summary()}; "
        f"{hint}"
    )


def expected_shapes(
    keys: AttentionKeys, dims: MultiheadAttentionConfig, prefix: str = ""
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required weight shapes, optional bias shapes) under the layout's own key names."""
    E, KV = dims.embed_dim, dims.kv_dim
    if keys.fused:
        if dims.kdim != E or dims.vdim != E:
            raise CheckpointError("a fused qkv projection needs kdim == vdim == embed_dim")
        if keys.qkv_packing == "per_head" and dims.num_kv_heads != dims.num_heads:
            raise CheckpointError("qkv_packing 'per_head' needs num_kv_heads == num_heads")
        rows = {keys.qkv: E + 2 * KV, keys.out: E}
        required = {f"{prefix}{keys.qkv}.weight": (E + 2 * KV, E)}
    else:
        rows = {keys.q: E, keys.k: KV, keys.v: KV, keys.out: E}
        required = {
            f"{prefix}{keys.q}.weight": (E, E),
            f"{prefix}{keys.k}.weight": (KV, dims.kdim),
            f"{prefix}{keys.v}.weight": (KV, dims.vdim),
        }
    required[f"{prefix}{keys.out}.weight"] = (E, E)
    optional = {f"{prefix}{name}.bias": (n,) for name, n in rows.items()}
    return required, optional


def _unpack_per_head(t: Tensor, num_heads: int) -> Tensor:
    """[q_0, k_0, v_0, q_1, ...] rows -> [Q; K; V] rows (works for weights and biases)."""
    tail = t.shape[1:]
    per_head = t.reshape(num_heads, 3, -1, *tail)  # (H, 3, hd, ...)
    return per_head.transpose(0, 1).reshape(t.shape)  # (3 * H * hd, ...)


def to_pytorch_names(
    state: dict[str, Tensor],
    keys: AttentionKeys,
    dims: MultiheadAttentionConfig,
    prefix: str = "",
    strict: bool = True,
) -> tuple[dict[str, Tensor], bool]:
    """Validate the block under `prefix` and give it PyTorch's names (no prefix), plus `bias`.

    strict: every key under `prefix` must belong to the layout (else only its modules are read).
    Q/K/V become one in_proj_weight when they share the input width (else q/k/v_proj_weight).
    If only some projections carry a bias, the others get zeros: x + 0 is exact, so the numbers
    equal the source module's, and the engine keeps a single `bias` flag.
    """
    required, optional = expected_shapes(keys, dims, prefix)
    modules = set(keys.modules())
    block = {
        k: v
        for k, v in state.items()
        if k.startswith(prefix) and (strict or k[len(prefix) :].rsplit(".", 1)[0] in modules)
    }
    check_state(block, required, f"attention layout {keys.describe()}", optional)

    def get(name: str, kind: str) -> Tensor | None:
        return block.get(f"{prefix}{name}.{kind}")

    E, KV = dims.embed_dim, dims.kv_dim
    has_bias = any(key in block for key in optional)
    out: dict[str, Tensor] = {"out_proj.weight": get(keys.out, "weight")}
    if keys.fused:
        w_qkv, b_qkv = get(keys.qkv, "weight"), get(keys.qkv, "bias")
        if keys.qkv_packing == "per_head":
            w_qkv = _unpack_per_head(w_qkv, dims.num_heads)
            b_qkv = None if b_qkv is None else _unpack_per_head(b_qkv, dims.num_heads)
        out["in_proj_weight"] = w_qkv.contiguous()  # (E + 2KV, E)
        biases = [b_qkv if b_qkv is not None else w_qkv.new_zeros(E + 2 * KV)]
    else:
        weights = [get(n, "weight") for n in (keys.q, keys.k, keys.v)]
        if dims.kdim == E and dims.vdim == E:
            out["in_proj_weight"] = torch.cat(weights)  # (E + 2KV, E)
        else:
            names = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
            out.update(zip(names, weights, strict=True))
        biases = [
            b if (b := get(n, "bias")) is not None else w.new_zeros(w.shape[0])
            for n, w in zip((keys.q, keys.k, keys.v), weights, strict=True)
        ]
    if has_bias:
        out["in_proj_bias"] = torch.cat(biases)  # (E + 2KV,)
        out_b = get(keys.out, "bias")
        out["out_proj.bias"] = out_b if out_b is not None else out["out_proj.weight"].new_zeros(E)
    return out, has_bias
