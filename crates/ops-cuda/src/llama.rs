//! The Llama family: launches of `kernels/llama.cu` — RMSNorm forward and backward, SwiGLU
//! forward and backward, and the rotary embedding (its transpose is the backward).
//!
//! Each op picks a vectorised kernel (16-byte loads and stores) when every row operand is
//! 16-byte aligned and rows hold whole vectors, else a scalar one that takes any alignment:
//! - RMSNorm: one block per row keeping the row in registers (up to 4 vectors a thread, 256
//!   threads), so x is read once. The backward's block takes several rows at a time (8 vectors
//!   of x and of dy in flight per thread, see [`backward_rows_per_pass`]), writes their dx and
//!   keeps its column sums of the weight gradient in registers; each block writes them once to
//!   its row of a scratch `[blocks, n]` in f32 (f64 for f64), and a second kernel adds the
//!   rows. Blocks: 2 per SM at 256 threads, 3 for 16-bit types at one vector a thread (more
//!   for narrower rows, at most 16 an SM), so the scratch is `blocks · n · 4` bytes:
//!   396 · 2048 · 4 = 3.2 MB for Llama-3.2-1B's 2048 in bf16.
//! - SwiGLU: rows along the grid's y, a row's vectors along x; `gate` and `up` may have any row
//!   stride (halves of a packed projection).
//! - Rotary: a flat walk over (row, unit) pairs, a row being one head at one position and a
//!   unit an element (or 16-byte vector) of its first half; any strides (the scalar kernel) or
//!   unit last strides (the vector one).
//!
//! Shapes and dtypes are checked by autograd-core's shared rules (`dims()` of the argument
//! structs). This family sits on the ground floor and imports no other family.

use cudarc::driver::{DeviceRepr, LaunchConfig};
use headroom_autograd_core::{
    DType, GateUp, Result, RmsNormBackward, RmsNormForward, RotaryArgs, SwiGluBackward,
    SwiGluForward, View,
};

use crate::device::CudaBackend;
use crate::kernels::{float_suffix, KernelName, Module};
use crate::launch::{checked_grid, launch_in, Param, NO_ARGS};
use crate::operands::element_address;
use crate::scratch::Scratch;

/// Threads per block at most, and of the scalar row kernels.
const THREADS: u64 = 256;
/// Blocks of a row launch at most (the kernels loop over the rest): a few waves of an H200.
const MAX_ROW_BLOCKS: u64 = 132 * 16;
/// Blocks of the vectorised RMSNorm forward at most: one a row up to 64 an SM. Measured on the
/// H200 at 8192 × 2048 (`scripts/cuda/rms_norm_forward_shapes.cu`): in f32 one block a row ran
/// 5% faster than 16 blocks an SM walking the rows; in bf16 the 8% came from one block a row
/// together with four vectors a thread ([`RowShare::Forward`]: 19.9 µs against 21.5 for one
/// vector of 256 threads on 2112 blocks, which one block a row alone does not beat).
const MAX_FORWARD_ROW_BLOCKS: u64 = 132 * 64;
/// An H200's streaming multiprocessors.
const SMS: u64 = 132;
/// Blocks of the scalar RMSNorm backward that sums the weight gradient: each writes one `[n]`
/// row of partial sums, so enough to stream x and dy at full speed and few enough that adding
/// the partials stays a small fraction of the traffic.
const WEIGHT_GRAD_BLOCKS: u64 = SMS * 3;
/// Threads an SM of the vectorised RMSNorm backward that sums the weight gradient runs at
/// `per_thread` vectors a thread: its launch bounds (`backward_blocks_per_sm` of `llama.cu`),
/// three blocks of 256 for 16-bit types at one vector a thread, else two; or more blocks of
/// narrower rows, each with its own `[n]` row of partial sums (so about the same bytes).
fn weight_grad_threads_per_sm(dtype: DType, per_thread: u64) -> u64 {
    if dtype.size_in_bytes() == 2 && per_thread == 1 {
        768
    } else {
        512
    }
}
/// Columns and rows of threads of a block of `rms_norm_weight_grad_finish` (llama.cu's
/// FINISH_COLS x FINISH_ROWS, its launch bounds): each thread adds every 128th partial row of
/// its column, then the block adds its rows as a tree.
const FINISH_BLOCK: (u32, u32, u32) = (8, 128, 1);
/// Blocks of a flat grid-stride launch at most: enough to fill an H200 several times over.
const MAX_FLAT_BLOCKS: u64 = 132 * 32;
/// Rows along the grid's y at most (CUDA's limit); the kernels loop over the rest.
const MAX_GRID_Y: u64 = 65_535;

