//! Linear layers through cuBLASLt: the bias added in the GEMM's epilogue forward, and the bias
//! gradient reduced in the weight-gradient GEMM's epilogue backward.
//!
//! `Backend::linear` is one `cublasLtMatmul` with `CUBLASLT_EPILOGUE_BIAS` (no bias broadcast
//! into the output, no accumulate pass); exact GELU then runs as the crate's elementwise kernel on
//! the pre-activation, since cuBLASLt's GELU epilogues compute the tanh approximation, not
//! `torch.nn.GELU()`. `Backend::linear_weight_grad` is one `cublasLtMatmul` with
//! `CUBLASLT_EPILOGUE_BGRADB`: in column-major terms `dWᵀ = xᵀ · grad`, so `grad` is operand B and
//! the bias gradient is B's reduction over the GEMM's `k` (the rows).
//!
//! `Backend::matmul_float8` is one `cublasLtMatmul` with fp8 A and B and the inverse scales as
//! cuBLASLt's A and B scale pointers (read on the device, so nothing synchronises): tensorwise
//! scales as scalars, rowwise ones as outer vectors (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`,
//! one scale a row of each operand; a one-value side is broadcast into a dense vector first),
//! accumulating in f32 with fast accumulation off, into f32, bf16 or f16. Hopper's fp8 GEMMs
//! read both operands along k (the "TN" form): an operand that is not k-contiguous is first
//! written k-contiguous into scratch by `float8.cu`'s `float8_transpose` (backward's `dY·W` and
//! `dYᵀ·X`). Sizes that are not multiples of 16 (cuBLASLt's fp8 alignment) answer "not here" and
//! the core composes the product. A plan asks the heuristic with the scale pointers set (without
//! them it offered no outer-vector algorithm on the H100 or the H200; with them, every rowwise
//! problem parity asks got one on the H100, `results/2026-12-05-579a00b`). Where a plan still
//! gets none, the product runs with unit scalar scales into f32 and the scales, the bias and the
//! rounding follow as elementwise passes ([`CudaBackend::float8_scales_after_products`] counts
//! them).
//!
//! A plan (descriptors, layouts and the heuristic's algorithm) is cached per problem: dtype,
//! compute type, epilogue, transposes, sizes, leading dimensions and pointer alignments, so the
//! heuristic is queried once per shape. Whatever cuBLASLt is not given — f64, operands with
//! neither contiguous rows nor contiguous columns (a broadcast gradient, stride 0), a bias not
//! 16-byte aligned, an empty product, a problem the heuristic has no algorithm for, a machine
//! without the library — runs composed of
//! the other primitives (`compose_linear`, `compose_linear_weight_grad`), counted by
//! [`CudaBackend::linear_fallbacks`]. The handle and the plan cache are the ground floor's
//! (`blas_lt.rs`, inside `blas.rs`'s `BlasState`) and share cuBLAS's workspace (an allocation of
//! the caching allocator, so it shows in the statistics); both libraries run on the backend's one
//! stream, so their uses of it never overlap. This module sits on the ground floor and imports no
//! other family (exact GELU is reached through the `Backend` trait); it knows nothing of
//! autograd: it sees views, never tensors.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use cudarc::cublaslt::{result as lt, sys as lt_sys};
use cudarc::driver::{result, sys, LaunchConfig};
use headroom_autograd_core::{
    compose_linear, compose_linear_weight_grad, float8_matmul_dims, linear_dims,
    linear_weight_grad_dims, Backend, BinaryOp, Buffer, DType, Float8Matmul, Layout,
    LinearEpilogue, LinearForward, LinearWeightGrad, Result, UnaryOp, View,
};

use crate::blas_lt::{Epilogue, Float8Key, Float8Scales, OperandKey, Plan, PlanKey};
use crate::device::CudaBackend;
use crate::error::device_error;
use crate::kernels::{KernelName, Module};
use crate::launch::{checked_grid, launch_in, Param, NO_ARGS};
use crate::operands::{copy_raw, element_address};
use crate::scratch::Scratch;

