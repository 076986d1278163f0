// MLA decode attention (DeepSeek's absorbed form) in CUDA C++, compiled by NVRTC (mla_decode_cuda.py): the split
// kernel of mla_attention.mla_decode_attention, with the same split plan, partials and reduce kernel.
//
// A CTA is one consumer warpgroup and PRODUCERS producer warps, for HB (16) query heads of one row over its chunk of
// the context. The producers copy the chunk's cached rows, 16 at a time (a segment: one cache block holds whole
// segments; producer p takes segments p, p + PRODUCERS, ...), into a ring of SEGS segment slots with cp.async.bulk,
// one copy a row (a lane's copies of one instruction issue one after another), so that each row lands 16 bytes
// further along the banks than the one before (PITCH) and the ldmatrix reads below are conflict-free. It looks
// segments up in the block table 32 at a time, and, as a programmatic dependent, copies every segment before it
// waits for the kernel before, but the one holding the step's new row (EARLY).
//
// The consumers take 64 cached rows (4 segments) a tile, with the rows as wgmma's M side:
//   scores^T [64 rows, 16 heads] = rows [64, LAT + ROPE] x Q^T: A from registers (ldmatrix of warp w's segment),
//     B the queries' image in shared memory (written once per CTA);
//   online softmax over the rows (a head's max across the warpgroup through shared memory), p written as the
//     B image of the second product;
//   out^T [LAT, 16 heads] += rows^T [LAT, 64 rows] x p^T: A from registers (ldmatrix.trans of each segment), LAT / 64
//     m64 tiles, the accumulator 64 floats a thread.
// A segment slot goes back to the producer once both products that read it retired (an arrive per consumer warp).
//
// An fp8 (e4m3) cache (FP8) keeps its rows at half the pitch and widens them to f16 on their way from shared memory
// into the A registers, beside f16 queries: one cvt.rn.f16x2.e4m3x2 per two values, or, for the output's product
// with OUT_BITS, bit moves on the integer pipe (e4m3x2_bits: the values times 2^-8, undone in the stored output; on
// the scores' product they made ptxas serialize the wgmmas). Both products' ldmatrix move 16-bit units of two e4m3
// bytes, so each product takes its K or M side in another order, which changes no sum's terms:
//   scores: a thread's unit pair (bytes 4c..4c+3 of a row's 16-byte chunk) is the A fragment's K slots 2c, 2c + 1,
//     2c + 8, 2c + 9 of that k-step, and the queries' image holds each chunk's values in that order (to_operand);
//   output: ldmatrix.trans gives a thread one unit (dims 2g, 2g + 1) of cached rows 2c and 2c + 1, paired by dim, so
//     the fragment's M rows g and g + 8 are the warp's dims 2g and 2g + 1 (the store follows).
// Rows past the chunk's end are masked: their scores to -inf, their values to zero in the registers (a slot may hold
// anything there). A split's (max, sum, acc) is stored at its end, as the Triton kernel stores it, or, with one
// split (SINGLE), the row's output.
//
// Compiled with: LAT, ROPE (the latent and rope widths, multiples of 64), BLOCK (the cache's rows a
// block, a multiple of 16), SEGS (the ring's segment slots), SINGLE, BF16 (1: bf16 queries and output, 0: f16), FP8
// (1: an e4m3 cache, 0: the queries' dtype), OUT_BITS, PDL,
// EARLY, MIN_SPLIT (DecodeConfig.min_split), MINB (CTAs an SM: the register budget), PRODUCERS (warps).

