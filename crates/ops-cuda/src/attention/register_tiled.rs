//! Fused scaled-dot-product attention for f32 and f64 (`kernels/attention.cu`): forward, and
//! backward as a dQ kernel (which also writes each query's `Δ = dO·O`) followed by a dK/dV
//! kernel, over shared-memory tiles with no `[queries, keys]` matrix in memory.
//!
//! Blocks of 64 threads take 32 rows of one (batch, head) pair; each thread holds 4 rows × `dc`
//! head columns of the output tile in registers (`dc` = 4, 8, 12 or 16: head dims up to 128).
//! The dK/dV blocks take one (batch, key/value head) pair and sum its group's query heads in
//! registers; packed sequences' boundaries travel in `AttnArgs`.
//! `Δ` lives in scratch from the caching allocator for the duration of the backward. With dropout
//! the kernels are their `_dropout_` builds (f32 at `dc` 8 or 16, f64 at 16: the head dim padded
//! to 64 or 128), every probability's keep bit derived from its index.
//!
//! With `HEADROOM_ATTENTION_FUSED_BACKWARD=1` ([`FUSED_BACKWARD_VARIABLE`]) the backward is one
//! pass over the keys instead: a kernel writes `Δ` and zeroes dQ, then each 32-key block computes
//! its dK and dV and adds its share of dQ atomically (five tile products per key and query tile
//! instead of seven; dQ's summation order then varies between runs).
//!
//! This path sits on the attention family's `args.rs` and the ground floor, and imports no other
//! path; the family's entry point (`mod.rs`) sends f32 and f64 here.

use std::sync::OnceLock;

use cudarc::driver::LaunchConfig;
use headroom_autograd_core::{
    AttentionBackward, AttentionDims, AttentionForward, DType, Result, TensorError,
};

use super::args::{address, attn_args, to_u32, AttnArgs};
use crate::device::CudaBackend;
use crate::kernels::{KernelName, Module};
use crate::launch::{launch_in, Param};
use crate::scratch::Scratch;

/// Threads per block of every attention kernel (`THREADS` in the kernels).
const THREADS: u32 = 64;
/// Rows per block and per streamed tile (`BQ` and `BK` in the kernels).
const ROWS: usize = 32;
/// Row stride of the probability tiles in shared memory (`WS` in the kernels).
const WEIGHT_STRIDE: usize = 36;

/// Output columns per thread for `head_dim` (head dims up to 8 × that), and the kernel suffix.
fn variant(dtype: DType, head_dim: usize, dropout: bool) -> Result<(usize, &'static str)> {
    let dc = match head_dim {
        // The dropout builds: f32 at DC 8 and 16, f64 at 16 (head dims padded to 64 or 128).
        0..=64 if dropout && dtype == DType::F32 => 8,
        0..=128 if dropout => 16,
        0..=32 => 4,
        33..=64 => 8,
        65..=96 => 12,
        97..=128 => 16,
        _ => {
            return Err(TensorError::InvalidArgument {
                op: "attention",
                reason: format!("head dim {head_dim} exceeds the fused kernels' 128"),
            })
        }
    };
    let suffix = match (dtype, dc) {
        (DType::F32, 4) => "f32_4",
        (DType::F32, 8) => "f32_8",
        (DType::F32, 12) => "f32_12",
        (DType::F32, _) => "f32_16",
        (DType::F64, 4) => "f64_4",
        (DType::F64, 8) => "f64_8",
        (DType::F64, 12) => "f64_12",
        (DType::F64, _) => "f64_16",
        (dtype, _) => {
            return Err(TensorError::UnsupportedDtype {
                op: "attention",
                dtype,
            })
        }
    };
    Ok((dc, suffix))
}

/// Set to `1`: the one-pass backward with atomic dQ (see the module docs).
pub(crate) const FUSED_BACKWARD_VARIABLE: &str = "HEADROOM_ATTENTION_FUSED_BACKWARD";

pub(crate) fn fused_backward() -> bool {
    static FUSED: OnceLock<bool> = OnceLock::new();
    *FUSED.get_or_init(|| std::env::var(FUSED_BACKWARD_VARIABLE).is_ok_and(|value| value == "1"))
}

/// The tiled attention kernels (their shared-memory maps differ).
#[derive(Debug, Clone, Copy)]
enum Kernel {
    Forward,
    BackwardDq,
    BackwardDkDv,
    BackwardFused,
}