/// The vectorised RMSNorm kernels by vectors per thread (1, 2, 4).
const RMS_VEC_FORWARD: [&str; 3] = ["rms_norm_v1", "rms_norm_v2", "rms_norm_v4"];
const RMS_VEC_BACKWARD: [&str; 3] = [
    "rms_norm_backward_v1",
    "rms_norm_backward_v2",
    "rms_norm_backward_v4",
];

/// Elements of `dtype` in a 16-byte vector.
fn per_vector(dtype: DType) -> u64 {
    (16 / dtype.size_in_bytes()) as u64
}

/// Whether every address is 16-byte aligned and every element stride a whole number of vectors.
fn vectorisable(dtype: DType, addresses: &[u64], strides: &[u64]) -> bool {
    let per_vector = per_vector(dtype);
    addresses.iter().all(|a| a.is_multiple_of(16))
        && strides.iter().all(|s| s.is_multiple_of(per_vector))
}

/// How the vectorised RMSNorm kernels share a row among a block's threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowShare {
    /// The fewest vectors a thread (the backward, whose weight-gradient sums take registers
    /// per vector).
    Narrow,
    /// For 16-bit types the most vectors a thread that still leaves a whole warp (more rows in
    /// flight an SM; measured on the H200 at 8192 × 2048 in bf16, 4 vectors × 64 threads ran 8%
    /// faster than 1 × 256), for wider types the fewest (f32: 2 × 256 beat 4 × 128 by 2%).
    Forward,
}

/// The slot of the vectorised RMSNorm kernels (vectors per thread 1, 2, 4 → 0..3) and the
/// threads per block for rows of `n` elements, when they apply (`n` a whole number of vectors,
/// at most 256 · 4 of them, every operand aligned, the weight dense).
fn rms_vec_plan(
    dtype: DType,
    n: u64,
    addresses: &[u64],
    weight_stride: u64,
    share: RowShare,
) -> Option<(usize, u32)> {
    let per_vector = per_vector(dtype);
    if n == 0 || !n.is_multiple_of(per_vector) || weight_stride != 1 {
        return None;
    }
    if !vectorisable(dtype, addresses, &[]) {
        return None;
    }
    let vectors = n / per_vector;
    let fits = |&(_, per_thread): &(usize, u64)| vectors <= THREADS * per_thread;
    let narrowest = [(0, 1), (1, 2), (2, 4)].into_iter().find(fits)?;
    let (slot, per_thread) = match share {
        RowShare::Forward if dtype.size_in_bytes() == 2 => [(2, 4), (1, 2)]
            .into_iter()
            .find(|&(slot, per_thread)| slot > narrowest.0 && vectors.div_ceil(per_thread) >= 32)
            .unwrap_or(narrowest),
        _ => narrowest,
    };
    let threads = vectors.div_ceil(per_thread).div_ceil(32) * 32;
    Some((slot, threads as u32))
}

/// Rows a block of the vectorised RMSNorm backward takes at a time with `per_thread` vectors a
/// thread: `backward_rows_per_pass` of `llama.cu` (8 vectors of x and of dy in flight a thread;
/// 4 for f64, and for 16-bit types at 1 or 4 vectors a thread). It sets only the block count:
/// the kernel walks all rows whatever the grid, so a mismatch would cost balance, not
/// correctness.
fn backward_rows_per_pass(dtype: DType, per_thread: u64) -> u64 {
    match dtype.size_in_bytes() {
        8 => 4 / per_thread,
        2 if per_thread == 4 => 1,
        2 if per_thread == 1 => 4,
        _ => 8 / per_thread,
    }
}

/// One block of `threads` per row, at most `max_blocks` blocks.
fn row_config(rows: u64, threads: u32, max_blocks: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, max_blocks) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The `[n]` stride of a parameter view.
fn param_stride(view: &View<'_>) -> u64 {
    view.layout.strides().first().copied().unwrap_or(1) as u64
}

