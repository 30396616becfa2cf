//! The fp8 primitives' words: [`Float8Quantize`] (a tensor's scales and 8-bit codes in one call)
//! and [`Float8Matmul`] (the product of two scaled 8-bit operands, `torch._scaled_mm`'s
//! contract), with the shape rules every backend checks ([`float8_quantize_dims`],
//! [`float8_matmul_dims`]).
//!
//! It sits on views and dtypes; it knows no backend and no recipe (which operand is scaled how
//! is `crate::ops::float8`'s).

use super::args::{Operands, UnaryOp, View};
use crate::dtype::DType;
use crate::error::{Result, TensorError};

/// Which elements share one scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Float8Granularity {
    /// One scale for the whole tensor (torchao's `TENSORWISE`; cuBLASLt's scalar scales).
    Tensorwise,
    /// One scale per row, taken along the last dim (torchao's `AXISWISE` along the dim a GEMM
    /// contracts).
    Rowwise,
}

/// Inputs and outputs of [`Backend::quantize_float8`](super::Backend::quantize_float8): for
/// `v = f32(x) · premultiply` (an f32 product, per column) — or, with an `activation`,
/// `v = f32(activation(x))`, the activation computed as the backend's unary op computes it in
/// `x`'s dtype (rounded to it) —
/// `amax = max(|v| over a group, 1e-12)` (in f64; NaN if any `v` is),
/// `scale = f32(max_finite / amax)`, rounded down to a power of two when asked, and
/// `codes = saturate(round_nearest_even(f32(v · scale)))` in the 8-bit float.
#[derive(Debug, Clone, Copy)]
pub struct Float8Quantize<'a> {
    /// `[rows, cols]`, f32, f64, bf16 or f16, possibly strided.
    pub x: View<'a>,
    /// f32 `[cols]` (stride 0 for one value): each column's multiplier, applied before the amax
    /// (a fold of another operand's scales into this one), if any.
    pub premultiply: Option<View<'a>>,
    /// `UnaryOp::Gelu` or `UnaryOp::GeluTanh` applied to `x` first (a GELU linear's input in one
    /// pass, with no activation written), if any; not with `premultiply`. A backend may decline
    /// it (answer `Ok(false)`), and the core then applies the unary op first.
    pub activation: Option<UnaryOp>,
    /// One scale for all of `x`, or one per row.
    pub granularity: Float8Granularity,
    /// Scales rounded down to powers of two (`2^floor(log2 scale)`, torchao's
    /// `round_scales_to_power_of_2`): multiplying by one, or by its reciprocal, is exact.
    pub power_of_two: bool,
    /// The scales to use instead (delayed scaling: from earlier casts' amaxes), f32 shaped as
    /// `scale`, copied into `scale`; the current amax then only feeds `amax`.
    pub delayed_scale: Option<View<'a>>,
    /// The codes, dense `[rows, cols]`, F8E4M3 or F8E5M2.
    pub codes: View<'a>,
    /// The scales used, dense f32: `[1]` tensorwise, `[rows]` rowwise.
    pub scale: View<'a>,
    /// Where to write each group's amax (`max |v|` rounded to f32, before the floor; NaN if any
    /// `v` is), dense f32 shaped as `scale`, if wanted (delayed scaling's history).
    pub amax: Option<View<'a>>,
    /// Where to write each scale's reciprocal `1 / scale` (f32, correctly rounded; the
    /// canonical NaN for a NaN scale), dense f32 shaped as `scale`, if wanted: what
    /// [`Float8Matmul`] takes, with no division launched of its own.
    pub inverse_scale: Option<View<'a>>,
}

impl<'a> Float8Quantize<'a> {
    /// `codes`, `scale`, `amax` and `inverse_scale` written; `x`, `premultiply` and
    /// `delayed_scale` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new(
            [
                Some(self.codes),
                Some(self.scale),
                self.amax,
                self.inverse_scale,
            ],
            [Some(self.x), self.premultiply, self.delayed_scale],
        )
    }
}

/// Inputs and outputs of [`Backend::matmul_float8`](super::Backend::matmul_float8):
/// `out[i, j] = round(acc[i, j] · (a_inverse_scale[i] · b_inverse_scale[j]) + bias[j])`, where
/// `acc` is `Σ_k a[i, k] · b[k, j]` of the codes accumulated in f32 (each code widens to f32
/// exactly), the scales' product an f32 product, the bias (if any) added in f32, and `round` the
/// one rounding to `out`'s dtype.
#[derive(Debug, Clone, Copy)]
pub struct Float8Matmul<'a> {
    /// `[m, k]` codes, F8E4M3 or F8E5M2, possibly strided.
    pub a: View<'a>,
    /// `[k, n]` codes, F8E4M3 or F8E5M2 (not both operands E5M2), possibly strided.
    pub b: View<'a>,
    /// f32 `[m]` (stride 0 for one value): the reciprocals of `a`'s row scales.
    pub a_inverse_scale: View<'a>,
    /// f32 `[n]` (stride 0 for one value): the reciprocals of `b`'s column scales.
    pub b_inverse_scale: View<'a>,
    /// `[n]` in `out`'s dtype, added to every row before the rounding (a linear's bias), if any.
    pub bias: Option<View<'a>>,
    /// The product, dense `[m, n]`, f32, bf16 or f16.
    pub out: View<'a>,
}

