//! fp8 training's quantize on the GPU (`kernels/float8.cuh`, built as `float8.cu` for compute_80
//! and `float8_sm89.cu` for compute_89, where codes are converted by instructions): a tensor's
//! amax, scale and 8-bit codes, and the scales' reciprocals the product takes. Tensorwise runs
//! three launches (each block's amax over its rows into a partial, the scale and its reciprocal
//! from the partials in one block, the codes; two, and one read, with a given scale and no amax
//! wanted), rowwise one (a block a row reads its row twice: amax, then codes). Inputs f32, bf16
//! or f16 with any strides; f64 answers "not here" (the core composes it), and so does a GELU to
//! apply first anywhere but the dense row-major tensorwise kernels, which apply it as they read.
//! A GELU linear's 16-bit input takes its amax from the pre-activation's extremes (one read, no
//! GELU per element: `float8_extrema_dense`, `float8_scale_gelu`; the same bits, the kernel's
//! comment says why; [`GELU_AMAX_VARIABLE`] turns it off). The fp8 product is the linear
//! layers' (`linear.rs`, cuBLASLt).
//!
//! This family sits on the ground floor and imports no other family; it knows nothing of
//! recipes or autograd: it sees views, never tensors.

use cudarc::driver::LaunchConfig;
use headroom_autograd_core::{
    float8_quantize_dims, DType, Float8Granularity, Float8Quantize, Result, UnaryOp, View,
};

use crate::device::CudaBackend;
use crate::kernels::{KernelName, Module};
use crate::launch::{checked_grid, launch_in, Param, NO_ARGS};
use crate::operands::element_address;
use crate::scratch::Scratch;

/// Threads of a quantize block (`THREADS` of float8.cu).
const THREADS: u32 = 256;
/// Blocks of a quantize launch at most (the kernels loop over the rest): a few waves of an
/// H200; also the tensorwise partials' count.
const MAX_BLOCKS: u64 = 132 * 8;

