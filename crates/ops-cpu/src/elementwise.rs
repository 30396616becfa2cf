//! Elementwise kernels: copy/cast, fill, random fills, unary and binary math, masked ops and
//! dropout.
//!
//! Each kernel walks its operands with [`for_each_run`] (parallel when large) and computes in
//! the dtype's compute type (f32 for f16/bf16). Ops are matched once per call, outside the
//! loops, so every inner loop is a monomorphised closure. Nothing here allocates.

use headroom_autograd_core::{
    BinaryOp, DropoutDraw, MaskedOp, RandomDraw, Result, TensorError, UnaryOp, View,
};

use crate::element::{dispatch_any, dispatch_float, is_mask, BoolByte, Float, Real, Scalar};
use crate::strided::{for_each_run, for_each_run_weighted, HostPtr};

/// sqrt(2 / pi), the tanh-GELU constant.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of tanh-GELU.
const GELU_KAPPA: f64 = 0.044715;

fn check_shapes(op: &'static str, lhs: &View<'_>, rhs: &View<'_>) -> Result<()> {
    if lhs.layout.shape() != rhs.layout.shape() {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: lhs.layout.shape().to_vec(),
            rhs: rhs.layout.shape().to_vec(),
        });
    }
    Ok(())
}

/// `dst = src`, converting dtypes through f64 (a plain element copy when they match).
pub(crate) fn copy(src: View<'_>, dst: View<'_>) -> Result<()> {
    check_shapes("copy", &src, &dst)?;
    if src.dtype == dst.dtype {
        match src.dtype.size_in_bytes() {
            1 => copy_same::<u8>(src, dst),
            2 => copy_same::<u16>(src, dst),
            4 => copy_same::<u32>(src, dst),
            _ => copy_same::<u64>(src, dst),
        }
        return Ok(());
    }
    dispatch_any!(src.dtype, S => dispatch_any!(dst.dtype, D => copy_cast::<S, D>(src, dst)));
    Ok(())
}

fn copy_same<T: Copy + Send + Sync>(src: View<'_>, dst: View<'_>) {
    let (from, to) = (HostPtr::<T>::new(&src), HostPtr::<T>::new(&dst));
    for_each_run(
        dst.layout.shape(),
        [dst.layout.strides(), src.layout.strides()],
        [dst.layout.offset(), src.layout.offset()],
        |b, s, len| {
            to.check_run(b[0], s[0], len);
            from.check_run(b[1], s[1], len);
            for i in 0..len {
                // SAFETY: both runs were checked above and `i < len`.
                unsafe { to.write_in_run(b[0], s[0], i, from.read_in_run(b[1], s[1], i)) };
            }
        },
    );
}

fn copy_cast<S: Scalar, D: Scalar>(src: View<'_>, dst: View<'_>) {
    let (from, to) = (HostPtr::<S>::new(&src), HostPtr::<D>::new(&dst));
    for_each_run(
        dst.layout.shape(),
        [dst.layout.strides(), src.layout.strides()],
        [dst.layout.offset(), src.layout.offset()],
        |b, s, len| {
            for i in 0..len {
                to.write(
                    b[0] + i * s[0],
                    D::from_f64(from.read(b[1] + i * s[1]).to_f64()),
                );
            }
        },
    );
}

/// Sets every element of `dst` to `value`.
pub(crate) fn fill(dst: View<'_>, value: f64) -> Result<()> {
    dispatch_any!(dst.dtype, T => fill_typed(dst, <T as Scalar>::from_f64(value)));
    Ok(())
}

fn fill_typed<T: Scalar>(dst: View<'_>, value: T) {
    let to = HostPtr::<T>::new(&dst);
    for_each_run(
        dst.layout.shape(),
        [dst.layout.strides()],
        [dst.layout.offset()],
        |b, s, len| {
            for i in 0..len {
                to.write(b[0] + i * s[0], value);
            }
        },
    );
}

