// The mid-batch quantized GEMM in CUDA C++ (quant_gemm_cuda.py compiles it with NVRTC): out = x @ W.T for a
// q8_0 (FMT 0) or q4_1 / q4_K (FMT 1: q4_1's planes) weight in fragment-order planes (quant_pack.py), 16-128 tokens
// a token tile, on Hopper's wgmma.
//
// A CTA is WG consumer warpgroups and PRODUCERS producer warps. The producers stream each stage's weight rows (qs
// and d planes, as they are) and x (the token tile's image, laid out as wgmma reads it: quant_gemm_cuda.x_image)
// into a ring of S shared-memory stages with cp.async.bulk, counted by the stage's `full` mbarrier; producer p
// fills stages p, p + PRODUCERS, ... (a warp's copies go out one after another: more warps, more in flight).
// Consumer warp w of warpgroup g reads its 16-row tiles' bytes of each chunk back with one 16-byte shared load a
// lane (the fragment order is the wgmma A fragment), dequantizes them in registers (quant_gemv.ASM_Q8's
// instructions) and issues the chunk's wgmmas; once they retired, each warp arrives on the stage's `empty`
// mbarrier on its own (count: every consumer warp). No CTA barrier runs in the main loop.
//
// Compiled with: BN (token tile), RB (64-row blocks per warpgroup), WG (consumer warpgroups), PRODUCERS, CH
// (32-column chunks per stage), S (stages), SPLIT (K splits, reduced in split order by the last CTA of a tile),
// ACT (0: store the rows, 1: SiLU(gate) * up, 2: GELU-tanh(gate) * up of rows interleaved 8 by 8), OUT (0 f32,
// 1 f16, 2 bf16), PDL (launched as a programmatic dependent), LAG (a stage's MMAs in flight while the next is
// dequantized),
// PROBE (a diagnostic, bench/gemm_cuda.py --probe: 1 skips the MMAs, 2 the dequantization, 3 both), MINB (CTAs an
// SM for the register budget), WREG (the weights loaded from global memory straight into registers, 1 or 2 stages
// ahead: the ring carries x only), L2PF (with WREG: the quant bytes L2PF stages further ahead prefetched into
// L2), and the host's pieces: wgmma_bn() (the wgmma of BN tokens), the GEMV's dequantization PTX
// (ASM_DEQUANT_Q8, ASM_DEQUANT_Q4) and the helpers shared with mla_decode_cuda.cu (cuda_common.cuh).

#if FMT                                      // q4_1 and q4_K (q4_1's planes): 64 columns a chunk, two 32-blocks
#define BLOCKS 2
#define SIDE 128                             // a tile's chunk of sides: 8 groups x (d, m) x 2 blocks x 2 rows
typedef uint4 side_t;
#else                                        // q8_0: 32 columns a chunk, an f16 scale a row
#define BLOCKS 1
#define SIDE 32
typedef u32 side_t;
#endif
#define CONSUMERS (WG * 128)
#define THREADS (CONSUMERS + 32 * PRODUCERS)
#define TILES (WG * RB * 4)                 // 16-row tiles of a CTA
#define ROWS (TILES * 16)
#if WREG                                     // the weights go from global memory straight into registers
#define QS_BYTES 0
#define D_BYTES 0
#else
#define QS_BYTES (TILES * CH * 512)          // a stage's quant bytes: [tile][chunk][512]
#define D_BYTES (TILES * CH * SIDE)          // its scales: [tile][chunk][SIDE]
#endif
#define X_CHUNK_BYTES (BN * 64)              // one chunk of the x image: BN tokens x 32 f16
#define X_BYTES (CH * BLOCKS * X_CHUNK_BYTES)
#define STAGE_BYTES (QS_BYTES + D_BYTES + X_BYTES)
#define NACC (BN / 2)                        // accumulators a thread holds per 64-row block

// One word of a 4-bit chunk (q4_1's planes: q4_1 and q4_K) -> the operands of its low block (the low nibbles) and
// its high block (the high nibbles, used in place as 16 q: their scales come in divided by 16), rows g and g + 8:
// each nibble under 0x64 (1024 + q as f16), minus 1024 exactly, times d plus m: quant_gemv.ASM_NIB_AFFINE, which
// the host defines as ASM_DEQUANT_Q4.
static __device__ __forceinline__ void dequant_q4(u32 word, const u32 (&sc)[8], u32& lo_g, u32& lo_g8, u32& hi_g,
                                                  u32& hi_g8) {
    asm(ASM_DEQUANT_Q4
        : "=r"(lo_g), "=r"(lo_g8), "=r"(hi_g), "=r"(hi_g8)
        : "r"(word), "r"(sc[0]), "r"(sc[1]), "r"(sc[2]), "r"(sc[3]), "r"(sc[4]), "r"(sc[5]), "r"(sc[6]), "r"(sc[7]));
}

