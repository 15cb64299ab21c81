"""PNG pictures for the debug endpoints: attention heatmaps per head and head-importance bars.

matplotlib (Agg, object API, no pyplot state) is an optional extra: `pip install
'mha-serve[debug]'`. Figures have a fixed geometry so the image size follows from the grid:
width = cols * panel + COLORBAR_PX, height = rows * panel + HEADER_PX, where panel is PANEL_PX,
or larger with token labels on the axes (panel_px).
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from service.pipeline.errors import ServiceError

DPI = 100
PANEL_PX = 240  # one heatmap cell of the grid, square
COLORBAR_PX = 90
HEADER_PX = 60
MAX_COLS_ONE_LAYER = 4  # one layer's heads wrap onto rows of at most this many
MASK_RGB = (204, 204, 204)  # padded (masked) keys: a grey the viridis map never produces
TOKEN_PX = 12  # with token labels: pixels per token on each axis (readable up to ~64 tokens)
LABEL_PX = 78  # with token labels: room for them left of and below each panel
LABEL_CHARS = 12  # longer token labels are cut, ending in "…"
SPECIAL_COLOR = "tab:red"  # special tokens ([CLS], [SEP], ...) on the axes
MAX_LABELLED_TOKENS = 64  # longer sequences get position ticks; the JSON answer has the tokens
MAX_PIXELS = 25_000_000  # a token-labelled grid larger than this is refused before drawing


class PlottingUnavailable(ServiceError):
    """PNG asked for but matplotlib is not installed (501)."""

    status = 501
    reason = "unavailable"


def _matplotlib() -> tuple[Any, Any, Any]:
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlottingUnavailable(
            "format=png needs matplotlib: pip install 'mha-serve[debug]'; "
            "JSON and binary tensors work without it"
        ) from None
    return matplotlib, Figure, FigureCanvasAgg


def grid_shape(num_layers: int, num_heads: int) -> tuple[int, int]:
    """(rows, cols) of the heatmap grid: one row per layer, or one layer's heads wrapped."""
    if num_layers > 1:
        return num_layers, num_heads
    cols = min(num_heads, MAX_COLS_ONE_LAYER)
    return math.ceil(num_heads / cols), cols


def labels_tokens(seq_len: int, has_tokens: bool) -> bool:
    """Whether the axes name the tokens: only up to MAX_LABELLED_TOKENS, where they stay legible."""
    return has_tokens and seq_len <= MAX_LABELLED_TOKENS


def panel_px(seq_len: int, labelled: bool) -> int:
    """Side of one grid cell: fixed, or growing with the tokens when they label the axes."""
    return max(PANEL_PX, LABEL_PX + 24 + TOKEN_PX * seq_len) if labelled else PANEL_PX


def labelled_size(num_layers: int, num_heads: int, seq_len: int) -> tuple[int, int]:
    """(width, height) of the grid attention_png draws for `seq_len` tokens; ValueError over
    MAX_PIXELS, so a caller can refuse the request before any drawing."""
    rows, cols = grid_shape(num_layers, num_heads)
    width, height = image_size(rows, cols, panel_px(seq_len, labels_tokens(seq_len, True)))
    if width * height > MAX_PIXELS:
        raise ValueError(
            f"a token-labelled heatmap of {num_layers} layer(s) x {num_heads} head(s) at "
            f"{seq_len} tokens would be {width}x{height} pixels, over {MAX_PIXELS // 10**6} Mpx"
        )
    return width, height


def image_size(rows: int, cols: int, panel: int = PANEL_PX) -> tuple[int, int]:
    """(width, height) in pixels of a heatmap grid."""
    return cols * panel + COLORBAR_PX, rows * panel + HEADER_PX


def _label(token: str) -> str:
    return token if len(token) <= LABEL_CHARS else token[: LABEL_CHARS - 1] + "…"


def _token_ticks(ax: Any, tokens: list[str], special: np.ndarray | None) -> None:
    """Every position labelled with its token on both axes; special tokens in colour."""
    ticks = np.arange(len(tokens))
    labels = [_label(t) for t in tokens]
    ax.set_xticks(ticks, labels, rotation=90, fontsize=7)
    ax.set_yticks(ticks, labels, fontsize=7)
    if special is not None:
        for axis_labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            for text, is_special in zip(axis_labels, special, strict=True):
                if is_special:
                    text.set_color(SPECIAL_COLOR)
                    text.set_fontweight("bold")


def _png(fig: Any, canvas_cls: Any) -> bytes:
    buffer = io.BytesIO()
    canvas_cls(fig).print_png(buffer)
    return buffer.getvalue()


