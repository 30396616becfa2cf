//! Gather and scatter-add along a dim (embedding forward and backward, max backward).
//!
//! Index values are checked against the indexed dim before any access. Gather's outputs are
//! independent and run in parallel; scatter-add may hit one destination from many sources, so
//! it runs serially in row-major order (deterministic sums).

use headroom_autograd_core::{index_strides, Result, TensorError, View};

use crate::element::{dispatch_float, Float};
use crate::strided::{for_each_run, for_each_run_serial, HostPtr};

/// Checks that every value of `index` (I64, shape-checked by [`index_strides`]) is in
/// `0..size`, the size of the indexed dim.
fn check_index_values(op: &'static str, index: &View<'_>, size: usize) -> Result<()> {
    let limit = size as i64;
    let ptr = HostPtr::<i64>::new(index);
    let mut bad = None;
    for_each_run_serial(
        index.layout.shape(),
        [index.layout.strides()],
        [index.layout.offset()],
        |o, s, len| {
            for i in 0..len {
                let value = ptr.read(o[0] + i * s[0]);
                if !(0..limit).contains(&value) {
                    bad = Some(value);
                }
            }
        },
    );
    if let Some(value) = bad {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!("index {value} is out of bounds for size {limit}"),
        });
    }
    Ok(())
}

pub(crate) fn gather(x: View<'_>, dim: usize, index: View<'_>, out: View<'_>) -> Result<()> {
    let strides = index_strides("gather", &x, dim, &index, &out)?;
    check_index_values("gather", &index, x.layout.shape()[dim])?;
    dispatch_float!(x.dtype, "gather", T => gather_typed::<T>(x, dim, index, out, &strides));
    Ok(())
}

fn gather_typed<T: Float>(
    x: View<'_>,
    dim: usize,
    index: View<'_>,
    out: View<'_>,
    strides: &[usize],
) {
    let (from, at, to) = (
        HostPtr::<T>::new(&x),
        HostPtr::<i64>::new(&index),
        HostPtr::<T>::new(&out),
    );
    let dim_stride = x.layout.strides()[dim];
    for_each_run(
        out.layout.shape(),
        [out.layout.strides(), index.layout.strides(), strides],
        [
            out.layout.offset(),
            index.layout.offset(),
            x.layout.offset(),
        ],
        |o, s, len| {
            for i in 0..len {
                let position = at.read(o[1] + i * s[1]) as usize;
                to.write(
                    o[0] + i * s[0],
                    from.read(o[2] + i * s[2] + position * dim_stride),
                );
            }
        },
    );
}

pub(crate) fn scatter_add(dst: View<'_>, dim: usize, index: View<'_>, src: View<'_>) -> Result<()> {
    let strides = index_strides("scatter_add", &dst, dim, &index, &src)?;
    check_index_values("scatter_add", &index, dst.layout.shape()[dim])?;
    if src.dtype != dst.dtype {
        return Err(TensorError::DtypeMismatch {
            op: "scatter_add",
            lhs: dst.dtype,
            rhs: src.dtype,
        });
    }
    dispatch_float!(dst.dtype, "scatter_add", T => scatter_add_typed::<T>(dst, dim, index, src, &strides));
    Ok(())
}

fn scatter_add_typed<T: Float>(
    dst: View<'_>,
    dim: usize,
    index: View<'_>,
    src: View<'_>,
    strides: &[usize],
) {
    let (to, at, from) = (
        HostPtr::<T>::new(&dst),
        HostPtr::<i64>::new(&index),
        HostPtr::<T>::new(&src),
    );
    let dim_stride = dst.layout.strides()[dim];
    for_each_run_serial(
        src.layout.shape(),
        [src.layout.strides(), index.layout.strides(), strides],
        [
            src.layout.offset(),
            index.layout.offset(),
            dst.layout.offset(),
        ],
        |o, s, len| {
            for i in 0..len {
                let target = o[2] + i * s[2] + at.read(o[1] + i * s[1]) as usize * dim_stride;
                let sum = to.read(target).load() + from.read(o[0] + i * s[0]).load();
                to.write(target, T::store(sum));
            }
        },
    );
}
