//! Optimizers for Headroom: SGD, Adam, AdamW and Adafactor with PyTorch's formulas, each as a
//! single-tensor, foreach (multi-tensor, bounded temporaries) and fused (one pass) update,
//! bitsandbytes' 8-bit blockwise Adam and torchao's 4-bit Adam; gradient clipping; learning-rate
//! schedulers; state dicts as safetensors.
//!
//! Two layers:
//! - [`kernels`], the raw-buffer layer: update kernels over host slices (`&mut [f32]` params,
//!   `&[f32]` grads, state slices). It needs no tensor type, so a trainer that owns its buffers
//!   calls it directly; each call updates one parameter, which is also the per-parameter step
//!   an optimizer-in-backward hook needs. The fused and 8-bit kernels take a
//!   [`GradScaling`](kernels::GradScaling) (in-kernel unscale and overflow skip, no host sync).
//! - The optimizer layer over autograd-core parameters: [`GroupOptimizer`] (aliases [`Sgd`],
//!   [`Adam`], [`Adafactor`], [`Adam8bit`], [`Adam4bit`]) runs one [`UpdateRule`] over
//!   parameter groups with per-group hyperparameters and one [`Implementation`] — how the rule
//!   runs: `Single`,
//!   `Foreach { chunk }` (temporaries bounded by `chunk` elements, [`DEFAULT_FOREACH_CHUNK`] =
//!   16 MiB of f32 by default, instead of PyTorch's one temporary per parameter),
//!   `ForeachUnbounded` (PyTorch's foreach) or `Fused`; 8-bit and 4-bit Adam are rules whose only
//!   implementation is `Fused`. It sits behind the object-safe [`Optimizer`] trait, which holds
//!   only what every optimizer needs: [`Optimizer::step_with`] (all parameters or the given
//!   [`ParamId`] handles — [`StepParams`] — with an optional gradient [`Scaling`]), `step`,
//!   `zero_grad` and state dicts. A handle is resolved once ([`Optimizer::param_id`]), and
//!   stepping one parameter or one bucket costs O(its size), never a pass over all parameters
//!   (`benches/step_param.rs`, one 64-element parameter on the CPU: fused SGD 0.63 µs with 10
//!   parameters and 0.62 µs with 10,000, fused Adam 0.94 and 0.93 µs; the `step_param` this
//!   replaced took 126 and 246 µs at 10,000, so a backward with a hook per parameter was
//!   O(parameters²)). [`LrScheduler`] drives the groups' learning rates. State
//!   tensors and step temporaries come from the parameters' caching allocator, so their bytes
//!   show in `memory_allocated()`.
//! - Host memory for the state: [`OffloadedAdam`] (Adam's state stepped by the host, or streamed
//!   through the GPU) and [`StreamedOptimizer`], which wraps any rule's `GroupOptimizer` and
//!   keeps its state in pinned host memory between steps, streamed in and out around each
//!   bucket and stepped by the rule's own CUDA kernels (bitwise the on-device optimizer; 4-bit
//!   AdamW keeps 1.06 bytes a parameter on the host; the GPU holds at most the stream budget
//!   ahead).
//!
//! Parameters may live on the CPU or, with the `cuda` feature, on a CUDA device: the optimizer
//! takes its [`StepDevice`] from its parameters (all on one device, contiguous, of a dtype the
//! rule takes, else a typed error), and the device is chosen in one place: `StepDevice` calls the
//! rule's host entry ([`UpdateRule::host_step`]) or its CUDA entry ([`CudaKernels`]`::cuda_step`),
//! trait methods all the way down. The rules' front ends (`sgd.rs`, `adam.rs`, `adafactor.rs`,
//! `adam8bit.rs`, and their CUDA pieces in `cuda/`) say only which buffers go to which kernels;
//! one shared driver per device (`driver.rs`, `cuda/multi_tensor.rs`) does the element-type
//! dispatch, the scratch of the single and foreach forms, the chunking and the per-parameter
//! schedule.
//!
//! A rule of your own is an [`ElementwiseRule`]: the update of one element in f32, the names of
//! its state tensors and its constants per step. `GroupOptimizer::<YourRule>` then runs it with
//! every implementation on the host (f32, bf16 and f16 parameters, states of their dtype, each
//! value rounded once), with state dicts and schedulers, and on CUDA with a PTX kernel you supply
//! ([`ElementKernel`], reading a table of [`ElementPiece`]s); `examples/custom_rule` writes Lion
//! and checks it against a hand-written loop, bit for bit.
//!
//! Gradient clipping: [`clip_grad_norm_`] (norms 2 and inf, `error_if_nonfinite`, the total norm
//! returned as a device tensor) and [`clip_grad_value_`], with PyTorch 2.11's semantics, over
//! f32, bf16 and f16 gradients on the CPU (f64 sums) or CUDA (three launches for any number of
//! gradients, the norm and the coefficient staying in device memory: no host synchronisation
//! unless `error_if_nonfinite` asks for the norm). On PyTorch's golden data the total norm is
//! within an ulp of both PyTorch's CPU and CUDA results and the clipped gradients within 2 ulps.
//! A GradScaler's overflow check, [`non_finite_check_and_unscale_`] (PyTorch's
//! `_amp_foreach_non_finite_check_and_unscale_`), is one CUDA launch per gradient dtype, its flag
//! left in device memory.
//!
//! SGD and Adam/AdamW take f32, bf16 and f16 parameters (a group may mix them; each dtype steps
//! separately, as PyTorch groups by dtype), with PyTorch's semantics for low precision:
//! gradients and states (momentum buffer, `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`) in the
//! parameter's dtype, so a bf16 moment takes 2 bytes per element; arithmetic in f32; each stored
//! value rounded to nearest-even once — at the end of the element's update in the fused form, as
//! PyTorch's fused kernels do, and after every op in the single and foreach forms, as PyTorch's
//! op-by-op paths do ([`kernels::ParamElement`]). The CPU and CUDA kernels round alike, so they
//! agree to the bit for bf16 and f16 too. [`AdamStochastic`] trains bf16 parameters without an
//! f32 master copy: f32 moments, the updated value rounded stochastically with seeded
//! counter-based bits ([`kernels::round_bf16_stochastic`]), 12 bytes per parameter, the CPU and
//! CUDA bit-equal. Adafactor, 8-bit and 4-bit Adam take f32 parameters only (a
//! [`OptimError::DType`] for others). CUDA has every
//! implementation too, with the CPU's float32 operations in the CPU's order, so results agree to
//! the bit (Adafactor's two f64 norms to an ulp); a GradScaler on the GPU passes its scale and
//! found-inf flag as device tensors ([`DeviceGradScaling`]): fused and 8-bit kernels read them,
//! and a skipped step is counted on the device. On the CPU the host kernels read those tensors in
//! place, so a GradScaler passes device tensors on either device
//! ([`Optimizer::takes_device_scaling`]); a step's [`SkipFlag`] tells an [`LrScheduler`] not to
//! advance past a skipped step. Measured on an H200 (1e9 parameters, 160
//! tensors, Adam; `benches/cuda_adam.rs`, PyTorch 2.11 in the same run): fused 7.03 ms
//! (PyTorch 9.18), foreach 19.5 ms holding 16 MiB of temporaries (PyTorch 21.2 ms, 4.03 GB),
//! 8-bit 5.42 ms; the workspace README has the table.
//!
//! This crate sits on autograd-core (tensors, their storage) and knows no device API itself:
//! the CPU side runs `kernels` on host memory; the CUDA side (`cuda`, feature `cuda`) launches
//! PTX built from `kernels/*.cu` through headroom-ops-cuda's backend.
//!
//! Modules import one way, down these layers (bottom first; a module imports from its own layer
//! or lower ones, never in a cycle — `tests/module_layers.rs` reads the sources and holds it):
//! 0. `clip::norm` — what a gradient clip is (its norm type, PyTorch's coefficient).
//! 1. `error` — the crate's one error type (it names the norm type).
//! 2. `kernels` — the raw-buffer layer: updates over host slices, no tensors.
//! 3. `step`, `host`, `cuda::table` — the step vocabulary; tensors as host slices; piece tables.
//! 4. `cuda::launch`, `cuda::replays`, `clip::host` — launches on a CUDA device (and the steps
//!    a CUDA graph replays); clipping on the host.
//! 5. `rule`, `loss_scaler`, `cuda::grads`, `cuda::clip`, `cuda::grad_scale` — what a rule is;
//!    what a loss scale provides; CUDA clipping.
//! 6. `driver`, `cuda::multi_tensor`, `device` — the drivers rules plug into; where steps run.
//! 7. `optimizer` — `GroupOptimizer` over parameter groups, the `Optimizer` trait, state dicts.
//! 8. `sgd`, `adam`, `adam_stochastic`, `adafactor`, `adam8bit`, `adam4bit`, `elementwise` — rule
//!    front ends.
//! 9. `clip`, `grad_scale`, `scheduler`, `offload_state` — public clipping, overflow check,
//!    schedulers; an offloaded parameter's host state and host step.
//! 10. `cuda` — the rules' CUDA pieces (each implements `CudaKernels` for its front end's
//!     state), the raw-buffer CUDA layer, offload's streams and host thread, and the state
//!     stream (pinned host states copied through the GPU) both offloads share.
//! 11. `offload`, `streamed` — `OffloadedAdam`, Adam with its state in host memory;
//!     `StreamedOptimizer`, any rule's state in host memory, streamed through the GPU.
//!
//! Crate features: `cuda` adds the CUDA device (capability only; results are the CPU's).
//!
//! The raw layer on host slices — two Adam steps, then the 8-bit form of the same update:
//!
//! ```
//! use headroom_optim::kernels::{
//!     adam8bit_blockwise, adam_fused, dynamic_map, n_blocks, Adam8bitBuffers, Adam8bitConfig,
//!     AdamBuffers, AdamConfig, GradScaling, ParamRounding, StepOutcome,
//! };
//!
//! let cfg = AdamConfig::adamw();
//! let mut param = vec![1.0f32; 4];
//! let grad = vec![0.5f32, -0.5, 1.0, 0.0];
//! let (mut exp_avg, mut exp_avg_sq) = (vec![0.0; 4], vec![0.0; 4]);
//! for step in 1..=2 {
//!     let bufs = AdamBuffers {
//!         param: &mut param,
//!         grad: &grad,
//!         exp_avg: &mut exp_avg,
//!         exp_avg_sq: &mut exp_avg_sq,
//!         max_exp_avg_sq: None,
//!     };
//!     assert_eq!(adam_fused(&cfg, step, bufs, GradScaling::NONE)?, StepOutcome::Stepped);
//! }
//! // Adam moves each coordinate by about lr against the gradient's sign.
//! assert!((param[0] - (1.0 - 2e-3 - 2e-5)).abs() < 1e-6);
//!
//! // A step whose gradients overflowed is skipped inside the kernel.
//! let skip = GradScaling { grad_scale: Some(1024.0), found_inf: Some(1.0) };
//! let bufs = AdamBuffers {
//!     param: &mut param,
//!     grad: &grad,
//!     exp_avg: &mut exp_avg,
//!     exp_avg_sq: &mut exp_avg_sq,
//!     max_exp_avg_sq: None,
//! };
//! assert_eq!(adam_fused(&cfg, 3, bufs, skip)?, StepOutcome::Skipped);
//!
//! // 8-bit state: u8 codes and one f32 scale per block of 256.
//! let (qmap1, qmap2) = (dynamic_map(true), dynamic_map(false));
//! let n = 5000;
//! let mut param = vec![0.1f32; n];
//! let grad: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
//! let (mut state1, mut state2) = (vec![0u8; n], vec![0u8; n]);
//! let (mut absmax1, mut absmax2) = (vec![0.0f32; n_blocks(n)], vec![0.0f32; n_blocks(n)]);
//! let bufs = Adam8bitBuffers {
//!     param: &mut param,
//!     grad: &grad,
//!     state1: &mut state1,
//!     state2: &mut state2,
//!     absmax1: &mut absmax1,
//!     absmax2: &mut absmax2,
//! };
//! adam8bit_blockwise(&Adam8bitConfig::adam(), 1, &qmap1, &qmap2, bufs, GradScaling::NONE, ParamRounding::NEAREST)?;
//! assert!(param.iter().zip(&grad).all(|(p, g)| *g == 0.0 || (*p < 0.1) == (*g > 0.0)));
//! # Ok::<(), headroom_optim::OptimError>(())
//! ```

