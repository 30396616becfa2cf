//! The fused rotary embedding (`rotate_half` convention) and its transpose, the backward: each
//! pair `(x₁, x₂)` of a head's two halves is rotated by its position's angle, computed in f64 and
//! rounded once.
//!
//! Operands are padded to `[outer, heads, seq, head_dim]` (autograd-core's `RotaryDims`), any
//! strides; rows (one head at one position) are spread over rayon.

use headroom_autograd_core::{Result, RotaryArgs};
use rayon::prelude::*;

use crate::element::{dispatch_float, Float, Real};
use crate::strided::HostPtr;

pub(crate) fn rotary_embedding(args: RotaryArgs<'_>) -> Result<()> {
    args.dims()?;
    dispatch_float!(args.x.dtype, "rotary_embedding", T => rotate::<T>(args));
    Ok(())
}

fn rotate<T: Float>(args: RotaryArgs<'_>) {
    let dims = args.dims().expect("checked by the caller");
    let [outer, heads, seq, head_dim] = dims.shape;
    let half = head_dim / 2;
    let (x, out) = (HostPtr::<T>::new(&args.x), HostPtr::<T>::new(&args.out));
    let (cos, sin) = (HostPtr::<T>::new(&args.cos), HostPtr::<T>::new(&args.sin));
    let (cos0, sin0) = (args.cos.layout.offset(), args.sin.layout.offset());
    let (x0, out0) = (args.x.layout.offset(), args.out.layout.offset());
    let (xs, os) = (dims.x_strides, dims.out_strides);
    // Forward: out₁ = x₁c₁ − x₂s₁, out₂ = x₂c₂ + x₁s₂; transposed: out₁ = x₁c₁ + x₂s₂,
    // out₂ = x₂c₂ − x₁s₁.
    let transpose = args.transpose;
    (0..outer * heads * seq).into_par_iter().for_each(|row| {
        let (o, h, s) = (row / (heads * seq), (row / seq) % heads, row % seq);
        let x_base = x0 + o * xs[0] + h * xs[1] + s * xs[2];
        let out_base = out0 + o * os[0] + h * os[1] + s * os[2];
        let table = |ptr: HostPtr<T>, base: usize, j: usize| {
            ptr.read(base + s * head_dim + j).load().to_f64()
        };
        for j in 0..half {
            let x1 = x.read(x_base + j * xs[3]).load().to_f64();
            let x2 = x.read(x_base + (j + half) * xs[3]).load().to_f64();
            let (c1, c2) = (table(cos, cos0, j), table(cos, cos0, j + half));
            let (s1, s2) = (table(sin, sin0, j), table(sin, sin0, j + half));
            let (out1, out2) = if transpose {
                (x1 * c1 + x2 * s2, x2 * c2 - x1 * s1)
            } else {
                (x1 * c1 - x2 * s1, x2 * c2 + x1 * s2)
            };
            let store = |value: f64| T::store(<T::C as Real>::from_f64(value));
            out.write(out_base + j * os[3], store(out1));
            out.write(out_base + (j + half) * os[3], store(out2));
        }
    });
}
