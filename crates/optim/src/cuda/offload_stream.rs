//! The device-stepping side of [`OffloadedAdam`](crate::OffloadedAdam)
//! ([`OffloadStepper::Device`](crate::OffloadStepper::Device)): each parameter's moments live in
//! pinned host memory and stream through the GPU, which steps them with the on-device fused
//! kernels (`Adam`'s for f32, `AdamStochastic`'s for bf16), so the result is the on-device
//! optimizer's bit for bit and the host does no arithmetic.
//!
//! A parameter's moments (`exp_avg`, `exp_avg_sq` and, with AMSGrad, `max_exp_avg_sq`, f32) come
//! in and go back through `state_stream.rs` (prefetched in the last step's bucket order, as far
//! ahead as [`OffloadConfig::stream_bytes`] allows); a parameter's first step starts from zeros
//! on the device.
//!
//! It sits on `state_stream.rs` and on the CUDA entries of `Adam` and `AdamStochastic`; it knows
//! no model and no hook.
//!
//! [`OffloadConfig::stream_bytes`]: crate::OffloadConfig::stream_bytes

use std::borrow::Cow;

use headroom_autograd_core::{DType, Tensor};

use super::state_stream::{NamedState, StateStream};
use crate::adam::AdamState;
use crate::adam_stochastic::AdamStochasticConfig;
use crate::cuda::launch::CudaDevice;
use crate::error::OptimError;
use crate::kernels::AdamConfig;
use crate::offload_state::NAME;
use crate::rule::CudaKernels;
use crate::step::{Implementation, RuleCall, Scaling, StepItem};

/// A parameter's step count and moments (`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`), as a
/// state dict holds them.
pub(crate) type StreamedState = (u64, Vec<Vec<f32>>);

/// The moments' names, in the order they stream.
const MOMENT_NAMES: [&str; 3] = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"];

/// The parameters, their steps and the stream of their moments.
pub(crate) struct StreamedOffload {
    device: CudaDevice,
    params: Vec<Tensor>,
    steps: Vec<u64>,
    amsgrad: bool,
    stream: StateStream,
}

impl StreamedOffload {
    /// The offload of `params` (contiguous, of one `CudaBackend`), holding at most `budget`
    /// bytes of moments coming in and as many going back, beyond the bucket being stepped.
    pub(crate) fn new(
        params: &[Tensor],
        amsgrad: bool,
        budget: u64,
    ) -> Result<StreamedOffload, OptimError> {
        let device = CudaDevice::of(NAME, &params[0], params.len())?;
        let stream = StateStream::new(NAME, &params[0], params.len(), budget)?;
        Ok(StreamedOffload {
            device,
            params: params.to_vec(),
            steps: vec![0; params.len()],
            amsgrad,
            stream,
        })
    }

