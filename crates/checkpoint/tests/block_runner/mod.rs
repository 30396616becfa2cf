//! The technique the checkpoint tests train with: a block runner set on the model, then the plain
//! loop's step. Shared by the test binaries (`mod block_runner;`): checkpointing, offload and the
//! planner.

use std::sync::Arc;

use headroom_autograd_core::Tensor;
use headroom_nn::BlockRunner;
use headroom_testkit::{Baseline, Batch, Technique, TrainRun};

/// Sets its runner as the model's block runner (ViT or GPT-2), then trains as the plain loop does.
pub(crate) struct WithRunner(pub(crate) Arc<dyn BlockRunner>);

impl Technique for WithRunner {
    fn name(&self) -> &str {
        "blocks through a runner"
    }

    fn prepare(&mut self, run: &mut TrainRun) -> headroom_testkit::Result<()> {
        let blocks = run.model.blocks_mut().ok_or("the MLP has no blocks")?;
        blocks.set_block_runner(Some(Arc::clone(&self.0)));
        Ok(())
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> headroom_testkit::Result<Tensor> {
        Baseline.step(run, batch)
    }
}
