// Shared definitions of the pagedkv_np CUDA kernels.
//
// The kernels move bits, never values: a "word" is the unit one thread loads
// and stores, chosen on the host as the widest of 16, 8, 4 or 2 bytes that
// divides a row (head_dim elements) and every address and stride involved.
// Every kernel is a template over the word type with one extern "C" entry
// point per word size (suffix _b2, _b4, _b8, _b16), so float32, float16 and
// bfloat16 share code: a dtype only decides which words are possible.
//
// Launch shape (all kernels): 3-D blocks whose x threads walk the words of a
// row, so a warp touches consecutive addresses; y threads walk heads and z
// threads walk tokens or positions, so a decode step with a few tokens still
// fills a block and a prefill of thousands of tokens spreads over the grid.
// Every loop is grid-stride, so any grid size is correct; the host sizes the
// grid to cover the work once.
//
// Indices and strides are 64-bit wherever a product can pass 2^31 (a store
// holds up to 2^31 slots of rows); int32 appears only for index arrays and
// counts that fit by construction.
#pragma once

#if defined(__CUDACC_RTC__)
// NVRTC compiles without the C library headers; these widths hold on every
// CUDA target.
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef long long int64_t;
#else
#include <cstdint>
#endif

static_assert(sizeof(int8_t) == 1 && sizeof(uint16_t) == 2 && sizeof(uint32_t) == 4,
              "word widths");
static_assert(sizeof(int32_t) == 4 && sizeof(int64_t) == 8, "index widths");
static_assert(sizeof(uint2) == 8 && sizeof(uint4) == 16, "vector word widths");

// Threads per block; the host splits it over (x, y, z) in powers of two.
#define PAGEDKV_BLOCK_THREADS 256

namespace pagedkv {

// Copy one K row and one V row of `num_words` words. Both loads are issued
// before either store so the two streams overlap (without restrict the
// compiler may not reorder a load past a store to a possibly aliasing row).
template <class Word>
__device__ __forceinline__ void copy_rows(Word* k_dst, Word* v_dst, const Word* k_src,
                                          const Word* v_src, int32_t num_words) {
    for (int32_t w = threadIdx.x; w < num_words; w += blockDim.x) {
        const Word k_word = k_src[w];
        const Word v_word = v_src[w];
        k_dst[w] = k_word;
        v_dst[w] = v_word;
    }
}

// Zero one K row and one V row: all-zero bits, which is +0.0 in every dtype.
template <class Word>
__device__ __forceinline__ void zero_rows(Word* k_dst, Word* v_dst, int32_t num_words) {
    const Word zero = Word();
    for (int32_t w = threadIdx.x; w < num_words; w += blockDim.x) {
        k_dst[w] = zero;
        v_dst[w] = zero;
    }
}

}  // namespace pagedkv