    fn moment_names(&self) -> &'static [&'static str] {
        &MOMENT_NAMES[..if self.amsgrad { 3 } else { 2 }]
    }

    /// Steps `grads` (slot index and gradient, ascending slots) on the compute stream: their
    /// moments come in (prefetched, or fetched now; zeros at a first step), the fused kernel
    /// updates parameters and moments in place, and the moments go back to the host. Returns
    /// without waiting.
    pub(crate) fn submit(
        &mut self,
        grads: Vec<(usize, Tensor)>,
        adam: &AdamConfig,
        seed: u64,
    ) -> Result<(), OptimError> {
        if grads.is_empty() {
            return self.stream.end_bucket(Vec::new());
        }
        let mut moments = Vec::with_capacity(grads.len());
        for (index, _) in &grads {
            let arrived = match self.stream.arrive(*index)? {
                Some(arrived) => arrived,
                None => {
                    // The pinned block first: a budget too small for it fails the step before
                    // anything moves.
                    let zeros = self.zero_moments(*index)?;
                    self.stream.reserve(*index, &zeros)?;
                    zeros
                }
            };
            moments.push(arrived);
        }
        for (index, _) in &grads {
            self.steps[*index] += 1;
        }
        let mut states = moments.iter().map(adam_state).collect::<Vec<AdamState>>();
        for dtype in [DType::F32, DType::BF16] {
            let mut items: Vec<StepItem<'_, AdamState>> = grads
                .iter()
                .zip(states.iter_mut())
                .filter(|((index, _), _)| self.params[*index].dtype() == dtype)
                .map(|((index, grad), state)| StepItem {
                    step: self.steps[*index],
                    slot: *index,
                    param: &self.params[*index],
                    grad: grad.clone(),
                    state,
                })
                .collect();
            if items.is_empty() {
                continue;
            }
            let call = RuleCall {
                implementation: Implementation::Fused,
                items: &mut items,
                scaling: Scaling::None,
            };
            match dtype {
                DType::BF16 => AdamStochasticConfig::new(adam.clone(), seed)
                    .cuda_step(&mut self.device, call)?,
                _ => adam.cuda_step(&mut self.device, call)?,
            }
        }
        drop(states);
        for ((index, _), arrived) in grads.iter().zip(moments) {
            self.stream.depart(*index, arrived)?;
        }
        self.stream
            .end_bucket(grads.iter().map(|(index, _)| *index).collect())
    }

    /// Ends a step: the next step's first buckets start coming in.
    pub(crate) fn finish(&mut self) -> Result<(), OptimError> {
        self.stream.finish()
    }

    /// Waits for every copy under way (the host state is then the truth, for a state dict or a
    /// load).
    pub(crate) fn settle(&mut self) -> Result<(), OptimError> {
        self.stream.settle()
    }

    /// Bytes of pinned host memory the moments hold.
    pub(crate) fn state_bytes(&self) -> u64 {
        self.stream.host_bytes()
    }

    /// How many steps parameter `index` has taken.
    pub(crate) fn step(&self, index: usize) -> u64 {
        self.steps[index]
    }

    /// Parameter `index`'s step count and moments by their state-dict names (after
    /// [`StreamedOffload::settle`]), once it has stepped.
    pub(crate) fn saved(&self, index: usize) -> Result<Option<StreamedState>, OptimError> {
        let Some(pieces) = self.stream.host_state(index)? else {
            return Ok(None);
        };
        let moments = pieces
            .into_iter()
            .map(|(_, _, _, bytes)| {
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect()
            })
            .collect();
        Ok(Some((self.steps[index], moments)))
    }

    /// Replaces parameter `index`'s state (after [`StreamedOffload::settle`]): `moments` in the
    /// state-dict order, or `None` for none.
    pub(crate) fn restore(
        &mut self,
        index: usize,
        saved: Option<StreamedState>,
    ) -> Result<(), OptimError> {
        let Some((step, moments)) = saved else {
            self.steps[index] = 0;
            return self.stream.restore(index, None);
        };
        let n = self.params[index].numel();
        let pieces = self
            .moment_names()
            .iter()
            .zip(&moments)
            .map(|(name, values)| {
                let bytes = Cow::Borrowed(bytemuck::cast_slice::<f32, u8>(values));
                (*name, DType::F32, vec![n], bytes)
            })
            .collect();
        self.steps[index] = step;
        self.stream.restore(index, Some(pieces))
    }

    /// Zero moments for parameter `index`'s first step, on the device.
    fn zero_moments(&self, index: usize) -> Result<NamedState, OptimError> {
        let param = &self.params[index];
        self.moment_names()
            .iter()
            .map(|name| {
                let zeros = Tensor::zeros(param.backend(), &[param.numel()], DType::F32)?;
                Ok((*name, zeros))
            })
            .collect()
    }
}

/// The Adam state over a parameter's streamed moments.
fn adam_state(moments: &NamedState) -> AdamState {
    AdamState {
        exp_avg: moments[0].1.clone(),
        exp_avg_sq: moments[1].1.clone(),
        max_exp_avg_sq: moments.get(2).map(|(_, tensor)| tensor.clone()),
    }
}