/// cuBLASLt's fp8 GEMMs want every size and leading dimension a multiple of 16 elements.
const FLOAT8_ALIGNMENT: usize = 16;

/// One operand of a column-major product: where it is, its leading dimension, and whether the
/// product reads it transposed.
#[derive(Debug, Clone, Copy)]
struct Operand {
    address: u64,
    ld: usize,
    transposed: bool,
}

/// A column-major product `D (m × n) = op(A) (m × k) · op(B) (k × n)` with an epilogue.
#[derive(Debug, Clone, Copy)]
struct Gemm {
    dtype: DType,
    dims: (usize, usize, usize),
    a: Operand,
    b: Operand,
    d: Operand,
    epilogue: Epilogue,
    /// The bias (or bias gradient) for the epilogues that have one.
    bias: u64,
    /// An fp8 product's operand dtypes and scales (`dtype` is then D's).
    float8: Option<Float8Operands>,
}

/// The fp8 side of a [`Gemm`]: A's and B's 8-bit floats, the device addresses of the f32
/// scalars or vectors that multiply them (cuBLASLt's A and B scale pointers), and which they are.
#[derive(Debug, Clone, Copy)]
struct Float8Operands {
    dtypes: (DType, DType),
    scales: (u64, u64),
    form: Float8Scales,
}

/// A column-major fp8 product in cuBLASLt's one fp8 form ("TN"): `D (m × n) = (A_s · Aᵀ) (B_s ·
/// B)`, A stored `k × m` and B `k × n` (k contiguous in both, `ld` apart), D dense `m × n` in
/// `out_dtype`; A_s and B_s f32 scalars on the device, or (outer vectors) dense f32 vectors of
/// `m` and `n` scales, `D[i, j]` multiplied by `A_s[i] · B_s[j]`.
#[derive(Debug, Clone, Copy)]
struct Float8Gemm {
    out_dtype: DType,
    /// `(m, n, k)`.
    dims: (usize, usize, usize),
    a_dtype: DType,
    /// A's address and leading dimension.
    a: (u64, usize),
    /// The address of A's f32 scale (or its `m` scales).
    a_scale: u64,
    b_dtype: DType,
    /// B's address and leading dimension.
    b: (u64, usize),
    /// The address of B's f32 scale (or its `n` scales).
    b_scale: u64,
    /// Scalars or outer vectors.
    scales: Float8Scales,
    /// D's address (dense, leading dimension m).
    d: u64,
    /// A bias over D's rows (`m` elements in D's dtype, 16-byte aligned) added in the epilogue.
    bias: Option<u64>,
}

/// Runs `gemm` through cuBLASLt's fp8 GEMM; `Ok(false)` when the library is missing or has no
/// algorithm for it (the caller composes instead).
fn run_float8_gemm(backend: &CudaBackend, gemm: &Float8Gemm) -> Result<bool> {
    let operand = |(address, ld): (u64, usize), transposed| Operand {
        address,
        ld,
        transposed,
    };
    run(
        backend,
        &Gemm {
            dtype: gemm.out_dtype,
            dims: gemm.dims,
            a: operand(gemm.a, true),
            b: operand(gemm.b, false),
            d: operand((gemm.d, gemm.dims.0), false),
            epilogue: if gemm.bias.is_some() {
                Epilogue::Bias
            } else {
                Epilogue::Plain
            },
            bias: gemm.bias.unwrap_or(0),
            float8: Some(Float8Operands {
                dtypes: (gemm.a_dtype, gemm.b_dtype),
                scales: (gemm.a_scale, gemm.b_scale),
                form: gemm.scales,
            }),
        },
    )
}

/// How a row-major `[rows, cols]` view reaches cuBLAS without a copy, or `None`.
#[derive(Debug, Clone, Copy)]
struct Stored {
    address: u64,
    ld: usize,
    /// Contiguous rows: cuBLAS's column-major view of the memory is the matrix's transpose.
    holds_transpose: bool,
}

