//! Adam and AdamW on CUDA (`kernels/adam.cu`): the rule's pieces for the multi-tensor driver
//! (`multi_tensor.rs`), and [`CudaFusedAdam`] over raw device buffers.
//!
//! Parameters may be f32, bf16 or f16 (one kernel instance per dtype, states of the parameter's
//! dtype); [`CudaFusedAdam`] takes f32 buffers, and bf16 ones with f32 moments for the
//! stochastic rule ([`CudaFusedAdam::step_buffers_stochastic`]). Each piece's constants are [`StepConsts`] of its
//! own step, as on the CPU. The foreach ops are those of `kernels/adam.rs`'s `run_ops`,
//! launched in its order; the fused kernel is its `fused_element`. A piece that a GradScaler on
//! the device may skip carries its skip counter and the raw hyperparameters, from which the
//! kernel recomputes the two bias corrections. [`AdamStochasticConfig`]'s entry launches the
//! stochastic-rounding kernel (bf16 parameters, f32 moments) with the same pieces, each extended
//! by the seed and the parameter's index.

use std::sync::Arc;

use headroom_autograd_core::DType;
use headroom_ops_cuda::CudaBackend;

use super::launch::{
    address, check_disjoint, checked_scaling_addresses, fused_block_elems, geometry, instance,
    raw_geometry, CudaDevice, ItemGeometry, Module, PassOps,
};
use super::multi_tensor::{self, PieceKernels, Span};
use super::table::{flags, PieceHead, Table};
use crate::adam::AdamState;
use crate::adam_stochastic::AdamStochasticConfig;
use crate::error::OptimError;
use crate::kernels::{AdamConfig, StepConsts, WeightDecay};
use crate::rule::CudaKernels;
use crate::step::{DeviceGradScaling, RuleCall};

const PIECE_SIZE: usize = 144;
/// The kernel of [`FusedAdamMath::Torch`] and the size of its `AdamTorchPiece`.
const TORCH_KERNEL: (Module, &str) = (Module::Adam, "adam_fused_torch_f32");
const TORCH_PIECE_SIZE: usize = 96;

impl CudaKernels<AdamState> for AdamConfig {
    fn cuda_step(
        &self,
        device: &mut CudaDevice,
        call: RuleCall<'_, '_, AdamState>,
    ) -> Result<(), OptimError> {
        multi_tensor::step(self, device, call)
    }
}

