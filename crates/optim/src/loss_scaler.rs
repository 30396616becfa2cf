//! Loss scaling as a provider: [`LossScaler`], the one interface through which every step
//! driver — the plain loop, an optimizer stepped inside backward, a sharded optimizer — takes a
//! loss scale, so fp16 training works wherever an f32 step works.
//!
//! A scaler is not an optimizer and wraps none: it scales the loss, opens a step with the scale
//! the gradients will carry and a zeroed overflow flag ([`DeviceGradScaling`], both on the
//! device), and, once the driver has set the flag from the step's gradients and stepped with
//! [`Scaling::Device`](crate::Scaling::Device) (the fused kernels divide by the scale and skip
//! the whole step when the flag is set), updates the scale from that flag. Which driver runs
//! the step is the caller's choice; what it must do with the pair is the same everywhere:
//! - the plain loop: set the flag over every gradient (`non_finite_check_and_unscale_`), then
//!   `optimizer.step_with(All, Scaling::Device(..))` (amp's `GradScaler::step` does both);
//! - in backward (hooks' `InBackward::backward_scaled`): a first pass sets the flag over every
//!   gradient, the updating pass steps each bucket with the pair;
//! - sharded (distributed's `ShardedOptimizer`): the ranks' flags are reduced to their maximum
//!   before any shard is updated, so every rank skips or steps together.
//!
//! It sits on autograd-core's tensors and this crate's scaling vocabulary; the scale's
//! arithmetic (PyTorch's growth and backoff) is amp's `GradScaler`, which implements it.

use headroom_autograd_core::Tensor;

use crate::error::OptimError;
use crate::step::DeviceGradScaling;

/// A source of loss scaling for training steps (PyTorch's `GradScaler` without the optimizer).
///
/// One step is `scale_loss`, backward, `begin_step`, the driver's check and step, `end_step`.
/// A disabled scaler returns the loss itself and no scaling, and the step runs unscaled.
pub trait LossScaler: Send + std::fmt::Debug {
    /// `loss × scale` in f32, what backward starts from (the loss itself when disabled).
    fn scale_loss(&mut self, loss: &Tensor) -> Result<Tensor, OptimError>;

    /// Opens the step whose gradients the scaled loss produced: the scale they carry and a
    /// zeroed overflow flag beside it (`[1]` f32 on the scale's device), which the driver sets
    /// from every gradient before any update reads it. `None` when disabled.
    fn begin_step(&mut self) -> Result<Option<DeviceGradScaling>, OptimError>;

    /// Closes the step `begin_step` opened: the scale backs off if `scaling`'s flag is set and
    /// grows after enough clean steps. Nothing waits for the device.
    fn end_step(&mut self, scaling: &DeviceGradScaling) -> Result<(), OptimError>;
}
