//! Batched GEMM through cuBLAS, on strided operands, with its workspace from the caching
//! allocator.
//!
//! Row-major `out = a @ b` is computed as the column-major `outᵀ = bᵀ · aᵀ`, so an operand whose
//! rows are contiguous is passed as is and a transposed one (contiguous columns) with the
//! transpose flag: transposes cost no copy. Batch dims are merged where every operand steps
//! through them uniformly and passed as one strided batch (stride 0 for a broadcast operand);
//! any other batch dims are looped over. f32 and f64 compute in their own precision (TF32 only
//! after `CudaBackend::set_allow_tf32(true)`, as in PyTorch), f16 and bf16 in f32.
//!
//! The cuBLAS handle and its 32 MiB workspace (PyTorch's size on Hopper) are created on the first
//! product; the workspace is an allocation of the backend's caching allocator, so it shows in
//! `memory_allocated()` as PyTorch's does. cuBLASLt (`linear.rs`) shares it.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys as blas_sys};
use headroom_autograd_core::{matmul_dims, DType, Layout, Result, TensorError, View};
use headroom_caching_allocator::{Allocation, StreamId};

use crate::backend::{device_error, CudaBackend, Scratch};
use crate::linear::LtState;

/// Bytes of cuBLAS workspace.
const WORKSPACE_BYTES: u64 = 32 << 20;

/// A cuBLAS handle and the workspace lent to it, and cuBLASLt's state (`linear.rs`), which
/// shares the workspace.
#[derive(Debug)]
pub(crate) struct BlasState {
    handle: Handle,
    workspace: Option<Allocation>,
    lt: Option<LtState>,
}

#[derive(Debug)]
struct Handle(blas_sys::cublasHandle_t);

// SAFETY: a cuBLAS handle may be used from any thread as long as calls do not overlap; the
// backend keeps it behind a mutex and binds its context before each call.
unsafe impl Send for Handle {}

impl BlasState {
    /// Returns the workspace to the allocator and destroys the handle.
    pub(crate) fn release(mut self, backend: &CudaBackend) {
        if let Some(lt) = self.lt.take() {
            lt.release();
        }
        // SAFETY: the handle was created by `create_handle` and is destroyed once, here.
        // Errors cannot be reported from a drop; the workspace goes back either way.
        let _ = unsafe { blas::destroy_handle(self.handle.0) };
        if let Some(workspace) = self.workspace.take() {
            let _ = backend.allocator().free(workspace);
        }
    }
}

impl BlasState {
    /// The workspace's address and size in bytes.
    pub(crate) fn workspace(&self) -> (u64, usize) {
        let address = self.workspace.as_ref().map_or(0, Allocation::address);
        (address, WORKSPACE_BYTES as usize)
    }

    /// cuBLASLt's state, created on first use.
    pub(crate) fn lt(&mut self) -> Result<&mut LtState> {
        if self.lt.is_none() {
            self.lt = Some(LtState::new()?);
        }
        Ok(self.lt.as_mut().expect("created above"))
    }

    /// cuBLASLt's state if a linear layer created it.
    pub(crate) fn lt_if_created(&mut self) -> Option<&mut LtState> {
        self.lt.as_mut()
    }
}

/// One operand matrix for cuBLAS: its transpose flag, leading dimension and element address.
#[derive(Debug, Clone, Copy)]
struct Matrix {
    op: blas_sys::cublasOperation_t,
    ld: i32,
}

