//! A model's repeated blocks as a seam: who runs them.
//!
//! Activation checkpointing, offload and a memory planner act per transformer block, and must
//! not need the model's code edited to do so. So the models with a stack of blocks (ViT's
//! [`Encoder`](crate::Encoder), GPT-2's [`Gpt2Model`](crate::Gpt2Model)) run each block through
//! an optional [`BlockRunner`]: without one, a block is called directly; with one, the runner gets
//! the block's index and its forward as a [`BlockForward`] it may call now and again later (a
//! checkpoint calls it again in backward). A ViT hands over its embedding with the first block
//! (block 0 takes the images), so that a runner that keeps block 0's input keeps the images the
//! patch embedding needs anyway rather than a sequence activation. The runner lives in the
//! technique's crate; this module only says how a block is handed over, and knows nothing about
//! what a runner does.

use std::sync::Arc;

use headroom_autograd_core::Tensor;

use crate::error::Result;

/// One block's forward, owned (it holds its own handles on the block's parameters), so a runner
/// can keep it and call it again.
pub type BlockForward = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// Runs the blocks of a model: `run(index, block, input)` returns what `block(input)` returns,
/// computed however the runner sees fit.
pub trait BlockRunner: Send + Sync + std::fmt::Debug {
    /// The output of block `index` (from 0, in forward order) on `input`.
    fn run(&self, index: usize, block: BlockForward, input: &Tensor) -> Result<Tensor>;
}

/// Calls `block` on `input` through `runner` when there is one, else directly.
pub(crate) fn run_block<B>(
    runner: Option<&Arc<dyn BlockRunner>>,
    index: usize,
    block: &B,
    forward: fn(&B, &Tensor) -> Result<Tensor>,
    input: &Tensor,
) -> Result<Tensor>
where
    B: Clone + Send + Sync + 'static,
{
    match runner {
        None => forward(block, input),
        Some(runner) => {
            let owned = block.clone();
            runner.run(index, Arc::new(move |x| forward(&owned, x)), input)
        }
    }
}
