//! One parameter's side of [`OffloadedAdam`](crate::OffloadedAdam) in host memory: its moments
//! and a copy of the parameter, read from the device when needed, and the host step over a
//! staged gradient that leaves the new parameter in its place for the copy back.
//!
//! It sits on the raw host kernels (`adam_fused`, `adam_fused_stochastic`) and
//! `AdamStochasticConfig`'s key (the same random stream as the on-device rule); it knows no
//! device API and no optimizer.

use headroom_autograd_core::{DType, Tensor};
use rayon::prelude::*;

use crate::adam_stochastic::AdamStochasticConfig;
use crate::error::OptimError;
use crate::kernels::{
    adam_fused, adam_fused_stochastic, bf16, AdamBuffers, AdamConfig, AdamStochasticBuffers,
    GradScaling, ParamElement, StepOutcome, PARALLEL_CHUNK,
};

/// The optimizer's name in errors and state dicts.
pub(crate) const NAME: &str = "OffloadedAdam";

/// One parameter's host side.
pub(crate) struct HostSlot {
    /// The parameter's index among the optimizer's (its random stream's key).
    index: usize,
    /// The device parameter.
    pub(crate) param: Tensor,
    state: Option<HostState>,
    step: u64,
    /// The parameter's version counter when the host copy last matched it.
    synced_version: u64,
    /// Whether the host copy must be read again whatever the version says (a loaded state).
    host_copy_stale: bool,
    /// Whether a bf16 parameter keeps an f32 master copy on the host.
    master: bool,
}

/// A moment by its state-dict name.
pub(crate) type NamedMoment<'a> = (&'static str, &'a [f32]);

/// One parameter's state as a state dict holds it.
pub(crate) struct SavedSlot {
    pub(crate) step: u64,
    pub(crate) exp_avg: Vec<f32>,
    pub(crate) exp_avg_sq: Vec<f32>,
    pub(crate) max_exp_avg_sq: Option<Vec<f32>>,
    /// The f32 master copy of a bf16 parameter, when the optimizer keeps one.
    pub(crate) master: Option<Vec<f32>>,
}

/// The moments and the host copy of the parameter.
struct HostState {
    weights: HostWeights,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    max_exp_avg_sq: Option<Vec<f32>>,
}

/// The host copy of a parameter: in its dtype, or an f32 master copy of a bf16 parameter.
enum HostWeights {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    Master(Vec<f32>),
}

/// Elements of a master's gradient widened to f32 at a time (1 MiB of f32 scratch).
const MASTER_CHUNK: usize = 1 << 18;

impl HostSlot {
    /// The slot of parameter `index`; a bf16 one keeps an f32 master copy when `master`.
    pub(crate) fn new(index: usize, param: Tensor, master: bool) -> HostSlot {
        let master = master && param.dtype() == DType::BF16;
        HostSlot {
            index,
            param,
            state: None,
            step: 0,
            synced_version: 0,
            host_copy_stale: true,
            master,
        }
    }

    pub(crate) fn state_bytes(&self) -> u64 {
        self.state.as_ref().map_or(0, |state| {
            let moments = state.exp_avg.len()
                + state.exp_avg_sq.len()
                + state.max_exp_avg_sq.as_ref().map_or(0, Vec::len);
            let weights = match &state.weights {
                HostWeights::F32(w) | HostWeights::Master(w) => 4 * w.len(),
                HostWeights::Bf16(w) => 2 * w.len(),
            };
            (4 * moments + weights) as u64
        })
    }

    /// Whether the host copy must be (re)read from the device before the next step.
    pub(crate) fn needs_read(&self) -> bool {
        self.state.is_none() || self.host_copy_stale || self.param.version() != self.synced_version
    }