fn stored(view: &View<'_>) -> Option<Stored> {
    let (&[rows, cols], &[row_stride, col_stride]) = (view.layout.shape(), view.layout.strides())
    else {
        return None;
    };
    let address = element_address(view);
    // The stride of a dimension of size 1 is never stepped: the tightest leading dimension is
    // passed instead (see `matmul::as_transposed`: cuBLAS's kernels may load one stride past a
    // single row).
    if col_stride == 1 && row_stride >= cols.max(1) {
        Some(Stored {
            address,
            ld: if rows == 1 { cols.max(1) } else { row_stride },
            holds_transpose: true,
        })
    } else if row_stride == 1 && col_stride >= rows.max(1) {
        Some(Stored {
            address,
            ld: if cols == 1 { rows.max(1) } else { col_stride },
            holds_transpose: false,
        })
    } else {
        None
    }
}

impl Stored {
    /// The operand that reads the matrix itself (`transpose` false) or its transpose.
    fn operand(self, transpose: bool) -> Operand {
        Operand {
            address: self.address,
            ld: self.ld,
            transposed: self.holds_transpose != transpose,
        }
    }
}

/// `out = epilogue(input weightᵀ + bias)`.
pub(crate) fn linear(backend: &CudaBackend, args: LinearForward<'_>) -> Result<()> {
    let (rows, in_features, out_features) = linear_dims(&args)?;
    let product = match args.epilogue {
        LinearEpilogue::None => args.out,
        LinearEpilogue::Gelu { pre_activation } => pre_activation,
    };
    let gemm = match (stored(&args.weight), stored(&args.input)) {
        (Some(weight), Some(input)) => Some(Gemm {
            dtype: args.input.dtype,
            // Row-major `out = x Wᵀ` is column-major `outᵀ = W xᵀ`.
            dims: (out_features, rows, in_features),
            a: weight.operand(false),
            b: input.operand(true),
            d: dense(&product, out_features),
            epilogue: if args.bias.is_some() {
                Epilogue::Bias
            } else {
                Epilogue::Plain
            },
            bias: args.bias.map_or(0, |bias| element_address(&bias)),
            float8: None,
        }),
        _ => None,
    };
    let contiguous_bias = args.bias.is_none_or(|bias| bias.layout.strides() == [1]);
    match gemm {
        Some(gemm) if contiguous_bias && run(backend, &gemm)? => {
            if let LinearEpilogue::Gelu { pre_activation } = args.epilogue {
                backend.unary(UnaryOp::Gelu, pre_activation, args.out)?;
            }
            Ok(())
        }
        _ => {
            backend.note_linear_fallback()?;
            compose_linear(backend, args)
        }
    }
}

/// `grad_weight = grad_outᵀ input` and `grad_bias = Σ_rows grad_out`.
pub(crate) fn linear_weight_grad(backend: &CudaBackend, args: LinearWeightGrad<'_>) -> Result<()> {
    let (rows, in_features, out_features) = linear_weight_grad_dims(&args)?;
    let gemm = match (args.grad_bias, stored(&args.input), stored(&args.grad_out)) {
        (Some(grad_bias), Some(input), Some(grad_out)) => Some(Gemm {
            dtype: args.input.dtype,
            // Row-major `dW = gradᵀ x` is column-major `dWᵀ = xᵀ grad`: B is the gradient, whose
            // reduction over k (the rows) is the bias gradient.
            dims: (in_features, out_features, rows),
            a: input.operand(true),
            b: grad_out.operand(false),
            d: dense(&args.grad_weight, in_features),
            epilogue: Epilogue::BiasGradB,
            bias: element_address(&grad_bias),
            float8: None,
        }),
        // Without a bias gradient the product is cuBLAS's `matmul`, as fast.
        _ => None,
    };
    match gemm {
        Some(gemm) if run(backend, &gemm)? => Ok(()),
        _ => {
            if args.grad_bias.is_some() {
                backend.note_linear_fallback()?;
            }
            compose_linear_weight_grad(backend, args)
        }
    }
}

