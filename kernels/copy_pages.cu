// copy_pages: copy whole pages, every layer, K and V.
//
//   cache[l, dst_pages[i]] = cache[l, src_pages[i]]   for every layer l
//
// One page of one layer is contiguous in both store layouts, so the layout
// does not matter here: a page is page_words words at page_id * page_words
// within its layer. Destinations are distinct and never sources (checked on
// the host), so the copies are independent.
#include "pagedkv_common.cuh"

namespace pagedkv {

// Grid: x walks the words of a page, y walks page pairs, z walks layers.
template <class Word>
__device__ __forceinline__ void copy_pages(
    Word* k_cache, Word* v_cache,                           // [num_layers, num_pages, page_words]
    const int32_t* src_pages, const int32_t* dst_pages,     // [num_pairs]
    int32_t num_pairs, int32_t num_layers, int64_t layer_stride, int64_t page_words) {
    const int64_t word_first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t word_step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.y; i < num_pairs; i += gridDim.y) {
        const int64_t src_base = (int64_t)src_pages[i] * page_words;
        const int64_t dst_base = (int64_t)dst_pages[i] * page_words;
        for (int64_t layer = blockIdx.z; layer < num_layers; layer += gridDim.z) {
            const int64_t src = layer * layer_stride + src_base;
            const int64_t dst = layer * layer_stride + dst_base;
            for (int64_t w = word_first; w < page_words; w += word_step) {
                const Word k_word = k_cache[src + w];
                const Word v_word = v_cache[src + w];
                k_cache[dst + w] = k_word;
                v_cache[dst + w] = v_word;
            }
        }
    }
}

}  // namespace pagedkv

#define PAGEDKV_COPY_PAGES_ENTRY(SUFFIX, WORD)                                              \
    extern "C" __global__ void __launch_bounds__(PAGEDKV_BLOCK_THREADS)                     \
        copy_pages_##SUFFIX(WORD* k_cache, WORD* v_cache, const int32_t* src_pages,         \
                            const int32_t* dst_pages, int32_t num_pairs,                    \
                            int32_t num_layers, int64_t layer_stride, int64_t page_words) { \
        pagedkv::copy_pages<WORD>(k_cache, v_cache, src_pages, dst_pages, num_pairs,        \
                                  num_layers, layer_stride, page_words);                    \
    }

PAGEDKV_COPY_PAGES_ENTRY(b1, uint8_t)  // int8 stores whose pages are an odd number of bytes
PAGEDKV_COPY_PAGES_ENTRY(b2, uint16_t)
PAGEDKV_COPY_PAGES_ENTRY(b4, uint32_t)
PAGEDKV_COPY_PAGES_ENTRY(b8, uint2)
PAGEDKV_COPY_PAGES_ENTRY(b16, uint4)
