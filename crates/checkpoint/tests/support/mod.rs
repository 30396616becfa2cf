//! What the offload test files share: the technique that runs a model's blocks through a block
//! runner and otherwise trains as the plain loop does.

use std::sync::Arc;

use headroom_autograd_core::Tensor;
use headroom_nn::BlockRunner;
use headroom_testkit::{Baseline, Batch, Model, Technique, TrainRun};

/// Sets `0` as the model's block runner (a ViT's encoder, a GPT-2's transformer), then steps as
/// [`Baseline`].
pub(crate) struct RunBlocks(pub(crate) Arc<dyn BlockRunner>);

impl Technique for RunBlocks {
    fn name(&self) -> &str {
        "blocks through a runner"
    }

    fn prepare(&mut self, run: &mut TrainRun) -> headroom_testkit::Result<()> {
        let runner = Some(Arc::clone(&self.0));
        match &mut run.model {
            Model::Vit(vit) => vit.encoder.block_runner = runner,
            Model::Gpt2(gpt2) => gpt2.transformer.block_runner = runner,
            Model::Mlp(_) => return Err("the MLP has no blocks".into()),
        }
        Ok(())
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> headroom_testkit::Result<Tensor> {
        Baseline.step(run, batch)
    }
}