/// A dense row-major `[_, cols]` output as column-major D.
fn dense(view: &View<'_>, cols: usize) -> Operand {
    Operand {
        address: element_address(view),
        ld: cols,
        transposed: false,
    }
}

/// The largest power of two (at most 256) dividing `address`: cuBLASLt's alignment classes.
fn alignment(address: u64) -> u32 {
    1 << address.trailing_zeros().min(8)
}

/// Runs `gemm` through cuBLASLt; `Ok(false)` when it cannot (the caller composes instead).
fn run(backend: &CudaBackend, gemm: &Gemm) -> Result<bool> {
    let (m, n, k) = gemm.dims;
    let data_type = match gemm.dtype {
        DType::F32 => lt_sys::cudaDataType::CUDA_R_32F,
        DType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => lt_sys::cudaDataType::CUDA_R_16BF,
        _ => return Ok(false),
    };
    let has_bias = gemm.epilogue != Epilogue::Plain;
    if m == 0 || n == 0 || k == 0 || (has_bias && !gemm.bias.is_multiple_of(16)) {
        return Ok(false);
    }
    let tf32 = gemm.dtype == DType::F32 && gemm.float8.is_none() && backend.allow_tf32();
    let key = |operand: &Operand| OperandKey {
        transposed: operand.transposed,
        ld: operand.ld,
        alignment: alignment(operand.address),
    };
    let mut state = backend.blas_state()?;
    let (workspace, workspace_bytes) = state.workspace();
    let stream = backend.stream.cu_stream() as lt_sys::cudaStream_t;
    let lt_state = state.lt()?;
    let key = PlanKey {
        dtype: gemm.dtype,
        tf32,
        epilogue: gemm.epilogue,
        dims: gemm.dims,
        a: key(&gemm.a),
        b: key(&gemm.b),
        d: key(&gemm.d),
        float8: gemm.float8.map(|float8| Float8Key {
            dtypes: float8.dtypes,
            scales: float8.form,
        }),
        fast_accumulation: gemm.float8.is_some() && lt_state.float8_fast_accumulation(),
    };
    // A's scales stand in for both scale pointers while a new plan asks the heuristic.
    let scale_placeholder = gemm.float8.map_or(0, |float8| float8.scales.0);
    let Some((handle, plan)) = lt_state.plan(key, data_type, workspace_bytes, scale_placeholder)?
    else {
        return Ok(false);
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    if has_bias {
        let bias = gemm.bias as *const c_void;
        // SAFETY: the descriptor is the plan's live one; the attribute is a device pointer, of
        // the size cuBLASLt documents, read during the call.
        unsafe {
            lt::set_matmul_desc_attribute(
                plan.desc,
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                (&bias as *const *const c_void).cast(),
                std::mem::size_of::<*const c_void>(),
            )
            .map_err(|e| device_error("linear", e))?;
        }
    }
    if let Some(Float8Operands {
        scales: (a_scale, b_scale),
        ..
    }) = gemm.float8
    {
        for (attribute, scale) in [
            (
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                a_scale,
            ),
            (
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                b_scale,
            ),
        ] {
            let scale = scale as *const c_void;
            // SAFETY: the descriptor is the plan's live one; the attribute is a device pointer
            // to one f32 (the scale type), or for outer-vector scales to the dense f32 vector of
            // the operand's rows of `op(A)` (`m`) or columns of `op(B)` (`n`) the plan's scale
            // mode says, of the size cuBLASLt documents, read during the call.
            unsafe {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    attribute,
                    (&scale as *const *const c_void).cast(),
                    std::mem::size_of::<*const c_void>(),
                )
                .map_err(|e| device_error("matmul_float8", e))?;
            }
        }
    }
    let matmul = |plan: &Plan, algo: &lt_sys::cublasLtMatmulAlgo_t| {
        // SAFETY: the descriptor, layouts and algorithm were made for exactly this problem (the
        // key holds every size, leading dimension, transpose and alignment class); every address
        // is an element of a live view the core checked against its buffer, with the extents the
        // layouts describe (D is dense, C is D with beta 0); the bias (bias gradient) has D's row
        // count, contiguous and 16-byte aligned; the workspace is the BLAS state's live
        // allocation of `workspace_bytes`, used by one library at a time on this one stream;
        // alpha and beta are f32 scalars (the scale type) that outlive the call.
        unsafe {
            lt::matmul(
                handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                gemm.a.address as *const c_void,
                plan.layouts[0],
                gemm.b.address as *const c_void,
                plan.layouts[1],
                gemm.d.address as *const c_void,
                plan.layouts[2],
                gemm.d.address as *mut c_void,
                plan.layouts[2],
                algo,
                workspace as *mut c_void,
                workspace_bytes,
                stream,
            )
        }
        .map_err(|e| device_error("linear", e))
    };
    if !plan.untimed.is_empty() {
        // Beta is 0, so each candidate only overwrites D (and the bias gradient): timing them on
        // the real operands changes nothing the final product does not write again.
        let candidates: Vec<_> = std::iter::once(plan.algo)
            .chain(std::mem::take(&mut plan.untimed))
            .collect();
        let mut best: Option<(f32, lt_sys::cublasLtMatmulAlgo_t)> = None;
        for algo in candidates {
            if let Some(ms) = time_candidate(backend, || {
                (0..TUNING_REPEATS).try_for_each(|_| matmul(plan, &algo))
            })? {
                if best.is_none_or(|(fastest, _)| ms < fastest) {
                    best = Some((ms, algo));
                }
            }
        }
        if let Some((_, algo)) = best {
            plan.algo = algo;
        }
    }
    matmul(plan, &plan.algo)?;
    Ok(true)
}

