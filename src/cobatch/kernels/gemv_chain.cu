// A chain of q8_0 GEMVs of up to 8 tokens in one persistent launch (gemv_chain.py compiles it with NVRTC): stage s
// computes out_s = x_s @ W_s.T, where x_s may be the output of stage s - 1. Why one launch: at few tokens a GEMV of a
// small matrix spends as long in its launch, ramp and tail as in its bytes (docs/kernels.md); here a CTA that runs
// out of one stage's work asks L2 for its first item of the next stage and waits for the stage before only then, so
// the next weights stream in while the last items of the stage before finish.
//
// Work: a stage's items are its row blocks of RT 16-row tiles, times `split` K ranges, handed out in order by an
// atomic counter to whichever CTA asks (the next index is asked for while the current item runs). The W warps of a
// CTA split the item's K range; a warp walks its chunks as the GEMV does: each lane loads its 16 fragment-order bytes
// of a chunk per tile (the mma.sync m16n8k16 A fragment of rows g, g + 8: quant_pack.fragment_order) and its rows'
// scales, dequantizes them with the GEMV's own instructions (quant_gemv.ASM_Q8, defined by the host as
// ASM_DEQUANT_Q8) and issues two k16 MMAs per tile against x's 8 tokens, one 16-byte load of 8 columns a lane (the
// planes' column order, quant_pack.k_order, makes them contiguous) for all RT tiles. Loads run one group of U chunks
// ahead, and with PF each item's weights are asked of L2 at once when it starts.
//
// Reduction: the warps' sums of a tile are added in warp order through shared memory; with split K each item then
// stores its partial sums, and the last item of a row block to arrive adds them in split order, so a row's bits do
// not depend on the batch or on which CTA came last. That item stores the rows (act: the gated epilogue of rows
// interleaved 8 by 8, as quant_gemm_cuda.cu's) and counts the row block done. A CTA reads a stage's x only once the
// stage before has counted all its row blocks done. The last CTA out sets the counters back to zero.
//
// PIPE: the next item's first load group is issued before the current item's reduction and stores (same stage).
//
// RING > 0 compiles the ring engine instead (at the end of this file): a producer warp streams every item's weights
// through shared memory, ahead of the consumers and across stages.
//
// Compiled with: W (warps a CTA; the ring engine's consumers), RT (tiles a row block), U (chunks a load group), PF,
// PIPE, RING, CH, OWN and PRODUCERS (the ring engine's slots, chunks a slot, whole slots a warp, producer warps), DT
// (x: 0 f16, 1 bf16; each stage's out has its own), MAX_STAGES, PDL, and the host's pieces: the GEMV's
// dequantization PTX (ASM_DEQUANT_Q8, ASM_DEQUANT_Q4) and the helpers shared with quant_gemm_cuda.cu
// (cuda_common.cuh).

struct Stage {
    const unsigned char* qs;     // fragment-order q8_0 planes: [tiles][n_chunks * 512]
    const unsigned char* d;      // [tiles][n_chunks * 32]: a tile's f16 scales per chunk, row r at 2 (r % 8) + r / 8
    const u16* x;                // [n_tok][x_stride]
    u16* out;                    // [n_tok][out_stride]
    float* partial;              // [row blocks * split][RT * 128], split > 1
    int* arrivals;               // [row blocks], split > 1; zero between launches
    int blocks, n_chunks, split, act, x_stride, out_stride, rows;
    int out_dt;                  // out's dtype: 0 f16, 1 bf16 (x's is DT: a stage's out read by the next is of DT)
};

struct Chain {
    Stage stage[MAX_STAGES];
    int* counters;               // [2 MAX_STAGES + 1]: items handed out, row blocks done (per stage); CTAs out
    int n_stages, n_tok;
};

static __device__ __forceinline__ uint4 ldg_cg(const void* p) {       // x: written in this launch, so from L2
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

static __device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}

