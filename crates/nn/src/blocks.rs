//! A model's repeated blocks as a seam: who runs them.
//!
//! Activation checkpointing, offload and a memory planner act per transformer block, and must
//! not need the model's code edited to do so. So the models with a stack of blocks (ViT's
//! [`Encoder`](crate::Encoder), GPT-2's [`Gpt2Model`](crate::Gpt2Model), and the models around
//! them) are each a [`BlockStack`]: the one way to attach a runner, the same on every model, so
//! code that attaches a technique takes any model with blocks. Each block runs through the
//! optional [`BlockRunner`]: without one, a block is called directly; with one, the runner gets
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

/// A model with a stack of blocks that a [`BlockRunner`] can take over: the one way to attach a
/// technique (checkpointing, offload, a planner's plan) to ViT, GPT-2 or any other model with
/// blocks, so code that attaches one is generic over the model.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use headroom_autograd_core::{DType, Generator, Tensor};
/// use headroom_nn::{
///     BlockForward, BlockRunner, BlockStack, Gpt2Config, Gpt2LMHeadModel, VisionTransformer,
///     VitConfig,
/// };
///
/// /// Runs each block directly and notes its index.
/// #[derive(Debug, Default)]
/// struct Trace(Mutex<Vec<usize>>);
///
/// impl BlockRunner for Trace {
///     fn run(
///         &self,
///         index: usize,
///         block: BlockForward,
///         input: &Tensor,
///     ) -> headroom_nn::Result<Tensor> {
///         self.0.lock().unwrap().push(index);
///         block(input)
///     }
/// }
///
/// /// Attaches one runner to any model with blocks.
/// fn trace_blocks(model: &mut impl BlockStack) -> Arc<Trace> {
///     let trace = Arc::new(Trace::default());
///     model.set_block_runner(Some(Arc::clone(&trace) as Arc<dyn BlockRunner>));
///     trace
/// }
///
/// let cpu = headroom_ops_cpu::CpuBackend::new_ref();
/// let generator = Arc::new(Generator::new(0));
/// let mut vit = VisionTransformer::new(&cpu, VitConfig::tiny(), DType::F32, &generator)?;
/// let mut gpt2 = Gpt2LMHeadModel::new(&cpu, Gpt2Config::tiny(), DType::F32, &generator)?;
///
/// let vit_trace = trace_blocks(&mut vit);
/// vit.forward(&Tensor::ones(&cpu, &[1, 3, 32, 32], DType::F32)?)?;
/// let expected: Vec<usize> = (0..vit.n_blocks()).collect();
/// assert_eq!(*vit_trace.0.lock().unwrap(), expected);
///
/// let gpt2_trace = trace_blocks(&mut gpt2);
/// gpt2.forward(&Tensor::from_slice(&cpu, &[1i64, 2, 3], &[1, 3])?)?;
/// let expected: Vec<usize> = (0..gpt2.n_blocks()).collect();
/// assert_eq!(*gpt2_trace.0.lock().unwrap(), expected);
///
/// gpt2.set_block_runner(None);
/// assert!(gpt2.block_runner().is_none());
/// # Ok::<(), headroom_nn::NnError>(())
/// ```
///
/// headroom-checkpoint's `CheckpointBlocks` shows the same generic function attaching
/// activation checkpointing to both models.
pub trait BlockStack {
    /// How many blocks a runner is handed per forward, indexed from 0 in forward order.
    fn n_blocks(&self) -> usize;

    /// Who runs the blocks; `None` when they are called directly.
    fn block_runner(&self) -> Option<&Arc<dyn BlockRunner>>;

    /// Sets who runs the blocks from the next forward on; `None` calls them directly again. The
    /// same call on every model with blocks (the trait's example attaches one runner to a ViT
    /// and a GPT-2 through one generic function).
    fn set_block_runner(&mut self, runner: Option<Arc<dyn BlockRunner>>);
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

/// Implements [`BlockStack`] for a model: `blocks: field` over its own blocks (the `Vec` field
/// named, the runner in its `block_runner` field), `through: field` by delegating to the inner
/// stack in the field named (a model around an encoder or decoder).
macro_rules! impl_block_stack {
    ($model:ty, blocks: $blocks:ident) => {
        impl $crate::blocks::BlockStack for $model {
            fn n_blocks(&self) -> usize {
                self.$blocks.len()
            }

            fn block_runner(&self) -> Option<&std::sync::Arc<dyn $crate::blocks::BlockRunner>> {
                self.block_runner.as_ref()
            }

            fn set_block_runner(
                &mut self,
                runner: Option<std::sync::Arc<dyn $crate::blocks::BlockRunner>>,
            ) {
                self.block_runner = runner;
            }
        }
    };
    ($model:ty, through: $inner:ident) => {
        impl $crate::blocks::BlockStack for $model {
            fn n_blocks(&self) -> usize {
                $crate::blocks::BlockStack::n_blocks(&self.$inner)
            }

            fn block_runner(&self) -> Option<&std::sync::Arc<dyn $crate::blocks::BlockRunner>> {
                $crate::blocks::BlockStack::block_runner(&self.$inner)
            }

            fn set_block_runner(
                &mut self,
                runner: Option<std::sync::Arc<dyn $crate::blocks::BlockRunner>>,
            ) {
                $crate::blocks::BlockStack::set_block_runner(&mut self.$inner, runner);
            }
        }
    };
}
pub(crate) use impl_block_stack;