#if SEGS < 4
#error "the ring holds a whole tile: 4 segments at least"
#endif
#if FP8 && LAT % 128
#error "an fp8 cache's output product takes its m64 tiles in pairs"
#endif
#if OUT_BITS && !FP8
#error "OUT_BITS widens e4m3 rows"
#endif
#define HB 16                                 // query heads a CTA: wgmma's N
#define TILE 64                               // cached rows a tile: wgmma's M
#define WIDTH (LAT + ROPE)
#define KSTEPS (WIDTH / 16)
#define ELEM (FP8 ? 1 : 2)                     // a cached value's bytes
#define ROW_BYTES (WIDTH * ELEM)
#define PITCH (ROW_BYTES + 16)                // an odd multiple of 16 bytes mod 128: conflict-free ldmatrix
#define SEG_BYTES (16 * PITCH)
#define Q_BYTES (HB * WIDTH * 2)
#define P_BYTES (HB * TILE * 2)
#define MT (LAT / 64)                         // the output's m64 tiles
#define Q_OFF (SEGS * SEG_BYTES)
#define P_OFF (Q_OFF + Q_BYTES)
#define RED_OFF (P_OFF + P_BYTES)             // [2][4 warps][HB] maxima, then [4 warps][HB] sums
#define BAR_OFF (RED_OFF + 3 * 4 * HB * 4)
#define SMEM_BYTES (BAR_OFF + 16 * SEGS)
#define THREADS (128 + 32 * PRODUCERS)
#define AVB (MINB == 1 ? 2 : 1)   // the output's operand buffers: two where one CTA an SM has the registers
#define NEG_INF __int_as_float(0xff800000)

#if BF16
#define CVT_OUT "cvt.rn.bf16.f32"
#else
#define CVT_OUT "cvt.rn.f16.f32"
#endif
#if BF16 && !FP8
#define WGMMA_TYPES "bf16.bf16"
#define CVT_OPERAND "cvt.rn.bf16.f32"
#else
#define WGMMA_TYPES "f16.f16"
#define CVT_OPERAND "cvt.rn.f16.f32"
#endif

static __device__ __forceinline__ u16 to_half(float v) {          // the output's dtype
    u16 h;
    asm(CVT_OUT " %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

static __device__ __forceinline__ u16 to_operand_half(float v) {  // the wgmmas' (f16 with an fp8 cache)
    u16 h;
    asm(CVT_OPERAND " %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

// four e4m3 bytes -> two f16x2: bytes 0, 1 into lo, 2, 3 into hi (the low byte into the low half)
static __device__ __forceinline__ void e4m3x4_to_f16(u32 w, u32& lo, u32& hi) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi) : "r"(w));
}

// two e4m3 bytes, spread to bits 8-15 and 24-31 (the rest zero), -> f16x2 by bit moves: each byte's sign to the
// f16's sign, its exponent and mantissa one bit lower, under f16's exponent field. f16's exponent bias is 8 more than
// e4m3's, so each half reads as the value times 2^-8, exactly, subnormals included (e4m3's NaN bytes read as +-1.875:
// only rows past a chunk's end hold them, and those are masked)
static __device__ __forceinline__ u32 e4m3x2_bits(u32 spread) {
    return (spread & 0x80008000u) | ((spread >> 1) & 0x3F803F80u);
}

static __device__ __forceinline__ u32 prmt(u32 a, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(a), "r"(sel));
    return r;
}

// one word (two 16-bit values) of the queries' image: values of a 16-value chunk whose words are w[0..7]; with an fp8
// cache the image's K order is the scores' (the header): its even 8 values are the chunk's words 0, 2, 4, 6 and its
// odd 8 the words 1, 3, 5, 7, widened bf16 -> f16 where the queries are bf16
static __device__ __forceinline__ u32 to_operand(u32 pair) {
#if FP8 && BF16
    const float lo = __uint_as_float(pair << 16), hi = __uint_as_float(pair & 0xFFFF0000u);
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return pair;
#endif
}

static __device__ __forceinline__ void ldsm_x4(u32 addr, u32 (&a)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}

static __device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32 (&a)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}

// the queries' and p's images: no-swizzle K-major B images of the 16 heads
static __device__ __forceinline__ u64 b_descriptor(u32 addr) { return no_swizzle_b_descriptor(addr, HB); }

