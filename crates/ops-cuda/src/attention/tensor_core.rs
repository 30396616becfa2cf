//! Fused attention for f16 and bf16 on tensor cores (`kernels/attention_tc.cu`, FlashAttention-2
//! style): forward, and backward as a dQ kernel (which also writes each query's `Δ = dO·O`)
//! followed by a dK/dV kernel.
//!
//! Same operands (`AttnArgs` of `args.rs`: strided `[batch, heads, rows, head_dim]` views read in
//! place) and same saved state (one f32 log-sum-exp per query) as the other attention paths.
//! The kernels move 16-byte chunks, so they take head dims that are multiples of 8 up to 128 with
//! every operand 8-element aligned ([`fits`]); the family's entry point (`mod.rs`) sends anything
//! else to the cuBLAS path of `gemm.rs`. Blocks of 128 threads take 64 rows of one (batch, head)
//! pair; the head dim is padded to 32, 64, 96 or 128 in shared memory. Grouped-query heads and
//! packed sequences travel in `AttnArgs`: the dK/dV grid runs over (batch, key/value head) pairs,
//! each block summing its group's query heads in registers. `Δ` lives in scratch from
//! the caching allocator for the duration of the backward.
//!
//! This path sits on the attention family's `args.rs` and the ground floor, and imports no other
//! path.

use cudarc::driver::LaunchConfig;
use headroom_autograd_core::{
    AttentionBackward, AttentionDims, AttentionForward, DType, Result, TensorError, View,
};

use super::args::{address, attn_args, AttnArgs};
use crate::device::CudaBackend;
use crate::kernels::{KernelName, Module};
use crate::launch::{launch_in, Param};
use crate::operands::element_address;
use crate::scratch::Scratch;

/// Threads per block (`TC_THREADS` in the kernels).
const THREADS: u32 = 128;
/// Rows per block and per streamed tile (`TC_ROWS` in the kernels).
const ROWS: usize = 64;
/// Elements per 16-byte chunk: the alignment every operand needs.
const CHUNK: usize = 8;
/// Largest head dim the kernels take.
const MAX_HEAD_DIM: usize = 128;
/// Most (batch, head) pairs of one launch (the grid's y extent).
const MAX_PAIRS: usize = 65_535;