/// The input dtypes the kernels take, in the order of each family's table below.
fn input_index(dtype: DType) -> Option<usize> {
    match dtype {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}

/// The amax kernels, `<family>_<input>`: strided and dense.
const AMAX: [KernelName; 3] = [
    ("float8_amax", "f32"),
    ("float8_amax", "bf16"),
    ("float8_amax", "f16"),
];
const AMAX_DENSE: [KernelName; 3] = [
    ("float8_amax_dense", "f32"),
    ("float8_amax_dense", "bf16"),
    ("float8_amax_dense", "f16"),
];

/// The kernels that write codes, `<family>_<input>` by input, completed by [`with_codes`]:
/// strided, dense row-major, dense column-major (tensorwise) and rowwise.
/// A GELU linear's 16-bit input (bf16, f16): its extremes, and the scale from them
/// (`float8.cuh`'s `GELU_FAST_BOUND`).
const EXTREMA_DENSE: [KernelName; 2] = [
    ("float8_extrema_dense", "bf16"),
    ("float8_extrema_dense", "f16"),
];
const SCALE_GELU: [KernelName; 2] = [("float8_scale_gelu", "bf16"), ("float8_scale_gelu", "f16")];

/// Set to `exact`, the environment variable that takes a GELU linear's activation amax element
/// by element (the GELU computed in the amax pass too) instead of from the pre-activation's
/// extremes: the same scale, for measuring one against the other.
pub(crate) const GELU_AMAX_VARIABLE: &str = "HEADROOM_FLOAT8_GELU_AMAX";

/// Whether a GELU linear's 16-bit input takes its amax from its extremes.
fn gelu_amax_from_extremes() -> bool {
    static EXTREMES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *EXTREMES.get_or_init(|| std::env::var(GELU_AMAX_VARIABLE).map_or(true, |v| v != "exact"))
}

const CAST: [&str; 3] = ["float8_cast_f32", "float8_cast_bf16", "float8_cast_f16"];
const CAST_DENSE: [&str; 3] = [
    "float8_cast_dense_f32",
    "float8_cast_dense_bf16",
    "float8_cast_dense_f16",
];
const CAST_COLUMNS: [&str; 3] = [
    "float8_cast_columns_f32",
    "float8_cast_columns_bf16",
    "float8_cast_columns_f16",
];
const ROWWISE: [&str; 3] = [
    "float8_rowwise_f32",
    "float8_rowwise_bf16",
    "float8_rowwise_f16",
];

/// `<family>_e4m3` or `<family>_e5m2`, for codes of `dtype`.
fn with_codes(family: &'static str, dtype: DType) -> KernelName {
    let codes = if dtype == DType::F8E4M3 {
        "e4m3"
    } else {
        "e5m2"
    };
    (family, codes)
}

/// One block: the scale kernels'.
fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn row_blocks(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows as u64).clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The address and element stride of an optional `[len]` f32 vector (0, 0 when absent).
fn vector(view: Option<&View<'_>>) -> (u64, i64) {
    view.map_or((0, 0), |view| {
        (element_address(view), view.layout.strides()[0] as i64)
    })
}

/// `codes`, `scale` (and `amax`) of `args.x`; `Ok(false)` for an f64 input.
pub(crate) fn quantize_float8(backend: &CudaBackend, args: Float8Quantize<'_>) -> Result<bool> {
    const OP: &str = "quantize_float8";
    let (rows, cols) = float8_quantize_dims(&args)?;
    let Some(input) = input_index(args.x.dtype) else {
        return Ok(false);
    };
    // A GELU linear's activation runs inside the dense row-major tensorwise kernels alone.
    let activation = match args.activation {
        None => 0,
        Some(UnaryOp::Gelu) => 1,
        Some(_) => 2,
    };
    let memory = dense_memory(&args.x, rows, cols);
    let fuses =
        args.granularity == Float8Granularity::Tensorwise && memory == Some(DenseMemory::RowMajor);
    if activation != 0 && !fuses {
        return Ok(false);
    }
    let codes = args.codes.dtype;
    let max_finite = args.codes.dtype.max_finite().unwrap_or(f64::from(f32::MAX));
    let strides = args.x.layout.strides();
    let (premultiply, premultiply_stride) = vector(args.premultiply.as_ref());
    let source = [
        Param::U64(element_address(&args.x)),
        Param::I64(strides[0] as i64),
        Param::I64(strides[1] as i64),
        Param::I64(rows as i64),
        Param::I64(cols as i64),
        Param::U64(premultiply),
        Param::I64(premultiply_stride),
    ];
    let delayed = args.delayed_scale.as_ref().map_or(0, element_address);
    let amax = args.amax.as_ref().map_or(0, element_address);
    let inverse = args.inverse_scale.as_ref().map_or(0, element_address);
    let (scale, code_address) = (element_address(&args.scale), element_address(&args.codes));
    let config = row_blocks(rows);
    // The scale's inputs and outputs, as every scale-writing kernel takes them last.
    let scale_outputs = [
        Param::F64(max_finite),
        Param::I32(i32::from(args.power_of_two)),
        Param::U64(delayed),
        Param::U64(scale),
        Param::U64(amax),
        Param::U64(inverse),
    ];
    match args.granularity {
        Float8Granularity::Rowwise => {
            if rows == 0 {
                return Ok(true);
            }
            let mut params = source.to_vec();
            params.extend(scale_outputs);
            params.push(Param::U64(code_address));
            let name = with_codes(ROWWISE[input], codes);
            launch_in(backend, Module::Float8, OP, name, config, &params, NO_ARGS)?;
        }
        Float8Granularity::Tensorwise => {
            // A given scale and no amax wanted: the codes in one read, no amax taken.
            let takes_amax = args.delayed_scale.is_none() || args.amax.is_some();
            if takes_amax && activation != 0 && input > 0 && gelu_amax_from_extremes() {
                // A GELU linear's 16-bit input: the amax from the pre-activation's extremes.
                launch_gelu_amax(backend, &args, input, activation, &scale_outputs)?;
            } else {
                let partial = match takes_amax {
                    true => Some(launch_amax(
                        backend,
                        &args,
                        memory,
                        &source,
                        premultiply,
                        activation,
                    )?),
                    false => None,
                };
                let (partial_address, blocks) = partial
                    .as_ref()
                    .map_or((0, 0), |(partial, blocks)| (partial.address(), *blocks));
                let mut params = vec![Param::U64(partial_address), Param::I32(blocks as i32)];
                params.extend(scale_outputs);
                let name: KernelName = ("float8_scale", "");
                launch_in(
                    backend,
                    Module::Float8,
                    OP,
                    name,
                    one_block(),
                    &params,
                    NO_ARGS,
                )?;
            }
            if rows == 0 || cols == 0 {
                return Ok(true);
            }
            match memory {
                Some(DenseMemory::RowMajor) => {
                    let params = [
                        Param::U64(element_address(&args.x)),
                        Param::I64((rows * cols) as i64),
                        Param::U64(premultiply),
                        Param::I64(premultiply_stride),
                        Param::I64(cols as i64),
                        Param::I32(activation),
                        Param::U64(scale),
                        Param::U64(code_address),
                    ];
                    let name = with_codes(CAST_DENSE[input], codes);
                    let config = vector_blocks(rows * cols, args.x.dtype);
                    launch_in(backend, Module::Float8, OP, name, config, &params, NO_ARGS)?;
                }
                Some(DenseMemory::ColumnMajor) => {
                    let params = [
                        Param::U64(element_address(&args.x)),
                        Param::I64(rows as i64),
                        Param::I64(cols as i64),
                        Param::I64(strides[1] as i64),
                        Param::U64(premultiply),
                        Param::I64(premultiply_stride),
                        Param::U64(scale),
                        Param::U64(code_address),
                    ];
                    let grid =
                        checked_grid(OP, rows.div_ceil(32) as u64, cols.div_ceil(32) as u64, 1)?;
                    let config = LaunchConfig {
                        grid_dim: grid,
                        block_dim: (32, 8, 1),
                        shared_mem_bytes: 0,
                    };
                    let name = with_codes(CAST_COLUMNS[input], codes);
                    launch_in(backend, Module::Float8, OP, name, config, &params, NO_ARGS)?;
                }
                None => {
                    let mut params = source.to_vec();
                    params.extend([Param::U64(scale), Param::U64(code_address)]);
                    let name = with_codes(CAST[input], codes);
                    launch_in(backend, Module::Float8, OP, name, config, &params, NO_ARGS)?;
                }
            }
        }
    }
    Ok(true)
}

/// The scale (amax, inverse) of a GELU linear's activation from its 16-bit dense row-major
/// pre-activation `args.x` (`input` 1 or 2): each block's extremes, then `float8_scale_gelu`.
fn launch_gelu_amax(
    backend: &CudaBackend,
    args: &Float8Quantize<'_>,
    input: usize,
    activation: i32,
    scale_outputs: &[Param],
) -> Result<()> {
    const OP: &str = "quantize_float8";
    let n = args.x.layout.numel();
    let config = vector_blocks(n, args.x.dtype);
    let blocks = config.grid_dim.0;
    let partial = Scratch::new(backend, u64::from(blocks) * 8)?;
    let x = Param::U64(element_address(&args.x));
    let params = [x, Param::I64(n as i64), Param::U64(partial.address())];
    let name = EXTREMA_DENSE[input - 1];
    launch_in(backend, Module::Float8, OP, name, config, &params, NO_ARGS)?;
    let mut params = vec![
        Param::U64(partial.address()),
        Param::I32(blocks as i32),
        x,
        Param::I64(n as i64),
        Param::I32(activation),
    ];
    params.extend_from_slice(scale_outputs);
    let name = SCALE_GELU[input - 1];
    launch_in(
        backend,
        Module::Float8,
        OP,
        name,
        one_block(),
        &params,
        NO_ARGS,
    )
}

/// Each block's amax of `args.x` into a partial (its bits), for `float8_scale`: the partials and
/// how many there are.
fn launch_amax<'b>(
    backend: &'b CudaBackend,
    args: &Float8Quantize<'_>,
    memory: Option<DenseMemory>,
    source: &[Param],
    premultiply: u64,
    activation: i32,
) -> Result<(Scratch<'b>, u32)> {
    const OP: &str = "quantize_float8";
    let (rows, cols) = (args.x.layout.shape()[0], args.x.layout.shape()[1]);
    let input = input_index(args.x.dtype).expect("checked by the caller");
    let premultiply_stride = vector(args.premultiply.as_ref()).1;
    let config = match memory {
        Some(_) => vector_blocks(rows * cols, args.x.dtype),
        None => row_blocks(rows),
    };
    let blocks = config.grid_dim.0;
    let partial = Scratch::new(backend, u64::from(blocks) * 4)?;
    let (name, params): (KernelName, Vec<Param>) = match memory {
        Some(memory) => {
            let column_step = match memory {
                DenseMemory::RowMajor => 1,
                DenseMemory::ColumnMajor => rows,
            };
            let params = vec![
                Param::U64(element_address(&args.x)),
                Param::I64((rows * cols) as i64),
                Param::U64(premultiply),
                Param::I64(premultiply_stride),
                Param::I64(column_step as i64),
                Param::I64(cols as i64),
                Param::I32(activation),
                Param::U64(partial.address()),
            ];
            (AMAX_DENSE[input], params)
        }
        None => {
            let mut params = source.to_vec();
            params.push(Param::U64(partial.address()));
            (AMAX[input], params)
        }
    };
    launch_in(backend, Module::Float8, OP, name, config, &params, NO_ARGS)?;
    Ok((partial, blocks))
}

