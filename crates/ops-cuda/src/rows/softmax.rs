//! Softmax and log-softmax along one dim by `kernels/rows.cu`, forward and backward: the dim is
//! the row walked by one block, every other dim picks a row.
//!
//! This room sits on the rows family's `args.rs` and the ground floor, and imports no other room.

use headroom_autograd_core::{Result, SoftmaxBackward, TensorError, View};

use super::args::{launch, row_args, same_dtype, same_shape};
use crate::device::CudaBackend;
use crate::kernels::float_suffix;
use crate::launch::Param;

/// Splits `view` into (outer shape, outer strides) without `dim`, and its stride along `dim`.
fn lanes(view: &View<'_>, dim: usize) -> (Vec<usize>, Vec<usize>, [usize; 1]) {
    let mut shape = view.layout.shape().to_vec();
    let mut strides = view.layout.strides().to_vec();
    shape.remove(dim);
    let lane = strides.remove(dim);
    (shape, strides, [lane])
}

pub(crate) fn softmax(
    backend: &CudaBackend,
    x: View<'_>,
    dim: usize,
    log: bool,
    out: View<'_>,
) -> Result<()> {
    same_dtype("softmax", &[&x, &out])?;
    same_shape("softmax", &[&x, &out])?;
    if dim >= x.layout.ndim() {
        return Err(TensorError::InvalidArgument {
            op: "softmax",
            reason: format!("dim {dim} of shape {:?}", x.layout.shape()),
        });
    }
    let suffix = float_suffix("softmax", x.dtype)?;
    let len = [x.layout.shape()[dim]];
    let (o, x_lanes) = (lanes(&out, dim), lanes(&x, dim));
    let args = row_args(
        "softmax",
        &[(&o.0, &o.1), (&x_lanes.0, &x_lanes.1)],
        &[(&len, &o.2), (&len, &x_lanes.2)],
        &[out.layout.offset(), x.layout.offset()],
    )?;
    let params = [
        Param::I32(i32::from(log)),
        Param::U64(x.buffer.address()),
        Param::U64(out.buffer.address()),
    ];
    launch(
        backend,
        "softmax",
        ("softmax", suffix),
        args.rows,
        &params,
        Some(args),
    )
}

pub(crate) fn softmax_backward(backend: &CudaBackend, args: SoftmaxBackward<'_>) -> Result<()> {
    let SoftmaxBackward { y, dy, dx, .. } = args;
    let (dim, log) = (args.dim, args.log);
    same_dtype("softmax_backward", &[&y, &dy, &dx])?;
    same_shape("softmax_backward", &[&y, &dy, &dx])?;
    if dim >= y.layout.ndim() {
        return Err(TensorError::InvalidArgument {
            op: "softmax_backward",
            reason: format!("dim {dim} of shape {:?}", y.layout.shape()),
        });
    }
    let suffix = float_suffix("softmax_backward", y.dtype)?;
    let len = [y.layout.shape()[dim]];
    let (d, yl, gl) = (lanes(&dx, dim), lanes(&y, dim), lanes(&dy, dim));
    let args = row_args(
        "softmax_backward",
        &[(&d.0, &d.1), (&yl.0, &yl.1), (&gl.0, &gl.1)],
        &[(&len, &d.2), (&len, &yl.2), (&len, &gl.2)],
        &[dx.layout.offset(), y.layout.offset(), dy.layout.offset()],
    )?;
    let params = [
        Param::I32(i32::from(log)),
        Param::U64(y.buffer.address()),
        Param::U64(dy.buffer.address()),
        Param::U64(dx.buffer.address()),
    ];
    launch(
        backend,
        "softmax_backward",
        ("softmax_backward", suffix),
        args.rows,
        &params,
        Some(args),
    )
}