/// A `[rows, cols]` matrix of codes as the fp8 GEMM reads it: rows contiguous (each row's
/// elements adjacent, rows `ld` apart), either the view itself or a dense copy in `scratch`.
struct RowMajor {
    address: u64,
    ld: usize,
}

/// `view` (`[rows, cols]` codes) with contiguous rows: as it is when its rows are, else
/// transposed into `scratch` by `float8_transpose`.
fn row_major<'a>(
    backend: &'a CudaBackend,
    view: &View<'_>,
    scratch: &mut Vec<Scratch<'a>>,
) -> Result<RowMajor> {
    const OP: &str = "matmul_float8";
    let (&[rows, cols], &[row_stride, col_stride]) = (view.layout.shape(), view.layout.strides())
    else {
        unreachable!("checked as a matrix");
    };
    let address = element_address(view);
    let ld = if rows == 1 { cols } else { row_stride };
    if (col_stride == 1 || cols == 1) && ld >= cols && ld.is_multiple_of(FLOAT8_ALIGNMENT) {
        return Ok(RowMajor { address, ld });
    }
    let dense = Scratch::new(backend, (rows * cols) as u64)?;
    // A transposed view of a row-major matrix (`[cols, rows]`, rows `col_stride` apart) in
    // whole 4-byte words takes the word-wide transpose; any other view the byte-wide one.
    let words = row_stride == 1
        && col_stride >= rows
        && [rows, cols, col_stride].iter().all(|n| n.is_multiple_of(4))
        && address.is_multiple_of(4);
    let (name, grid, block_dim, params): (KernelName, _, _, Vec<Param>) = if words {
        (
            ("float8_transpose_words", ""),
            checked_grid(OP, rows.div_ceil(64) as u64, cols.div_ceil(64) as u64, 1)?,
            (16, 16, 1),
            vec![
                Param::U64(address),
                Param::I64(cols as i64),
                Param::I64(rows as i64),
                Param::I64(col_stride as i64),
                Param::U64(dense.address()),
            ],
        )
    } else {
        (
            ("float8_transpose", ""),
            checked_grid(OP, cols.div_ceil(32) as u64, rows.div_ceil(32) as u64, 1)?,
            (32, 8, 1),
            vec![
                Param::U64(address),
                Param::I64(rows as i64),
                Param::I64(cols as i64),
                Param::I64(row_stride as i64),
                Param::I64(col_stride as i64),
                Param::U64(dense.address()),
            ],
        )
    };
    let config = LaunchConfig {
        grid_dim: grid,
        block_dim,
        shared_mem_bytes: 0,
    };
    launch_in(backend, Module::Float8, OP, name, config, &params, NO_ARGS)?;
    let address = dense.address();
    scratch.push(dense);
    Ok(RowMajor { address, ld: cols })
}