// d[8] += A (registers) x B (descriptor), m64 n16 k16: d[4 j + 2 e + i] is row g + 8 e of the warp's 16, column
// 8 j + 2 (lane % 4) + i
static __device__ __forceinline__ void wgmma16(float (&d)[8], const u32 (&a)[4], u64 desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
                 " wgmma.mma_async.sync.aligned.m64n16k16.f32." WGMMA_TYPES
                 " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

static __device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> static __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
static __device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

static __device__ __forceinline__ float warp_max_over_rows(float v) {     // over the lanes of one lane % 4
    v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFF, v, 4));
    v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFF, v, 8));
    return fmaxf(v, __shfl_xor_sync(0xFFFFFFFF, v, 16));
}

static __device__ __forceinline__ float warp_sum_over_rows(float v) {
    v += __shfl_xor_sync(0xFFFFFFFF, v, 4);
    v += __shfl_xor_sync(0xFFFFFFFF, v, 8);
    return v + __shfl_xor_sync(0xFFFFFFFF, v, 16);
}

// tile t of a program's chunk [start, end): its first row, rows, segments, and whether a split ends with it
struct TileSpan {
    int t, tile0, rows, segs;
    bool split_end;
};

static __device__ __forceinline__ TileSpan tile_span(int t, int start, int end, int split_len) {
    TileSpan span;
    span.t = t;
    span.tile0 = start + TILE * t;
    span.rows = min(TILE, end - span.tile0);
    span.segs = (span.rows + 15) / 16;
    span.split_end = (span.tile0 + TILE) % split_len == 0 || span.tile0 + TILE >= end;
    return span;
}

// A consumer thread's heads: (j, i) at h = 2 j + i is head 8 j + 2 c + i of the CTA's 16 (c = lane % 4).
static __device__ __forceinline__ int head_of(int h, int lane) { return 8 * (h / 2) + 2 * (lane % 4) + h % 2; }

// each warp's values of its lanes' heads into buf [4 warps][HB] (the lanes of g = 0 hold them), for every consumer
// thread to read after the warpgroup's barrier
static __device__ __forceinline__ void publish(float* buf, const float (&v)[4], int warp, int lane) {
    if (lane / 4 == 0)
#pragma unroll
        for (int h = 0; h < 4; ++h) buf[warp * HB + head_of(h, lane)] = v[h];
    consumers_sync();
}

// scores^T of the tile: warp w's segment as A, 4 k-steps a group, groups double-buffered in registers
static __device__ __forceinline__ void scores_tile(float (&s)[8], u32 base, u32 q_img, u32 full, const TileSpan& span,
                                                   int warp, int lane) {
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] = 0.0f;
    const bool have = warp < span.segs;
    const int my_seg = 4 * span.t + warp;
    if (have) mbar_wait(full + 8 * (my_seg % SEGS), (my_seg / SEGS) & 1);
    const u32 rows_addr = base + (my_seg % SEGS) * SEG_BYTES + (lane % 16) * PITCH + (lane / 16) * 16;
    u32 a[2][4][4];
#pragma unroll
    for (int grp = 0; grp < KSTEPS / 4; ++grp) {
        u32 (&ag)[4][4] = a[grp & 1];
#if FP8
        // two k-steps an ldmatrix: units of rows g and g + 8 in each of two 16-byte chunks
#pragma unroll
        for (int k = 0; k < 4; k += 2) {
            u32 r[4] = {0, 0, 0, 0};
            if (have) ldsm_x4(rows_addr + (grp * 2 + k / 2) * 32, r);
#pragma unroll
            for (int i = 0; i < 4; ++i)          // r[i]: row g (i even) or g + 8, k-step k + i / 2
                e4m3x4_to_f16(r[i], ag[k + i / 2][i % 2], ag[k + i / 2][i % 2 + 2]);
        }
#else
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (have) ldsm_x4(rows_addr + (grp * 4 + k) * 32, ag[k]);
            else ag[k][0] = ag[k][1] = ag[k][2] = ag[k][3] = 0;
        }
