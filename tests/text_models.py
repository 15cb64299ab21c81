"""Tiny random BERT-family text models built offline: transformers models saved with
save_pretrained(safe_serialization=True) plus a WordPiece tokenizer.json over a small vocabulary,
so engine and service tests compare with transformers without downloading anything."""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub

WORDS = """the a an is are was of to in on for with and or what how who where deep learning
machine model models text texts query passage search rank paris france capital city cat cats
dog dogs sat mat good bad great terrible movie film food weather rain sun this that it be not
very hello world sentence sentences example each converted : ? . ,""".split()  # noqa: SIM905
SPECIALS = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] = 1: RoBERTa's offset shows
VOCAB = [*SPECIALS, *string.ascii_lowercase, *(f"##{c}" for c in string.ascii_lowercase), *WORDS]
PAD, CLS, SEP = 1, 2, 3
D, HEADS, LAYERS, FFN, POSITIONS = 32, 4, 2, 48, 40
LABELS3 = {0: "negative", 1: "neutral", 2: "positive"}
SPARSE_MODULES = "sentence_transformers.sparse_encoder.models."  # SparseEncoder's module types
# 3 to 21 tokens: shorter and longer than the ModernBERT test model's window (4 each way)
LONG_AND_SHORT = [
    "the cat sat on the mat",
    "hello",
    "what is deep learning and how does a model rank a passage for a query ?",
    "a dog . a cat . a mat",
]