// Two x values as f16x2: as they are (DT 0), or from bf16 through f32, rounded to nearest (the GEMV's conversion)
static __device__ __forceinline__ u32 x_pair(u32 v) {
#if DT
    u32 r;
    const float lo = __uint_as_float(v << 16), hi = __uint_as_float(v & 0xFFFF0000u);
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return v;
#endif
}

static __device__ __forceinline__ void mma(float (&acc)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// v in out's dtype (dt: 0 f16, 1 bf16), rounded to nearest
static __device__ __forceinline__ u16 to_out(float v, int dt) {
    u16 h;
    if (dt)
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    else
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

static __device__ __forceinline__ float rounded(float v, int dt) {
    const u16 h = to_out(v, dt);
    if (dt) return __uint_as_float(((u32)h) << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// act(gate) * up, each rounded to the output type first (activation._gated_mul_kernel's numerics)
static __device__ __forceinline__ float gated(float gate, float up, int act, int dt) {
    const float gr = rounded(gate, dt), ur = rounded(up, dt);
    const float z = act == 2 ? 1.5957691216057308f * (gr + 0.044715f * gr * gr * gr) : gr;
    return gr * (1.0f / (1.0f + __expf(-z))) * ur;
}

// Store a tile's sums: acc[i] row g, acc[2 + i] row g + 8, token 2 c + i
static __device__ __forceinline__ void store_tile(const Stage& st, int tile, int n_tok, const float* acc, int lane) {
    const int g = lane / 4, c = lane % 4;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int t = 2 * c + i;
        if (t >= n_tok) continue;
        u16* row = st.out + (u64)t * st.out_stride;
        if (st.act) {
            const int col = tile * 8 + g;                  // the tile's gate row g, up row g + 8
            if (col < st.rows / 2) row[col] = to_out(gated(acc[i], acc[2 + i], st.act, st.out_dt), st.out_dt);
        } else {
            const int r = tile * 16 + g;
            if (r < st.rows) row[r] = to_out(acc[i], st.out_dt);
            if (r + 8 < st.rows) row[r + 8] = to_out(acc[2 + i], st.out_dt);
        }
    }
}

#if !RING
// A group of U chunks' loads: each lane's 16 quant bytes and its rows' scale pair per tile, and its 8 columns of
// token g
struct Group {
    uint4 q[RT][U];
    u32 sc[RT][U];
    uint4 xv[U];
};

static __device__ __forceinline__ void load_group(Group& grp, const unsigned char* qs, const unsigned char* d,
                                                  u64 tile_qs, u64 tile_d, const u16* x, bool token_live) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            grp.q[r][u] = ldg128(qs + r * tile_qs + u * 512);
            grp.sc[r][u] = ldg32(d + r * tile_d + u * 32);
        }
        grp.xv[u] = token_live ? ldg_cg(x + u * 32) : make_uint4(0, 0, 0, 0);
    }
}

static __device__ __forceinline__ void mma_group(float (&acc)[RT][4], const Group& grp) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const u32 b0 = x_pair(grp.xv[u].x), b1 = x_pair(grp.xv[u].y), b2 = x_pair(grp.xv[u].z),
                  b3 = x_pair(grp.xv[u].w);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            u32 a[8];
            dequant_q8_chunk(grp.q[r][u], grp.sc[r][u], a);
            // k16 half h: words 2 h, 2 h + 1 of the weights; x elements 4 h .. 4 h + 3 (GGUF columns 8 c + 4 h ..)
            mma(acc[r], a[0], a[1], a[2], a[3], b0, b1);
            mma(acc[r], a[4], a[5], a[6], a[7], b2, b3);
        }
    }
}

// The next item of stage s for this CTA (thread 0 asks; the others read it after a barrier)
static __device__ __forceinline__ int grab(int* handed, int s) {
    return atomicAdd(handed + s, 1);
}

