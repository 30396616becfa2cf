//! Fused attention for f32 on tensor cores (`kernels/attention_tf32.cu`, FlashAttention-2 style)
//! with f32 accuracy from split TF32 operands (each product as three TF32 products of the
//! operands' TF32 parts and remainders, as PyTorch's memory-efficient kernel computes f32):
//! forward, and backward as a dQ kernel (which also writes each query's `Δ = dO·O`) followed by a
//! dK/dV kernel.
//!
//! Same operands (`AttnArgs` of `args.rs`: strided `[batch, heads, rows, head_dim]` views read in
//! place) and same saved state (one f32 log-sum-exp per query) as the other attention paths.
//! The kernels move 16-byte chunks, so they take head dims that are multiples of 4 up to 128 with
//! every operand 4-element aligned ([`fits`]); the family's entry point (`mod.rs`) sends other f32
//! operands to the register-tiled kernels of `register_tiled.rs`. Blocks of 128 threads take 64
//! rows of one (batch, head) pair and stream the other side 32 or 64 rows at a time (64 from 512
//! rows on); the head dim is padded to 32, 64, 96 or 128 in shared memory.
//! Grouped-query heads and packed sequences travel in `AttnArgs`: the dK/dV grid runs over
//! (batch, key/value head) pairs, each block summing its group's query heads in registers. `Δ`
//! lives in scratch from the caching allocator for the duration of the backward.
//!
//! This path sits on the attention family's `args.rs` and the ground floor, and imports no other
//! path.

use cudarc::driver::LaunchConfig;
use headroom_autograd_core::{
    AttentionBackward, AttentionDims, AttentionForward, Result, TensorError, View,
};

use super::args::{address, attn_args, AttnArgs};
use crate::device::CudaBackend;
use crate::kernels::{KernelName, Module};
use crate::launch::{launch_in, Param};
use crate::operands::element_address;
use crate::scratch::Scratch;

/// Threads per block (`TF_THREADS` in the kernels).
const THREADS: u32 = 128;
/// Own rows per block (`TF_ROWS` in the kernels).
const ROWS: usize = 64;
/// Elements per 16-byte chunk: the alignment every operand needs.
const CHUNK: usize = 4;
/// Largest head dim the kernels take.
const MAX_HEAD_DIM: usize = 128;
/// Most (batch, head) pairs of one launch (the grid's y extent).
const MAX_PAIRS: usize = 65_535;

/// Whether the split-TF32 kernels take these dims and operands (f32 `[batch, heads, rows,
/// head_dim]` views): head dim a multiple of 4 up to 128, every operand's offset and strides
/// multiples of 4 elements with a contiguous head dim, buffers 16-byte aligned.
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

/// Rows of each streamed tile (`KR` in the kernels) when the other side has `streamed_rows`: 64
/// from 512 rows on, 32 below. Measured on the H200 (results/2026-12-04-attention-f32): 64 is
/// faster at GPT-2's 1024 tokens (forward + backward 1.590 against 1.694 ms at batch 8) and
/// Llama's 2048 and 4096; 32 at ViT's 197 (0.827 against 0.917 ms at batch 32), where twice the
/// blocks fit an SM.
fn streamed_tile_rows(streamed_rows: usize) -> usize {
    if streamed_rows >= 512 {
        64
    } else {
        32
    }
}

/// The kernels' suffix for `head_dim` and a streamed side of `streamed_rows`, their padded head
/// dim and streamed tile rows.
fn variant(head_dim: usize, streamed_rows: usize) -> Result<(&'static str, usize, usize)> {
    let padded = head_dim.div_ceil(32).max(1) * 32;
    let streamed = streamed_tile_rows(streamed_rows);
    let suffix = match (padded, streamed) {
        (32, 32) => "32_32",
        (64, 32) => "64_32",
        (96, 32) => "96_32",
        (128, 32) => "128_32",
        (32, _) => "32_64",
        (64, _) => "64_64",
        (96, _) => "96_64",
        (128, _) => "128_64",
        _ => {
            return Err(TensorError::InvalidArgument {
                op: "attention",
                reason: format!("no split-TF32 attention kernel for head dim {head_dim}"),
            })
        }
    };
    Ok((suffix, padded, streamed))
}

/// The launch shape over `rows` rows of each of `pairs` (batch, head) pairs (query heads, or
/// key/value heads for dK/dV), with shared memory for `tiles` f32 rows of `padded + 4` and
/// `stats` f32 values.
fn config(pairs: usize, rows: usize, padded: usize, tiles: usize, stats: usize) -> LaunchConfig {
    let bytes = tiles * (padded + CHUNK) * 4 + stats * 4;
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
        Module::AttentionTf32,
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
    let (suffix, padded, streamed) = variant(dims.head_dim, dims.keys)?;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out])?;
    // Q, and two buffers each of K and V.
    let rows = ROWS + 4 * streamed;
    let config = config(dims.batch * dims.heads, dims.queries, padded, rows, 0);
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
        ("attention_tf32_forward", suffix),
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
    // One tile height for both kernels (the dQ kernel streams keys, the dK/dV kernel queries).
    let (suffix, padded, streamed) = variant(dims.head_dim, dims.keys.min(dims.queries))?;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv])?;
    // Two tiles of own rows (Q and dO, or K and V) and two buffers each of the streamed two.
    let rows = 2 * ROWS + 4 * streamed;
    // Δ per query, from the caching allocator, returned (in stream order) after the launches.
    let delta = Scratch::new(backend, (dims.batch * dims.heads * dims.queries * 4) as u64)?;
    let delta_address = Param::U64(delta.address());
    if dims.queries > 0 {
        // Q, dO, and two buffers each of K and V; log-sum-exp and Δ of the block's queries.
        let config = config(
            dims.batch * dims.heads,
            dims.queries,
            padded,
            rows,
            2 * ROWS,
        );
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
            ("attention_tf32_backward_dq", suffix),
            config,
            &params,
            args,
        )?;
    }
    if dims.keys > 0 {
        // K, V, and two buffers each of Q and dO with their queries' statistics.
        // One block per (batch, key/value head) and 64 keys, over the group's query heads.
        let config = config(
            dims.batch * dims.kv_heads,
            dims.keys,
            padded,
            rows,
            4 * streamed,
        );
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
            ("attention_tf32_backward_dkdv", suffix),
            config,
            &params,
            args,
        )?;
    }
    Ok(())
}
