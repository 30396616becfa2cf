//! What makes a configuration of optim's into a CUDA optimizer of this crate: [`CudaRule`] (the
//! name, the dtypes it steps, the state buffers a `Var` needs, one launch over many parameters
//! through optim's raw-buffer layer), implemented for the four configurations.
//!
//! Every launch is optim's raw layer (`headroom_optim::cuda`), so the bits are those of the same
//! optimizer on Headroom's own tensors and on the CPU (the kernels mirror the host's arithmetic).
//! It sits on optim's raw entry points; it knows nothing of candle.

use std::sync::Arc;

use candle_core::DType;
use headroom_autograd_core::DType as HeadroomDType;
use headroom_ops_cuda::CudaBackend;
use headroom_optim::cuda::{
    CudaAdam8bit, CudaFusedAdam, CudaSgd, DeviceAdam8bitParam, DeviceAdamParam, DeviceSgdParam,
};
use headroom_optim::kernels::{n_blocks, Adam8bitConfig, AdamConfig, SgdConfig, MIN_8BIT_SIZE};
use headroom_optim::{AdamStochasticConfig, OptimError};

/// One state buffer a `Var` needs: its name in the state dict, dtype and elements.
pub(crate) type StateSpec = (&'static str, DType, usize);

/// One parameter of a launch, by device address: the `Var` at `index` among the optimizer's,
/// its gradient, its state buffers in [`CudaRule::states`]' order, and its elements.
#[derive(Debug, Clone)]
pub(crate) struct Item {
    pub(crate) index: usize,
    pub(crate) param: u64,
    pub(crate) grad: u64,
    pub(crate) states: Vec<u64>,
    pub(crate) len: usize,
}

/// An update rule as this crate runs it on CUDA.
pub(crate) trait CudaRule {
    /// The launcher of optim's raw layer the rule keeps between steps.
    type Launcher: std::fmt::Debug;
    /// The optimizer's name, in errors.
    const NAME: &'static str;
    /// The dtypes of the `Var`s it steps on CUDA.
    const DTYPES: &'static [DType];

    /// The configuration's own check (optim's `validate`).
    fn check(&self) -> Result<(), OptimError>;
    /// The learning rate.
    fn learning_rate(&self) -> f64;
    /// Sets the learning rate.
    fn set_learning_rate(&mut self, lr: f64);
    /// The launcher, on `backend`.
    fn launcher(backend: Arc<CudaBackend>) -> Result<Self::Launcher, OptimError>;
    /// The state buffers a `Var` of `dtype` and `len` elements needs, zero at its first step.
    fn states(&self, dtype: DType, len: usize) -> Vec<StateSpec>;
    /// One step of `items`, every parameter of `dtype` at step `step` (from 1), queued on the
    /// backend's stream.
    ///
    /// # Safety
    /// Every address of `items` is a live device buffer of its `Var`, gradient or state (sizes
    /// as [`CudaRule::states`] says), not overlapping another, until the launch completes.
    unsafe fn launch(
        &self,
        launcher: &mut Self::Launcher,
        dtype: DType,
        step: u64,
        items: &[Item],
    ) -> Result<(), OptimError>;
}

/// optim's dtype of candle's.
fn headroom_dtype(dtype: DType) -> HeadroomDType {
    match dtype {
        DType::BF16 => HeadroomDType::BF16,
        DType::F16 => HeadroomDType::F16,
        _ => HeadroomDType::F32,
    }
}

/// Adam's moments of `dtype` (and the AMSGrad maximum).
fn moments(dtype: DType, len: usize, amsgrad: bool) -> Vec<StateSpec> {
    let mut states = vec![("exp_avg", dtype, len), ("exp_avg_sq", dtype, len)];
    if amsgrad {
        states.push(("max_exp_avg_sq", dtype, len));
    }
    states
}

/// The raw layer's Adam parameter of `item` (moments first, the AMSGrad maximum third).
fn adam_param(item: &Item) -> DeviceAdamParam {
    DeviceAdamParam {
        param: item.param,
        grad: item.grad,
        exp_avg: item.states[0],
        exp_avg_sq: item.states[1],
        max_exp_avg_sq: item.states.get(2).copied(),
        len: item.len,
    }
}

impl CudaRule for AdamConfig {
    type Launcher = CudaFusedAdam;
    const NAME: &'static str = "headroom_candle_cuda::AdamW";
    const DTYPES: &'static [DType] = &[DType::F32, DType::BF16, DType::F16];

    fn check(&self) -> Result<(), OptimError> {
        self.validate()
    }

    fn learning_rate(&self) -> f64 {
        self.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn launcher(backend: Arc<CudaBackend>) -> Result<CudaFusedAdam, OptimError> {
        // SAFETY: no buffer is given at creation; each step passes its own.
        unsafe { CudaFusedAdam::new(backend, &[]) }
    }

    fn states(&self, dtype: DType, len: usize) -> Vec<StateSpec> {
        moments(dtype, len, self.amsgrad)
    }

    unsafe fn launch(
        &self,
        launcher: &mut CudaFusedAdam,
        dtype: DType,
        step: u64,
        items: &[Item],
    ) -> Result<(), OptimError> {
        let params: Vec<_> = items.iter().map(adam_param).collect();
        // SAFETY: the caller's contract: live, disjoint buffers of `dtype`.
        unsafe {
            launcher.step_buffers_of(self, step, headroom_dtype(dtype), &params, (None, None))
        }
    }
}

impl CudaRule for AdamStochasticConfig {
    type Launcher = CudaFusedAdam;
    const NAME: &'static str = "headroom_candle_cuda::AdamWStochastic";
    const DTYPES: &'static [DType] = &[DType::BF16];

    fn check(&self) -> Result<(), OptimError> {
        self.adam.validate()
    }

    fn learning_rate(&self) -> f64 {
        self.adam.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.adam.lr = lr;
    }

    fn launcher(backend: Arc<CudaBackend>) -> Result<CudaFusedAdam, OptimError> {
        // SAFETY: no buffer is given at creation; each step passes its own.
        unsafe { CudaFusedAdam::new(backend, &[]) }
    }

    fn states(&self, _dtype: DType, len: usize) -> Vec<StateSpec> {
        moments(DType::F32, len, self.adam.amsgrad)
    }

    unsafe fn launch(
        &self,
        launcher: &mut CudaFusedAdam,
        _dtype: DType,
        step: u64,
        items: &[Item],
    ) -> Result<(), OptimError> {
        let params: Vec<_> = items.iter().map(adam_param).collect();
        let slots: Vec<usize> = items.iter().map(|item| item.index).collect();
        // SAFETY: the caller's contract: live, disjoint bf16 parameters and gradients, f32
        // moments.
        unsafe {
            launcher.step_buffers_stochastic(
                self,
                step,
                &params,
                &slots,
                HeadroomDType::F32,
                (None, None),
            )
        }
    }
}

impl CudaRule for Adam8bitConfig {
    type Launcher = CudaAdam8bit;
    const NAME: &'static str = "headroom_candle_cuda::AdamW8bit";
    const DTYPES: &'static [DType] = &[DType::F32];

    fn check(&self) -> Result<(), OptimError> {
        self.validate()
    }

    fn learning_rate(&self) -> f64 {
        self.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn launcher(backend: Arc<CudaBackend>) -> Result<CudaAdam8bit, OptimError> {
        // SAFETY: no buffer is given at creation; each step passes its own.
        unsafe { CudaAdam8bit::new(backend, &[]) }
    }

    /// bitsandbytes' layout: u8 codes and an f32 scale per block of 256 from
    /// `MIN_8BIT_SIZE` elements, f32 moments under it.
    fn states(&self, _dtype: DType, len: usize) -> Vec<StateSpec> {
        if len >= MIN_8BIT_SIZE {
            vec![
                ("state1", DType::U8, len),
                ("state2", DType::U8, len),
                ("absmax1", DType::F32, n_blocks(len)),
                ("absmax2", DType::F32, n_blocks(len)),
            ]
        } else {
            vec![("state1", DType::F32, len), ("state2", DType::F32, len)]
        }
    }

    unsafe fn launch(
        &self,
        launcher: &mut CudaAdam8bit,
        _dtype: DType,
        step: u64,
        items: &[Item],
    ) -> Result<(), OptimError> {
        let params: Vec<_> = items
            .iter()
            .map(|item| DeviceAdam8bitParam {
                param: item.param,
                grad: item.grad,
                state1: item.states[0],
                state2: item.states[1],
                absmax1: item.states.get(2).copied().unwrap_or(0),
                absmax2: item.states.get(3).copied().unwrap_or(0),
                len: item.len,
            })
            .collect();
        // SAFETY: the caller's contract: live, disjoint f32 parameters and gradients with
        // bitsandbytes' state layout.
        unsafe { launcher.step_buffers(self, step, &params, (None, None)) }
    }
}

impl CudaRule for SgdConfig {
    type Launcher = CudaSgd;
    const NAME: &'static str = "headroom_candle_cuda::Sgd";
    const DTYPES: &'static [DType] = &[DType::F32, DType::BF16, DType::F16];

    fn check(&self) -> Result<(), OptimError> {
        self.validate()
    }

    fn learning_rate(&self) -> f64 {
        self.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn launcher(backend: Arc<CudaBackend>) -> Result<CudaSgd, OptimError> {
        Ok(CudaSgd::new(backend))
    }

    fn states(&self, dtype: DType, len: usize) -> Vec<StateSpec> {
        if self.has_momentum() {
            vec![("momentum_buffer", dtype, len)]
        } else {
            Vec::new()
        }
    }

    unsafe fn launch(
        &self,
        launcher: &mut CudaSgd,
        dtype: DType,
        step: u64,
        items: &[Item],
    ) -> Result<(), OptimError> {
        let params: Vec<_> = items
            .iter()
            .map(|item| DeviceSgdParam {
                param: item.param,
                grad: item.grad,
                momentum_buffer: item.states.first().copied(),
                len: item.len,
            })
            .collect();
        // SAFETY: the caller's contract: live, disjoint buffers of `dtype`.
        unsafe { launcher.step_buffers(self, headroom_dtype(dtype), step, &params, (None, None)) }
    }
}
