// paged_write: scatter the K/V rows of N tokens into their slots of one layer.
//
//   slot = slot_mapping[n]            (-1: token n is skipped)
//   page = slot / page_size, offset = slot % page_size
//   cache[page, offset, h, :] = k[n, h, :]     (NHD)
//   cache[page, h, offset, :] = k[n, h, :]     (HND)
//
// The layout enters only through the strides: the host passes the stride of a
// page, of an offset within a page and of a head, in words. k and v may have
// any token and head strides (rows themselves are contiguous).
#include "pagedkv_common.cuh"

namespace pagedkv {

// Grid: x walks tokens (blockDim.z per block), y walks heads (blockDim.y per
// block); blockDim.x threads walk the words of a row.
template <class Word>
__device__ __forceinline__ void paged_write(
    Word* k_cache, Word* v_cache,          // one layer: [num_pages, ...] rows of row_words
    const Word* k, const Word* v,          // [num_tokens, num_heads, row_words], strided
    const int32_t* slot_mapping,           // [num_tokens]
    int32_t num_tokens, int32_t num_heads, int32_t row_words, int32_t page_size,
    int64_t page_stride, int64_t offset_stride, int64_t head_stride,
    int64_t k_token_stride, int64_t k_head_stride,
    int64_t v_token_stride, int64_t v_head_stride) {
    const int64_t token_step = (int64_t)gridDim.x * blockDim.z;
    const int64_t head_step = (int64_t)gridDim.y * blockDim.y;
    for (int64_t n = (int64_t)blockIdx.x * blockDim.z + threadIdx.z; n < num_tokens;
         n += token_step) {
        const int32_t slot = slot_mapping[n];
        if (slot < 0) {
            continue;
        }
        const int32_t page_id = slot / page_size;
        const int32_t offset = slot - page_id * page_size;
        const int64_t slot_base = (int64_t)page_id * page_stride + (int64_t)offset * offset_stride;
        for (int64_t h = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; h < num_heads;
             h += head_step) {
            const int64_t dst = slot_base + h * head_stride;
            copy_rows(k_cache + dst, v_cache + dst,
                      k + n * k_token_stride + h * k_head_stride,
                      v + n * v_token_stride + h * v_head_stride, row_words);
        }
    }
}

}  // namespace pagedkv

#define PAGEDKV_WRITE_ENTRY(SUFFIX, WORD)                                                   \
    extern "C" __global__ void __launch_bounds__(PAGEDKV_BLOCK_THREADS)                     \
        paged_write_##SUFFIX(WORD* k_cache, WORD* v_cache, const WORD* k, const WORD* v,    \
                             const int32_t* slot_mapping, int32_t num_tokens,               \
                             int32_t num_heads, int32_t row_words, int32_t page_size,       \
                             int64_t page_stride, int64_t offset_stride,                    \
                             int64_t head_stride, int64_t k_token_stride,                   \
                             int64_t k_head_stride, int64_t v_token_stride,                 \
                             int64_t v_head_stride) {                                       \
        pagedkv::paged_write<WORD>(k_cache, v_cache, k, v, slot_mapping, num_tokens,        \
                                   num_heads, row_words, page_size, page_stride,            \
                                   offset_stride, head_stride, k_token_stride,              \
                                   k_head_stride, v_token_stride, v_head_stride);           \
    }

PAGEDKV_WRITE_ENTRY(b2, uint16_t)
PAGEDKV_WRITE_ENTRY(b4, uint32_t)
PAGEDKV_WRITE_ENTRY(b8, uint2)
PAGEDKV_WRITE_ENTRY(b16, uint4)