pub mod kernels;

#[cfg(feature = "cuda")]
pub mod cuda;

mod adafactor;
mod adam;
mod adam4bit;
mod adam8bit;
mod adam_stochastic;
mod clip;
mod device;
mod driver;
mod elementwise;
mod error;
mod grad_scale;
mod host;
mod loss_scaler;
mod offload;
mod offload_state;
mod optimizer;
mod rule;
mod scheduler;
mod sgd;
mod step;
mod streamed;

pub use adafactor::{Adafactor, AdafactorState};
pub use adam::{Adam, AdamState};
pub use adam4bit::{Adam4bit, Adam4bitState};
pub use adam8bit::{bnb_maps, Adam8bit, Adam8bitState, BlockwiseState};
pub use adam_stochastic::{AdamStochastic, AdamStochasticConfig};
pub use clip::{clip_grad_norm_, clip_grad_value_, NormType};
pub use device::StepDevice;
pub use elementwise::{
    ElementKernel, ElementPiece, ElementwiseRule, ElementwiseState, KERNEL_CONSTS,
    MAX_ELEMENT_STATES,
};
pub use error::OptimError;
pub use grad_scale::non_finite_check_and_unscale_;
pub use kernels::{
    AdafactorConfig, Adam4bitConfig, Adam8bitConfig, AdamConfig, SgdConfig, WeightDecay,
};
pub use loss_scaler::LossScaler;
pub use offload::{
    OffloadConfig, OffloadStepper, OffloadedAdam, DEFAULT_BUCKETS_IN_FLIGHT, DEFAULT_STREAM_BYTES,
};
pub use optimizer::{GroupOptimizer, Optimizer, ParamGroup};
pub use rule::{CudaKernels, SavedTensors, UpdateRule};
pub use scheduler::{LrScheduler, Schedule, SkipFlag};
pub use sgd::{Sgd, SgdState};
pub use step::{
    DeviceGradScaling, Implementation, NamedTensors, ParamId, Scaling, StepParams,
    DEFAULT_FOREACH_CHUNK,
};
pub use streamed::{StreamedOptimizer, DEFAULT_STATE_STREAM_BYTES};