impl PieceKernels for AdamConfig {
    const MODULE: Module = Module::Adam;
    const FUSED_KERNELS: [&'static str; 3] =
        ["adam_fused_f32", "adam_fused_bf16", "adam_fused_f16"];
    const PASS_KERNELS: [&'static str; 3] = ["adam_pass_f32", "adam_pass_bf16", "adam_pass_f16"];
    const FUSED_BLOCK: (u64, u32) = (1 << 16, 512);
    const REPLAYED: bool = true;

    fn state_addresses(state: &AdamState) -> [u64; 3] {
        let max_exp_avg_sq = state.max_exp_avg_sq.as_ref().map_or(0, address);
        [
            address(&state.exp_avg),
            address(&state.exp_avg_sq),
            max_exp_avg_sq,
        ]
    }

    /// Those that need no temporary (v's two ops and m's lerp, unless the gradient is modified
    /// into the temporary first; AMSGrad's maximum) run over whole tensors, as PyTorch runs
    /// every op; the rest chunk by chunk, decay just before p's update, so that a chunk's arrays
    /// are reused while they are still in the L2.
    fn pass_ops(&self) -> PassOps {
        let c = StepConsts::new(self, 1);
        let mut ops = PassOps::default();
        if c.changes_grad() {
            ops.whole.push(MUL_V);
            ops.chunked.extend([GRAD, ADDCMUL, LERP]);
            if self.amsgrad {
                ops.chunked.push(MAX);
            }
        } else {
            ops.whole.extend([MUL_V, ADDCMUL, LERP]);
            if self.amsgrad {
                ops.whole.push(MAX);
            }
        }
        ops.chunked.extend([SQRT, DIV, ADD_EPS]);
        if self.weight_decay != 0.0 && self.decay == WeightDecay::Decoupled {
            ops.chunked.push(DECAY);
        }
        ops.chunked.push(ADDCDIV);
        ops
    }

    /// Writes an `AdamPiece` (`kernels/adam.cu`).
    fn write_piece(&self, table: &mut Table, head: PieceHead, span: Span, grad_scale: Option<f32>) {
        self.write_fields(table, head, span, grad_scale)
            .end(PIECE_SIZE);
    }
}

impl AdamConfig {
    /// Writes an `AdamTorchPiece` (`kernels/adam.cu`): the hyperparameters rounded to f32, as
    /// PyTorch's fused kernel takes them; the kernel derives the step's constants itself.
    fn write_torch_piece(&self, table: &mut Table, head: PieceHead, span: Span) {
        let decays = self.weight_decay != 0.0;
        let piece_flags = flags::when(self.maximize, flags::MAXIMIZE)
            | flags::when(decays && self.decay == WeightDecay::L2, flags::L2)
            | flags::when(decays && self.decay == WeightDecay::Decoupled, flags::DECAY);
        let [exp_avg, exp_avg_sq, max_exp_avg_sq] = span.states;
        table
            .entry(head)
            .u64(span.param)
            .u64(span.grad)
            .u64(exp_avg)
            .u64(exp_avg_sq)
            .u64(max_exp_avg_sq)
            .u32(piece_flags)
            .f32(self.lr as f32)
            .f32(self.betas.0 as f32)
            .f32(self.betas.1 as f32)
            .f32(self.weight_decay as f32)
            .f32(self.eps as f32)
            .end(TORCH_PIECE_SIZE);
    }

    /// The fields of an `AdamPiece`, left open for a struct that extends it.
    fn write_fields<'t>(
        &self,
        table: &'t mut Table,
        head: PieceHead,
        span: Span,
        grad_scale: Option<f32>,
    ) -> &'t mut Table {
        let c = StepConsts::new(self, head.step);
        let piece_flags = flags::when(grad_scale.is_some(), flags::HOST_SCALED)
            | flags::when(c.maximize, flags::MAXIMIZE)
            | flags::when(c.l2.is_some(), flags::L2)
            | flags::when(c.decay_factor.is_some(), flags::DECAY)
            | flags::when(c.changes_grad(), flags::CHANGES_GRAD);
        let [exp_avg, exp_avg_sq, max_exp_avg_sq] = span.states;
        table
            .entry(head)
            .u64(span.param)
            .u64(span.grad)
            .u64(exp_avg)
            .u64(exp_avg_sq)
            .u64(max_exp_avg_sq)
            .u64(span.tmp)
            .f64(self.lr)
            .f64(self.betas.0)
            .f64(self.betas.1)
            .u32(piece_flags)
            .f32(c.l2.unwrap_or(0.0))
            .f32(c.decay_factor.unwrap_or(1.0))
            .f32(c.one_minus_beta1)
            .f32(c.beta2)
            .f32(c.one_minus_beta2)
            .f32(c.bias_correction2_sqrt)
            .f32(c.eps)
            .f32(c.neg_step_size)
            .f32(grad_scale.unwrap_or(1.0))
    }
}

/// The size of an `AdamStochasticPiece` (`kernels/adam.cu`): an `AdamPiece`, the seed and the
/// parameter's index.
const STOCHASTIC_PIECE_SIZE: usize = PIECE_SIZE + 16;
/// The kernel of [`AdamStochasticConfig`] (bf16 parameters, f32 moments).
const STOCHASTIC_KERNEL: (Module, &str) = (Module::Adam, "adam_fused_stochastic_bf16");
/// The same with bf16 moments (rounded to nearest-even as they are stored).
const STOCHASTIC_BF16_STATE_KERNEL: (Module, &str) =
    (Module::Adam, "adam_fused_stochastic_bf16_bf16_state");