/// `x` (row-major `[rows, cols]` with strides `(rs, cs)`) as the column-major `xᵀ` cuBLAS wants:
/// contiguous rows pass untransposed, contiguous columns pass with the transpose flag.
fn as_transposed(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<Matrix> {
    if cs == 1 || cols == 1 {
        let ld = rs.max(cols).max(1);
        Some(Matrix {
            op: blas_sys::cublasOperation_t::CUBLAS_OP_N,
            ld: ld.try_into().ok()?,
        })
    } else if rs == 1 || rows == 1 {
        let ld = cs.max(rows).max(1);
        Some(Matrix {
            op: blas_sys::cublasOperation_t::CUBLAS_OP_T,
            ld: ld.try_into().ok()?,
        })
    } else {
        None
    }
}

fn unsupported_strides(view: &View<'_>) -> TensorError {
    TensorError::InvalidArgument {
        op: "matmul",
        reason: format!(
            "operand strides {:?} have neither contiguous rows nor contiguous columns \
             (make it contiguous first)",
            view.layout.strides()
        ),
    }
}

/// `out (+)= a @ b` over equal batch dims.
pub(crate) fn matmul(
    backend: &CudaBackend,
    a: View<'_>,
    b: View<'_>,
    out: View<'_>,
    accumulate: bool,
) -> Result<()> {
    let (m, k, n) = matmul_dims(&a, &b, &out)?;
    let nd = out.layout.ndim();
    let (data_type, compute) = match a.dtype {
        DType::F32 if backend.allow_tf32() => (
            blas_sys::cudaDataType::CUDA_R_32F,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        ),
        DType::F32 => (
            blas_sys::cudaDataType::CUDA_R_32F,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F64 => (
            blas_sys::cudaDataType::CUDA_R_64F,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
        ),
        DType::F16 => (
            blas_sys::cudaDataType::CUDA_R_16F,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::BF16 => (
            blas_sys::cudaDataType::CUDA_R_16BF,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        dtype => {
            return Err(TensorError::UnsupportedDtype {
                op: "matmul",
                dtype,
            })
        }
    };
    if m == 0 || n == 0 {
        return Ok(());
    }
    let element = a.dtype.size_in_bytes();
    // Operands cuBLAS cannot read in place (e.g. a fully broadcast gradient) are made dense first.
    let (a_address, a_layout, _a_scratch) = readable(backend, &a, m, k, element)?;
    let (b_address, b_layout, _b_scratch) = readable(backend, &b, k, n, element)?;
    let out_layout = out.layout.clone();
    let stride = |layout: &Layout, d: usize| layout.strides()[d];
    let lhs = as_transposed(m, k, stride(&a_layout, nd - 2), stride(&a_layout, nd - 1))
        .ok_or_else(|| unsupported_strides(&a))?;
    let rhs = as_transposed(k, n, stride(&b_layout, nd - 2), stride(&b_layout, nd - 1))
        .ok_or_else(|| unsupported_strides(&b))?;
    if stride(&out_layout, nd - 1) != 1 && n != 1 {
        return Err(unsupported_strides(&out));
    }
    let ldc: i32 = stride(&out_layout, nd - 2)
        .max(n)
        .try_into()
        .map_err(|_| unsupported_strides(&out))?;

    // Merge batch dims that all three operands step through uniformly.
    let mut batch: Vec<(usize, [usize; 3])> = Vec::new();
    for (d, &size) in out.layout.shape()[..nd - 2].iter().enumerate() {
        if size == 1 {
            continue;
        }
        let strides = [
            stride(&out_layout, d),
            stride(&a_layout, d),
            stride(&b_layout, d),
        ];
        if let Some((last_size, last_strides)) = batch.last_mut() {
            if (0..3).all(|i| last_strides[i] == strides[i] * size) {
                *last_size *= size;
                *last_strides = strides;
                continue;
            }
        }
        batch.push((size, strides));
    }
    let (inner_count, inner_strides) = batch.pop().unwrap_or((1, [0, 0, 0]));
    let outer_count: usize = batch.iter().map(|(size, _)| size).product();

    let element = element as u64;
    let out0 = out.buffer.address() + out_layout.offset() as u64 * element;
    let (a0, b0) = (a_address, b_address);
    let (m, n, k) = (to_int(m)?, to_int(n)?, to_int(k)?);
    let batch_count = to_int(inner_count)?;
    let (alpha32, beta32) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
    let (alpha64, beta64) = (1.0f64, if accumulate { 1.0f64 } else { 0.0 });
    let (alpha, beta): (*const c_void, *const c_void) = if a.dtype == DType::F64 {
        (
            (&alpha64 as *const f64).cast(),
            (&beta64 as *const f64).cast(),
        )
    } else {
        (
            (&alpha32 as *const f32).cast(),
            (&beta32 as *const f32).cast(),
        )
    };

    let state = backend.blas_state()?;
    let handle = state.handle.0;
    for outer in 0..outer_count {
        // Offsets of this outer batch index, in elements.
        let mut rest = outer;
        let mut offsets = [0usize; 3];
        for (size, strides) in batch.iter().rev() {
            let index = rest % size;
            rest /= size;
            for i in 0..3 {
                offsets[i] += index * strides[i];
            }
        }
        let at = |base: u64, i: usize| base + offsets[i] as u64 * element;
        // SAFETY: the handle is live and bound to this context's stream; every address is an
        // element of a live buffer, and the matrices' extents (m, n, k, leading dims, batch
        // strides) are those of views the core checked against their buffers; alpha and beta
        // point to scalars of the compute type that outlive the call.
        unsafe {
            blas::gemm_strided_batched_ex(
                handle,
                rhs.op,
                lhs.op,
                n,
                m,
                k,
                alpha,
                at(b0, 2) as *const c_void,
                data_type,
                rhs.ld,
                inner_strides[2] as i64,
                at(a0, 1) as *const c_void,
                data_type,
                lhs.ld,
                inner_strides[1] as i64,
                beta,
                at(out0, 0) as *mut c_void,
                data_type,
                ldc,
                inner_strides[0] as i64,
                batch_count,
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| device_error("matmul", e))?;
    }
    drop(state);
    Ok(())
}

/// `view` as cuBLAS can read it: (address of its first element, layout), copying it to dense
/// scratch when its matrices have neither contiguous rows nor contiguous columns.
fn readable<'a>(
    backend: &'a CudaBackend,
    view: &View<'_>,
    rows: usize,
    cols: usize,
    element: usize,
) -> Result<(u64, Layout, Option<Scratch<'a>>)> {
    let nd = view.layout.ndim();
    let strides = view.layout.strides();
    if as_transposed(rows, cols, strides[nd - 2], strides[nd - 1]).is_some() {
        let address = view.buffer.address() + (view.layout.offset() * element) as u64;
        return Ok((address, view.layout.clone(), None));
    }
    let dense = Layout::contiguous(view.layout.shape());
    let scratch = Scratch::new(backend, (dense.numel() * element) as u64)?;
    let address = scratch.address();
    let src = view.buffer.address();
    crate::elementwise::copy_raw(backend, src, view.layout, address, &dense, element)?;
    Ok((address, dense, Some(scratch)))
}

fn to_int(value: usize) -> Result<i32> {
    value.try_into().map_err(|_| TensorError::InvalidArgument {
        op: "matmul",
        reason: format!("dimension {value} exceeds cuBLAS's 32-bit sizes"),
    })
}

impl CudaBackend {
    /// The cuBLAS state, created on first use (handle on the default stream, workspace from the
    /// caching allocator).
    pub(crate) fn blas_state(&self) -> Result<parking_lot::MappedMutexGuard<'_, BlasState>> {
        self.bind("matmul")?;
        let mut guard = self.blas.lock();
        if guard.is_none() {
            let handle = blas::create_handle().map_err(|e| device_error("matmul", e))?;
            let workspace = self
                .allocator()
                .allocate(WORKSPACE_BYTES, StreamId::DEFAULT)?;
            // SAFETY: the handle was just created; the stream is the context's default stream;
            // the workspace is a live device allocation of WORKSPACE_BYTES that the state keeps
            // until the handle is destroyed.
            unsafe {
                blas::set_stream(handle, self.stream.cu_stream() as blas_sys::cudaStream_t)
                    .map_err(|e| device_error("matmul", e))?;
                blas_sys::cublasSetWorkspace_v2(
                    handle,
                    workspace.address() as *mut c_void,
                    WORKSPACE_BYTES as usize,
                )
                .result()
                .map_err(|e| device_error("matmul", e))?;
            }
            *guard = Some(BlasState {
                handle: Handle(handle),
                workspace: Some(workspace),
                lt: None,
            });
        }
        Ok(parking_lot::MutexGuard::map(guard, |state| {
            state.as_mut().expect("created above")
        }))
    }
}

/// One operand of [`gemm_batched`]: a column-major matrix (cuBLAS's view) at `address`, its
/// element type, leading dimension, distance between batch entries (elements) and whether cuBLAS
/// reads it transposed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemmOperand {
    pub(crate) address: u64,
    pub(crate) dtype: DType,
    pub(crate) ld: usize,
    pub(crate) batch_stride: usize,
    pub(crate) transposed: bool,
}

fn data_type(dtype: DType) -> Result<blas_sys::cudaDataType> {
    Ok(match dtype {
        DType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        DType::F64 => blas_sys::cudaDataType::CUDA_R_64F,
        DType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => blas_sys::cudaDataType::CUDA_R_16BF,
        dtype => {
            return Err(TensorError::UnsupportedDtype {
                op: "matmul",
                dtype,
            })
        }
    })
}

/// Column-major `c[i] = alpha · op(a[i]) op(b[i]) + beta · c[i]` for `batch` entries (`m × n`
/// results, inner dimension `k`), f32 accumulation: for kernels of this crate that chain products
/// of 16-bit operands with f32 results (tensor cores on f16/bf16, f32 scores).
///
/// # Safety
/// Every address must hold the matrices the dimensions, leading dimensions and batch strides
/// describe, in live memory of this backend.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_batched(
    backend: &CudaBackend,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: GemmOperand,
    b: GemmOperand,
    beta: f32,
    c: GemmOperand,
    batch: usize,
) -> Result<()> {
    let op = |t: bool| {
        if t {
            blas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            blas_sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (a_type, b_type, c_type) = (
        data_type(a.dtype)?,
        data_type(b.dtype)?,
        data_type(c.dtype)?,
    );
    let state = backend.blas_state()?;
    // SAFETY: the handle is live and bound to the backend's stream; the caller guarantees the
    // operands; alpha and beta are f32 scalars (the compute type's) that outlive the call.
    unsafe {
        blas::gemm_strided_batched_ex(
            state.handle.0,
            op(a.transposed),
            op(b.transposed),
            to_int(m)?,
            to_int(n)?,
            to_int(k)?,
            (&alpha as *const f32).cast(),
            a.address as *const c_void,
            a_type,
            to_int(a.ld)?,
            a.batch_stride as i64,
            b.address as *const c_void,
            b_type,
            to_int(b.ld)?,
            b.batch_stride as i64,
            (&beta as *const f32).cast(),
            c.address as *mut c_void,
            c_type,
            to_int(c.ld)?,
            c.batch_stride as i64,
            to_int(batch)?,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| device_error("matmul", e))
}
