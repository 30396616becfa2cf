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
//! A plan (descriptors, layouts and the heuristic's algorithm) is cached per problem: dtype,
//! compute type, epilogue, transposes, sizes, leading dimensions and pointer alignments, so the
//! heuristic is queried once per shape. Whatever cuBLASLt is not given — f64, operands with
//! neither contiguous rows nor contiguous columns (a broadcast gradient, stride 0), a bias not
//! 16-byte aligned, an empty product, a problem the heuristic has no algorithm for, a machine
//! without the library — runs composed of
//! the other primitives (`compose_linear`, `compose_linear_weight_grad`), counted by
//! [`CudaBackend::linear_fallbacks`]. The handle lives in `matmul.rs`'s `BlasState` and shares its
//! workspace (an allocation of the caching allocator, so it shows in the statistics); both
//! libraries run on the backend's one stream, so their uses of it never overlap. This module
//! knows nothing of autograd: it sees views, never tensors.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::{result as lt, sys as lt_sys};
use headroom_autograd_core::{
    compose_linear, compose_linear_weight_grad, linear_dims, linear_weight_grad_dims, Backend,
    DType, LinearEpilogue, LinearForward, LinearWeightGrad, Result, UnaryOp, View,
};

use crate::backend::{device_error, CudaBackend};
use crate::elementwise::element_address;

/// The cuBLASLt handle (absent when the library is not installed) and the plans made so far.
#[derive(Debug)]
pub(crate) struct LtState {
    handle: Option<LtHandle>,
    /// `None` marks a problem cuBLASLt has no algorithm for (it is not asked again).
    plans: HashMap<PlanKey, Option<Plan>>,
    fallbacks: u64,
}

#[derive(Debug)]
struct LtHandle(lt_sys::cublasLtHandle_t);

// SAFETY: the handle and the plans' descriptors are plain host objects of cuBLASLt, used from one
// thread at a time (the state sits behind the backend's BLAS mutex).
unsafe impl Send for LtState {}

/// A matrix description plus the algorithm the heuristic chose for it.
#[derive(Debug)]
struct Plan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    /// Layouts of A, B and D (C is D).
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

/// Everything the chosen algorithm depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    dtype: DType,
    tf32: bool,
    epilogue: Epilogue,
    /// `(m, n, k)` of the column-major product `D = op(A) op(B)`.
    dims: (usize, usize, usize),
    a: OperandKey,
    b: OperandKey,
    d: OperandKey,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct OperandKey {
    transposed: bool,
    ld: usize,
    alignment: u32,
}