// A chunk of one 16-row tile -> the wgmma A operands of its BLOCKS 32-column blocks (per block: k16 half h in
// registers 4 h .. 4 h + 3: rows g, g + 8 of the words 2 h and 2 h + 1)
static __device__ __forceinline__ void dequant_chunk(const uint4 q, const side_t sc, u32 (&a)[BLOCKS][8]) {
#if FMT
    // the lane group's (d, m) x (low, high block) x (row g, g + 8): the high block's d divided by 16 (exact)
    u32 d_hi16;
    asm("{\n .reg .b32 k;\n mov.b32 k, 0x2C002C00;\n mul.rn.f16x2 %0, %1, k;\n}" : "=r"(d_hi16) : "r"(sc.y));
    const u32 f[8] = {broadcast_lo(sc.x), broadcast_hi(sc.x), broadcast_lo(d_hi16), broadcast_hi(d_hi16),
                      broadcast_lo(sc.z), broadcast_hi(sc.z), broadcast_lo(sc.w), broadcast_hi(sc.w)};
    dequant_q4(q.x, f, a[0][0], a[0][1], a[1][0], a[1][1]);
    dequant_q4(q.y, f, a[0][2], a[0][3], a[1][2], a[1][3]);
    dequant_q4(q.z, f, a[0][4], a[0][5], a[1][4], a[1][5]);
    dequant_q4(q.w, f, a[0][6], a[0][7], a[1][6], a[1][7]);
#else
    const u32 s_g = broadcast_lo(sc), s_g8 = broadcast_hi(sc);
    dequant_q8(q.x, s_g, s_g8, a[0][0], a[0][1]);
    dequant_q8(q.y, s_g, s_g8, a[0][2], a[0][3]);
    dequant_q8(q.z, s_g, s_g8, a[0][4], a[0][5]);
    dequant_q8(q.w, s_g, s_g8, a[0][6], a[0][7]);
#endif
}

static __device__ __forceinline__ u32 first_word(const side_t sc) {
#if FMT
    return sc.x;
#else
    return sc;
#endif
}

static __device__ __forceinline__ side_t lds_side(u32 addr) {
#if FMT
    return lds128(addr);
#else
    return lds32(addr);
#endif
}

// x's image: a no-swizzle K-major B image of the token tile's BN tokens
static __device__ __forceinline__ u64 b_descriptor(u32 addr) { return no_swizzle_b_descriptor(addr, BN); }

static __device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

#if OUT == 0
typedef float out_t;
static __device__ __forceinline__ out_t to_out(float v) { return v; }
static __device__ __forceinline__ float rounded(float v) { return v; }
#elif OUT == 1
typedef u16 out_t;
static __device__ __forceinline__ out_t to_out(float v) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
static __device__ __forceinline__ float rounded(float v) { return f16_to_f32(to_out(v)); }
#else
typedef u16 out_t;
static __device__ __forceinline__ out_t to_out(float v) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
static __device__ __forceinline__ float rounded(float v) { return __uint_as_float(((u32)to_out(v)) << 16); }
#endif

// act(gate) * up, each rounded to the output type first, as activation._gated_mul_kernel computes it
static __device__ __forceinline__ float gated(float gate, float up) {
    float g = rounded(gate), u = rounded(up), z;
#if ACT == 2
    z = 1.5957691216057308f * (g + 0.044715f * g * g * g);
#else
    z = g;
#endif
    return g * (1.0f / (1.0f + __expf(-z))) * u;
}

// Store a thread's sums: row (of the CTA's) r0 + 8 e for e = 0, 1 and tokens t0 + 8 j + {0, 1}, as the wgmma
// accumulator holds them (acc[4 j + 2 e + i]: row r0 + 8 e, token t0 + 8 j + i).
static __device__ __forceinline__ void store_rows(const float* acc, out_t* out, int out_stride, int row,
                                                  int tok0, int n_rows, int n_tok) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int t = tok0 + 8 * j + i;
            if (t >= n_tok) continue;