extern "C" __global__ void __launch_bounds__(W * 32) gemv_chain(const Chain chain) {
    __shared__ float red[W][RT * 128];                  // the warps' sums of the item, for the reduction
    __shared__ int shared_item, shared_last;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    int* handed = chain.counters;
    int* done = chain.counters + MAX_STAGES;
    int* ctas_out = chain.counters + 2 * MAX_STAGES;
    const bool token_live = g < chain.n_tok;
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");     // the first stage's x, and the counters
#endif
    for (int s = 0; s < chain.n_stages; ++s) {
        const Stage& st = chain.stage[s];
        const int items = st.blocks * st.split, per_item = st.n_chunks / st.split, per_warp = per_item / W;
        const u64 tile_qs = (u64)st.n_chunks * 512, tile_d = (u64)st.n_chunks * 32;
        if (threadIdx.x == 0) shared_item = grab(handed, s);
        __syncthreads();
        int item = shared_item;
        bool ready = s == 0;
        // with PIPE, the next item's first load group is issued before this item's reduction, into `a`
        Group a, b;
        bool preloaded = false;
        while (item < items) {
            __syncthreads();                                // every thread has read shared_item
            int next = 0;
            if (threadIdx.x == 0) next = grab(handed, s);   // asked now, read at the item's end
            const int block = item / st.split, k = item % st.split, chunk0 = k * per_item;
            const unsigned char* qs = st.qs + block * RT * tile_qs + (u64)chunk0 * 512;
            const unsigned char* d = st.d + block * RT * tile_d + (u64)chunk0 * 32;
            if (threadIdx.x == 0 && (PF || !ready)) {
                // the weights depend on nothing: ask L2 for the item's at once, before any wait for the stage before
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    prefetch_l2(qs + r * tile_qs, per_item * 512);
                    prefetch_l2(d + r * tile_d, per_item * 32);
                }
            }
            if (!ready) {
                if (threadIdx.x == 0) {
                    const int want = chain.stage[s - 1].blocks;
                    while (ld_acquire(done + s - 1) < want) {
                    }
                }
                __syncthreads();
                ready = true;
            }
            const int wchunk = warp * per_warp;
            const unsigned char* wq = qs + (u64)wchunk * 512 + lane * 16;
            const unsigned char* wd = d + (u64)wchunk * 32 + g * 4;
            const u16* x = st.x + (u64)g * st.x_stride + (chunk0 + wchunk) * 32 + c * 8;
            float acc[RT][4];
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[r][i] = 0.0f;
            if (!preloaded) load_group(a, wq, wd, tile_qs, tile_d, x, token_live);
            for (int c0 = 0; c0 < per_warp; c0 += 2 * U) {
                if (c0 + U < per_warp)
                    load_group(b, wq + (c0 + U) * 512, wd + (c0 + U) * 32, tile_qs, tile_d, x + (c0 + U) * 32,
                               token_live);
                mma_group(acc, a);
                if (c0 + 2 * U < per_warp)
                    load_group(a, wq + (c0 + 2 * U) * 512, wd + (c0 + 2 * U) * 32, tile_qs, tile_d,
                               x + (c0 + 2 * U) * 32, token_live);
                if (c0 + U < per_warp) mma_group(acc, b);
            }
            // the warps' sums, added in warp order: warp r (and r + W ...) reduces tile r
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int i = 0; i < 4; ++i) red[warp][r * 128 + lane * 4 + i] = acc[r][i];
            if (PIPE && threadIdx.x == 0) shared_item = next;
            __syncthreads();
            preloaded = false;
            if (PIPE) {
                // the next item's weights and x need no wait (same stage): its first group streams in while this
                // item is reduced and stored
                const int nitem = shared_item;
                if (nitem < items) {
                    const int nblock = nitem / st.split, nchunk0 = nitem % st.split * per_item + wchunk;
                    load_group(a, st.qs + nblock * RT * tile_qs + (u64)nchunk0 * 512 + lane * 16,
                               st.d + nblock * RT * tile_d + (u64)nchunk0 * 32 + g * 4, tile_qs, tile_d,
                               st.x + (u64)g * st.x_stride + nchunk0 * 32 + c * 8, token_live);
                    preloaded = true;
                }
            }
            float sum[RT][4];
#pragma unroll
            for (int r = 0; r < RT; ++r) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float v = 0.0f;
                    if (r % W == warp)
#pragma unroll
                        for (int w = 0; w < W; ++w) v += red[w][r * 128 + lane * 4 + i];
                    sum[r][i] = v;
                }
            }
            bool store = true;
            if (st.split > 1) {
                // the item's partial sums, then the last item of the row block adds all of them in split order
                float* mine = st.partial + (u64)item * (RT * 128);
#pragma unroll
                for (int r = 0; r < RT; ++r)
                    if (r % W == warp)
#pragma unroll
                        for (int i = 0; i < 4; ++i) mine[r * 128 + lane * 4 + i] = sum[r][i];
                __threadfence();
                __syncthreads();
                if (threadIdx.x == 0) shared_last = atomicAdd(st.arrivals + block, 1) == st.split - 1;
                __syncthreads();
                store = shared_last;
                if (store) {
                    __threadfence();
                    const float* all = st.partial + (u64)block * st.split * (RT * 128);
#pragma unroll
                    for (int r = 0; r < RT; ++r) {
                        if (r % W != warp) continue;
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            float v = 0.0f;
                            for (int j = 0; j < st.split; ++j)
                                v += ld_cg(all + (u64)j * (RT * 128) + r * 128 + lane * 4 + i);
                            sum[r][i] = v;
                        }
                    }
                    if (threadIdx.x == 0) st.arrivals[block] = 0;
                }
            }
            if (store) {
#pragma unroll
                for (int r = 0; r < RT; ++r)
                    if (r % W == warp) store_tile(st, block * RT + r, chain.n_tok, sum[r], lane);
                __threadfence();
                __syncthreads();
                if (threadIdx.x == 0) atomicAdd(done + s, 1);
            }
            if (!PIPE && threadIdx.x == 0) shared_item = next;
            __syncthreads();
            item = shared_item;
        }
    }
    // the last CTA out re-arms the counters: every other CTA is past its last read of them
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(ctas_out, 1) == gridDim.x - 1) {
            for (int i = 0; i < 2 * MAX_STAGES; ++i) chain.counters[i] = 0;
            __threadfence();
            *ctas_out = 0;
        }
    }
}
#endif

