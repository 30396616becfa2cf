//! [`AdamW8bit`]: bitsandbytes' 8-bit blockwise AdamW (`bnb.optim.AdamW8bit`) over candle
//! `Var`s of f32, or of bf16 with no master copy (the update in f32, the new weight stored by the
//! config's [`Bf16Rounding`](headroom_optim::kernels::Bf16Rounding): to nearest or
//! stochastically). States in host memory: u8 codes and one f32 scale per block of 256 for a
//! parameter of at least 4096 elements, f32 moments for smaller ones, as bitsandbytes keeps them.
//!
//! It sits on `host_slices.rs` (slots, the in-place step) and optim's kernels (`adam8bit_blockwise`, `adam_bnb_32bit`); it
//! knows nothing of Adam's 32-bit rule.

use crate::error::CandleOptimError;
use crate::host_slices::{
    float_vars, host_tensor, step_slots, typed_state, HostFloat, ParamUpdate, RuleState, Slot,
};
use crate::state_dict::{saved_vec, state_methods};
use std::any::Any;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use headroom_optim::bnb_maps;
use headroom_optim::kernels::{
    adam8bit_blockwise, adam_bnb_32bit, n_blocks, Adam8bitConfig, BlockwiseBuffers, F32States,
    GradScaling, ParamRounding, MIN_8BIT_SIZE,
};

/// One parameter's state, allocated at its first step.
#[derive(Debug)]
enum State8 {
    /// Codes of both moments and their per-block scales.
    Quantized {
        state1: Vec<u8>,
        state2: Vec<u8>,
        absmax1: Vec<f32>,
        absmax2: Vec<f32>,
    },
    /// f32 moments of a parameter under `MIN_8BIT_SIZE` elements.
    Full { state1: Vec<f32>, state2: Vec<f32> },
}

impl RuleState for State8 {
    fn tensors(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        Ok(match self {
            State8::Quantized {
                state1,
                state2,
                absmax1,
                absmax2,
            } => vec![
                ("state1", host_tensor(state1)?),
                ("state2", host_tensor(state2)?),
                ("absmax1", host_tensor(absmax1)?),
                ("absmax2", host_tensor(absmax2)?),
            ],
            State8::Full { state1, state2 } => vec![
                ("state1", host_tensor(state1)?),
                ("state2", host_tensor(state2)?),
            ],
        })
    }

    fn bytes(&self) -> u64 {
        let bytes = match self {
            State8::Quantized {
                state1,
                state2,
                absmax1,
                absmax2,
            } => state1.len() + state2.len() + 4 * (absmax1.len() + absmax2.len()),
            State8::Full { state1, state2 } => 4 * (state1.len() + state2.len()),
        };
        bytes as u64
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl State8 {
    /// The state saved for a `Var` of `n` elements: codes and scales from `MIN_8BIT_SIZE`, f32
    /// moments under it.
    fn restore(
        get: &dyn Fn(&str) -> candle_core::Result<Tensor>,
        n: usize,
    ) -> candle_core::Result<Box<dyn RuleState>> {
        let name = Update8bit::NAME;
        Ok(Box::new(if n >= MIN_8BIT_SIZE {
            State8::Quantized {
                state1: saved_vec::<u8>(name, get, "state1", n)?,
                state2: saved_vec::<u8>(name, get, "state2", n)?,
                absmax1: saved_vec::<f32>(name, get, "absmax1", n_blocks(n))?,
                absmax2: saved_vec::<f32>(name, get, "absmax2", n_blocks(n))?,
            }
        } else {
            State8::Full {
                state1: saved_vec::<f32>(name, get, "state1", n)?,
                state2: saved_vec::<f32>(name, get, "state2", n)?,
            }
        }))
    }
}

/// bitsandbytes' 8-bit blockwise AdamW over candle `Var`s (configuration: optim's
/// [`Adam8bitConfig`]; AdamW is [`Adam8bitConfig::adamw`]); f32 `Var`s, or bf16 ones without a
/// master copy. A `Var` without a gradient is left alone and its step count does not advance.
/// State dict (bitsandbytes' names): `{index}.step`, `{index}.state1`, `{index}.state2` and, for
/// 8-bit states, `{index}.absmax1`, `{index}.absmax2`.
#[derive(Debug)]
pub struct AdamW8bit {
    slots: Vec<Slot>,
    config: Adam8bitConfig,
}

state_methods!(AdamW8bit, Update8bit::NAME, restore_8bit);

/// A `Var`'s saved 8-bit state (`state1`, `state2` and, for codes, `absmax1`, `absmax2`).
fn restore_8bit(
    _config: &Adam8bitConfig,
    var: &Var,
    get: &dyn Fn(&str) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Box<dyn RuleState>> {
    State8::restore(get, var.elem_count())
}

impl candle_nn::Optimizer for AdamW8bit {
    type Config = Adam8bitConfig;

    fn new(vars: Vec<Var>, config: Adam8bitConfig) -> candle_core::Result<AdamW8bit> {
        config.validate().map_err(CandleOptimError::from)?;
        let dtypes = [DType::F32, DType::BF16];
        let slots = Slot::for_vars(float_vars(Update8bit::NAME, vars, &dtypes)?);
        Ok(AdamW8bit { slots, config })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        let config = &self.config;
        step_slots(&mut self.slots, grads, |slot| Update8bit {
            config,
            step: slot.step,
            rounding: ParamRounding::of(config.bf16_rounding, slot.index, slot.step),
        })
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

/// One parameter's 8-bit step number `step`, storing a bf16 parameter by `rounding`.
struct Update8bit<'a> {
    config: &'a Adam8bitConfig,
    step: u64,
    rounding: ParamRounding,
}

impl ParamUpdate for Update8bit<'_> {
    const NAME: &'static str = "headroom_candle::AdamW8bit";

    fn update<T: HostFloat>(
        &self,
        param: &mut [T],
        grad: &[T],
        state: &mut Option<Box<dyn RuleState>>,
    ) -> candle_core::Result<()> {
        let n = param.len();
        let state = typed_state(Self::NAME, state, || {
            if n >= MIN_8BIT_SIZE {
                State8::Quantized {
                    state1: vec![0; n],
                    state2: vec![0; n],
                    absmax1: vec![0.0; n_blocks(n)],
                    absmax2: vec![0.0; n_blocks(n)],
                }
            } else {
                State8::Full {
                    state1: vec![0.0; n],
                    state2: vec![0.0; n],
                }
            }
        })?;
        let (config, step, scaling, rounding) =
            (self.config, self.step, GradScaling::NONE, self.rounding);
        let outcome = match state {
            State8::Quantized {
                state1,
                state2,
                absmax1,
                absmax2,
            } => {
                let (qmap1, qmap2) = bnb_maps();
                let bufs = BlockwiseBuffers {
                    param,
                    grad,
                    state1,
                    state2,
                    absmax1,
                    absmax2,
                };
                adam8bit_blockwise(config, step, qmap1, qmap2, bufs, scaling, rounding)
            }
            State8::Full { state1, state2 } => {
                let bufs = F32States {
                    param,
                    grad,
                    state1,
                    state2,
                };
                adam_bnb_32bit(config, step, bufs, scaling, rounding)
            }
        };
        outcome.map_err(CandleOptimError::from)?;
        Ok(())
    }
}