#endif
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) wgmma16(s, ag[k], b_descriptor(q_img + (grp * 4 + k) * 512));
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
}

// online softmax, first half: the scores scaled (rows past the tile's end -inf), each head's max over the tile across
// the warpgroup (through `red`, double-buffered by tile), the new running max m and the old one's rescale alpha
static __device__ __forceinline__ void tile_max(float (&s)[8], float (&m)[4], float (&alpha)[4], float* red,
                                                const TileSpan& span, int warp, int lane, float qk_scale) {
    const int g = lane / 4;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const bool valid = 16 * warp + g + 8 * e < span.rows;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float& v = s[4 * j + 2 * e + i];
                v = valid ? v * qk_scale : NEG_INF;
            }
    }
    float tmax[4];
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        const int j = h / 2, i = h % 2;
        tmax[h] = warp_max_over_rows(fmaxf(s[4 * j + i], s[4 * j + 2 + i]));
    }
    float* red_max = red + (span.t & 1) * 4 * HB;
    publish(red_max, tmax, warp, lane);
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        const int head = head_of(h, lane);
        const float mx = fmaxf(fmaxf(red_max[head], red_max[HB + head]),
                               fmaxf(red_max[2 * HB + head], red_max[3 * HB + head]));
        const float m_new = fmaxf(m[h], mx);           // finite: a tile holds at least one row
        alpha[h] = exp2f(m[h] - m_new);
        m[h] = m_new;
    }
}

// online softmax, second half: p into the B image of the output's product (at p_img), and the running sums
static __device__ __forceinline__ void write_p(const float (&s)[8], const float (&m)[4], float (&l)[4],
                                               const float (&alpha)[4], unsigned char* p_img, int warp, int lane) {
    const int g = lane / 4, c = lane % 4;
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        const int j = h / 2, i = h % 2;
        float sum = 0.0f;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float p = exp2f(s[4 * j + 2 * e + i] - m[h]);
            sum += p;
            // p^T image: row k = 16 w + g + 8 e (K), head 8 j + 2 c + i (N)
            const int k = 16 * warp + g + 8 * e;
            *(u16*)(p_img + (k / 8) * 256 + j * 128 + (2 * c + i) * 16 + (k % 8) * 2) = to_operand_half(p);
        }
        l[h] = l[h] * alpha[h] + sum;
    }
}

static __device__ __forceinline__ void rescale(float (&o)[MT][8], const float (&alpha)[4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int k = 0; k < 8; ++k) o[mt][k] *= alpha[(k / 4) * 2 + k % 2];
}