fn map1<T: Float>(x: View<'_>, out: View<'_>, f: impl Fn(T::C) -> T::C + Sync + Send) {
    let (from, to) = (HostPtr::<T>::new(&x), HostPtr::<T>::new(&out));
    for_each_run(
        out.layout.shape(),
        [out.layout.strides(), x.layout.strides()],
        [out.layout.offset(), x.layout.offset()],
        |b, s, len| {
            to.check_run(b[0], s[0], len);
            from.check_run(b[1], s[1], len);
            for i in 0..len {
                // SAFETY: both runs were checked above and `i < len`.
                unsafe {
                    let value = from.read_in_run(b[1], s[1], i).load();
                    to.write_in_run(b[0], s[0], i, T::store(f(value)));
                }
            }
        },
    );
}

fn map2<T: Float>(
    a: View<'_>,
    b: View<'_>,
    out: View<'_>,
    f: impl Fn(T::C, T::C) -> T::C + Sync + Send,
) {
    let (lhs, rhs, to) = (
        HostPtr::<T>::new(&a),
        HostPtr::<T>::new(&b),
        HostPtr::<T>::new(&out),
    );
    for_each_run(
        out.layout.shape(),
        [out.layout.strides(), a.layout.strides(), b.layout.strides()],
        [out.layout.offset(), a.layout.offset(), b.layout.offset()],
        |o, s, len| {
            to.check_run(o[0], s[0], len);
            lhs.check_run(o[1], s[1], len);
            rhs.check_run(o[2], s[2], len);
            for i in 0..len {
                // SAFETY: the three runs were checked above and `i < len`.
                unsafe {
                    let value = f(
                        lhs.read_in_run(o[1], s[1], i).load(),
                        rhs.read_in_run(o[2], s[2], i).load(),
                    );
                    to.write_in_run(o[0], s[0], i, T::store(value));
                }
            }
        },
    );
}

/// The standard normal CDF times x.
fn gelu<C: Real>(x: C) -> C {
    let half = C::from_f64(0.5);
    half * x * (C::ONE + (x * C::from_f64(std::f64::consts::FRAC_1_SQRT_2)).erf())
}

fn gelu_grad<C: Real>(x: C) -> C {
    let half = C::from_f64(0.5);
    let cdf = half * (C::ONE + (x * C::from_f64(std::f64::consts::FRAC_1_SQRT_2)).erf());
    let pdf = (-half * x * x).exp() * C::from_f64(0.398_942_280_401_432_7);
    cdf + x * pdf
}

fn gelu_tanh<C: Real>(x: C) -> C {
    let inner = C::from_f64(SQRT_2_OVER_PI) * (x + C::from_f64(GELU_KAPPA) * x * x * x);
    C::from_f64(0.5) * x * (C::ONE + inner.tanh())
}

fn gelu_tanh_grad<C: Real>(x: C) -> C {
    let (beta, kappa) = (C::from_f64(SQRT_2_OVER_PI), C::from_f64(GELU_KAPPA));
    let half = C::from_f64(0.5);
    let x_sq = x * x;
    let tanh_inner = (beta * (x + kappa * x_sq * x)).tanh();
    let left_derivative = half * (C::ONE + tanh_inner);
    let right_derivative = half
        * x
        * (C::ONE - tanh_inner * tanh_inner)
        * beta
        * (C::ONE + C::from_f64(3.0) * kappa * x_sq);
    left_derivative + right_derivative
}

/// `out = op(x)`.
pub(crate) fn unary(op: UnaryOp, x: View<'_>, out: View<'_>) -> Result<()> {
    check_shapes("unary", &x, &out)?;
    dispatch_float!(x.dtype, "unary", T => unary_typed::<T>(op, x, out));
    Ok(())
}