/// `out = (a · b) · a_inverse_scale · b_inverse_scale` through cuBLASLt: tensorwise scales as
/// its scalar scale pointers, rowwise ones (either operand's scales a vector) as its outer-vector
/// scales; `Ok(false)` for sizes that are not multiples of 16, or a problem cuBLASLt has no
/// algorithm for (the core composes it).
pub(crate) fn matmul_float8(backend: &CudaBackend, args: Float8Matmul<'_>) -> Result<bool> {
    let (m, k, n) = float8_matmul_dims(&args)?;
    let aligned = [m, k, n]
        .iter()
        .all(|size| *size > 0 && size.is_multiple_of(FLOAT8_ALIGNMENT));
    if !aligned {
        return Ok(false);
    }
    let mut scratch = Vec::new();
    let one_value = |scale: &View<'_>| scale.layout.strides() == [0] || scale.layout.shape() == [1];
    // cuBLASLt's A is `b`'s side and its B is `a`'s (see below).
    let (form, a_scale, b_scale) =
        if one_value(&args.a_inverse_scale) && one_value(&args.b_inverse_scale) {
            (
                Float8Scales::Scalars,
                element_address(&args.b_inverse_scale),
                element_address(&args.a_inverse_scale),
            )
        } else {
            (
                Float8Scales::OuterVectors,
                dense_scales(backend, &args.b_inverse_scale, &mut scratch)?,
                dense_scales(backend, &args.a_inverse_scale, &mut scratch)?,
            )
        };
    // Row-major `out[m, n] = a[m, k] · b[k, n]` is column-major `outᵀ = bᵀ aᵀ`: cuBLASLt's A is
    // bᵀ (`[n, k]`, read transposed: k-contiguous) and its B is a (`[m, k]` rows, k-contiguous).
    let a = row_major(backend, &args.a, &mut scratch)?;
    let b_transposed = args.b.layout.permute("matmul_float8", &[1, 0])?;
    let b = row_major(
        backend,
        &View {
            layout: &b_transposed,
            ..args.b
        },
        &mut scratch,
    )?;
    let gemm = Float8Gemm {
        out_dtype: args.out.dtype,
        dims: (n, m, k),
        a_dtype: args.b.dtype,
        a: (b.address, b.ld),
        a_scale,
        b_dtype: args.a.dtype,
        b: (a.address, a.ld),
        b_scale,
        scales: form,
        d: element_address(&args.out),
        bias: None,
    };
    // A 16-bit output takes its bias in the epilogue (cuBLASLt's fp8 bias is 16-bit); an f32
    // one gets it added after the product, the same f32 sum.
    let epilogue_bias = args.bias.filter(|bias| {
        args.out.dtype != DType::F32
            && bias.layout.strides() == [1]
            && element_address(bias).is_multiple_of(16)
    });
    if args.bias.is_some() && epilogue_bias.is_none() && args.out.dtype != DType::F32 {
        // A 16-bit output would round twice with the bias added after: the core composes it.
        return Ok(false);
    }
    let ran = run_float8_gemm(
        backend,
        &Float8Gemm {
            bias: epilogue_bias.as_ref().map(element_address),
            ..gemm
        },
    )?;
    if !ran && form == Float8Scales::OuterVectors {
        // No outer-vector algorithm for this problem: the product with unit scalar scales, then
        // the scales.
        let scaled = scale_after_the_product(backend, &args, gemm)?;
        drop(scratch);
        return Ok(scaled);
    }
    drop(scratch);
    if !ran {
        return Ok(false);
    }
    if let (Some(bias), None) = (args.bias, epilogue_bias) {
        let rows = bias.layout.expand("matmul_float8", &[m, n])?;
        let bias = View {
            layout: &rows,
            ..bias
        };
        backend.binary(BinaryOp::Add, args.out, bias, args.out)?;
    }
    Ok(true)
}

