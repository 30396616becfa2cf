//! How tensors become fp8 codes for the fp8 ops (`ops/float8.rs`): the quantize with current
//! scales (tensorwise or rowwise, premultiplied, power-of-two), through the backend's fused
//! primitive or, tensorwise, composed of reductions and casts; delayed scaling's amax history
//! ([`Float8History`]); and the last linear input's codes, remembered so linears reading one
//! tensor share them.
//!
//! It sits on the backend trait and the tensor ops; it knows no linear (which operand is cast
//! how is `ops/float8.rs`'s).

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::autocast::autocast_disabled;
use crate::backend::{Float8Granularity, Float8Quantize, UnaryOp, View};
use crate::buffer::Buffer;
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::layout::Layout;
use crate::tensor::{Tensor, TensorImpl};

use super::float8::{Float8Recipe, Float8Tensor};
use super::index::cat;

/// The smallest amax a scale is taken against (torchao's `EPS`): an all-zero tensor scales by
/// `max_finite · 1e12` rather than dividing by zero.
const AMAX_FLOOR: f64 = 1e-12;

/// The tensors of a linear that delayed scaling keeps an amax history for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Float8Role {
    /// The linear's input.
    Input,
    /// Its weight.
    Weight,
    /// The gradient of its output.
    OutputGrad,
}

/// Delayed scaling's state for one linear (Transformer Engine's default, torchao's former
/// `ScalingType.DELAYED`): per [`Float8Role`], the amaxes of its last `len` casts, newest first,
/// in f32 on the linear's device. A cast scales by `max_finite / max(max(history), 1e-12)`, so it
/// needs no amax of its own before it casts (saturating if the tensor outgrew its history), and
/// then records its amax; the first cast of a role, with no history, scales by its own amax.
/// Unlike torchao, which refreshed scales once a step, every cast reads the history as the
/// previous casts left it.
///
/// ```
/// use headroom_autograd_core::{DType, Float8History, Float8Role, Tensor};
/// use headroom_ops_cpu::CpuBackend;
///
/// let cpu = CpuBackend::new_ref();
/// let history = Float8History::new(2)?;
/// let w = Tensor::from_f64s(&cpu, &[1.0, 0.0, 0.0, 1.0], &[2, 2], DType::F32)?;
/// for (step, peak) in [4.0, 2.0, 8.0].into_iter().enumerate() {
///     let x = Tensor::from_f64s(&cpu, &[peak, 1.0], &[1, 2], DType::F32)?;
///     let y = x.linear_float8_delayed(&w, None, &history)?;
///     // Step 2 scales by step 0 and 1's amaxes (448 / 4): 8 saturates to 448 / 112 = 4.
///     let want = if step == 2 { 4.0 } else { peak };
///     assert!((y.to_vec_f64()?[0] - want).abs() < 1e-5);
/// }
/// assert_eq!(history.amaxes(Float8Role::Input)?, [8.0, 2.0]); // the last two, newest first
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Float8History {
    len: usize,
    amaxes: Mutex<[Option<Tensor>; 3]>,
}

impl Float8History {
    /// A history of the last `len` amaxes per role (torchao used 16); `len` 0 is an error.
    pub fn new(len: usize) -> Result<Arc<Float8History>> {
        if len == 0 {
            return Err(TensorError::InvalidArgument {
                op: "Float8History::new",
                reason: "a history of 0 amaxes gives no scale; use 1 or more".to_string(),
            });
        }
        Ok(Arc::new(Float8History {
            len,
            amaxes: Mutex::new([None, None, None]),
        }))
    }

    /// How many amaxes a role keeps.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no cast has been recorded yet, for any role.
    pub fn is_empty(&self) -> bool {
        self.amaxes.lock().iter().all(Option::is_none)
    }