// out^T += rows^T x p^T, a segment (16 rows of K) at a time (with two operand buffers the next segment's operands
// load while the MMAs of one run); rows past the end are zeros. Then the tile's segments go back to the producer.
static __device__ __forceinline__ void output_tile(float (&o)[MT][8], u32 base, u32 p_img, u32 full,
                                                   const TileSpan& span, int warp, int lane) {
    const int c = lane % 4;
    u32 av[AVB][MT][4];
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
        if (kt >= span.segs) break;
        const int seg = 4 * span.t + kt;
        mbar_wait(full + 8 * (seg % SEGS), (seg / SEGS) & 1);    // landed (another warp's segment)
        const int seg_rows = min(16, span.rows - 16 * kt);
        const u32 keep_lo = (2 * c < seg_rows ? 0xFFFFu : 0u) | (2 * c + 1 < seg_rows ? 0xFFFF0000u : 0u);
        const u32 keep_hi = (2 * c + 8 < seg_rows ? 0xFFFFu : 0u) | (2 * c + 9 < seg_rows ? 0xFFFF0000u : 0u);
        u32 (&ak)[MT][4] = av[kt % AVB];
#if FP8
        // two m64 tiles an ldmatrix: the warp's 16 dims of rows 0-7 and 8-15 in each; (row 2c, row 2c + 1) of
        // dim 2g is the fragment's row g, of dim 2g + 1 its row g + 8
        const u32 v_addr = base + (seg % SEGS) * SEG_BYTES + (lane % 8 + ((lane / 8) & 1) * 8) * PITCH
                           + (lane / 16) * 64 + warp * 16;
#pragma unroll
        for (int mt = 0; mt < MT; mt += 2) {
            u32 r[4];
            ldsm_x4_trans(v_addr + mt * 64, r);
#pragma unroll
            for (int i = 0; i < 4; ++i) {        // r[i]: rows 0-7 (i even) or 8-15, m64 tile mt + i / 2
                u32 (&dst)[4] = ak[mt + i / 2];
                const int j = 2 * (i % 2);      // the fragment's K slots 2c, 2c + 1 or 2c + 8, 2c + 9
#if OUT_BITS
                dst[j] = e4m3x2_bits(prmt(r[i], 0x2404));           // dim 2g of rows 2c, 2c + 1
                dst[j + 1] = e4m3x2_bits(prmt(r[i], 0x3414));       // dim 2g + 1
#else
                e4m3x4_to_f16(prmt(r[i], 0x3120), dst[j], dst[j + 1]);
#endif
            }
        }
#else
        const u32 v_addr = base + (seg % SEGS) * SEG_BYTES + ((lane / 16) * 8 + lane % 8) * PITCH
                           + ((lane / 8) & 1) * 16 + warp * 32;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldsm_x4_trans(v_addr + mt * 128, ak[mt]);
#endif
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            ak[mt][0] &= keep_lo; ak[mt][1] &= keep_lo; ak[mt][2] &= keep_hi; ak[mt][3] &= keep_hi;
        }
        wgmma_fence();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) wgmma16(o[mt], ak[mt], b_descriptor(p_img + kt * 512));
        wgmma_commit();
        wgmma_wait<AVB - 1>();
    }
    wgmma_wait<0>();
}

static __device__ __forceinline__ void release_tile(u32 empty, const TileSpan& span, int lane) {
    __syncwarp();
    if (lane == 0)
        for (int kt = 0; kt < span.segs; ++kt) mbar_arrive(empty + 8 * ((4 * span.t + kt) % SEGS));
}

// a split's sum of each head over the warpgroup's rows (through `red`)
static __device__ __forceinline__ void split_sums(const float (&l)[4], float (&lsum)[4], float* red, int warp,
                                                  int lane) {
    float* red_sum = red + 2 * 4 * HB;
#pragma unroll
    for (int h = 0; h < 4; ++h) lsum[h] = warp_sum_over_rows(l[h]);
    publish(red_sum, lsum, warp, lane);
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        const int head = head_of(h, lane);
        lsum[h] = red_sum[head] + red_sum[HB + head] + red_sum[2 * HB + head] + red_sum[3 * HB + head];
    }
    consumers_sync();                               // red_sum is read before the next split writes it
}

// a split's (max, sum) for the reduce kernel (with one split, nothing: the output is stored whole)
static __device__ __forceinline__ void store_ml(const float (&m)[4], const float (&lsum)[4], float* part_ml, int seq,
                                                int head0, int n_heads, int num_splits, int split, int warp,
                                                int lane) {
#if !SINGLE
    if (warp == 0 && lane / 4 == 0)
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const int head = head0 + head_of(h, lane);
            if (head >= n_heads) continue;
            const long long part = ((long long)seq * n_heads + head) * num_splits + split;
            part_ml[part * 2] = m[h];
            part_ml[part * 2 + 1] = lsum[h];
        }
#endif
}