#if ACT == 0
            if (row < n_rows) out[(u64)t * out_stride + row] = to_out(acc[4 * j + i]);
            if (row + 8 < n_rows) out[(u64)t * out_stride + row + 8] = to_out(acc[4 * j + 2 + i]);
#else
            const int col = (row / 16) * 8 + row % 16;      // row: the tile's gate row g, row + 8 its up row
            if (col < n_rows / 2) out[(u64)t * out_stride + col] = to_out(gated(acc[4 * j + i], acc[4 * j + 2 + i]));
#endif
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
quant_gemm(const unsigned char* __restrict__ qs, const unsigned char* __restrict__ d,
              const unsigned char* __restrict__ x_image, out_t* __restrict__ out, float* __restrict__ partial,
              int* __restrict__ count, int n_tok, int n_rows, int out_stride, int n_chunks, int row_blocks) {
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 base = smem_u32(smem);
    const u32 bars = base + S * STAGE_BYTES;               // full[S], empty[S], then the split-K flag
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int tok_tile = blockIdx.x, row_block = blockIdx.y / SPLIT, split = blockIdx.y % SPLIT;
    const int n_stages = n_chunks / SPLIT / CH;
    const int chunk_first = split * n_stages * CH;
    const int tile0 = row_block * TILES;

    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(bars + 8 * s, 1);
            mbar_init(bars + 8 * (S + s), WG * 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

    if (warp >= WG * 4) {                                  // a producer warp: stages p, p + PRODUCERS, ...
        const int producer = warp - WG * 4;
        const u64 tile_bytes = (u64)n_chunks * 512, side_bytes = (u64)n_chunks * SIDE;
        const unsigned char* x_tile = x_image + (u64)tok_tile * n_chunks * BLOCKS * X_CHUNK_BYTES;
        // a stage's weights: lane t < TILES copies 16-row tile t's CH chunks of qs and of d; the bytes of the whole
        // stage, x's included, are expected on its barrier first
        auto copy_stage_weights = [&](u32 stage, u32 bar, int chunk0) {
            if (lane == 0) mbar_expect(bar, STAGE_BYTES);
            __syncwarp();
            if (!WREG && lane < TILES) {
                bulk_copy(stage + lane * CH * 512, qs + (tile0 + lane) * tile_bytes + chunk0 * 512, CH * 512, bar);
                bulk_copy(stage + QS_BYTES + lane * CH * SIDE, d + (tile0 + lane) * side_bytes + chunk0 * SIDE,
                          CH * SIDE, bar);
            }
        };
        int ahead = 0;
#if PDL
        // weights are never written: the first stages' copies start while the kernel before finishes
        ahead = n_stages < S ? n_stages : S;
        for (int s = producer; s < ahead; s += PRODUCERS)
            copy_stage_weights(base + s * STAGE_BYTES, bars + 8 * s, chunk_first + s * CH);
        asm volatile("griddepcontrol.wait;" ::: "memory");
        if (lane == 0)
            for (int s = producer; s < ahead; s += PRODUCERS)
                bulk_copy(base + s * STAGE_BYTES + QS_BYTES + D_BYTES,
                          x_tile + (u64)(chunk_first + s * CH) * BLOCKS * X_CHUNK_BYTES, X_BYTES, bars + 8 * s);
#endif
        for (int s = producer; s < n_stages; s += PRODUCERS) {
            if (s < ahead) continue;
            const int slot = s % S;
            const u32 stage = base + slot * STAGE_BYTES, bar = bars + 8 * slot;
            const int chunk0 = chunk_first + s * CH;
            mbar_wait(bars + 8 * (S + slot), ((s / S) & 1) ^ 1);   // a fresh barrier's phase before 0 is complete
            copy_stage_weights(stage, bar, chunk0);
            if (lane == 0)
                bulk_copy(stage + QS_BYTES + D_BYTES, x_tile + (u64)chunk0 * BLOCKS * X_CHUNK_BYTES, X_BYTES, bar);
        }
        return;
    }

    // the consumers: warp wi of warpgroup wg owns 16-row tile (wg RB + rb) 4 + wi of each of its RB blocks
    const int wg = warp / 4, wi = warp % 4, g = lane / 4;
    float acc[RB][NACC];
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
        for (int i = 0; i < NACC; ++i) acc[rb][i] = 0.0f;

    // one stage: wait for its x, dequantize each chunk's rows (from the weights' registers cur_q / cur_d with WREG,
    // else from the stage's shared memory) and issue its MMAs; hand the stage back once they retired
    typedef uint4 quant_regs[RB][CH];
    typedef side_t scale_regs[RB][CH];
    auto consume = [&](int s, const quant_regs& cur_q, const scale_regs& cur_d) {
        const int slot = s % S;
        const u32 stage = base + slot * STAGE_BYTES;
        mbar_wait(bars + 8 * slot, (s / S) & 1);
#pragma unroll
        for (int c = 0; c < CH; ++c) {
            u32 a[RB][BLOCKS][8];
#pragma unroll
            for (int rb = 0; rb < RB; ++rb) {
#if WREG
                const uint4 q = cur_q[rb][c];
                const side_t sc = cur_d[rb][c];
#else
                const int tile = (wg * RB + rb) * 4 + wi;
                const uint4 q = lds128(stage + (tile * CH + c) * 512 + lane * 16);
                const side_t sc = lds_side(stage + QS_BYTES + (tile * CH + c) * SIDE + g * (SIDE / 8));
#endif
#if PROBE & 2      // the raw bytes as the operand: no dequantization (wrong sums)
#pragma unroll
                for (int b = 0; b < BLOCKS; ++b) {
                    a[rb][b][0] = q.x; a[rb][b][1] = q.y; a[rb][b][2] = q.z; a[rb][b][3] = q.w;
                    a[rb][b][4] = q.x ^ b; a[rb][b][5] = q.y; a[rb][b][6] = q.z; a[rb][b][7] = q.w ^ first_word(sc);
                }
#else
                dequant_chunk(q, sc, a[rb]);
#endif
            }
            const u32 xs = stage + QS_BYTES + D_BYTES + c * BLOCKS * X_CHUNK_BYTES;
#if PROBE & 1      // no MMA: the operands folded into one accumulator, so that nothing before is dead code
#pragma unroll
            for (int rb = 0; rb < RB; ++rb)
#pragma unroll
                for (int b = 0; b < BLOCKS; ++b)
                    acc[rb][0] += __uint_as_float((a[rb][b][0] ^ a[rb][b][1] ^ a[rb][b][2] ^ a[rb][b][3] ^ a[rb][b][4]
                                                   ^ a[rb][b][5] ^ a[rb][b][6] ^ a[rb][b][7] ^ xs) & 0x3FFFFFFF);
#else
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int rb = 0; rb < RB; ++rb) {
#pragma unroll
                for (int b = 0; b < BLOCKS; ++b) {
                    // k16 half h: the block's words 2 h (columns 2c, 2c + 1) and 2 h + 1 (+ 8), rows g and g + 8
                    const u32 xb = xs + b * X_CHUNK_BYTES;
                    wgmma_bn(acc[rb], a[rb][b][0], a[rb][b][1], a[rb][b][2], a[rb][b][3], b_descriptor(xb));
                    wgmma_bn(acc[rb], a[rb][b][4], a[rb][b][5], a[rb][b][6], a[rb][b][7],
                             b_descriptor(xb + 2 * BN * 16));
                }
            }
#endif
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        }
#if LAG
        // retire the stage before, whose MMAs ran while this one was dequantized; this one's stay in flight
        asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(CH) : "memory");
        __syncwarp();
        if (lane == 0 && s > 0) mbar_arrive(bars + 8 * (S + (s + S - 1) % S));
#else
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        __syncwarp();
        if (lane == 0) mbar_arrive(bars + 8 * (S + slot));
#endif
    };