    /// The amaxes recorded for `role`, newest first (fewer than [`Float8History::len`] before
    /// that many casts). Reads them back from the device.
    pub fn amaxes(&self, role: Float8Role) -> Result<Vec<f64>> {
        let history = self.amaxes.lock()[role as usize].clone();
        history.map_or(Ok(Vec::new()), |history| history.to_vec_f64())
    }

    /// `x` (2-D) in `dtype`, scaled by `role`'s history (or by its own amax when there is none),
    /// its amax then recorded.
    pub(super) fn cast(&self, role: Float8Role, x: &Tensor, dtype: DType) -> Result<Float8Tensor> {
        let max_finite = dtype.max_finite().filter(|_| dtype.is_float8());
        let Some(max_finite) = max_finite else {
            return Err(TensorError::UnsupportedDtype {
                op: "to_float8",
                dtype,
            });
        };
        let (_grad, _autocast) = (no_grad(), autocast_disabled());
        let mut slots = self.amaxes.lock();
        let slot = &mut slots[role as usize];
        let delayed = match slot.as_ref() {
            Some(history) => Some(scale_of_amax(&history.max_dim(0, true)?.0, max_finite)?),
            None => None,
        };
        let scaling = Scaling {
            granularity: Float8Granularity::Tensorwise,
            power_of_two: false,
            premultiply: None,
            delayed: delayed.as_ref(),
            activation: None,
        };
        let (res, amax) = quantize_with(x, dtype, scaling, true)?;
        let amax = amax.expect("asked for");
        let next = match slot.take() {
            None => amax,
            Some(history) => {
                let kept = history.numel().min(self.len - 1);
                cat(&[&amax, &history.narrow(0, 0, kept)?], 0)?
            }
        };
        *slot = Some(next);
        Ok(res)
    }
}

/// `max_finite / max(amax, 1e-12)` of an f32 `[1]` amax, in f64, rounded to f32 (`[1]`).
fn scale_of_amax(amax: &Tensor, max_finite: f64) -> Result<Tensor> {
    let backend = amax.backend();
    let floor = Tensor::full(backend, &[1], AMAX_FLOOR, DType::F64)?;
    let floored = cat(&[&amax.to_dtype(DType::F64)?, &floor], 0)?
        .max_dim(0, true)?
        .0;
    Tensor::full(backend, &[1], max_finite, DType::F64)?
        .div(&floored)?
        .to_dtype(DType::F32)
}

/// Scales and codes of a 2-D `x` (`[rows, cols]`, any strides), each value first multiplied by
/// its column's `premultiply` (f32, `[]` or `[cols]`) if given (see [`quantize_with`]).
pub(super) fn quantize(
    x: &Tensor,
    premultiply: Option<&Tensor>,
    dtype: DType,
    granularity: Float8Granularity,
    power_of_two: bool,
) -> Result<Float8Tensor> {
    let scaling = Scaling {
        granularity,
        power_of_two,
        premultiply,
        delayed: None,
        activation: None,
    };
    Ok(quantize_with(x, dtype, scaling, false)?.0)
}

/// How [`quantize_with`] scales.
#[derive(Clone, Copy)]
pub(super) struct Scaling<'t> {
    pub(super) granularity: Float8Granularity,
    pub(super) power_of_two: bool,
    /// f32, `[]` or `[cols]`: each column's multiplier, before anything else.
    pub(super) premultiply: Option<&'t Tensor>,
    /// f32 `[1]`: the scale to use instead of the current amax's (delayed scaling; tensorwise).
    pub(super) delayed: Option<&'t Tensor>,
    /// A GELU applied to `x` first (a GELU linear's input): inside the backend's quantize where
    /// it takes it, else the unary op and then the quantize, the same bits.
    pub(super) activation: Option<UnaryOp>,
}

