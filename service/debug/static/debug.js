// The attention debug page: plain JavaScript, no libraries, no build step.
// It calls the same JSON endpoints a script would (GET /debug/info, POST .../attention,
// GET .../heads). On load it connects without credentials; only if the server answers 401 or
// 403 does it show the credential form, and then sends what is pasted there on each call: the
// API key (if the server has --api-key) as "Authorization: Bearer", the debug token
// (--debug-token) as X-Debug-Token.
"use strict";

const $ = (id) => document.getElementById(id);

const page = {
  token: "",
  apiKey: "",
  info: null, // GET /debug/info
  heads: null, // GET /v2/models/{name}/heads
  result: null, // {layer, kind, tokens, special, weights: Float32Array (H, T, S), H, T, S}
  results: null, // decoders: {self, cross}, each like `result`; `result` is the one shown
  head: 0,
  busy: false,
};

// -- talking to the server ------------------------------------------------------------------
async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (page.apiKey) headers.Authorization = `Bearer ${page.apiKey}`;
  if (page.token) headers["X-Debug-Token"] = page.token;
  const response = await fetch(path, { ...options, headers, cache: "no-store" });
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    body = null;
  }
  if (!response.ok) {
    const why = body && body.error ? body.error : response.statusText;
    const error = new Error(`${response.status}: ${why}`);
    error.status = response.status;
    throw error;
  }
  return body;
}

function modelPath(suffix) {
  return `/v2/models/${encodeURIComponent(page.info.model_name)}/${suffix}`;
}

function output(body, name) {
  const found = body.outputs.find((o) => o.name === name);
  if (!found) throw new Error(`the answer has no output '${name}'`);
  return found;
}

// A seeded normal sample (mulberry32 + Box-Muller), so "random input, seed s" is repeatable.
function normals(count, seed) {
  let a = seed >>> 0;
  const uniform = () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const out = new Array(count);
  for (let i = 0; i < count; i += 2) {
    const r = Math.sqrt(-2 * Math.log(1 - uniform()));
    const phi = 2 * Math.PI * uniform();
    out[i] = r * Math.cos(phi);
    if (i + 1 < count) out[i + 1] = r * Math.sin(phi);
  }
  return out;
}

function requestBody(layer) {
  const info = page.info;
  const parameters = { layer };
  if (info.input === "text") {
    const text = $("text").value;
    return {
      inputs: [{ name: "text", shape: [1], datatype: "BYTES", data: [text] }],
      parameters,
    };
  }
  const length = Number.parseInt($("random-length").value, 10);
  const seed = Number.parseInt($("seed").value, 10) || 0;
  if (info.decoder_inputs) {
    // A decoder: tgt and memory (or src and tgt), PyTorch's names; causal target, and a
    // memory 4 positions longer so the cross-attention map is visibly T x S.
    const lengths = { tgt: length, memory: length + 4, src: length + 4 };
    const inputs = info.decoder_inputs.map((name, i) => ({
      name, shape: [1, lengths[name], info.embed_dim], datatype: "FP32",
      data: normals(lengths[name] * info.embed_dim, seed + i),
    }));
    return {
      inputs,
      parameters: { ...parameters, tgt_is_causal: true },
      outputs: [{ name: "attention_weights" }, { name: "cross_attention_weights" }],
    };
  }
  const inputs = [
    { name: "input", shape: [1, length, info.embed_dim], datatype: "FP32",
      data: normals(length * info.embed_dim, seed) },
  ];
  if (info.needs_key_value) {
    inputs.push({ name: "key", shape: [1, length, info.kdim], datatype: "FP32",
      data: normals(length * info.kdim, seed + 1) });
    inputs.push({ name: "value", shape: [1, length, info.vdim], datatype: "FP32",
      data: normals(length * info.vdim, seed + 2) });
  }
  return { inputs, parameters, outputs: [{ name: "attention_weights" }] };
}

// -- colours --------------------------------------------------------------------------------
const VIRIDIS = [
  [68, 1, 84], [72, 40, 120], [62, 74, 137], [49, 104, 142], [38, 130, 142],
  [31, 158, 137], [53, 183, 121], [109, 205, 89], [180, 222, 44], [253, 231, 37],
];

