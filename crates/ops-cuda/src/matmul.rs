//! Batched GEMM through cuBLAS, on strided operands, with its workspace from the caching
//! allocator.
//!
//! Row-major `out = a @ b` is computed as the column-major `outᵀ = bᵀ · aᵀ`, so an operand whose
//! rows are contiguous is passed as is and a transposed one (contiguous columns) with the
//! transpose flag: transposes cost no copy. Batch dims are merged where every operand steps
//! through them uniformly and passed as one strided batch (stride 0 for a broadcast operand);
//! any other batch dims are looped over. f32 and f64 compute in their own precision (TF32 only
//! after `CudaBackend::set_allow_tf32(true)`, as in PyTorch), f16 and bf16 in f32, written rounded
//! to them or, into an f32 `out`, unrounded.
//!
//! The cuBLAS handle and its 32 MiB workspace (PyTorch's size on Hopper) are the ground floor's
//! (`blas.rs`), created on the first product; the workspace is an allocation of the backend's
//! caching allocator, so it shows in `memory_allocated()` as PyTorch's does. This family sits on
//! the ground floor (`blas.rs`, `operands.rs`, `scratch.rs`) and imports no other family.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys as blas_sys};
use headroom_autograd_core::{matmul_dims, DType, Layout, Result, TensorError, View};

use crate::blas::to_int;
use crate::device::CudaBackend;
use crate::error::device_error;
use crate::operands::copy_raw;
use crate::scratch::Scratch;

/// One operand matrix for cuBLAS: its transpose flag, leading dimension and element address.
#[derive(Debug, Clone, Copy)]
struct Matrix {
    op: blas_sys::cublasOperation_t,
    ld: i32,
}

/// `x` (row-major `[rows, cols]` with strides `(rs, cs)`) as the column-major `xᵀ` cuBLAS wants:
/// contiguous rows pass untransposed, contiguous columns pass with the transpose flag, and
/// anything else is `None` (the caller copies it dense).
///
/// The stride between the rows (or columns) becomes cuBLAS's leading dimension, so it must be at
/// least the row's (column's) length: rows that overlap — a stride of 0 after `expand`, say —
/// cannot be described to cuBLAS and are `None`. (Passing a larger leading dimension instead
/// made cuBLAS read rows that do not exist: wrong results, and on the H200 reads past the
/// buffer.) The stride of a dimension of size 1 is never stepped, so it is not passed: the
/// leading dimension is then the tightest cuBLAS accepts.
fn as_transposed(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<Matrix> {
    if (cs == 1 || cols == 1) && (rows == 1 || rs >= cols.max(1)) {
        let ld = if rows == 1 { cols } else { rs }.max(1);
        Some(Matrix {
            op: blas_sys::cublasOperation_t::CUBLAS_OP_N,
            ld: ld.try_into().ok()?,
        })
    } else if (rs == 1 || rows == 1) && (cols == 1 || cs >= rows.max(1)) {
        let ld = if cols == 1 { rows } else { cs }.max(1);
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
    // f16/bf16 inputs may write their f32 accumulation unrounded (the dims rule allows it).
    let (out_type, out_element) = if out.dtype == a.dtype {
        (data_type, element)
    } else {
        (blas_sys::cudaDataType::CUDA_R_32F, 4)
    };
    let out0 = out.buffer.address() + out_layout.offset() as u64 * out_element;
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
    let handle = state.handle();
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
        let at = |base: u64, i: usize| {
            let size = if i == 0 { out_element } else { element };
            base + offsets[i] as u64 * size
        };
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
                out_type,
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
    copy_raw(backend, src, view.layout, address, &dense, element)?;
    Ok((address, dense, Some(scratch)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn described(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<(bool, i32)> {
        as_transposed(rows, cols, rs, cs).map(|m| {
            let transposed = m.op == blas_sys::cublasOperation_t::CUBLAS_OP_T;
            (transposed, m.ld)
        })
    }

    #[test]
    fn dense_and_transposed_matrices_pass_in_place() {
        assert_eq!(described(3, 4, 4, 1), Some((false, 4)));
        assert_eq!(described(3, 4, 6, 1), Some((false, 6)));
        assert_eq!(described(3, 4, 1, 3), Some((true, 3)));
        assert_eq!(described(3, 4, 1, 5), Some((true, 5)));
    }

    #[test]
    fn overlapping_rows_or_columns_are_copied_first() {
        // `expand` of one row to 1000 rows: stride 0 between rows.
        assert_eq!(described(1000, 4, 0, 1), None);
        // A broadcast scalar seen as a column (a `k = 1` operand of a ViT head's weight
        // gradient at batch 1): no leading dimension describes it.
        assert_eq!(described(1000, 1, 0, 0), None);
        assert_eq!(described(1, 1000, 0, 0), None);
        // Rows closer than their length overlap too.
        assert_eq!(described(3, 4, 2, 1), None);
        assert_eq!(described(4, 3, 1, 2), None);
    }

    #[test]
    fn a_single_row_or_column_gets_the_tightest_leading_dimension() {
        // One row of a larger tensor keeps that tensor's row stride, which is never stepped.
        assert_eq!(described(1, 1024, 201_728, 1), Some((false, 1024)));
        assert_eq!(described(1024, 1, 1, 201_728), Some((false, 1)));
        assert_eq!(described(1024, 1, 0, 201_728), None);
        assert_eq!(described(1000, 1, 1, 1), Some((false, 1)));
    }
}