/// Scales, their reciprocals and codes of a 2-D `x`, and its amax when `record_amax` (f32 `[1]`
/// or `[rows]`): the backend's fused quantize, or for tensorwise scales without a premultiplier
/// or power-of-two rounding, reductions and casts. The scales come back as `[]` (tensorwise) or
/// `[rows]`.
pub(super) fn quantize_with(
    x: &Tensor,
    dtype: DType,
    scaling: Scaling<'_>,
    record_amax: bool,
) -> Result<(Float8Tensor, Option<Tensor>)> {
    const OP: &str = "to_float8";
    if !dtype.is_float8() {
        return Err(TensorError::UnsupportedDtype { op: OP, dtype });
    }
    let _autocast = autocast_disabled();
    let Scaling {
        granularity,
        power_of_two,
        premultiply,
        delayed,
        activation,
    } = scaling;
    let (rows, cols) = (x.shape()[0], x.shape()[1]);
    let backend = x.backend();
    let codes = Tensor::empty(backend, &[rows, cols], dtype)?;
    let groups = match granularity {
        Float8Granularity::Tensorwise => 1,
        Float8Granularity::Rowwise => rows,
    };
    let scale = Tensor::empty(backend, &[groups], DType::F32)?;
    let amax = record_amax
        .then(|| Tensor::empty(backend, &[groups], DType::F32))
        .transpose()?;
    let inverse_scale = Tensor::empty(backend, &[groups], DType::F32)?;
    let premultiply_layout = premultiply
        .map(|p| p.layout().expand(OP, &[cols]))
        .transpose()?;
    let fused = backend.quantize_float8(Float8Quantize {
        x: x.view(),
        premultiply: premultiply
            .zip(premultiply_layout.as_ref())
            .map(|(p, layout)| View { layout, ..p.view() }),
        activation,
        granularity,
        power_of_two,
        delayed_scale: delayed.map(Tensor::view),
        codes: codes.view(),
        scale: scale.view(),
        amax: amax.as_ref().map(Tensor::view),
        inverse_scale: Some(inverse_scale.view()),
    })?;
    if fused {
        let (scale, inverse_scale) = match granularity {
            Float8Granularity::Tensorwise => (scale.reshape(&[])?, inverse_scale.reshape(&[])?),
            Float8Granularity::Rowwise => (scale, inverse_scale),
        };
        let res = Float8Tensor {
            codes,
            scale,
            inverse_scale,
        };
        return Ok((res, amax));
    }
    if let Some(op) = activation {
        // Declined: the activation first, as its own op would compute it.
        let activated = x.unary_raw(op, "to_float8")?;
        let scaling = Scaling {
            activation: None,
            ..scaling
        };
        return quantize_with(&activated, dtype, scaling, record_amax);
    }
    if granularity == Float8Granularity::Rowwise || premultiply.is_some() || power_of_two {
        return Err(TensorError::InvalidArgument {
            op: OP,
            reason: format!(
                "rowwise, premultiplied or power-of-two scales need the backend's fused fp8 \
                 quantize, which the {:?} backend does not have yet; use Float8Recipe::TENSORWISE \
                 there",
                x.device()
            ),
        });
    }
    let (res, amax) = composed_tensorwise(x, dtype, delayed)?;
    Ok((res, record_amax.then_some(amax)))
}

