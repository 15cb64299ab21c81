"""JinaBERT references for tests, since transformers has no JinaBERT class: transformers' own
BertModel with its position table zeroed (JinaBERT has none), ALiBi given as a float attention
mask from the ALiBi paper's slopes written out here (not the engine's function), and each layer's
`intermediate` a GLU, so BertOutput is JinaBERT's `mlp.wo` + `mlp.layernorm`; and the Hub's files
for it (a `bert` config with position_embedding_type `alibi`, `mlp.gated_layers`/`wo`/
`layernorm`, under `bert.`). Also the files Jina's XLM-RoBERTa code writes (jina-reranker-v2)
for a transformers XLM-RoBERTa model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tests import text_models as tm

# the ALiBi paper's slopes: 2^(-8i/H) for H a power of two; else the power of two below, then
# every other slope of twice it (jina-embeddings-v2-base-en has 12 heads)
SLOPES = {
    4: [2**-2, 2**-4, 2**-6, 2**-8],
    6: [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3],
    8: [2.0**-k for k in range(1, 9)],
    12: [*(2.0**-k for k in range(1, 9)), 2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5],
}
JINA_AUTO_MAP = {
    "AutoConfig": "jinaai/jina-bert-implementation--configuration_bert.JinaBertConfig",
    "AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel",
}


class GatedIntermediate(nn.Module):
    """JinaBERT's GLU up to `wo`: act(rows [:F] of gated_layers(x)) * rows [F:]."""

    def __init__(self, hidden: int, ffn: int, act: nn.Module) -> None:
        super().__init__()
        self.gated_layers = nn.Linear(hidden, 2 * ffn, bias=False)
        self.ffn, self.act = ffn, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gated_layers(x)
        return self.act(h[..., : self.ffn]) * h[..., self.ffn :]


def reference(
    head: str = "", heads: int = 4, feed_forward: str = "geglu", hidden: int = 0, **overrides
):
    """A transformers BertModel (or ...ForSequenceClassification) computing JinaBERT; hidden
    width 8 * heads unless given."""
    hidden = hidden or 8 * heads
    model = tm.build("bert", head, hidden_size=hidden, num_attention_heads=heads, **overrides)
    bert = model.bert if head else model
    torch.manual_seed(7)
    act = nn.GELU() if feed_forward == "geglu" else nn.ReLU()
    with torch.no_grad():
        bert.embeddings.position_embeddings.weight.zero_()  # no position table: adds nothing
        for layer in bert.encoder.layer:
            glu = GatedIntermediate(hidden, model.config.intermediate_size, act)
            glu.gated_layers.weight.normal_(0, 0.5 / hidden**0.5)
            layer.intermediate = glu
    return model.eval()


def alibi_mask(mask: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, H, T, T) float mask: -slope * |i - j| plus the padded keys' minimum."""
    T = mask.shape[-1]
    distance = (torch.arange(T)[None, :] - torch.arange(T)[:, None]).abs()  # (T, T)
    bias = -torch.tensor(SLOPES[heads])[:, None, None] * distance  # (H, T, T)
    padded = ~mask.bool()[:, None, None, :]  # (B, 1, 1, T)
    return bias[None].masked_fill(padded, torch.finfo(torch.float32).min)


def run(reference, ids: torch.Tensor, mask: torch.Tensor, **kw):
    heads = reference.config.num_attention_heads
    with torch.no_grad():
        return reference(input_ids=ids, attention_mask=alibi_mask(mask, heads), **kw)


def hub_form(reference, directory: Path, feed_forward: str = "geglu", **config) -> Path:
    """The Hub's files: JinaBERT's weight names (under `bert.`, as its checkpoints), config."""
    directory.mkdir()
    state = {}
    for key, value in reference.state_dict().items():
        key = key if key.startswith(("bert.", "classifier.")) else "bert." + key
        if key.endswith("position_embeddings.weight"):
            continue
        key = re.sub(r"(layer\.\d+\.)intermediate\.", r"\1mlp.", key)
        key = re.sub(r"(layer\.\d+\.)output\.dense\.", r"\1mlp.wo.", key)
        key = re.sub(r"(layer\.\d+\.)output\.LayerNorm\.", r"\1mlp.layernorm.", key)
        state[key] = value.contiguous()
    save_file(state, directory / "model.safetensors")
    written = {
        **reference.config.to_dict(), "position_embedding_type": "alibi",
        "feed_forward_type": feed_forward, "architectures": ["JinaBertForMaskedLM"],
        "auto_map": JINA_AUTO_MAP, "hidden_act": "gelu", **config,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(written))
    tm.write_tokenizer(directory)
    return directory


CODE = "modeling_xlm_roberta."
FLASH_AUTO_MAP = {
    "AutoConfig": "configuration_xlm_roberta.XLMRobertaFlashConfig",
    "AutoModel": CODE + "XLMRobertaModel",
    "AutoModelForSequenceClassification": CODE + "XLMRobertaForSequenceClassification",
}
# transformers' names inside layer i -> Jina's flash ones
LAYER_NAMES = {
    "attention.output.dense.": "mixer.out_proj.",
    "attention.output.LayerNorm.": "norm1.",
    "intermediate.dense.": "mlp.fc1.",
    "output.dense.": "mlp.fc2.",
    "output.LayerNorm.": "norm2.",
}


def xlmr_flash_form(reference, directory: Path, **config) -> Path:
    """The files Jina's XLM-RoBERTa code writes for `reference` (its state renamed, Q/K/V fused
    into Wqkv, no pooler, no model_type in config.json)."""
    directory.mkdir()
    state = reference.state_dict()
    out = {}
    for key, value in state.items():
        prefix = "roberta." if key.startswith("roberta.") else ""
        inner = key[len(prefix) :]
        if inner.startswith("pooler."):
            continue  # Jina's XLMRobertaModel is built without one
        layer = re.match(r"encoder\.layer\.(\d+)\.(.*)", inner)
        if layer is None:
            out[prefix + inner.replace("embeddings.LayerNorm.", "emb_ln.")] = value
            continue
        i, rest = layer.groups()
        p = f"{prefix}encoder.layers.{i}."
        if rest.startswith("attention.self.query."):
            leaf = rest.rsplit(".", 1)[1]
            parts = [state[key.replace(".query.", f".{n}.")] for n in ("query", "key", "value")]
            out[f"{p}mixer.Wqkv.{leaf}"] = torch.cat(parts)  # rows [q; k; v]
        for theirs, flash in LAYER_NAMES.items():
            if rest.startswith(theirs):
                out[p + flash + rest[len(theirs) :]] = value
    save_file({k: v.contiguous() for k, v in out.items()}, directory / "model.safetensors")
    written = {k: v for k, v in reference.config.to_dict().items() if k != "model_type"}
    written.update({"auto_map": FLASH_AUTO_MAP, "use_flash_attn": True, **config})
    (directory / "config.json").write_text(json.dumps(written))
    tm.write_tokenizer(directory, 0)
    return directory
