/* Attention over packed variable-length sequences on the CPU, in one call per layer
   (mha_engine/cpu_varlen.py compiles this at first use and calls it).

   One task is one (sequence, head): it reads that head's rows of Q, K and V straight from
   the packed projections (cu_seqlens boundaries, no gathers, no padding), computes
   softmax(Q K^T * scale) V in float32 and writes the merged-heads rows of the output.
   Every task runs the same code whatever else is in the batch and whichever thread runs it,
   so a sequence's numbers never depend on its batch-mates (bit-exact batch invariance).
   Tasks are spread over OpenMP threads (the same libgomp as torch's, so the same thread
   pool) in ranges the caller balances; without OpenMP they run one after another.

   Vectors are GCC vector extensions of the target's register width (VL floats: 16 with
   AVX-512, 8 with AVX/AVX2, 4 with SSE; wider generic vectors than the registers spill, and
   ran 12x slower in an x86-64-v3 build). Every sum runs in the same order whatever VL, so
   builds of each width give the same bits where they share FMA. Inputs and outputs are
   float32 or bfloat16 (read as float32, written rounded to nearest even); all arithmetic is
   float32. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vselect(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }
static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* exp(x) for x <= 0 (Cephes' expf polynomial, about 1e-7 relative error); x < -88, -inf
   included, gives 0. NaN stays NaN. */
static inline vf vexp(vf x) {
  const vf lo = vsplat(-88.0f);
  x = vselect(x < lo, lo, x);
  vf z = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(z, vi); /* truncates: floor for z >= 0, fixed below */
  vf nf = __builtin_convertvector(n, vf);
  n += (vi)(nf > z); /* -1 where truncation rounded up (negative z) */
  nf = __builtin_convertvector(n, vf);
  vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi bits = (n + 127) << 23; /* 2^n; n = -127 gives +0 */
  return p * (vf)bits;
}

static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if (f != f) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16); /* round to nearest even */
}

/* four rows' vectors, times `scale`, at dst, dst + ld, dst + 2 ld, dst + 3 ld */
static inline void store_rows(float *dst, int64_t ld, vf r0, vf r1, vf r2, vf r3, float scale) {
  vstore(dst, r0 * scale);
  vstore(dst + ld, r1 * scale);
  vstore(dst + 2 * ld, r2 * scale);
  vstore(dst + 3 * ld, r3 * scale);
}

/* n floats of row `row` (row stride ld elements) from a float32 or bfloat16 tensor; whole
   vectors first (built with -fno-tree-loop-distribute-patterns: no memcpy call per row) */
static inline void read_row(const void *base, int bf16, int64_t row, int64_t ld, int64_t col, int64_t n, float *dst) {
  int64_t d = 0;
  if (bf16) {
    const uint16_t *s = (const uint16_t *)base + row * ld + col;
    for (; d < n; ++d) dst[d] = bf16_to_f32(s[d]);
  } else {
    const float *s = (const float *)base + row * ld + col;
    for (; d + VL <= n; d += VL) vstore(dst + d, vload(s + d));
    for (; d < n; ++d) dst[d] = s[d];
  }
}

/* Rows r and r + w (r without bit w) of a VL x VL block: their off-diagonal w-wide blocks
   swap places. Steps w = VL / 2, ..., 2, 1 transpose the block in registers. */
static inline __attribute__((always_inline)) void transpose_step(vf *m, int w) {
  vi lo, hi; /* __builtin_shuffle's indices: below VL from a, from VL on from b */
  for (int c = 0; c < VL; ++c) {
    lo[c] = c & w ? VL + c - w : c;
    hi[c] = c & w ? VL + c : c + w;
  }
  for (int r = 0; r < VL; ++r) {
    if (r & w) continue;
    const vf a = m[r], b = m[r + w];
    m[r] = __builtin_shuffle(a, b, lo);
    m[r + w] = __builtin_shuffle(a, b, hi);
  }
}

/* dst[d * ld + j] = rows[j * n + d] for VL rows j and VL columns d (rows: row-major, n wide) */
static inline __attribute__((always_inline)) void transpose_block(const float *rows, int64_t n, float *dst, int64_t ld) {
  vf m[VL];
  for (int j = 0; j < VL; ++j) m[j] = vload(rows + j * n);
  for (int w = VL / 2; w > 0; w /= 2) transpose_step(m, w);
  for (int d = 0; d < VL; ++d) vstore(dst + d * ld, m[d]);
}

typedef struct {
  const void *q, *k, *v;
  void *out;
  int64_t ldq, ldk, ldv, ldo; /* row strides, elements */
  const int32_t *cu_q, *cu_k; /* (B+1,) */
  int64_t num_heads, num_kv_heads, head_dim;
  float scale;
  const uint8_t *mode; /* (B,) per sequence: 0 left to the caller, 1 all keys, 2 causal */
  int bf16;
} Args;

