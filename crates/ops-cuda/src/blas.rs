//! cuBLAS's state of one device: its handle, the workspace lent to it (32 MiB, PyTorch's size on
//! Hopper, unless `CUBLAS_WORKSPACE_CONFIG` says otherwise, read as PyTorch reads it), cuBLASLt's
//! state (`blas_lt.rs`, which shares the workspace), and the batched GEMM
//! that kernel families chain ([`BlasState::gemm_batched`]).
//!
//! The state is created on the first product (`CudaBackend::blas_state` in `device.rs`), on the
//! backend's one stream, with the workspace taken from the backend's caching allocator, so it
//! shows in `memory_allocated()` as PyTorch's does; both libraries run on that stream, so their
//! uses of the workspace never overlap.
//!
//! This module is ground floor: it is handed the stream and the allocator, and knows nothing of
//! `CudaBackend` (which holds it), of views or of tensors.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::CudaStream;
use headroom_autograd_core::{DType, Result, TensorError};
use headroom_caching_allocator::{Allocation, CachingAllocator, CudaStorage, StreamId};

use crate::blas_lt::LtState;
use crate::error::device_error;

/// Bytes of cuBLAS workspace unless `CUBLAS_WORKSPACE_CONFIG` sets them.
const DEFAULT_WORKSPACE_BYTES: u64 = 32 << 20;

/// The environment variable PyTorch and cuBLAS read for the workspace: `:SIZE_KIB:COUNT`
/// entries, for example `:4096:8` (8 buffers of 4096 KiB: 32 MiB).
const WORKSPACE_VARIABLE: &str = "CUBLAS_WORKSPACE_CONFIG";

/// The workspace bytes a `CUBLAS_WORKSPACE_CONFIG` value asks for: the sum of its entries'
/// `SIZE_KIB × COUNT` KiB, as PyTorch sizes its cuBLAS workspace. `None` when it is malformed.
pub(crate) fn workspace_bytes_from_config(config: &str) -> Option<u64> {
    let fields: Vec<&str> = config.split(':').collect();
    let (empty, pairs) = fields.split_first()?;
    if !empty.is_empty() || pairs.is_empty() || pairs.len() % 2 != 0 {
        return None;
    }
    pairs.chunks(2).try_fold(0u64, |total, pair| {
        let kib: u64 = pair[0].trim().parse().ok()?;
        let count: u64 = pair[1].trim().parse().ok()?;
        total.checked_add(kib.checked_mul(count)?.checked_mul(1024)?)
    })
}

/// The workspace size: `CUBLAS_WORKSPACE_CONFIG` when set, else 32 MiB; a malformed value is
/// an error that names the expected form.
fn workspace_bytes() -> Result<u64> {
    match std::env::var(WORKSPACE_VARIABLE) {
        Err(_) => Ok(DEFAULT_WORKSPACE_BYTES),
        Ok(value) => {
            workspace_bytes_from_config(&value).ok_or_else(|| TensorError::InvalidArgument {
                op: "matmul",
                reason: format!(
                "{WORKSPACE_VARIABLE}={value:?} is not of the form :SIZE_KIB:COUNT (for example \
                 :4096:8 for 32 MiB); fix or unset it"
            ),
            })
        }
    }
}

/// The workspace bytes the BLAS state takes from the caching allocator on the first product
/// and keeps (shared by cuBLAS and cuBLASLt, never one per call): `CUBLAS_WORKSPACE_CONFIG`'s
/// size, else 32 MiB (also when the variable is malformed: the first product reports that).
pub(crate) fn lent_workspace_bytes() -> usize {
    workspace_bytes().unwrap_or(DEFAULT_WORKSPACE_BYTES) as usize
}

/// A cuBLAS handle and the workspace lent to it, and cuBLASLt's state (`blas_lt.rs`), which
/// shares the workspace.
#[derive(Debug)]
pub(crate) struct BlasState {
    handle: Handle,
    workspace: Option<Allocation>,
    workspace_bytes: u64,
    lt: Option<LtState>,
}

#[derive(Debug)]
struct Handle(blas_sys::cublasHandle_t);

// SAFETY: a cuBLAS handle may be used from any thread as long as calls do not overlap; the
// backend keeps it behind a mutex and binds its context before each call.
unsafe impl Send for Handle {}