impl CudaKernels<AdamState> for AdamStochasticConfig {
    /// One fused launch for every parameter of the call; each piece carries the seed and the
    /// parameter's index, from which the kernel derives the random stream of its true step.
    fn cuda_step(
        &self,
        device: &mut CudaDevice,
        call: RuleCall<'_, '_, AdamState>,
    ) -> Result<(), OptimError> {
        let RuleCall { items, scaling, .. } = call;
        if items.is_empty() {
            return Ok(());
        }
        let geometry = geometry(items);
        let spans: Vec<Span> = items
            .iter()
            .map(|it| Span {
                param: address(it.param),
                grad: address(&it.grad),
                states: AdamConfig::state_addresses(it.state),
                tmp: 0,
            })
            .collect();
        let grad_scale = scaling.host().grad_scale;
        device.run_fused(
            STOCHASTIC_KERNEL,
            &geometry,
            AdamConfig::FUSED_BLOCK,
            (scaling, false),
            &mut |table, idx, head| {
                self.adam
                    .write_fields(table, head, spans[idx], grad_scale)
                    .u64(self.seed)
                    .u64(geometry[idx].slot as u64)
                    .end(STOCHASTIC_PIECE_SIZE);
            },
        )
    }
}

/// One parameter's device buffers (f32, `len` elements each), by address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAdamParam {
    /// The parameter.
    pub param: u64,
    /// Its gradient.
    pub grad: u64,
    /// First moment.
    pub exp_avg: u64,
    /// Second moment.
    pub exp_avg_sq: u64,
    /// Running maximum of the second moment (AMSGrad), if used.
    pub max_exp_avg_sq: Option<u64>,
    /// Elements.
    pub len: usize,
}

/// The arithmetic of a [`CudaFusedAdam`] step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FusedAdamMath {
    /// PyTorch's op-by-op Adam (`_single_tensor_adam`, `foreach=True`) in one pass: the kernel of
    /// the optimizer's fused implementation, bit-identical to [`crate::kernels::adam_fused`] and
    /// to the CPU.
    #[default]
    OpByOp,
    /// PyTorch 2.11's own fused kernel (`torch.optim.Adam(fused=True)`, `AdamW(fused=True)`),
    /// for a caller that must agree with it to the bit: hyperparameters rounded to f32, the
    /// bias corrections from the device's `powf` of the step, the moments as two fmas each,
    /// weight decay contracted into an fma. With a device `grad_scale`, the gradients are left
    /// divided by it, as PyTorch's fused step leaves them.
    Torch,
}

/// Fused Adam over a fixed list of device buffers: one launch per step for the whole list, with
/// the arithmetic of [`FusedAdamMath`] (by default the optimizer's fused implementation,
/// bit-identical to [`crate::kernels::adam_fused`]).
#[derive(Debug)]
pub struct CudaFusedAdam {
    device: CudaDevice,
    params: Vec<DeviceAdamParam>,
    amsgrad: bool,
    math: FusedAdamMath,
}

impl CudaFusedAdam {
    /// Fused Adam over `params` on `backend`.
    ///
    /// # Safety
    /// Every address in `params` must be a live f32 buffer of `len` elements on `backend`'s
    /// device for as long as this value is used, and the buffers of different parameters must
    /// not overlap.
    pub unsafe fn new(
        backend: Arc<CudaBackend>,
        params: &[DeviceAdamParam],
    ) -> Result<CudaFusedAdam, OptimError> {
        let amsgrad = params.iter().any(|p| p.max_exp_avg_sq.is_some());
        if amsgrad && !params.iter().all(|p| p.max_exp_avg_sq.is_some()) {
            return Err(OptimError::InvalidArgument {
                op: "CudaFusedAdam",
                reason: "either every parameter or none has an AMSGrad buffer".into(),
            });
        }
        check_disjoint("CudaFusedAdam", written_ranges(params, 4))?;
        Ok(CudaFusedAdam {
            device: CudaDevice::new(backend, 0),
            params: params.to_vec(),
            amsgrad,
            math: FusedAdamMath::default(),
        })
    }