#if WREG
    // the weights: each lane's 16 quant bytes and its rows' scales of every chunk, loaded into registers WREG stages
    // before they are used, in WREG + 1 sets of registers that the stages take in turn (a stage's loads land in the
    // set it will read, so no move waits for them)
    const u64 tile_bytes = (u64)n_chunks * 512, side_bytes = (u64)n_chunks * SIDE;
    auto load_stage = [&](int s, quant_regs& q, scale_regs& sc) {
#pragma unroll
        for (int rb = 0; rb < RB; ++rb) {
            const int tile = tile0 + (wg * RB + rb) * 4 + wi;
#pragma unroll
            for (int c = 0; c < CH; ++c) {
                const int chunk = chunk_first + s * CH + c;
                q[rb][c] = ldg128(qs + tile * tile_bytes + chunk * 512 + lane * 16);
#if FMT
                sc[rb][c] = ldg128(d + tile * side_bytes + chunk * SIDE + g * 16);
#else
                sc[rb][c] = ldg32(d + tile * side_bytes + chunk * SIDE + g * 4);
#endif
            }
        }
    };
    // with L2PF, stage s + WREG + L2PF's quant bytes are asked of L2 too: bytes in flight that hold no register
    auto prefetch_stage = [&](int s) {
#pragma unroll
        for (int rb = 0; rb < RB; ++rb) {
            const int tile = tile0 + (wg * RB + rb) * 4 + wi;
#pragma unroll
            for (int c = 0; c < CH; ++c) {
                const unsigned char* p = qs + tile * tile_bytes + (chunk_first + s * CH + c) * 512 + lane * 16;
                asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
            }
        }
    };
    quant_regs buf_q[WREG + 1];
    scale_regs buf_d[WREG + 1];
