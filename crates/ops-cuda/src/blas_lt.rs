//! cuBLASLt's state of one device: its handle (absent when the library is not installed) and
//! the plans made so far, one per problem.
//!
//! A plan is a problem described to cuBLASLt (matmul descriptor with its epilogue, matrix layouts)
//! plus the algorithm its heuristic chose, cached under everything that choice depends on
//! ([`PlanKey`]: dtype, compute type, epilogue, transposes, sizes, leading dimensions, pointer
//! alignment classes), so the heuristic is asked once per shape; a problem it has no algorithm
//! for is remembered as such and not asked again. With `HEADROOM_GEMM_TUNING=1` a plan keeps the
//! heuristic's first few algorithms, and the linear layers time them on the plan's first problem
//! and keep the fastest (PyTorch's TunableOp, for these products). The state lives inside `blas.rs`'s `BlasState`
//! (behind the backend's BLAS mutex) and shares its workspace.
//!
//! This module is ground floor: it imports only `error.rs`, knows nothing of `CudaBackend`, views
//! or tensors, and leaves running a plan, and deciding what to do without one, to the linear
//! layers (`linear.rs`).

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::{result as lt, sys as lt_sys};
use headroom_autograd_core::{DType, Result};

use crate::error::device_error;

/// The cuBLASLt handle (absent when the library is not installed) and the plans made so far.
#[derive(Debug)]
pub(crate) struct LtState {
    handle: Option<LtHandle>,
    /// `None` marks a problem cuBLASLt has no algorithm for (it is not asked again).
    plans: HashMap<PlanKey, Option<Plan>>,
    fallbacks: u64,
    /// Whether plans time the heuristic's candidates ([`TUNING_VARIABLE`]).
    tuning: bool,
    /// Whether fp8 products accumulate fast ([`FLOAT8_FAST_ACCUMULATION_VARIABLE`]).
    float8_fast_accumulation: bool,
}

#[derive(Debug)]
struct LtHandle(lt_sys::cublasLtHandle_t);

// SAFETY: the handle and the plans' descriptors are plain host objects of cuBLASLt, used from one
// thread at a time (the state sits behind the backend's BLAS mutex).
unsafe impl Send for LtState {}

/// Algorithms asked of the heuristic per problem when tuning (see [`TUNING_VARIABLE`]).
const TUNING_CANDIDATES: usize = 8;

/// Set to `1`, the environment variable that makes each plan time the heuristic's first
/// [`TUNING_CANDIDATES`] algorithms on its first problem and keep the fastest (PyTorch's
/// `PYTORCH_TUNABLEOP_ENABLED`, for cuBLASLt's products). Every candidate computes the same
/// product in the same compute type (true f32 stays f32); only the kernel differs.
pub(crate) const TUNING_VARIABLE: &str = "HEADROOM_GEMM_TUNING";

/// A matrix description plus the algorithm the heuristic chose for it.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) desc: lt_sys::cublasLtMatmulDesc_t,
    /// Layouts of A, B and D (C is D).
    pub(crate) layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
    pub(crate) algo: lt_sys::cublasLtMatmulAlgo_t,
    /// The heuristic's other algorithms, best first, still to be timed against `algo` (empty
    /// unless tuning; emptied once timed).
    pub(crate) untimed: Vec<lt_sys::cublasLtMatmulAlgo_t>,
}

/// Everything the chosen algorithm depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    pub(crate) dtype: DType,
    pub(crate) tf32: bool,
    pub(crate) epilogue: Epilogue,
    /// `(m, n, k)` of the column-major product `D = op(A) op(B)`.
    pub(crate) dims: (usize, usize, usize),
    pub(crate) a: OperandKey,
    pub(crate) b: OperandKey,
    pub(crate) d: OperandKey,
    /// An fp8 product's 8-bit floats and scale form (`dtype` is then D's), or `None`.
    pub(crate) float8: Option<Float8Key>,
    /// An fp8 product's fast accumulation (no promotion of the tensor cores' partial sums to
    /// f32 along k; see [`FLOAT8_FAST_ACCUMULATION_VARIABLE`]).
    pub(crate) fast_accumulation: bool,
}