    /// The same optimizer stepping with `math`.
    pub fn with_math(mut self, math: FusedAdamMath) -> CudaFusedAdam {
        self.math = math;
        self
    }

    /// Adam step number `step` (counted from 1) on every buffer given at creation. With
    /// `scaling`, a GradScaler's scale and found-inf flag in device memory (one-element f32
    /// tensors of this optimizer's backend, checked): gradients are divided by the scale, and
    /// nothing is written when the flag is non-zero (the caller does not count such a step).
    /// The tensors are borrowed for the call; the allocator frees their memory in stream order,
    /// after the launch.
    pub fn step(
        &mut self,
        cfg: &AdamConfig,
        step: u64,
        scaling: Option<&DeviceGradScaling>,
    ) -> Result<(), OptimError> {
        if cfg.amsgrad != self.amsgrad {
            return Err(OptimError::InvalidArgument {
                op: "CudaFusedAdam::step",
                reason: "amsgrad differs from the buffers given at creation".into(),
            });
        }
        let addresses = checked_scaling_addresses(&self.device, "CudaFusedAdam::step", scaling)?;
        self.launch(cfg, step, None, addresses)
    }

    /// [`CudaFusedAdam::step`] over `params` given for this step alone, for a caller whose
    /// buffers move between steps (a framework's gradients, reallocated after `zero_grad`):
    /// one launch on the backend's compute stream, nothing copied. The
    /// buffers given at creation are kept for [`CudaFusedAdam::step`]; `params` are not.
    /// `scaling` holds the device addresses of a GradScaler's scale and found-inf flag (one
    /// f32 each), or `None` for each.
    ///
    /// # Safety
    /// As [`CudaFusedAdam::new`], for `params`: live f32 buffers of `len` elements on the
    /// backend's device until the launch completes, not overlapping between parameters, and
    /// every parameter with an AMSGrad buffer or none; each address of `scaling` a live f32 of
    /// the backend's device until the launch completes.
    pub unsafe fn step_buffers(
        &mut self,
        cfg: &AdamConfig,
        step: u64,
        params: &[DeviceAdamParam],
        scaling: (Option<u64>, Option<u64>),
    ) -> Result<(), OptimError> {
        // SAFETY: the caller's contract is this one's, for f32 buffers.
        unsafe { self.step_buffers_of(cfg, step, DType::F32, params, scaling) }
    }

    /// [`CudaFusedAdam::step_buffers`] over buffers of `dtype` (f32, bf16 or f16): parameters,
    /// gradients and states all of `dtype`, the update in f32 and each value stored once, rounded
    /// to `dtype`, as PyTorch's fused Adam does for low-precision parameters (the bits of
    /// [`crate::kernels::adam_fused`] on the same slices). [`FusedAdamMath::Torch`] has an f32
    /// kernel only, so other dtypes are refused under it.
    ///
    /// # Safety
    /// As [`CudaFusedAdam::step_buffers`], every buffer of `len` elements of `dtype`.
    pub unsafe fn step_buffers_of(
        &mut self,
        cfg: &AdamConfig,
        step: u64,
        dtype: DType,
        params: &[DeviceAdamParam],
        (grad_scale, found_inf): (Option<u64>, Option<u64>),
    ) -> Result<(), OptimError> {
        const OP: &str = "CudaFusedAdam::step_buffers";
        let elem = match (dtype, self.math) {
            (DType::F32, _) => 4,
            (DType::BF16 | DType::F16, FusedAdamMath::OpByOp) => 2,
            (other, math) => {
                return Err(OptimError::InvalidArgument {
                    op: OP,
                    reason: format!(
                        "{other:?} buffers under {math:?} (f32 always; bf16 and f16 with OpByOp)"
                    ),
                })
            }
        };
        check_amsgrad_buffers(OP, params, cfg.amsgrad)?;
        check_disjoint(OP, written_ranges(params, elem))?;
        let addresses = (grad_scale.unwrap_or(0), found_inf.unwrap_or(0));
        self.launch(cfg, step, Some((params, dtype)), addresses)
    }