def attention_png(
    weights: np.ndarray,
    layer_ids: list[int],
    *,
    averaged: bool,
    key_padding_mask: np.ndarray | None,
    causal: bool,
    title: str,
    tokens: list[str] | None = None,
    special: np.ndarray | None = None,
) -> bytes:
    """A grid of heatmaps of one sequence's weights (L, H, T, S): query rows, key columns,
    one shared colour bar; padded keys (key_padding_mask True) drawn grey. With `tokens`
    (self-attention over text, T == S) both axes name them and `special` ones are coloured."""
    matplotlib, Figure, FigureCanvasAgg = _matplotlib()
    num_layers, num_heads, tgt_len, src_len = weights.shape
    if tokens is not None and not len(tokens) == tgt_len == src_len:
        raise ValueError(f"{len(tokens)} tokens for weights of shape {weights.shape}")
    labelled = labels_tokens(tgt_len, tokens is not None)
    rows, cols = grid_shape(num_layers, num_heads)
    panel = panel_px(tgt_len, labelled)
    width, height = image_size(rows, cols, panel)
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad=np.array(MASK_RGB) / 255)
    vmax = max(float(weights.max()), 1e-6)
    masked_cols = np.zeros(src_len, bool)  # add_bias_kv / add_zero_attn keys stay unmasked
    if key_padding_mask is not None:
        masked_cols[: key_padding_mask.shape[0]] = key_padding_mask

    # Panel boxes in figure fractions; each PANEL_PX cell keeps room for ticks and a title.
    left, bottom, right, top = (LABEL_PX, LABEL_PX, 10, 24) if labelled else (46, 34, 10, 24)
    image = None
    for index in range(num_layers * num_heads):
        layer, head = divmod(index, num_heads)
        row, col = divmod(index, cols)
        x0 = col * panel + left
        y0 = height - HEADER_PX - (row + 1) * panel + bottom
        ax = fig.add_axes(
            (
                x0 / width,
                y0 / height,
                (panel - left - right) / width,
                (panel - bottom - top) / height,
            )
        )
        shown = np.ma.masked_array(
            weights[layer, head], np.broadcast_to(masked_cols, (tgt_len, src_len))
        )  # (T, S)
        image = ax.imshow(
            shown, cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest"
        )
        name = "mean over heads" if averaged else f"head {head}"
        if num_layers > 1 or layer_ids != [0]:
            name = f"layer {layer_ids[layer]}, {name}"
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        if labelled:
            _token_ticks(ax, tokens, special)
        ax.set_xlabel("key", fontsize=8, labelpad=1)
        ax.set_ylabel("query", fontsize=8, labelpad=1)

    cax = fig.add_axes(
        (
            (cols * panel + 14) / width,
            bottom / height,
            18 / width,
            (height - HEADER_PX - bottom - top) / height,
        )
    )
    bar = fig.colorbar(image, cax=cax)
    bar.ax.tick_params(labelsize=7)
    bar.set_label("attention weight", fontsize=8)
    notes = f"T={tgt_len}, S={src_len}{', causal' if causal else ''}"
    if masked_cols.any():
        notes += "; grey = padded keys"
    if labelled and special is not None and special.any():
        notes += "; red = special tokens"
    elif tokens is not None and not labelled:
        notes += f"; over {MAX_LABELLED_TOKENS} tokens: positions, not tokens, on the axes"
    fig.text(0.5, 1 - 8 / height, title, ha="center", va="top", fontsize=10)
    fig.text(0.5, 1 - 30 / height, notes, ha="center", va="top", fontsize=8, color="0.3")
    return _png(fig, FigureCanvasAgg)


def heads_png(report: list[dict[str, Any]], title: str) -> bytes:
    """Per layer: a bar chart of each head's share of out_proj, beside the head correlation."""
    _, Figure, FigureCanvasAgg = _matplotlib()
    num_heads = report[0]["num_heads"]
    bars_in = max(3.5, 0.45 * num_heads + 1.2)
    fig = Figure(figsize=(bars_in + 3.2, 2.6 * len(report) + 0.5), dpi=DPI, layout="constrained")
    fig.suptitle(title, fontsize=10)
    axes = fig.subplots(len(report), 2, squeeze=False, width_ratios=(bars_in, 3.2))
    for (bars, corr), layer in zip(axes, report, strict=True):
        heads = np.arange(layer["num_heads"])
        bars.bar(heads, np.asarray(layer["head_share"]) * 100, color="tab:blue")
        bars.axhline(100 / layer["num_heads"], color="0.4", linestyle="--", linewidth=0.8)
        bars.set_xticks(heads)
        bars.set_xlabel("head", fontsize=8)
        bars.set_ylabel("share of ‖W^O‖ (%)", fontsize=8)
        bars.set_title(f"layer {layer['layer']}: head share (dashed: uniform)", fontsize=9)
        image = corr.imshow(
            np.asarray(layer["correlation"]), cmap="coolwarm", vmin=-1, vmax=1, aspect="equal"
        )
        corr.set_title("head correlation", fontsize=9)
        corr.set_xticks(heads)
        corr.set_yticks(heads)
        fig.colorbar(image, ax=corr, shrink=0.8)
        for ax in (bars, corr):
            ax.tick_params(labelsize=7)
    return _png(fig, FigureCanvasAgg)