/// Set to `1`, the environment variable that runs fp8 products with cuBLASLt's fast
/// accumulation (`CUBLASLT_MATMUL_DESC_FAST_ACCUM`, torchao's `use_fast_accum`), which skips
/// promoting the tensor cores' partial sums to f32 along k: faster, less precise. Off by
/// default, and for the parity tests' bounds.
pub(crate) const FLOAT8_FAST_ACCUMULATION_VARIABLE: &str = "HEADROOM_FLOAT8_FAST_ACCUMULATION";

/// cuBLASLt's name for an fp8 dtype (E4M3 unless E5M2).
fn float8_data_type(dtype: DType) -> lt_sys::cudaDataType {
    if dtype == DType::F8E5M2 {
        lt_sys::cudaDataType::CUDA_R_8F_E5M2
    } else {
        lt_sys::cudaDataType::CUDA_R_8F_E4M3
    }
}

/// The fp8 part of a [`PlanKey`]: A's and B's 8-bit floats and how their scales apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Float8Key {
    pub(crate) dtypes: (DType, DType),
    pub(crate) scales: Float8Scales,
}

/// How an fp8 product's A and B scales multiply it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Float8Scales {
    /// One f32 each (`CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F`): tensorwise scaling.
    Scalars,
    /// An f32 vector each (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`): A's `m` scales, one a
    /// row of `op(A)`, and B's `n`, one a column of `op(B)`; `D[i, j]` is multiplied by both —
    /// rowwise scaling.
    OuterVectors,
}

/// One operand's part of a [`PlanKey`]: whether the product reads it transposed, its leading
/// dimension and its address's alignment class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct OperandKey {
    pub(crate) transposed: bool,
    pub(crate) ld: usize,
    pub(crate) alignment: u32,
}

/// The epilogues the linear layers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    /// `D = A B`.
    Plain,
    /// `D = A B + bias` (bias over D's rows, broadcast over its columns).
    Bias,
    /// `D = A B` and `bias = Σ_k B` (B's sums over the reduced dimension).
    BiasGradB,
}