/// The epilogues this module uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Epilogue {
    /// `D = A B`.
    Plain,
    /// `D = A B + bias` (bias over D's rows, broadcast over its columns).
    Bias,
    /// `D = A B` and `bias = Σ_k B` (B's sums over the reduced dimension).
    BiasGradB,
}

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
    if col_stride == 1 && row_stride >= cols.max(1) {
        Some(Stored {
            address,
            ld: row_stride,
            holds_transpose: true,
        })
    } else if row_stride == 1 && col_stride >= rows.max(1) {
        Some(Stored {
            address,
            ld: col_stride,
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
    let tf32 = gemm.dtype == DType::F32 && backend.allow_tf32();
    let key = |operand: &Operand| OperandKey {
        transposed: operand.transposed,
        ld: operand.ld,
        alignment: alignment(operand.address),
    };
    let key = PlanKey {
        dtype: gemm.dtype,
        tf32,
        epilogue: gemm.epilogue,
        dims: gemm.dims,
        a: key(&gemm.a),
        b: key(&gemm.b),
        d: key(&gemm.d),
    };
    let mut state = backend.blas_state()?;
    let (workspace, workspace_bytes) = state.workspace();
    let stream = backend.stream.cu_stream() as lt_sys::cudaStream_t;
    let lt_state = state.lt()?;
    let Some(handle) = lt_state.handle.as_ref().map(|handle| handle.0) else {
        return Ok(false);
    };
    let plan = match lt_state.plans.entry(key) {
        std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
        std::collections::hash_map::Entry::Vacant(entry) => {
            entry.insert(Plan::new(handle, &key, data_type, workspace_bytes)?)
        }
    };
    let Some(plan) = plan.as_ref() else {
        return Ok(false);
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: the descriptor, layouts and algorithm were made for exactly this problem (the key
    // holds every size, leading dimension, transpose and alignment class); every address is an
    // element of a live view the core checked against its buffer, with the extents the layouts
    // describe (D is dense, C is D with beta 0); the bias (bias gradient) has D's row count,
    // contiguous and 16-byte aligned; the workspace is the BLAS state's live allocation of
    // `workspace_bytes`, used by one library at a time on this one stream; alpha and beta are
    // f32 scalars (the scale type) that outlive the call.
    unsafe {
        if has_bias {
            let bias = gemm.bias as *const c_void;
            lt::set_matmul_desc_attribute(
                plan.desc,
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                (&bias as *const *const c_void).cast(),
                std::mem::size_of::<*const c_void>(),
            )
            .map_err(|e| device_error("linear", e))?;
        }
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
            &plan.algo,
            workspace as *mut c_void,
            workspace_bytes,
            stream,
        )
        .map_err(|e| device_error("linear", e))?;
    }
    Ok(true)
}

impl Plan {
    /// Describes the problem of `key` and asks the heuristic for an algorithm; `None` when it
    /// has none.
    fn new(
        handle: lt_sys::cublasLtHandle_t,
        key: &PlanKey,
        data_type: lt_sys::cudaDataType,
        workspace_bytes: usize,
    ) -> Result<Option<Plan>> {
        let failed = |e: lt::CublasError| device_error("linear", e);
        let compute = if key.tf32 {
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let (m, n, k) = key.dims;
        let desc =
            lt::create_matmul_desc(compute, lt_sys::cudaDataType::CUDA_R_32F).map_err(failed)?;
        // Stored shape of an operand read as an `rows × cols` matrix.
        let stored = |operand: &OperandKey, rows: usize, cols: usize| {
            let (rows, cols) = if operand.transposed {
                (cols, rows)
            } else {
                (rows, cols)
            };
            lt::create_matrix_layout(data_type, rows as u64, cols as u64, operand.ld as i64)
        };
        let mut plan = Plan {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            algo: lt_sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        // From here on, dropping `plan` releases what was created.
        plan.layouts[0] = stored(&key.a, m, k).map_err(failed)?;
        plan.layouts[1] = stored(&key.b, k, n).map_err(failed)?;
        plan.layouts[2] = stored(&key.d, m, n).map_err(failed)?;
        let epilogue = match key.epilogue {
            Epilogue::Plain => lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::BiasGradB => lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADB,
        };
        let preference = lt::create_matmul_pref().map_err(failed)?;
        let alignments = [
            (
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                key.a.alignment,
            ),
            (
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                key.b.alignment,
            ),
            (
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                key.d.alignment,
            ),
            (
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                key.d.alignment,
            ),
        ];
        let transposes = [
            (
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                key.a.transposed,
            ),
            (
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                key.b.transposed,
            ),
        ];
        let workspace_bytes = workspace_bytes as u64;
        // SAFETY: the descriptor, layouts and preference are live objects created above; each
        // attribute is given a value of the type and size cuBLASLt documents for it (i32
        // operations, u32 epilogue and alignments, u64 workspace bytes), read during the call.
        let heuristic = unsafe {
            let set_desc = |attribute, value: *const c_void, size| {
                lt::set_matmul_desc_attribute(plan.desc, attribute, value, size)
            };
            for (attribute, transposed) in transposes {
                let operation: i32 = transposed.into();
                set_desc(attribute, (&operation as *const i32).cast(), 4).map_err(failed)?;
            }
            set_desc(
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&epilogue as *const lt_sys::cublasLtEpilogue_t).cast(),
                std::mem::size_of::<lt_sys::cublasLtEpilogue_t>(),
            )
            .map_err(failed)?;
            let set_preference = |attribute, value: *const c_void, size| {
                lt::set_matmul_pref_attribute(preference, attribute, value, size)
            };
            let configured = set_preference(
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace_bytes as *const u64).cast(),
                8,
            )
            .and_then(|()| {
                alignments.iter().try_for_each(|(attribute, bytes)| {
                    set_preference(*attribute, (bytes as *const u32).cast(), 4)
                })
            });
            let heuristic = configured.and_then(|()| {
                lt::get_matmul_algo_heuristic(
                    handle,
                    plan.desc,
                    plan.layouts[0],
                    plan.layouts[1],
                    plan.layouts[2],
                    plan.layouts[2],
                    preference,
                )
            });
            lt::destroy_matmul_pref(preference).map_err(failed)?;
            heuristic
        };
        match heuristic {
            Ok(result) => {
                plan.algo = result.algo;
                Ok(Some(plan))
            }
            // No algorithm for this problem (or one the library rejects): compose instead.
            Err(_) => Ok(None),
        }
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: the descriptor and layouts were created by `Plan::new` and are destroyed once,
        // here; a null layout was never created. Errors cannot be reported from a drop and leave
        // nothing on the device.
        unsafe {
            for layout in self.layouts {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

impl LtState {
    /// A handle when the library is installed; without one every call composes.
    pub(crate) fn new() -> Result<LtState> {
        // SAFETY: only tries to load the shared library; nothing is called through it.
        let present = unsafe { lt_sys::is_culib_present() };
        let handle = if present {
            Some(LtHandle(
                lt::create_handle().map_err(|e| device_error("linear", e))?,
            ))
        } else {
            None
        };
        Ok(LtState {
            handle,
            plans: HashMap::new(),
            fallbacks: 0,
        })
    }

    /// Destroys the plans, then the handle.
    pub(crate) fn release(mut self) {
        self.plans.clear();
        if let Some(handle) = self.handle.take() {
            // SAFETY: the handle was created by `LtState::new` and is destroyed once, here,
            // after every plan made with it.
            let _ = unsafe { lt::destroy_handle(handle.0) };
        }
    }
}

impl CudaBackend {
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
            .map_or(0, |lt| lt.fallbacks)
    }

    fn note_linear_fallback(&self) -> Result<()> {
        self.blas_state()?.lt()?.fallbacks += 1;
        Ok(())
    }
}
