//! The raw-buffer layer: optimizer updates over host slices, usable without autograd-core.
//!
//! Each algorithm comes in the forms the tensor layer chooses among:
//! - `*_single`: PyTorch's single-tensor path, op by op, each op one pass over the tensor, with
//!   the temporaries of one parameter in a caller-provided `scratch` slice;
//! - `*_foreach`: the same ops applied across a list of tensors in chunks whose temporaries fit
//!   one `scratch` slice (its length is the chunk size);
//! - `*_fused`: one pass per element, every intermediate in registers, no temporaries; it takes
//!   a [`GradScaling`] (in-kernel unscale and skip) so a GradScaler needs no host sync.
//!
//! All forms apply PyTorch's float32 operations in PyTorch's order (hyperparameter arithmetic in
//! f64, as Python does, then rounded to f32 where the tensor op receives it), so they agree with
//! each other to the bit and with PyTorch to float32 rounding.
//!
//! SGD and Adam also take bf16 and f16 parameters ([`ParamElement`]), as PyTorch's do: gradients,
//! states and temporaries are of the parameter's type, arithmetic is float32 (PyTorch's
//! "opmath"), and each stored value is rounded to nearest-even once. The fused forms round at the
//! end of the element's update, as PyTorch's fused kernels do (SGD stores the momentum buffer
//! before the update reads it back); the single and foreach forms round each op's result, as
//! PyTorch's op-by-op paths do. For f32 every rounding is the identity, so f32 results are those
//! of the f32-only kernels. 8-bit and 4-bit Adam take f32 and bf16 parameters (gradients of
//! the parameter's type, states quantised or f32) and store a bf16 parameter to nearest or
//! stochastically ([`ParamRounding`]), with no f32 master copy; Adafactor takes f32 only. Every kernel updates one
//! parameter (or one list), so the per-parameter step of optimizer-in-backward is a plain call.
//! The CUDA side (`crate::cuda`, feature `cuda`) runs the same operations in the same order on
//! device memory.

mod adafactor;
mod adam;
mod adam4bit;
mod adam8bit;
mod quantization;
mod sgd;
mod stochastic;

pub use adafactor::{
    adafactor_fused, adafactor_scratch_len, adafactor_single, AdafactorBuffers, AdafactorConfig,
};
pub use adam::{
    adam_foreach, adam_fused, adam_fused_stochastic, adam_scratch_len, adam_single, AdamBuffers,
    AdamConfig, AdamStochasticBuffers, WeightDecay,
};
pub use adam4bit::{
    adam4bit_blockwise, adam4bit_f32_states, code_4bit, code_thresholds, dequantize_4bit,
    is_quantized_4bit, qmap4, quantize_4bit, threshold_code, Adam4bitBuffers, Adam4bitConfig,
    Qmap4, AO_BLOCK_SIZE, MIN_4BIT_SIZE,
};
pub use adam8bit::{
    adam8bit_blockwise, adam_bnb_32bit, n_blocks, Adam8bitBuffers, Adam8bitConfig,
    BlockwiseBuffers, F32States, BNB_BLOCK_SIZE, MIN_8BIT_SIZE,
};
pub use quantization::{
    code_bin, code_key, dequantize_blockwise, dynamic_map, quantize_blockwise, quantize_code,
    quantize_state_code, QuantizationMap, StateCodeTable, CODE_BINS_PER_SIGN, MAP_LEN,
};
pub use sgd::{sgd_foreach, sgd_fused, sgd_single, SgdBuffers, SgdConfig};
pub use stochastic::{
    round_bf16_stochastic, stochastic_bits, stochastic_bits_of, stochastic_group, stochastic_key,
    Bf16Rounding, ParamRounding,
};

pub use half::{bf16, f16};

#[cfg(feature = "cuda")]
pub(crate) use adafactor::{factors, StepConsts as AdafactorConsts};
#[cfg(feature = "cuda")]
pub(crate) use adam::{foreach_chunks, StepConsts};
#[cfg(feature = "cuda")]
pub(crate) use adam4bit::{qmap4_tables, StepConsts as Adam4bitConsts};
#[cfg(feature = "cuda")]
pub(crate) use adam8bit::StepConsts as Adam8bitConsts;
#[cfg(feature = "cuda")]
pub(crate) use sgd::StepConsts as SgdConsts;

use headroom_autograd_core::DType;

use crate::error::OptimError;

/// An element type of SGD and Adam parameters: `f32`, [`bf16`] or [`f16`](struct@f16). Values are widened to
/// f32 exactly for arithmetic and stored back rounded to nearest-even (NaN as one canonical quiet
/// NaN, the bits the CUDA kernels store), so the host and the GPU agree to the bit.
pub trait ParamElement: Copy + Send + Sync + std::fmt::Debug + 'static + sealed::Sealed {
    /// The tensor dtype of this element type.
    const DTYPE: DType;
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
    /// `value` rounded to this type, to nearest-even.
    fn from_f32(value: f32) -> Self;
    /// `value` rounded to this type with 16 uniform random bits: bf16 stochastically
    /// ([`round_bf16_stochastic`]); f32 exactly and f16 to nearest-even, ignoring them.
    fn from_f32_stochastic(value: f32, random: u32) -> Self;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

impl ParamElement for f32 {
    const DTYPE: DType = DType::F32;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn from_f32(value: f32) -> f32 {
        value
    }

    #[inline(always)]
    fn from_f32_stochastic(value: f32, _random: u32) -> f32 {
        value
    }
}

impl ParamElement for bf16 {
    const DTYPE: DType = DType::BF16;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }

    #[inline(always)]
    fn from_f32(value: f32) -> bf16 {
        if value.is_nan() {
            bf16::from_bits(0x7fc0)
        } else {
            bf16::from_f32(value)
        }
    }

    #[inline(always)]
    fn from_f32_stochastic(value: f32, random: u32) -> bf16 {
        round_bf16_stochastic(value, random)
    }
}