/// The launch shape of `kernel` over `rows` rows per (batch, head) pair: query heads, or
/// key/value heads for the kernels whose own rows are keys (each block sums its group).
fn config(
    dims: &AttentionDims,
    kernel: Kernel,
    dc: usize,
    rows: usize,
    dtype: DType,
) -> Result<LaunchConfig> {
    // Row tiles [ROWS][8·dc + 4], weight tiles [ROWS][WEIGHT_STRIDE] and ROWS-long statistics
    // (see the kernels' shared-memory maps).
    let padded = 8 * dc + 4;
    let (row_tiles, weight_tiles, stats) = match kernel {
        Kernel::Forward => (3, 1, 0),
        Kernel::BackwardDq => (4, 1, 2),
        Kernel::BackwardDkDv => (4, 2, 2),
        Kernel::BackwardFused => (4, 3, 2),
    };
    let values = row_tiles * ROWS * padded + weight_tiles * ROWS * WEIGHT_STRIDE + stats * ROWS;
    let heads = match kernel {
        Kernel::Forward | Kernel::BackwardDq => dims.heads,
        Kernel::BackwardDkDv | Kernel::BackwardFused => dims.kv_heads,
    };
    Ok(LaunchConfig {
        grid_dim: (
            to_u32(rows.div_ceil(ROWS).max(1))?,
            to_u32(dims.batch * heads)?,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: to_u32(values * stats_bytes(dtype))?,
    })
}

/// Bytes of one accumulator value (and statistic): 8 for f64, 4 otherwise.
fn stats_bytes(dtype: DType) -> usize {
    if dtype == DType::F64 {
        8
    } else {
        4
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
        Module::Attention,
        op,
        name,
        config,
        params,
        Some(args),
    )
}

/// Forward; the entry point (`mod.rs`) computed the dims and returned early when there is nothing
/// to compute.
pub(crate) fn forward(
    backend: &CudaBackend,
    f: AttentionForward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let (dc, suffix) = variant(f.q.dtype, dims.head_dim, f.dropout.is_some())?;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out])?;
    let config = config(&dims, Kernel::Forward, dc, dims.queries, f.q.dtype)?;
    let params = [f.q, f.k, f.v, f.out, f.lse].map(|v| address(&v));
    launch(
        backend,
        "attention",
        (
            if f.dropout.is_some() {
                "attention_forward_dropout"
            } else {
                "attention_forward"
            },
            suffix,
        ),
        config,
        &params,
        args,
    )
}

/// Backward; the entry point (`mod.rs`) computed the dims and returned early when there are no
/// (batch, head) pairs or no head dim.
pub(crate) fn backward(
    backend: &CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let f = b.forward;
    let (dc, suffix) = variant(f.q.dtype, dims.head_dim, f.dropout.is_some())?;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv])?;
    let stats = stats_bytes(f.q.dtype);
    let rows = dims.batch * dims.heads * dims.queries;
    // Δ per query, from the caching allocator, returned (in stream order) after the launches.
    let delta = Scratch::new(backend, (rows * stats) as u64)?;
    let delta_address = Param::U64(delta.address());
    // The one-pass kernel takes no dropout: a dropping backward runs the two kernels.
    if fused_backward() && f.dropout.is_none() {
        return fused(backend, b, dims, (dc, suffix), args, delta_address);
    }
    if dims.queries > 0 {
        let config = config(&dims, Kernel::BackwardDq, dc, dims.queries, f.q.dtype)?;
        let params = [
            address(&f.q),
            address(&f.k),
            address(&f.v),
            address(&f.out),
            address(&b.dout),
            address(&f.lse),
            address(&b.dq),
            delta_address,
        ];
        launch(
            backend,
            "attention_backward",
            (
                if f.dropout.is_some() {
                    "attention_backward_dq_dropout"
                } else {
                    "attention_backward_dq"
                },
                suffix,
            ),
            config,
            &params,
            args,
        )?;
    }
    if dims.keys > 0 {
        let config = config(&dims, Kernel::BackwardDkDv, dc, dims.keys, f.q.dtype)?;
        let params = [
            address(&f.q),
            address(&f.k),
            address(&f.v),
            address(&b.dout),
            address(&f.lse),
            delta_address,
            address(&b.dk),
            address(&b.dv),
        ];
        launch(
            backend,
            "attention_backward",
            (
                if f.dropout.is_some() {
                    "attention_backward_dkdv_dropout"
                } else {
                    "attention_backward_dkdv"
                },
                suffix,
            ),
            config,
            &params,
            args,
        )?;
    }
    Ok(())
}

/// The one-pass backward: `Δ` and a zeroed dQ, then dK, dV and dQ's shares per 32-key block.
fn fused(
    backend: &CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
    (dc, suffix): (usize, &'static str),
    args: AttnArgs,
    delta_address: Param,
) -> Result<()> {
    let f = b.forward;
    let rows = dims.batch * dims.heads * dims.queries;
    if rows > 0 {
        // One warp per query row, two warps a block.
        let config = LaunchConfig {
            grid_dim: (to_u32(rows.div_ceil(2))?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let delta_suffix = if f.q.dtype == DType::F64 {
            "f64"
        } else {
            "f32"
        };
        let params = [
            address(&f.out),
            address(&b.dout),
            delta_address,
            address(&b.dq),
        ];
        launch(
            backend,
            "attention_backward",
            ("attention_backward_delta_zero", delta_suffix),
            config,
            &params,
            args,
        )?;
    }
    if dims.keys > 0 {
        let config = config(&dims, Kernel::BackwardFused, dc, dims.keys, f.q.dtype)?;
        let params = [
            address(&f.q),
            address(&f.k),
            address(&f.v),
            address(&b.dout),
            address(&f.lse),
            delta_address,
            address(&b.dq),
            address(&b.dk),
            address(&b.dv),
        ];
        launch(
            backend,
            "attention_backward",
            ("attention_backward_fused", suffix),
            config,
            &params,
            args,
        )?;
    }
    Ok(())
}