    /// One launch of the kernel of `self.math` over `given` (or the buffers given at creation),
    /// each with an AMSGrad buffer exactly when `cfg.amsgrad` (checked by the callers), reading
    /// the scale and flag at `addresses` (0: none).
    fn launch(
        &mut self,
        cfg: &AdamConfig,
        step: u64,
        given: Option<(&[DeviceAdamParam], DType)>,
        addresses: (u64, u64),
    ) -> Result<(), OptimError> {
        cfg.validate()?;
        let (params, dtype) = given.unwrap_or((&self.params, DType::F32));
        let math = self.math;
        let geometry = raw_geometry("CudaFusedAdam", params.iter().map(|p| p.len), step)?;
        let (table, n_blocks, block) = raw_pieces(
            &mut self.device,
            &geometry,
            params,
            &mut |t, _, head, span| match math {
                FusedAdamMath::OpByOp => cfg.write_piece(t, head, span, None),
                FusedAdamMath::Torch => cfg.write_torch_piece(t, head, span),
            },
        )?;
        let n_pieces = params.len();
        match math {
            FusedAdamMath::OpByOp => {
                let kernel = (Module::Adam, instance(dtype, AdamConfig::FUSED_KERNELS));
                let launch = (&table, n_pieces, n_blocks);
                self.device
                    .run_elementwise_replayed(kernel, launch, block, addresses)
                    .map(drop)
            }
            FusedAdamMath::Torch => self.device.run_elementwise(
                TORCH_KERNEL,
                &table,
                n_pieces,
                n_blocks,
                block,
                addresses,
            ),
        }
    }
}

impl CudaFusedAdam {
    /// [`AdamStochasticConfig`]'s step over raw buffers given for this call: bf16 parameters and
    /// gradients, moments of `moments` (`DType::F32`, or `DType::BF16`: 4 bytes a parameter of
    /// state instead of 8, each moment rounded to nearest-even as it is stored; `len` elements
    /// each), the new parameters rounded stochastically
    /// with parameter `i`'s random stream keyed by `slots[i]` (its index among the caller's
    /// parameters, stable across steps) and the step, as [`AdamStochasticConfig::key`] says; one
    /// launch on the backend's stream, the bits of [`crate::kernels::adam_fused_stochastic`].
    /// `scaling` holds the device addresses of a GradScaler's scale and found-inf flag (one f32
    /// each), or `None` for each. The math of [`CudaFusedAdam::with_math`] does not apply: the
    /// stochastic kernel has the optimizer's own arithmetic.
    ///
    /// # Safety
    /// For `params`: live buffers on the backend's device until the launch completes — the
    /// parameter and gradient of `len` bf16 elements, each state of `len` elements of
    /// `moments` — not overlapping
    /// between parameters, every parameter with an AMSGrad buffer or none; each address of
    /// `scaling` a live f32 of the backend's device until the launch completes.
    pub unsafe fn step_buffers_stochastic(
        &mut self,
        cfg: &AdamStochasticConfig,
        step: u64,
        params: &[DeviceAdamParam],
        slots: &[usize],
        moments: DType,
        (grad_scale, found_inf): (Option<u64>, Option<u64>),
    ) -> Result<(), OptimError> {
        const OP: &str = "CudaFusedAdam::step_buffers_stochastic";
        cfg.adam.validate()?;
        let (kernel, moment_bytes) = match moments {
            DType::F32 => (STOCHASTIC_KERNEL, 4),
            DType::BF16 => (STOCHASTIC_BF16_STATE_KERNEL, 2),
            other => {
                return Err(OptimError::InvalidArgument {
                    op: OP,
                    reason: format!("moments of {other:?}: give f32 or bf16"),
                })
            }
        };
        if slots.len() != params.len() {
            return Err(OptimError::InvalidArgument {
                op: OP,
                reason: format!("{} slots for {} parameters", slots.len(), params.len()),
            });
        }
        check_amsgrad_buffers(OP, params, cfg.adam.amsgrad)?;
        check_disjoint(OP, stochastic_ranges(params, moment_bytes))?;
        let mut geometry = raw_geometry(OP, params.iter().map(|p| p.len), step)?;
        for (item, &slot) in geometry.iter_mut().zip(slots) {
            item.slot = slot;
        }
        let (table, n_blocks, block) = raw_pieces(
            &mut self.device,
            &geometry,
            params,
            &mut |t, idx, head, span| {
                cfg.adam
                    .write_fields(t, head, span, None)
                    .u64(cfg.seed)
                    .u64(slots[idx] as u64)
                    .end(STOCHASTIC_PIECE_SIZE);
            },
        )?;
        let addresses = (grad_scale.unwrap_or(0), found_inf.unwrap_or(0));
        self.device
            .run_elementwise(kernel, &table, params.len(), n_blocks, block, addresses)
    }
}