fn unary_typed<T: Float>(op: UnaryOp, x: View<'_>, out: View<'_>) {
    type C<T> = <T as Float>::C;
    match op {
        UnaryOp::Neg => map1::<T>(x, out, |v| -v),
        UnaryOp::Exp => map1::<T>(x, out, Real::exp),
        UnaryOp::Log => map1::<T>(x, out, Real::ln),
        UnaryOp::Sqrt => map1::<T>(x, out, Real::sqrt),
        UnaryOp::Rsqrt => map1::<T>(x, out, |v| C::<T>::ONE / v.sqrt()),
        UnaryOp::Tanh => map1::<T>(x, out, Real::tanh),
        UnaryOp::Relu => map1::<T>(x, out, |v| if v < C::<T>::ZERO { C::<T>::ZERO } else { v }),
        UnaryOp::Gelu => map1::<T>(x, out, gelu),
        UnaryOp::GeluTanh => map1::<T>(x, out, gelu_tanh),
        UnaryOp::AddScalar(c) => {
            let c = C::<T>::from_f64(c);
            map1::<T>(x, out, move |v| v + c)
        }
        UnaryOp::MulScalar(c) => {
            let c = C::<T>::from_f64(c);
            map1::<T>(x, out, move |v| v * c)
        }
        UnaryOp::DivScalar(c) => {
            let c = C::<T>::from_f64(c);
            map1::<T>(x, out, move |v| v / c)
        }
        UnaryOp::PowScalar(c) => {
            let c = C::<T>::from_f64(c);
            map1::<T>(x, out, move |v| v.powf(c))
        }
    }
}

