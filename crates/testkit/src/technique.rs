//! The [`Technique`] trait — what a memory technique changes in a training step — and the plain
//! loop it is measured against ([`Baseline`]).
//!
//! A technique sees the whole run ([`TrainRun`]): the model, to wrap its blocks or its forward
//! (activation checkpointing, autocast); the optimizer, to take it over (optimizer-in-backward
//! steps from gradient hooks; a GradScaler steps it with scaling); and the case's optimizer as
//! data, to build its own.

use std::fmt;

use headroom_autograd_core::{BackendRef, Tensor};
use headroom_optim::Optimizer;

use crate::case::{Batch, Model, OptimSpec};
use crate::{HarnessError, Result};

/// One run of a case as a technique sees it.
pub struct TrainRun {
    /// Where the model lives.
    pub backend: BackendRef,
    /// The model, initialised from the case's seed.
    pub model: Model,
    /// The case's optimizer over every parameter, built before [`Technique::prepare`]; a
    /// technique that steps its own way may take it (`run.optimizer.take()`).
    pub optimizer: Option<Box<dyn Optimizer>>,
    /// The case's optimizer as data, for a technique that builds its own (per parameter, say).
    pub optim_spec: OptimSpec,
    /// The step being run, from 0.
    pub step: usize,
}

/// A change to the training step that must not change what training computes (or only within
/// the case's [`Tolerance`](crate::Tolerance)).
///
/// The harness calls [`prepare`](Technique::prepare) once, [`step`](Technique::step) once per
/// batch, then [`finish`](Technique::finish), and compares the parameters with the plain loop's.
pub trait Technique {
    /// Names the technique in reports and failures.
    fn name(&self) -> &str;

    /// Called once before the first step: install hooks, wrap blocks, take the optimizer.
    fn prepare(&mut self, run: &mut TrainRun) -> Result<()> {
        let _ = run;
        Ok(())
    }

    /// One training step on `batch`: afterwards the parameters hold the step's update. Returns
    /// the loss (for the report; read once, after the step).
    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> Result<Tensor>;

    /// Called once after the last step, before the parameters are compared: flush deferred
    /// updates, remove hooks.
    fn finish(&mut self, run: &mut TrainRun) -> Result<()> {
        let _ = run;
        Ok(())
    }
}

/// The plain loop: forward, loss, backward, `optimizer.step()`, `zero_grad(set_to_none)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Baseline;

impl Technique for Baseline {
    fn name(&self) -> &str {
        "baseline"
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> Result<Tensor> {
        let output = run.model.forward(&batch.input)?;
        let loss = run.model.loss(&output, batch)?;
        loss.backward()?;
        let optimizer = run.optimizer_mut()?;
        optimizer.step()?;
        optimizer.zero_grad(true)?;
        Ok(loss)
    }
}

impl TrainRun {
    /// The case's optimizer, or an error saying the technique took it.
    pub fn optimizer_mut(&mut self) -> Result<&mut dyn Optimizer> {
        match &mut self.optimizer {
            Some(optimizer) => Ok(optimizer.as_mut()),
            None => Err(HarnessError::OptimizerTaken.into()),
        }
    }
}

impl fmt::Debug for TrainRun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrainRun")
            .field("device", &self.backend.device())
            .field("model", &self.model)
            .field(
                "optimizer",
                &self.optimizer.as_ref().map(|optimizer| optimizer.name()),
            )
            .field("optim_spec", &self.optim_spec)
            .field("step", &self.step)
            .finish()
    }
}