#pragma unroll
    for (int i = WREG; i < WREG + L2PF; ++i)
        if (i < n_stages) prefetch_stage(i);
#pragma unroll
    for (int i = 0; i < WREG; ++i)
        if (i < n_stages) load_stage(i, buf_q[i], buf_d[i]);
    for (int s0 = 0; s0 < n_stages; s0 += WREG + 1) {
#pragma unroll
        for (int u = 0; u <= WREG; ++u) {
            const int s = s0 + u;
            if (s >= n_stages) break;
            const int ahead = (u + WREG) % (WREG + 1);      // the set stage s + WREG reads
            if (L2PF && s + WREG + L2PF < n_stages) prefetch_stage(s + WREG + L2PF);
            if (s + WREG < n_stages) load_stage(s + WREG, buf_q[ahead], buf_d[ahead]);
            consume(s, buf_q[u], buf_d[u]);
        }
    }
#else
    quant_regs no_q;
    scale_regs no_d;
#if LAG
#pragma unroll 2
#endif
    for (int s = 0; s < n_stages; ++s) consume(s, no_q, no_d);
#endif
#if LAG
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif

#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");      // stores after the kernel before's reads and writes
#endif
    const int tok0 = tok_tile * BN + 2 * (lane % 4);
    if (SPLIT == 1) {
#pragma unroll
        for (int rb = 0; rb < RB; ++rb) {
            const int row = row_block * ROWS + ((wg * RB + rb) * 4 + wi) * 16 + g;
            store_rows(acc[rb], out, out_stride, row, tok0, n_rows, n_tok);
        }
        return;
    }
    // split K: each CTA stores its partial sums (thread-major: every CTA of the tile lays them out alike), and the
    // last of the tile's SPLIT CTAs adds them in split order, so a row's bits do not depend on which came last
    const int tile = tok_tile * row_blocks + row_block;
    float* mine = partial + ((u64)tile * SPLIT + split) * (ROWS * BN);
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
        for (int i = 0; i < NACC; ++i) mine[(rb * NACC + i) * CONSUMERS + threadIdx.x] = acc[rb][i];
    __threadfence();
    asm volatile("bar.sync 1, %0;" :: "n"(CONSUMERS) : "memory");
    volatile int* flag = (volatile int*)(smem + S * STAGE_BYTES + 16 * S);
    if (threadIdx.x == 0) {
        const int arrived = atomicAdd(count + tile, 1);
        *flag = arrived == SPLIT - 1;
    }
    asm volatile("bar.sync 1, %0;" :: "n"(CONSUMERS) : "memory");
    if (!*flag) return;
    __threadfence();
    const float* all = partial + (u64)tile * SPLIT * (ROWS * BN);
#pragma unroll
    for (int rb = 0; rb < RB; ++rb) {
#pragma unroll
        for (int i = 0; i < NACC; ++i) {
            float v = 0.0f;
            for (int k = 0; k < SPLIT; ++k)
                v += ld_cg(all + (u64)k * (ROWS * BN) + (rb * NACC + i) * CONSUMERS + threadIdx.x);
            acc[rb][i] = v;
        }
        const int row = row_block * ROWS + ((wg * RB + rb) * 4 + wi) * 16 + g;
        store_rows(acc[rb], out, out_stride, row, tok0, n_rows, n_tok);
    }
    if (threadIdx.x == 0) count[tile] = 0;
}