/// The piece table of a launch over raw `params` (`geometry` theirs) on `device`: the fused
/// block for their total length, one piece per parameter written by `write(table, index, head,
/// span)`.
fn raw_pieces(
    device: &mut CudaDevice,
    geometry: &[ItemGeometry],
    params: &[DeviceAdamParam],
    write: &mut dyn FnMut(&mut Table, usize, PieceHead, Span),
) -> Result<(Table, u64, (u64, u32)), OptimError> {
    let total_len = params.iter().map(|p| p.len).sum();
    let block = (
        fused_block_elems(total_len, AdamConfig::FUSED_BLOCK),
        AdamConfig::FUSED_BLOCK.1,
    );
    let (table, n_blocks) = device.piece_table(geometry, block.0, false, &mut |t, idx, head| {
        let p = &params[idx];
        let span = Span {
            param: p.param,
            grad: p.grad,
            states: [p.exp_avg, p.exp_avg_sq, p.max_exp_avg_sq.unwrap_or(0)],
            tmp: 0,
        };
        write(t, idx, head, span)
    })?;
    Ok((table, n_blocks, block))
}

/// `Ok` when every parameter has an AMSGrad buffer with `amsgrad` and none has one without.
fn check_amsgrad_buffers(
    op: &'static str,
    params: &[DeviceAdamParam],
    amsgrad: bool,
) -> Result<(), OptimError> {
    if params.iter().all(|p| p.max_exp_avg_sq.is_some() == amsgrad) {
        return Ok(());
    }
    Err(OptimError::InvalidArgument {
        op,
        reason: "with amsgrad every parameter needs an AMSGrad buffer, without it none".into(),
    })
}

/// The byte ranges of a stochastic step's buffers, per parameter: the bf16 parameter and
/// gradient, the f32 states.
fn stochastic_ranges(
    params: &[DeviceAdamParam],
    moment_bytes: u64,
) -> impl Iterator<Item = (u64, u64)> + '_ {
    params.iter().flat_map(move |p| {
        let half = p.len as u64 * 2;
        let states = [p.exp_avg, p.exp_avg_sq]
            .into_iter()
            .chain(p.max_exp_avg_sq)
            .map(move |address| (address, p.len as u64 * moment_bytes));
        [(p.param, half), (p.grad, half)].into_iter().chain(states)
    })
}

/// The byte ranges of a fused step's buffers, per parameter: the parameter, its gradient (which
/// [`FusedAdamMath::Torch`] writes when scaled) and its states, all of `elem` bytes an element.
fn written_ranges(params: &[DeviceAdamParam], elem: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
    params.iter().flat_map(move |p| {
        let bytes = p.len as u64 * elem;
        let states = [p.exp_avg, p.exp_avg_sq];
        [p.param, p.grad]
            .into_iter()
            .chain(states)
            .chain(p.max_exp_avg_sq)
            .map(move |address| (address, bytes))
    })
}

// The ops of `adam_pass_f32`, in the order they run.
const GRAD: i32 = 0;
const DECAY: i32 = 1;
const LERP: i32 = 2;
const MUL_V: i32 = 3;
const ADDCMUL: i32 = 4;
const MAX: i32 = 5;
const SQRT: i32 = 6;
const DIV: i32 = 7;
const ADD_EPS: i32 = 8;
const ADDCDIV: i32 = 9;
