// The operand description shared by the attention kernels (attention.cu, attention_tc.cu) and
// crates/ops-cuda/src/attention/args.rs (`AttnArgs`, field for field).

#pragma once

#include "counter_random.cuh"

// Where row `r` of pair (b, h) starts: offset + b·strides[0] + h·strides[1] + r·strides[2]
// (elements; the head dim is contiguous).
struct AttnOperand {
    unsigned long long offset;
    unsigned long long strides[3];
};

struct AttnArgs {
    unsigned int batch;
    // Query heads; k, v, dk and dv have kv_heads, a divisor: query head h reads kv head
    // h / (heads / kv_heads).
    unsigned int heads;
    unsigned int queries;
    unsigned int keys;
    unsigned int head_dim;
    unsigned int causal;
    // Every operand's offset and strides are multiples of 4 elements (and head_dim too).
    unsigned int vector;
    unsigned int kv_heads;
    double scale;
    // q, k, v, out, dout, dq, dk, dv
    AttnOperand ops[8];
    // Packed sequences (batch 1, queries == keys): n_seqs + 1 cumulative starts on the device,
    // or null.
    const int* cu_seqlens;
    unsigned int n_seqs;
    unsigned int pad;
    // Packed sequences in the tensor-core kernels: this launch's own-row tiles, heaviest first (a
    // permutation of 0..gridDim.x - 1 from the host), or null.
    const unsigned int* tile_order;
    // Dropout on the probabilities (autograd-core's `DropoutDraw`): probability (pair, i, j) is
    // kept when the 24 bits of number offset + (pair·queries + i)·keys + j of stream `seed` are at
    // least `dropout_threshold`, and a kept one is multiplied by `dropout_scale`. Read only by
    // the kernels built with dropout (threshold 0 otherwise).
    unsigned long long dropout_seed;
    unsigned long long dropout_offset;
    double dropout_scale;
    unsigned int dropout_threshold;
    unsigned int dropout_pad;
};

enum { OP_Q, OP_K, OP_V, OP_O, OP_DO, OP_DQ, OP_DK, OP_DV };

__device__ __forceinline__ unsigned long long row_at(const AttnArgs& a, int op, unsigned int b,
                                                     unsigned int h, unsigned int r) {
    const AttnOperand& o = a.ops[op];
    return o.offset + b * o.strides[0] + h * o.strides[1] + r * o.strides[2];
}

__device__ __forceinline__ unsigned int group_size(const AttnArgs& a) { return a.heads / a.kv_heads; }

// The dropout stream's base plus the draw's offset: `dropout_keeps` takes it, computed once.
__device__ __forceinline__ unsigned long long dropout_base(const AttnArgs& a) {
    return counter_stream(a.dropout_seed) + a.dropout_offset;
}

// Whether dropout keeps probability (pair, query, key), `pair` = b·heads + query head.
__device__ __forceinline__ bool dropout_keeps(const AttnArgs& a, unsigned long long base, unsigned long long pair,
                                              unsigned int query, unsigned int key) {
    const unsigned long long index = (pair * a.queries + query) * a.keys + key;
    return counter_bits24(base, index) >= a.dropout_threshold;
}

// The packed sequence holding `row` (< the token count): its first row and one past its last.
// Every row is one sequence when not packed (`rows` the side's count).
__device__ __forceinline__ void sequence_of(const AttnArgs& a, unsigned int row, unsigned int rows,
                                            unsigned int& first, unsigned int& end) {
    if (a.cu_seqlens == nullptr) {
        first = 0;
        end = rows;
        return;
    }
    // The last n < n_seqs with cu_seqlens[n] <= row (skips empty sequences).
    unsigned int lo = 0, hi = a.n_seqs - 1;
    while (lo < hi) {
        const unsigned int mid = (lo + hi + 1) >> 1;
        if ((unsigned int)a.cu_seqlens[mid] <= row) lo = mid;
        else hi = mid - 1;
    }
    first = (unsigned int)a.cu_seqlens[lo];
    end = (unsigned int)a.cu_seqlens[lo + 1];
}

// The other side's rows that own `row` meets, [lo, hi): for a query (`own_queries`) the keys it
// sees (all, up to the query when causal, its own sequence's when packed), for a key the queries
// that see it (the transpose); none for a row past its side. Both ends never decrease with `row`,
// so a block of rows meets [lo of its first row, hi of its last).
__device__ __forceinline__ void rows_met(const AttnArgs& a, bool own_queries, unsigned int row,
                                         unsigned int& lo, unsigned int& hi) {
    if (row >= (own_queries ? a.queries : a.keys)) {
        lo = hi = 0;
        return;
    }
    unsigned int first, end;
    sequence_of(a, row, own_queries ? a.keys : a.queries, first, end);
    lo = a.causal && !own_queries ? row : first;
    hi = a.causal && own_queries ? row + 1 : end;
}

// The keys query `row` sees.
__device__ __forceinline__ void keys_seen(const AttnArgs& a, unsigned int row, unsigned int& lo,
                                          unsigned int& hi) {
    rows_met(a, true, row, lo, hi);
}

// The queries that see key `row`.
__device__ __forceinline__ void queries_seeing(const AttnArgs& a, unsigned int row, unsigned int& lo,
                                               unsigned int& hi) {
    rows_met(a, false, row, lo, hi);
}

// The other side's rows a block of own rows first..first + n meets (`rows_met` of its first and
// last rows): [lo, hi), empty when no own row is in range.
__device__ __forceinline__ void block_range(const AttnArgs& a, bool own_queries, unsigned int first,
                                            unsigned int n, unsigned int& lo, unsigned int& hi) {
    const unsigned int own_rows = own_queries ? a.queries : a.keys;
    if (first >= own_rows) {
        lo = hi = 0;
        return;
    }
    const unsigned int last = min(first + n, own_rows) - 1;
    unsigned int unused;
    rows_met(a, own_queries, first, lo, unused);
    rows_met(a, own_queries, last, unused, hi);
    if (hi < lo) hi = lo;
}