/// Whether the tensor-core kernels take these dims and operands (f16 or bf16 `[batch, heads,
/// rows, head_dim]` views): head dim a multiple of 8 up to 128, every operand's offset and strides
/// multiples of 8 elements with a contiguous head dim, buffers 16-byte aligned.
pub(crate) fn fits(dims: &AttentionDims, views: &[View<'_>]) -> bool {
    dims.head_dim.is_multiple_of(CHUNK)
        && dims.head_dim <= MAX_HEAD_DIM
        && dims.batch * dims.heads <= MAX_PAIRS
        && views.iter().all(|view| {
            let strides = view.layout.strides();
            view.layout.offset().is_multiple_of(CHUNK)
                && strides.len() == 4
                && strides[3] == 1
                && strides[..3].iter().all(|s| s.is_multiple_of(CHUNK))
                && view
                    .buffer
                    .address()
                    .is_multiple_of((CHUNK * view.dtype.size_in_bytes()) as u64)
        })
}

/// The kernels of a kernel family for `dtype` and `head_dim`, and their padded head dim.
fn variant(dtype: DType, head_dim: usize) -> Result<(&'static str, usize)> {
    let padded = head_dim.div_ceil(32).max(1) * 32;
    let suffix = match (dtype, padded) {
        (DType::BF16, 32) => "bf16_32",
        (DType::BF16, 64) => "bf16_64",
        (DType::BF16, 96) => "bf16_96",
        (DType::BF16, 128) => "bf16_128",
        (DType::F16, 32) => "f16_32",
        (DType::F16, 64) => "f16_64",
        (DType::F16, 96) => "f16_96",
        (DType::F16, 128) => "f16_128",
        (dtype, _) => {
            return Err(TensorError::InvalidArgument {
                op: "attention",
                reason: format!(
                    "no tensor-core attention kernel for {dtype:?} head dim {head_dim}"
                ),
            })
        }
    };
    Ok((suffix, padded))
}

/// The launch shape over `rows` rows of each of `pairs` (batch, head) pairs (query heads, or
/// key/value heads for dK/dV), with `tiles` shared `[64][padded + 8]` tiles and `stats` f32 values
/// of shared memory.
fn config(pairs: usize, rows: usize, padded: usize, tiles: usize, stats: usize) -> LaunchConfig {
    let bytes = tiles * ROWS * (padded + CHUNK) * 2 + stats * 4;
    LaunchConfig {
        // `fits` bounds the pairs by 65 535; rows are u32 (checked by `attn_args`).
        grid_dim: (rows.div_ceil(ROWS) as u32, pairs as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: bytes as u32,
    }
}

fn launch(
    backend: &CudaBackend,
    op: &'static str,
    name: KernelName,
    config: LaunchConfig,
    params: &[Param],
    args: AttnArgs,
) -> Result<()> {
    launch_in(
        backend,
        Module::AttentionTc,
        op,
        name,
        config,
        params,
        Some(args),
    )
}

/// The log-sum-exp's first element (dense f32 `[batch, heads, queries]`).
fn lse_address(f: &AttentionForward<'_>) -> Param {
    Param::U64(element_address(&f.lse))
}

/// Forward; the caller checked [`fits`] for q, k, v and out.
pub(crate) fn forward(
    backend: &CudaBackend,
    f: AttentionForward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let (suffix, padded) = variant(f.q.dtype, dims.head_dim)?;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out])?;
    // Q, and two buffers each of K and V.
    let config = config(dims.batch * dims.heads, dims.queries, padded, 5, 0);
    let params = [
        address(&f.q),
        address(&f.k),
        address(&f.v),
        address(&f.out),
        lse_address(&f),
    ];
    launch(
        backend,
        "attention",
        ("attention_tc_forward", suffix),
        config,
        &params,
        args,
    )
}

/// Backward; the caller checked [`fits`] for q, k, v, out, dout, dq, dk and dv.
pub(crate) fn backward(
    backend: &CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let f = b.forward;
    let (suffix, padded) = variant(f.q.dtype, dims.head_dim)?;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv])?;
    // Δ per query, from the caching allocator, returned (in stream order) after the launches.
    let delta = Scratch::new(backend, (dims.batch * dims.heads * dims.queries * 4) as u64)?;
    let delta_address = Param::U64(delta.address());
    if dims.queries > 0 {
        // Q, dO, and two buffers each of K and V; log-sum-exp and Δ of the block's queries.
        let config = config(dims.batch * dims.heads, dims.queries, padded, 6, 2 * ROWS);
        let params = [
            address(&f.q),
            address(&f.k),
            address(&f.v),
            address(&f.out),
            address(&b.dout),
            lse_address(&f),
            address(&b.dq),
            delta_address,
        ];
        launch(
            backend,
            "attention_backward",
            ("attention_tc_backward_dq", suffix),
            config,
            &params,
            args,
        )?;
    }
    if dims.keys > 0 {
        // K, V, and two buffers each of Q and dO with their queries' statistics.
        // One block per (batch, key/value head) and 64 keys, over the group's query heads.
        let config = config(dims.batch * dims.kv_heads, dims.keys, padded, 6, 4 * ROWS);
        let params = [
            address(&f.q),
            address(&f.k),
            address(&f.v),
            address(&b.dout),
            lse_address(&f),
            delta_address,
            address(&b.dk),
            address(&b.dv),
        ];
        launch(
            backend,
            "attention_backward",
            ("attention_tc_backward_dkdv", suffix),
            config,
            &params,
            args,
        )?;
    }
    Ok(())
}