#if RING
// The ring engine (RING > 0): a producer warp streams the weights through a ring of RING shared-memory slots of CH
// chunks, and the W consumer warps multiply out of it. Why: the engine above runs each item's latency chain in series
// (its handout, its loads, the CTA's reduction, the done count), and its bytes in flight are what its warps' registers
// hold. Here the schedule is static (no handout), a row block is one item with all of its K (no partial sums), and the
// producer never waits for a stage before: the weights depend on nothing, so it runs up to RING slots ahead across
// items and stages, and the next matrix's bytes stream in while the consumers finish this one, reduce, store, or wait
// for the stage before. With OWN a warp takes whole slots (slot k of an item to warp k % W): each warp then has W
// slots' time to bring in its next slot's x from L2, where splitting every slot's chunks leaves one slot's time.
//
// Item i of a stage goes to CTA (i + first) % grid, first the items of the stages before: the CTAs that took fewer
// items of one stage take the first of the next. Consumer warp w takes chunks w CH / W .. (w + 1) CH / W - 1 of each
// slot (one 16-byte shared load a lane and tile, and its rows' scales: the GEMV's fragment order), x from L2 (the
// stage before wrote it in this launch), one slot's x loaded ahead; the warps' sums are added in warp order, so a
// row's bits depend on W, CH and OWN only. A slot is handed back (its `empty` barrier, count W, 1 with OWN) once each
// warp that reads it has.
// ACC > 1 spreads a warp's MMAs of a row tile over that many accumulators (MMA m of a slot to m % ACC), so their
// latencies overlap where one accumulator makes every MMA wait for the one before; the bits then depend on ACC too.
// PRODUCERS warps may share the copies (producer p fills slots p, p + PRODUCERS, ...: one warp's bulk copies go out
// one after another).

