//! Fused SwiGLU, `silu(gate) · up`, and its backward, which recomputes `silu(gate)` and its
//! derivative from `gate` (the forward saves nothing else).
//!
//! Everything is computed in f64 and rounded once to the operands' dtype: the reference the CUDA
//! kernels (f32 arithmetic for 16- and 32-bit types) are held to. `gate` and `up` are `[rows, n]`
//! with a contiguous last dim and any row stride; the walk goes over rayon.

use headroom_autograd_core::{GateUp, Result, SwiGluBackward, SwiGluForward, View};

use crate::element::{dispatch_float, Float, Real};
use crate::strided::{for_each_run, HostPtr};

/// `1 / (1 + e^-g)`.
fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

/// Walks the `[rows, n]` operands `views` together: `visit(values)` gets each element's input
/// values (the first `inputs` views) and returns the values of the rest, the outputs.
fn walk<T: Float, const N: usize>(
    views: [View<'_>; N],
    inputs: usize,
    visit: impl Fn(&[f64]) -> [f64; 2] + Sync + Send,
) {
    let ptrs = views.map(|v| HostPtr::<T>::new(&v));
    let shape = views[0].layout.shape();
    for_each_run(
        shape,
        views.map(|v| v.layout.strides()),
        views.map(|v| v.layout.offset()),
        |bases, strides, len| {
            for (k, ptr) in ptrs.iter().enumerate() {
                ptr.check_run(bases[k], strides[k], len);
            }
            let mut values = [0.0; N];
            for i in 0..len {
                for k in 0..inputs {
                    // SAFETY: every run was checked above and `i < len`.
                    values[k] = unsafe { ptrs[k].read_in_run(bases[k], strides[k], i) }
                        .load()
                        .to_f64();
                }
                let results = visit(&values[..inputs]);
                for (k, result) in (inputs..N).zip(results) {
                    let value = T::store(<T::C as Real>::from_f64(result));
                    // SAFETY: as above; each output element is reached by exactly one run.
                    unsafe { ptrs[k].write_in_run(bases[k], strides[k], i, value) };
                }
            }
        },
    );
}

pub(crate) fn swiglu(args: SwiGluForward<'_>) -> Result<()> {
    args.dims()?;
    let GateUp { gate, up } = args.inputs;
    dispatch_float!(gate.dtype, "swiglu", T => walk::<T, 3>(
        [gate, up, args.out],
        2,
        |v| [v[0] * sigmoid(v[0]) * v[1], 0.0],
    ));
    Ok(())
}

pub(crate) fn swiglu_backward(args: SwiGluBackward<'_>) -> Result<()> {
    args.dims()?;
    let (GateUp { gate, up }, grads) = (args.inputs, args.grads);
    dispatch_float!(gate.dtype, "swiglu_backward", T => walk::<T, 5>(
        [gate, up, args.dout, grads.gate, grads.up],
        3,
        |v| {
            let (gate, up, dout) = (v[0], v[1], v[2]);
            let s = sigmoid(gate);
            [dout * up * s * (1.0 + gate * (1.0 - s)), dout * gate * s]
        },
    ));
    Ok(())
}