    /// Creates the state on the first step (zero moments) and reads the parameter into the host
    /// copy when [`HostSlot::needs_read`] (the device's work on it must be complete: the read
    /// goes through the tensor layer, which waits for it).
    pub(crate) fn sync_from_device(&mut self, amsgrad: bool) -> Result<(), OptimError> {
        if !self.needs_read() {
            return Ok(());
        }
        let weights = match self.param.dtype() {
            // The master starts from the parameter's values (bf16 widens exactly).
            DType::BF16 if self.master => HostWeights::Master(
                self.param
                    .to_vec::<bf16>()?
                    .iter()
                    .map(|v| v.to_f32())
                    .collect(),
            ),
            DType::BF16 => HostWeights::Bf16(self.param.to_vec::<bf16>()?),
            _ => HostWeights::F32(self.param.to_vec::<f32>()?),
        };
        let n = self.param.numel();
        match &mut self.state {
            Some(state) => state.weights = weights,
            None => {
                self.state = Some(HostState {
                    weights,
                    exp_avg: vec![0.0; n],
                    exp_avg_sq: vec![0.0; n],
                    max_exp_avg_sq: amsgrad.then(|| vec![0.0; n]),
                })
            }
        }
        self.synced_version = self.param.version();
        self.host_copy_stale = false;
        Ok(())
    }

    /// One step with the gradient in `region` (the parameter's dtype and length, little-endian
    /// bytes), then the new parameter written over it, for the copy back.
    pub(crate) fn update(
        &mut self,
        adam: &AdamConfig,
        seed: u64,
        region: &mut [u8],
    ) -> Result<(), OptimError> {
        let state = self
            .state
            .as_mut()
            .ok_or_else(|| OptimError::InvalidArgument {
                op: NAME,
                reason: "a step before the parameter's host state was read".into(),
            })?;
        self.step += 1;
        let step = self.step;
        let HostState {
            weights,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
        } = state;
        let outcome = match weights {
            HostWeights::F32(param) => {
                let grad: &[f32] = cast(region)?;
                let outcome = adam_fused(
                    adam,
                    step,
                    AdamBuffers {
                        param,
                        grad,
                        exp_avg,
                        exp_avg_sq,
                        max_exp_avg_sq: max_exp_avg_sq.as_deref_mut(),
                    },
                    GradScaling::NONE,
                )?;
                copy_in_parallel(cast_mut::<f32>(region)?, param);
                outcome
            }
            HostWeights::Bf16(param) => {
                let key = AdamStochasticConfig::new(adam.clone(), seed).key(self.index, step);
                let grad: &[bf16] = cast(region)?;
                let outcome = adam_fused_stochastic(
                    adam,
                    step,
                    key,
                    AdamStochasticBuffers {
                        param,
                        grad,
                        exp_avg,
                        exp_avg_sq,
                        max_exp_avg_sq: max_exp_avg_sq.as_deref_mut(),
                    },
                    GradScaling::NONE,
                )?;
                copy_in_parallel(cast_mut::<bf16>(region)?, param);
                outcome
            }
            HostWeights::Master(master) => {
                // f32 Adam on the master, over the bf16 gradient widened a chunk at a time (the
                // update is element-wise, so chunks change no bit), then the parameter is the
                // master rounded to nearest, as a master-weights wrapper's copy back rounds it.
                let mut widened = vec![0f32; MASTER_CHUNK.min(master.len())];
                let mut outcome = StepOutcome::Stepped;
                let grad: &[bf16] = cast(region)?;
                for (start, chunk) in grad.chunks(MASTER_CHUNK).enumerate() {
                    let range = start * MASTER_CHUNK..start * MASTER_CHUNK + chunk.len();
                    let widened = &mut widened[..chunk.len()];
                    for (w, g) in widened.iter_mut().zip(chunk) {
                        *w = g.to_f32();
                    }
                    outcome = adam_fused(
                        adam,
                        step,
                        AdamBuffers {
                            param: &mut master[range.clone()],
                            grad: widened,
                            exp_avg: &mut exp_avg[range.clone()],
                            exp_avg_sq: &mut exp_avg_sq[range.clone()],
                            max_exp_avg_sq: max_exp_avg_sq.as_deref_mut().map(|v| &mut v[range]),
                        },
                        GradScaling::NONE,
                    )?;
                }
                let rounded = cast_mut::<bf16>(region)?.par_chunks_mut(PARALLEL_CHUNK);
                rounded
                    .zip(master.par_chunks(PARALLEL_CHUNK))
                    .for_each(|(out, values)| {
                        for (out, value) in out.iter_mut().zip(values) {
                            *out = <bf16 as ParamElement>::from_f32(*value);
                        }
                    });
                outcome
            }
        };
        debug_assert_eq!(outcome, StepOutcome::Stepped);
        Ok(())
    }