def write_tokenizer(directory: Path, pair_type: int = 1) -> None:
    """A BERT-style WordPiece tokenizer.json: lower-cased, [CLS] A [SEP] (B [SEP] of type
    `pair_type`: 1 for BERT, 0 as RoBERTa's tokenizers give)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair=f"[CLS] $A [SEP] $B:{pair_type} [SEP]:{pair_type}",
        special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)],
    )
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(directory / "tokenizer.json"))


def hf_config(model_type: str, **overrides):
    import transformers

    if model_type == "distilbert":
        kwargs = dict(dim=D, n_heads=HEADS, n_layers=LAYERS, hidden_dim=FFN)
    elif model_type == "modernbert":  # layers: full, sliding (keys within 4 tokens), full
        kwargs = dict(
            hidden_size=D, num_attention_heads=HEADS, num_hidden_layers=3, intermediate_size=FFN,
            local_attention=8, global_attn_every_n_layers=2, bos_token_id=CLS, cls_token_id=CLS,
            eos_token_id=SEP, sep_token_id=SEP,
        )  # fmt: skip
    elif model_type == "qwen3":  # GQA (4 query heads, 2 K/V heads) of 16 dims: 64 wide, not 32
        kwargs = dict(
            hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=LAYERS, intermediate_size=FFN, eos_token_id=SEP,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        )  # fmt: skip
    elif model_type in ("llama", "mistral", "qwen2", "eurobert"):  # Qwen3's, no head norms
        kwargs = dict(
            hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=LAYERS, intermediate_size=FFN, eos_token_id=SEP,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        )  # fmt: skip
        if model_type == "mistral":
            kwargs["sliding_window"] = None  # a test sets one where it matters
    elif model_type in ("nomic_bert", "gte"):  # BERT with RoPE and a gated MLP, no positions
        kwargs = dict(
            hidden_size=D, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
            intermediate_size=FFN, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        )  # fmt: skip
        if model_type == "gte":
            kwargs["type_vocab_size"] = 1
    elif model_type == "gemma3_text":  # EmbeddingGemma's form: bidirectional, sliding (4 each way)
        kwargs = dict(
            hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=16,
            query_pre_attn_scalar=16, num_hidden_layers=3, intermediate_size=FFN,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=8, use_bidirectional_attention=True, eos_token_id=SEP,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
        )  # fmt: skip
    else:
        kwargs = dict(
            hidden_size=D,
            num_attention_heads=HEADS,
            num_hidden_layers=LAYERS,
            intermediate_size=FFN,
            type_vocab_size=1 if model_type in ("roberta", "xlm-roberta", "camembert") else 2,
            layer_norm_eps=1e-12,
        )
    kwargs.update(vocab_size=len(VOCAB), max_position_embeddings=POSITIONS, pad_token_id=PAD)
    kwargs.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def build(model_type: str, head: str = "", seed: int = 0, **overrides):
    """A seeded eval-mode transformers model, every parameter perturbed (zero biases and unit
    LayerNorms would hide mapping mistakes). head: "", "ForSequenceClassification",
    "ForMaskedLM" or "ForCausalLM"."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(model_type, **overrides)
    cls = getattr(transformers, f"AutoModel{head}")
    model = cls.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def save(model, directory: Path) -> Path:
    """save_pretrained with safetensors, plus the tokenizer: a directory mha-serve loads."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory, 1 if model.config.model_type in ("bert", "nomic_bert") else 0)
    return directory


def classifier(model_type: str, directory: Path, labels: dict[int, str] | None = None, **kw):
    """A `...ForSequenceClassification` directory; one label makes a reranker."""
    labels = labels or LABELS3
    model = build(
        model_type,
        "ForSequenceClassification",
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
        **kw,
    )
    return model, save(model, directory)


def sentence_transformer(
    directory: Path,
    pooling: str = "mean",
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    model_type: str = "bert",
):
    """A base model with sentence-transformers' files: 1_Pooling (mean_tokens, cls_token or
    lasttoken), optional Normalize, and prompts in config_sentence_transformers.json."""
    model = build(model_type)
    save(model, directory)
    write_st_modules(directory, pooling, normalize, prompts)
    return model, directory


def write_st_modules(
    directory: Path,
    pooling: str = "mean",
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
) -> None:
    """sentence-transformers' files beside a saved model (see sentence_transformer)."""
    parts = [("", "Transformer"), ("1_Pooling", "Pooling")]
    if normalize:
        parts.append(("2_Normalize", "Normalize"))
    modules = [
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{kind}"}
        for i, (p, kind) in enumerate(parts)
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    mode = {"mean": "mean_tokens", "cls": "cls_token", "last_token": "lasttoken"}[pooling]
    flags = {f"pooling_mode_{m}": m == mode for m in ("mean_tokens", "cls_token", "lasttoken")}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    if prompts is not None:
        config = {"prompts": prompts, "default_prompt_name": None}
        (directory / "config_sentence_transformers.json").write_text(json.dumps(config))


def add_dense(
    directory: Path, layers: list[tuple[int, int, bool, str]], legacy: bool = False, seed: int = 4
) -> list[torch.nn.Linear]:
    """Dense modules (in, out, bias, torch.nn activation class name) written as
    sentence-transformers writes them (`<idx>_Dense/config.json` and weights under `linear.`;
    legacy: pytorch_model.bin, as LaBSE's), put in modules.json after Pooling and before
    Normalize; the seeded Linears, for references."""
    modules = json.loads((directory / "modules.json").read_text())
    tail = [m for m in modules if m["type"].endswith("Normalize")]
    head = [m for m in modules if m not in tail]
    torch.manual_seed(seed)
    linears = []
    for in_f, out_f, bias, act in layers:
        where = f"{len(head)}_Dense"
        (directory / where).mkdir()
        config = {"in_features": in_f, "out_features": out_f, "bias": bias,
                  "activation_function": f"torch.nn.modules.{act}"}  # fmt: skip
        (directory / where / "config.json").write_text(json.dumps(config))
        linear = torch.nn.Linear(in_f, out_f, bias=bias)
        state = {f"linear.{k}": v.detach().clone() for k, v in linear.state_dict().items()}
        if legacy:
            torch.save(state, directory / where / "pytorch_model.bin")
        else:
            from safetensors.torch import save_file

            save_file(state, str(directory / where / "model.safetensors"))
        head.append({"idx": 0, "name": "", "path": where,
                     "type": "sentence_transformers.models.Dense"})  # fmt: skip
        linears.append(linear)
    modules = [{**m, "idx": i, "name": str(i)} for i, m in enumerate(head + tail)]
    for m in modules:
        if m["type"].endswith("Normalize"):
            m["path"] = f"{m['idx']}_Normalize"
    (directory / "modules.json").write_text(json.dumps(modules))
    return linears


def write_dense(path: Path, folder: str, width: int, seed: int = 9) -> torch.nn.Linear:
    """A Dense module folder (identity activation) that modules.json does not list, as
    stella_en_400M_v5 ships 2_Dense_<dims> alternatives; its seeded Linear."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    linear = torch.nn.Linear(D, width)
    (path / folder).mkdir()
    config = {"in_features": D, "out_features": width, "bias": True,
              "activation_function": "torch.nn.modules.linear.Identity"}  # fmt: skip
    (path / folder / "config.json").write_text(json.dumps(config))
    state = {f"linear.{k}": v.detach().clone() for k, v in linear.state_dict().items()}
    save_file(state, str(path / folder / "model.safetensors"))
    return linear


def splade(directory: Path, model_type: str = "bert", seed: int = 2, **overrides):
    """A `...ForMaskedLM` model saved as sentence-transformers' SparseEncoder saves one:
    modules.json with MLMTransformer and SpladePooling (max of log(1 + relu))."""
    model = build(model_type, "ForMaskedLM", seed=seed, **overrides)
    save(model, directory)
    kinds = ("MLMTransformer", "SpladePooling")
    modules = [
        {
            "idx": i,
            "name": str(i),
            "path": p,
            "type": SPARSE_MODULES + k,
        }
        for i, (p, k) in enumerate((("", kinds[0]), ("1_SpladePooling", kinds[1])))
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_SpladePooling").mkdir(exist_ok=True)
    pooling = {"pooling_strategy": "max", "activation_function": "relu",
               "word_embedding_dimension": model.config.vocab_size}  # fmt: skip
    (directory / "1_SpladePooling" / "config.json").write_text(json.dumps(pooling))
    return model, directory


def splade_reference(model, encoded) -> torch.Tensor:
    """transformers' logits through SPLADE's pooling: max over real tokens of log(1 + relu)."""
    ids, mask, types = padded(encoded)
    kwargs = {"token_type_ids": types} if model.config.model_type == "bert" else {}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits  # (B, T, V)
    weights = torch.log1p(torch.relu(logits)) * mask[..., None]
    return weights.amax(dim=1)  # (B, V)


def tokenize(directory: Path, texts: list, pairs: bool = False):
    """(ids, token types) per text (or per (a, b) pair) with the directory's tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    encs = tokenizer.encode_batch([tuple(t) for t in texts] if pairs else texts)
    return [(torch.tensor(e.ids), torch.tensor(e.type_ids)) for e in encs]


def padded(encoded):
    """Right-padded (ids, attention_mask, token_type_ids) of tokenize()'s output."""
    T = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), T), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for i, (row, t) in enumerate(encoded):
        ids[i, : len(row)], mask[i, : len(row)], types[i, : len(row)] = row, 1, t
    return ids, mask, types