function colour(x) {
  const t = Math.min(1, Math.max(0, x)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(t));
  const f = t - i;
  return VIRIDIS[i].map((c, j) => Math.round(c + f * (VIRIDIS[i + 1][j] - c)));
}

function headSlice(h) {
  const { T, S, weights } = page.result;
  return weights.subarray(h * T * S, (h + 1) * T * S);
}

function maxOf(values) {
  let m = 0;
  for (const v of values) if (v > m) m = v;
  return m || 1;
}

// -- the chosen head's heatmap: a DOM grid (one element per cell, labels as text) -----------
function renderHeatmap() {
  const { tokens, special, T, S, layer } = page.result;
  const keys = page.result.keyTokens;
  const keySpecial = page.result.keySpecial;
  const h = page.head;
  const values = headSlice(h);
  const vmax = maxOf(values);
  const grid = $("heatmap");
  const cell = Math.max(8, Math.min(28, Math.floor(640 / Math.max(T, S))));
  grid.style.setProperty("--cell", `${cell}px`);
  grid.style.gridTemplateColumns = `auto repeat(${S}, ${cell}px)`;
  const parts = [];
  const corner = document.createElement("div");
  corner.className = "corner";
  corner.textContent = "q \\ k";
  parts.push(corner);
  keys.forEach((token, k) => {
    const label = document.createElement("div");
    label.className = keySpecial[k] ? "col-label special" : "col-label";
    label.dataset.k = String(k);
    label.textContent = token;
    label.title = token;
    parts.push(label);
  });
  for (let q = 0; q < T; q++) {
    const label = document.createElement("div");
    label.className = special[q] ? "row-label special" : "row-label";
    label.dataset.q = String(q);
    label.textContent = tokens[q];
    label.title = tokens[q];
    parts.push(label);
    for (let k = 0; k < S; k++) {
      const w = values[q * S + k];
      const el = document.createElement("div");
      el.className = "cell";
      el.dataset.q = String(q);
      el.dataset.k = String(k);
      el.dataset.w = w.toPrecision(6);
      const [r, g, b] = colour(w / vmax);
      el.style.background = `rgb(${r},${g},${b})`;
      parts.push(el);
    }
  }
  grid.replaceChildren(...parts);
  grid.dataset.head = String(h);
  grid.dataset.layer = String(layer);
  grid.dataset.rows = String(T);
  grid.dataset.cols = String(S);
  const what = { self: "self-attention", cross: "cross-attention (target to memory)" };
  const kind = page.info.decoder_inputs ? `, ${what[page.result.kind]}` : "";
  $("heatmap-title").textContent = `Layer ${layer}, head ${h}${kind}`;
  grid.dataset.kind = page.result.kind;
  renderLegend(vmax);
}

function renderLegend(vmax) {
  const canvas = document.createElement("canvas");
  canvas.width = 100;
  canvas.height = 1;
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(100, 1);
  for (let i = 0; i < 100; i++) {
    const [r, g, b] = colour(i / 99);
    image.data.set([r, g, b, 255], i * 4);
  }
  ctx.putImageData(image, 0, 0);
  const low = document.createElement("span");
  low.textContent = "0";
  const high = document.createElement("span");
  high.textContent = `${vmax.toFixed(3)} (this head's largest weight)`;
  $("legend").replaceChildren(low, canvas, high);
}

function showTooltip(event) {
  const target = event.target;
  const tip = $("tooltip");
  if (!target.classList || !target.classList.contains("cell")) {
    tip.hidden = true;
    return;
  }
  const q = Number(target.dataset.q);
  const k = Number(target.dataset.k);
  const { tokens, keyTokens } = page.result;
  tip.textContent =
    `query ${q}: ${tokens[q]}\nkey   ${k}: ${keyTokens[k]}\nweight ${Number(target.dataset.w).toFixed(4)}`;
  tip.hidden = false;
  tip.style.left = `${event.clientX + 14}px`;
  tip.style.top = `${event.clientY + 14}px`;
  const grid = $("heatmap");
  grid.querySelectorAll(".active").forEach((el) => el.classList.remove("active"));
  grid.querySelector(`.row-label[data-q="${q}"]`)?.classList.add("active");
  grid.querySelector(`.col-label[data-k="${k}"]`)?.classList.add("active");
}