    /// How many steps the parameter has taken.
    pub(crate) fn step(&self) -> u64 {
        self.step
    }

    /// The step count and the moments by their state-dict names, once the slot has state.
    pub(crate) fn saved(&self) -> Option<(u64, Vec<NamedMoment<'_>>)> {
        let state = self.state.as_ref()?;
        let mut moments = vec![
            ("exp_avg", state.exp_avg.as_slice()),
            ("exp_avg_sq", state.exp_avg_sq.as_slice()),
        ];
        if let Some(vmax) = &state.max_exp_avg_sq {
            moments.push(("max_exp_avg_sq", vmax.as_slice()));
        }
        if let HostWeights::Master(master) = &state.weights {
            moments.push(("master_weight", master.as_slice()));
        }
        Some((self.step, moments))
    }

    /// Restores a saved step count and moments (`None`: no state, as before a first step); the
    /// host copy of the parameter is read from the device at the next step.
    pub(crate) fn restore(&mut self, saved: Option<SavedSlot>) {
        match saved {
            None => {
                self.state = None;
                self.step = 0;
            }
            Some(saved) => {
                let weights = match (self.param.dtype(), saved.master) {
                    // A saved master is the truth (the parameter is its rounding).
                    (DType::BF16, Some(master)) => {
                        self.host_copy_stale = false;
                        self.synced_version = self.param.version();
                        HostWeights::Master(master)
                    }
                    (DType::BF16, None) => HostWeights::Bf16(Vec::new()),
                    _ => HostWeights::F32(Vec::new()),
                };
                let keep_master = matches!(weights, HostWeights::Master(_));
                self.state = Some(HostState {
                    weights,
                    exp_avg: saved.exp_avg,
                    exp_avg_sq: saved.exp_avg_sq,
                    max_exp_avg_sq: saved.max_exp_avg_sq,
                });
                self.step = saved.step;
                if keep_master {
                    return;
                }
            }
        }
        self.host_copy_stale = true;
    }

    /// The version the device parameter has once the copy back lands (copies do not move it).
    pub(crate) fn mark_synced(&mut self) {
        self.synced_version = self.param.version();
    }
}

/// `dst = src` over rayon's pool, in the host kernels' chunks (the new parameter into the staging
/// block: a serial copy of a large parameter costs as much as its update).
fn copy_in_parallel<T: Copy + Send + Sync>(dst: &mut [T], src: &[T]) {
    dst.par_chunks_mut(PARALLEL_CHUNK)
        .zip(src.par_chunks(PARALLEL_CHUNK))
        .for_each(|(dst, src)| dst.copy_from_slice(src));
}

/// `bytes` as elements of `T` (aligned, a whole number of them).
fn cast<T: bytemuck::Pod>(bytes: &[u8]) -> Result<&[T], OptimError> {
    bytemuck::try_cast_slice(bytes).map_err(|err| OptimError::InvalidArgument {
        op: NAME,
        reason: format!("staging bytes as {}: {err}", std::any::type_name::<T>()),
    })
}

/// `bytes` as mutable elements of `T`.
fn cast_mut<T: bytemuck::Pod>(bytes: &mut [u8]) -> Result<&mut [T], OptimError> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|err| OptimError::InvalidArgument {
        op: NAME,
        reason: format!("staging bytes as {}: {err}", std::any::type_name::<T>()),
    })
}
