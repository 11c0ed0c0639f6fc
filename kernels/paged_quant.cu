// paged_quant: the int8 store. Quantize K/V on write, dequantize on gather.
//
// The format is pagedkv_np.quant's: int8 codes in the store's layout, and
// beside them a float32 scale per group of `group` values along head_dim, in
// the same page geometry (a store row of head_dim codes has num_groups
// scales). Store rows are addressed in rows, not words:
//
//   row = page * page_rows + offset * offset_rows + head * head_rows
//   codes[row * head_dim + d],  scales[row * num_groups + d / group]
//
// Every step is one IEEE float32 operation in the order of the reference
// (a division, rintf, a multiplication; no expression that a compiler could
// fuse into an FMA), and nothing meets a subnormal float32: inputs below
// 2^-126 count as zero, scales are normal or zero, and a code times a normal
// scale is normal or zero. So results equal the NumPy reference bit for bit,
// with or without -ftz. 16-bit types are converted by integer arithmetic,
// rounding to nearest, ties to even.
//
// Entry points per input or output type: _f32 (float), _f16 and _bf16 (the
// 16-bit patterns as uint16_t). One thread per (token, head, group) on
// write, one per output element on gather; loops are grid-stride.
#include "pagedkv_common.cuh"

namespace pagedkv {

#define PAGEDKV_QMAX 127.0f

__device__ __forceinline__ float quant_scale_min() { return __uint_as_float(0x00800000u); }
__device__ __forceinline__ float quant_scale_max() { return __uint_as_float(0x7C010203u); }
__device__ __forceinline__ float float_max() { return __uint_as_float(0x7F7FFFFFu); }

__device__ __forceinline__ uint32_t f16_to_f32_bits(uint32_t h) {
    const uint32_t sign = (h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1Fu;
    uint32_t m = h & 0x3FFu;
    if (e == 0x1Fu) {
        return sign | 0x7F800000u | (m << 13);
    }
    if (e != 0) {
        return sign | ((e + 112u) << 23) | (m << 13);
    }
    if (m == 0) {
        return sign;
    }
    uint32_t e2 = 113u;  // a subnormal: normalise the significand
    while ((m & 0x400u) == 0) {
        m <<= 1;
        --e2;
    }
    return sign | (e2 << 23) | ((m & 0x3FFu) << 13);
}

__device__ __forceinline__ uint16_t f32_bits_to_f16(uint32_t b) {
    const uint32_t sign = (b >> 16) & 0x8000u;
    const uint32_t a = b & 0x7FFFFFFFu;
    if (a > 0x7F800000u) {  // NaN (never made by a dequantization)
        return (uint16_t)(sign | 0x7E00u);
    }
    if (a >= 0x477FF000u) {  // from 65520 up: infinity
        return (uint16_t)(sign | 0x7C00u);
    }
    if (a >= 0x38800000u) {  // a normal float16
        const uint32_t r = a - 0x38000000u;
        return (uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
    }
    if (a < 0x33000000u) {  // below half the smallest subnormal
        return (uint16_t)sign;
    }
    const uint32_t shift = 126u - (a >> 23);
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
    uint32_t r = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (r & 1u) != 0)) {
        ++r;
    }
    return (uint16_t)(sign | r);
}

__device__ __forceinline__ uint16_t f32_bits_to_bf16(uint32_t b) {
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// How each kind of K/V element is read as a float32 and written from one.
struct F32 {
    typedef float T;
    static __device__ __forceinline__ float load(T x) { return x; }
    static __device__ __forceinline__ T store(float x) { return x; }
};
struct F16 {
    typedef uint16_t T;
    static __device__ __forceinline__ float load(T x) {
        return __uint_as_float(f16_to_f32_bits(x));
    }
    static __device__ __forceinline__ T store(float x) {
        return f32_bits_to_f16(__float_as_uint(x));
    }
};
struct BF16 {
    typedef uint16_t T;
    static __device__ __forceinline__ float load(T x) { return __uint_as_float((uint32_t)x << 16); }
    static __device__ __forceinline__ T store(float x) {
        return f32_bits_to_bf16(__float_as_uint(x));
    }
};

// One group: its scale into *scale, its codes into codes[0, group).
template <class Kind>
__device__ __forceinline__ void quantize_group(const typename Kind::T* x, int32_t group,
                                               int8_t* codes, float* scale) {
    // the largest finite magnitude (NaN fails the comparison)
    float amax = 0.0f;
    for (int32_t e = 0; e < group; ++e) {
        float mag = fabsf(Kind::load(x[e]));
        mag = mag <= float_max() ? mag : 0.0f;
        amax = mag > amax ? mag : amax;
    }
    float s = amax / PAGEDKV_QMAX;
    s = s > quant_scale_max() ? quant_scale_max() : s;
    s = s < quant_scale_min() ? 0.0f : s;
    *scale = s;
    for (int32_t e = 0; e < group; ++e) {
        float f = Kind::load(x[e]);
        f = fabsf(f) >= quant_scale_min() ? f : 0.0f;  // NaN and subnormals count as 0
        float q = s > 0.0f ? rintf(f / s) : 0.0f;      // an infinity stays one
        q = q < PAGEDKV_QMAX ? q : PAGEDKV_QMAX;
        q = q > -PAGEDKV_QMAX ? q : -PAGEDKV_QMAX;
        codes[e] = (int8_t)(int32_t)q;
    }
}

template <class Kind>
__device__ __forceinline__ void paged_write_q(
    int8_t* k_codes, int8_t* v_codes,        // one layer of codes
    float* k_scales, float* v_scales,        // one layer of scales
    const typename Kind::T* k, const typename Kind::T* v,  // [num_tokens, num_heads, head_dim]
    const int32_t* slot_mapping,             // [num_tokens]
    int32_t num_tokens, int32_t num_heads, int32_t head_dim, int32_t group, int32_t page_size,
    int64_t page_rows, int64_t offset_rows, int64_t head_rows,
    int64_t k_token_stride, int64_t k_head_stride,
    int64_t v_token_stride, int64_t v_head_stride) {
    const int64_t num_groups = head_dim / group;
    const int64_t total = (int64_t)num_tokens * num_heads * num_groups;
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int64_t g = i % num_groups;
        const int64_t h = (i / num_groups) % num_heads;
        const int64_t n = i / (num_groups * num_heads);
        const int32_t slot = slot_mapping[n];
        if (slot < 0) {
            continue;
        }
        const int32_t page_id = slot / page_size;
        const int32_t offset = slot - page_id * page_size;
        const int64_t row = (int64_t)page_id * page_rows + (int64_t)offset * offset_rows +
                            h * head_rows;
        const int64_t code0 = row * head_dim + g * group;
        const int64_t scale0 = row * num_groups + g;
        quantize_group<Kind>(k + n * k_token_stride + h * k_head_stride + g * group, group,
                             k_codes + code0, k_scales + scale0);
        quantize_group<Kind>(v + n * v_token_stride + v_head_stride * h + g * group, group,
                             v_codes + code0, v_scales + scale0);
    }
}

// Output element i of a C-contiguous [num_seqs, num_positions, num_heads,
// head_dim] (bhtd == 0) or [num_seqs, num_heads, num_positions, head_dim]
// buffer: the dequantized value below seq_lens[b], zero from there.
template <class Kind>
__device__ __forceinline__ void paged_gather_q(
    const int8_t* k_codes, const int8_t* v_codes, const float* k_scales,
    const float* v_scales, typename Kind::T* k_out, typename Kind::T* v_out,
    const int32_t* page_table,               // [num_seqs, max_pages]
    const int32_t* seq_lens,                 // [num_seqs]
    int32_t num_seqs, int32_t max_pages, int32_t num_positions, int32_t num_heads,
    int32_t head_dim, int32_t group, int32_t page_size, int32_t bhtd,
    int64_t page_rows, int64_t offset_rows, int64_t head_rows) {
    const int64_t num_groups = head_dim / group;
    const int64_t total = (int64_t)num_seqs * num_positions * num_heads * head_dim;
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int64_t d = i % head_dim;
        const int64_t rest = i / head_dim;
        int64_t t, h;
        if (bhtd) {
            t = rest % num_positions;
            h = (rest / num_positions) % num_heads;
        } else {
            h = rest % num_heads;
            t = (rest / num_heads) % num_positions;
        }
        const int64_t b = rest / ((int64_t)num_positions * num_heads);
        if (t >= seq_lens[b]) {
            k_out[i] = Kind::store(0.0f);
            v_out[i] = Kind::store(0.0f);
            continue;
        }
        // t < seq_len <= INT32_MAX: 32-bit division is exact
        const int32_t pos = (int32_t)t;
        const int32_t page_idx = pos / page_size;
        const int32_t offset = pos - page_idx * page_size;
        const int64_t row = (int64_t)page_table[b * max_pages + page_idx] * page_rows +
                            (int64_t)offset * offset_rows + h * head_rows;
        const int64_t code = row * head_dim + d;
        const int64_t scale = row * num_groups + d / group;
        const float k_value = (float)k_codes[code] * k_scales[scale];
        const float v_value = (float)v_codes[code] * v_scales[scale];
        k_out[i] = Kind::store(k_value);
        v_out[i] = Kind::store(v_value);
    }
}

}  // namespace pagedkv