// -- small multiples: every head of the layer, one canvas each ------------------------------
function renderHeads() {
  const { H, T, S, layer } = page.result;
  const figures = [];
  for (let h = 0; h < H; h++) {
    const values = headSlice(h);
    const vmax = maxOf(values);
    const canvas = document.createElement("canvas");
    canvas.width = S;
    canvas.height = T;
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(S, T);
    for (let i = 0; i < T * S; i++) {
      const [r, g, b] = colour(values[i] / vmax);
      image.data.set([r, g, b, 255], i * 4);
    }
    ctx.putImageData(image, 0, 0);
    const figure = document.createElement("figure");
    figure.dataset.head = String(h);
    if (h === page.head) figure.classList.add("selected");
    const caption = document.createElement("figcaption");
    caption.textContent = `head ${h}`;
    figure.append(canvas, caption);
    figure.addEventListener("click", () => selectHead(h));
    figures.push(figure);
  }
  $("heads-grid").replaceChildren(...figures);
  $("heads-title").textContent = `All ${H} heads of layer ${layer}`;
}

// -- head importance: an SVG bar chart of each head's share of W^O --------------------------
const SVG = "http://www.w3.org/2000/svg";

function svgElement(name, attributes, text) {
  const el = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) el.setAttribute(key, String(value));
  if (text !== undefined) el.textContent = text;
  return el;
}

function renderImportance() {
  if (!page.heads) return;
  const layer = Number($("layer").value) || 0;
  const report = page.heads.layers.find((l) => l.layer === layer) || page.heads.layers[0];
  const shares = report.head_share;
  const width = 640;
  const height = 200;
  const pad = { left: 44, right: 10, top: 10, bottom: 28 };
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const top = Math.max(...shares, 1 / shares.length) * 1.15;
  const svg = svgElement("svg", { viewBox: `0 0 ${width} ${height}`, width, height, role: "img" });
  svg.append(svgElement("title", {}, `Layer ${report.layer}: each head's share of W^O`));
  const step = plotW / shares.length;
  shares.forEach((share, h) => {
    const barH = (share / top) * plotH;
    const bar = svgElement("rect", {
      class: h === page.head ? "bar selected" : "bar",
      x: pad.left + h * step + step * 0.15,
      y: pad.top + plotH - barH,
      width: step * 0.7,
      height: barH,
      "data-head": h,
    });
    bar.append(svgElement("title", {}, `head ${h}: ${(share * 100).toFixed(2)}% of W^O`));
    bar.addEventListener("click", () => selectHead(h));
    svg.append(bar);
    svg.append(svgElement("text", {
      x: pad.left + (h + 0.5) * step, y: height - 10, "text-anchor": "middle",
    }, String(h)));
  });
  const uniformY = pad.top + plotH - (1 / shares.length / top) * plotH;
  svg.append(svgElement("line", {
    class: "uniform", x1: pad.left, x2: width - pad.right, y1: uniformY, y2: uniformY,
  }));
  svg.append(svgElement("line", {
    x1: pad.left, x2: pad.left, y1: pad.top, y2: pad.top + plotH, stroke: "#888",
  }));
  svg.append(svgElement("text", { x: 4, y: pad.top + 10 }, `${(top * 100).toFixed(0)}%`));
  svg.append(svgElement("text", { x: 4, y: pad.top + plotH }, "0%"));
  $("importance").replaceChildren(svg);
  $("importance-title").textContent =
    `Head importance, layer ${report.layer}: share of the output projection W^O (dashed: uniform)`;
}

// -- controls -------------------------------------------------------------------------------
function setStatus(message, isError = false) {
  $("status").textContent = message;
  $("status").classList.toggle("error", isError);
}

function fillSelect(select, count, prefix) {
  select.replaceChildren(
    ...Array.from({ length: count }, (_, i) => new Option(`${prefix} ${i}`, String(i))),
  );
}

function selectHead(h) {
  page.head = h;
  $("head").value = String(h);
  if (page.result) {
    renderHeatmap();
    document.querySelectorAll("#heads-grid figure").forEach((f) => {
      f.classList.toggle("selected", Number(f.dataset.head) === h);
    });
  }
  renderImportance();
}