pub(crate) fn rms_norm(backend: &CudaBackend, args: RmsNormForward<'_>) -> Result<()> {
    let op = "rms_norm";
    let (rows, n) = args.dims()?;
    let (rows, n) = (rows as u64, n as u64);
    if rows == 0 {
        return Ok(());
    }
    let suffix = float_suffix(op, args.x.dtype)?;
    let (x, out) = (element_address(&args.x), element_address(&args.out));
    let (w, ws) = (element_address(&args.weight), param_stride(&args.weight));
    let rstd = element_address(&args.rstd);
    let eps = Param::F64(args.eps);
    let plan = rms_vec_plan(args.x.dtype, n, &[x, out, w], ws, RowShare::Forward);
    let (name, threads, max_blocks) = match plan {
        Some((slot, threads)) => (RMS_VEC_FORWARD[slot], threads, MAX_FORWARD_ROW_BLOCKS),
        None => ("rms_norm_rows", THREADS as u32, MAX_ROW_BLOCKS),
    };
    // The row kernel takes the weight's stride after its address; the vectorised ones do not.
    let mut params = vec![Param::U64(x), Param::U64(w)];
    if plan.is_none() {
        params.push(Param::U64(ws));
    }
    params.extend([Param::U64(out), Param::U64(rstd), eps]);
    params.extend([rows, n].map(Param::U64));
    let config = row_config(rows, threads, max_blocks);
    let name = (name, suffix);
    launch_in(backend, Module::Llama, op, name, config, &params, NO_ARGS)
}

pub(crate) fn rms_norm_backward(backend: &CudaBackend, args: RmsNormBackward<'_>) -> Result<()> {
    let op = "rms_norm_backward";
    let (rows, n) = args.dims()?;
    let (rows, n) = (rows as u64, n as u64);
    let suffix = float_suffix(op, args.x.dtype)?;
    if n == 0 {
        return Ok(());
    }
    let (dy, x) = (element_address(&args.dy), element_address(&args.x));
    let (w, ws) = (element_address(&args.weight), param_stride(&args.weight));
    let rstd = element_address(&args.rstd);
    let dx = args.dx.as_ref().map_or(0, element_address);
    let mut addresses = vec![dy, x, w];
    addresses.extend(args.dx.as_ref().map(element_address));
    let plan = rms_vec_plan(args.x.dtype, n, &addresses, ws, RowShare::Narrow);
    let (name, threads, rows_per_pass, weight_grad_blocks) = match plan {
        Some((slot, threads)) => {
            let per_thread = 1 << slot;
            let rows_per_pass = backward_rows_per_pass(args.x.dtype, per_thread);
            let per_sm = weight_grad_threads_per_sm(args.x.dtype, per_thread) / u64::from(threads);
            let blocks = SMS * per_sm.clamp(2, 16);
            (RMS_VEC_BACKWARD[slot], threads, rows_per_pass, blocks)
        }
        None => (
            "rms_norm_backward_rows",
            THREADS as u32,
            1,
            WEIGHT_GRAD_BLOCKS,
        ),
    };
    let max_blocks = match args.dweight {
        Some(_) => weight_grad_blocks,
        None => MAX_ROW_BLOCKS,
    };
    // No rows: no partial sums, and the finish below writes a zero weight gradient.
    let blocks = rows.div_ceil(rows_per_pass).min(max_blocks);
    // Each block's `[n]` column sums of the weight gradient (accumulation type), added below.
    let accumulator = if args.x.dtype == DType::F64 { 8 } else { 4 };
    let scratch = match args.dweight {
        Some(_) => Some(Scratch::new(backend, blocks * n * accumulator)?),
        None => None,
    };
    let partial = scratch.as_ref().map_or(0, Scratch::address);
    let mut params = vec![
        Param::U64(dy),
        Param::U64(x),
        Param::U64(rstd),
        Param::U64(w),
    ];
    if plan.is_none() {
        params.push(Param::U64(ws));
    }
    params.extend([dx, partial, rows, n].map(Param::U64));
    if rows > 0 {
        let config = row_config(rows, threads, blocks);
        launch_in(
            backend,
            Module::Llama,
            op,
            (name, suffix),
            config,
            &params,
            NO_ARGS,
        )?;
    }
    let Some(dweight) = args.dweight else {
        return Ok(());
    };
    // `rms_norm_weight_grad_finish`: a block adds the blocks' partial sums of 8 columns.
    let finish = LaunchConfig {
        grid_dim: checked_grid(op, n.div_ceil(u64::from(FINISH_BLOCK.0)), 1, 1)?,
        block_dim: FINISH_BLOCK,
        shared_mem_bytes: 0,
    };
    let params = [
        Param::U64(partial),
        Param::U64(blocks),
        Param::U64(element_address(&dweight)),
        Param::U64(param_stride(&dweight)),
        Param::U64(n),
    ];
    let name = ("rms_norm_weight_grad_finish", suffix);
    launch_in(backend, Module::Llama, op, name, finish, &params, NO_ARGS)
}