/* Query and key count of sequence b; 0 and 0 where its mode is 0 (skipped). */
static inline void seq_lens(const Args *a, int64_t b, int64_t *t, int64_t *s) {
  *t = a->cu_q[b + 1] - a->cu_q[b];
  *s = a->cu_k[b + 1] - a->cu_k[b];
  if (a->mode[b] == 0) *t = *s = 0;
}

typedef struct {
  float *ks;  /* (S, D) this head's keys */
  float *vs;  /* (S, Dp) its values; Dp = D rounded up to VL (zero columns) */
  float *qb;  /* (VL, D) a block of up to VL query rows (zero rows past T) */
  float *qt;  /* (D, VL) the block transposed: one query per vector lane */
  float *p;   /* (S, VL) per key, the block's scores, then probabilities */
  float *o;   /* (4, Dp) unnormalised outputs of four query rows */
} Scratch;

/* scores of the block's queries (qt) against keys j, j + 1, ... (ks: row-major) into p, n keys
   (n independent sums) per step while n are left, each sum over d in order */
#define SCORES(n)                                                                  \
  for (; j + (n) <= keys; j += (n)) {                                              \
    const float *k = w->ks + j * D;                                                \
    vf s[n] = {{0}};                                                               \
    for (int64_t d = 0; d < D; ++d) {                                              \
      const vf c = vload(w->qt + d * VL);                                          \
      for (int u = 0; u < (n); ++u) s[u] += k[u * D + d] * c;                      \
    }                                                                              \
    for (int u = 0; u < (n); ++u) vstore(w->p + (j + u) * VL, s[u] * a->scale);   \
  }

/* One (sequence, head): T queries over S keys. Queries go VL at a time, one per vector lane,
   so the softmax over keys is lane by lane across the keys' vectors (no horizontal steps). */
static void attend(const Args *a, int64_t b, int64_t h, Scratch *w) {
  const int64_t D = a->head_dim, Dp = round_up(D, VL), q0 = a->cu_q[b], k0 = a->cu_k[b];
  int64_t T, S;
  seq_lens(a, b, &T, &S);
  const int64_t kh = h / (a->num_heads / a->num_kv_heads); /* K/V head (GQA) */
  const int causal = a->mode[b] == 2;
  if (T == 0) return;
  if (Dp != D) memset(w->vs, 0, S * Dp * sizeof(float));
  for (int64_t j = 0; j < S; ++j) {
    read_row(a->k, a->bf16, k0 + j, a->ldk, kh * D, D, w->ks + j * D);
    read_row(a->v, a->bf16, k0 + j, a->ldv, kh * D, D, w->vs + j * Dp);
  }
  vi lane;
  for (int i = 0; i < VL; ++i) lane[i] = i;
  const vf neg_inf = vsplat(-INFINITY);
  for (int64_t i0 = 0; i0 < T; i0 += VL) {
    const int64_t rows = T - i0 < VL ? T - i0 : VL;
    /* keys any row of the block may see: all, or up to its last row's own (causal) */
    const int64_t keys = causal ? (i0 + VL < S ? i0 + VL : S) : S;
    for (int64_t i = 0; i < VL; ++i) {
      if (i < rows) read_row(a->q, a->bf16, q0 + i0 + i, a->ldq, h * D, D, w->qb + i * D);
      else memset(w->qb + i * D, 0, D * sizeof(float));
    }
    if (D % VL == 0) {
      for (int64_t d = 0; d < D; d += VL) transpose_block(w->qb + d, D, w->qt + d * VL, VL);
    } else {
      for (int64_t d = 0; d < D; ++d)
        for (int64_t i = 0; i < VL; ++i) w->qt[d * VL + i] = w->qb[i * D + d];
    }
    int64_t j = 0;
    SCORES(8)
    SCORES(4)
    SCORES(1)
    /* softmax per lane: a NaN score, or an infinite max (inf - inf), gives a NaN that vexp
       keeps, so that query's sum and whole output row are NaN */
    vf m = neg_inf;
    for (j = 0; j < keys; ++j) {
      vf x = vload(w->p + j * VL);
      if (causal) { /* lane i (query i0 + i) sees keys up to its own position */
        x = vselect(lane + (int32_t)i0 >= (int32_t)j, x, neg_inf);
        vstore(w->p + j * VL, x);
      }
      m = vmax(x, m);
    }
    vf sum = {0};
    for (j = 0; j < keys; ++j) {
      const vf e = vexp(vload(w->p + j * VL) - m);
      vstore(w->p + j * VL, e);
      sum += e;
    }
    float inv[VL];
    vstore(inv, vsplat(1.0f) / sum);
    /* outputs of four rows at a time: probabilities x values, 2 x VL columns, then VL */
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const float *p = w->p + r0; /* p[j * VL + r]: row r0 + r, key j */
      int64_t dc = 0;
      for (; dc + 2 * VL <= Dp; dc += 2 * VL) {
        vf o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0}, u0 = {0}, u1 = {0}, u2 = {0}, u3 = {0};
        for (j = 0; j < keys; ++j) {
          const vf v0 = vload(w->vs + j * Dp + dc), v1 = vload(w->vs + j * Dp + dc + VL);
          const float *pj = p + j * VL;
          const float a0 = pj[0], a1 = pj[1], a2 = pj[2], a3 = pj[3];
          o0 += a0 * v0, o1 += a1 * v0, o2 += a2 * v0, o3 += a3 * v0;
          u0 += a0 * v1, u1 += a1 * v1, u2 += a2 * v1, u3 += a3 * v1;
        }
        store_rows(w->o + dc, Dp, o0, o1, o2, o3, 1.0f);
        store_rows(w->o + dc + VL, Dp, u0, u1, u2, u3, 1.0f);
      }
      if (dc < Dp) {
        vf o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};
        for (j = 0; j < keys; ++j) {
          const vf v0 = vload(w->vs + j * Dp + dc);
          const float *pj = p + j * VL;
          o0 += pj[0] * v0, o1 += pj[1] * v0, o2 += pj[2] * v0, o3 += pj[3] * v0;
        }
        store_rows(w->o + dc, Dp, o0, o1, o2, o3, 1.0f);
      }
      for (int r = 0; r < 4 && r0 + r < rows; ++r) {
        const int64_t dst = (q0 + i0 + r0 + r) * a->ldo + h * D;
        const float *o = w->o + r * Dp, scale = inv[r0 + r];
        if (a->bf16) {
          uint16_t *out = (uint16_t *)a->out + dst;
          for (int64_t d = 0; d < D; ++d) out[d] = f32_to_bf16(o[d] * scale);
        } else {
          float *out = (float *)a->out + dst;
          for (int64_t d = 0; d < D; ++d) out[d] = o[d] * scale;
        }
      }
    }
  }
}
#undef SCORES

