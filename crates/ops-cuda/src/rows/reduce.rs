//! Reductions by the row kernels of `kernels/rows.cu`: sum, mean, max and min over trailing dims
//! (one block per output element), and max/min over the last dim with the index of the first
//! such element (one thread per row).
//!
//! This room sits on the rows family's `args.rs` and the ground floor; reductions that read a
//! matrix down its columns go to `column_sums.rs`, chosen by the family's entry point (`mod.rs`).

use cudarc::driver::LaunchConfig;
use headroom_autograd_core::{DType, ReduceOp, ReduceWithIndex, Result, TensorError, View};

use super::args::{launch, row_args, same_dtype, MAX_BLOCKS, MAX_DIMS, THREADS};
use crate::device::CudaBackend;
use crate::kernels::{float_suffix, Module};
use crate::launch::{launch_in, Param};

/// A reduction over the trailing `n_reduced` dims of `x` by the row kernel, one block per output
/// element; the entry point (`mod.rs`) checked the operands and chose this over column sums.
pub(crate) fn reduce_rows(
    backend: &CudaBackend,
    op: ReduceOp,
    x: View<'_>,
    n_reduced: usize,
    out: View<'_>,
    suffix: &'static str,
) -> Result<()> {
    let ndim = x.layout.ndim();
    let (outer_shape, inner_shape) = x.layout.shape().split_at(ndim - n_reduced);
    let (outer_strides, inner_strides) = x.layout.strides().split_at(ndim - n_reduced);
    if inner_shape.iter().product::<usize>() == 0 && matches!(op, ReduceOp::Max | ReduceOp::Min) {
        return Err(TensorError::InvalidArgument {
            op: "reduce",
            reason: "max/min of an empty dim".into(),
        });
    }
    let args = row_args(
        "reduce",
        &[
            (outer_shape, out.layout.strides()),
            (outer_shape, outer_strides),
        ],
        &[
            (inner_shape, &[0; MAX_DIMS][..inner_shape.len()]),
            (inner_shape, inner_strides),
        ],
        &[out.layout.offset(), x.layout.offset()],
    )?;
    let code = match op {
        ReduceOp::Sum => 0,
        ReduceOp::Mean => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    };
    let params = [
        Param::I32(code),
        Param::U64(x.buffer.address()),
        Param::U64(out.buffer.address()),
    ];
    launch(
        backend,
        "reduce",
        ("reduce", suffix),
        args.rows,
        &params,
        Some(args),
    )
}

/// Max or min over the last dim of `x` with the index of the first such element (a NaN wins).
pub(crate) fn reduce_with_index(backend: &CudaBackend, args: ReduceWithIndex<'_>) -> Result<()> {
    let ReduceWithIndex {
        op,
        x,
        values,
        indices,
    } = args;
    let name = "reduce_with_index";
    let is_max = match op {
        ReduceOp::Max => 1,
        ReduceOp::Min => 0,
        other => {
            return Err(TensorError::InvalidArgument {
                op: name,
                reason: format!("{other:?} has no index"),
            })
        }
    };
    same_dtype(name, &[&x, &values])?;
    if indices.dtype != DType::I64 {
        return Err(TensorError::UnsupportedDtype {
            op: name,
            dtype: indices.dtype,
        });
    }
    let ndim = x.layout.ndim();
    let outer = &x.layout.shape()[..ndim.saturating_sub(1)];
    if ndim == 0
        || values.layout.shape() != outer
        || indices.layout.shape() != outer
        || x.layout.shape()[ndim - 1] == 0
    {
        return Err(TensorError::ShapeMismatch {
            op: name,
            lhs: x.layout.shape().to_vec(),
            rhs: values.layout.shape().to_vec(),
        });
    }
    let suffix = float_suffix(name, x.dtype)?;
    let lane = [x.layout.shape()[ndim - 1]];
    let zero = [0usize];
    let args = row_args(
        name,
        &[
            (outer, values.layout.strides()),
            (outer, indices.layout.strides()),
            (outer, &x.layout.strides()[..ndim - 1]),
        ],
        &[
            (&lane, &zero),
            (&lane, &zero),
            (&lane, &x.layout.strides()[ndim - 1..]),
        ],
        &[
            values.layout.offset(),
            indices.layout.offset(),
            x.layout.offset(),
        ],
    )?;
    let params = [
        Param::I32(is_max),
        Param::U64(x.buffer.address()),
        Param::U64(values.buffer.address()),
        Param::U64(indices.buffer.address()),
    ];
    // One thread per row: rows / THREADS blocks.
    let blocks = args.rows.div_ceil(u64::from(THREADS));
    let config = LaunchConfig {
        grid_dim: (blocks.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    if args.rows == 0 {
        return Ok(());
    }
    launch_in(
        backend,
        Module::Rows,
        name,
        ("arg_reduce", suffix),
        config,
        &params,
        Some(args),
    )
}