/// Rows along y (at most CUDA's limit), `units` per row along x in blocks of 256 threads.
fn rows_by_units(op: &'static str, rows: u64, units: u64) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: checked_grid(
            op,
            units.div_ceil(THREADS).max(1),
            rows.clamp(1, MAX_GRID_Y),
            1,
        )?,
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The row stride of a `[rows, n]` operand with a contiguous last dim.
fn row_stride(view: &View<'_>) -> u64 {
    view.layout.strides().first().copied().unwrap_or(0) as u64
}

/// Launches the SwiGLU kernel `family` (`swiglu` or `swiglu_backward`): `gate` and `up` with
/// their row strides, then the dense operands `dense` (read, then written).
fn launch_swiglu(
    backend: &CudaBackend,
    op: &'static str,
    family: [&'static str; 2],
    GateUp { gate, up }: GateUp<'_>,
    dense: &[u64],
    (rows, n): (usize, usize),
) -> Result<()> {
    let (rows, n) = (rows as u64, n as u64);
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let suffix = float_suffix(op, gate.dtype)?;
    let (gs, us) = (row_stride(&gate), row_stride(&up));
    let (g, u) = (element_address(&gate), element_address(&up));
    let mut addresses = vec![g, u];
    addresses.extend(dense);
    let vec = vectorisable(gate.dtype, &addresses, &[gs, us, n]);
    let units = if vec { n / per_vector(gate.dtype) } else { n };
    let mut params = vec![Param::U64(g), Param::U64(gs), Param::U64(u), Param::U64(us)];
    params.extend(dense.iter().map(|&address| Param::U64(address)));
    params.extend([Param::U64(rows), Param::U64(n)]);
    let config = rows_by_units(op, rows, units)?;
    let name: KernelName = (family[usize::from(!vec)], suffix);
    launch_in(backend, Module::Llama, op, name, config, &params, NO_ARGS)
}

pub(crate) fn swiglu(backend: &CudaBackend, args: SwiGluForward<'_>) -> Result<()> {
    let dims = args.dims()?;
    let dense = [element_address(&args.out)];
    let family = ["swiglu_v", "swiglu_s"];
    launch_swiglu(backend, "swiglu", family, args.inputs, &dense, dims)
}

pub(crate) fn swiglu_backward(backend: &CudaBackend, args: SwiGluBackward<'_>) -> Result<()> {
    let dims = args.dims()?;
    let dense = [&args.dout, &args.grads.gate, &args.grads.up].map(element_address);
    let family = ["swiglu_backward_v", "swiglu_backward_s"];
    launch_swiglu(
        backend,
        "swiglu_backward",
        family,
        args.inputs,
        &dense,
        dims,
    )
}

/// `RotaryShape` of `llama.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RotaryShape {
    shape: [u64; 4],
    x_strides: [u64; 4],
    out_strides: [u64; 4],
}

// SAFETY: `repr(C)`, plain u64 arrays, laid out exactly like `RotaryShape` in `kernels/llama.cu`
// (no padding).
unsafe impl DeviceRepr for RotaryShape {}

pub(crate) fn rotary_embedding(backend: &CudaBackend, args: RotaryArgs<'_>) -> Result<()> {
    let op = "rotary_embedding";
    let dims = args.dims()?;
    let suffix = float_suffix(op, args.x.dtype)?;
    let widen = |values: [usize; 4]| values.map(|v| v as u64);
    let shape = RotaryShape {
        shape: widen(dims.shape),
        x_strides: widen(dims.x_strides),
        out_strides: widen(dims.out_strides),
    };
    let [outer, heads, seq, head_dim] = shape.shape;
    let (rows, half) = (outer * heads * seq, head_dim / 2);
    if rows == 0 || half == 0 {
        return Ok(());
    }
    let addresses = [&args.x, &args.cos, &args.sin, &args.out].map(element_address);
    let unit_last = shape.x_strides[3] == 1 && shape.out_strides[3] == 1;
    let mut strides = shape.x_strides[..3].to_vec();
    strides.extend(&shape.out_strides[..3]);
    strides.push(half);
    let vec = unit_last && vectorisable(args.x.dtype, &addresses, &strides);
    let units = if vec {
        half / per_vector(args.x.dtype)
    } else {
        half
    };
    let params = addresses
        .map(Param::U64)
        .into_iter()
        .chain([Param::I32(i32::from(args.transpose))])
        .collect::<Vec<_>>();
    // A flat grid-stride walk over (row, unit) pairs.
    let config = LaunchConfig {
        grid_dim: (
            (rows * units).div_ceil(THREADS).clamp(1, MAX_FLAT_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = (if vec { "rotary_v" } else { "rotary_s" }, suffix);
    launch_in(
        backend,
        Module::Llama,
        op,
        name,
        config,
        &params,
        Some(shape),
    )
}
