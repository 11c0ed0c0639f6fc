// paged_gather: copy each sequence's K/V of one layer into contiguous buffers.
//
//   for t < seq_lens[b]:   out[b, t, h, :] = cache[page_table[b, t / page_size],
//                                                  t % page_size, h, :]
//   for seq_lens[b] <= t < num_positions:   out[b, t, h, :] = 0
//
// Every output row is written (data or zeros), so the output needs no
// clearing beforehand. Store layout (NHD/HND) and output layout (BTHD/BHTD)
// enter only through the strides, in words. Page table entries past a
// sequence's last page are never read, so they may hold -1.
#include "pagedkv_common.cuh"

namespace pagedkv {

// Grid: x walks positions (blockDim.z per block), y walks sequences, z walks
// heads (blockDim.y per block); blockDim.x threads walk the words of a row.
template <class Word>
__device__ __forceinline__ void paged_gather(
    const Word* k_cache, const Word* v_cache,  // one layer: [num_pages, ...] rows of row_words
    Word* k_out, Word* v_out,                  // [num_seqs, num_positions, num_heads] rows, strided
    const int32_t* page_table,                 // [num_seqs, max_pages]
    const int32_t* seq_lens,                   // [num_seqs]
    int32_t num_seqs, int32_t max_pages, int32_t num_positions, int32_t num_heads,
    int32_t row_words, int32_t page_size,
    int64_t page_stride, int64_t offset_stride, int64_t head_stride,
    int64_t out_seq_stride, int64_t out_pos_stride, int64_t out_head_stride) {
    const int64_t pos_step = (int64_t)gridDim.x * blockDim.z;
    const int64_t head_first = (int64_t)blockIdx.z * blockDim.y + threadIdx.y;
    const int64_t head_step = (int64_t)gridDim.z * blockDim.y;
    for (int64_t b = blockIdx.y; b < num_seqs; b += gridDim.y) {
        const int32_t seq_len = seq_lens[b];
        const int32_t* pages = page_table + b * max_pages;
        for (int64_t t = (int64_t)blockIdx.x * blockDim.z + threadIdx.z; t < num_positions;
             t += pos_step) {
            Word* k_row = k_out + b * out_seq_stride + t * out_pos_stride;
            Word* v_row = v_out + b * out_seq_stride + t * out_pos_stride;
            if (t < seq_len) {
                // t < seq_len <= INT32_MAX: 32-bit division is exact and cheap.
                const int32_t pos = (int32_t)t;
                const int32_t page_idx = pos / page_size;
                const int32_t offset = pos - page_idx * page_size;
                const int64_t slot_base = (int64_t)pages[page_idx] * page_stride +
                                          (int64_t)offset * offset_stride;
                for (int64_t h = head_first; h < num_heads; h += head_step) {
                    const int64_t src = slot_base + h * head_stride;
                    copy_rows(k_row + h * out_head_stride, v_row + h * out_head_stride,
                              k_cache + src, v_cache + src, row_words);
                }
            } else {
                for (int64_t h = head_first; h < num_heads; h += head_step) {
                    zero_rows(k_row + h * out_head_stride, v_row + h * out_head_stride,
                              row_words);
                }
            }
        }
    }
}

}  // namespace pagedkv

#define PAGEDKV_GATHER_ENTRY(SUFFIX, WORD)                                                  \
    extern "C" __global__ void __launch_bounds__(PAGEDKV_BLOCK_THREADS)                     \
        paged_gather_##SUFFIX(const WORD* k_cache, const WORD* v_cache, WORD* k_out,        \
                              WORD* v_out, const int32_t* page_table,                       \
                              const int32_t* seq_lens, int32_t num_seqs, int32_t max_pages, \
                              int32_t num_positions, int32_t num_heads, int32_t row_words,  \
                              int32_t page_size, int64_t page_stride,                       \
                              int64_t offset_stride, int64_t head_stride,                   \
                              int64_t out_seq_stride, int64_t out_pos_stride,               \
                              int64_t out_head_stride) {                                    \
        pagedkv::paged_gather<WORD>(k_cache, v_cache, k_out, v_out, page_table, seq_lens,   \
                                    num_seqs, max_pages, num_positions, num_heads,          \
                                    row_words, page_size, page_stride, offset_stride,       \
                                    head_stride, out_seq_stride, out_pos_stride,            \
                                    out_head_stride);                                       \
    }

PAGEDKV_GATHER_ENTRY(b2, uint16_t)
PAGEDKV_GATHER_ENTRY(b4, uint32_t)
PAGEDKV_GATHER_ENTRY(b8, uint2)
PAGEDKV_GATHER_ENTRY(b16, uint4)