// With a submit event: the credentials pasted in the form. Without (on load): none at all.
async function connect(event) {
  if (event) {
    event.preventDefault();
    page.token = $("token").value.trim();
    page.apiKey = $("api-key").value.trim();
  }
  setStatus("Connecting…");
  try {
    const info = await api("/debug/info");
    page.info = info;
    fillSelect($("layer"), info.weight_layers || info.num_layers, "layer");
    $("kind-control").hidden = !info.decoder_inputs;
    fillSelect($("head"), info.num_heads, "head");
    const text = info.input === "text";
    $("text-control").hidden = !text;
    $("tensor-control").hidden = text;
    // No max= on the field: the server checks the limit and its 400 names the flag.
    $("length-limit").textContent = `(at most ${info.max_tokens}, ${info.max_tokens_flag})`;
    $("model-line").textContent =
      `${info.model_name}: ${info.architecture}, ${info.num_layers} layer(s), ` +
      `${info.num_heads} heads, d=${info.embed_dim}; ` +
      (text ? "text input" : "hidden-state input (random)") +
      `, at most ${info.max_tokens} tokens (${info.max_tokens_flag})`;
    $("controls").hidden = false;
    page.heads = await api(modelPath("heads"));
    renderImportance();
    setStatus("Connected.");
    document.body.dataset.state = "connected";
  } catch (error) {
    if (error.status === 401 || error.status === 403) {
      $("connect-panel").hidden = false;  // the server wants credentials: ask for them
      $("model-line").textContent =
        "This server needs credentials: paste the debug token and the API key " +
        "(each blank if the server has none) and connect.";
    }
    setStatus(`Could not connect: ${error.message}`, true);
  }
}

async function run(event) {
  if (event) event.preventDefault();
  if (!page.info || page.busy) return;
  const layer = Number($("layer").value);
  page.busy = true;
  $("run").disabled = true;
  document.body.dataset.state = "loading";
  setStatus("Computing attention weights…");
  try {
    const body = await api(modelPath("attention"), {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(layer)),
    });
    const kinds = { self: output(body, "attention_weights") }; // (1, H, T, S)
    if (page.info.decoder_inputs) kinds.cross = output(body, "cross_attention_weights");
    const [, H, T] = kinds.self.shape;
    let tokens;
    let special;
    if (page.info.input === "text") {
      tokens = output(body, "tokens").data;
      special = output(body, "special_tokens_mask").data;
    } else {
      tokens = Array.from({ length: T }, (_, i) => String(i));
      special = new Array(T).fill(false);
    }
    page.results = {};
    for (const [kind, weights] of Object.entries(kinds)) {
      const S = weights.shape[3];
      page.results[kind] = {
        layer, tokens, special, H, T, S, kind,
        keyTokens: S === T ? tokens : Array.from({ length: S }, (_, i) => String(i)),
        keySpecial: S === T ? special : new Array(S).fill(false),
        weights: Float32Array.from(weights.data),
      };
    }
    page.result = page.results[$("kind").value] || page.results.self;
    page.head = Math.min(Number($("head").value) || 0, H - 1);
    $("results").hidden = false;
    renderHeatmap();
    renderHeads();
    renderImportance();
    const cut = body.parameters && body.parameters.truncated ? " (text truncated)" : "";
    setStatus(`${T} tokens, layer ${layer}${cut}.`);
    document.body.dataset.state = "ready";
  } catch (error) {
    setStatus(error.message, true);
    document.body.dataset.state = "error";
  } finally {
    page.busy = false;
    $("run").disabled = false;
  }
  if (page.result && document.body.dataset.state === "ready" &&
      Number($("layer").value) !== page.result.layer) {
    run();  // the layer picker changed while this request was running
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("connect-form").addEventListener("submit", connect);
  $("run-form").addEventListener("submit", run);
  $("layer").addEventListener("change", () => {
    renderImportance();
    if (page.result) run();  // while busy, the finished run picks the new layer up
  });
  $("head").addEventListener("change", () => selectHead(Number($("head").value)));
  $("kind").addEventListener("change", () => {
    if (!page.results) return;
    page.result = page.results[$("kind").value] || page.results.self;
    renderHeatmap();
    renderHeads();
  });
  $("heatmap").addEventListener("mousemove", showTooltip);
  $("heatmap").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  connect(null);  // no credentials needed: connected at once, no form shown
});
