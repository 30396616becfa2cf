// The operand description shared by the attention kernels (attention.cu, attention_tc.cu) and
// crates/ops-cuda/src/attention/args.rs (`AttnArgs`, field for field).

#pragma once

// Where row `r` of pair (b, h) starts: offset + b·strides[0] + h·strides[1] + r·strides[2]
// (elements; the head dim is contiguous).
struct AttnOperand {
    unsigned long long offset;
    unsigned long long strides[3];
};

struct AttnArgs {
    unsigned int batch;
    unsigned int heads;
    unsigned int queries;
    unsigned int keys;
    unsigned int head_dim;
    unsigned int causal;
    // Every operand's offset and strides are multiples of 4 elements (and head_dim too).
    unsigned int vector;
    unsigned int pad;
    double scale;
    // q, k, v, out, dout, dq, dk, dv
    AttnOperand ops[8];
};

enum { OP_Q, OP_K, OP_V, OP_O, OP_DO, OP_DQ, OP_DK, OP_DV };

__device__ __forceinline__ unsigned long long row_at(const AttnArgs& a, int op, unsigned int b,
                                                     unsigned int h, unsigned int r) {
    const AttnOperand& o = a.ops[op];
    return o.offset + b * o.strides[0] + h * o.strides[1] + r * o.strides[2];
}
