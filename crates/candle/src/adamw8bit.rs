//! [`AdamW8bit`]: bitsandbytes' 8-bit blockwise AdamW (`bnb.optim.AdamW8bit`) over candle
//! `Var`s of f32, or of bf16 with no master copy (the update in f32, the new weight stored by the
//! config's [`Bf16Rounding`](headroom_optim::kernels::Bf16Rounding): to nearest or
//! stochastically). States in host memory: u8 codes and one f32 scale per block of 256 for a
//! parameter of at least 4096 elements, f32 moments for smaller ones, as bitsandbytes keeps them.
//!
//! It sits on `rule.rs` (the optimizer a rule makes) and optim's kernels (`adam8bit_blockwise`, `adam_bnb_32bit`); it
//! knows nothing of Adam's 32-bit rule.

use crate::error::CandleOptimError;
use crate::host_slices::{host_tensor, typed_state, HostFloat, RuleState};
use crate::rule::{candle_optimizer, CandleRule, Getter, Slices, StepAt};
use crate::state_dict::saved_vec;
use std::any::Any;

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
    /// Zero state for a parameter of `n` elements: codes from `MIN_8BIT_SIZE`, f32 moments
    /// under it.
    fn zeros(n: usize) -> State8 {
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
    }

    /// The state saved for a `Var` of `n` elements: codes and scales from `MIN_8BIT_SIZE`, f32
    /// moments under it.
    fn restore(
        get: &dyn Fn(&str) -> candle_core::Result<Tensor>,
        n: usize,
    ) -> candle_core::Result<Box<dyn RuleState>> {
        let name = Adam8bitConfig::NAME;
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

candle_optimizer! {
    /// bitsandbytes' 8-bit blockwise AdamW over candle `Var`s (configuration: optim's
    /// [`Adam8bitConfig`]; AdamW is [`Adam8bitConfig::adamw`]); f32 `Var`s, or bf16 ones without
    /// a master copy. A `Var` without a gradient is left alone and its step count does not
    /// advance. State dict (bitsandbytes' names): `{index}.step`, `{index}.state1`,
    /// `{index}.state2` and, for 8-bit states, `{index}.absmax1`, `{index}.absmax2`.
    AdamW8bit(Adam8bitConfig),
    lr: lr,
    check: validate,
}

impl CandleRule for Adam8bitConfig {
    const NAME: &'static str = "headroom_candle::AdamW8bit";
    const DTYPES: &'static [DType] = &[DType::F32, DType::BF16];

    /// One parameter's 8-bit step, storing a bf16 parameter by the configuration's rounding.
    fn update<T: HostFloat>(&self, at: StepAt, slices: Slices<'_, T>) -> candle_core::Result<()> {
        let Slices { param, grad, state } = slices;
        let n = param.len();
        let state = typed_state(Self::NAME, state, || State8::zeros(n))?;
        let rounding = ParamRounding::of(self.bf16_rounding, at.index, at.step);
        let (step, scaling) = (at.step, GradScaling::NONE);
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
                adam8bit_blockwise(self, step, qmap1, qmap2, bufs, scaling, rounding)
            }
            State8::Full { state1, state2 } => {
                let bufs = F32States {
                    param,
                    grad,
                    state1,
                    state2,
                };
                adam_bnb_32bit(self, step, bufs, scaling, rounding)
            }
        };
        outcome.map_err(CandleOptimError::from)?;
        Ok(())
    }

    /// The `Var`'s saved 8-bit state (`state1`, `state2` and, for codes, `absmax1`,
    /// `absmax2`).
    fn restore(&self, var: &Var, get: &Getter<'_>) -> candle_core::Result<Box<dyn RuleState>> {
        State8::restore(get, var.elem_count())
    }
}