/* Tasks [first, last) of the (sequence, head) list, sequence-major. 0, or -1 if out of memory. */
static int run_tasks(const Args *a, int64_t first, int64_t last, int64_t max_s) {
  if (first >= last) return 0;
  const int64_t D = a->head_dim, Dp = round_up(D, VL);
  const int64_t floats = max_s * D + max_s * Dp + 2 * VL * D + max_s * VL + 4 * Dp;
  float *mem = malloc((size_t)(floats > 0 ? floats : 1) * sizeof(float));
  if (mem == NULL) return -1;
  Scratch w;
  w.ks = mem;
  w.vs = w.ks + max_s * D;
  w.qb = w.vs + max_s * Dp;
  w.qt = w.qb + VL * D;
  w.p = w.qt + D * VL;
  w.o = w.p + max_s * VL;
  for (int64_t t = first; t < last; ++t) attend(a, t / a->num_heads, t % a->num_heads, &w);
  free(mem);
  return 0;
}

/* Thread n of `threads` gets the tasks [first, last) that split the work (T * S + T + S per
   task) evenly; tasks are (sequence, head) pairs, sequence-major. */
static void task_range(const Args *a, int64_t batch, int n, int threads, int64_t *first, int64_t *last) {
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t t, s;
    seq_lens(a, b, &t, &s);
    total += (t * s + t + s) * a->num_heads;
  }
  int64_t cum = 0, task = 0, bound[2] = {0, 0};
  for (int e = 0; e < 2; ++e) { /* the first task whose cumulative start reaches n / threads */
    const int64_t edge = n + e;
    for (; task < batch * a->num_heads; ++task) {
      if (cum * threads >= total * edge) break;
      int64_t t, s;
      seq_lens(a, task / a->num_heads, &t, &s);
      cum += t * s + t + s;
    }
    bound[e] = edge == threads ? batch * a->num_heads : task;
  }
  *first = n == 0 ? 0 : bound[0];
  *last = bound[1];
}

/* Attention of every (sequence, head) of `batch` sequences whose mode is not 0, over
   `threads` OpenMP threads; the rows of `out` of mode-0 sequences are not touched.
   max_s: the longest key sequence computed here (scratch sizes).
   0, or -1 out of memory. */
int mha_varlen_attention(const void *q, int64_t ldq, const void *k, int64_t ldk, const void *v,
                         int64_t ldv, void *out, int64_t ldo, const int32_t *cu_q,
                         const int32_t *cu_k, int64_t batch, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, float scale,
                         const uint8_t *mode, int32_t bf16, int32_t threads, int64_t max_s) {
  const Args a = {q, k, v, out, ldq, ldk, ldv, ldo, cu_q, cu_k, num_heads, num_kv_heads,
                  head_dim, scale, mode, bf16};
  int failed = 0;
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
      int64_t first, last;
      task_range(&a, batch, omp_get_thread_num(), omp_get_num_threads(), &first, &last);
      failed |= run_tasks(&a, first, last, max_s) != 0;
    }
    return failed ? -1 : 0;
  }
#endif
  return run_tasks(&a, 0, batch * num_heads, max_s);
}

/* 1 when built with OpenMP (the caller then asks for several threads). */
int mha_varlen_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}