impl Plan {
    /// Describes the problem of `key` and asks the heuristic for an algorithm; `None` when it
    /// has none. Outer-vector scales are asked with both scale pointers at `scale_placeholder`
    /// (a live device address; each call sets its own before it runs): on the H100, cuBLASLt's
    /// heuristic offered an outer-vector algorithm at every shape when the pointers were set
    /// (`scripts/pytorch/cublaslt_outer_vector_probe.py`) and none to plans asked without them.
    fn new(
        handle: lt_sys::cublasLtHandle_t,
        key: &PlanKey,
        data_type: lt_sys::cudaDataType,
        workspace_bytes: usize,
        scale_placeholder: u64,
        candidates: usize,
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
        // A's and B's element types: D's, or the fp8 product's.
        let (a_type, b_type) = match key.float8 {
            Some(Float8Key { dtypes: (a, b), .. }) => (float8_data_type(a), float8_data_type(b)),
            None => (data_type, data_type),
        };
        // Stored shape of an operand read as an `rows × cols` matrix.
        let stored = |operand: &OperandKey, data_type, rows: usize, cols: usize| {
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
            untimed: Vec::new(),
        };
        // From here on, dropping `plan` releases what was created.
        plan.layouts[0] = stored(&key.a, a_type, m, k).map_err(failed)?;
        plan.layouts[1] = stored(&key.b, b_type, k, n).map_err(failed)?;
        plan.layouts[2] = stored(&key.d, data_type, m, n).map_err(failed)?;
        let epilogue = match key.epilogue {
            Epilogue::Plain => lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::BiasGradB => lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADB,
        };
        if let Some(Float8Key {
            scales: Float8Scales::OuterVectors,
            ..
        }) = key.float8
        {
            let mode =
                lt_sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
            for attribute in [
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
            ] {
                // SAFETY: the descriptor is the live one created above; the attribute takes a
                // 32-bit scale mode (the enum is `repr(u32)`), read during the call.
                let set = unsafe {
                    lt::set_matmul_desc_attribute(
                        plan.desc,
                        attribute,
                        (&mode as *const lt_sys::cublasLtMatmulMatrixScale_t).cast(),
                        std::mem::size_of::<lt_sys::cublasLtMatmulMatrixScale_t>(),
                    )
                };
                if set.is_err() {
                    // A library that predates outer-vector scales: the core composes.
                    return Ok(None);
                }
            }
            let placeholder = scale_placeholder as *const c_void;
            for attribute in [
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            ] {
                // SAFETY: the descriptor is the live one created above; the attribute is a device
                // pointer of the size cuBLASLt documents, read during the call (the heuristic
                // reads no device memory through it).
                unsafe {
                    lt::set_matmul_desc_attribute(
                        plan.desc,
                        attribute,
                        (&placeholder as *const *const c_void).cast(),
                        std::mem::size_of::<*const c_void>(),
                    )
                }
                .map_err(failed)?;
            }
        }
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
            if key.fast_accumulation {
                let fast: i8 = 1;
                set_desc(
                    lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                    (&fast as *const i8).cast(),
                    1,
                )
                .map_err(failed)?;
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
                let mut results = vec![std::mem::zeroed(); candidates.max(1)];
                let mut returned = 0;
                lt_sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    plan.desc,
                    plan.layouts[0],
                    plan.layouts[1],
                    plan.layouts[2],
                    plan.layouts[2],
                    preference,
                    results.len() as i32,
                    results.as_mut_ptr(),
                    &mut returned,
                )
                .result()?;
                results.truncate(returned.max(0) as usize);
                Ok(results)
            });
            lt::destroy_matmul_pref(preference).map_err(failed)?;
            heuristic
        };
        let usable: Vec<lt_sys::cublasLtMatmulAlgo_t> = match heuristic {
            Ok(results) => results
                .into_iter()
                .filter(|result| result.state == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|result| result.algo)
                .collect(),
            Err(_) => Vec::new(),
        };
        match usable.split_first() {
            Some((best, others)) => {
                plan.algo = *best;
                plan.untimed = others.to_vec();
                Ok(Some(plan))
            }
            // No algorithm for this problem (or one the library rejects): compose instead.
            None => Ok(None),
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
        let present = headroom_caching_allocator::cuda_library_present("cublasLt");
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
            tuning: std::env::var(TUNING_VARIABLE).is_ok_and(|value| value == "1"),
            float8_fast_accumulation: std::env::var(FLOAT8_FAST_ACCUMULATION_VARIABLE)
                .is_ok_and(|value| value == "1"),
        })
    }

    /// Whether fp8 products accumulate fast ([`FLOAT8_FAST_ACCUMULATION_VARIABLE`]).
    pub(crate) fn float8_fast_accumulation(&self) -> bool {
        self.float8_fast_accumulation
    }

    /// The handle and the plan for `key` (of elements `data_type`, with `workspace_bytes` of
    /// workspace; `scale_placeholder` a live device address an fp8 plan's heuristic sees as its
    /// scale pointers, see `Plan::new`), made on first use; `None` when the library is not
    /// installed or has no algorithm for the problem.
    pub(crate) fn plan(
        &mut self,
        key: PlanKey,
        data_type: lt_sys::cudaDataType,
        workspace_bytes: usize,
        scale_placeholder: u64,
    ) -> Result<Option<(lt_sys::cublasLtHandle_t, &mut Plan)>> {
        let Some(handle) = self.handle.as_ref().map(|handle| handle.0) else {
            return Ok(None);
        };
        let candidates = if self.tuning { TUNING_CANDIDATES } else { 1 };
        let plan = match self.plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::hash_map::Entry::Vacant(entry) => entry.insert(Plan::new(
                handle,
                &key,
                data_type,
                workspace_bytes,
                scale_placeholder,
                candidates,
            )?),
        };
        Ok(plan.as_mut().map(|plan| (handle, plan)))
    }

    /// How many linear-layer calls ran composed instead of through a plan (see
    /// `CudaBackend::linear_fallbacks`).
    pub(crate) fn fallbacks(&self) -> u64 {
        self.fallbacks
    }

    /// Counts one more composed linear-layer call.
    pub(crate) fn note_fallback(&mut self) {
        self.fallbacks += 1;
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