def random_padded(lengths: list[int], seed: int = 3):
    """Seeded random ids (never the pad id) of these lengths, right-padded with PAD, and the
    attention mask: (B, T) each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(2, len(VOCAB), (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3-Reranker's prompt as a chat template over sentence-transformers' pair roles (system: the
# instruction, query, document), ending in the empty thinking block its answer follows
RERANK_TEMPLATE = """<|im_start|>system
Judge whether the Document meets the requirements based on the Query and the Instruct provided. \
Note that the answer can only be "yes" or "no".<|im_end|>
<|im_start|>user
<Instruct>: {{ messages | selectattr("role", "eq", "system") | map(attribute="content") | first \
| default("Given a web search query, retrieve relevant passages that answer the query") }}
<Query>: {{ messages | selectattr("role", "eq", "query") | map(attribute="content") | first }}
<Document>: {{ messages | selectattr("role", "eq", "document") | map(attribute="content") \
| first }}<|im_end|>
<|im_start|>assistant
<think>

</think>

"""


def write_chat_tokenizer(directory: Path, max_length: int) -> int:
    """A Qwen-style tokenizer.json (no special tokens added around a text; the chat markers are
    special tokens) over VOCAB plus "yes" and "no", and tokenizer_config.json with its max
    length; the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = [*dict.fromkeys(VOCAB), "yes", "no", *CHAT_TOKENS]
    tokenizer = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    specials = [*CHAT_TOKENS, "[PAD]"]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]",
              "model_max_length": max_length}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return len(tokens)


def qwen3_reranker(
    directory: Path, head: str = "ForCausalLM", max_length: int = 240, seed: int = 7
):
    """A Qwen3 reranker as sentence-transformers saves one: a causal LM scored by LogitScore
    ("yes" minus "no", as Qwen/Qwen3-Reranker-*), or a one-label ForSequenceClassification (its
    seq-cls form); the chat template in chat_template.jinja. The CrossEncoder that saved it
    (the reference) and the directory."""
    from sentence_transformers import CrossEncoder

    raw = directory.parent / f"{directory.name}-raw"
    raw.mkdir(parents=True)
    vocab = write_chat_tokenizer(raw, max_length)
    labels = {"id2label": {0: "LABEL_0"}, "label2id": {"LABEL_0": 0}} if "Sequence" in head else {}
    model = build("qwen3", head, seed=seed, vocab_size=vocab, max_position_embeddings=256, **labels)
    model.save_pretrained(raw, safe_serialization=True)
    (raw / "chat_template.jinja").write_text(RERANK_TEMPLATE)
    CrossEncoder(str(raw)).save(str(directory))
    return CrossEncoder(str(directory)), directory