#if FMT             // q4_1's planes (q4_1 and q4_K): 64 columns a chunk, two 32-blocks
#define BLOCKS 2
#define SIDE 128
#else               // q8_0: 32 columns a chunk, an f16 scale a row
#define BLOCKS 1
#define SIDE 32
#endif
#define SLOT_QS (RT * CH * 512)        // a slot: [tile][chunk][512] quant bytes, then [tile][chunk][SIDE] sides
#define SLOT_BYTES (SLOT_QS + RT * CH * SIDE)
#if OWN             // a warp takes whole slots: slot k of an item goes to warp k % W
#define PER_WARP CH
#else               // each warp takes its CH / W chunks of every slot
#define PER_WARP (CH / W)
#endif

static __device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;" :: "n"(W * 32) : "memory");
}

// this CTA's first item of a stage whose items start at CTA `first` (mod grid)
static __device__ __forceinline__ int first_item(int first, int grid) {
    return ((int)blockIdx.x - first % grid + grid) % grid;
}

extern "C" __global__ void __launch_bounds__(W * 32 + PRODUCERS * 32, 1) gemv_chain(const Chain chain) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ float red[W][RT * 128];                  // the warps' sums of an item, for the reduction
    __shared__ __align__(8) u64 barriers[2 * RING];      // full[RING], then empty[RING]
    const u32 base = smem_u32(smem), full = smem_u32(barriers), empty = full + 8 * RING;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, grid = gridDim.x;
    int* done = chain.counters + MAX_STAGES;
    int* ctas_out = chain.counters + 2 * MAX_STAGES;
    if (threadIdx.x == 0) {
        for (int i = 0; i < RING; ++i) {
            mbar_init(full + 8 * i, 1);
            mbar_init(empty + 8 * i, OWN ? 1 : W);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp >= W) {                    // a producer: slots q with q % PRODUCERS its own, of every item, in order
        const u32 producer = warp - W;
        u32 q = 0;
        for (int s = 0, first = 0; s < chain.n_stages; first += chain.stage[s].blocks, ++s) {
            const Stage& st = chain.stage[s];
            const u64 tile_qs = (u64)st.n_chunks * 512, tile_d = (u64)st.n_chunks * SIDE;
            const int slots = st.n_chunks / CH;
            for (int item = first_item(first, grid); item < st.blocks; item += grid) {
                for (int k = 0; k < slots; ++k, ++q) {
                    if (q % PRODUCERS != producer) continue;
                    const int slot = q % RING;
                    const u32 dst = base + slot * SLOT_BYTES, bar = full + 8 * slot;
                    mbar_wait(empty + 8 * slot, ((q / RING) & 1) ^ 1);   // a fresh barrier's phase before 0 is complete
                    if (lane == 0) mbar_expect(bar, SLOT_BYTES);
                    __syncwarp();
                    if (lane < RT) {
                        const u64 tile = (u64)item * RT + lane;
                        bulk_copy(dst + lane * CH * 512, st.qs + tile * tile_qs + (u64)k * CH * 512, CH * 512, bar);
                        bulk_copy(dst + SLOT_QS + lane * CH * SIDE, st.d + tile * tile_d + (u64)k * CH * SIDE,
                                  CH * SIDE, bar);
                    }
                }
            }
        }
        return;
    }

    const bool token_live = g < chain.n_tok;
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");     // the first stage's x, and the counters
#endif
    u32 q0 = 0;                                         // the item's first slot in the ring's order
    for (int s = 0, first = 0; s < chain.n_stages; first += chain.stage[s].blocks, ++s) {
        const Stage& st = chain.stage[s];
        const int slots = st.n_chunks / CH;
        bool ready = s == 0;
        for (int item = first_item(first, grid); item < st.blocks; item += grid, q0 += slots) {
            if (!ready) {                               // x is the stage before's output: wait for all of it
                if (threadIdx.x == 0)
                    while (ld_acquire(done + s - 1) < chain.stage[s - 1].blocks) {
                    }
                consumers_sync();
                ready = true;
            }
            // the warp's slots k0, k0 + dk, ... and its chunks chunk0 .. chunk0 + PER_WARP - 1 of each
            const int k0 = OWN ? warp : 0, dk = OWN ? W : 1, chunk0 = OWN ? 0 : warp * PER_WARP;
            // lane (g, c): token g's 8 columns of each 32-block of the warp's chunks (the planes' column order)
            const u16* x = st.x + (u64)g * st.x_stride + chunk0 * BLOCKS * 32 + c * 8;
            float acc[RT][ACC][4];          // ACC independent chains of MMAs a row tile, added at the item's end
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int j = 0; j < ACC; ++j)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[r][j][i] = 0.0f;
            // x one of the warp's slots ahead (with OWN, W slots of the ring)
            uint4 xv[PER_WARP][BLOCKS], xn[PER_WARP][BLOCKS];
            auto load_x = [&](uint4 (&dst)[PER_WARP][BLOCKS], int k) {
#pragma unroll
                for (int u = 0; u < PER_WARP; ++u)
#pragma unroll
                    for (int b = 0; b < BLOCKS; ++b)
                        dst[u][b] = token_live && k < slots ? ldg_cg(x + ((k * CH + u) * BLOCKS + b) * 32)
                                                            : make_uint4(0, 0, 0, 0);
            };
            load_x(xv, k0);
            for (int k = k0; k < slots; k += dk) {
                load_x(xn, k + dk);
                const u32 q = q0 + k;
                const int slot = q % RING;
                const u32 src = base + slot * SLOT_BYTES;
                mbar_wait(full + 8 * slot, (q / RING) & 1);
#pragma unroll
                for (int u = 0; u < PER_WARP; ++u) {
                    const int chunk = chunk0 + u;
#pragma unroll
                    for (int r = 0; r < RT; ++r) {
                        const uint4 wq = lds128(src + (r * CH + chunk) * 512 + lane * 16);
                        u32 a[BLOCKS][8];       // per 32-block: k16 half h in a[b][4 h .. 4 h + 3]
#if FMT
                        dequant_q4_chunk(wq, lds128(src + SLOT_QS + (r * CH + chunk) * SIDE + g * 16), a[0], a[1]);
#else
                        dequant_q8_chunk(wq, lds32(src + SLOT_QS + (r * CH + chunk) * SIDE + g * 4), a[0]);
#endif
#pragma unroll
                        for (int b = 0; b < BLOCKS; ++b) {
                            const uint4 xb = xv[u][b];
                            const int m = (u * BLOCKS + b) * 2;     // the slot's MMA m goes to chain m % ACC
                            mma(acc[r][m % ACC], a[b][0], a[b][1], a[b][2], a[b][3], x_pair(xb.x), x_pair(xb.y));
                            mma(acc[r][(m + 1) % ACC], a[b][4], a[b][5], a[b][6], a[b][7], x_pair(xb.z),
                                x_pair(xb.w));
                        }
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(empty + 8 * slot);
#pragma unroll
                for (int u = 0; u < PER_WARP; ++u)
#pragma unroll
                    for (int b = 0; b < BLOCKS; ++b) xv[u][b] = xn[u][b];
            }
            // the chains' sums in chain order, then the warps' in warp order: warp r % W reduces and stores tile r
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float v = acc[r][0][i];
#pragma unroll
                    for (int j = 1; j < ACC; ++j) v += acc[r][j][i];
                    red[warp][r * 128 + lane * 4 + i] = v;
                }
            consumers_sync();
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                if (r % W != warp) continue;
                float sum[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float v = 0.0f;
#pragma unroll
                    for (int w = 0; w < W; ++w) v += red[w][r * 128 + lane * 4 + i];
                    sum[i] = v;
                }
                store_tile(st, item * RT + r, chain.n_tok, sum, lane);
            }
            __threadfence();
            consumers_sync();                           // the stores before the count; red free for the next item
            if (threadIdx.x == 0) atomicAdd(done + s, 1);
        }
    }
    // the last CTA out re-arms the counters: every other CTA is past its last read of them
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(ctas_out, 1) == grid - 1) {
            for (int i = 0; i < 2 * MAX_STAGES; ++i) chain.counters[i] = 0;
            __threadfence();
            *ctas_out = 0;
        }
    }
}
#endif