impl BlasState {
    /// A handle on `stream` with a workspace from `allocator` (the caller has bound the context).
    pub(crate) fn create(
        stream: &CudaStream,
        allocator: &CachingAllocator<CudaStorage>,
    ) -> Result<BlasState> {
        let workspace_bytes = workspace_bytes()?;
        let handle = blas::create_handle().map_err(|e| device_error("matmul", e))?;
        let workspace = allocator.allocate(workspace_bytes, StreamId::DEFAULT)?;
        // SAFETY: the handle was just created; the stream is the context's default stream;
        // the workspace is a live device allocation of `workspace_bytes` that the state keeps
        // until the handle is destroyed.
        unsafe {
            blas::set_stream(handle, stream.cu_stream() as blas_sys::cudaStream_t)
                .map_err(|e| device_error("matmul", e))?;
            blas_sys::cublasSetWorkspace_v2(
                handle,
                workspace.address() as *mut c_void,
                workspace_bytes as usize,
            )
            .result()
            .map_err(|e| device_error("matmul", e))?;
        }
        Ok(BlasState {
            handle: Handle(handle),
            workspace: Some(workspace),
            workspace_bytes,
            lt: None,
        })
    }

    /// Returns the workspace to `allocator` (the one it came from) and destroys the handle.
    pub(crate) fn release(mut self, allocator: &CachingAllocator<CudaStorage>) {
        if let Some(lt) = self.lt.take() {
            lt.release();
        }
        // SAFETY: the handle was created by `create` and is destroyed once, here.
        // Errors cannot be reported from a drop; the workspace goes back either way.
        let _ = unsafe { blas::destroy_handle(self.handle.0) };
        if let Some(workspace) = self.workspace.take() {
            let _ = allocator.free(workspace);
        }
    }

    /// The cuBLAS handle, bound to the backend's stream.
    pub(crate) fn handle(&self) -> blas_sys::cublasHandle_t {
        self.handle.0
    }

    /// The workspace's address and size in bytes.
    pub(crate) fn workspace(&self) -> (u64, usize) {
        let address = self.workspace.as_ref().map_or(0, Allocation::address);
        (address, self.workspace_bytes as usize)
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

    /// Column-major `c[i] = alpha · op(a[i]) op(b[i]) + beta · c[i]` for `batch` entries
    /// (`m × n` results, inner dimension `k`), f32 accumulation: for kernels of this crate that
    /// chain products of 16-bit operands with f32 results (tensor cores on f16/bf16, f32 scores).
    ///
    /// # Safety
    /// Every address must hold the matrices the dimensions, leading dimensions and batch strides
    /// describe, in live memory of the backend this state belongs to.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm_batched(
        &self,
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
        // SAFETY: the handle is live and bound to the backend's stream; the caller guarantees the
        // operands; alpha and beta are f32 scalars (the compute type's) that outlive the call.
        unsafe {
            blas::gemm_strided_batched_ex(
                self.handle.0,
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
}

/// One operand of [`BlasState::gemm_batched`]: a column-major matrix (cuBLAS's view) at
/// `address`, its element type, leading dimension, distance between batch entries (elements) and
/// whether cuBLAS reads it transposed.
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

/// `value` as one of cuBLAS's 32-bit sizes.
pub(crate) fn to_int(value: usize) -> Result<i32> {
    value.try_into().map_err(|_| TensorError::InvalidArgument {
        op: "matmul",
        reason: format!("dimension {value} exceeds cuBLAS's 32-bit sizes"),
    })
}

#[cfg(test)]
mod tests {
    use super::workspace_bytes_from_config;

    #[test]
    fn workspace_config_reads_as_pytorch_reads_it() {
        assert_eq!(workspace_bytes_from_config(":4096:8"), Some(32 << 20));
        assert_eq!(
            workspace_bytes_from_config(":4096:2:16:8"),
            Some((8 << 20) + (128 << 10))
        );
        assert_eq!(workspace_bytes_from_config(":0:0"), Some(0));
        for bad in [
            "",
            "4096:8",
            ":4096",
            ":a:8",
            ":4096:8:",
            ":99999999999999999:999999",
        ] {
            assert_eq!(workspace_bytes_from_config(bad), None, "{bad:?}");
        }
    }
}