#define PAGEDKV_WRITE_Q_ENTRY(SUFFIX, KIND)                                                  \
    extern "C" __global__ void __launch_bounds__(PAGEDKV_BLOCK_THREADS)                      \
        paged_write_q_##SUFFIX(int8_t* k_codes, int8_t* v_codes, float* k_scales,            \
                               float* v_scales, const pagedkv::KIND::T* k,                   \
                               const pagedkv::KIND::T* v, const int32_t* slot_mapping,       \
                               int32_t num_tokens, int32_t num_heads, int32_t head_dim,      \
                               int32_t group, int32_t page_size, int64_t page_rows,          \
                               int64_t offset_rows, int64_t head_rows,                       \
                               int64_t k_token_stride, int64_t k_head_stride,                \
                               int64_t v_token_stride, int64_t v_head_stride) {              \
        pagedkv::paged_write_q<pagedkv::KIND>(                                               \
            k_codes, v_codes, k_scales, v_scales, k, v, slot_mapping, num_tokens, num_heads, \
            head_dim, group, page_size, page_rows, offset_rows, head_rows, k_token_stride,   \
            k_head_stride, v_token_stride, v_head_stride);                                   \
    }

#define PAGEDKV_GATHER_Q_ENTRY(SUFFIX, KIND)                                                 \
    extern "C" __global__ void __launch_bounds__(PAGEDKV_BLOCK_THREADS)                      \
        paged_gather_q_##SUFFIX(const int8_t* k_codes, const int8_t* v_codes,                \
                                const float* k_scales, const float* v_scales,                \
                                pagedkv::KIND::T* k_out, pagedkv::KIND::T* v_out,            \
                                const int32_t* page_table, const int32_t* seq_lens,          \
                                int32_t num_seqs, int32_t max_pages, int32_t num_positions,  \
                                int32_t num_heads, int32_t head_dim, int32_t group,          \
                                int32_t page_size, int32_t bhtd, int64_t page_rows,          \
                                int64_t offset_rows, int64_t head_rows) {                    \
        pagedkv::paged_gather_q<pagedkv::KIND>(                                              \
            k_codes, v_codes, k_scales, v_scales, k_out, v_out, page_table, seq_lens,        \
            num_seqs, max_pages, num_positions, num_heads, head_dim, group, page_size, bhtd, \
            page_rows, offset_rows, head_rows);                                              \
    }

PAGEDKV_WRITE_Q_ENTRY(f32, F32)
PAGEDKV_WRITE_Q_ENTRY(f16, F16)
PAGEDKV_WRITE_Q_ENTRY(bf16, BF16)
PAGEDKV_GATHER_Q_ENTRY(f32, F32)
PAGEDKV_GATHER_Q_ENTRY(f16, F16)
PAGEDKV_GATHER_Q_ENTRY(bf16, BF16)