/// Tensorwise scale, codes and amax (f32 `[1]`) from reductions and casts (a backend without
/// the fused quantize): amax = max(max(x), max(−x)), exact in x's dtype, the two extremes alone
/// widened to f64, where torchao takes the scale (against the floor), unless a delayed scale is
/// given.
fn composed_tensorwise(
    x: &Tensor,
    dtype: DType,
    delayed: Option<&Tensor>,
) -> Result<(Float8Tensor, Tensor)> {
    let max_finite = dtype.max_finite().expect("an 8-bit float");
    let backend = x.backend();
    let flat = x.contiguous()?.reshape(&[x.numel()])?;
    let zero = Tensor::zeros(backend, &[1], DType::F64)?;
    let amax = if flat.numel() == 0 {
        zero
    } else {
        let high = flat.max_dim(0, true)?.0.to_dtype(DType::F64)?;
        let low = flat.neg()?.max_dim(0, true)?.0.to_dtype(DType::F64)?;
        cat(&[&high, &low, &zero], 0)?.max_dim(0, true)?.0
    };
    let scale = match delayed {
        Some(delayed) => delayed.reshape(&[])?,
        None => {
            let floor = Tensor::full(backend, &[1], AMAX_FLOOR, DType::F64)?;
            let floored = cat(&[&amax, &floor], 0)?.max_dim(0, false)?.0;
            Tensor::full(backend, &[], max_finite, DType::F64)?
                .div(&floored)?
                .to_dtype(DType::F32)?
        }
    };
    let codes = x.to_dtype(DType::F32)?.mul(&scale)?.to_dtype(dtype)?;
    let inverse_scale = Tensor::full(backend, &[], 1.0, DType::F32)?.div(&scale)?;
    let res = Float8Tensor {
        codes,
        scale,
        inverse_scale,
    };
    Ok((res, amax.to_dtype(DType::F32)?))
}

thread_local! {
    /// The input the last fp8 linear on this thread quantized, and its codes, so the linears that
    /// read one tensor (a block's q, k and v projections) quantize it once and save one copy.
    /// Weak on every side: it keeps neither an input nor codes alive, so codes nobody saved are
    /// freed as always, and an entry whose input was dropped can never match (a live weak
    /// reference keeps its allocation from being reused by another tensor). The codes come back
    /// as views of the saved storages, contiguous as quantize wrote them.
    static LAST_INPUT: RefCell<Option<QuantizedInput>> = const { RefCell::new(None) };
}

struct QuantizedInput {
    input: Weak<TensorImpl>,
    version: u64,
    recipe: Float8Recipe,
    /// The storages of the codes and of the scales' reciprocals (saved tensors hold their own
    /// handles on them).
    codes: Weak<Buffer>,
    inverse_scale: Weak<Buffer>,
    scale_shape: Vec<usize>,
}

/// `input` as `[rows, in]` E4M3 codes with `recipe`'s scales, and the scales' reciprocals (what
/// a product and a linear's backward take; nothing needs the scales themselves): the last
/// linear's when it quantized this very tensor, unchanged since (its version), with this recipe,
/// and they are still alive; else quantized now and remembered.
pub(super) fn quantized_input(
    input: &Tensor,
    shape: [usize; 2],
    recipe: Float8Recipe,
) -> Result<(Tensor, Tensor)> {
    let hit = LAST_INPUT.with(|last| {
        let last = last.borrow();
        let entry = last.as_ref().filter(|entry| {
            entry.input.as_ptr() == Arc::as_ptr(&input.inner)
                && entry.version == input.version()
                && entry.recipe == recipe
        })?;
        let codes = entry.codes.upgrade()?;
        let inverse_scale = entry.inverse_scale.upgrade()?;
        Some((codes, inverse_scale, entry.scale_shape.clone()))
    });
    if let Some((codes, inverse_scale, scale_shape)) = hit {
        let scale_layout = Layout::contiguous(&scale_shape);
        return Ok((
            Tensor::from_parts(codes, Layout::contiguous(&shape), DType::F8E4M3, true),
            Tensor::from_parts(inverse_scale, scale_layout, DType::F32, true),
        ));
    }
    let flat = input.detach().reshape(&shape)?;
    let res = quantize(
        &flat,
        None,
        DType::F8E4M3,
        recipe.granularity,
        recipe.power_of_two_scales,
    )?;
    let entry = QuantizedInput {
        input: Arc::downgrade(&input.inner),
        version: input.version(),
        recipe,
        codes: Arc::downgrade(res.codes.buffer()),
        inverse_scale: Arc::downgrade(res.inverse_scale.buffer()),
        scale_shape: res.scale.shape().to_vec(),
    };
    // The entry replaced holds only weak references: dropping it frees no tensor.
    LAST_INPUT.with(|last| last.replace(Some(entry)));
    Ok((res.codes, res.inverse_scale))
}