/// `out = op(a, b)`.
pub(crate) fn binary(op: BinaryOp, a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()> {
    check_shapes("binary", &a, &out)?;
    check_shapes("binary", &b, &out)?;
    if a.dtype != b.dtype || a.dtype != out.dtype {
        return Err(TensorError::DtypeMismatch {
            op: "binary",
            lhs: a.dtype,
            rhs: b.dtype,
        });
    }
    dispatch_float!(a.dtype, "binary", T => binary_typed::<T>(op, a, b, out));
    Ok(())
}

fn binary_typed<T: Float>(op: BinaryOp, a: View<'_>, b: View<'_>, out: View<'_>) {
    type C<T> = <T as Float>::C;
    match op {
        BinaryOp::Add => map2::<T>(a, b, out, |x, y| x + y),
        BinaryOp::Sub => map2::<T>(a, b, out, |x, y| x - y),
        BinaryOp::Mul => map2::<T>(a, b, out, |x, y| x * y),
        BinaryOp::Div => map2::<T>(a, b, out, |x, y| x / y),
        BinaryOp::Pow => map2::<T>(a, b, out, Real::powf),
        BinaryOp::ReluBackward => {
            map2::<T>(
                a,
                b,
                out,
                |g, y| if y > C::<T>::ZERO { g } else { C::<T>::ZERO },
            )
        }
        BinaryOp::GeluBackward => map2::<T>(a, b, out, |g, x| g * gelu_grad(x)),
        BinaryOp::GeluTanhBackward => map2::<T>(a, b, out, |g, x| g * gelu_tanh_grad(x)),
        BinaryOp::TanhBackward => map2::<T>(a, b, out, |g, y| g * (C::<T>::ONE - y * y)),
        BinaryOp::SqrtBackward => map2::<T>(a, b, out, |g, y| g / (y + y)),
        BinaryOp::RsqrtBackward => {
            map2::<T>(a, b, out, |g, y| -(C::<T>::from_f64(0.5) * g * y * y * y))
        }
    }
}

/// `out = op(x, mask)`.
pub(crate) fn masked(op: MaskedOp, x: View<'_>, mask: View<'_>, out: View<'_>) -> Result<()> {
    check_shapes("masked", &x, &mask)?;
    check_shapes("masked", &x, &out)?;
    if !is_mask(mask.dtype) {
        return Err(TensorError::UnsupportedDtype {
            op: "masked",
            dtype: mask.dtype,
        });
    }
    dispatch_float!(x.dtype, "masked", T => masked_typed::<T>(op, x, mask, out));
    Ok(())
}

fn masked_typed<T: Float>(op: MaskedOp, x: View<'_>, mask: View<'_>, out: View<'_>) {
    let (from, flags, to) = (
        HostPtr::<T>::new(&x),
        HostPtr::<BoolByte>::new(&mask),
        HostPtr::<T>::new(&out),
    );
    let (fill_value, scale, is_fill) = match op {
        MaskedOp::Fill(value) => (<T::C as Real>::from_f64(value), <T::C as Real>::ONE, true),
        MaskedOp::Scale(scale) => (<T::C as Real>::ZERO, <T::C as Real>::from_f64(scale), false),
    };
    for_each_run(
        out.layout.shape(),
        [
            out.layout.strides(),
            x.layout.strides(),
            mask.layout.strides(),
        ],
        [out.layout.offset(), x.layout.offset(), mask.layout.offset()],
        |o, s, len| {
            for i in 0..len {
                let set = flags.read(o[2] + i * s[2]).0 != 0;
                let value = match (is_fill, set) {
                    (true, true) => fill_value,
                    (true, false) => from.read(o[1] + i * s[1]).load(),
                    (false, true) => from.read(o[1] + i * s[1]).load() * scale,
                    (false, false) => <T::C as Real>::ZERO,
                };
                to.write(o[0] + i * s[0], T::store(value));
            }
        },
    );
}

/// Dropout forward; `out` and `mask` are dense, so an element's offset in `out` is its
/// row-major index, which keys the random stream.
pub(crate) fn dropout(x: View<'_>, draw: DropoutDraw, out: View<'_>, mask: View<'_>) -> Result<()> {
    check_shapes("dropout", &x, &out)?;
    check_shapes("dropout", &x, &mask)?;
    if !out.layout.is_contiguous()
        || !mask.layout.is_contiguous()
        || out.layout.offset() != 0
        || mask.layout.offset() != 0
    {
        return Err(TensorError::InvalidArgument {
            op: "dropout",
            reason: "out and mask must be fresh dense tensors".into(),
        });
    }
    dispatch_float!(x.dtype, "dropout", T => dropout_typed::<T>(x, draw, out, mask));
    Ok(())
}

fn dropout_typed<T: Float>(x: View<'_>, draw: DropoutDraw, out: View<'_>, mask: View<'_>) {
    let (from, to, flags) = (
        HostPtr::<T>::new(&x),
        HostPtr::<T>::new(&out),
        HostPtr::<BoolByte>::new(&mask),
    );
    let scale = <T::C as Real>::from_f64(draw.scale());
    let dense = headroom_autograd_core::contiguous_strides(out.layout.shape());
    for_each_run(
        out.layout.shape(),
        [&dense, x.layout.strides()],
        [0, x.layout.offset()],
        |o, s, len| {
            for i in 0..len {
                let index = o[0] + i * s[0];
                let keep = draw.keeps(index as u64);
                let value = if keep {
                    from.read(o[1] + i * s[1]).load() * scale
                } else {
                    <T::C as Real>::ZERO
                };
                to.write(index, T::store(value));
                flags.write(index, BoolByte(u8::from(keep)));
            }
        },
    );
}

/// `dst`'s element `i` (row-major) = `draw.value(i)` rounded to the dtype, on rayon's threads
/// when the tensor is large.
pub(crate) fn random(dst: View<'_>, draw: RandomDraw) -> Result<()> {
    dispatch_float!(dst.dtype, "random", T => random_typed::<T>(dst, draw));
    Ok(())
}

fn random_typed<T: Float + Scalar>(dst: View<'_>, draw: RandomDraw) {
    let to = HostPtr::<T>::new(&dst);
    let dense = headroom_autograd_core::contiguous_strides(dst.layout.shape());
    // A draw costs about as much as a row of a softmax: the walk goes parallel early.
    for_each_run_weighted(
        dst.layout.shape(),
        [&dense, dst.layout.strides()],
        [0, dst.layout.offset()],
        16,
        |b, s, len| {
            for i in 0..len {
                let index = b[0] + i * s[0];
                to.write(b[1] + i * s[1], T::from_f64(draw.value(index as u64)));
            }
        },
    );
}
