// Device helpers the package's CUDA C++ kernels share (quant_gemm_cuda.cu, mla_decode_cuda.cu): their
// hosts put this text after their #defines (ASM_DEQUANT_Q8 among them, where the kernel dequantizes) and before the
// kernel's own source.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

// a streamed weight load: read once, so kept out of L1
static __device__ __forceinline__ uint4 ldg128(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

static __device__ __forceinline__ u32 ldg32(const void* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

static __device__ __forceinline__ float ld_cg(const float* p) {      // from L2: another CTA's partial sums
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

#ifdef ASM_DEQUANT_Q8
// One q8_0 word (rows g, g + 8 x logical columns 2c, 2c + 1: quant_pack.fragment_order) -> the f16x2 operand of
// row g and of row g + 8: the sign flipped (q + 128), each byte under 0x64 (1024 + q + 128 as f16), minus 1152
// exactly, times the row's scale. The GEMV's and the Gluon GEMM's instructions: quant_gemv.ASM_Q8, which the
// host defines as ASM_DEQUANT_Q8.
static __device__ __forceinline__ void dequant_q8(u32 word, u32 scale_g, u32 scale_g8, u32& row_g, u32& row_g8) {
    asm(ASM_DEQUANT_Q8
        : "=r"(row_g), "=r"(row_g8) : "r"(word), "r"(scale_g), "r"(scale_g8));
}
#endif

static __device__ __forceinline__ u32 broadcast_lo(u32 pair) {     // (a, b) -> (a, a)
    u32 r;
    asm("prmt.b32 %0, %1, 0, 0x1010;" : "=r"(r) : "r"(pair));
    return r;
}

static __device__ __forceinline__ u32 broadcast_hi(u32 pair) {     // (a, b) -> (b, b)
    u32 r;
    asm("prmt.b32 %0, %1, 0, 0x3232;" : "=r"(r) : "r"(pair));
    return r;
}

// shared memory, mbarriers and bulk copies (the producer / consumer rings)
static __device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

static __device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count));
}

static __device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n .reg .pred done;\n WAIT_%=:\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT_%=;\n}" :: "r"(bar), "r"(parity) : "memory");
}

static __device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

static __device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

static __device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

static __device__ __forceinline__ uint4 lds128(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

static __device__ __forceinline__ u32 lds32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// wgmma's descriptor of a no-swizzle K-major B image of n columns (tokens, heads) from shared address addr: core
// matrices of 8 columns x 8 values of K (128 contiguous bytes), the column groups side by side (SBO 128 bytes), the
// next 8 values of K n x 16 bytes on (LBO); each field in 16-byte units
static __device__ __forceinline__ u64 no_swizzle_b_descriptor(u32 addr, u32 n) {
    const u64 lbo = (n * 16) >> 4, sbo = 128 >> 4;
    return (u64)((addr & 0x3FFFF) >> 4) | (lbo << 16) | (sbo << 32);
}