/// How a dense input lies in memory, for the fast kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DenseMemory {
    /// Strides `[cols, 1]`.
    RowMajor,
    /// Strides `[1, rows]` (a transposed view of a row-major matrix).
    ColumnMajor,
}

/// How `x` (`[rows, cols]`) lies in memory when the fast kernels take it: dense one way or the
/// other, 16-byte aligned, a whole number of 16-byte vectors (and, column-major, more than one
/// row and one column: a vector or a single element is row-major too).
fn dense_memory(x: &View<'_>, rows: usize, cols: usize) -> Option<DenseMemory> {
    let per_vector = 16 / x.dtype.size_in_bytes();
    let n = rows * cols;
    if n == 0 || !n.is_multiple_of(per_vector) || !element_address(x).is_multiple_of(16) {
        return None;
    }
    let strides = x.layout.strides();
    if strides[1] == 1 && (strides[0] == cols || rows == 1) {
        Some(DenseMemory::RowMajor)
    } else if strides[0] == 1 && strides[1] == rows {
        Some(DenseMemory::ColumnMajor)
    } else {
        None
    }
}

/// A grid-stride launch over the 16-byte vectors of `n` elements of `dtype`.
fn vector_blocks(n: usize, dtype: DType) -> LaunchConfig {
    let vectors = (n / (16 / dtype.size_in_bytes())) as u64;
    LaunchConfig {
        grid_dim: (
            vectors.div_ceil(u64::from(THREADS)).clamp(1, MAX_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel name the launches can ask for is an entry of the committed PTX, of both
    /// builds (compute_80 and compute_89), and every entry is launched (a missing name would
    /// surface only on a GPU).
    #[test]
    fn every_launched_kernel_is_in_the_ptx() {
        let mut names: Vec<KernelName> = AMAX.into_iter().chain(AMAX_DENSE).collect();
        for family in [CAST, CAST_DENSE, CAST_COLUMNS, ROWWISE]
            .into_iter()
            .flatten()
        {
            for codes in [DType::F8E4M3, DType::F8E5M2] {
                names.push(with_codes(family, codes));
            }
        }
        names.extend(EXTREMA_DENSE.into_iter().chain(SCALE_GELU));
        // And the code transposes, which linear.rs's fp8 product launches: every entry.
        names.extend([
            ("float8_scale", ""),
            ("float8_transpose", ""),
            ("float8_transpose_words", ""),
        ]);
        for (build, ptx) in [
            ("float8.ptx", Module::Float8.ptx_for((8, 0))),
            ("float8_sm89.ptx", Module::Float8.ptx_for((9, 0))),
        ] {
            assert!(ptx.contains(if build == "float8.ptx" {
                ".target sm_80"
            } else {
                ".target sm_89"
            }));
            assert_eq!(names.len(), ptx.matches(".entry ").count(), "{build}");
            for (family, suffix) in &names {
                let name = match *suffix {
                    "" => (*family).to_owned(),
                    suffix => format!("{family}_{suffix}"),
                };
                assert!(
                    ptx.contains(&format!(".entry {name}(")),
                    "{name} is not in {build}"
                );
            }
        }
    }
}