// a split's accumulator for the reduce kernel, or with one split the row's output (divided by the sums)
static __device__ __forceinline__ void store_o(const float (&o)[MT][8], const float (&lsum)[4], u16* out,
                                               float* part_acc, long long out_row_stride, long long out_head_stride,
                                               int seq, int head0, int n_heads, int num_splits, int split, int warp,
                                               int lane) {
    const int g = lane / 4;
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        const int head = head0 + head_of(h, lane);
        if (head >= n_heads) continue;
#if SINGLE
        const float inv = 1.0f / (lsum[h] > 0.0f ? lsum[h] : 1.0f);
        u16* row = out + seq * out_row_stride + head * out_head_stride;
#else
        const long long part = ((long long)seq * n_heads + head) * num_splits + split;
#endif
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int dim = 64 * mt + 16 * warp + (FP8 ? 2 * g + e : g + 8 * e);
                const float v = o[mt][(h / 2) * 4 + 2 * e + h % 2] * (OUT_BITS ? 256.0f : 1.0f);
#if SINGLE
                row[dim] = to_half(v * inv);
#else
                part_acc[part * LAT + dim] = v;
#endif
            }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
mla_decode(const u16* __restrict__ q, const u16* __restrict__ q_rope, const unsigned char* __restrict__ cache,
           const int* __restrict__ block_tables, const int* __restrict__ seq_lens, u16* __restrict__ out,
           float* __restrict__ part_acc, float* __restrict__ part_ml,
           long long q_row_stride, long long q_head_stride, long long qr_row_stride, long long qr_head_stride,
           long long bt_stride, long long cache_block_stride, long long out_row_stride, long long out_head_stride,
           int n_heads, int num_splits, float qk_scale) {
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 base = smem_u32(smem);
    const u32 full = base + BAR_OFF, empty = full + 8 * SEGS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int seq = blockIdx.y, head0 = blockIdx.x * HB;

    // the program's chunk of the row's splits (attention._program_chunk with 64-row tiles)
    const int seq_len = seq_lens[seq];
    const int per = max((seq_len + num_splits - 1) / num_splits, MIN_SPLIT);
    const int split_len = (per + TILE - 1) / TILE * TILE;
    const int row_splits = (seq_len + split_len - 1) / split_len;
    const int splits_per_program = (row_splits + gridDim.z - 1) / gridDim.z;
    const int start = blockIdx.z * splits_per_program * split_len;
    const int end = min(seq_len, start + splits_per_program * split_len);
    const int n_seg = end > start ? (end - start + 15) / 16 : 0;

    if (threadIdx.x == 0) {
        for (int s = 0; s < SEGS; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 4);                   // the warps of the output's product
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp >= 4) {                                       // the producer warps
        const int producer = warp - 4;
        const int* bt_row = block_tables + seq * bt_stride;
        bool waited = !(PDL && EARLY);
#if PDL && !EARLY
        asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
        for (int sg0 = producer; sg0 < n_seg; sg0 += 32 * PRODUCERS) {
            const int mine = sg0 + lane * PRODUCERS;        // this warp's segments sg0, sg0 + PRODUCERS, ...
            const int block = mine < n_seg ? bt_row[(start + 16 * mine) / BLOCK] : 0;
            for (int i = 0; i < 32 && sg0 + i * PRODUCERS < n_seg; ++i) {
                const int sg = sg0 + i * PRODUCERS, slot = sg % SEGS;
                const long long blk = __shfl_sync(0xFFFFFFFF, block, i);
                const int t0 = start + 16 * sg, rows = min(16, end - t0);
                if (!waited && t0 + rows == seq_len) {     // the step's new row: written by the kernels before
                    asm volatile("griddepcontrol.wait;" ::: "memory");
                    waited = true;
                }
                mbar_wait(empty + 8 * slot, ((sg / SEGS) & 1) ^ 1);   // a fresh barrier's phase before 0 is complete
                if (lane == 0) mbar_expect(full + 8 * slot, rows * ROW_BYTES);
                __syncwarp();
                if (lane < rows)
                    bulk_copy(base + slot * SEG_BYTES + lane * PITCH,
                              cache + (blk * cache_block_stride + (long long)(t0 % BLOCK + lane) * WIDTH) * ELEM,
                              ROW_BYTES,
                              full + 8 * slot);
            }
        }
        return;
    }

    // the consumers: warp w takes segment 4 t + w of tile t in the scores' product and dims 16 w.. of each m64 tile
    // in the output's; its lane holds (wgmma's accumulators) rows g, g + 8 and heads head_of(h, lane)
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");     // the queries come from the kernels before
#endif
    const u32 q_img = base + Q_OFF, p_img = base + P_OFF;
    float* red = (float*)(smem + RED_OFF);
    const int n_tiles = (n_seg + 3) / 4;
    // the queries' image: for 8 values kc of K and head h, 16 bytes at kc 256 + (h / 8) 128 + (h % 8) 16
    for (int idx = threadIdx.x; idx < HB * WIDTH / 8; idx += 128) {
        const int kc = idx / HB, h = idx % HB, head = head0 + h;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (head < n_heads) {
            const u16* src = kc < LAT / 8 ? q + seq * q_row_stride + head * q_head_stride + 8 * kc
                                          : q_rope + seq * qr_row_stride + head * qr_head_stride + 8 * (kc - LAT / 8);
#if FP8
            const u32* words = (const u32*)(src - 8 * (kc & 1));    // the 16-value chunk
            const int odd = kc & 1;
            v = make_uint4(to_operand(words[odd]), to_operand(words[2 + odd]), to_operand(words[4 + odd]),
                           to_operand(words[6 + odd]));
#else
            v = *(const uint4*)src;
#endif
        }
        *(uint4*)(smem + Q_OFF + kc * 256 + (h / 8) * 128 + (h % 8) * 16) = v;
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // the wgmmas read it through the async proxy
    consumers_sync();

    float m[4], l[4], o[MT][8];                             // per head (j, i) at 2 j + i
#pragma unroll
    for (int h = 0; h < 4; ++h) m[h] = NEG_INF, l[h] = 0.0f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int k = 0; k < 8; ++k) o[mt][k] = 0.0f;
    for (int t = 0; t < n_tiles; ++t) {
        const TileSpan span = tile_span(t, start, end, split_len);
        float s[8], alpha[4];
        scores_tile(s, base, q_img, full, span, warp, lane);
        tile_max(s, m, alpha, red, span, warp, lane, qk_scale);
        write_p(s, m, l, alpha, smem + P_OFF, warp, lane);
        rescale(o, alpha);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        consumers_sync();
        output_tile(o, base, p_img, full, span, warp, lane);
        release_tile(empty, span, lane);
        // the end of a split: its partial (or, with one split, the row's output), then the next split from scratch
        if (span.split_end) {
            float lsum[4];
            split_sums(l, lsum, red, warp, lane);
            store_ml(m, lsum, part_ml, seq, head0, n_heads, num_splits, span.tile0 / split_len, warp, lane);
            store_o(o, lsum, out, part_acc, out_row_stride, out_head_stride, seq, head0, n_heads, num_splits,
                    span.tile0 / split_len, warp, lane);
#pragma unroll
            for (int h = 0; h < 4; ++h) m[h] = NEG_INF;  // the next tile's alpha clears l and the accumulator
        }
    }
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#if SINGLE
    if (n_tiles == 0) {                                    // an empty row (a padded slot): zeros, as the reference
        for (int idx = threadIdx.x; idx < HB * LAT; idx += 128) {
            const int head = head0 + idx / LAT;
            if (head < n_heads) out[seq * out_row_stride + head * out_head_stride + idx % LAT] = 0;
        }
    }
#endif
}