impl<'a> Float8Matmul<'a> {
    /// `out` written; the codes, the scales and the bias read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new(
            [Some(self.out)],
            [
                Some(self.a),
                Some(self.b),
                Some(self.a_inverse_scale),
                Some(self.b_inverse_scale),
                self.bias,
            ],
        )
    }
}

fn invalid(op: &'static str, reason: String) -> TensorError {
    TensorError::InvalidArgument { op, reason }
}

fn check_dtype(op: &'static str, view: &View<'_>, ok: bool) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(TensorError::UnsupportedDtype {
            op,
            dtype: view.dtype,
        })
    }
}

/// `(rows, cols)` of a [`Float8Quantize`], after checking every shape and dtype.
pub fn float8_quantize_dims(args: &Float8Quantize<'_>) -> Result<(usize, usize)> {
    const OP: &str = "quantize_float8";
    let &[rows, cols] = args.x.layout.shape() else {
        return Err(invalid(
            OP,
            format!("x is {:?}, not [rows, cols]", args.x.layout.shape()),
        ));
    };
    check_dtype(OP, &args.x, args.x.dtype.is_float())?;
    check_dtype(OP, &args.codes, args.codes.dtype.is_float8())?;
    check_dtype(OP, &args.scale, args.scale.dtype == DType::F32)?;
    if args.codes.layout.shape() != [rows, cols] || !args.codes.layout.is_contiguous() {
        return Err(invalid(
            OP,
            format!(
                "codes {:?} are not dense [{rows}, {cols}]",
                args.codes.layout.shape()
            ),
        ));
    }
    let scales = match args.granularity {
        Float8Granularity::Tensorwise => 1,
        Float8Granularity::Rowwise => rows,
    };
    if args.scale.layout.shape() != [scales] || !args.scale.layout.is_contiguous() {
        return Err(invalid(
            OP,
            format!(
                "scale {:?} is not dense [{scales}]",
                args.scale.layout.shape()
            ),
        ));
    }
    for (view, name) in [
        (&args.delayed_scale, "delayed_scale"),
        (&args.amax, "amax"),
        (&args.inverse_scale, "inverse_scale"),
    ] {
        let Some(view) = view else { continue };
        check_dtype(OP, view, view.dtype == DType::F32)?;
        if view.layout.shape() != [scales] || !view.layout.is_contiguous() {
            return Err(invalid(
                OP,
                format!("{name} {:?} is not dense [{scales}]", view.layout.shape()),
            ));
        }
    }
    if let Some(activation) = args.activation {
        if !matches!(activation, UnaryOp::Gelu | UnaryOp::GeluTanh) || args.premultiply.is_some() {
            return Err(invalid(
                OP,
                format!(
                    "activation {activation:?} (with a premultiplier: {}): only GELU, alone",
                    args.premultiply.is_some()
                ),
            ));
        }
    }
    if let Some(premultiply) = &args.premultiply {
        check_dtype(OP, premultiply, premultiply.dtype == DType::F32)?;
        if premultiply.layout.shape() != [cols] {
            return Err(invalid(
                OP,
                format!(
                    "premultiply {:?} is not [{cols}]",
                    premultiply.layout.shape()
                ),
            ));
        }
    }
    Ok((rows, cols))
}

/// `(m, k, n)` of a [`Float8Matmul`], after checking every shape and dtype.
pub fn float8_matmul_dims(args: &Float8Matmul<'_>) -> Result<(usize, usize, usize)> {
    const OP: &str = "matmul_float8";
    let (&[m, k], &[k_b, n]) = (args.a.layout.shape(), args.b.layout.shape()) else {
        return Err(invalid(
            OP,
            format!(
                "a {:?} and b {:?} are not matrices",
                args.a.layout.shape(),
                args.b.layout.shape()
            ),
        ));
    };
    if k != k_b {
        return Err(invalid(
            OP,
            format!("a is [{m}, {k}] but b is [{k_b}, {n}]"),
        ));
    }
    check_dtype(OP, &args.a, args.a.dtype.is_float8())?;
    check_dtype(OP, &args.b, args.b.dtype.is_float8())?;
    if args.a.dtype == DType::F8E5M2 && args.b.dtype == DType::F8E5M2 {
        return Err(invalid(
            OP,
            "both operands are E5M2 (fp8 GEMMs take E4M3 for at least one)".to_string(),
        ));
    }
    for (scale, len, name) in [
        (&args.a_inverse_scale, m, "a_inverse_scale"),
        (&args.b_inverse_scale, n, "b_inverse_scale"),
    ] {
        check_dtype(OP, scale, scale.dtype == DType::F32)?;
        if scale.layout.shape() != [len] {
            return Err(invalid(
                OP,
                format!("{name} {:?} is not [{len}]", scale.layout.shape()),
            ));
        }
    }
    let out_ok = matches!(args.out.dtype, DType::F32 | DType::BF16 | DType::F16);
    check_dtype(OP, &args.out, out_ok)?;
    if let Some(bias) = &args.bias {
        check_dtype(OP, bias, bias.dtype == args.out.dtype)?;
        if bias.layout.shape() != [n] {
            return Err(invalid(
                OP,
                format!("bias {:?} is not [{n}]", bias.layout.shape()),
            ));
        }
    }
    if args.out.layout.shape() != [m, n] || !args.out.layout.is_contiguous() {
        return Err(invalid(
            OP,
            format!("out {:?} is not dense [{m}, {n}]", args.out.layout.shape()),
        ));
    }
    Ok((m, k, n))
}