/// Rowwise scales where cuBLASLt has no outer-vector algorithm: the fp8 product of `gemm` with
/// unit scalar scales into f32 (the output itself when it is f32, else a temporary), then times
/// `a`'s inverse scales along rows and `b`'s along columns, plus the bias, in f32, rounded once
/// into the output. The product still runs on the fp8 tensor cores; the scales cost three
/// elementwise passes over `[m, n]` (two for an f32 output without bias). `Ok(false)` when the
/// scalar-scaled product has no algorithm either.
fn scale_after_the_product(
    backend: &CudaBackend,
    args: &Float8Matmul<'_>,
    gemm: Float8Gemm,
) -> Result<bool> {
    let (n, m, _) = gemm.dims;
    let owner = args.out.buffer.backend();
    fn f32_view<'a>(buffer: &'a Buffer, layout: &'a Layout) -> View<'a> {
        View {
            buffer,
            layout,
            dtype: DType::F32,
        }
    }
    let unit = Buffer::new(owner, DType::F32.size_in_bytes())?;
    let one = Layout::contiguous(&[1]);
    backend.fill(f32_view(&unit, &one), 1.0)?;
    let dense = Layout::contiguous(&[m, n]);
    let temporary = match args.out.dtype {
        DType::F32 if args.out.layout == &dense => None,
        _ => Some(Buffer::new(owner, m * n * DType::F32.size_in_bytes())?),
    };
    let product = f32_view(temporary.as_ref().unwrap_or(args.out.buffer), &dense);
    let ran = run_float8_gemm(
        backend,
        &Float8Gemm {
            out_dtype: DType::F32,
            a_scale: unit.address(),
            b_scale: unit.address(),
            scales: Float8Scales::Scalars,
            d: element_address(&product),
            bias: None,
            ..gemm
        },
    )?;
    if !ran {
        return Ok(false);
    }
    // `a`'s scales down the rows, `b`'s along the columns (a one-value side by stride 0).
    let along = |scale: &View<'_>, rows: bool| {
        let stride = scale.layout.strides().first().copied().unwrap_or(0);
        let strides = if rows { [stride, 0] } else { [0, stride] };
        Layout::from_parts(&[m, n], &strides, scale.layout.offset())
    };
    for (scale, rows) in [
        (&args.a_inverse_scale, true),
        (&args.b_inverse_scale, false),
    ] {
        let layout = along(scale, rows)?;
        backend.binary(
            BinaryOp::Mul,
            product,
            f32_view(scale.buffer, &layout),
            product,
        )?;
    }
    if let Some(bias) = args.bias {
        let rows = bias.layout.expand("matmul_float8", &[m, n])?;
        let (widened, widened_rows);
        let bias = if bias.dtype == DType::F32 {
            View {
                layout: &rows,
                ..bias
            }
        } else {
            let dense_bias = Layout::contiguous(&[n]);
            widened = Buffer::new(owner, n * DType::F32.size_in_bytes())?;
            backend.copy(bias, f32_view(&widened, &dense_bias))?;
            widened_rows = Layout::from_parts(&[m, n], &[0, 1], 0)?;
            f32_view(&widened, &widened_rows)
        };
        backend.binary(BinaryOp::Add, product, bias, product)?;
    }
    if temporary.is_some() {
        backend.copy(product, args.out)?;
    }
    backend.float8_scaled_after.fetch_add(1, Ordering::Relaxed);
    Ok(true)
}

