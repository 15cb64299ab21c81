/* Attention over packed variable-length sequences on the CPU, in one call per layer
   (mha_engine/cpu_varlen.py compiles this at first use and calls it).

   One task is one (sequence, head): it reads that head's rows of Q, K and V straight from
   the packed projections (cu_seqlens boundaries, no gathers, no padding), computes
   softmax(Q K^T * scale) V in float32 and writes the merged-heads rows of the output.
   Every task runs the same code whatever else is in the batch and whichever thread runs it,
   so a sequence's numbers never depend on its batch-mates (bit-exact batch invariance).
   Tasks are spread over OpenMP threads (the same libgomp as torch's, so the same thread
   pool) in ranges the caller balances; without OpenMP they run one after another.

   Vectors are GCC vector extensions (16 floats): the compiler maps them to AVX-512, AVX2 or
   SSE for the CPU it builds for. Inputs and outputs are float32 or bfloat16 (read as float32,
   written rounded to nearest even); all arithmetic is float32. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define VL 16
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

/* horizontal max and sum: halve the vector four times */
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
static inline float hmax(vf v) {
  v = vmax(v, __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  v = vmax(v, __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
  v = vmax(v, __builtin_shuffle(v, (vi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
  v = vmax(v, __builtin_shuffle(v, (vi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0}));
  return v[0];
}
static inline float hsum(vf v) {
  v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
  v += __builtin_shuffle(v, (vi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
  return v[0];
}

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

/* n floats of row `row` (row stride ld elements) from a float32 or bfloat16 tensor */
static inline void read_row(const void *base, int bf16, int64_t row, int64_t ld, int64_t col, int64_t n, float *dst) {
  if (bf16) {
    const uint16_t *s = (const uint16_t *)base + row * ld + col;
    for (int64_t d = 0; d < n; ++d) dst[d] = bf16_to_f32(s[d]);
  } else {
    const float *s = (const float *)base + row * ld + col;
    for (int64_t d = 0; d < n; ++d) dst[d] = s[d]; /* short rows: a loop beats a memcpy call */
  }
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
  float *qs;  /* (T4, D) this head's queries; T4 = T rounded up to 4 (zero rows) */
  float *kt;  /* (D, Sp) keys transposed; Sp = S rounded up to VL (zero columns) */
  float *vs;  /* (S, Dp) values; Dp = D rounded up to VL (zero columns) */
  float *p;   /* (4, Sp) scores, then probabilities, of four query rows */
  float *o;   /* (4, Dp) unnormalised outputs of four query rows */
} Scratch;

/* One (sequence, head): T queries over S keys. */
static void attend(const Args *a, int64_t b, int64_t h, Scratch *w) {
  const int64_t D = a->head_dim, q0 = a->cu_q[b], k0 = a->cu_k[b];
  int64_t T, S;
  seq_lens(a, b, &T, &S);
  const int64_t Sp = round_up(S, VL), Dp = round_up(D, VL), T4 = round_up(T, 4);
  const int64_t kh = h / (a->num_heads / a->num_kv_heads); /* K/V head (GQA) */
  const int causal = a->mode[b] == 2;
  if (T == 0) return;
  float row[D > 0 ? D : 1];
  for (int64_t i = 0; i < T; ++i) read_row(a->q, a->bf16, q0 + i, a->ldq, h * D, D, w->qs + i * D);
  memset(w->qs + T * D, 0, (T4 - T) * D * sizeof(float));
  memset(w->kt, 0, D * Sp * sizeof(float));
  memset(w->vs, 0, S * Dp * sizeof(float));
  for (int64_t j = 0; j < S; ++j) {
    read_row(a->k, a->bf16, k0 + j, a->ldk, kh * D, D, row);
    for (int64_t d = 0; d < D; ++d) w->kt[d * Sp + j] = row[d];
    read_row(a->v, a->bf16, k0 + j, a->ldv, kh * D, D, w->vs + j * Dp);
  }
  for (int64_t i0 = 0; i0 < T; i0 += 4) {
    /* keys any of the four rows may see: all, or up to the last row's own (causal) */
    const int64_t keys = causal ? (i0 + 4 < S ? i0 + 4 : S) : S;
    const int64_t keys_p = round_up(keys, VL);
    const float *q = w->qs + i0 * D;
    /* scores of four rows, 2 x VL keys at a time (eight independent sums), then VL */
    int64_t jb = 0;
    for (; jb + 2 * VL <= keys_p; jb += 2 * VL) {
      vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, t0 = {0}, t1 = {0}, t2 = {0}, t3 = {0};
      for (int64_t d = 0; d < D; ++d) {
        const vf c0 = vload(w->kt + d * Sp + jb), c1 = vload(w->kt + d * Sp + jb + VL);
        const float a0 = q[d], a1 = q[D + d], a2 = q[2 * D + d], a3 = q[3 * D + d];
        s0 += a0 * c0, s1 += a1 * c0, s2 += a2 * c0, s3 += a3 * c0;
        t0 += a0 * c1, t1 += a1 * c1, t2 += a2 * c1, t3 += a3 * c1;
      }
      store_rows(w->p + jb, Sp, s0, s1, s2, s3, a->scale);
      store_rows(w->p + jb + VL, Sp, t0, t1, t2, t3, a->scale);
    }
    if (jb < keys_p) {
      vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
      for (int64_t d = 0; d < D; ++d) {
        const vf c0 = vload(w->kt + d * Sp + jb);
        s0 += q[d] * c0, s1 += q[D + d] * c0, s2 += q[2 * D + d] * c0, s3 += q[3 * D + d] * c0;
      }
      store_rows(w->p + jb, Sp, s0, s1, s2, s3, a->scale);
    }
    float inv_sum[4];
    int nan_row[4];
    for (int r = 0; r < 4; ++r) { /* softmax of each row over the keys it sees */
      float *p = w->p + r * Sp;
      const int64_t seen = causal ? (i0 + r + 1 < S ? i0 + r + 1 : S) : S;
      for (int64_t j = seen; j < keys_p; ++j) p[j] = -INFINITY;
      vf m = vsplat(-INFINITY);
      for (int64_t j = 0; j < keys_p; j += VL) m = vmax(vload(p + j), m);
      const float row_max = hmax(m);
      vf sum = {0};
      vi nan = {0};
      for (int64_t j = 0; j < keys_p; j += VL) {
        const vf x = vload(p + j) - row_max; /* NaN: a NaN score, or an infinite max */
        nan |= (x != x);
        const vf e = vexp(x);
        vstore(p + j, e);
        sum += e;
      }
      int any_nan = 0;
      for (int l = 0; l < VL; ++l) any_nan |= nan[l] != 0;
      nan_row[r] = any_nan || row_max != row_max;
      inv_sum[r] = 1.0f / hsum(sum);
    }
    /* outputs: probabilities x values, 2 x VL columns at a time, then VL */
    const float *p = w->p;
    int64_t dc = 0;
    for (; dc + 2 * VL <= Dp; dc += 2 * VL) {
      vf o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0}, u0 = {0}, u1 = {0}, u2 = {0}, u3 = {0};
      for (int64_t j = 0; j < keys; ++j) {
        const vf v0 = vload(w->vs + j * Dp + dc), v1 = vload(w->vs + j * Dp + dc + VL);
        const float a0 = p[j], a1 = p[Sp + j], a2 = p[2 * Sp + j], a3 = p[3 * Sp + j];
        o0 += a0 * v0, o1 += a1 * v0, o2 += a2 * v0, o3 += a3 * v0;
        u0 += a0 * v1, u1 += a1 * v1, u2 += a2 * v1, u3 += a3 * v1;
      }
      store_rows(w->o + dc, Dp, o0, o1, o2, o3, 1.0f);
      store_rows(w->o + dc + VL, Dp, u0, u1, u2, u3, 1.0f);
    }
    if (dc < Dp) {
      vf o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};
      for (int64_t j = 0; j < keys; ++j) {
        const vf v0 = vload(w->vs + j * Dp + dc);
        o0 += p[j] * v0, o1 += p[Sp + j] * v0, o2 += p[2 * Sp + j] * v0, o3 += p[3 * Sp + j] * v0;
      }
      store_rows(w->o + dc, Dp, o0, o1, o2, o3, 1.0f);
    }
    for (int r = 0; r < 4 && i0 + r < T; ++r) {
      const int64_t dst = (q0 + i0 + r) * a->ldo + h * D;
      float *o = w->o + r * Dp;
      const float inv = nan_row[r] ? NAN : inv_sum[r]; /* NaN * anything: a NaN row */
      if (a->bf16) {
        uint16_t *out = (uint16_t *)a->out + dst;
        for (int64_t d = 0; d < D; ++d) out[d] = f32_to_bf16(o[d] * inv);
      } else {
        float *out = (float *)a->out + dst;
        for (int64_t d = 0; d < D; ++d) out[d] = o[d] * inv;
      }
    }
  }
}

/* Tasks [first, last) of the (sequence, head) list, sequence-major. 0, or -1 if out of memory. */
static int run_tasks(const Args *a, int64_t first, int64_t last, int64_t max_t, int64_t max_s) {
  if (first >= last) return 0;
  const int64_t D = a->head_dim, Dp = round_up(D, VL), Sp = round_up(max_s, VL);
  const int64_t floats = round_up(max_t, 4) * D + D * Sp + max_s * Dp + 4 * Sp + 4 * Dp;
  float *mem = malloc((size_t)(floats > 0 ? floats : 1) * sizeof(float));
  if (mem == NULL) return -1;
  Scratch w = {mem, 0, 0, 0, 0};
  w.kt = w.qs + round_up(max_t, 4) * D;
  w.vs = w.kt + D * Sp;
  w.p = w.vs + max_s * Dp;
  w.o = w.p + 4 * Sp;
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
   max_t / max_s: the longest query / key sequence computed here (scratch sizes).
   0, or -1 out of memory. */
int mha_varlen_attention(const void *q, int64_t ldq, const void *k, int64_t ldk, const void *v,
                         int64_t ldv, void *out, int64_t ldo, const int32_t *cu_q,
                         const int32_t *cu_k, int64_t batch, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, float scale,
                         const uint8_t *mode, int32_t bf16, int32_t threads, int64_t max_t,
                         int64_t max_s) {
  const Args a = {q, k, v, out, ldq, ldk, ldv, ldo, cu_q, cu_k, num_heads, num_kv_heads,
                  head_dim, scale, mode, bf16};
  int failed = 0;
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
      int64_t first, last;
      task_range(&a, batch, omp_get_thread_num(), omp_get_num_threads(), &first, &last);
      failed |= run_tasks(&a, first, last, max_t, max_s) != 0;
    }
    return failed ? -1 : 0;
  }
#endif
  return run_tasks(&a, 0, batch * num_heads, max_t, max_s);
}

/* 1 when built with OpenMP (the caller then asks for several threads). */
int mha_varlen_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}