impl ParamElement for f16 {
    const DTYPE: DType = DType::F16;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[inline(always)]
    fn from_f32(value: f32) -> f16 {
        if value.is_nan() {
            f16::from_bits(0x7e00)
        } else {
            f16::from_f32(value)
        }
    }

    #[inline(always)]
    fn from_f32_stochastic(value: f32, _random: u32) -> f16 {
        <f16 as ParamElement>::from_f32(value)
    }
}

/// Gradient unscaling and overflow skipping inside a fused or 8-bit kernel, as PyTorch's
/// `_fused_adam_(..., grad_scale, found_inf)` does.
///
/// With `grad_scale` set, each gradient element is divided by it before use (the gradient
/// buffer itself is left as it was). With `found_inf` non-zero, the kernel returns
/// [`StepOutcome::Skipped`] without touching parameter or state, and the caller does not count
/// the step. Both are values here; the CUDA kernels will read them from device memory.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GradScaling {
    /// The loss scale the gradients carry.
    pub grad_scale: Option<f32>,
    /// Non-zero when some gradient overflowed this step.
    pub found_inf: Option<f32>,
}

impl GradScaling {
    /// No scaling and no skipping.
    pub const NONE: GradScaling = GradScaling {
        grad_scale: None,
        found_inf: None,
    };

    /// Whether the kernel must skip the step.
    pub fn skips(&self) -> bool {
        self.found_inf.is_some_and(|flag| flag != 0.0)
    }

    /// A gradient element as the update takes it: divided by the loss scale when there is one.
    #[inline(always)]
    pub(crate) fn unscale(&self, g: f32) -> f32 {
        match self.grad_scale {
            Some(scale) => g / scale,
            None => g,
        }
    }
}

/// What a kernel that can skip did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// Parameter and state were updated; the step counts.
    Stepped,
    /// `found_inf` was set; nothing was written.
    Skipped,
}

/// Elements per rayon task in the fused kernels; below this a kernel runs on the calling thread.
pub(crate) const PARALLEL_CHUNK: usize = 1 << 15;

pub(crate) fn check_len(
    op: &'static str,
    expected: usize,
    got: usize,
    what: &str,
) -> Result<(), OptimError> {
    if expected != got {
        return Err(OptimError::LengthMismatch {
            op,
            expected,
            got,
            detail: what.to_string(),
        });
    }
    Ok(())
}

/// Runs `body` compiled for AVX2 and FMA when the CPU has them, else as built. The bits are the
/// same either way — `f32::mul_add` rounds once whether the instruction or the C library's
/// `fmaf` computes it, and every other operation is IEEE — but without the `fma` feature each
/// `mul_add` is a library call, which made the fused Adam step compute-bound at about 7 ns an
/// element on one core. Kernels wrap their per-range loops in it (the closure is inlined into
/// the feature-enabled function).
#[inline(always)]
pub(crate) fn with_fast_fma<R>(body: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        fn fast<R>(body: impl FnOnce() -> R) -> R {
            body()
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has both features the function is compiled for (checked just above).
            return unsafe { fast(body) };
        }
    }
    body()
}

/// PyTorch's `lerp(self, end, weight)` in float32 (`torch.lerp_`, scalar path).
#[inline(always)]
pub(crate) fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    if weight.abs() < 0.5 {
        weight.mul_add(end - start, start)
    } else {
        (weight - 1.0).mul_add(end - start, end)
    }
}

/// Checks a step number: steps count from 1 (step 0's bias correction `1 - beta^0` is 0, and
/// every parameter would become NaN).
pub(crate) fn check_step(op: &'static str, step: u64) -> Result<(), OptimError> {
    if step == 0 {
        return Err(OptimError::InvalidArgument {
            op,
            reason: "steps count from 1, got step 0".into(),
        });
    }
    Ok(())
}

/// Checks a host-valued gradient scale: a positive normal f32 (0 would turn every parameter
/// into NaN, a subnormal scale's inverse overflows, a negative one would flip the update).
pub(crate) fn check_host_scaling(op: &'static str, scaling: GradScaling) -> Result<(), OptimError> {
    match scaling.grad_scale {
        Some(scale) if !(scale > 0.0 && scale.is_normal()) => Err(OptimError::InvalidArgument {
            op,
            reason: format!("a gradient scale must be a positive normal f32, got {scale:e}"),
        }),
        _ => Ok(()),
    }
}

/// Checks Adam's hyperparameter ranges as PyTorch, bitsandbytes and torchao check them: `lr`,
/// `eps` and `weight_decay` at least 0 (NaN is not), each beta in `[0, 1)`; `op` names the config.
pub(crate) fn check_adam_ranges(
    op: &'static str,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
) -> Result<(), OptimError> {
    let reason = if !non_negative(lr) {
        format!("invalid learning rate {lr}")
    } else if !non_negative(eps) {
        format!("invalid epsilon {eps}")
    } else if !(0.0..1.0).contains(&betas.0) || !(0.0..1.0).contains(&betas.1) {
        format!("invalid betas {betas:?}")
    } else if !non_negative(weight_decay) {
        format!("invalid weight_decay {weight_decay}")
    } else {
        return Ok(());
    };
    Err(OptimError::InvalidArgument { op, reason })
}

/// `x >= 0`, false for NaN.
#[inline]
pub(crate) fn non_negative(x: f64) -> bool {
    x >= 0.0
}

/// `torch.maximum`: NaN propagates from either side.
#[inline(always)]
pub(crate) fn maximum(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}
