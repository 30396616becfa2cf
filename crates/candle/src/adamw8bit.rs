//! [`AdamW8bit`]: bitsandbytes' 8-bit blockwise AdamW (`bnb.optim.AdamW8bit`) over candle
//! `Var`s of f32, or of bf16 with no master copy (the update in f32, the new weight stored by the
//! config's [`Bf16Rounding`](headroom_optim::kernels::Bf16Rounding): to nearest or
//! stochastically). States in host memory: u8 codes and one f32 scale per block of 256 for a
//! parameter of at least 4096 elements, f32 moments for smaller ones, as bitsandbytes keeps them.
//!
//! It sits on `host_slices.rs` and optim's kernels (`adam8bit_blockwise`, `adam_bnb_32bit`); it
//! knows nothing of Adam's 32-bit rule.

use crate::error::CandleOptimError;
use crate::host_slices::{float_vars, param_and_grad, typed_state, HostFloat, Slot, StateLock};
use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Var};
use half::bf16;
use headroom_optim::bnb_maps;
use headroom_optim::kernels::{
    adam8bit_blockwise, adam_bnb_32bit, n_blocks, Adam8bitConfig, BlockwiseBuffers, F32States,
    GradScaling, ParamRounding, MIN_8BIT_SIZE,
};

const NAME: &str = "headroom_candle::AdamW8bit";

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

/// bitsandbytes' 8-bit blockwise AdamW over candle `Var`s (configuration: optim's
/// [`Adam8bitConfig`]; AdamW is [`Adam8bitConfig::adamw`]); f32 `Var`s, or bf16 ones without a
/// master copy. A `Var` without a gradient is left alone and its step count does not advance.
#[derive(Debug)]
pub struct AdamW8bit {
    slots: Vec<Slot>,
    config: Adam8bitConfig,
}

impl AdamW8bit {
    /// The bytes of state the optimizer holds (states allocated so far).
    pub fn state_bytes(&self) -> u64 {
        let bytes = |s: &State8| -> usize {
            match s {
                State8::Quantized {
                    state1,
                    state2,
                    absmax1,
                    absmax2,
                } => state1.len() + state2.len() + 4 * (absmax1.len() + absmax2.len()),
                State8::Full { state1, state2 } => 4 * (state1.len() + state2.len()),
            }
        };
        self.slots
            .iter()
            .map(|slot| {
                let state = slot.state.lock();
                let state = state.as_deref().and_then(|s| s.downcast_ref::<State8>());
                state.map_or(0, |s| bytes(s) as u64)
            })
            .sum()
    }
}

impl candle_nn::Optimizer for AdamW8bit {
    type Config = Adam8bitConfig;

    fn new(vars: Vec<Var>, config: Adam8bitConfig) -> candle_core::Result<AdamW8bit> {
        config.validate().map_err(CandleOptimError::from)?;
        let slots = Slot::for_vars(float_vars(NAME, vars, &[DType::F32, DType::BF16])?);
        Ok(AdamW8bit { slots, config })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        for slot in &mut self.slots {
            let Some(grad) = grads.get(slot.var.as_tensor()) else {
                continue;
            };
            slot.step += 1;
            let op = Step8 {
                config: &self.config,
                step: slot.step,
                rounding: ParamRounding::of(self.config.bf16_rounding, slot.index, slot.step),
                state: &slot.state,
            };
            slot.var.as_tensor().inplace_op2(grad, &op)?;
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

/// One parameter's 8-bit step, as candle's in-place op on the parameter with its gradient.
struct Step8<'a> {
    config: &'a Adam8bitConfig,
    step: u64,
    rounding: ParamRounding,
    state: &'a StateLock,
}

impl Step8<'_> {
    fn run<T: HostFloat>(
        &self,
        param: (&mut CpuStorage, &Layout),
        grad: (&CpuStorage, &Layout),
    ) -> candle_core::Result<()> {
        let (param, grad) = param_and_grad::<T>(NAME, param, grad)?;
        let n = param.len();
        let mut state = self.state.lock();
        let state = typed_state(NAME, &mut state, || {
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

impl InplaceOp2 for Step8<'_> {
    fn name(&self) -> &'static str {
        "headroom-adamw8bit"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        grad: &CpuStorage,
        grad_l: &Layout,
    ) -> candle_core::Result<()> {
        let grad = (grad, grad_l);
        match dst.dtype() {
            DType::F32 => self.run::<f32>((dst, dst_l), grad),
            DType::BF16 => self.run::<bf16>((dst, dst_l), grad),
            other => Err(CandleOptimError::Unsupported {
                optimizer: NAME,
                reason: format!("a {other:?} parameter"),
            }
            .into()),
        }
    }
}