/// The device address of `scales` (f32 `[len]`) as a dense vector: the view itself when its
/// elements are adjacent and 16-byte aligned, else (a tensorwise scale broadcast by stride 0, a
/// strided one) a dense copy in `scratch`.
fn dense_scales<'a>(
    backend: &'a CudaBackend,
    scales: &View<'_>,
    scratch: &mut Vec<Scratch<'a>>,
) -> Result<u64> {
    let address = element_address(scales);
    let len = scales.layout.numel();
    if (scales.layout.strides() == [1] || len == 1) && address.is_multiple_of(16) {
        return Ok(address);
    }
    let dense = Layout::contiguous(&[len]);
    let copy = Scratch::new(backend, (len * DType::F32.size_in_bytes()) as u64)?;
    copy_raw(
        backend,
        scales.buffer.address(),
        scales.layout,
        copy.address(),
        &dense,
        DType::F32.size_in_bytes(),
    )?;
    let address = copy.address();
    scratch.push(copy);
    Ok(address)
}

/// Runs of each candidate algorithm when tuning (the first warms it up as much as it times it).
const TUNING_REPEATS: usize = 3;

/// Device milliseconds `launch` takes, or `None` when it fails (a candidate the library rejects
/// at run time is skipped, not an error).
fn time_candidate(
    backend: &CudaBackend,
    launch: impl FnOnce() -> Result<()>,
) -> Result<Option<f32>> {
    let event = || {
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| device_error("linear", e))?;
        // SAFETY: the event was just created in the bound context; the stream is the backend's.
        unsafe { result::event::record(event, backend.stream.cu_stream()) }
            .map_err(|e| device_error("linear", e))?;
        Ok::<_, headroom_autograd_core::TensorError>(event)
    };
    let start = event()?;
    let launched = launch();
    let end = event()?;
    // SAFETY: both events were recorded on the backend's stream above; the end event is waited
    // for before the elapsed time is read, and each is destroyed once, here.
    let elapsed = unsafe {
        let elapsed = result::event::synchronize(end)
            .and_then(|()| result::event::elapsed(start, end))
            .map_err(|e| device_error("linear", e));
        let _ = result::event::destroy(start);
        let _ = result::event::destroy(end);
        elapsed
    };
    match launched {
        Ok(()) => Ok(Some(elapsed?)),
        Err(_) => Ok(None),
    }
}

impl CudaBackend {
    /// How many rowwise fp8 products (`matmul_float8` with a vector of scales) ran as a
    /// product with unit scalar scales followed by the scales, because cuBLASLt offered no
    /// outer-vector algorithm for them (see the module's header). The results agree
    /// within f32 rounding; this tells where an fp8 epilogue is missing.
    pub fn float8_scales_after_products(&self) -> u64 {
        self.float8_scaled_after.load(Ordering::Relaxed)
    }

    /// How many `linear` and `linear_weight_grad` calls (with a bias gradient) ran composed of
    /// other primitives instead of as one cuBLASLt product with a bias epilogue: f64, an operand
    /// with neither contiguous rows nor contiguous columns (such as the broadcast gradient of a
    /// `sum()` loss), a bias not 16-byte aligned, or a problem cuBLASLt has no algorithm for.
    /// The results are the same either way; this tells where time may be left.
    pub fn linear_fallbacks(&self) -> u64 {
        self.blas
            .lock()
            .as_mut()
            .and_then(|state| state.lt_if_created())
            .map_or(0, |lt| lt.fallbacks())
    }

    fn note_linear_fallback(&self) -> Result<()> {
        self.blas_state()?.lt()?.note_fallback();
        Ok(())
    }
}
