//! Fused scaled-dot-product attention on the GPU (`kernels/attention.cu`): forward, and backward
//! as a dQ kernel (which also writes each query's `Δ = dO·O`) followed by a dK/dV kernel — for
//! f32 and f64. f16 and bf16 take the tensor-core kernels of `attention_tc.rs` where their
//! alignment rule holds, else the cuBLAS path of `attention_gemm.rs`; all keep the same saved state.
//!
//! Operands are `[batch, heads, rows, head_dim]` views with a contiguous head dim, described to
//! the kernels by one `AttnArgs` (offset and batch/head/row strides per operand), so heads sliced
//! out of a packed projection and outputs laid out `[batch, rows, heads, head_dim]` need no copy.
//! Blocks of 64 threads take 32 rows of one (batch, head) pair; each thread holds 4 rows × `dc`
//! head columns of the output tile (`dc` = 4, 8, 12 or 16: head dims up to 128). `Δ` lives in
//! scratch from the caching allocator for the duration of the backward.

use cudarc::driver::{DeviceRepr, LaunchConfig};
use headroom_autograd_core::{
    attention_dims, AttentionBackward, AttentionDims, AttentionForward, DType, Result, TensorError,
    View,
};

use crate::attention_gemm;
use crate::attention_tc;
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

/// One operand: element offset and batch/head/row strides.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct AttnOperand {
    offset: u64,
    strides: [u64; 3],
}

/// `AttnArgs` of `attention.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct AttnArgs {
    batch: u32,
    heads: u32,
    queries: u32,
    keys: u32,
    head_dim: u32,
    causal: u32,
    /// Every operand's rows start 4-element aligned: the kernels move 4 elements at a time.
    vector: u32,
    pad: u32,
    scale: f64,
    /// q, k, v, out, dout, dq, dk, dv.
    ops: [AttnOperand; 8],
}

// SAFETY: `repr(C)`, plain integers and a double, laid out exactly like `AttnArgs` in
// `kernels/attention.cu`; passed by value as a kernel parameter.
unsafe impl DeviceRepr for AttnArgs {}

fn operand(view: &View<'_>) -> AttnOperand {
    let s = view.layout.strides();
    AttnOperand {
        offset: view.layout.offset() as u64,
        strides: [s[0] as u64, s[1] as u64, s[2] as u64],
    }
}

fn to_u32(value: usize) -> Result<u32> {
    value.try_into().map_err(|_| TensorError::InvalidArgument {
        op: "attention",
        reason: format!("size {value} exceeds the kernels' 32-bit sizes"),
    })
}

pub(crate) fn attn_args(
    dims: &AttentionDims,
    forward: &AttentionForward<'_>,
    views: &[View<'_>],
) -> Result<AttnArgs> {
    let mut args = AttnArgs {
        batch: to_u32(dims.batch)?,
        heads: to_u32(dims.heads)?,
        queries: to_u32(dims.queries)?,
        keys: to_u32(dims.keys)?,
        head_dim: to_u32(dims.head_dim)?,
        causal: u32::from(forward.causal),
        vector: 0,
        pad: 0,
        scale: forward.scale,
        ops: [AttnOperand::default(); 8],
    };
    let element = forward.q.dtype.size_in_bytes() as u64;
    let mut aligned = dims.head_dim.is_multiple_of(4);
    for (slot, view) in args.ops.iter_mut().zip(views) {
        *slot = operand(view);
        aligned &= slot.offset.is_multiple_of(4)
            && slot.strides.iter().all(|s| s.is_multiple_of(4))
            && view.buffer.address().is_multiple_of(4 * element);
    }
    args.vector = u32::from(aligned);
    Ok(args)
}

/// Output columns per thread for `head_dim` (head dims up to 8 × that), and the kernel suffix.
fn variant(dtype: DType, head_dim: usize) -> Result<(usize, &'static str)> {
    let dc = match head_dim {
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

/// The three attention kernels (their shared-memory maps differ).
#[derive(Debug, Clone, Copy)]
enum Kernel {
    Forward,
    BackwardDq,
    BackwardDkDv,
}

/// The launch shape of `kernel` over `rows` rows per (batch, head) pair.
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
    };
    let values = row_tiles * ROWS * padded + weight_tiles * ROWS * WEIGHT_STRIDE + stats * ROWS;
    Ok(LaunchConfig {
        grid_dim: (
            to_u32(rows.div_ceil(ROWS).max(1))?,
            to_u32(dims.batch * dims.heads)?,
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

/// A kernel parameter for `view`'s buffer (the offsets travel in `AttnArgs`).
pub(crate) fn address(view: &View<'_>) -> Param {
    Param::U64(view.buffer.address())
}

pub(crate) fn attention(backend: &CudaBackend, f: AttentionForward<'_>) -> Result<()> {
    let dims = attention_dims(&f, &[])?;
    if dims.batch * dims.heads * dims.queries == 0 || dims.head_dim == 0 {
        return Ok(());
    }
    if matches!(f.q.dtype, DType::F16 | DType::BF16) {
        return if attention_tc::fits(&dims, &[f.q, f.k, f.v, f.out]) {
            attention_tc::forward(backend, f, dims)
        } else {
            attention_gemm::forward(backend, f, dims)
        };
    }
    let (dc, suffix) = variant(f.q.dtype, dims.head_dim)?;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out])?;
    let config = config(&dims, Kernel::Forward, dc, dims.queries, f.q.dtype)?;
    let params = [f.q, f.k, f.v, f.out, f.lse].map(|v| address(&v));
    launch(
        backend,
        "attention",
        ("attention_forward", suffix),
        config,
        &params,
        args,
    )
}

pub(crate) fn attention_backward(backend: &CudaBackend, b: AttentionBackward<'_>) -> Result<()> {
    let f = b.forward;
    let dims = attention_dims(&f, &[b.dout, b.dq, b.dk, b.dv])?;
    if dims.batch * dims.heads == 0 || dims.head_dim == 0 {
        return Ok(());
    }
    if matches!(f.q.dtype, DType::F16 | DType::BF16) {
        let views = [f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv];
        return if attention_tc::fits(&dims, &views) {
            attention_tc::backward(backend, b, dims)
        } else {
            attention_gemm::backward(backend, b, dims)
        };
    }
    let (dc, suffix) = variant(f.q.dtype, dims.head_dim)?;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv])?;
    let stats = stats_bytes(f.q.dtype);
    let rows = dims.batch * dims.heads * dims.queries;
    // Δ per query, from the caching allocator, returned (in stream order) after the launches.
    let delta = Scratch::new(backend, (rows * stats) as u64)?;
    let delta_address = Param::U64(delta.address());
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
            ("attention_backward_dq", suffix),
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
            ("attention_backward_dkdv", suffix),
            config,
            &params,
            args,
        )?;
    }
    Ok(())
}
